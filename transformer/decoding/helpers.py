"""Helper processes for the distill stage (distill.py): each translates its share of the
missing parts on a device of its own and writes each part whole, while the stage's process
translates its own share and follows them.

No helper outlives the stage: a stop, a failure or the end of the block ends them, and a
helper whose stage was killed outright (the OOM killer, SIGKILL) gets a SIGTERM from the
kernel (processes.die_with_parent). A part a helper was writing is discarded whole, as any
stopped write; the rerun translates it.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import signal
import sys
import traceback
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from multiprocessing.connection import Connection
from multiprocessing.connection import wait as wait_for_any
from pathlib import Path

import torch

from transformer.cli import USER_ERRORS, UserError, one_line
from transformer.config import DecodeConfig
from transformer.decoding.translate import load_ensemble, translate_lines
from transformer.nn.kv_cache import Arena
from transformer.processes import die_with_parent

Share = tuple[str, dict[Path, slice]]  # a device, and the parts it translates: their rows
Read = Callable[[list[slice]], Iterable[list[str]]]  # the lines of each range of rows, in turn
Write = Callable[[Path, list[str]], None]  # writes a part's translations whole

POLL_S = 1.0  # how often the stage, its own share done, looks at its helpers


class HelperFailed(UserError):
    """A helper's user error (a file, the disk): which helper, and the error, in one line."""


class HelperCrashed(RuntimeError):
    """A helper's bug (with its traceback), or its death by a signal or an exit code."""


@dataclass
class _Helper:
    name: str  # "distill helper 2 (cuda:1)": several may share the CPU
    proc: multiprocessing.Process
    said: Connection  # what it says before it exits on a failure; a pipe of its own


class Helpers:
    """The started helpers: `check()` raises the failure of one that failed; `wait(poll)`
    returns once all are done, calling `poll` meanwhile."""

    def __init__(self, helpers: list[_Helper]) -> None:
        self.helpers = helpers

    def check(self) -> None:
        for helper in self.helpers:
            code = helper.proc.exitcode
            if failure := _said(helper):
                raise failure
            if code:  # ended without a word (read after its exit code: none will come)
                raise HelperCrashed(f"{helper.name} ended: {_how(code)}")

    def wait(self, poll: Callable[[], None]) -> None:
        while running := [h.proc.sentinel for h in self.helpers if h.proc.exitcode is None]:
            self.check()
            wait_for_any(running, POLL_S)
            poll()
        self.check()


def _said(helper: _Helper) -> Exception | None:
    if not helper.said.poll():
        return None
    try:
        kind, text = helper.said.recv()
    except EOFError:  # it closed its end without a word (done, or killed mid-word)
        return None
    return (HelperFailed if kind == "user" else HelperCrashed)(f"{helper.name}: {text}")


def _how(code: int) -> str:
    if code > 0:
        return f"exit code {code}"
    return f"killed by signal {-code} ({signal.strsignal(-code) or 'unknown'})"


@contextlib.contextmanager
def helped(shares: list[Share], read: Read, teachers: list[str], cfg: DecodeConfig,
           threads: int, write: Write) -> Iterator[Helpers]:  # fmt: skip
    """A helper process a share, started for the block and ended with it. Each reads its
    lines itself (`read`): at WMT scale a share's lines are tens of MB to pickle through a
    pipe."""
    # spawn: no fork of a process that holds threads, locks or CUDA. Not the forkserver of
    # the shard stage's pool: a helper must be the stage's own child for the kernel to end
    # it with the stage (a forkserver outlives its caller while its children live).
    context = multiprocessing.get_context("spawn")
    helpers: list[_Helper] = []
    try:
        for k, (device, parts) in enumerate(shares, 1):
            said, says = context.Pipe(duplex=False)
            args = (read, teachers, device, parts, cfg, threads, write, says, os.getpid())
            proc = context.Process(target=_helper, args=args, daemon=True, name=f"distill-{k}")
            helpers.append(_Helper(f"distill helper {k} ({device})", proc, said))
            # Ctrl-C is the stage's to take: held back from a helper until it ignores it
            blocked = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
            try:
                proc.start()
            finally:
                signal.pthread_sigmask(signal.SIG_SETMASK, blocked)
                says.close()  # the helper's end: its exit is then the pipe's EOF
        yield Helpers(helpers)
    finally:  # all of them asked first: a second Ctrl-C while joining leaves none running
        started = [h.proc for h in helpers if h.proc.pid is not None]
        for proc in started:
            if proc.is_alive():
                proc.terminate()
        for proc in started:
            proc.join()
        for helper in helpers:
            helper.said.close()


def _helper(read: Read, teachers: list[str], device: str, parts: dict[Path, slice],
            cfg: DecodeConfig, threads: int, write: Write, says: Connection,
            stage: int) -> None:  # fmt: skip
    """Translate the lines of `parts` on `device` and write each part whole. A failure goes
    back to the stage: a user error in one line (naming the part where the error names no
    file), a bug with its traceback."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})
    die_with_parent(stage)
    part = None
    try:
        torch.set_num_threads(threads)
        mine = read(list(parts.values()))
        models, sp, _ = load_ensemble(teachers, device)
        arena = Arena()  # one cache memory for every part (distill.py says why)
        for part, lines in zip(parts, mine, strict=True):
            write(part, translate_lines(models, sp, lines, cfg, device, arena=arena))
    except USER_ERRORS as err:
        text = (str(err).splitlines() or [""])[0]
        if isinstance(err, OSError) and err.filename is None and part is not None:
            text = f"{part}: {text}"  # a full disk names no file by itself
        says.send(("user", one_line(text)))
        sys.exit(1)
    except Exception:
        says.send(("bug", traceback.format_exc()))
        sys.exit(1)
