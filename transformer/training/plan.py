"""The shape of a run before it starts: how an update is split over ranks and
micro-batches, and what the log says of the run's devices, kernels and disk."""

from __future__ import annotations

import logging
import math
import shutil
from pathlib import Path

from torch import nn

from transformer.config import TrainConfig
from transformer.files import CHECKPOINTS
from transformer.nn import kernels
from transformer.nn.attention import describe as describe_attention
from transformer.training.checkpoint import KEEP_STATES
from transformer.training.distributed import DistEnv

log = logging.getLogger("transformer.train")


def batch_plan(batch_tokens: int, max_tokens: int, world_size: int) -> tuple[int, int]:
    """(update_freq, tokens per micro-batch): the fewest micro-batches per rank for which
    `batch_tokens` of an update, shared out over the ranks, fit `max_tokens` each."""
    update_freq = math.ceil(batch_tokens / (world_size * max_tokens))
    return update_freq, batch_tokens // (world_size * update_freq)


def log_plan(
    cfg: TrainConfig,
    env: DistEnv,
    model: nn.Module,
    bf16: bool,
    update_freq: int,
    micro_tokens: int,
    run_dir: Path,
    branch: bool,
) -> None:
    """What the run is about to do, in the log: kernels, ranks, the update's shape, the
    disk its checkpoints need (a warning if they may not fit). `bf16`: whether it trains
    in bf16 autocast; `update_freq` micro-batches of at most `micro_tokens` tokens an
    update (`batch_plan`); `branch`: whether it keeps a state at its cooldown's start."""
    n_params = sum(p.numel() for p in model.parameters())
    log.info(describe_attention(env.device))
    log.info(kernels.describe(env.device))
    log.info("rank %d of %d on %s; model: %.2fM parameters",
             env.rank, env.world_size, env.device, n_params / 1e6)  # fmt: skip
    if env.device.type == "cpu" and cfg.precision == "bf16":
        if bf16:
            log.info("train.precision=bf16: bf16 autocast on this CPU's %s (fp32 master "
                     "weights; attention in fp32)", kernels.CPU_BF16.upper())  # fmt: skip
        else:
            log.info("train.precision=bf16: this CPU has no bf16 instructions "
                     "(AVX512_BF16, AMX): training in fp32")  # fmt: skip
    log.info("an update: %d rank(s) x %d micro-batch(es) of <= %d tokens (batch_tokens %d, "
             "padding counted); the loss is normalised by its real target tokens",
             env.world_size, update_freq, micro_tokens, cfg.batch_tokens)  # fmt: skip
    if cfg.rdrop_alpha:
        log.info("R-Drop (train.rdrop_alpha %g): each micro-batch goes through the "
                 "model twice, stacked: up to %d tokens a forward pass",
                 cfg.rdrop_alpha, 2 * micro_tokens)  # fmt: skip
    # fp32 weights; a training state adds Adam's two moments. One more of each while a
    # new file is written beside the one it replaces, and the cooldown's first state.
    model_gb = n_params * 4 / 1e9
    states, snapshots = KEEP_STATES + 1 + branch, cfg.keep_last + cfg.keep_best + 1
    need = states * 3 * model_gb + snapshots * model_gb
    free = shutil.disk_usage(run_dir).free / 1e9
    log.info("disk: up to %.1f GB in %s (%d training states of %.2f GB, %d snapshots "
             "of %.2f GB); %.1f GB free", need, run_dir / CHECKPOINTS, states,
             3 * model_gb, snapshots, model_gb, free)  # fmt: skip
    if need > free:
        log.warning("the checkpoints may not fit: %.1f GB needed, %.1f GB free", need, free)
