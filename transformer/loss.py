"""Label-smoothed cross-entropy (section 5.4) fused with the output projection.

The pre-softmax layer is the largest tensor of a step: (target tokens x vocabulary) logits,
37k columns for WMT14. Materialised in fp32 with its log-softmax and the gradient, it costs
~80 bytes a logit (~3 GB at 4k tokens, ~24 GB at 32k). Here the projection, one softmax
and the gradient are computed chunk by chunk, over the non-padding positions only: at most
one chunk of logits exists at a time (R-Drop: two passes of half a chunk each, and three more
tensors of their size), and the loss (what is optimised) and the NLL (what is
reported) come from the same log-normaliser. The gradient is computed in the forward pass and
kept (as Liger's fused linear cross-entropy does), so backward is one multiplication.

Sums, not means: the trainer normalises by the global token count across ranks and
micro-batches. The smoothed distribution puts eps / V on every class and 1 - eps on top of
that on the target, the convention of F.cross_entropy(label_smoothing=eps); fairseq spreads
eps over the V - 1 other classes instead, a difference of eps / V.
"""

from __future__ import annotations

import torch
from torch import Tensor

from transformer.kernels import linear

# Logits per chunk, whatever the vocabulary. On a GPU, 256 MB in fp32: few, large products.
# On a CPU, 8 MB: a chunk stays in cache, and glibc's malloc reuses its memory (blocks over
# 32 MB are fresh mappings, page-faulted and zeroed at every use): the loss of a Multi30k
# step (1,750 tokens, 8k vocabulary, 1 thread) takes 73 ms instead of 122.
CHUNK_LOGITS = {"cuda": 1 << 26, "cpu": 1 << 21}


def label_smoothed_loss(
    hidden: Tensor, weight: Tensor, target: Tensor, eps: float, rdrop_alpha: float = 0.0
) -> tuple[Tensor, Tensor]:
    """(sum of the label-smoothed loss, sum of the NLL) over the rows of `hidden`.

    hidden (N, D): the decoder's output at the target positions that count (no padding);
    weight (V, D): the pre-softmax projection; target (N,). Under autocast the projection
    runs in the autocast dtype and the softmax in fp32. The NLL carries no gradient.

    R-Drop (Liang et al., 2021): hidden (2, N, D), two passes of the same rows under two
    dropout masks. Both sums are then the two passes' mean, and the loss adds rdrop_alpha / 4
    times their symmetric KL, sum_v (p1 - p2)(log p1 - log p2), through both passes: fairseq's
    label_smoothed_cross_entropy_with_rdrop halved, to stay a loss per target token (Adam
    does not see the scale).
    """
    # Grad mode read here: forward() runs with it off, and needs_input_grad stays True under
    # no_grad (validation would compute, and throw away, two more products per chunk).
    return _FusedProjectionLoss.apply(
        hidden, weight, target, eps, rdrop_alpha, torch.is_grad_enabled()
    )


