"""Train the Transformer: one process, or any number under torchrun, with the same command.

    python -m transformer.train PARAMS --data SHARDS --out RUN_DIR [key=value ...]
    torchrun --nproc_per_node N -m transformer.train PARAMS --data SHARDS --out RUN_DIR

Rerunning the command resumes from the newest readable checkpoint of RUN_DIR and continues
the same trajectory (model, optimizer, schedule, every RNG, the data position); a finished
run is a no-op. Resuming with other model/training params or other data is refused with
the differences named, unless `--allow-param-change`; `--reset` starts over. Raising
train.max_steps (and the other keys of RESUMABLE_CHANGES) extends a run freely.

Exit codes: 0 trained to max_steps (or already there); 1 stopped after train.max_bad_steps
non-finite updates in a row (the checkpoints are left as they were); 2 bad params, data or
checkpoints (one line on stderr); 128 + signal number after SIGTERM/SIGINT: the current
update is finished and saved first. Not 0, because an interrupted run is not a finished
one: the pipeline marks a run folder DONE on exit 0, and its rerun resumes.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import fcntl
import logging
import math
import os
import random
import shutil
import signal
import sys
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from transformer import checkpoint as ckpt
from transformer.config import Params, ParamsError, load_params, to_dict
from transformer.data import DataError
from transformer.data.batching import Batch, BatchLoader, ShardDataset, TokenBatchSampler
from transformer.distributed import (
    DistEnv,
    all_gather_objects,
    all_reduce_sum,
    barrier,
    broadcast_object,
    init_distributed,
    shutdown,
)
from transformer.loss import label_smoothed_nll
from transformer.metrics import (
    ConsoleLogger,
    MetricsLogger,
    NullLogger,
    TeeLogger,
    TrainMeter,
    setup_logging,
)
from transformer.model import Transformer
from transformer.optim import build_optimizer
from transformer.vocab import EOS, PAD, VocabError, load_spm

log = logging.getLogger("transformer.train")  # not "__main__" under -m

SPM_NAME = "spm.model"
# Keys that change how long or how visibly a run goes, never its trajectory.
RESUMABLE_CHANGES = frozenset(
    f"train.{key}"
    for key in (
        "max_steps",
        "save_every",
        "keep_last",
        "valid_every",
        "valid_bleu",
        "log_every",
        "max_bad_steps",
        "nproc_per_node",
        "timeout_minutes",
        "compile",
    )
)
EXIT_BAD_STEPS, EXIT_USAGE = 1, 2


class TrainError(RuntimeError):
    """Training cannot start as asked; the message says why (exit code 2)."""


@dataclass
class TrainState:
    step: int = 0  # optimizer updates applied
    bad_steps: int = 0  # non-finite updates in a row
    bad_steps_total: int = 0
    tokens_seen: int = 0  # target tokens of the applied updates, all ranks
    best_valid_loss: float = math.inf

    def state_dict(self) -> dict[str, Any]:
        return asdict(self)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for key, value in state.items():
            setattr(self, key, value)


@dataclass
class Trainer:
    """Everything a step needs; `model` is the bare module, `net` what the step calls
    (DistributedDataParallel around it when there are several ranks)."""

    params: Params
    env: DistEnv
    run_dir: Path
    model: Transformer
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    train_loader: BatchLoader
    valid: ShardDataset
    sp: Any  # sentencepiece.SentencePieceProcessor
    fingerprint: str
    net: nn.Module | None = None
    state: TrainState = field(default_factory=TrainState)
    saved_step: int | None = None  # the step of the last step checkpoint this run wrote

    def autocast(self):
        # bf16 autocast with fp32 master weights, on GPU only (the CPU runs fp32).
        if self.env.device.type == "cuda" and self.params.train.precision == "bf16":
            return torch.autocast("cuda", dtype=torch.bfloat16)
        return contextlib.nullcontext()


# --------------------------------------------------------------------------- entry point


def main(argv: list[str] | None = None, logger: MetricsLogger | None = None) -> int:
    """Train as the command line says; returns the exit code. Rank 0 logs metrics to the
    console and to `logger` (closed on return); other ranks log nothing."""
    try:
        args = parse_args(argv)
    except SystemExit as exit_:  # argparse's usage errors
        return int(exit_.code or 0)
    try:
        params = load_params(args.params, args.overrides)
    except ParamsError as err:
        print(f"error: {err}".replace("\n", "; "), file=sys.stderr)
        return EXIT_USAGE
    env = init_distributed()
    setup_logging(env.is_main)
    try:
        return run(params, args, env, logger)
    except (TrainError, DataError, VocabError, ckpt.CheckpointError) as err:
        rank = f" (rank {env.rank})" if env.distributed else ""
        print(f"error{rank}: {err}", file=sys.stderr)
        return EXIT_USAGE
    finally:
        shutdown()


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m transformer.train", description="Train (or resume) a Transformer."
    )
    parser.add_argument("params", type=Path, help="params YAML file")
    parser.add_argument("overrides", nargs="*", metavar="key=value", help="params overrides")
    parser.add_argument("--data", type=Path, required=True, help="shards folder")
    parser.add_argument("--out", type=Path, required=True, help="run folder")
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument(
        "--allow-param-change",
        action="store_true",
        help="resume even if params, data or world size differ from the checkpoint's",
    )
    mode.add_argument("--reset", action="store_true", help="delete the checkpoints, start over")
    return parser.parse_intermixed_args(argv)


def run(params: Params, args: argparse.Namespace, env: DistEnv, logger: MetricsLogger | None):
    die_with_parent()
    with prepare_run_dir(args.out, args.reset, env):
        return _run(params, args, env, logger)


def _run(params: Params, args: argparse.Namespace, env: DistEnv, logger: MetricsLogger | None):
    t = build(params, env, args.data, args.out)
    resume(t, args.allow_param_change)
    copy_vocab(t)
    if t.state.step >= params.train.max_steps:
        log.info("step %d >= train.max_steps: nothing to do", t.state.step)
        return 0
    t.net = distribute(t.model, params, env)
    if env.is_main:
        console = ConsoleLogger(params.train.max_steps, t.state.step)
        metrics_logger = TeeLogger(console, logger) if logger else console
    else:
        metrics_logger = NullLogger()
    stop = StopSignal()
    try:
        stop.install()
        return train_loop(t, metrics_logger, stop)
    finally:
        stop.restore()
        t.train_loader.close()
        metrics_logger.close()


# --------------------------------------------------------------------------- setup


@contextlib.contextmanager
def prepare_run_dir(run_dir: Path, reset: bool, env: DistEnv) -> Iterator[None]:
    """Rank 0 holds the run folder's lock for the whole run: one trainer per folder (a rerun
    that races a dying predecessor waits for it to save and exit)."""
    with contextlib.ExitStack() as held:
        if env.is_main:
            run_dir.mkdir(parents=True, exist_ok=True)
            held.enter_context(_lock(run_dir / ".lock"))
            if reset:
                shutil.rmtree(run_dir / ckpt.CHECKPOINTS, ignore_errors=True)
                log.info("--reset: deleted the checkpoints of %s", run_dir)
            ckpt.remove_partial_writes(run_dir)
        barrier()
        yield


@contextlib.contextmanager
def _lock(path: Path) -> Iterator[None]:
    with open(path, "w") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            log.warning("another trainer is running in %s: waiting for it", path.parent)
            fcntl.flock(f, fcntl.LOCK_EX)
        yield  # closing the file releases the lock, also when the process dies


def die_with_parent() -> None:
    """torchrun starts every rank in a session of its own, so a SIGKILL of torchrun (or of
    the pipeline around it) would leave the ranks training on, orphaned, beside a rerun.
    Linux can send a SIGTERM when the parent dies: the rank then saves and exits."""
    if sys.platform == "linux" and "TORCHELASTIC_RUN_ID" in os.environ:
        pr_set_pdeathsig = 1
        ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, signal.SIGTERM)
        if os.getppid() == 1:  # the parent died before the request: act on it now
            os.kill(os.getpid(), signal.SIGTERM)


def copy_vocab(t: Trainer) -> None:
    """The run folder gets the shards' sentencepiece model: the export bundles it. Only once
    the checkpoint is known to be of these shards, so a refused resume leaves it alone."""
    if t.env.is_main:
        tmp = t.run_dir / f".{SPM_NAME}.tmp"
        shutil.copyfile(t.valid.spm_model, tmp)
        os.replace(tmp, t.run_dir / SPM_NAME)


def build(params: Params, env: DistEnv, shards: Path, run_dir: Path) -> Trainer:
    cfg = params.train
    train, valid = ShardDataset(shards, "train"), ShardDataset(shards, "valid")
    sp = load_spm(train.spm_model)
    # The same seed on every rank: identical initial weights (DDP broadcasts them anyway).
    torch.manual_seed(cfg.seed)
    model = Transformer(params.model, sp.get_piece_size(), pad_id=PAD).to(env.device)
    optimizer, scheduler = build_optimizer(model, cfg, params.model.d_model)
    # Each rank its own dropout stream from here on (restored from a checkpoint instead).
    seed_everything(cfg.seed + env.rank)
    try:
        sampler = TokenBatchSampler.from_dataset(
            train, cfg.max_tokens, seed=cfg.seed, rank=env.rank, world_size=env.world_size
        )
    except ValueError as err:
        raise TrainError(f"train split of {shards}: {err}") from None
    loader = BatchLoader(
        train, sampler, prefetch=max(2, cfg.update_freq), pin_memory=env.device.type == "cuda"
    )
    t = Trainer(
        params, env, run_dir, model, optimizer, scheduler, loader, valid, sp, train.fingerprint
    )
    describe(t)
    return t


def seed_everything(seed: int) -> None:
    torch.manual_seed(seed)
    random.seed(seed)
    np.random.seed(seed % 2**32)


def describe(t: Trainer) -> None:
    cfg, env = t.params.train, t.env
    n_params = sum(p.numel() for p in t.model.parameters())
    log.info(
        "rank %d of %d on %s; model: %.2fM parameters",
        env.rank,
        env.world_size,
        env.device,
        n_params / 1e6,
    )
    if env.device.type == "cpu" and cfg.precision != "fp32":
        log.info("train.precision=%s applies on GPU only: training in fp32 on CPU", cfg.precision)
    log.info(
        "an update: %d rank(s) x %d micro-batch(es) x <= %d tokens (padding counted), "
        "so up to %d tokens; the loss is normalised by the real target tokens of the update",
        env.world_size,
        cfg.update_freq,
        cfg.max_tokens,
        env.world_size * cfg.update_freq * cfg.max_tokens,
    )


def distribute(model: Transformer, params: Params, env: DistEnv) -> nn.Module:
    """Compile (in place: state_dict keys stay unprefixed), then wrap in DDP if needed."""
    if params.train.compile:
        model.compile()
    if not env.distributed:
        return model
    device_ids = [env.device] if env.device.type == "cuda" else None
    return DistributedDataParallel(model, device_ids=device_ids, gradient_as_bucket_view=True)


# --------------------------------------------------------------------------- resume


def resume(t: Trainer, allow_change: bool) -> None:
    """Load the newest readable checkpoint, if any; refuse a different run unless allowed."""
    found = ckpt.load_latest(t.run_dir) if t.env.is_main else None
    path = broadcast_object(str(found[0]) if found else None)  # every rank the same file
    if path is None:
        log.info("no checkpoint in %s: starting at step 0", t.run_dir)
        return
    state = found[1] if found else ckpt.load_checkpoint(path)
    differences = ckpt.resume_differences(
        state, to_dict(t.params), t.fingerprint, t.env.world_size, RESUMABLE_CHANGES
    )
    if differences and not allow_change:
        raise TrainError(
            f"cannot resume from {path}: "
            + "; ".join(differences)
            + ". Rerun with --allow-param-change to continue anyway, or --reset to start over"
        )
    for line in differences:
        log.warning("resuming despite a difference (--allow-param-change): %s", line)
    load_state(t, state, path)
    log.info("resumed from %s at step %d", path, t.state.step)


def load_state(t: Trainer, state: dict, path: str) -> None:
    try:
        t.model.load_state_dict(state["model"])
        t.optimizer.load_state_dict(state["optimizer"])
    except (RuntimeError, ValueError, KeyError) as err:
        raise TrainError(f"{path}: does not fit this model: {err}") from None
    t.scheduler.load_state_dict(state["scheduler"])
    t.state.load_state_dict(state["train_state"])
    restore_data_position(t.train_loader, state["data"])
    rngs = state["rng"]
    if t.env.rank < len(rngs):
        ckpt.set_rng_state(rngs[t.env.rank])
    else:
        log.warning("no RNG state for rank %d in %s: a fresh dropout stream", t.env.rank, path)


def restore_data_position(loader: BatchLoader, saved: dict) -> None:
    """The sampler's position; if the batches changed (other world size or data, allowed),
    the same fraction of the same epoch instead."""
    try:
        loader.load_state_dict(saved)
        return
    except ValueError as err:
        log.warning("data position: %s; continuing from the same point of the epoch", err)
    old_per_rank = math.ceil(saved["n_batches"] / saved["world_size"])
    new = loader.state_dict()
    per_rank = loader.sampler.batches_per_rank
    position = min(per_rank - 1, round(saved["position"] / old_per_rank * per_rank))
    loader.load_state_dict({**new, "consumed": saved["epoch"] * per_rank + position})


# --------------------------------------------------------------------------- the loop


@dataclass
class StepResult:
    ok: bool  # loss and gradient finite: the update was applied
    loss: float  # sums over the update's target tokens, all ranks
    nll: float
    tokens: float
    grad_norm: float
    lr: float
    stop: bool  # some rank was asked to stop


def train_loop(t: Trainer, logger: MetricsLogger, stop: StopSignal) -> int:
    cfg = t.params.train
    meter = TrainMeter()
    batches = iter(t.train_loader)
    while t.state.step < cfg.max_steps:
        start = time.perf_counter()
        micro = [next(batches).to(t.env.device) for _ in range(cfg.update_freq)]
        result = train_step(t, micro, stop.requested)
        if result.ok:
            t.state.step += 1
            t.state.bad_steps = 0
            t.state.tokens_seen += int(result.tokens)
            meter.add(
                result.loss,
                result.nll,
                result.tokens,
                result.grad_norm,
                time.perf_counter() - start,
            )
            after_update(t, meter, logger, result.lr)
        elif bad_step(t, result):
            return EXIT_BAD_STEPS
        if result.stop and t.state.step < cfg.max_steps:
            return save_and_stop(t, stop)
    return 0


def train_step(t: Trainer, batches: list[Batch], stop_requested: bool) -> StepResult:
    """One update from this rank's micro-batches (gradients all-reduced after the last)."""
    tokens = torch.tensor(float(sum(b.n_tgt_tokens for b in batches)), device=t.env.device)
    all_reduce_sum(tokens)
    # DDP averages gradients over ranks: times world_size / (the update's target tokens on
    # all ranks), the result is the gradient of the update's summed loss per target token,
    # whatever the split over ranks and micro-batches.
    scale = t.env.world_size / tokens
    sums = torch.zeros(3, device=t.env.device)  # loss, nll, stop
    for i, batch in enumerate(batches):
        with sync_gradients(t.net, last=i == len(batches) - 1):
            loss, nll = forward_loss(t, batch)
            (loss * scale).backward()
        sums[0] += loss.detach()
        sums[1] += nll
    grad_norm = clip_gradients(t.model, t.params.train.clip_norm)
    sums[2] = float(stop_requested)
    all_reduce_sum(sums)
    loss, nll, stop, n_tokens, norm = torch.cat([sums, tokens[None], grad_norm[None]]).tolist()
    ok = math.isfinite(loss) and math.isfinite(norm)  # the same on every rank: all-reduced
    lr = t.optimizer.param_groups[0]["lr"]
    if ok:
        t.optimizer.step()
        t.scheduler.step()
    t.optimizer.zero_grad(set_to_none=True)
    return StepResult(ok, loss, nll, n_tokens, norm, lr, stop > 0)


