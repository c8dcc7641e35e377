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


def die_with_parent(parent: int | None = None) -> None:
    """From now on, a SIGTERM to this process when its parent dies; at once if it already
    has (`parent`: its pid, else a parent of pid 1 means gone). Elsewhere than Linux,
    nothing."""
    if sys.platform != "linux":
        return
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    # Given the parent: under a subreaper (a container's init) an orphan's is not pid 1.
    gone = os.getppid() == 1 if parent is None else os.getppid() != parent
    if gone:
        os.kill(os.getpid(), signal.SIGTERM)
