"""Where training metrics go: a two-method protocol the caller implements (MLflow in tasks/),
a console logger by default, and the per-window accumulator of the training metrics."""

from __future__ import annotations

import logging
import math
import sys
import time
from typing import Protocol

from tqdm import tqdm


class MetricsLogger(Protocol):
    def log(self, metrics: dict[str, float], step: int) -> None: ...

    def close(self) -> None: ...


class NullLogger:
    """For ranks other than 0: only rank 0 logs."""

    def log(self, metrics: dict[str, float], step: int) -> None:
        pass

    def close(self) -> None:
        pass


class ConsoleLogger:
    """Lines a person can follow on stdout, one per `log()`: progress, the few numbers that
    tell a run is healthy, time left. The full metric set goes to the caller's logger.

        step 120/600 (20%) | loss 2.62 | lr 2.9e-03 | 14,000 tok/s | eta 1m05s
        valid 200/600 | loss 2.104 | ppl 8.20 | bleu 31.52 | best 31.52

    A progress bar on stderr when it is a terminal (a pipe, as under the pipeline, gets the
    lines only)."""

    def __init__(self, total_steps: int, initial_step: int = 0):
        self.total = total_steps
        self.start = (time.monotonic(), initial_step)
        self.bar = tqdm(
            total=total_steps,
            initial=initial_step,
            unit="step",
            file=sys.stderr,
            dynamic_ncols=True,
            disable=not sys.stderr.isatty(),
        )

    def log(self, metrics: dict[str, float], step: int) -> None:
        self.bar.update(max(0, step - self.bar.n))
        if "train/loss" in metrics:
            line = self._train_line(metrics, step)
        else:
            line = f"valid {step}/{self.total} | " + " | ".join(
                f"{k.split('/')[-1]} {v:.4g}" for k, v in metrics.items() if v is not None
            )
        tqdm.write(line, file=sys.stdout)
        sys.stdout.flush()

    def _train_line(self, m: dict[str, float], step: int) -> str:
        started, first = self.start
        done = step - first
        eta = (time.monotonic() - started) / done * (self.total - step) if done > 0 else 0.0
        return (
            f"step {step}/{self.total} ({step / self.total:.0%}) | loss {m['train/loss']:.3f} | "
            f"lr {m['train/lr']:.1e} | {m['train/tokens_per_s']:,.0f} tok/s | "
            f"eta {format_duration(eta)}"
        )

    def close(self) -> None:
        self.bar.close()


def format_duration(seconds: float) -> str:
    """65 -> '1m05s', 3725 -> '1h02m', 9 -> '9s'."""
    s = round(seconds)
    if s >= 3600:
        return f"{s // 3600}h{s % 3600 // 60:02d}m"
    if s >= 60:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s}s"


class TeeLogger:
    """The same metrics to several loggers (the console and the caller's)."""

    def __init__(self, *loggers: MetricsLogger):
        self.loggers = loggers

    def log(self, metrics: dict[str, float], step: int) -> None:
        for logger in self.loggers:
            logger.log(metrics, step)

    def close(self) -> None:
        for logger in self.loggers:
            logger.close()


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


class Progress:
    """How far a long data stage is: a bar on a terminal; elsewhere (a pipeline's log, a
    pipe) a line at every tenth of the way, so a slow machine shows progress, not a hang."""

    def __init__(self, what: str, total: int, unit: str, log: logging.Logger):
        self.what, self.total, self.unit, self.log = what, total, unit, log
        self.done, self.start = 0, time.monotonic()
        self.next_tenth = 1
        self.bar = tqdm(total=total, desc=what, unit=unit, file=sys.stderr,
                        disable=not sys.stderr.isatty(), leave=False)  # fmt: skip

    def update(self, n: int) -> None:
        self.done += n
        self.bar.update(n)
        if self.bar.disable and self.total and self.done * 10 >= self.next_tenth * self.total:
            self.next_tenth = self.done * 10 // self.total + 1
            elapsed = time.monotonic() - self.start
            eta = elapsed / self.done * (self.total - self.done)
            self.log.info("%s: %s/%s %s (%d%%), eta %s", self.what, f"{self.done:,}",
                          f"{self.total:,}", self.unit, 100 * self.done // self.total,
                          format_duration(eta))  # fmt: skip

    def close(self) -> None:
        self.bar.close()


class TrainMeter:
    """Sums over the updates since the last log; `metrics()` reads and resets them.

    Losses are per target token of the whole window (token-weighted, as the optimisation
    itself weighs them); throughput counts the time inside training steps only, so
    validation and checkpointing do not drag it down.
    """

    def __init__(self):
        self.reset()

    def reset(self) -> None:
        self.loss = self.nll = self.tokens = self.grad_norm = self.seconds = 0.0
        self.updates = 0

    def add(self, result, seconds: float) -> None:
        """`result`: a train.StepResult (sums over the update's target tokens)."""
        self.loss += result.loss
        self.nll += result.nll
        self.tokens += result.tokens
        self.grad_norm += result.grad_norm
        self.seconds += seconds
        self.updates += 1

    def metrics(self, lr: float, bad_steps: int) -> dict[str, float]:
        n, tokens = max(self.updates, 1), max(self.tokens, 1.0)
        out = {
            "train/loss": self.loss / tokens,
            "train/nll_loss": self.nll / tokens,
            "train/ppl": math.exp(min(self.nll / tokens, 100.0)),
            "train/lr": lr,
            "train/grad_norm": self.grad_norm / n,
            "train/tokens_per_s": self.tokens / max(self.seconds, 1e-9),
            "train/step_time": self.seconds / n,
            "train/tokens_per_update": self.tokens / n,
        }
        if bad_steps:
            out["train/bad_steps"] = float(bad_steps)
        self.reset()
        return out
