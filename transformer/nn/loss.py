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

import functools

import torch
from torch import Tensor

from transformer.nn.kernels import cpu_path, linear

# Logits per chunk, whatever the vocabulary. On a GPU, 512 MB in bf16: few, large products
# (and few launches: each chunk is ~20 ops). On a CPU, 8 MB: a chunk stays in cache, and
# glibc's malloc reuses its memory (blocks over 32 MB are fresh mappings, page-faulted and
# zeroed at every use), which made a Multi30k step's loss faster (3083278; the figures:
# benchmarks/results/2026-11-29-zen3-code-figures/NOTES.md).
CHUNK_LOGITS = {"cuda": 1 << 28, "cpu": 1 << 21}


def label_smoothed_loss(
    hidden: Tensor,
    weight: Tensor,
    target: Tensor,
    eps: float,
    rdrop_alpha: float = 0.0,
    compiled: bool = False,
) -> tuple[Tensor, Tensor]:
    """(sum of the label-smoothed loss, sum of the NLL) over the rows of `hidden`.

    hidden (N, D): the decoder's output at the target positions that count (no padding);
    weight (V, D): the pre-softmax projection; target (N,). Under autocast the projection
    runs in the autocast dtype; the softmax's sums are fp32, and its logits stay in the
    product's dtype on a GPU (bf16: no fp32 copy of the largest tensor of the step) and are
    fp32 on a CPU. The NLL carries no gradient. `compiled`: each chunk's softmax and
    gradient through torch.compile (one or two fused passes over the logits instead of
    eight; compiled.py), as train.compile asks.

    R-Drop (Liang et al., 2021): hidden (2, N, D), two passes of the same rows under two
    dropout masks. Both sums are then the two passes' mean, and the loss adds rdrop_alpha / 4
    times their symmetric KL, sum_v (p1 - p2)(log p1 - log p2), through both passes: fairseq's
    label_smoothed_cross_entropy_with_rdrop halved, to stay a loss per target token (Adam
    does not see the scale).
    """
    # Grad mode read here: forward() runs with it off, and needs_input_grad stays True under
    # no_grad (validation would compute, and throw away, two more products per chunk).
    return _FusedProjectionLoss.apply(
        hidden, weight, target, eps, rdrop_alpha, torch.is_grad_enabled(), compiled
    )


