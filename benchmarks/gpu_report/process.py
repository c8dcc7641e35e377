"""A section in a process of its own, killed with all it started at its time limit: the
proof's way (a phase that hangs or overruns costs its limit, not the run), and the way of
any section given --limit. Its rows reach the runner through a result file written at each
addition, so a killed section's record keeps what it had measured."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
import warnings
from pathlib import Path
from typing import NoReturn

import torch

from benchmarks.gpu_report.plan import ROOT, Plan, Section
from benchmarks.gpu_report.section import Ctx, execute

LOG_TAIL = 2000  # characters of a section's output kept where it did not finish


def run(section: Section, ctx: Ctx, plan: Plan, limit: float | None) -> dict:
    """The section's record: status, seconds, tables, notes, the tree and the limit, and
    where it did not finish, the end of its output. It has `limit` seconds, or what is left
    of the run's budget where that is less (None: no limit)."""
    timeout = None if limit is None else min(limit, ctx.deadline - time.time())
    if timeout is not None:
        ctx.deadline = time.time() + timeout
    name = section.title.replace(" ", "-").replace(",", "")
    ctx.result, log = ctx.work / f"{name}.json", ctx.work / f"{name}.log"
    job = ctx.work / f"{name}.job"
    job.write_text(json.dumps(job_of(ctx, plan, section)))
    # In the tree's root, whose transformer comes first on sys.path (tree.py says why); this
    # package through PYTHONPATH, before what was there (the wheels of `make gpu-proof`).
    path = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    env = dict(os.environ, PYTHONPATH=path, PYTHONUNBUFFERED="1")
    cmd = [sys.executable, "-m", "benchmarks.gpu_report", "--child", str(job)]
    rc, seconds = spawn(cmd, ctx.tree_root, env, log, timeout)
    found = json.loads(ctx.result.read_text()) if ctx.result.is_file() else {}
    record = {"status": found.get("status"), "seconds": seconds, "tree": ctx.tree_label}
    record.update(limit_s=limit, tables=found.get("tables", {}), notes=found.get("notes", []))
    if rc is None:
        record["status"] = f"killed: over its time limit of {timeout:.3g} s"
    elif rc != 0 or not found:
        record["status"] = f"failed: exit code {rc}" + ("" if found else ", no result written")
    if found.get("traceback"):
        record["traceback"] = found["traceback"]
    if rc != 0 or not found or found["status"] == "running":
        record["log tail"] = log.read_text(errors="replace")[-LOG_TAIL:]
    return record


def spawn(cmd: list[str], cwd: Path, env: dict, log: Path, timeout: float | None):
    """(exit code, or None if killed at `timeout`; seconds). The command and all it started
    (its own process group) are killed at the limit."""
    start = time.monotonic()
    with log.open("w") as out:
        # A process group of its own (not a session: the machine's end of a command ends it)
        proc = subprocess.Popen(
            cmd, cwd=cwd, env=env, stdout=out, stderr=subprocess.STDOUT, process_group=0
        )
        try:
            rc = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            rc = None
    return rc, time.monotonic() - start


def job_of(ctx: Ctx, plan: Plan, section: Section) -> dict:
    return {
        "plan": plan.name,
        "section": section.title,
        "device": str(ctx.device),
        "sizes": ctx.sizes.name,
        "work": str(ctx.work),
        "deadline": ctx.deadline,  # time.time()'s clock: the child can read it
        "tree": str(ctx.tree_root),
        "label": ctx.tree_label,
        "best": ctx.best,
        "result": str(ctx.result),
    }


def child(job_file: Path, plans: dict[str, Plan]) -> NoReturn:
    """One section, in this process: its result file says how far it got, at every row."""
    job = json.loads(job_file.read_text())
    plan = plans[job["plan"]]
    ctx = Ctx(
        torch.device(job["device"]),
        plan.sizes[job["sizes"]],
        Path(job["work"]),
        job["deadline"],
        Path(job["tree"]),
        job["label"],
        job["best"],
        Path(job["result"]),
    )
    quiet(ctx.tiny)
    execute(plan.section(job["section"]).function(), ctx)
    # Its result is saved: out now, without the interpreter's teardown, where a section
    # that finished could still hang past its limit (Inductor's compile workers, CUPTI).
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def quiet(tiny: bool) -> None:
    """The settings of a process that runs sections: toy models gain nothing from threads,
    and spin-waits cost on a busy machine; torch.nn.Transformer's warning that it cannot use
    nested tensors (the train step's peer) says nothing of what is measured."""
    if tiny:
        torch.set_num_threads(1)
    warnings.filterwarnings("ignore", module="torch.nn.modules.transformer")
