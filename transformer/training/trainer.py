"""The trainer: a set of stateful parts (model, optimizer, schedule, data position, every
rank's RNG, progress, early stopping, the checkpoint manager), each with `state_dict` /
`load_state_dict`, saved together by the checkpoint manager, and the loop over them
(`fit`). The command that builds and runs it: transformer/train.py.

An update whose loss or gradient is not finite is skipped on the device (its batch is used
up, its step counted, the weights and Adam's moments left as they were) and counted when the
host next reads the metrics: every train.log_every updates, and at each validation and
checkpoint; no update waits for the GPU to report. With several ranks, a stop signal is
agreed one update late.
"""

from __future__ import annotations

import contextlib
import logging
import random
import signal
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.nn.parallel import DistributedDataParallel

from transformer.cli import UserError
from transformer.config import ModelConfig, Params, to_dict
from transformer.data.dataset import Batch, ShardDataset
from transformer.data.loader import BatchLoader
from transformer.data.sampler import TokenBatchSampler
from transformer.data.shard import verify_shards
from transformer.data.vocab import load_spm
from transformer.model_file import load_typed
from transformer.nn import kernels
from transformer.nn.kv_cache import Arena
from transformer.nn.loss import label_smoothed_loss
from transformer.nn.model import Transformer
from transformer.tokens import PAD
from transformer.training.checkpoint import (
    STATE_FORMAT,
    CheckpointManager,
    RankRNG,
    resume_differences,
)
from transformer.training.distributed import DistEnv, all_reduce_sum, barrier, broadcast_object
from transformer.training.lifecycle import StopSignal
from transformer.training.metrics import MetricsLogger, TrainMeter
from transformer.training.optim import (
    build_optimizer,
    clip_gradients,
    cooldown_start,
    in_cooldown,
    resync_lr,
    with_these_kernels,
)
from transformer.training.plan import batch_plan, log_plan
from transformer.training.precision import ComputeWeights
from transformer.training.validate import EarlyStopping, validate

log = logging.getLogger("transformer.train")  # not "__main__" under -m

EXIT_BAD_STEPS, EXIT_USAGE = 1, 2


class TrainError(UserError, RuntimeError):
    """Training cannot start as asked; the message says why (exit code 2)."""


@dataclass
class Progress:
    step: int = 0  # updates taken, a skipped (non-finite) one included
    bad_steps: int = 0  # non-finite updates in a row
    bad_steps_total: int = 0
    tokens_seen: int = 0  # target tokens of the applied updates, all ranks

    def state_dict(self) -> dict[str, Any]:
        return asdict(self)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for key, value in state.items():
            setattr(self, key, value)


