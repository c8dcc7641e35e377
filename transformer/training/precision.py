"""bf16 compute weights beside the fp32 master weights, instead of autocast's casts.

Under bf16 autocast every matrix weight and bias is cast to bf16 at every forward pass, and
its gradient cast back in the backward pass: ~120 casts each way in an update of base, the
largest share of its host's work after the products. Here the encoder and decoder layers'
matrix weights are kept as bf16 copies, refreshed once per update in one multi-tensor copy
(`refresh`); their gradients are added to the fp32 weights' in one more (`grads_to_master`),
and the optimizer updates the fp32 weights as before. Everything else (embeddings, the
tied output projection, LayerNorms, dropout) is shared with the fp32 model, not copied.

The arithmetic is autocast's: a weight already in bf16 is not cast again, and autocast
still casts the activations and runs LayerNorm, softmax and the loss's sums in fp32.
"""

from __future__ import annotations

import copy

import torch
from torch import Tensor, nn


class ComputeWeights:
    """`net` is what a training step runs: `model` itself when not `enabled`, else a copy
    of it whose layers' nn.Linear weights are bf16 (the rest shared with `model`). After
    the backward pass call `grads_to_master()`, then the optimizer's step, then `refresh()`.
    """

    def __init__(self, model: nn.Module, enabled: bool):
        self.model = model
        self.pairs: list[tuple[Tensor, Tensor]] = []  # (bf16 copy, fp32 master)
        self.net = _bf16_copy(model) if enabled else model
        if enabled:
            masters = dict(model.named_parameters())
            copies = self.net.named_parameters()
            self.pairs = [(p, masters[n]) for n, p in copies if p is not masters[n]]
        self._grads = [torch.zeros_like(master) for _, master in self.pairs]

    @property
    def enabled(self) -> bool:
        return self.net is not self.model

    def grads_to_master(self) -> None:
        """The bf16 gradients of this backward pass into the fp32 weights' (added to what
        earlier micro-batches of the update left there); the copies' are cleared."""
        if not self.pairs:
            return
        copies = [c for c, _ in self.pairs]
        grads = [c.grad for c in copies]
        if self.pairs[0][1].grad is None:  # the update's first micro-batch
            for (_, master), buffer in zip(self.pairs, self._grads, strict=True):
                master.grad = buffer
            torch._foreach_copy_(self._grads, grads)
        else:
            torch._foreach_add_(self._grads, grads)
        for c in copies:
            c.grad = None

    @torch.no_grad()
    def refresh(self) -> None:
        """The bf16 copies from the fp32 weights (after an optimizer step or a load)."""
        if self.pairs:
            torch._foreach_copy_([c for c, _ in self.pairs], [m for _, m in self.pairs])


def _bf16_copy(model: nn.Module) -> nn.Module:
    """A copy of `model` that shares every parameter, buffer and leaf module with it except
    the nn.Linear modules of its encoder and decoder layers, which it holds in bf16."""
    layers = [*model.encoder, *model.decoder]
    linears = [m for layer in layers for m in layer.modules() if isinstance(m, nn.Linear)]
    own = {id(t) for m in linears for t in (m, *m.parameters())}
    leaves = [m for m in model.modules() if not list(m.children())]
    shared = [*leaves, *model.parameters(), *model.buffers()]
    net = copy.deepcopy(model, {id(t): t for t in shared if id(t) not in own})
    for layer in [*net.encoder, *net.decoder]:
        for m in layer.modules():
            if isinstance(m, nn.Linear):
                m.to(torch.bfloat16)
    return net
