"""The machine a report ran on: versions, the device, the host, the commit, the GPU's clocks
and power. The proof's environment section; the report's begins with it."""

from __future__ import annotations

import contextlib
import os
import platform
import shutil
import subprocess
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

import torch
from torch.nn.attention import SDPBackend

from benchmarks.gpu_report.plan import ROOT
from benchmarks.gpu_report.section import Ctx

SMI_FIELDS = (
    "name,driver_version,pstate,clocks.sm,clocks.max.sm,clocks.mem,clocks.max.mem,"
    "power.draw,power.limit,temperature.gpu"
)


def environment(ctx: Ctx) -> None:
    ctx.add("versions", *({"item": k, "value": v} for k, v in versions(ctx.device).items()))
    ctx.add("nvidia-smi", *nvidia_smi())


def versions(device: torch.device) -> dict[str, str]:
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
        out["SMs"] = str(props.multi_processor_count)
    for package in ("ctranslate2", "transformers", "sentencepiece", "pytest", "triton"):
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
    """The checkout's commit and how many files differ from it; where .git did not travel
    to the machine, the COMMIT file `make gpu-baseline` writes beside the checkout."""
    git = lambda *args: subprocess.run(
        ["git", *args], cwd=ROOT, capture_output=True, text=True, timeout=10
    )
    try:
        head, dirty = git("rev-parse", "--short", "HEAD"), git("status", "--porcelain")
    except (OSError, subprocess.TimeoutExpired):
        head = None
    if head is None or head.returncode != 0:
        written = ROOT / "COMMIT"
        if written.is_file():
            return f"{written.read_text().strip()} (COMMIT: no git here)"
        return "unknown (no git checkout)"
    changed = len(dirty.stdout.splitlines())
    return head.stdout.strip() + (f" + {changed} changed files" if changed else "")


def nvidia_smi() -> list[dict]:
    """One row per GPU: its clocks, power and limit, as nvidia-smi reads them now (the
    fields an earlier report read, where a driver refuses one of the others)."""
    if shutil.which("nvidia-smi") is None:
        return [{"status": "skipped: no nvidia-smi here"}]
    for fields in (SMI_FIELDS, "name,clocks.max.sm,power.limit"):
        cmd = ["nvidia-smi", f"--query-gpu={fields}", "--format=csv"]
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=30)
        if done.returncode == 0:
            head, *lines = [[c.strip() for c in ln.split(",")] for ln in done.stdout.splitlines()]
            return [dict(zip(head, line, strict=False)) for line in lines if line]
    return [{"status": f"failed: {(done.stdout + done.stderr).strip()[:200]}"}]
