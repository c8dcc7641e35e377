"""The GPU report: what this project does on a GPU machine, measured in one run beside its
targets, written to one folder as report.md and report.json.

    python benchmarks/gpu_report.py [--out DIR] [--device cuda|cpu] [--tiny] [--budget S]

The folder defaults to benchmarks/results/<YYYY-MM-DD>-<device name>/ and is printed at the
end. On one H100 the run is meant to take under 9 minutes: a section that would start
after --budget seconds is skipped, saying so. `--device cpu --tiny` runs every section's
code on toy sizes in under a minute; tests/test_gpu_report.py runs it, so the report cannot
rot. Nothing is installed: it runs on the torch it finds (an NGC container's, say).

Sections, in the order they run:
- environment: versions, the device, and for each kind of attention call model.py makes
  the SDPA backend that runs it (transformer/attention.py's choice, and torch's default)
  with every backend's time at representative shapes and over a sweep of new shapes: the
  measurement behind attention.CUDA_BACKENDS, where a backend is admitted only if it is
  also right (its outputs and gradients beside the math backend's);
- gpu tests: `pytest -m gpu` in a subprocess;
- train step: target tokens/s, TFLOP/s and MFU of a training step of base and big in
  bf16 at two micro-batch sizes, beside torch.nn.Transformer and MarianMTModel of the same
  dimensions (benchmarks/model_step.py), and of the smoke model on the CPU;
- train loop: transformer.train's own loop with data loading on synthetic shards
  (benchmarks/train_throughput.py);
- decode: beam-4 sentences/s of base and big (and the smoke model on the CPU) beside
  CTranslate2 and Hugging Face's MarianMTModel.generate on the same weights
  (benchmarks/decode.py's functions; CTranslate2's wheels need CUDA 12's cuBLAS);
- bf16 vs fp32: the loss curves of both precisions overfitting one batch;
- checkpoint: seconds to save a training state of big and a model snapshot;
then the project's targets, pass or fail. A section degrades to "skipped: <why>" when a
package or a device feature is missing, a peer's row likewise, and a section that fails
says so without stopping the others.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import datetime
import functools
import gc
import importlib.util
import json
import os
import platform
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
import traceback
import warnings
import xml.etree.ElementTree as ET
from collections import Counter
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from unittest import mock

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path[:0] = [str(ROOT), str(HERE)]  # the library, and the benchmarks beside this one

import decode as decode_bench  # noqa: E402
import model_step  # noqa: E402
import train_throughput  # noqa: E402

from transformer import attention, search  # noqa: E402
from transformer.checkpoint import CheckpointManager  # noqa: E402
from transformer.config import Params, load_params, to_dict  # noqa: E402
from transformer.model import Transformer  # noqa: E402
from transformer.optim import build_optimizer  # noqa: E402
from transformer.vocab import PAD  # noqa: E402

PEAK_TFLOPS = model_step.PEAK_TFLOPS
AGREE = 0.05  # bf16 and fp32 losses "agree" within this relative difference at every step
TINY = [
    "model.n_layers=1",
    "model.d_model=32",
    "model.d_ff=64",
    "model.n_heads=2",
    "vocab.size=64",
    "train.batch_tokens=256",
    "train.max_tokens=256",
]
CONFIGS = {  # name: (params file, overrides)
    "base": ("params/base.yaml", []),
    "big": ("params/big.yaml", []),
    # the same params under torch.compile (dynamic shapes): measured beside them, the
    # params' default left to what the numbers say
    "base compile": ("params/base.yaml", ["train.compile=true"]),
    "big compile": ("params/big.yaml", ["train.compile=true"]),
    "smoke": ("params/smoke.yaml", []),
    "tiny": ("params/smoke.yaml", TINY),
}


def config(name: str, *extra: str) -> Params:
    path, overrides = CONFIGS[name]
    return load_params(ROOT / path, [*overrides, *extra])


# --------------------------------------------------------------------------- plans


@dataclass(frozen=True)
class Shapes:
    """The environment section's attention calls: h heads of d_k; training calls at the
    (rows, length) shapes of `train`, then once each at the new shapes of `sweep`; beam
    search over `sentences` x 4 hypotheses for `steps` steps, a new key length each."""

    heads: int
    d_k: int
    train: tuple[tuple[int, int], ...]
    sweep: tuple[tuple[int, int], ...]
    sentences: int
    steps: int
    reps: int  # timed calls at each representative shape


@dataclass(frozen=True)
class Plan:
    """What each section measures. A device "main" is --device's; "cpu" is the CPU's."""

    name: str
    step_cases: tuple[tuple[str, int, str], ...]  # train step: (config, max_tokens, device)
    timed_steps: int
    warmup_steps: int
    loop_cases: tuple[tuple[str, int], ...]  # train loop: (config, steps)
    compile_cases: tuple[tuple[str, int], ...]  # the same under torch.compile, last
    profile_cases: tuple[tuple[str, str, int], ...]  # ("train", config, max_tokens) or
    # ("beam", config, sentences)
    loop_pairs: int  # the synthetic corpus
    loop_max_len: int
    decode_cases: tuple[tuple[str, str, int], ...]  # (config, device, sentences)
    default_sentences: int  # beam search under torch's default kernels (CUDA only)
    overfit: tuple[str, int, int]  # bf16 vs fp32: (config, max_tokens, steps)
    checkpoint: str
    cpu_config: str  # the model of the CPU targets
    shapes: Shapes
    tests: str  # what `pytest -m gpu` collects


WMT_SWEEP = tuple((32768 // n, n) for n in range(40, 104, 8))  # 32k-token batches
# Every test marked gpu lives here (tests/test_gpu_report.py checks it). The other modules
# import prefect and mlflow, which a GPU image lacks: collected, they would be errors.
GPU_TESTS = "tests/test_gpu.py"
GPU = Plan(
    "gpu",
    step_cases=(
        ("base", 8192, "main"),
        ("base", 32768, "main"),
        ("big", 8192, "main"),
        ("big", 32768, "main"),
        ("smoke", 2048, "cpu"),
    ),
    timed_steps=20,
    warmup_steps=5,
    loop_cases=(("base", 300), ("big", 200)),
    compile_cases=(("base compile", 100), ("big compile", 80)),
    profile_cases=(("train", "base", 8192), ("train", "base", 32768), ("beam", "base", 500)),
    loop_pairs=100_000,
    loop_max_len=250,
    decode_cases=(("base", "main", 2000), ("big", "main", 1000), ("smoke", "cpu", 500)),
    default_sentences=128,
    overfit=("base", 4096, 100),
    checkpoint="big",
    cpu_config="smoke",
    shapes=Shapes(8, 64, ((1024, 32), (128, 256)), WMT_SWEEP, 256, 60, 20),
    tests=GPU_TESTS,
)
CPU = Plan(
    "cpu",
    step_cases=(("smoke", 1024, "main"), ("smoke", 2048, "main")),
    timed_steps=5,
    warmup_steps=1,
    loop_cases=(("smoke", 50),),
    compile_cases=(),
    profile_cases=(("train", "smoke", 2048), ("beam", "smoke", 100)),
    loop_pairs=5000,
    loop_max_len=100,
    decode_cases=(("smoke", "main", 200),),
    default_sentences=32,
    overfit=("smoke", 1024, 30),
    checkpoint="smoke",
    cpu_config="smoke",
    shapes=Shapes(
        4, 32, ((64, 32), (16, 128)), ((48, 40), (40, 48), (32, 56), (28, 64)), 32, 20, 3
    ),
    tests=GPU_TESTS,
)
TINY_PLAN = Plan(
    "tiny",
    step_cases=(("tiny", 128, "main"), ("tiny", 256, "main")),
    timed_steps=2,
    warmup_steps=1,
    loop_cases=(("tiny", 8),),
    compile_cases=(),
    profile_cases=(("train", "tiny", 256), ("beam", "tiny", 8)),
    loop_pairs=400,
    loop_max_len=20,
    decode_cases=(("tiny", "main", 12),),
    default_sentences=4,
    overfit=("tiny", 128, 5),
    checkpoint="tiny",
    cpu_config="tiny",
    shapes=Shapes(2, 16, ((8, 16),), ((6, 20), (5, 24)), 4, 4, 1),
    tests=GPU_TESTS,
)


@dataclass
class Run:
    device: torch.device
    plan: Plan
    work: Path  # temporary files, inside the report folder (its disk is the one measured)
    budget: float  # seconds after which no section starts
    threads: int  # CPU threads of subprocesses (0: torch's default)
    start: float = field(default_factory=time.monotonic)

    def on(self, where: str) -> torch.device:
        return self.device if where == "main" else torch.device(where)

    def left(self) -> float:
        return self.budget - (time.monotonic() - self.start)


@dataclass
class Result:
    tables: dict[str, list[dict]] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)


class Skipped(Exception):
    """A whole section cannot run here; the message says why."""


def peer(row: dict, measure: Callable[[], dict]) -> dict:
    """`row` with `measure()`'s figures, or with a `status` saying why there are none: a
    missing package, or a failure of this peer (the section goes on without it)."""
    try:
        return {**row, **measure()}
    except ImportError as err:
        return {**row, "status": f"skipped: {err.name or err} not installed"}
    except Skipped as why:
        return {**row, "status": f"skipped: {why}"}
    except Exception as err:  # a peer's failure is a finding, not the end of the section
        return {**row, "status": model_step.failure(err)}


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


# --------------------------------------------------------------------------- environment

ENCODER, CAUSAL, CROSS, BEAM = (
    "encoder self-attention",
    "decoder causal self-attention",
    "cross-attention",
    "beam-search step",
)
BACKENDS = (
    SDPBackend.FLASH_ATTENTION,
    SDPBackend.EFFICIENT_ATTENTION,
    SDPBackend.CUDNN_ATTENTION,
    SDPBackend.MATH,
)
# A backend's output and gradients may differ from the math backend's by this much, relative
# to the largest value: bf16 rounding gives ~1e-2; a wrong kernel far more, or NaN.
AGREES = 0.05


def environment(run: Run) -> Result:
    rows = attention_rows(run)
    versions = [{"item": k, "value": v} for k, v in versions_table(run.device).items()]
    notes = [attention.describe(run.device), *verdict(rows, run)]
    return Result({"versions": versions, "attention backends": rows}, notes)


def versions_table(device: torch.device) -> dict[str, str]:
    out = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "CUDA (torch built with)": str(torch.version.cuda),
        "cuDNN": str(torch.backends.cudnn.version()),
        "device": device_name(device),
        "host CPU": cpu_model(),  # beam search is host-bound: its speed follows the host's
        "CPU cores": str(len(os.sched_getaffinity(0))),
        "torch threads": str(torch.get_num_threads()),
        "commit": git_commit(),
    }
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        out["compute capability"] = f"sm{props.major}{props.minor}"
        out["GPU memory"] = f"{props.total_memory / 2**30:.1f} GiB"
    for package in ("ctranslate2", "transformers", "sentencepiece", "pytest"):
        out[package] = package_version(package)
    order = getattr(torch._C, "_get_sdp_priority_order", lambda: [])()  # private: may vanish
    out["torch's SDPA priority"] = " > ".join(SDPBackend(i).name for i in order) or "unknown"
    for var in sorted(v for v in os.environ if v.startswith("TORCH_CUDNN_SDPA")):
        out[var] = os.environ[var]
    return out


def package_version(name: str) -> str:
    try:
        return version(name)
    except PackageNotFoundError:
        return "not installed"


def device_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else f"CPU {cpu_model()}"


def cpu_model() -> str:
    with contextlib.suppress(OSError):  # Linux names the CPU model here; others may not
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.machine()


def git_commit() -> str:
    git = lambda *args: subprocess.run(
        ["git", *args], cwd=ROOT, capture_output=True, text=True, timeout=10
    )
    try:
        head, dirty = git("rev-parse", "--short", "HEAD"), git("status", "--porcelain")
    except (OSError, subprocess.TimeoutExpired):
        return "unknown (no git)"
    if head.returncode != 0:
        return "unknown (not a git checkout)"
    changed = len(dirty.stdout.splitlines())
    return head.stdout.strip() + (f" + {changed} changed files" if changed else "")


def attention_rows(run: Run) -> list[dict]:
    """Per call kind and backend: whether ours / torch's default picks it, its time at the
    representative shapes, and over new shapes (first calls, then the same calls again)."""
    kinds = (ENCODER, CAUSAL, CROSS, BEAM)
    shapes = {kind: kind_shapes(kind, run.plan.shapes) for kind in kinds}
    # torch's default first: its priority order is set up at the first SDPA call, and a
    # set_priority context entered before that restores the order it found, not torch's.
    default = {k: chosen(k, shapes[k][0][0], run, contextlib.nullcontext()) for k in kinds}
    rows = []
    for kind in kinds:
        warm, sweep = shapes[kind]
        ours = chosen(kind, warm[0], run, attention.attention_context(run.device))
        for backend in BACKENDS:
            row = {
                "call": kind,
                "backend": attention.NAMES[backend],
                "ours": ours == backend,
                "torch default": default[kind] == backend,
            }
            rows.append({**row, **backend_times(backend, kind, warm, sweep, run)})
    return rows


def kind_shapes(kind: str, s: Shapes) -> tuple[list, list]:
    """(representative shapes, new shapes) of a kind: (rows, length), or for beam search
    (sentences, cache slots), 4 slots more at each step."""
    if kind == BEAM:  # the representative shape is none of the sweep's: those stay new
        sweep = [(s.sentences, 4 * t) for t in range(1, s.steps + 1)]
        return [(s.sentences, 4 * (s.steps // 2) + 2)], sweep
    return list(s.train), list(s.sweep)


def sdpa_call(kind: str, shape: tuple[int, int], run: Run):
    """(a call of model.py's kind at `shape`, with backward for the training kinds; its
    SDPA arguments). q, k, v are views of one projection as MultiHeadAttention's are."""
    s, dev = run.plan.shapes, run.device
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    (b, n), train = shape, kind != BEAM
    if kind == BEAM:  # 4 hypotheses a sentence, one new position each, n filled cache slots
        q = torch.randn(b, s.heads, 4, s.d_k, device=dev, dtype=dtype)
        kv = torch.randn(2, b, s.heads, n + 8, s.d_k, device=dev, dtype=dtype)[..., :n, :]
        seen = torch.rand(b, 1, 4, n, device=dev) < 0.7
        seen[..., -1] = True  # every hypothesis sees at least its own newest slot
        # The cache's kind of mask, additive, in the dtype autocast gives it.
        mask = torch.zeros(seen.shape, device=dev, dtype=dtype).masked_fill_(~seen, float("-inf"))
        args, leaves = (q, kv[0], kv[1], mask, False), []
    else:
        keys = n + n // 8 if kind == CROSS else n  # a source a little longer than the target
        x = torch.randn(b, n, 3, s.heads, s.d_k, device=dev, dtype=dtype, requires_grad=True)
        m = torch.randn(b, keys, 2, s.heads, s.d_k, device=dev, dtype=dtype, requires_grad=True)
        q, k, v = x.permute(2, 0, 3, 1, 4).unbind(0)  # (B, h, T, d_k) each
        if kind == CROSS:
            k, v = m.permute(2, 0, 3, 1, 4).unbind(0)
        lengths = torch.randint(keys // 2, keys + 1, (b,), device=dev)
        mask = (torch.arange(keys, device=dev) < lengths[:, None])[:, None, None, :]
        args = (q, k, v, None, True) if kind == CAUSAL else (q, k, v, mask, False)
        leaves = [x, m]

    def call() -> None:
        y = F.scaled_dot_product_attention(*args[:3], attn_mask=args[3], is_causal=args[4])
        if train:
            y.backward(torch.ones_like(y))
            for leaf in leaves:
                leaf.grad = None

    return call, args


def chosen(kind: str, shape, run: Run, context) -> SDPBackend | None:
    """The backend SDPA selects for this call under `context` (torch's own selector)."""
    _, (q, k, v, mask, causal) = sdpa_call(kind, shape, run)
    try:
        with context:
            return SDPBackend(torch._fused_sdp_choice(q, k, v, mask, 0.0, causal))
    except (AttributeError, RuntimeError, TypeError, ValueError):  # a private op: may change
        return None


def backend_times(backend: SDPBackend, kind: str, warm: list, sweep: list, run: Run) -> dict:
    with sdpa_kernel([backend]), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch explains at length why a kernel does not fit
        try:
            ms = {}
            for shape in warm:
                call, _ = sdpa_call(kind, shape, run)
                call()  # the first call at a shape: plans, kernels loaded, memory
                ms["x".join(map(str, shape))] = 1000 * timed(call, run.device, run.plan.shapes.reps)
            calls = [sdpa_call(kind, shape, run)[0] for shape in sweep]
            cold = [timed(call, run.device) for call in calls]
            again = [timed(call, run.device) for call in calls]
            diff = disagreement(backend, kind, warm[0], run)
        except RuntimeError as err:
            return {"status": f"unsupported: {model_step.first_line(err)[:80]}"}
    return {
        "ms at shape": ms,
        "new shapes": len(sweep),
        "first calls ms": 1000 * sum(cold),
        "same again ms": 1000 * sum(again),
        "diff vs math": diff,
    }


def disagreement(backend: SDPBackend, kind: str, shape, run: Run) -> float:
    """The largest difference of `backend`'s output, and for the training kinds its
    gradients, from the math backend's on the same inputs, relative to the largest math
    value (inf for a NaN): a fast backend must also be right to be admitted."""
    _, (q, k, v, mask, causal) = sdpa_call(kind, shape, run)
    results = []
    for b in (backend, SDPBackend.MATH):
        with sdpa_kernel([b]), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal)
            grads = torch.autograd.grad(y, (q, k, v), torch.ones_like(y)) if y.requires_grad else ()
        results.append([y.detach().float(), *(g.float() for g in grads)])
    pairs = zip(*results, strict=True)
    diffs = torch.stack([(a - b).abs().max() / b.abs().max().clamp_min(1e-6) for a, b in pairs])
    return float("inf") if diffs.isnan().any() else diffs.max().item()


