"""Start the trainer wherever the params say its ranks run, and follow it to its end.

`pipeline.launcher: local` runs it on this machine: plain python for one process, else
torchrun (`LocalRun`); `slurm` submits one job whose nodes each run a torchrun agent
(tasks/slurm.py). Both run the one command built here, both are followed by the one loop
here: rank 0's log (the run folder's train.log) streamed into the stage's log, the
trainer's end turned into the stage's result.
"""

from __future__ import annotations

import collections
import logging
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import torch
from prefect.exceptions import TerminationSignal


class TrainingFailed(RuntimeError):
    """The trainer exited with an error: a bug, or (exit 2) a user error in one line."""

    def __init__(self, message: str, user_error: bool):
        super().__init__(message)
        self.user_error = user_error


@dataclass(frozen=True)
class Layout:
    """nnodes x nproc ranks. The update is the params' whatever the layout: each rank takes
    batch_tokens / ranks, in update_freq micro-batches of at most max_tokens (paper 5.1)."""

    launcher: str
    nnodes: int
    nproc: int

    @property
    def ranks(self) -> int:
        return self.nnodes * self.nproc

    @classmethod
    def of(cls, pipeline) -> Layout:
        nproc = pipeline.nproc_per_node or torch.cuda.device_count() or 1
        return cls(pipeline.launcher, pipeline.nnodes, nproc)


class Run(Protocol):
    """A started trainer: `done()` polls it, `stop()` asks it to save and stop (and waits a
    while for that), `result(tail)` raises unless it trained to its end."""

    def done(self) -> bool: ...
    def stop(self) -> None: ...
    def result(self, tail: list[str]) -> None: ...


def worker(params_file: Path, shards: Path, out: Path, extra: Sequence[str] = ()) -> list[str]:
    """What every rank runs (after `python`); `extra`: the trainer's further arguments.
    The trainer saves and stops if its launcher dies."""
    return ["-m", "tasks.train_worker", str(params_file), "--data", str(shards),
            "--out", str(out), "--no-timestamps", "--die-with-parent", *extra]  # fmt: skip


def torchrun(layout: Layout, endpoint: str, local_addr: str, *rdzv: str) -> list[str]:
    """One node's torchrun agent (after `python`): c10d rendezvous at `endpoint`, its stores
    listening on `local_addr` only (tasks/torchrun.py); `rdzv`: further rendezvous options."""
    return ["-m", "tasks.torchrun", "--nnodes", str(layout.nnodes),
            "--nproc_per_node", str(layout.nproc), "--rdzv-backend", "c10d",
            "--rdzv-endpoint", endpoint, "--local-addr", local_addr, *rdzv]  # fmt: skip


def local_command(layout: Layout, work: list[str]) -> list[str]:
    """One process: plain python, no rendezvous, no port. Several: torchrun on the
    loopback interface, at a port the system picks."""
    if layout.ranks == 1:
        return [sys.executable, *work]
    return [sys.executable, *torchrun(layout, "127.0.0.1:0", "127.0.0.1"), *work]


def follow(run: Run, path: Path, start: int, log, timeout_s: float | None) -> None:
    """Stream `path` from `start` into `log` until `run` ends, then its result. Stops the
    run if this task is interrupted, or after `timeout_s`."""
    tail: collections.deque[str] = collections.deque(maxlen=40)
    timed_out = threading.Event()

    def expire() -> None:
        if not run.done():
            timed_out.set()
            run.stop()

    # A timer, not a check per line: a hung rank prints nothing.
    watchdog = threading.Timer(timeout_s or 0, expire)
    with open(path, encoding="utf-8") as reader:
        reader.seek(start)
        if timeout_s:
            watchdog.start()
        try:
            while True:
                line = reader.readline()
                if line:
                    tail.append(line.rstrip())
                    forward(log, line.rstrip())
                elif run.done():
                    break
                else:
                    time.sleep(0.2)
            for line in reader:  # what the last ranks wrote as the run ended
                tail.append(line.rstrip())
                forward(log, line.rstrip())
        except BaseException:  # the task itself was interrupted: leave no trainer behind
            run.stop()
            raise
        finally:
            watchdog.cancel()
    if timed_out.is_set():
        raise TrainingFailed("training exceeded pipeline.train_timeout_minutes", user_error=True)
    run.result(list(tail))


def forward(log, line: str) -> None:
    """A trainer line at its own level, its level word dropped (Prefect prints one); the
    console's step lines and torchrun's lines as they are, at INFO."""
    level, _, message = line.partition(" ")
    if level in ("INFO", "WARNING", "ERROR") and message:
        log.log(getattr(logging, level), message)
    else:
        log.info(line)


def exit_error(code: int, tail: list[str], path: Path) -> TrainingFailed:
    """What a trainer's exit code other than 0 and a signal's says, in one line for a user
    error (exit 2: the trainer's last line), with the log's tail for a bug."""
    if code == 2:
        return TrainingFailed(tail[-1] if tail else "training failed", user_error=True)
    last = "\n".join(tail)
    return TrainingFailed(f"the trainer exited with {code}; last lines of {path}:\n{last}",
                          user_error=code > 128)  # fmt: skip


class LocalRun:
    """The trainer as a child process of this one, in its process group, so a signal to
    the group reaches it too."""

    def __init__(self, cmd: list[str], env: dict, logfile, path: Path):
        self.proc = subprocess.Popen(cmd, env=env, stdout=logfile, stderr=subprocess.STDOUT)
        self.path = path

    def done(self) -> bool:
        return self.proc.poll() is not None

    def stop(self) -> None:
        """SIGTERM the trainer (torchrun forwards it to each rank, which finishes its update
        and saves; one already signalled with the whole process group takes it as the same
        request), then SIGKILL if it has not exited within 25 s."""
        if self.proc.poll() is not None:
            return
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout=25)
        except subprocess.TimeoutExpired:
            self.proc.kill()

    def result(self, tail: list[str]) -> None:
        code = self.proc.returncode
        if code - 128 in (signal.SIGINT, signal.SIGTERM):
            # The trainer was signalled, saved and stopped, and this process was not (a job
            # started with `&` by a script ignores SIGINT; a signal to the trainer alone):
            # the run stops here as it would had the signal come here too.
            sig = code - 128
            raise KeyboardInterrupt if sig == signal.SIGINT else TerminationSignal(sig)
        if code != 0:
            raise exit_error(code, tail, self.path)
