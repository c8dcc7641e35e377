"""How the command line stops: SIGINT (Ctrl-C) or SIGTERM (a scheduler, `kill`) ends the flow
with one line and exit 128 + the signal, whatever it was doing: the stage at work unwinds
(training saves, every other stage's atomic writes are discarded whole), its MLflow runs are
marked, and a rerun of the same command picks up from there.

Three things stand in the way, and `Stop` deals with each:
- Prefect's own SIGTERM handler, for the flow's run, re-sends the signal to the handler
  it replaced once the flow has unwound: Python's default, which kills the process
  (exit -15, no line). The command line's handler is the one it finds, and keeps.
- A second signal (Ctrl-C twice, or the group's SIGTERM beside a launcher's) raised while
  the first unwinds cuts the unwinding short: tracebacks, a crash half-reported. Only the
  first is raised; later ones are noted.
- Python runs a signal handler between any two bytecodes, those of a finalizer (`__del__`,
  a weakref callback) included, and an exception leaving a finalizer is printed
  ("Exception ignored in ...") and dropped: the flow would run on. `sys.unraisablehook`
  sees it go, and the signal is delivered again, at the main thread's next line. And one
  that lands inside a database call waits for the call's end (see DATABASE_MODULES).
"""

from __future__ import annotations

import _thread
import contextlib
import signal
import sys
import threading
from collections.abc import Iterator

from prefect.exceptions import TerminationSignal

SIGNALS = (signal.SIGINT, signal.SIGTERM)


class Stop:
    def __init__(self) -> None:
        self.signum: int | None = None  # the first signal
        self.unwinding = False  # its exception is on its way up
        self.installed = False
        self._ignored: set[int] = set()

    @contextlib.contextmanager
    def handling(self) -> Iterator[None]:
        """The handlers, for the block (the command line's main thread); what was there
        before comes back after it (a test that runs the command in its own process). A
        signal the process was started ignoring stays ignored (SIGINT, in a script's
        `flow &`: the trainer takes its own, and the flow then stops with it)."""
        previous = {sig: signal.getsignal(sig) for sig in SIGNALS}
        self._next_hook = sys.unraisablehook
        self.signum, self.unwinding, self.installed = None, False, True
        self._ignored = {sig for sig, handler in previous.items() if handler == signal.SIG_IGN}
        for sig in set(SIGNALS) - self._ignored:
            signal.signal(sig, self._handle)
        sys.unraisablehook = self._unraisable
        try:
            yield
        finally:
            self.installed = False
            sys.unraisablehook = self._next_hook
            for sig, handler in previous.items():
                signal.signal(sig, handler)

    def take_over(self) -> None:
        """Inside the flow's run, where Prefect has put its SIGTERM handler in place of this
        one (it puts this one back when the run ends): this one again, if installed."""
        if self.installed and signal.SIGTERM not in self._ignored:
            signal.signal(signal.SIGTERM, self._handle)

    def raise_if_stopped(self) -> None:
        """Between stages: a stop whose exception some code swallowed whole is raised again."""
        if self.signum is not None and not self.unwinding:
            self.unwinding = True
            raise _exception(self.signum)

    def _handle(self, signum: int, frame) -> None:
        if self.signum is None:
            self.signum = signum
        if self.unwinding:
            return
        if _in_database(frame):  # delivered again shortly, once the call has returned
            threading.Timer(RETRY_S, _thread.interrupt_main, (signum,)).start()
            return
        self.unwinding = True
        raise _exception(self.signum)

    def _unraisable(self, unraisable) -> None:
        if isinstance(unraisable.exc_value, (KeyboardInterrupt, TerminationSignal)):
            # Raised inside a finalizer, and dropped there: once more, from outside it (a
            # signal raised from here would be raised in here, and dropped again).
            self.unwinding = False
            signum = self.signum or _signum(unraisable.exc_value)
            threading.Timer(0.05, _thread.interrupt_main, (signum,)).start()
            return
        self._next_hook(unraisable)


# A stop raised inside a database call (MLflow's SQLite store) leaves the query's cursor
# open in the frames its traceback holds, and with it SQLite's lock: marking the run failed
# then finds the store "locked". Such a stop waits for the call to return.
DATABASE_MODULES = ("sqlalchemy", "sqlite3", "alembic")
RETRY_S = 0.1


def _in_database(frame) -> bool:
    while frame is not None:
        if frame.f_globals.get("__name__", "").startswith(DATABASE_MODULES):
            return True
        frame = frame.f_back
    return False


def _signum(exc: BaseException) -> int:
    return getattr(exc, "signal", signal.SIGINT)  # TerminationSignal's, or a Ctrl-C's


def _exception(signum: int) -> BaseException:
    """What Prefect and the code under it know as a stop: a crash, not a failure."""
    return KeyboardInterrupt() if signum == signal.SIGINT else TerminationSignal(signum)


STOP = Stop()