def verdict(rows: list[dict], run: Run) -> list[str]:
    """Whether cuDNN beats attention.py's choice at every call kind, new shapes counted."""
    if run.device.type != "cuda":
        return ["cuDNN attention does not run on a CPU: nothing to decide here"]
    lines, slower, kinds = [], [], (ENCODER, CAUSAL, CROSS, BEAM)
    for kind in kinds:
        ours = next((r for r in rows if r["call"] == kind and r["ours"]), None)
        cudnn = next(r for r in rows if r["call"] == kind and r["backend"] == "cuDNN")
        if ours is None or "first calls ms" not in cudnn or "first calls ms" not in ours:
            lines.append(f"{kind}: no comparison (cuDNN or ours did not run)")
            slower.append(kind)
            continue
        warm = lambda r: sum(r["ms at shape"].values())
        faster = warm(cudnn) < warm(ours) and cudnn["first calls ms"] < ours["first calls ms"]
        faster = faster and cudnn["diff vs math"] <= AGREES  # and right
        lines.append(
            f"{kind}: ours ({ours['backend']}) {warm(ours):.3g} ms warm, "
            f"{ours['first calls ms']:.4g} ms over {ours['new shapes']} new shapes; cuDNN "
            f"{warm(cudnn):.3g} ms, {cudnn['first calls ms']:.4g} ms, "
            f"{cudnn['diff vs math']:.2g} from math (at most {AGREES})"
        )
        slower += [] if faster else [kind]
    if slower:
        lines.append(
            f"keep attention.CUDA_BACKENDS: cuDNN is not measured faster and right at "
            f"{', '.join(slower)}"
        )
    else:
        lines.append(
            "cuDNN is faster at every call kind, new shapes counted: admit it first "
            "in attention.CUDA_BACKENDS, citing this report"
        )
    return lines


