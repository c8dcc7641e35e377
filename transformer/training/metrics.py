"""Where training metrics go: a two-method protocol the caller implements (MLflow in tasks/),
a console logger by default, and the per-window accumulator of the training metrics."""

from __future__ import annotations

import math
import sys
import time
from typing import Any, Protocol

import torch
from torch import Tensor
from tqdm import tqdm

from transformer.console import format_duration


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


class TrainMeter:
    """The training metrics, summed on the device update by update, read by the host only
    when it needs them (`read`: one device-to-host copy): a read inside every update would
    make the host wait for the GPU at each one, and the GPU for the host's next one.

    `add` also decides, on the device, whether the update may be applied: a non-finite loss
    or gradient norm skips it (the optimizer's `found_inf`). Losses are per target token of
    the window (token-weighted, as the optimisation itself weighs them); throughput is the
    window's wall time up to the read that ends it, less validation and checkpointing.
    """

    # The device sums: loss, nll, tokens, grad norm (applied updates), applied, skipped,
    # the current run of skipped updates and the longest since the last read.
    LOSS, NLL, TOKENS, NORM, OK, BAD, RUN, LONGEST = range(8)

    def __init__(self, device: torch.device, bad_run: int = 0):
        self.sums = torch.zeros(8, device=device)
        self.sums[self.RUN] = self.sums[self.LONGEST] = bad_run
        self.window = [0.0] * 6  # the host's sums since the last log, as `sums`' first six
        self.seconds = self.updates = 0
        self.clock = time.perf_counter()

    def add(self, loss: Tensor, nll: Tensor, tokens: Tensor, grad_norm: Tensor) -> Tensor:
        """One update's sums (all ranks); returns found_inf, 1.0 where it must be skipped."""
        s = self.sums
        values = torch.stack([loss, nll, tokens, grad_norm])
        ok = values.isfinite().all()
        s[: self.OK] += values.where(ok, 0.0)
        s[self.OK : self.RUN] += torch.stack([ok, ~ok])
        s[self.RUN] = (s[self.RUN] + 1).where(~ok, 0.0)
        s[self.LONGEST] = s[self.LONGEST].maximum(s[self.RUN])
        self.updates += 1
        return (~ok).float()

    def read(self) -> tuple[int, int, int, int]:
        """Into the window: (skipped updates since the last read, current run of skipped
        updates, longest run since the last read, target tokens of the applied updates since
        the last read). The one host read."""
        values = self.sums.tolist()
        self.sums[: self.RUN].zero_()
        self.sums[self.LONGEST] = self.sums[self.RUN]
        for i in range(6):
            self.window[i] += values[i]
        now = time.perf_counter()
        self.seconds, self.clock = self.seconds + now - self.clock, now
        counts = (self.BAD, self.RUN, self.LONGEST, self.TOKENS)
        return tuple(int(values[i]) for i in counts)

    def state_dict(self) -> dict[str, Any]:
        """The open logging window (after a `read`): a run stopped inside it and resumed
        logs at its end what an uninterrupted run logs."""
        return {"window": list(self.window), "updates": self.updates, "seconds": self.seconds}

    def load_state_dict(self, state: dict[str, Any] | None) -> None:
        if state is not None:  # a state saved before the window was kept: a fresh one
            self.window, self.updates = list(state["window"]), state["updates"]
            self.seconds = state["seconds"]

    def pause(self) -> None:
        """Validation or a checkpoint: their time is not training's."""
        self.clock = time.perf_counter()

    def metrics(self, lr: float, bad_steps: int) -> dict[str, float]:
        """The window's metrics (after a `read`); starts the next window."""
        loss, nll, tokens, norm, ok, _ = self.window
        n, tokens = max(self.updates, 1), max(tokens, 1.0)
        out = {
            "train/loss": loss / tokens,
            "train/nll_loss": nll / tokens,
            "train/ppl": math.exp(min(nll / tokens, 100.0)),
            "train/lr": lr,
            "train/grad_norm": norm / max(ok, 1.0),
            "train/tokens_per_s": tokens / max(self.seconds, 1e-9),
            "train/step_time": self.seconds / n,
            "train/tokens_per_update": tokens / max(ok, 1.0),
        }
        if bad_steps:
            out["train/bad_steps"] = float(bad_steps)
        self.window = [0.0] * 6
        self.seconds = self.updates = 0
        return out