class _FusedProjectionLoss(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx, hidden: Tensor, weight: Tensor, target: Tensor, eps: float, alpha: float,
        grad_mode: bool, compiled: bool,
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
            # Raw sums, combined once at the end (_totals).
            stats = torch.zeros(4, device=hidden.device)
            grad_h = torch.empty_like(passes) if grad else None  # in h's dtype
            grad_w = torch.zeros_like(weight, dtype=torch.float32) if grad else None
            # R-Drop's passes take half the rows each: its five (c, V) tensors at a time
            # (two softmaxes, their log-ratio, difference and one gradient) are 2.5 chunks of
            # logits, against the plain path's one.
            chunk = max(1, CHUNK_LOGITS.get(device, 1 << 26) // (weight.size(0) * len(passes)))
            step = _compiled_chunk() if compiled else _chunk
            for start in range(0, passes.size(1), chunk):
                rows = slice(start, start + chunk)
                if len(passes) == 1:
                    dzs = [step(passes[0, rows], w, target[rows], eps, stats, grad)]
                else:
                    dzs = _rdrop_chunk(passes[:, rows], w, target[rows], eps, alpha, stats, grad)
                for i, dz in enumerate(dzs if grad else ()):
                    dz = dz.to(h.dtype)  # (c, V); fp32 logits on a CPU in bf16
                    torch.mm(dz, w, out=grad_h[i, rows])  # (c, D)
                    grad_w += torch.mm(dz.t(), passes[i, rows])  # (V, D)
            loss, nll = _totals(stats, eps, weight.size(0))
        ctx.mark_non_differentiable(nll)
        if grad:
            ctx.save_for_backward(grad_h.view_as(hidden).to(hidden.dtype), grad_w.to(weight.dtype))
        return loss, nll

    @staticmethod
    def backward(ctx, grad_loss: Tensor, _grad_nll: Tensor):
        grad_h, grad_w = ctx.saved_tensors
        return grad_h * grad_loss, grad_w * grad_loss, None, None, None, None, None


def _totals(stats: Tensor, eps: float, vocab: int) -> tuple[Tensor, Tensor]:
    """The loss and NLL sums from the raw ones (lse, z_y, all logits, R-Drop's term):
    nll = lse - z_y, and the smoothing term mean_v(-log p_v) = lse - mean_v(z)."""
    lse, z_y, z_all, extra = stats.unbind()
    nll = lse - z_y
    return nll * (1.0 - eps) + (lse - z_all / vocab) * eps + extra, nll


def _logits(h: Tensor, w: Tensor) -> Tensor:
    """(c, V) logits: the product's dtype on a GPU, fp32 on a CPU."""
    z = linear(h, w)
    return z.float() if cpu_path(z) else z


def _chunk(h: Tensor, w: Tensor, target: Tensor, eps: float, stats: Tensor, grad: bool):
    """Adds this chunk's raw sums to `stats`; returns d(loss)/d(logits) (c, V), in the
    logits' memory and dtype (None without `grad`)."""
    p, _ = _softmax(_logits(h, w), target, stats)
    return _smoothed_grad(p, target, eps) if grad else None


def _softmax(z: Tensor, target: Tensor, stats: Tensor, scale: float = 1.0):
    """Adds `scale` times this chunk's sum of lse, of z_y and of all logits to `stats`;
    returns the softmax, in z's memory, and the log-normaliser lse (c,) in fp32.

    lse = m + log sum exp(z - m), in place, with fp32 sums; no log-softmax is materialised
    (the passes over a chunk with one were slower on a CPU:
    benchmarks/results/2026-11-25-cpu-2cores/train_step.md)."""
    z_y = z.gather(1, target[:, None]).sum(dtype=torch.float32)
    z_all = z.sum(dtype=torch.float32)
    m = z.amax(dim=-1, keepdim=True)  # (c, 1)
    p = z.sub_(m).exp_()  # unnormalised softmax
    total = p.sum(dim=-1, keepdim=True, dtype=torch.float32)  # (c, 1)
    lse = total.log().add_(m).squeeze(1)  # (c,)
    sums = torch.stack([lse.sum(), z_y, z_all])
    stats[:3] += sums if scale == 1.0 else sums.mul_(scale)
    return p.div_(total), lse


def _smoothed_grad(p: Tensor, target: Tensor, eps: float) -> Tensor:
    """d/dz of (1 - eps) * -log p_y + eps * mean_v(-log p_v) = p - (1 - eps) onehot_y - eps / V,
    in p's memory."""
    return p.sub_(eps / p.size(1)).scatter_(1, target[:, None], eps - 1.0, reduce="add")


def _rdrop_chunk(
    h: Tensor, w: Tensor, target: Tensor, eps: float, alpha: float, stats: Tensor, grad: bool
) -> list[Tensor]:
    """R-Drop over a chunk of rows seen by two passes, h (2, c, D): adds the passes' mean
    raw sums, and alpha / 4 times J = sum_v (p1 - p2)(log p1 - log p2), to `stats`;
    returns d/dz1 and d/dz2. dJ/dz1 = p1 (d - E_p1[d]) + p1 - p2 with d = log p1 - log p2,
    and dJ/dz2 the same with the passes swapped (d changes sign). In fp32 everywhere: the
    two passes' logits differ by little, less than bf16 resolves."""
    z1, z2 = linear(h[0], w).float(), linear(h[1], w).float()
    d = z1 - z2
    p1, lse1 = _softmax(z1, target, stats, 0.5)
    p2, lse2 = _softmax(z2, target, stats, 0.5)
    d.sub_((lse1 - lse2)[:, None])  # log p1 - log p2
    diff = p1 - p2
    stats[3] += alpha / 4 * torch.dot(diff.flatten(), d.flatten())
    if not grad:
        return []
    # Row-wise E_p[d] as (c, 1, V) @ (c, V, 1): no (c, V) temporary.
    e1, e2 = (torch.bmm(p[:, None], d[:, :, None]).squeeze(2) for p in (p1, p2))
    g1 = d.sub(e1).mul_(p1).add_(diff)
    g2 = d.sub_(e2).mul_(p2).add_(diff).neg_()  # in d's memory
    return [
        _smoothed_grad(p, target, eps).mul_(0.5).add_(g, alpha=alpha / 4)
        for p, g in ((p1, g1), (p2, g2))
    ]


@functools.cache
def _compiled_chunk():
    """The chunk's softmax and gradient compiled (train.compile), for any number of rows
    (one chunk size, and each batch's last chunk): one graph (compiled.py)."""
    return torch.compile(_chunk, fullgraph=True, dynamic=True)