# --------------------------------------------------------------------------- training


def train_step(run: Run) -> Result:
    rows = []
    for name, max_tokens, where in run.plan.step_cases:
        rows += model_step.measure(
            name,
            config(name),
            run.on(where),
            max_tokens,
            run.plan.timed_steps,
            run.plan.warmup_steps,
        )
    notes = [
        *model_step.ratios(rows),
        f"{run.plan.timed_steps} timed steps after {run.plan.warmup_steps} untimed, Adam "
        "included; the same WMT-like synthetic batches and fused loss for all three; bf16 "
        "autocast on CUDA, fp32 on CPU; under transformer.attention's kernels "
        "(python benchmarks/model_step.py --configs base,big --max-tokens 8192,32768 "
        "--optimizer for the same measurement alone)",
        f"MFU against {PEAK_TFLOPS:.0f} TFLOP/s (what a large bf16 product reaches on one H100 "
        "SXM; its data sheet says 989); FLOPs: 6 x non-embedding params x real tokens + "
        "6 D V per target token + attention",
    ]
    return Result({"": rows}, notes)


def train_loop(run: Run) -> Result:
    rows = [  # a case that fails (big out of memory, a timeout) keeps the others' rows
        peer({"config": name}, lambda name=name, steps=steps: loop_case(run, name, steps))
        for name, steps in run.plan.loop_cases
    ]
    return Result({"": rows}, [loop_note(run)])


