"""Timing on a device, a failure's one-line status, the profiler's tables and the printed
ones: what every benchmark here shares.

torch only, no import of the library: the GPU proof's "before" measures the base commit's
tree in a process where this checkout's `transformer` must not be imported
(benchmarks/gpu_report/tree.py), and times it with these.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable

import torch

# MFU's reference (issue #11's): about what a large bf16 product reaches on one H100 SXM
# (an 8192^3 product: ~790-800 TFLOP/s). The data sheet's dense bf16 peak is 989, against
# which every MFU here would read 0.8x as high.
PEAK_TFLOPS = 790.0
TOP = 12  # rows of profiled()'s op and kernel tables


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def timed(fn: Callable[[], object], device: torch.device, reps: int = 1) -> float:
    """Seconds per call of `fn`, the device's queue drained before and after."""
    sync(device)
    start = time.perf_counter()
    for _ in range(reps):
        fn()
    sync(device)
    return (time.perf_counter() - start) / reps


def print_columns(head: list[str], rows: list[list[str]], right: bool = False) -> None:
    """A table on stdout: the columns as wide as their widest cell, two spaces apart."""
    widths = [max(len(row[i]) for row in [head, *rows]) for i in range(len(head))]
    for row in [head, *rows]:
        cells = zip(row, widths, strict=True)
        print("  ".join(cell.rjust(w) if right else cell.ljust(w) for cell, w in cells))


def failure(err: Exception, batch: tuple | None = None) -> str:
    """A row's status for work that raised `err` (at `batch`, if in a training step)."""
    if isinstance(err, torch.cuda.OutOfMemoryError) and batch is not None:
        return f"failed: out of memory at {batch[0].numel()} padded source tokens"
    return f"failed: {type(err).__name__}: {first_line(err)}"


def first_line(err: BaseException) -> str:
    return str(err).strip().splitlines()[0] if str(err).strip() else ""


def profiled(device: torch.device, warm: Callable, work: Callable, per: str, context=None):
    """The summary, the top ops and the top CUDA kernels of `work()`, after `warm()`, both
    under `context` (the attention kernels of the tree measured): where the time goes."""
    from torch.profiler import ProfilerActivity, profile

    cuda = device.type == "cuda"
    activities = [ProfilerActivity.CPU, *([ProfilerActivity.CUDA] if cuda else [])]
    with context or contextlib.nullcontext():
        warm()
        sync(device)
        with profile(activities=activities) as prof:
            start = time.perf_counter()
            work()
            sync(device)
            wall = time.perf_counter() - start
    events = prof.key_averages()
    on_device = lambda e: str(e.device_type).endswith("CUDA")
    kernels = [e for e in events if on_device(e)]
    ops = [e for e in events if not on_device(e)]
    # Off CUDA an op's own CPU time stands for the device time it would have launched.
    own = (lambda e: e.self_device_time_total) if cuda else (lambda e: e.self_cpu_time_total)
    busy = sum(own(e) for e in kernels) / 1e3  # ms
    total = sum(own(e) for e in (kernels if cuda else ops)) or 1.0
    summary = {
        "device": device.type,
        "per": per,
        "wall ms": wall * 1e3,
        "GPU busy ms": busy if cuda else None,
        "GPU busy": busy / 1e3 / wall if cuda else None,
        "kernels": sum(e.count for e in kernels) if cuda else None,
        "aten ops": sum(e.count for e in ops if e.key.startswith("aten::")),
    }
    row = lambda e, col: {
        col: e.key[:90],
        "calls": e.count,
        "ms": own(e) / 1e3,
        "share": f"{own(e) / total:.1%}",
    }
    rows = lambda found, col: [
        row(e, col) for e in sorted(found, key=own, reverse=True)[:TOP] if own(e) > 0
    ]
    return summary, rows(ops, "op"), rows(kernels, "kernel") if cuda else []
