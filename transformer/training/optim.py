"""Adam with the paper's warmup then inverse-square-root learning rate (section 5.3), or a
constant one after the warmup, an optional cooldown to zero at the end, linear or 1-sqrt
(constant then cooldown is warmup-stable-decay, torchtitan's `decay_ratio` and
`decay_type`), and the gradient norm
(clipping is off in the paper, available here)."""

from __future__ import annotations

import math

import torch
from torch import nn
from torch.optim.lr_scheduler import LambdaLR

from transformer.config import TrainConfig


def inverse_sqrt_schedule(
    step: int, d_model: int, warmup_steps: int, lr_scale: float = 1.0, decay: bool = True
) -> float:
    """lrate = lr_scale * d_model^-0.5 * min(step^-0.5, step * warmup_steps^-1.5), step >= 1:
    linear warmup for `warmup_steps` updates, then decay with 1 / sqrt(step); without
    `decay`, the peak (its value at warmup_steps) from there on."""
    step = max(step, 1)
    after = step**-0.5 if decay else warmup_steps**-0.5
    return lr_scale * d_model**-0.5 * min(after, step * warmup_steps**-1.5)


def cooldown_factor(step: int, max_steps: int, cooldown: float, shape: str = "linear") -> float:
    """1 before the last `cooldown` fraction of `max_steps` updates, then falling to ~0 at
    update `max_steps` as 1 - x ("linear", to 1 / (window + 1)) or 1 - sqrt(x) ("1-sqrt":
    steeper at first, longer near zero), x the fraction of the window gone: a run that must
    end at a given step ends annealed (a lower loss than its inverse-sqrt lr leaves; 1-sqrt
    the lower of the two, Hagele et al. 2024)."""
    start = cooldown_start(max_steps, cooldown)
    if start is None or step <= start:
        return 1.0
    left = max(0.0, (max_steps + 1 - step) / (max_steps - start + 1))  # 1 - x
    return 1.0 - math.sqrt(1.0 - left) if shape == "1-sqrt" else left


def cooldown_start(max_steps: int, cooldown: float) -> int | None:
    """The last update before the cooldown, the last `cooldown` fraction of `max_steps`
    (ceil(cooldown * max_steps) updates; its held-lr state is where further cooldowns
    branch from), or None with no cooldown."""
    window = math.ceil(cooldown * max_steps)
    return max_steps - window if window > 0 else None


def in_cooldown(step: int, max_steps: int, cooldown: float) -> bool:
    """Whether update `step` (counted from 1) is in the cooldown."""
    start = cooldown_start(max_steps, cooldown)
    return start is not None and step > start


def build_optimizer(
    model: nn.Module, cfg: TrainConfig, d_model: int
) -> tuple[torch.optim.Adam, LambdaLR]:
    """Adam (beta1 0.9, beta2 0.98, eps 1e-9 in the paper) and a LambdaLR for the schedule.

    The base lr is 1.0, so the multiplier is the absolute lr. LambdaLR applies lambda(0)
    at construction and lambda(k) after the k-th `scheduler.step()`; the lambda shifts by
    one so that update k (counted from 1, as the paper does) runs at schedule(k).
    Call `scheduler.step()` after each `optimizer.step()`. With `cfg.cooldown` the lr
    depends on `cfg.max_steps`: extending a run moves the cooldown to its new end.
    """
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.Adam(
        params,
        lr=1.0,
        betas=tuple(cfg.adam_betas),
        eps=cfg.adam_eps,
        weight_decay=cfg.weight_decay,
        # One kernel for all parameters, and an update skipped on the device when the
        # trainer sets `found_inf` (a non-finite loss or gradient), as GradScaler does.
        fused=True,
    )
    scheduler = LambdaLR(
        optimizer,
        lambda k: (
            inverse_sqrt_schedule(
                k + 1, d_model, cfg.warmup_steps, cfg.lr_scale, cfg.decay == "inverse_sqrt"
            )
            * cooldown_factor(k + 1, cfg.max_steps, cfg.cooldown, cfg.cooldown_shape)
        ),
    )
    return optimizer, scheduler


def resync_lr(optimizer: torch.optim.Optimizer, scheduler: LambdaLR) -> None:
    """After loading a saved optimizer and schedule: the next update's lr under today's
    schedule, not the one saved (which a changed max_steps moves, with a cooldown)."""
    for group, schedule in zip(optimizer.param_groups, scheduler.lr_lambdas, strict=True):
        group["lr"] = group["initial_lr"] * schedule(scheduler.last_epoch)


def with_these_kernels(optimizer: torch.optim.Optimizer, saved: dict) -> dict:
    """`saved` (an optimizer's state_dict) with `optimizer`'s kernel choice (fused on a GPU)
    in each param group, to load in its place. load_state_dict restores the saved flags,
    and puts each step count on the GPU only if they say fused: a state saved on a CPU
    would step unfused on a GPU, or, fused afterwards, with its step counts on the host."""
    mine = {key: optimizer.defaults[key] for key in ("fused", "foreach")}
    return {**saved, "param_groups": [{**group, **mine} for group in saved["param_groups"]]}


def clip_gradients(model: torch.nn.Module, clip_norm: float) -> torch.Tensor:
    """The global gradient norm (always, for the log and the finiteness check); clipped to
    `clip_norm` when it is > 0. After DDP's all-reduce every rank holds the same gradients."""
    params = [p for p in model.parameters() if p.grad is not None]
    norm = torch.nn.utils.get_total_norm([p.grad for p in params])
    if clip_norm > 0:
        torch.nn.utils.clip_grads_with_norm_(params, clip_norm, norm)
    return norm