def compiled_loop(run: Run) -> Result:
    """The real loop under torch.compile, last: compilation time is unknown until measured,
    so it runs after the sections with known costs, each case with its share of the time
    left (a case that runs out says how far it got and how often it recompiled)."""
    cases = run.plan.compile_cases
    if not cases:
        raise Skipped("no compiled cases at these sizes (the compiler's time would be all of it)")
    rows = []
    for i, (name, steps) in enumerate(cases):
        share = max(60.0, run.left() / (len(cases) - i))
        measure = functools.partial(loop_case, run, name, steps, share)
        rows.append(peer({"config": name}, measure))
    note = (
        "the params' train.compile=true: torch.compile(dynamic=True) of the model; the first "
        "fifth of the steps (compilation included) left out, as in the train loop"
    )
    return Result({"": rows}, [note, loop_note(run)])


def loop_note(run: Run) -> str:
    return (
        f"python -m transformer.train <params> --data <shards> in a fresh process per "
        f"config, its own params (batch_tokens, max_tokens, precision), on {run.plan.loop_pairs:,} "
        f"synthetic pairs (random words, WMT-like lengths <= {run.plan.loop_max_len}, a word "
        "vocabulary of the params' size); the first fifth of the steps left out "
        "(benchmarks/train_throughput.py --corpus synthetic)"
    )


def loop_case(run: Run, name: str, steps: int, timeout: float | None = None) -> dict:
    path, overrides = CONFIGS[name]
    shards = train_throughput.synthetic_shards(
        run.work, config(name).vocab.size, run.plan.loop_pairs, run.plan.loop_max_len
    )
    r = train_throughput.measure(
        name,
        path,
        overrides,
        shards,
        steps,
        run.work,
        run.threads,
        cpu=run.device.type != "cuda",
        timeout=timeout or max(60.0, run.left()),  # a hung case must not eat the others' time
    )
    tflops = r["tokens_per_s"] * r["flops_per_token"] / 1e12
    return {
        "device": r["device"],
        "steps": steps,
        "tokens/update": r["tokens_per_update"],
        "step s": r["step_time"],
        "tgt tok/s": r["tokens_per_s"],
        "TFLOP/s": tflops,
        "MFU": tflops / PEAK_TFLOPS if run.device.type == "cuda" else None,
        "peak mem GiB": r["peak_mem_gb"],
    }


