"""Label smoothing and the learning-rate schedule against hand-computed values."""

import copy
import math

import pytest
import torch
import torch.nn.functional as F
from opcount import OpCounter
from torch import nn

from transformer.config import TrainConfig
from transformer.nn import kernels
from transformer.nn import loss as loss_module
from transformer.nn.loss import label_smoothed_loss
from transformer.training.optim import (
    build_optimizer,
    cooldown_factor,
    inverse_sqrt_schedule,
    with_these_kernels,
)


def test_label_smoothing_hand_computed():
    # logits log(1, 2, 1): p = (1/4, 1/2, 1/4), target 1: nll = ln 2,
    # mean_v(-log p) = (2 + 1 + 2) ln 2 / 3.
    hidden, weight = torch.ones(1, 1), torch.log(torch.tensor([[1.0], [2.0], [1.0]]))
    loss, nll = label_smoothed_loss(hidden, weight, torch.tensor([1]), 0.1)
    assert nll.item() == pytest.approx(math.log(2), rel=1e-6)
    assert loss.item() == pytest.approx(0.9 * math.log(2) + 0.1 * 5 / 3 * math.log(2), rel=1e-6)


@pytest.mark.parametrize("eps", [0.0, 0.1, 0.2])
def test_fused_loss_equals_cross_entropy_over_the_full_logits(eps, monkeypatch):
    """Chunked projection + one log-softmax == F.cross_entropy on the materialised logits:
    the sums within 1e-5 (relative) and the gradients of hidden and weight alike."""
    monkeypatch.setitem(loss_module.CHUNK_LOGITS, "cpu", 7 * 11)  # 7 rows a chunk: several
    torch.manual_seed(0)
    hidden = (torch.randn(30, 8) * 2).requires_grad_()
    weight = torch.randn(11, 8).requires_grad_()
    target = torch.randint(0, 11, (30,))
    loss, nll = label_smoothed_loss(hidden, weight, target, eps)
    logits = hidden @ weight.t()
    expected = F.cross_entropy(logits, target, label_smoothing=eps, reduction="sum")
    torch.testing.assert_close(loss, expected, rtol=1e-5, atol=0)
    torch.testing.assert_close(
        nll, F.cross_entropy(logits, target, reduction="sum"), rtol=1e-5, atol=0
    )
    assert not nll.requires_grad  # reported, never optimised
    got = torch.autograd.grad(loss * 3.0, [hidden, weight])
    want = torch.autograd.grad(expected * 3.0, [hidden, weight])
    for g, w in zip(got, want, strict=True):  # fp32 rounding, on the gradient's scale
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5 * w.abs().max().item())


@pytest.mark.parametrize("eps", [0.0, 0.1])
def test_rdrop_loss_equals_fairseqs_objective_halved(eps, monkeypatch):
    """Two passes (2, N, D): the mean of their smoothed losses plus alpha / 4 times the
    symmetric KL, written out as fairseq's label_smoothed_cross_entropy_with_rdrop does
    (F.kl_div both ways, halved), over several chunks; gradients of both passes alike."""
    monkeypatch.setitem(loss_module.CHUNK_LOGITS, "cpu", 2 * 7 * 11)  # 7 rows a chunk
    torch.manual_seed(0)
    hidden = (torch.randn(2, 30, 8) * 2).requires_grad_()
    weight = torch.randn(11, 8).requires_grad_()
    target = torch.randint(0, 11, (30,))
    loss, nll = label_smoothed_loss(hidden, weight, target, eps, rdrop_alpha=5.0)
    logits = hidden @ weight.t()
    lp, lq = F.log_softmax(logits, dim=-1).unbind()
    smoothed = [F.cross_entropy(z, target, label_smoothing=eps, reduction="sum") for z in logits]
    kl = (F.kl_div(lp, lq.exp(), reduction="sum") + F.kl_div(lq, lp.exp(), reduction="sum")) / 2
    expected = (sum(smoothed) + 5.0 * kl) / 2
    torch.testing.assert_close(loss, expected, rtol=1e-5, atol=0)
    mean_nll = sum(F.cross_entropy(z, target, reduction="sum") for z in logits) / 2
    torch.testing.assert_close(nll, mean_nll, rtol=1e-5, atol=0)
    got = torch.autograd.grad(loss * 3.0, [hidden, weight])
    want = torch.autograd.grad(expected * 3.0, [hidden, weight])
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5 * w.abs().max().item())


