"""bf16 compute weights beside the fp32 master weights (transformer/training/precision.py): the same
arithmetic as autocast casting the fp32 weights at every pass, without the casts."""

from __future__ import annotations

import torch

from transformer.config import load_params
from transformer.nn.loss import label_smoothed_loss
from transformer.nn.model import Transformer
from transformer.tokens import PAD
from transformer.training.precision import ComputeWeights


def tiny_model(tiny_params, seed=0) -> Transformer:
    torch.manual_seed(seed)
    params = load_params(tiny_params, ["model.n_layers=2", "model.dropout=0.0"])
    return Transformer(params.model, 50, PAD)


def update_grads(net: torch.nn.Module, master: Transformer, src, tgt) -> torch.Tensor:
    with torch.autocast("cpu", dtype=torch.bfloat16):
        hidden = net(src, tgt, project=False).flatten(0, 1)
        loss, _ = label_smoothed_loss(hidden, master.out_proj.weight, tgt.flatten(), 0.1)
    loss.backward()
    return loss.detach()


def test_compute_weights_give_autocasts_loss_and_gradients(tiny_params):
    src, tgt = torch.randint(4, 50, (3, 7)), torch.randint(4, 50, (3, 5))
    plain, copied = tiny_model(tiny_params), tiny_model(tiny_params)
    weights = ComputeWeights(copied, enabled=True)
    assert update_grads(plain, plain, src, tgt) == update_grads(weights.net, copied, src, tgt)
    weights.grads_to_master()
    for (name, a), b in zip(plain.named_parameters(), copied.parameters(), strict=True):
        assert b.grad is not None and b.grad.dtype == torch.float32, name
        torch.testing.assert_close(b.grad, a.grad, rtol=1e-6, atol=1e-7, msg=name)
    assert all(c.grad is None for c, _ in weights.pairs)


def test_compute_weights_share_all_but_the_layers_matrices(tiny_params):
    model = tiny_model(tiny_params)
    weights = ComputeWeights(model, enabled=True)
    net = weights.net
    assert net.src_embed is model.src_embed and net.out_proj is model.out_proj
    assert net.encoder[0].sub[0].norm is model.encoder[0].sub[0].norm
    # 2 encoder layers x 4 matrices + 2 decoder layers x 6, each a weight and a bias
    assert len(weights.pairs) == 2 * (2 * 4 + 2 * 6)
    assert {c.dtype for c, _ in weights.pairs} == {torch.bfloat16}
    model.set_dropout(0.3)  # the trainer's cooldown dropout reaches what runs
    assert net.dropout.p == net.encoder[1].sub[1].dropout.p == 0.3
    assert ComputeWeights(model, enabled=False).net is model


def test_refresh_copies_the_master_weights_after_a_step(tiny_params):
    model = tiny_model(tiny_params)
    weights = ComputeWeights(model, enabled=True)
    with torch.no_grad():
        for _, master in weights.pairs:
            master.add_(1.0)
    assert not torch.equal(weights.pairs[0][0], weights.pairs[0][1].bfloat16())
    weights.refresh()
    for copy, master in weights.pairs:
        assert torch.equal(copy, master.bfloat16())


def test_micro_batches_add_up_in_the_master_gradients(tiny_params):
    """Two backward passes before the transfer: one transfer adds both; a second transfer
    of a later backward adds to what is there."""
    model = tiny_model(tiny_params)
    weights = ComputeWeights(model, enabled=True)
    src, tgt = torch.randint(4, 50, (3, 7)), torch.randint(4, 50, (3, 5))
    update_grads(weights.net, model, src, tgt)
    weights.grads_to_master()
    once = [m.grad.clone() for _, m in weights.pairs]
    update_grads(weights.net, model, src, tgt)
    weights.grads_to_master()
    for g, (_, m) in zip(once, weights.pairs, strict=True):
        torch.testing.assert_close(m.grad, 2 * g)