def precision(run: Run) -> Result:
    """Both precisions overfit one batch from the same initial weights, dropout off."""
    name, max_tokens, steps = run.plan.overfit
    params = config(name, "model.dropout=0.0")
    batch = model_step.wmt_like_batches(1, max_tokens, params.vocab.size, seed=2)[0]
    batch = tuple(x.to(run.device) for x in batch)
    curves = {p: overfit(params, batch, steps, p == "bf16", run.device) for p in ("fp32", "bf16")}
    diff = [abs(b - f) / f for f, b in zip(curves["fp32"], curves["bf16"], strict=True)]
    shown = sorted({0, *range(steps // 10 or 1, steps, steps // 10 or 1), steps - 1})
    rows = [
        {
            "step": i + 1,
            "fp32 loss": curves["fp32"][i],
            "bf16 loss": curves["bf16"][i],
            "relative difference": diff[i],
        }
        for i in shown
    ]
    agree = "agree" if max(diff) <= AGREE else "DISAGREE"
    return Result(
        {"": rows},
        [
            f"{agree}: the largest relative difference over {steps} steps is {max(diff):.2%} "
            f"(agreement: <= {AGREE:.0%} at every step)",
            f"config {name}, dropout 0, one batch of <= {max_tokens} padded tokens "
            f"({batch[3].numel()} targets), Adam lr 3e-4, label smoothing 0.1, the trainer's "
            "fused loss; bf16 autocast on " + run.device.type,
        ],
    )


def overfit(params: Params, batch, steps: int, bf16: bool, device: torch.device) -> list:
    net = model_step.build("ours", params, device, seed=1)
    adam = torch.optim.Adam(net.parameters(), lr=3e-4, betas=(0.9, 0.98), eps=1e-9)
    step = model_step.make_step(net, adam, bf16)
    with attention.attention_context(device):
        return [step(batch).item() / batch[3].numel() for _ in range(steps)]


PROFILED_STEPS, TOP = 3, 12  # profiled training steps (after as many untimed); rows shown


def profile(run: Run) -> Result:
    """Where ours spends its time, by torch.profiler, in a training step and in beam search:
    per aten op (the device time of the kernels it launched itself; off CUDA its own CPU
    time), per CUDA kernel, how busy the GPU was and how many kernels it was sent: what to
    fix first where a rate is short of its target."""
    tables: dict[str, list[dict]] = {"summary": []}
    for kind, name, size in run.plan.profile_cases:
        work = (training_work if kind == "train" else beam_work)(run, name, size)
        summary, ops, kernels = profiled(run.device, *work)
        label = f"{kind} {name} {size}"
        tables["summary"].append({"work": label, **summary})
        tables[f"ops, {label}"] = ops
        if kernels:
            tables[f"kernels, {label}"] = kernels
    notes = [
        f"train <config> <max_tokens>: ours, {PROFILED_STEPS} training steps (Adam included) "
        f"after {PROFILED_STEPS} untimed, on the train step section's WMT-like batches",
        "beam <config> <sentences>: ours, beam 4 as the decode section runs it (the params' "
        "decode section, random weights, WMT-like sources) after a warm-up batch",
        "bf16 autocast on CUDA; the profiler's own cost is in the wall time; ms are in all "
        "(the summary's 'per' says over what); 'share' is of all the device time (CPU time "
        "off CUDA); op names are aten's, kernel names cut at 90 characters",
    ]
    return Result(tables, notes)


def training_work(run: Run, name: str, max_tokens: int) -> tuple[Callable, Callable, str]:
    """(warm up, the profiled work, what it is) for training steps of ours."""
    params, device, n = config(name), run.device, PROFILED_STEPS
    batches = model_step.wmt_like_batches(2 * n, max_tokens, params.vocab.size, seed=1)
    batches = [tuple(x.to(device) for x in b) for b in batches]
    net = model_step.build("ours", params, device, seed=1)
    adam = build_optimizer(net, params.train, params.model.d_model)[0]
    step = model_step.make_step(net, adam, bf16=device.type == "cuda")
    steps = lambda some: [step(b) for b in some]
    return lambda: steps(batches[:n]), lambda: steps(batches[n:]), f"{n} steps"


def beam_work(run: Run, name: str, sentences: int) -> tuple[Callable, Callable, str]:
    """(warm up, the profiled work, what it is) for beam search of ours."""
    params, dev = config(name), run.device.type
    torch.manual_seed(0)
    model = Transformer(params.model, params.vocab.size, pad_id=PAD).to(run.device).eval()
    sources = decode_sources(params, sentences, params.decode.max_tokens)
    go = lambda some: decode_bench.run(
        decode_bench.EndsWithSource(model), some, params.decode, "beam", dev
    )
    return lambda: go(sources[:16]), lambda: go(sources), f"{sentences} sentences"


def profiled(device: torch.device, warm: Callable, work: Callable, per: str):
    """The summary, the top ops and the top CUDA kernels of `work()`, after `warm()`."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as profiler

    cuda = device.type == "cuda"
    activities = [ProfilerActivity.CPU, *([ProfilerActivity.CUDA] if cuda else [])]
    with attention.attention_context(device):
        warm()
        sync(device)
        with profiler(activities=activities) as prof:
            start = time.perf_counter()
            work()
            sync(device)
            wall = time.perf_counter() - start
    events = prof.key_averages()
    on_device = lambda e: str(e.device_type).endswith("CUDA")
    kernels = [e for e in events if on_device(e)]
    ops = [e for e in events if not on_device(e)]
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


def checkpoint(run: Run) -> Result:
    """A training state (model, Adam's moments, schedule) and a model snapshot of the
    plan's model, written as the trainer writes them (atomic_save: write, fsync, rename)."""
    name = run.plan.checkpoint
    params = config(name)
    torch.manual_seed(1)
    model = Transformer(params.model, params.vocab.size, PAD).to(run.device)
    adam, schedule = build_optimizer(model, params.train, params.model.d_model)
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    adam.step()  # Adam's moments exist, as in any state after step 1
    manager = CheckpointManager(run.work / "checkpoints", 1, 0, higher_is_better=False)
    state = {
        "params": to_dict(params),
        "model": model.state_dict(),
        "optimizer": adam.state_dict(),
        "scheduler": schedule.state_dict(),
    }
    writes = {
        "training state": lambda: manager.save_state(1, state),
        "model snapshot": lambda: manager.snapshot(1, {}, model.state_dict(), None),
    }
    rows = []
    for what, write in writes.items():
        start = time.perf_counter()
        path = write()
        seconds = time.perf_counter() - start
        size = path.stat().st_size / 1e9
        rows.append(
            {"config": name, "file": what, "GB": size, "seconds": seconds, "GB/s": size / seconds}
        )
    n_params = sum(p.numel() for p in model.parameters())
    shutil.rmtree(run.work / "checkpoints")  # gigabytes, in the report folder
    return Result(
        {"": rows},
        [
            f"{n_params:,} parameters on {run.device.type}, written to {run.work} "
            "(inside the report folder: that disk) through transformer.checkpoint's "
            "CheckpointManager (torch.save, fsync, rename); the time includes the copy off the GPU",
        ],
    )


# --------------------------------------------------------------------------- decoding


def decode(run: Run) -> Result:
    rows, notes = [], []
    for name, where, n in run.plan.decode_cases:
        device = run.on(where)
        row = {"config": name, "device": device.type, "search": "beam 4, ours"}
        if run.left() <= 0:  # this section has no time of its own: the run's budget
            rows.append(
                {**row, "status": f"skipped: the time budget ({run.budget:.0f} s) is spent"}
            )
            continue
        try:
            case = decode_case(run, name, device, n)
        except Exception as err:  # big out of memory, say: the other configs' rows stay
            rows.append({**row, "status": model_step.failure(err)})
            continue
        rows += case
        ours, marian, ct2, wide = case[0], case[2], case[3], case[4]
        if "tok/s" in ours and "tok/s" in wide:
            notes.append(
                f"{name} on {ours['device']}: {WIDER}x wider batches / the params' = "
                f"{wide['tok/s'] / ours['tok/s']:.2f}x target tokens/s"
            )
        for peer_row, peer_name in ((ct2, "CTranslate2"), (marian, "MarianMTModel")):
            if "sent/s" in ours and "sent/s" in peer_row:
                notes.append(
                    f"{name} on {ours['device']}: ours / {peer_name} = "
                    f"{ours['sent/s'] / peer_row['sent/s']:.2f}x sentences/s"
                )
    notes += [
        "random weights, WMT-like random sources (lognormal lengths, mean ~27 subwords), "
        "each batch's sources evened to its longest and every output ending where its source "
        "does, for both decoders (benchmarks/decode.py; python benchmarks/decode.py --configs "
        "base,big --modes beam,ct2-beam measures the same alone); the params' decode section "
        "(beam 4, alpha 0.6, max length source + 50, decode.max_tokens per batch)",
        f"ours, <N>-token batches: the same search with decode.max_tokens {WIDER}x the "
        "params' (sources evened to the longest of these larger batches: longer outputs, so "
        "compare tok/s)",
        "torch default attention: the same search with no sdpa_kernel restriction, on the "
        "first sentences only and first calls included, as a translate run without "
        "transformer.attention would pay them",
        " ".join(decode_bench.DIFFERENCES.split()),
    ]
    return Result({"": rows}, notes)


def decode_case(run: Run, name: str, device: torch.device, n: int) -> list[dict]:
    params = config(name)
    vocab, cfg, dev = params.vocab.size, params.decode, device.type
    torch.manual_seed(0)
    model = Transformer(params.model, vocab, pad_id=PAD).to(device).eval()
    sources = decode_sources(params, n, cfg.max_tokens)
    searcher = decode_bench.EndsWithSource(model)
    go = lambda s, cfg=cfg: decode_bench.run(searcher, s, cfg, "beam", dev)
    # The same search in batches WIDER times as large: if a GPU's step costs the host the
    # same for 4x the sentences, these show it. Sources evened per larger batch, so longer
    # on average: compare tok/s.
    wide_cfg = cfg.model_copy(update={"max_tokens": WIDER * cfg.max_tokens})
    wide_sources = decode_sources(params, n, wide_cfg.max_tokens)
    row = {"config": name, "device": dev, "precision": "bf16" if dev == "cuda" else "fp32"}
    with attention.attention_context(device):
        ours = {**row, "search": "beam 4, ours", **rate(go, sources, warm_up=True)}
        wide = {
            **row,
            "search": f"beam 4, ours, {wide_cfg.max_tokens:,}-token batches",
            **rate(lambda s: go(s, wide_cfg), wide_sources),
        }
    default = {**row, "search": "beam 4, ours, torch default attention"}
    if dev == "cuda":
        first = sources[: run.plan.default_sentences]
        default = peer(default, lambda: unrestricted(lambda: rate(go, first)))
    else:
        default["status"] = "skipped: on CPU attention.py leaves torch's choice as it is"
    pieces = ["<pad>", "<unk>", "<s>", "</s>", *(f"w{i}" for i in range(4, vocab))]
    marian = peer(
        {**row, "search": "beam 4, MarianMTModel (transformers)"},
        lambda: marian_rate(model, sources, cfg, dev),
    )
    ct2 = peer(
        {**row, "search": "beam 4, CTranslate2"},
        lambda: ctranslate2_rate(model, sources, pieces, cfg, dev),
    )
    return [ours, default, marian, ct2, wide]


WIDER = 4  # the wide-batch row: decode.max_tokens times this


def decode_sources(params: Params, n: int, max_tokens: int) -> list[list[int]]:
    """n WMT-like random sources, each batch of `max_tokens` evened to its longest
    (benchmarks/decode.py says why)."""
    sources = decode_bench.wmt_like_sources(n, params.vocab.size, seed=0)
    return decode_bench.even_batches(sources, max_tokens, params.vocab.size, seed=1)


def rate(go: Callable, sources: list, warm_up: bool = False) -> dict:
    if warm_up:
        go(sources[:16])
    seconds, tokens, _ = go(sources)
    return {
        "sentences": len(sources),
        "seconds": seconds,
        "sent/s": len(sources) / seconds,
        "tok/s": tokens / seconds,
        "mean tgt len": tokens / len(sources),
    }


def ctranslate2_rate(model, sources, pieces, cfg, dev: str) -> dict:
    if dev == "cuda":
        needs_cublas12()
    translator = decode_bench.ctranslate2_translator(model, pieces, dev)
    go = lambda s: decode_bench.run_ctranslate2(translator, s, pieces, cfg, "ct2-beam", True)
    return rate(go, sources, warm_up=True)


def marian_rate(model, sources, cfg, dev: str) -> dict:
    marian = decode_bench.marian_generator(model, cfg, dev)
    go = lambda s: decode_bench.run_marian(marian, s, cfg, True, dev)
    return rate(go, sources, warm_up=True)


def needs_cublas12() -> None:
    """CTranslate2's PyPI wheels (4.x) are built for CUDA 12 and load libcublas.so.12 at
    their first product; beside a torch built for CUDA 13 it is usually absent."""
    try:
        ctypes.CDLL("libcublas.so.12")
    except OSError:
        version = package_version("ctranslate2")
        raise Skipped(
            f"CTranslate2 {version}'s CUDA build loads libcublas.so.12 (CUDA 12), absent "
            f"here (torch is built for CUDA {torch.version.cuda})"
        ) from None


def unrestricted(fn: Callable[[], dict]) -> dict:
    """fn() with search.py's sdpa_kernel restriction lifted: torch's own backend order."""
    with mock.patch.object(search, "attention_context", lambda device: contextlib.nullcontext()):
        return fn()


# --------------------------------------------------------------------------- tests


GPU_TESTS_S = 180.0  # at most, of the run's 480 s


def gpu_tests(run: Run) -> Result:
    if importlib.util.find_spec("pytest") is None:
        raise Skipped("pytest is not installed")
    xml = run.work / "gpu-tests.xml"
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    if run.device.type != "cuda":  # the report's device only
        env["CUDA_VISIBLE_DEVICES"] = ""
    cmd = [sys.executable, "-m", "pytest", "-m", "gpu", "-q", "-p", "no:cacheprovider"]
    # A test module that cannot be imported here is counted as an error, not the end.
    cmd += ["--continue-on-collection-errors", f"--junitxml={xml}", run.plan.tests]
    timeout = max(60.0, min(GPU_TESTS_S, run.left()))  # a hung test leaves the rest time
    try:
        done = subprocess.run(
            cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout
        )
    except subprocess.TimeoutExpired:
        raise RuntimeError(f"pytest did not finish in {timeout:.0f} s") from None
    if done.returncode in (2, 3, 4):  # interrupted, internal error, usage error: no results
        raise RuntimeError(f"pytest exit code {done.returncode}: {done.stdout[-500:]}")
    cases = junit_cases(xml) if xml.is_file() else []
    counts = Counter(c["outcome"] for c in cases)
    summary = {k: counts.get(k, 0) for k in ("passed", "failed", "error", "skipped")}
    notes = [f"{shlex.join(['python', *cmd[1:-2], run.plan.tests])}: exit code {done.returncode}"]
    if done.returncode == 1:  # some test failed, or some module could not be collected
        notes.append("output tail: " + (done.stdout + done.stderr)[-1500:])
    return Result({"counts": [summary], "tests": cases}, notes)


def junit_cases(xml: Path) -> list[dict]:
    cases = []
    for case in ET.parse(xml).iter("testcase"):
        outcome, message = "passed", ""
        for tag in ("failure", "error", "skipped"):
            found = case.find(tag)
            if found is not None:
                outcome = "failed" if tag == "failure" else tag
                message = (found.get("message") or "").strip().split("\n")[0][:200]
                break
        name = f"{case.get('classname', '')}::{case.get('name', '')}"
        cases.append({"test": name, "outcome": outcome, "message": message})
    return cases


# --------------------------------------------------------------------------- targets


def targets(run: Run, sections: dict) -> list[dict]:
    """The project's targets beside what this run measured."""
    gpu_why = gpu_judgement(run)
    cpu_why = "--tiny sizes" if run.plan is TINY_PLAN else None
    loop = lambda cfg: find(sections, "train loop", config=cfg)
    beam = lambda cfg, dev, search: find(sections, "decode", config=cfg, device=dev, search=search)
    base_beam = beam("base", "cuda", "beam 4, ours")
    cpu = run.plan.cpu_config
    ours_cpu, ct2_cpu = beam(cpu, "cpu", "beam 4, ours"), beam(cpu, "cpu", "beam 4, CTranslate2")
    step = cpu_step_rows(sections, cpu)
    return [
        target(
            "base training, target tokens/s (one H100, the real loop)",
            get(loop("base"), "tgt tok/s"),
            550_000,
            gpu_why,
        ),
        target(
            "big training, target tokens/s (one H100, the real loop)",
            get(loop("big"), "tgt tok/s"),
            250_000,
            gpu_why,
        ),
        target(
            "beam-4 base, sentences/s (one H100, WMT-like lengths)",
            get(base_beam, "sent/s"),
            1500,
            gpu_why,
        ),
        target(
            f"CPU beam 4: ours / CTranslate2 sentences/s ({cpu} model)",
            ratio(ours_cpu, ct2_cpu, "sent/s"),
            0.8,
            cpu_why,
        ),
        target(
            f"CPU training step: ours / torch.nn.Transformer tokens/s ({cpu} model)",
            ratio(step.get("ours"), step.get("torch.nn.Transformer"), "tgt_tok/s"),
            1.2,
            cpu_why,
        ),
    ]


def gpu_judgement(run: Run) -> str | None:
    """Why the one-H100 targets are not judged in this run, or None."""
    if run.plan is TINY_PLAN:
        return "--tiny sizes"
    if run.device.type != "cuda":
        return "not on a GPU"
    name = torch.cuda.get_device_name(run.device)
    return None if "H100" in name else f"the targets are for one H100, this is {name}"


def cpu_step_rows(sections: dict, cfg: str) -> dict[str, dict]:
    """The CPU training-step rows of `cfg` at its largest micro-batch, by model."""
    rows = [
        r for r in table(sections, "train step") if r["config"] == cfg and r.get("device") == "cpu"
    ]
    largest = max((r["max_tok"] for r in rows), default=None)
    return {r["model"]: r for r in rows if r["max_tok"] == largest}


def table(sections: dict, title: str) -> list[dict]:
    return sections.get(title, {}).get("tables", {}).get("", [])


def find(sections: dict, title: str, **match) -> dict | None:
    return next(
        (r for r in table(sections, title) if all(r.get(k) == v for k, v in match.items())), None
    )


def get(row: dict | None, key: str) -> float | None:
    return None if row is None else row.get(key)


def ratio(a: dict | None, b: dict | None, key: str) -> float | None:
    x, y = get(a, key), get(b, key)
    return None if x is None or y is None else x / y


def target(name: str, value: float | None, threshold: float, why_not: str | None) -> dict:
    if value is None:
        result = "not measured (see its section)"
    elif why_not:
        result = f"not judged: {why_not}"
    else:
        result = "pass" if value >= threshold else "FAIL"
    return {"target": name, "at least": threshold, "measured": value, "result": result}


# --------------------------------------------------------------------------- the run

SECTIONS = {  # the tests early: what the report's figures rest on gets its time first
    "environment": environment,
    "gpu tests": gpu_tests,
    "train step": train_step,
    "train loop": train_loop,
    "decode": decode,
    "bf16 vs fp32": precision,
    "checkpoint": checkpoint,
    "profile": profile,
    "train loop, compiled": compiled_loop,
}


def run_section(fn: Callable[[Run], Result], run: Run) -> dict:
    if run.left() <= 0:
        return {
            "status": f"skipped: the time budget (--budget {run.budget:.0f} s) is spent",
            "seconds": 0.0,
        }
    start, trace = time.perf_counter(), None
    try:
        result, status = fn(run), "ok"
    except Skipped as why:
        result, status = Result(), f"skipped: {why}"
    except Exception as err:  # the other sections still run: a 9-minute report is not lost
        result, status = Result(), model_step.failure(err)[:320]
        trace = traceback.format_exc()
    finally:
        gc.collect()
        with contextlib.suppress(Exception):  # after a sticky CUDA error it raises too: the
            torch.cuda.empty_cache()  # next sections then fail one by one, each saying so
    out = {"status": status, "seconds": time.perf_counter() - start, **asdict(result)}
    return {**out, "traceback": trace} if trace else out


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    device = torch.device(args.device)
    plan = TINY_PLAN if args.tiny else GPU if device.type == "cuda" else CPU
    if args.tiny:  # toy models gain nothing from threads, and spin-waits cost on a busy box
        torch.set_num_threads(1)
    out = args.out or default_folder(device, args.tiny)
    out.mkdir(parents=True, exist_ok=True)
    warnings.filterwarnings("ignore", module="torch.nn.modules.transformer")  # nested tensors
    started = datetime.datetime.now().astimezone()
    snapshot = lambda complete: {  # the report so far
        "command": shlex.join(["python", "benchmarks/gpu_report.py", *argv]),
        "started": started.isoformat(timespec="seconds"),
        "wall_s": time.monotonic() - run.start,
        "device": device_name(device),
        "plan": plan.name,
        "complete": complete,
        "targets": targets(run, sections),
        "sections": sections,
    }
    with tempfile.TemporaryDirectory(dir=out, prefix=".work-") as work:
        run = Run(device, plan, Path(work), args.budget, threads=1 if args.tiny else 0)
        sections = {}
        for title, fn in SECTIONS.items():
            if args.only and title not in args.only:
                continue
            sections[title] = run_section(fn, run)
            # Written after each section: a run stopped from outside (a time limit) still
            # leaves the sections it finished.
            write_report(out, snapshot(complete=False))
            print(
                f"{title}: {sections[title]['status']} ({sections[title]['seconds']:.1f} s)",
                flush=True,
            )
    report = snapshot(complete=True)
    write_report(out, report)
    for t in report["targets"]:
        print(
            f"target: {t['target']}: {cell('', t['measured'])} (at least {t['at least']:,}): "
            f"{t['result']}"
        )
    print(out)
    return 0


def write_report(out: Path, report: dict) -> None:
    """report.json and report.md, each replaced whole (never half-written)."""
    for name, text in (
        ("report.json", json.dumps(report, indent=2, default=str) + "\n"),
        ("report.md", markdown(report)),
    ):
        tmp = out / f".{name}.tmp"
        tmp.write_text(text)
        os.replace(tmp, out / name)


def parse_args(argv: list[str]) -> argparse.Namespace:
    cuda = torch.cuda.is_available()
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--out", type=Path, help="the report folder (default: benchmarks/results/<date>-<device>)"
    )
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda" if cuda else "cpu")
    p.add_argument("--tiny", action="store_true", help="toy sizes: the code paths, in a minute")
    p.add_argument(
        "--budget",
        type=float,
        default=480.0,
        help="seconds after which no section starts (default 480: for a run of under 9 minutes)",
    )
    p.add_argument(
        "--only",
        action="append",
        choices=list(SECTIONS),
        metavar="SECTION",
        help="run this section alone (repeatable; quote titles with spaces): one a short "
        "machine lease could not reach, with the whole budget. Default: all, in order",
    )
    args = p.parse_args(argv)
    if args.device == "cuda" and not cuda:
        p.error(
            f"--device cuda: no CUDA device (torch {torch.__version__}, built for CUDA "
            f"{torch.version.cuda})"
        )
    return args


def default_folder(device: torch.device, tiny: bool) -> Path:
    name = device_name(device) if device.type == "cuda" else "cpu"
    slug = re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")
    name = f"{datetime.date.today().isoformat()}-{slug}{'-tiny' if tiny else ''}"
    return HERE / "results" / name


# --------------------------------------------------------------------------- markdown


def markdown(report: dict) -> str:
    lines = [
        f"# GPU report: {report['device']}",
        "",
        f"`{report['command']}`, started {report['started']}, {report['wall_s']:.0f} s in "
        f"all ({report['plan']} sizes)."
        + ("" if report["complete"] else " Unfinished: the sections below are those it ran."),
        "",
        "## Targets",
        "",
        *md_table(report["targets"]),
    ]
    for title, section in report["sections"].items():
        lines += ["", f"## {title}", "", f"{section['status']} ({section['seconds']:.1f} s)"]
        for name, rows in section.get("tables", {}).items():
            lines += ["", *([f"**{name}**", ""] if name else []), *md_table(rows)]
        if section.get("notes"):
            lines += ["", *(f"- {note}" for note in section["notes"])]
        if section.get("traceback"):
            lines += ["", "```text", section["traceback"].rstrip(), "```"]
    return "\n".join(lines) + "\n"


def md_table(rows: list[dict]) -> list[str]:
    if not rows:
        return ["(no rows)"]
    cols = list(dict.fromkeys(k for r in rows for k in r if k != "status"))
    cols += ["status"] if any("status" in r for r in rows) else []
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for r in rows:
        lines.append("| " + " | ".join(cell(c, r.get(c)) for c in cols) + " |")
    return lines


def cell(col: str, v) -> str:
    if v is None:
        return "-"
    if isinstance(v, bool):
        return "yes" if v else ""
    if isinstance(v, int):
        return f"{v:,}"
    if isinstance(v, float):
        if "MFU" in col or "difference" in col:
            return f"{v:.2%}" if "difference" in col else f"{v:.1%}"
        return f"{v:,.0f}" if abs(v) >= 1000 else f"{v:.3g}"
    if isinstance(v, dict):
        return "; ".join(f"{k}: {cell(col, x)}" for k, x in v.items())
    return str(v).replace("|", "\\|").replace("\n", " ")


if __name__ == "__main__":
    sys.exit(main())
