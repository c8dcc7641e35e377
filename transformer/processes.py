"""A process that ends with the one that started it: Linux's PR_SET_PDEATHSIG, for what
the project starts and must not outlive its starter (a trainer's ranks under torchrun, the
distill stage's helpers, the local Prefect server): a SIGKILL of the starter, which runs no
cleanup, would leave them running beside a rerun."""

from __future__ import annotations

import ctypes
import os
import signal
import sys

PR_SET_PDEATHSIG = 1
LAUNCHER_PID = "TRANSFORMER_LAUNCHER_PID"  # set by a launcher for its children (tasks/torchrun.py)


def started_by() -> int:
    """The pid of the process that started this one: the launcher's word where it gave it
    (true however late it is asked), else the parent's now: ask first thing, since a dead
    parent is replaced by a reaper. The word is taken out of the environment, so that what
    this process starts in turn does not take it for its own."""
    said = os.environ.pop(LAUNCHER_PID, "")
    return int(said) if said.isdigit() else os.getppid()


def die_with_parent(parent: int) -> None:
    """From now on, a SIGTERM to this process when its parent dies; at once if `parent`,
    the pid of the process that started this one, is gone already. A parent of pid 1 is
    no sign of an orphan (a torchrun that is a container's first process): the pid the
    process started with is. Elsewhere than Linux, nothing."""
    if sys.platform != "linux":
        return
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    if os.getppid() != parent:
        os.kill(os.getpid(), signal.SIGTERM)
