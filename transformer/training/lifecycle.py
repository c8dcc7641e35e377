"""The life of a training process: one trainer per run folder, a rank that dies with its
launcher, and stop signals that let the current update finish and be saved, and never cut
a save short."""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import signal
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from transformer import processes
from transformer.files import CHECKPOINTS, locked
from transformer.training.distributed import DistEnv, barrier

log = logging.getLogger(__name__)


@contextlib.contextmanager
def prepare_run_dir(run_dir: Path, reset: bool, env: DistEnv) -> Iterator[None]:
    """Rank 0 holds the run folder's lock for the whole run: one trainer per folder (a rerun
    that races a dying predecessor waits for it to save and exit)."""
    with contextlib.ExitStack() as held:
        if env.is_main:
            message = "another trainer is running in %s: waiting for it"
            held.enter_context(locked(run_dir / ".lock", lambda: log.warning(message, run_dir)))
            if reset:
                shutil.rmtree(run_dir / CHECKPOINTS, ignore_errors=True)
                log.info("--reset: deleted the checkpoints of %s", run_dir)
            for tmp in (run_dir / CHECKPOINTS).glob(".*.tmp"):  # saves a kill interrupted
                tmp.unlink(missing_ok=True)
        barrier()
        yield


def die_with_parent(asked: bool, parent: int) -> None:
    """torchrun starts every rank in a session of its own, so a SIGKILL of torchrun (or of
    the pipeline around it) would leave the ranks training on, orphaned, beside a rerun.
    Linux can send a SIGTERM when the parent dies: the rank then saves and exits. Not for
    a plain command (`nohup python -m transformer.train ...` outlives its shell) unless
    `asked`, as the pipeline does. `parent`: processes.started_by(), the launcher's pid
    or the parent's as the process started (pid 1 may be torchrun itself, a container's
    first process); a parent gone since, during the rendezvous, is a SIGTERM at once."""
    if asked or "TORCHELASTIC_RUN_ID" in os.environ:
        processes.die_with_parent(parent)


_saving = 0  # saves under way in this process (`whole_save`)
_impatient = False  # a second SIGINT came during one


@contextlib.contextmanager
def whole_save() -> Iterator[None]:
    """A checkpoint being written: an impatient second SIGINT (StopSignal) waits for its
    end, so that the file the first signal asked for is saved whole, then stops at once."""
    global _saving
    _saving += 1
    try:
        yield
    finally:
        _saving -= 1
    if _impatient and not _saving:
        raise KeyboardInterrupt


class StopSignal:
    """SIGTERM/SIGINT ask the loop to stop after the current update (and save). Another
    SIGINT (an impatient Ctrl-C) stops at once, or at the end of the save under way;
    another SIGTERM changes nothing (a launcher and the process group may both send one,
    and each asks for the same graceful stop)."""

    def __init__(self):
        self.signum: int | None = None
        self._previous: dict[int, Any] = {}

    @property
    def requested(self) -> bool:
        return self.signum is not None

    def install(self) -> None:
        global _impatient
        _impatient = False
        with contextlib.suppress(ValueError):  # not the main thread: no handlers there
            for sig in (signal.SIGTERM, signal.SIGINT):
                self._previous[sig] = signal.signal(sig, self._handle)

    def restore(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()

    def _handle(self, signum: int, frame) -> None:
        global _impatient
        if self.signum is not None:
            if signum == signal.SIGINT:
                _impatient = True
                if not _saving:
                    raise KeyboardInterrupt
            return
        self.signum = signum
        log.warning("%s: stopping after this update", signal.Signals(signum).name)
