"""Where training metrics go: a two-method protocol the caller implements (MLflow in tasks/),
a console logger by default, and the per-window accumulator of the training metrics."""

from __future__ import annotations

import logging
import math
import sys
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
    """One compact line per `log()` on stdout, and a progress bar on stderr when it is a
    terminal (a pipe, as under the pipeline, gets the lines only)."""

    def __init__(self, total_steps: int, initial_step: int = 0):
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
        tqdm.write(format_line(metrics, step), file=sys.stdout)
        sys.stdout.flush()

    def close(self) -> None:
        self.bar.close()


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


def format_line(metrics: dict[str, float], step: int) -> str:
    """'step 120 | train/loss 5.432 | train/lr 0.000312 | ...' with 4 significant digits."""
    return " | ".join([f"step {step}", *(f"{k} {v:.4g}" for k, v in metrics.items())])


class _TqdmHandler(logging.Handler):
    """Log records through tqdm.write, so they never break the progress bar; sys.stdout is
    looked up at each record (it is replaced under test runners)."""

    def emit(self, record: logging.LogRecord) -> None:
        try:
            tqdm.write(self.format(record), file=sys.stdout)
            sys.stdout.flush()
        except Exception:
            self.handleError(record)


def setup_logging(is_main: bool) -> None:
    """Messages of the `transformer` package to stdout: INFO on rank 0, warnings elsewhere."""
    log = logging.getLogger("transformer")
    if not any(isinstance(h, _TqdmHandler) for h in log.handlers):
        handler = _TqdmHandler()
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(message)s"))
        log.addHandler(handler)
    log.setLevel(logging.INFO if is_main else logging.WARNING)


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

    def add(self, loss: float, nll: float, tokens: float, grad_norm: float, seconds: float):
        self.loss += loss
        self.nll += nll
        self.tokens += tokens
        self.grad_norm += grad_norm
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