def test_rdrop_loss_under_bf16_autocast_gives_both_passes_fp32_gradients():
    torch.manual_seed(0)
    hidden = torch.randn(2, 12, 8, requires_grad=True)
    weight = torch.randn(11, 8, requires_grad=True)
    target = torch.randint(0, 11, (12,))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss, _ = label_smoothed_loss(hidden, weight, target, 0.1, rdrop_alpha=5.0)
    assert loss.dtype == torch.float32 and loss.item() > 0
    # The projection in bf16, the softmaxes and their KL in fp32.
    logits = (hidden.bfloat16() @ weight.bfloat16().t()).float()
    lp, lq = F.log_softmax(logits, dim=-1).unbind()
    smoothed = sum(F.cross_entropy(z, target, label_smoothing=0.1, reduction="sum") for z in logits)
    kl = (F.kl_div(lp, lq.exp(), reduction="sum") + F.kl_div(lq, lp.exp(), reduction="sum")) / 2
    torch.testing.assert_close(loss, (smoothed + 5.0 * kl) / 2, rtol=1e-5, atol=0)
    loss.backward()
    assert hidden.grad.shape == (2, 12, 8) and hidden.grad.dtype == torch.float32
    assert hidden.grad[0].abs().sum() > 0 and hidden.grad[1].abs().sum() > 0


def test_rdrop_loss_refuses_more_than_two_passes():
    weight, target = torch.randn(11, 8), torch.randint(0, 11, (12,))
    with pytest.raises(ValueError, match="2, N, D"):
        label_smoothed_loss(torch.randn(3, 12, 8), weight, target, 0.1, rdrop_alpha=5.0)


def test_fused_loss_under_no_grad_computes_no_gradient(monkeypatch):
    """Validation's loss: the same sums, one product per chunk instead of three (the
    gradient's two are skipped although the weights require grad)."""
    monkeypatch.setitem(loss_module.CHUNK_LOGITS, "cpu", 7 * 11)  # 5 chunks of 7 rows
    monkeypatch.setattr(kernels, "ONEDNN", False)  # products as aten's mm
    torch.manual_seed(0)
    hidden, weight = torch.randn(30, 8, requires_grad=True), torch.randn(11, 8, requires_grad=True)
    target = torch.randint(0, 11, (30,))
    with torch.no_grad(), OpCounter() as ops:
        sums = label_smoothed_loss(hidden, weight, target, 0.1)
    assert ops.counts["aten.mm"] == 5
    assert all(not t.requires_grad for t in sums)
    with OpCounter() as ops:
        torch.testing.assert_close(sums, label_smoothed_loss(hidden, weight, target, 0.1))
    assert ops.counts["aten.mm"] == 15


def test_fused_loss_under_bf16_autocast_projects_in_bf16_and_softmaxes_in_fp32():
    torch.manual_seed(0)
    hidden, weight = torch.randn(12, 8, requires_grad=True), torch.randn(11, 8, requires_grad=True)
    target = torch.randint(0, 11, (12,))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss, _ = label_smoothed_loss(hidden, weight, target, 0.1)
    assert loss.dtype == torch.float32
    logits = (hidden.bfloat16() @ weight.bfloat16().t()).float()
    expected = F.cross_entropy(logits, target, label_smoothing=0.1, reduction="sum")
    torch.testing.assert_close(loss, expected, rtol=1e-5, atol=0)
    loss.backward()
    assert hidden.grad.dtype == weight.grad.dtype == torch.float32


def test_schedule_hand_computed():
    # 512^-0.5 * min(step^-0.5, step * 4000^-1.5)
    assert inverse_sqrt_schedule(1, 512, 4000) == pytest.approx(1.746928e-07, rel=1e-6)
    assert inverse_sqrt_schedule(4000, 512, 4000) == pytest.approx(6.987712e-04, rel=1e-6)
    assert inverse_sqrt_schedule(100000, 512, 4000) == pytest.approx(1.397542e-04, rel=1e-6)
    assert inverse_sqrt_schedule(4000, 512, 4000, lr_scale=2.0) == pytest.approx(1.3975425e-03)


def test_cooldown_falls_linearly_to_near_zero_over_the_last_fraction():
    # 10 updates, the last 30% (3) cool down: updates 1-7 at full lr, then 3/4, 2/4, 1/4.
    factors = [cooldown_factor(k, 10, 0.3) for k in range(1, 11)]
    assert factors == [1.0] * 7 + [0.75, 0.5, 0.25]
    # The paper's: none, also for the lr after the last update (a run extended later).
    assert [cooldown_factor(k, 10, 0.0) for k in (1, 10, 11)] == [1.0, 1.0, 1.0]


def test_a_1_sqrt_cooldown_falls_steeply_then_lingers_near_zero():
    # The same window, 1 - sqrt(x) of the fraction gone (1/4, 2/4, 3/4): below the linear
    # factor at every update of the window, and through the optimizer as configured.
    factors = [cooldown_factor(k, 10, 0.3, "1-sqrt") for k in range(1, 11)]
    assert factors == pytest.approx([1.0] * 7 + [0.5, 1 - 0.5**0.5, 1 - 0.75**0.5])
    linear = [cooldown_factor(k, 10, 0.3) for k in range(8, 11)]
    assert all(f < g for f, g in zip(factors[7:], linear, strict=True))
    cfg = TrainConfig(warmup_steps=1, max_steps=10, cooldown=0.3, cooldown_shape="1-sqrt")
    lrs = lrs_per_update(cfg, d_model=16)
    full = [inverse_sqrt_schedule(k, 16, 1) for k in range(1, 11)]
    assert lrs == pytest.approx([f * c for f, c in zip(full, factors, strict=True)])


