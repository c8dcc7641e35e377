"""What a person watching a command sees: the library's log lines on stdout, a progress bar
on a terminal (elsewhere a line every tenth of the way, or every so many seconds),
durations in words."""

from __future__ import annotations

import logging
import sys
import time

from tqdm import tqdm


def format_duration(seconds: float) -> str:
    """65 -> '1m05s', 3725 -> '1h02m', 9 -> '9s'."""
    s = round(seconds)
    if s >= 3600:
        return f"{s // 3600}h{s % 3600 // 60:02d}m"
    if s >= 60:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s}s"


class _TqdmHandler(logging.Handler):
    """Log records through tqdm.write, so they never break the progress bar; sys.stdout is
    looked up at each record (it is replaced under test runners)."""

    def emit(self, record: logging.LogRecord) -> None:
        try:
            tqdm.write(self.format(record), file=sys.stdout)
            sys.stdout.flush()
        except Exception:
            self.handleError(record)


def setup_logging(is_main: bool, timestamps: bool = True) -> None:
    """Messages of the `transformer` package to stdout: INFO on rank 0, warnings elsewhere.
    `timestamps=False` for a caller that stamps each line itself (the pipeline's logger)."""
    log = logging.getLogger("transformer")
    handler = next((h for h in log.handlers if isinstance(h, _TqdmHandler)), None)
    if handler is None:
        handler = _TqdmHandler()
        log.addHandler(handler)
    fmt = "%(asctime)s %(levelname)s %(message)s" if timestamps else "%(levelname)s %(message)s"
    handler.setFormatter(logging.Formatter(fmt))
    log.setLevel(logging.INFO if is_main else logging.WARNING)


# How often a job that reports by time (decoding, validation: `every_s`) says how far it
# is, about the training's pace of lines; a job done sooner says nothing.
PROGRESS_EVERY_S = 30.0


class Progress:
    """How far a long job is: a bar on a terminal; elsewhere (a pipeline's log, a pipe) a
    line at every tenth of the way, or every `every_s` seconds, so a slow machine shows
    progress, not a hang: done/total, the rate, the time left. A total of 0 says nothing.
    `done`: what a stopped run did, which a rerun starts from; it counts toward the rate
    neither here nor in the bar."""

    def __init__(
        self,
        what: str,
        total: int,
        unit: str,
        log: logging.Logger,
        every_s: float | None = None,
        done: int = 0,
    ):
        self.what, self.total, self.unit, self.log = what, total, unit, log
        self.done, self.resumed, self.start = done, done, time.monotonic()
        self.next_tenth = done * 10 // total + 1 if total else 1
        self.every_s, self.said = every_s, self.start
        self.bar = tqdm(total=total, initial=done, desc=what, unit=unit, file=sys.stderr,
                        disable=not sys.stderr.isatty() or not total, leave=False)  # fmt: skip

    def update(self, n: int) -> None:
        self.done += n
        self.bar.update(n)
        if not self.bar.disable or not self.total:
            return
        now = time.monotonic()
        if self.every_s is not None:
            due = now - self.said >= self.every_s and self.done < self.total
        else:
            due = self.done * 10 >= self.next_tenth * self.total
            self.next_tenth = max(self.next_tenth, self.done * 10 // self.total + 1)
        if due:
            self.said = now
            self._line(now - self.start)

    def _line(self, elapsed: float) -> None:
        rate = (self.done - self.resumed) / max(elapsed, 1e-9)
        eta = (self.total - self.done) / max(rate, 1e-9)
        self.log.info("%s: %s/%s %s (%d%%), %s %s/s, eta %s", self.what, f"{self.done:,}",
                      f"{self.total:,}", self.unit, 100 * self.done // self.total,
                      f"{rate:,.0f}" if rate >= 10 else f"{rate:.2g}", self.unit,
                      format_duration(eta))  # fmt: skip

    def close(self) -> None:
        self.bar.close()
