"""The train stage: the library's trainer in a subprocess (under torchrun for several
processes), its output streamed to the run's log, its metrics in MLflow; and the cooldowns
stage, the further cooldowns branched from the run that `average.cooldowns` asks for.

The same run folder serves every params that differ only in operational keys: the trainer
resumes from its newest state by itself, so a raised `train.max_steps` or `patience`
continues the run, and a killed run loses at most `train.save_every` steps.
"""

from __future__ import annotations

import collections
import contextlib
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path

import torch
from mlflow.system_metrics.system_metrics_monitor import SystemMetricsMonitor
from prefect import get_run_logger
from prefect.exceptions import TerminationSignal

from transformer.files import TRAIN_LOG
from transformer.training.checkpoint import checkpoint_path, describe_run
from transformer.training.optim import cooldown_start

# Keys that say where training ends: a finished record that asked for other values is
# extended (or, if already past them, confirmed) by running the trainer again.
STOP_KEYS = ("max_steps", "patience", "best_metric", "valid_every", "valid_bleu", "valid_beam")


class TrainingFailed(RuntimeError):
    """The trainer exited with an error: a bug, or (exit 2) a user error in one line."""

    def __init__(self, message: str, user_error: bool):
        super().__init__(message)
        self.user_error = user_error


def training_request(params) -> dict:
    return {key: getattr(params.train, key) for key in STOP_KEYS}


def trained(report: dict) -> dict:
    """What of a run folder's report the stages after it depend on: the step it reached and
    the snapshots it kept."""
    return {key: report[key] for key in ("step", "snapshots")}


def launch_training(r) -> dict:
    """Train (or resume) in `r.out` until the params' stopping point; return where it got.
    `r`: a tasks.stages.StageRun."""
    with system_metrics(r.tracking):
        launch(r.params_file, r.inputs["shards"], r.out, r.tracking, **limits(r.params))
    return {**describe_run(r.out), "request": training_request(r.params)}


def train_cooldowns(r) -> dict:
    """The further cooldowns `average.cooldowns` asks for, trained (or resumed) in
    `r.out/cooldown-<i>`: each a branch of the train stage's run from its state at the
    cooldown's start, with train.seed + i; metrics in the stage's own MLflow run. Returns
    where each got, by folder name."""
    train = r.params.train
    start = cooldown_start(train.max_steps, train.cooldown)
    state = checkpoint_path(r.inputs["train"], "state", start)
    if not state.is_file():  # a run trained before the state was kept, or extended after
        raise TrainingFailed(
            f"{state}: no training state at the cooldown's start (update {start}) to branch "
            "average.cooldowns from",
            user_error=True,
        )
    tracking = {**r.tracking, "run_id": r.tracking["stage_run_id"]}
    branches = cooldown_runs(r.out, r.params.average.cooldowns)
    with system_metrics(r.tracking):
        for i, out in enumerate(branches, 1):
            branch = ["--init-from", str(state), f"train.seed={train.seed + i}"]
            launch(r.params_file, r.inputs["shards"], out, tracking, **limits(r.params),
                   extra=branch)  # fmt: skip
    return {out.name: describe_run(out) for out in branches}


def cooldown_runs(folder: Path | None, cooldowns: int) -> list[Path]:
    """The run folders of the further cooldowns in the cooldowns stage's `folder`, in order
    (none without one: the params ask for no further cooldown)."""
    return [] if folder is None else [folder / f"cooldown-{i}" for i in range(1, cooldowns)]


@contextlib.contextmanager
def system_metrics(tracking: dict):
    monitor = SystemMetricsMonitor(
        tracking["stage_run_id"], sampling_interval=5, tracking_uri=tracking["uri"]
    )
    monitor.start()
    try:
        yield
    finally:
        monitor.finish()


def limits(params) -> dict:
    pipeline = params.pipeline
    return {
        "nproc": pipeline.nproc_per_node or torch.cuda.device_count() or 1,
        "timeout_s": pipeline.train_timeout_minutes * 60 or None,
    }