class _FusedProjectionLoss(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx, hidden: Tensor, weight: Tensor, target: Tensor, eps: float, alpha: float,
        grad_mode: bool,
    ):  # fmt: skip
        device = hidden.device.type
        dtype = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else None
        grad = grad_mode and (ctx.needs_input_grad[0] or ctx.needs_input_grad[1])
        with torch.autocast(device, enabled=False):
            h = hidden if dtype is None else hidden.to(dtype)  # (N, D), or (2, N, D): R-Drop
            w = weight if dtype is None else weight.to(dtype)  # (V, D)
            passes = h.unsqueeze(0) if h.dim() == 2 else h  # (P, N, D)
            if len(passes) > 2:
                raise ValueError(f"hidden: (N, D) or, for R-Drop, (2, N, D); got {tuple(h.shape)}")
            sums = torch.zeros(2, device=hidden.device)  # loss, nll
            grad_h = torch.empty_like(passes, dtype=hidden.dtype) if grad else None
            grad_w = torch.zeros_like(weight, dtype=torch.float32) if grad else None
            # R-Drop's passes take half the rows each: its five (c, V) tensors at a time
            # (two softmaxes, their log-ratio, difference and one gradient) are 2.5 chunks of
            # logits, against the plain path's one; a quarter of the rows would make it one,
            # in twice as many, smaller products (the CPU's speed at that size unmeasured).
            chunk = max(1, CHUNK_LOGITS.get(device, 1 << 26) // (weight.size(0) * len(passes)))
            for start in range(0, passes.size(1), chunk):
                rows = slice(start, start + chunk)
                if len(passes) == 1:
                    dzs = [_chunk(passes[0, rows], w, target[rows], eps, sums)]
                else:
                    dzs = _rdrop_chunk(passes[:, rows], w, target[rows], eps, alpha, sums)
                for i, dz in enumerate(dzs):
                    if grad:
                        dz = dz.to(h.dtype)  # (c, V)
                        grad_h[i, rows] = linear(dz, w.t())  # dz @ w: (c, D)
                        grad_w += linear(passes[i, rows].t(), dz.t()).t().float()  # (V, D)
            grad_h = grad_h.view_as(hidden) if grad else None
        loss, nll = sums.unbind()
        ctx.mark_non_differentiable(nll)
        if grad:
            ctx.save_for_backward(grad_h, grad_w.to(weight.dtype))
        return loss, nll

    @staticmethod
    def backward(ctx, grad_loss: Tensor, _grad_nll: Tensor):
        grad_h, grad_w = ctx.saved_tensors
        return grad_h * grad_loss, grad_w * grad_loss, None, None, None, None


def _chunk(h: Tensor, w: Tensor, target: Tensor, eps: float, sums: Tensor) -> Tensor:
    """Adds this chunk's loss and NLL to `sums`; returns d(loss)/d(logits) (c, V), fp32."""
    p, _ = _softmax(linear(h, w).float(), target, eps, sums)
    return _smoothed_grad(p, target, eps)


def _softmax(
    z: Tensor, target: Tensor, eps: float, sums: Tensor, scale: float = 1.0
) -> tuple[Tensor, Tensor]:
    """Adds `scale` times the loss and NLL of the logits z (c, V) to `sums`; returns the
    softmax, in z's memory, and the log-normaliser lse (c,).

    In place: -log p_y = lse - z_y and mean_v(-log p_v) = lse - mean(z), with
    lse = m + log sum exp(z - m); the softmax is exp(z - m) / sum. No log-softmax is
    materialised: on a CPU, the passes over a chunk with one took 1.4-1.8x these."""
    z_y = z.gather(1, target[:, None]).squeeze(1)  # (c,)
    mean = z.mean(dim=-1)  # (c,)
    m = z.amax(dim=-1, keepdim=True)  # (c, 1)
    p = z.sub_(m).exp_()  # unnormalised softmax
    total = p.sum(dim=-1, keepdim=True)  # (c, 1)
    lse = (m + total.log()).squeeze(1)  # (c,)
    nll = lse - z_y
    sums += scale * torch.stack([((1.0 - eps) * nll + eps * (lse - mean)).sum(), nll.sum()])
    return p.mul_(total.reciprocal_()), lse


def _smoothed_grad(p: Tensor, target: Tensor, eps: float) -> Tensor:
    """d/dz of (1 - eps) * -log p_y + eps * mean_v(-log p_v) = p - (1 - eps) onehot_y - eps / V,
    in p's memory."""
    dz = p.sub_(eps / p.size(1))
    dz[torch.arange(len(target), device=dz.device), target] -= 1.0 - eps
    return dz


def _rdrop_chunk(
    h: Tensor, w: Tensor, target: Tensor, eps: float, alpha: float, sums: Tensor
) -> list[Tensor]:
    """R-Drop over a chunk of rows seen by two passes, h (2, c, D): adds the passes' mean
    loss and NLL, and alpha / 4 times J = sum_v (p1 - p2)(log p1 - log p2), to `sums`;
    returns d/dz1 and d/dz2. dJ/dz1 = p1 (d - E_p1[d]) + p1 - p2 with d = log p1 - log p2,
    and dJ/dz2 the same with the passes swapped (d changes sign)."""
    z1, z2 = linear(h[0], w).float(), linear(h[1], w).float()
    d = z1 - z2
    p1, lse1 = _softmax(z1, target, eps, sums, 0.5)
    p2, lse2 = _softmax(z2, target, eps, sums, 0.5)
    d.sub_((lse1 - lse2)[:, None])  # log p1 - log p2
    diff = p1 - p2
    sums[0] += alpha / 4 * torch.dot(diff.flatten(), d.flatten())
    # Row-wise E_p[d] as (c, 1, V) @ (c, V, 1): no (c, V) temporary.
    e1, e2 = (torch.bmm(p[:, None], d[:, :, None]).squeeze(2) for p in (p1, p2))
    g1 = d.sub(e1).mul_(p1).add_(diff)
    g2 = d.sub_(e2).mul_(p2).add_(diff).neg_()  # in d's memory
    return [
        _smoothed_grad(p, target, eps).mul_(0.5).add_(g, alpha=alpha / 4)
        for p, g in ((p1, g1), (p2, g2))
    ]
