"""Label-smoothed cross-entropy (section 5.4), summed so the trainer can normalise by the
global token count across ranks and micro-batches."""

from __future__ import annotations

import torch.nn.functional as F
from torch import Tensor


def label_smoothed_nll(
    logits: Tensor, target: Tensor, eps: float, ignore_index: int
) -> tuple[Tensor, Tensor]:
    """Sum over non-padding tokens of (1 - eps) * -log p(target) + eps * mean_v(-log p(v)),
    and the number of those tokens.

    The smoothed distribution puts eps / V on every class and 1 - eps on top of that on the
    target: the convention of F.cross_entropy(label_smoothing=eps), which this equals.
    fairseq spreads eps over the V - 1 other classes instead; for V = 37k the two differ
    by eps / V, far below noise. logits (N, V) or (B, T, V), any float dtype (computed in
    fp32); target (N,) or (B, T).
    """
    logp = F.log_softmax(logits.reshape(-1, logits.size(-1)).float(), dim=-1)  # (N, V)
    target = target.reshape(-1)  # (N,)
    keep = target != ignore_index  # (N,)
    nll = -logp.gather(1, target.masked_fill(~keep, 0)[:, None]).squeeze(1)  # (N,)
    smooth = -logp.mean(dim=-1)  # (N,): cross-entropy against the uniform distribution
    loss = ((1.0 - eps) * nll + eps * smooth).masked_fill(~keep, 0.0)
    return loss.sum(), keep.sum()