def command(
    params_file: Path, shards: Path, out: Path, nproc: int, extra: Sequence[str] = ()
) -> list[str]:
    """One process: plain python, no rendezvous, no port. Several: torchrun with its
    stores on the loopback interface only (tasks/torchrun.py). Either way the trainer
    saves and stops if this process dies. `extra`: the trainer's further arguments."""
    worker = ["-m", "tasks.train_worker", str(params_file), "--data", str(shards),
              "--out", str(out), "--no-timestamps", "--die-with-parent", *extra]  # fmt: skip
    if nproc == 1:
        return [sys.executable, *worker]
    return [sys.executable, "-m", "tasks.torchrun", "--nnodes", "1",
            "--nproc_per_node", str(nproc), "--rdzv-backend", "c10d",
            "--rdzv-endpoint", "127.0.0.1:0", "--local-addr", "127.0.0.1", *worker]  # fmt: skip


def launch(
    params_file: Path,
    shards: Path,
    out: Path,
    tracking: dict,
    nproc: int,
    timeout_s: float | None,
    extra: Sequence[str] = (),
) -> None:
    """Run the trainer to completion, following its log; raise with its tail on failure.

    The trainer writes straight into the run folder's train.log, not into a pipe to this
    process: if this process dies, the trainer still has somewhere to write while it saves
    (a pipe would break under it), and it stops on its own (--die-with-parent)."""
    log = get_run_logger()
    cmd = command(params_file, shards, out, nproc, extra)
    # The trainer finds the pipeline's MLflow run through the environment (rank 0 logs).
    env = dict(os.environ, MLFLOW_RUN_ID=tracking["run_id"], MLFLOW_TRACKING_URI=tracking["uri"],
               PYTHONUNBUFFERED="1")  # fmt: skip
    out.mkdir(parents=True, exist_ok=True)
    log.info("launching: %s", " ".join(cmd))
    tail: collections.deque[str] = collections.deque(maxlen=40)
    timed_out = threading.Event()
    # The trainer stays in our process group, so a signal to the group reaches it too.
    with open(out / TRAIN_LOG, "ab") as logfile, open(out / TRAIN_LOG, encoding="utf-8") as reader:
        reader.seek(logfile.tell())
        proc = subprocess.Popen(cmd, env=env, stdout=logfile, stderr=subprocess.STDOUT)
        # A timer, not a check per line: a hung rank prints nothing.
        watchdog = threading.Timer(timeout_s or 0, stop, args=(proc, timed_out))
        if timeout_s:
            watchdog.start()
        try:
            while True:
                line = reader.readline()
                if line:
                    tail.append(line.rstrip())
                    forward(log, line.rstrip())
                elif proc.poll() is not None:
                    break
                else:
                    time.sleep(0.2)
            code = proc.returncode
        except BaseException:  # the task itself was interrupted: leave no trainer behind
            stop(proc)
            raise
        finally:
            watchdog.cancel()
    if timed_out.is_set():
        raise TrainingFailed("training exceeded pipeline.train_timeout_minutes", user_error=True)
    if code - 128 in (signal.SIGINT, signal.SIGTERM):
        # The trainer was signalled, saved and stopped, and this process was not (a job
        # started with `&` by a script ignores SIGINT; a signal to the trainer alone): the
        # run stops here as it would had the signal come here too.
        raise KeyboardInterrupt if code - 128 == signal.SIGINT else TerminationSignal(code - 128)
    if code == 2:  # the trainer's one-line user error is its last line
        raise TrainingFailed(tail[-1] if tail else "training failed", user_error=True)
    if code != 0:
        last = "\n".join(tail)
        raise TrainingFailed(f"the trainer exited with {code}; last lines of "
                             f"{out / TRAIN_LOG}:\n{last}", user_error=code > 128)  # fmt: skip


def forward(log, line: str) -> None:
    """A trainer line at its own level, its level word dropped (Prefect prints one); the
    console's step lines and torchrun's lines as they are, at INFO."""
    level, _, message = line.partition(" ")
    if level in ("INFO", "WARNING", "ERROR") and message:
        log.log(getattr(logging, level), message)
    else:
        log.info(line)


def stop(proc: subprocess.Popen, timed_out: threading.Event | None = None) -> None:
    """SIGTERM the trainer (torchrun forwards it to each rank, which finishes its update and
    saves; one already signalled with the whole process group takes it as the same
    request), then SIGKILL if it has not exited within 25 s."""
    if proc.poll() is not None:
        return
    if timed_out is not None:
        timed_out.set()
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout=25)
    except subprocess.TimeoutExpired:
        proc.kill()
