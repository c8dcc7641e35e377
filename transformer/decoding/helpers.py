"""Helper processes for the distill stage (distill.py): each translates its share of the
missing parts on a device of its own and writes each part whole, while the stage's process
translates its own share and follows them.

No helper outlives the stage: a stop, a failure or the end of the block ends them, and a
helper whose stage was killed outright (the OOM killer, SIGKILL) gets a SIGTERM from the
kernel (lifecycle.die_with_parent). A part a helper was writing is discarded whole, as any
stopped write; the rerun translates it.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import signal
import sys
import traceback
from collections.abc import Callable, Iterator
from multiprocessing.connection import wait as wait_for_any
from pathlib import Path

import torch

from transformer.cli import USER_ERRORS, UserError, one_line
from transformer.config import DecodeConfig
from transformer.decoding.translate import load_ensemble, translate_lines
from transformer.nn.kv_cache import Arena
from transformer.processes import die_with_parent

Share = tuple[str, dict[Path, list[str]]]  # a device, and the parts it translates: their lines
Write = Callable[[Path, list[str]], None]  # writes a part's translations whole

POLL_S = 1.0  # how often the stage, its own share done, looks at its helpers


class HelperFailed(UserError):
    """A helper's user error (a file, the disk): its device and the error, in one line."""


class HelperCrashed(RuntimeError):
    """A helper's bug (with its traceback), or its death by a signal or an exit code."""


class Helpers:
    """The started helpers: `check()` raises the failure of any that failed; `wait(poll)`
    returns once all are done, calling `poll` meanwhile."""

    def __init__(self, procs: list[tuple[str, multiprocessing.Process]], errors) -> None:
        self.procs, self.errors = procs, errors

    def check(self) -> None:
        if failure := self._said():
            raise failure
        for device, proc in self.procs:
            if proc.exitcode:  # what it said before it exited, else how it ended
                code = proc.exitcode
                how = (f"killed by signal {-code} ({signal.Signals(-code).name})" if code < 0
                       else f"exit code {code}")  # fmt: skip
                raise self._said() or HelperCrashed(
                    f"the process translating on {device} ended: {how}"
                )

    def _said(self) -> Exception | None:
        if self.errors is None or self.errors.empty():
            return None
        kind, device, text = self.errors.get()
        return (HelperFailed if kind == "user" else HelperCrashed)(
            f"the process translating on {device}: {text}"
        )

    def wait(self, poll: Callable[[], None]) -> None:
        while running := [proc.sentinel for _, proc in self.procs if proc.exitcode is None]:
            self.check()
            wait_for_any(running, POLL_S)
            poll()
        self.check()


@contextlib.contextmanager
def helped(shares: list[Share], teachers: list[str], cfg: DecodeConfig, threads: int,
           write: Write) -> Iterator[Helpers]:  # fmt: skip
    """A helper process a share, started for the block and ended with it."""
    # spawn: no fork of a process that holds threads, locks or CUDA. Not the forkserver of
    # the shard stage's pool: a helper must be the stage's own child for the kernel to end
    # it with the stage (a forkserver outlives its caller while its children live).
    context = multiprocessing.get_context("spawn")
    errors = context.SimpleQueue() if shares else None
    procs: list[tuple[str, multiprocessing.Process]] = []
    try:
        for device, parts in shares:
            proc = context.Process(
                target=_helper,
                daemon=True,
                name=f"distill-{device}",
                args=(teachers, device, parts, cfg, threads, write, errors, os.getpid()),
            )
            proc.start()
            procs.append((device, proc))
        yield Helpers(procs, errors)
    finally:  # all of them asked first: a second Ctrl-C while joining leaves none running
        for _, proc in procs:
            if proc.is_alive():
                proc.terminate()
        for _, proc in procs:
            proc.join()
        if errors is not None:
            errors.close()


def _helper(teachers: list[str], device: str, parts: dict[Path, list[str]], cfg: DecodeConfig,
            threads: int, write: Write, errors, stage: int) -> None:  # fmt: skip
    """Translate `parts` on `device` and write each whole. Ctrl-C is the stage's to take: it
    ends the helpers. A failure goes back to the stage: a user error in one line, a bug
    with its traceback."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    die_with_parent(stage)
    try:
        torch.set_num_threads(threads)
        models, sp, _ = load_ensemble(teachers, device)
        arena = Arena()  # one cache memory for every part (distill.py says why)
        for path, lines in parts.items():
            write(path, translate_lines(models, sp, lines, cfg, device, arena=arena))
    except USER_ERRORS as err:
        errors.put(("user", device, one_line((str(err).splitlines() or [""])[0])))
        sys.exit(1)
    except Exception:
        errors.put(("bug", device, traceback.format_exc()))
        sys.exit(1)
