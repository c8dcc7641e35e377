"""Label smoothing and the learning-rate schedule against hand-computed values."""

import copy
import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from transformer.config import TrainConfig
from transformer.loss import label_smoothed_nll
from transformer.optim import build_optimizer, inverse_sqrt_schedule

PAD = 0


def test_label_smoothing_hand_computed():
    # p = (1/4, 1/2, 1/4), target 1: nll = ln 2, mean_v(-log p) = (2 + 1 + 2) ln 2 / 3.
    logits = torch.log(torch.tensor([[1.0, 2.0, 1.0], [5.0, 1.0, 1.0]]))
    loss, n = label_smoothed_nll(logits, torch.tensor([1, PAD]), eps=0.1, ignore_index=PAD)
    assert n.item() == 1
    assert loss.item() == pytest.approx(0.9 * math.log(2) + 0.1 * 5 / 3 * math.log(2), rel=1e-6)


@pytest.mark.parametrize("eps", [0.0, 0.1, 0.2])
def test_label_smoothing_matches_torch_cross_entropy(eps):
    torch.manual_seed(0)
    logits = torch.randn(3, 5, 11) * 3
    target = torch.randint(1, 11, (3, 5))
    target[0, 3:] = PAD
    loss, n = label_smoothed_nll(logits, target, eps=eps, ignore_index=PAD)
    expected = F.cross_entropy(
        logits.view(-1, 11), target.view(-1), label_smoothing=eps, ignore_index=PAD, reduction="sum"
    )
    assert n.item() == 13
    torch.testing.assert_close(loss, expected)
    # bf16 logits are upcast before the softmax: the result is fp32 and agrees to bf16 rounding.
    loss_bf16, _ = label_smoothed_nll(logits.bfloat16(), target, eps=eps, ignore_index=PAD)
    assert loss_bf16.dtype == torch.float32
    torch.testing.assert_close(loss_bf16, expected, rtol=2e-2, atol=0)


def test_schedule_hand_computed():
    # 512^-0.5 * min(step^-0.5, step * 4000^-1.5)
    assert inverse_sqrt_schedule(1, 512, 4000) == pytest.approx(1.746928e-07, rel=1e-6)
    assert inverse_sqrt_schedule(4000, 512, 4000) == pytest.approx(6.987712e-04, rel=1e-6)
    assert inverse_sqrt_schedule(100000, 512, 4000) == pytest.approx(1.397542e-04, rel=1e-6)
    assert inverse_sqrt_schedule(4000, 512, 4000, lr_scale=2.0) == pytest.approx(1.3975425e-03)


def make(seed: int):
    torch.manual_seed(seed)
    model = nn.Linear(4, 3)
    cfg = TrainConfig(warmup_steps=10, adam_betas=(0.9, 0.98), adam_eps=1e-9)
    return model, *build_optimizer(model, cfg, d_model=16)


def train_step(model, optimizer, scheduler, x):
    optimizer.zero_grad()
    model(x).square().sum().backward()
    optimizer.step()
    scheduler.step()


def test_optimizer_follows_schedule_from_the_first_update():
    model, optimizer, scheduler = make(0)
    group = optimizer.param_groups[0]
    assert group["betas"] == (0.9, 0.98) and group["eps"] == 1e-9
    for update in range(1, 6):  # the lr that update k uses is schedule(k)
        assert group["lr"] == pytest.approx(inverse_sqrt_schedule(update, 16, 10))
        train_step(model, optimizer, scheduler, torch.randn(2, 4))


def test_optimizer_and_scheduler_resume_exactly():
    x = torch.randn(5, 2, 4)
    model, optimizer, scheduler = make(0)
    for i in range(3):
        train_step(model, optimizer, scheduler, x[i])
    # Deep copies: state_dict() returns the live tensors that later updates change in place.
    saved = copy.deepcopy([model.state_dict(), optimizer.state_dict(), scheduler.state_dict()])
    for i in range(3, 5):
        train_step(model, optimizer, scheduler, x[i])

    resumed, optimizer2, scheduler2 = make(1)  # different init: everything must come from state
    resumed.load_state_dict(saved[0])
    optimizer2.load_state_dict(saved[1])
    scheduler2.load_state_dict(saved[2])
    for i in range(3, 5):
        train_step(resumed, optimizer2, scheduler2, x[i])
    for a, b in zip(model.parameters(), resumed.parameters(), strict=True):
        torch.testing.assert_close(a, b, atol=0, rtol=0)
    assert optimizer2.param_groups[0]["lr"] == optimizer.param_groups[0]["lr"]
