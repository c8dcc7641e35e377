"""The report's bf16 vs fp32: the loss curves of both precisions overfitting one batch from
the same initial weights, dropout off."""

from __future__ import annotations

import torch

from benchmarks import model_step
from benchmarks.gpu_report.plan import config
from benchmarks.gpu_report.section import Ctx
from transformer.config import Params
from transformer.nn import attention

AGREE = 0.05  # bf16 and fp32 losses "agree" within this relative difference at every step


def precision(ctx: Ctx) -> None:
    name, max_tokens, steps = ctx.sizes.overfit
    params = config(name, "model.dropout=0.0")
    batch = model_step.wmt_like_batches(1, max_tokens, params.vocab.size, seed=2)[0]
    batch = tuple(x.to(ctx.device) for x in batch)
    curves = {p: overfit(params, batch, steps, p == "bf16", ctx.device) for p in ("fp32", "bf16")}
    diff = [abs(b - f) / f for f, b in zip(curves["fp32"], curves["bf16"], strict=True)]
    shown = sorted({0, *range(steps // 10 or 1, steps, steps // 10 or 1), steps - 1})
    for i in shown:
        fp32, bf16 = curves["fp32"][i], curves["bf16"][i]
        row = {"step": i + 1, "fp32 loss": fp32, "bf16 loss": bf16}
        ctx.add("", {**row, "relative difference": diff[i]})
    agree = "agree" if max(diff) <= AGREE else "DISAGREE"
    ctx.note(
        f"{agree}: the largest relative difference over {steps} steps is {max(diff):.2%} "
        f"(agreement: <= {AGREE:.0%} at every step)",
        f"config {name}, dropout 0, one batch of <= {max_tokens} padded tokens "
        f"({batch[3].numel()} targets), Adam lr 3e-4, label smoothing 0.1, the trainer's "
        "fused loss; bf16 autocast on " + ctx.device.type,
    )


def overfit(params: Params, batch, steps: int, bf16: bool, device: torch.device) -> list:
    net = model_step.build("ours", params, device, seed=1)
    adam = torch.optim.Adam(net.parameters(), lr=3e-4, betas=(0.9, 0.98), eps=1e-9)
    step = model_step.make_step(net, adam, bf16)
    with attention.attention_context(device):
        return [step(batch).item() / batch[3].numel() for _ in range(steps)]