def test_optimizer_cools_down_to_max_steps():
    cfg = TrainConfig(warmup_steps=2, max_steps=8, cooldown=0.5)
    lrs = lrs_per_update(cfg, d_model=16)
    full = [inverse_sqrt_schedule(k, 16, 2) for k in range(1, 9)]
    assert lrs[:4] == pytest.approx(full[:4])  # the paper's curve until the cooldown
    assert lrs[4:] == pytest.approx([f * (9 - k) / 5 for k, f in enumerate(full[4:], start=5)])


def test_constant_decay_holds_the_peak_until_the_cooldown():
    # Warmup-stable-decay: the paper's warmup, its peak held, then the linear cooldown.
    cfg = TrainConfig(warmup_steps=2, max_steps=8, cooldown=0.5, decay="constant")
    lrs = lrs_per_update(cfg, d_model=16)
    peak = inverse_sqrt_schedule(2, 16, 2)  # 16^-0.5 * 2^-0.5
    assert lrs[:4] == pytest.approx([peak / 2, peak, peak, peak])
    assert lrs[4:] == pytest.approx([peak * (9 - k) / 5 for k in range(5, 9)])
    assert inverse_sqrt_schedule(10**6, 16, 2, decay=False) == pytest.approx(peak)


def make(seed: int):
    torch.manual_seed(seed)
    model = nn.Linear(4, 3)
    cfg = TrainConfig(warmup_steps=10, adam_betas=[0.9, 0.98], adam_eps=1e-9)
    return model, *build_optimizer(model, cfg, d_model=16)


def lrs_per_update(cfg: TrainConfig, d_model: int) -> list[float]:
    """The lr each of cfg.max_steps updates of a tiny model runs at, as the optimizer has it."""
    model = nn.Linear(4, 3)
    optimizer, scheduler = build_optimizer(model, cfg, d_model)
    lrs = []
    for _ in range(cfg.max_steps):
        lrs.append(optimizer.param_groups[0]["lr"])
        train_step(model, optimizer, scheduler, torch.randn(2, 4))
    return lrs


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


def test_resumed_optimizer_keeps_this_runs_kernels_not_the_saving_runs():
    """load_state_dict restores the saved param groups' `fused` flag: a state saved unfused
    (by this project before it fused on a CPU too) would step unfused, and could not skip a
    non-finite update on the device. Resumed, the state takes this run's flags."""
    model, optimizer, scheduler = make(0)
    train_step(model, optimizer, scheduler, torch.randn(2, 4))
    saved = copy.deepcopy(optimizer.state_dict())
    for group in saved["param_groups"]:
        group["fused"] = None  # what an unfused optimizer saves
    _, as_saved, _ = make(1)
    as_saved.load_state_dict(copy.deepcopy(saved))
    assert not as_saved.param_groups[0]["fused"]  # torch's load_state_dict: the saving run's
    resumed, optimizer2, scheduler2 = make(1)
    optimizer2.load_state_dict(with_these_kernels(optimizer2, saved))
    assert [g["fused"] for g in optimizer2.param_groups] == [True]  # this run's
    train_step(resumed, optimizer2, scheduler2, torch.randn(2, 4))


def test_on_a_gpu_the_logits_stay_bf16_and_a_chunk_is_twenty_ops(monkeypatch):
    """The GPU's path, run on the CPU: the (c, V) logits stay in the product's dtype (bf16,
    no fp32 copy), their sums in fp32; the loss within bf16's rounding of the fp32 logits'
    (each logit off by <= 2^-9 of itself, a little more through exp), the gradients alike.
    And each chunk costs a fixed ~20 ops, where it cost 33."""
    monkeypatch.setattr(kernels, "CPU_PATHS", False)
    monkeypatch.setitem(loss_module.CHUNK_LOGITS, "cpu", 7 * 500)  # 7 rows a chunk
    torch.manual_seed(0)
    hidden = torch.randn(70, 16, requires_grad=True)
    weight = (torch.randn(500, 16) * 0.5).requires_grad_()
    target = torch.randint(0, 500, (70,))
    with torch.autocast("cpu", dtype=torch.bfloat16), OpCounter() as ops:
        loss, _ = label_smoothed_loss(hidden, weight, target, 0.1)
    chunks = 10
    assert ops.counts["aten._to_copy"] <= 4  # hidden and weight cast once, nothing per chunk
    assert (ops.total - ops.counts["aten._to_copy"]) / chunks <= 21, (
        ops.counts.most_common()
    )  # + the call's own
    logits = (hidden.bfloat16() @ weight.bfloat16().t()).float()
    expected = F.cross_entropy(logits, target, label_smoothing=0.1, reduction="sum")
    torch.testing.assert_close(loss, expected, rtol=2e-3, atol=0)
    got = torch.autograd.grad(loss, [hidden, weight])
    want = torch.autograd.grad(expected, [hidden, weight])
    for g, w in zip(got, want, strict=True):
        assert ((g - w).norm() / w.norm()).item() < 1e-2