def sync_gradients(net: nn.Module, last: bool):
    """All-reduce only on the update's last micro-batch (DDP's no_sync for the others)."""
    if isinstance(net, DistributedDataParallel) and not last:
        return net.no_sync()
    return contextlib.nullcontext()


def forward_loss(t: Trainer, batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
    """Summed label-smoothed loss (what is optimised) and summed NLL (what is reported)."""
    eps = t.params.train.label_smoothing
    with t.autocast():
        logits = t.net(batch.src, batch.tgt_in)  # (B, T, V)
    loss, _ = label_smoothed_nll(logits, batch.tgt_out, eps, PAD)
    if eps == 0:
        return loss, loss.detach()
    with torch.no_grad():
        nll = F.cross_entropy(
            logits.flatten(0, 1).float(),
            batch.tgt_out.flatten(),
            ignore_index=PAD,
            reduction="sum",
        )
    return loss, nll


def clip_gradients(model: nn.Module, clip_norm: float) -> torch.Tensor:
    """The global gradient norm (always, for the log and the finiteness check); clipped to
    `clip_norm` when it is > 0. After DDP's all-reduce every rank holds the same gradients."""
    params = [p for p in model.parameters() if p.grad is not None]
    norm = torch.nn.utils.get_total_norm([p.grad for p in params])
    if clip_norm > 0:
        torch.nn.utils.clip_grads_with_norm_(params, clip_norm, norm)
    return norm


def bad_step(t: Trainer, result: StepResult) -> bool:
    """Count a skipped update; True when there were too many in a row."""
    t.state.bad_steps += 1
    t.state.bad_steps_total += 1
    limit = t.params.train.max_bad_steps
    log.warning(
        "non-finite %s after step %d: update skipped (%d in a row, train.max_bad_steps=%d)",
        "loss" if not math.isfinite(result.loss) else "gradient",
        t.state.step,
        t.state.bad_steps,
        limit,
    )
    if t.state.bad_steps < limit:
        return False
    saved = ckpt.list_checkpoints(t.run_dir)
    log.error(
        "stopping: %d non-finite updates in a row; the last good checkpoint is %s",
        limit,
        saved[-1] if saved else "none (no checkpoint was written)",
    )
    return True


def after_update(t: Trainer, meter: TrainMeter, logger: MetricsLogger, lr: float) -> None:
    """Log, validate and checkpoint on their schedules (and all three at the last step)."""
    cfg, step = t.params.train, t.state.step
    last = step == cfg.max_steps
    if step % cfg.log_every == 0 or last:
        logger.log(meter.metrics(lr, t.state.bad_steps_total), step)
    improved = False
    if step % cfg.valid_every == 0 or last:
        metrics = validate(t)
        logger.log(metrics, step)
        improved = metrics["valid/loss"] < t.state.best_valid_loss
        if improved:
            t.state.best_valid_loss = metrics["valid/loss"]
    if step % cfg.save_every == 0 or last or improved:
        save(t, due=step % cfg.save_every == 0 or last, best=improved)


def save_and_stop(t: Trainer, stop: StopSignal) -> int:
    if t.saved_step != t.state.step:
        save(t, due=True, best=False)
    signum = stop.signum or signal.SIGTERM  # another rank may have been the one signalled
    log.warning(
        "stopped by %s at step %d, checkpoint saved", signal.Signals(signum).name, t.state.step
    )
    return 128 + signum


# --------------------------------------------------------------------------- checkpoints


def save(t: Trainer, due: bool, best: bool) -> None:
    """A step checkpoint if `due`, and/or the best one; a collective (every rank's RNG)."""
    state = checkpoint_state(t)
    if due:
        t.saved_step = t.state.step
    if t.env.is_main:
        keep = t.params.train.keep_last
        saved = ckpt.save_checkpoint(t.run_dir, state, keep) if due else None
        if best:
            ckpt.link_best(t.run_dir, saved) if saved else ckpt.save_best(t.run_dir, state)
    barrier()


def checkpoint_state(t: Trainer) -> dict[str, Any] | None:
    """What resuming needs, and what makes the file describe itself (None off rank 0)."""
    rngs = all_gather_objects(ckpt.rng_state())
    if not t.env.is_main:
        return None
    return {
        "params": to_dict(t.params),
        "step": t.state.step,
        "train_state": t.state.state_dict(),
        "model": t.model.state_dict(),
        "optimizer": t.optimizer.state_dict(),
        "scheduler": t.scheduler.state_dict(),
        # Ranks step in lockstep: rank 0's sampler position restores every rank.
        "data": t.train_loader.state_dict(),
        "rng": rngs,  # one per rank
        "data_fingerprint": t.fingerprint,
        "world_size": t.env.world_size,
        "torch_version": str(torch.__version__),  # TorchVersion is no safe global
    }


# --------------------------------------------------------------------------- validation


def validate(t: Trainer) -> dict[str, float]:
    """valid/loss: NLL per target token without label smoothing (natural log), over the
    whole valid split shared out by rank; valid/ppl = exp(valid/loss), per subword as the
    paper's 4.92. valid/bleu: sacreBLEU of greedy decoding, when train.valid_bleu."""
    t.model.eval()
    try:
        sums = torch.zeros(2, dtype=torch.float64, device=t.env.device)
        with torch.no_grad():
            for batch in valid_loader(t):
                batch = batch.to(t.env.device)
                with t.autocast():
                    logits = t.model(batch.src, batch.tgt_in)
                nll = F.cross_entropy(
                    logits.flatten(0, 1).float(),
                    batch.tgt_out.flatten(),
                    ignore_index=PAD,
                    reduction="sum",
                )
                sums += torch.stack([nll.double(), nll.new_tensor(batch.n_tgt_tokens).double()])
        nll_sum, n_tokens = all_reduce_sum(sums).tolist()
        loss = nll_sum / n_tokens
        metrics = {"valid/loss": loss, "valid/ppl": math.exp(min(loss, 100.0))}
        if t.params.train.valid_bleu:
            metrics["valid/bleu"] = valid_bleu(t)
        return metrics
    finally:
        t.model.train()


def valid_loader(t: Trainer) -> BatchLoader:
    # Valid sentences are not length-filtered: let the longest fit in a batch of its own.
    max_tokens = max(t.params.train.max_tokens, int(t.valid.lengths.max()))
    try:
        sampler = TokenBatchSampler.from_dataset(
            t.valid, max_tokens, shuffle=False, rank=t.env.rank, world_size=t.env.world_size
        )
    except ValueError as err:
        raise TrainError(f"valid split: {err}") from None
    return BatchLoader(t.valid, sampler, epoch=0)


def valid_bleu(t: Trainer) -> float:
    """Greedy decoding of this rank's share, gathered; scored on rank 0 (0.0 elsewhere)."""
    from transformer.evaluate import score  # sacrebleu: only when asked for
    from transformer.search import greedy_search

    decode = t.params.decode
    pairs = []
    for batch in valid_loader(t):
        hyps = greedy_search(
            t.model, batch.src.to(t.env.device), decode.max_len_a, decode.max_len_b
        )
        refs = [[i for i in row if i not in (PAD, EOS)] for row in batch.tgt_out.tolist()]
        pairs += zip(batch.ids.tolist(), t.sp.decode(hyps), t.sp.decode(refs), strict=True)
    gathered = all_gather_objects(pairs)
    if not t.env.is_main:
        return 0.0
    ordered = sorted(p for part in gathered for p in part)
    return float(score([h for _, h, _ in ordered], [r for _, _, r in ordered])["bleu"])


# --------------------------------------------------------------------------- signals


class StopSignal:
    """SIGTERM/SIGINT ask the loop to stop after the current update (and save); a second
    one stops at once."""

    def __init__(self):
        self.signum: int | None = None
        self._previous: dict[int, Any] = {}

    @property
    def requested(self) -> bool:
        return self.signum is not None

    def install(self) -> None:
        with contextlib.suppress(ValueError):  # not the main thread: no handlers there
            for sig in (signal.SIGTERM, signal.SIGINT):
                self._previous[sig] = signal.signal(sig, self._handle)

    def restore(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()

    def _handle(self, signum: int, frame) -> None:
        if self.signum is not None:
            raise KeyboardInterrupt
        self.signum = signum
        log.warning("%s: stopping after this update", signal.Signals(signum).name)


if __name__ == "__main__":
    sys.exit(main())