class Trainer:
    """Everything a run needs; `model` is the bare module, `net` what a step calls (DDP
    around it with several ranks, compiled if asked)."""

    def __init__(self, params: Params, env: DistEnv, shards: Path, run_dir: Path):
        cfg = self.cfg = params.train
        # bf16 autocast with fp32 master weights, on a GPU or a CPU with bf16 instructions
        # (elsewhere a CPU emulates bf16, slower than fp32: it trains in fp32).
        bf16_here = env.device.type == "cuda" or kernels.CPU_BF16 is not None
        self.bf16 = cfg.precision == "bf16" and bf16_here
        self.params, self.env, self.run_dir = params, env, run_dir
        if env.device.type == "cuda":  # fp32 matmuls (fp32 runs, the loss) on tensor cores
            torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = True
        if env.is_main:  # sizes always, checksums once per shards folder
            verify_shards(shards)
        barrier()
        train = ShardDataset(shards, "train")
        self.valid, self.fingerprint = ShardDataset(shards, "valid"), train.fingerprint
        # The validation searches' cache memory, one for the run: an arena a validation,
        # freed after it, left glibc's heap larger at every validation on a CPU.
        self.arena = Arena()
        _check_positions(params.model, shards, {"train": train, "valid": self.valid})
        self.sp = load_spm(train.spm_model)
        torch.manual_seed(cfg.seed)  # the same initial weights on every rank
        self.model = Transformer(params.model, self.sp.get_piece_size(), PAD).to(env.device)
        self.weights = ComputeWeights(self.model, self.bf16)  # bf16 copies of the layers'
        self.optimizer, self.scheduler = build_optimizer(self.model, cfg, params.model.d_model)
        seed_everything(cfg.seed + env.rank)  # each rank its own dropout stream from here
        self.update_freq, micro = batch_plan(cfg.batch_tokens, cfg.max_tokens, env.world_size)
        try:
            sampler = TokenBatchSampler.from_dataset(
                train,
                micro,
                seed=cfg.seed,
                rank=env.rank,
                world_size=env.world_size,
                shape_classes=cfg.shape_classes,
            )
        except ValueError as err:
            raise TrainError(f"train split of {shards}: {err}") from None
        cuda = env.device.type == "cuda"
        self.loader = BatchLoader(train, sampler, prefetch=self.update_freq + 1, pin_memory=cuda)
        self.progress = Progress()
        self.stopping = EarlyStopping(cfg.best_metric, cfg.patience)
        self.checkpoints = CheckpointManager(
            run_dir, cfg.keep_last, cfg.keep_best, self.stopping.higher_is_better,
            branch_point=cooldown_start(cfg.max_steps, cfg.cooldown),
            save_every=cfg.save_every, last_step=cfg.max_steps,
        )  # fmt: skip
        self.parts = {
            "model": self.model,
            "optimizer": self.optimizer,
            "scheduler": self.scheduler,
            "data": self.loader,
            "rng": RankRNG(env.rank),
            "progress": self.progress,
            "early_stopping": self.stopping,
            "checkpoints": self.checkpoints,
        }
        self.net: torch.nn.Module = self.weights.net
        self.saved_step: int | None = None  # the step of the last state this run wrote
        self.meter = TrainMeter(env.device)
        self._vote: torch.Tensor | None = None  # the last update's stop flag, all ranks

    def log_plan(self) -> None:
        """What the run is about to do, in the log (plan.log_plan)."""
        micro, branch = self.loader.sampler.max_tokens, self.checkpoints.branch_point is not None
        log_plan(self.cfg, self.env, self.model, self.bf16, self.update_freq, micro,
                 self.run_dir, branch)  # fmt: skip

    def autocast(self):
        if self.bf16:
            return torch.autocast(self.env.device.type, dtype=torch.bfloat16)
        return contextlib.nullcontext()

    @property
    def finished(self) -> bool:
        return self.progress.step >= self.cfg.max_steps or self.stopping.stopped

    # ------------------------------------------------------------------- resume

    def resume(self, allow_change: bool, init_from: Path | None = None) -> None:
        """Load the newest readable state, if any; refuse another run unless allowed. A run
        folder with none starts from `init_from`, another run's state, if given: a branch
        (another cooldown from a held-lr state), whose params differences are expected."""
        chosen = self.choose_state(init_from)
        if chosen is None:
            log.info("no checkpoint in %s: starting at step 0", self.run_dir)
            return
        path, state, branch = chosen
        differences = resume_differences(state["params"], to_dict(self.params))
        if branch:
            log.info("branching from %s at step %d", path, state["step"])
            for line in differences:
                log.info("branching with another value: %s", line)
            differences = []
        if state["data_fingerprint"] != self.fingerprint:
            differences.append(
                f"data fingerprint {state['data_fingerprint']} in checkpoint, "
                f"{self.fingerprint} now: other shards"
            )
        if differences and not allow_change:
            raise TrainError(
                f"cannot {'branch' if branch else 'resume'} from {path}: "
                f"{'; '.join(differences)}. Rerun with --allow-param-change to continue "
                "anyway" + ("" if branch else ", or --reset to start over")
            )
        for line in differences:
            log.warning("resuming despite a difference (--allow-param-change): %s", line)
        was = state["params"]["train"]["max_steps"]
        if self.cfg.cooldown and was != self.cfg.max_steps:
            log.warning("train.max_steps %d -> %d: the lr cooldown (train.cooldown %g) moves to "
                        "the new end", was, self.cfg.max_steps, self.cfg.cooldown)  # fmt: skip
        state["optimizer"] = with_these_kernels(self.optimizer, state["optimizer"])
        try:
            for name, part in self.parts.items():
                if name == "checkpoints" and branch and self.env.is_main:
                    # Last, once the run is known to fit: its index names the source's files.
                    self.adopt_branch_snapshots(path, state["checkpoints"])
                part.load_state_dict(state[name])
        except (RuntimeError, ValueError, KeyError) as err:
            raise TrainError(f"{path}: does not fit this run: {err}") from None
        resync_lr(self.optimizer, self.scheduler)
        self.weights.refresh()
        self.meter = TrainMeter(self.env.device, self.progress.bad_steps)
        self.meter.load_state_dict(None if branch else state.get("meter"))
        if branch:  # the folder's own first state: a rerun resumes it, not the source
            self.save_state()
        self.saved_step = self.progress.step
        log.info("resumed from %s at step %d", path, self.progress.step)

    def choose_state(self, init_from: Path | None) -> tuple[Path, dict, bool] | None:
        """(path, state, is a branch): this folder's newest state (rank 0 finds it, every
        rank loads that file) or, if it has none, `init_from`, which every rank loads itself,
        so that a wrong file fails on all of them alike."""
        found = self.checkpoints.load_latest() if self.env.is_main else None
        own = broadcast_object(str(found[0]) if found else None)
        if own is not None:
            if init_from is not None:
                log.info("--init-from ignored: %s has a state of its own", self.run_dir)
            state = found[1] if found else load_typed(own, STATE_FORMAT, mmap=True)
            return Path(own), state, False
        if init_from is None:
            return None
        return init_from, load_typed(init_from, STATE_FORMAT, mmap=True), True

    def adopt_branch_snapshots(self, state_path: Path, index: dict[str, Any]) -> None:
        source = state_path.resolve().parent.parent  # RUN/checkpoints/state-*.pt
        missing = self.checkpoints.adopt_snapshots(source, index)
        if missing:
            log.warning("branching: the snapshots of step(s) %s, kept by that state, are gone "
                        "from %s: averages will lack them", missing, source)  # fmt: skip

    # ------------------------------------------------------------------- the loop

    def fit(self, logger: MetricsLogger, stop: StopSignal) -> int:
        batches = iter(self.loader)
        self.meter.pause()
        while not self.finished:
            micro = [next(batches).to(self.env.device) for _ in range(self.update_freq)]
            lr = self.optimizer.param_groups[0]["lr"]
            self.step(micro)
            self.progress.step += 1
            stopping = self.agreed_stop(stop.requested)
            if self.due() and (code := self.after_update(logger, lr)) is not None:
                return code
            if stopping and not self.finished:
                return self.save_and_stop(stop)
        return 0

    def step(self, batches: list[Batch]) -> None:
        """One update from this rank's micro-batches (gradients all-reduced after the last),
        queued with no host read: a non-finite update is skipped on the device."""
        self.schedule_dropout()
        dev, world = self.env.device, self.env.world_size
        # A fill, not a copy from the host: no sync. DDP averages gradients over ranks, so
        # times world / (the update's target tokens on all ranks) the gradient is that of the
        # update's summed loss per target token, however it is split.
        tokens = torch.full((), float(sum(b.n_tgt_tokens for b in batches)), device=dev)
        scale = world / all_reduce_sum(tokens)
        sums = torch.zeros(2, device=dev)  # loss, nll
        for i, batch in enumerate(batches):
            with self.sync_gradients(last=i == len(batches) - 1):
                loss, nll = self.forward_loss(batch)
                (loss * scale).backward()
            sums += torch.stack([loss.detach(), nll])
        self.weights.grads_to_master()
        grad_norm = clip_gradients(self.model, self.cfg.clip_norm)
        loss, nll = all_reduce_sum(sums).unbind()
        self.optimizer.found_inf = self.meter.add(loss, nll, tokens, grad_norm)
        self.optimizer.step()
        self.scheduler.step()
        self.weights.refresh()
        self.optimizer.zero_grad(set_to_none=True)

    def agreed_stop(self, requested: bool) -> bool:
        """Whether some rank was asked to stop. One rank: its own signal. Several: each update
        all-reduces the ranks' flags and the host reads the previous update's, done by now,
        so that every rank stops after the same update without waiting for this one."""
        if not self.env.distributed:
            return requested
        flag = all_reduce_sum(torch.full((), float(requested), device=self.env.device))
        previous, self._vote = self._vote, flag
        return previous is not None and previous.item() > 0

    def due(self) -> bool:
        """Whether this update ends with a read: a log, a validation, a checkpoint, the end."""
        cfg, step = self.cfg, self.progress.step
        every = (cfg.log_every, cfg.valid_every, cfg.save_every)
        branch = step == self.checkpoints.branch_point
        return self.finished or branch or any(step % n == 0 for n in every)

    def schedule_dropout(self) -> None:
        """This update's model.dropout: train.cooldown_dropout in the cooldown. Checked at
        every update, so a resume, or a max_steps that moves the cooldown, gets it right."""
        cfg, step = self.cfg, self.progress.step + 1
        lower = cfg.cooldown_dropout is not None and in_cooldown(step, cfg.max_steps, cfg.cooldown)
        rate = cfg.cooldown_dropout if lower else self.params.model.dropout
        if rate != self.model.dropout.p:
            log.info("update %d on: model.dropout %g (train.cooldown_dropout)", step, rate)
            self.model.set_dropout(rate)

    def sync_gradients(self, last: bool):
        """All-reduce only on the update's last micro-batch (DDP's no_sync for the others)."""
        if isinstance(self.net, DistributedDataParallel) and not last:
            return self.net.no_sync()
        return contextlib.nullcontext()

    def forward_loss(self, batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
        """Summed label-smoothed loss (optimised) and NLL (reported), over the non-padding
        target positions only, from one log-softmax (loss.py). With train.rdrop_alpha the
        batch goes through twice in one forward, stacked: two dropout masks."""
        cfg = self.cfg
        passes = 2 if cfg.rdrop_alpha else 1
        src, tgt_in = batch.src, batch.tgt_in
        if passes == 2:
            src, tgt_in = src.repeat(2, 1), tgt_in.repeat(2, 1)
        with self.autocast():
            hidden = self.net(src, tgt_in, project=False)  # (P * B, T, D)
        hidden = hidden.unflatten(0, (passes, -1)).flatten(1, 2)  # (P, B * T, D)
        rows = hidden.index_select(1, batch.tgt_positions).squeeze(0)  # (N, D) or (2, N, D)
        targets = batch.tgt_out.flatten().index_select(0, batch.tgt_positions)  # (N,)
        with self.autocast():
            return label_smoothed_loss(
                rows,
                self.model.out_proj.weight,
                targets,
                cfg.label_smoothing,
                cfg.rdrop_alpha,
                compiled=cfg.compile,
            )

    def count_bad_steps(self) -> bool:
        """Read the meter; count the skipped updates. True when too many came in a row."""
        p, limit = self.progress, self.cfg.max_bad_steps
        bad, p.bad_steps, longest, tokens = self.meter.read()
        p.bad_steps_total += bad
        p.tokens_seen += tokens
        if bad:
            log.warning("non-finite loss or gradient: %d update(s) skipped up to step %d "
                        "(%d in a row now, train.max_bad_steps=%d)",
                        bad, p.step, p.bad_steps, limit)  # fmt: skip
        if longest < limit:
            return False
        last = "none" if self.saved_step is None else f"step {self.saved_step}"
        log.error("stopping: %d non-finite updates in a row; the last saved state: %s",
                  limit, last)  # fmt: skip
        return True

    def after_update(self, logger: MetricsLogger, lr: float) -> int | None:
        """Read the metrics; log, validate and checkpoint on their schedules (and all three at
        the end). An exit code if the run must stop."""
        cfg, step = self.cfg, self.progress.step
        if self.count_bad_steps():
            return EXIT_BAD_STEPS
        last = step == cfg.max_steps
        if step % cfg.log_every == 0 or last:
            metrics = self.meter.metrics(lr, self.progress.bad_steps_total)
            logger.log({**metrics, "train/epoch": self.loader.epochs_done}, step)
        improved, score = False, None
        if step % cfg.valid_every == 0 or last:
            metrics = validate(self.model, self.valid, self.sp, self.params, self.env,
                               self.autocast(), self.arena)  # fmt: skip
            improved = self.stopping.update(metrics, step)
            score = metrics[self.stopping.key]
            logger.log({**metrics, "valid/best": self.stopping.best}, step)
            if self.stopping.stopped:
                log.info("early stop: no better %s in %d validations; the best, %.4g, at "
                         "step %d", self.stopping.key, cfg.patience, self.stopping.best,
                         self.stopping.best_step)  # fmt: skip
        due = step % cfg.save_every == 0 or self.finished
        if due or (improved and cfg.keep_best > 0):
            self.save(score, full=due)
        if step == self.checkpoints.branch_point and not due:  # kept for more cooldowns
            self.save_state()
        self.meter.pause()
        return None

    def save_and_stop(self, stop: StopSignal) -> int:
        """The training state only: a model snapshot off the `save_every` cadence would
        enter the averages, which a resumed run must end with as if never stopped."""
        if self.count_bad_steps():
            return EXIT_BAD_STEPS
        if self.saved_step != self.progress.step:
            self.save_state()
            barrier()
        signum = stop.signum or signal.SIGTERM  # another rank may have been the one signalled
        name = signal.Signals(signum).name
        log.warning("stopped by %s at step %d, checkpoint saved", name, self.progress.step)
        return 128 + signum

    # ------------------------------------------------------------------- checkpoints

    def save(self, score: float | None, full: bool) -> None:
        """A model snapshot (for averaging) and, if `full`, the training state; a collective
        (every rank's RNG is gathered)."""
        step = self.progress.step
        if self.env.is_main:
            meta = {
                "params": to_dict(self.params),
                "data_fingerprint": self.fingerprint,
                "metric": self.stopping.key,
                "higher_is_better": self.stopping.higher_is_better,
            }
            self.checkpoints.snapshot(step, meta, self.model.state_dict(), score)
        if full:
            self.save_state()
        barrier()

    def save_state(self) -> None:
        """The training state (a collective: every rank's RNG is gathered)."""
        state = {name: part.state_dict() for name, part in self.parts.items()}
        state["meter"] = self.meter.state_dict()  # read by count_bad_steps before any save
        if self.env.is_main:
            self.checkpoints.save_state(self.progress.step, {**self.describe_state(), **state})
        self.saved_step = self.progress.step

    def describe_state(self) -> dict[str, Any]:
        return {
            "params": to_dict(self.params),
            "step": self.progress.step,
            "data_fingerprint": self.fingerprint,
            "world_size": self.env.world_size,
            "torch_version": str(torch.__version__),  # TorchVersion is no safe global
        }


def _check_positions(cfg: ModelConfig, shards: Path, splits: dict[str, ShardDataset]) -> None:
    """Learned positions must hold the longest sequence of the splits the trainer reads (the
    params' own bound, Params._positions_fit, counts words, and a word may be several
    subwords): refused before the first step, not a crash at the batch that holds it."""
    if cfg.positional != "learned":
        return
    for role, split in splits.items():
        longest = int(split.lengths.max(initial=0))  # EOS included
        if longest > cfg.max_positions:
            raise TrainError(
                f"model.max_positions: {cfg.max_positions} learned positions, but {shards} "
                f"holds a {role} sequence of {longest} subwords"
            )


def seed_everything(seed: int) -> None:
    torch.manual_seed(seed)
    random.seed(seed)
    np.random.seed(seed % 2**32)
