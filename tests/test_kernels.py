"""transformer.nn.kernels: oneDNN matrix products and uniform-draw dropout on the CPU are
F.linear and F.dropout in what they compute, forward and backward; a decoding step's
attention and products without gradients are SDPA's and F.linear's with each build of
cpu_decoding's C kernels this CPU runs and with torch's ops alone (the `build` fixture)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from test_cpu_decoding import builds

from transformer.nn import cpu_decoding, kernels
from transformer.nn.kernels import Dropout, Linear, linear

needs_onednn = pytest.mark.skipif(
    not torch.backends.mkldnn.is_available(), reason="this torch has no oneDNN"
)
ONEDNN = kernels.ONEDNN  # this CPU's, before the `onednn` fixture sets it


@pytest.fixture(params=[*builds(), "torch"])
def build(request):
    """cpu_decoding's kernels of a build this CPU runs, or none (torch's ops: what runs
    without a C compiler), the selection put back afterwards."""
    saved = cpu_decoding._wanted
    cpu_decoding.select(request.param)
    if cpu_decoding.build() != request.param:
        pytest.skip(f"the {request.param} build could not be built here (no C compiler?)")
    yield request.param
    cpu_decoding.select(saved)


@pytest.fixture(autouse=True)
def onednn(monkeypatch):
    """The oneDNN path on any CPU that can run it, used or not on this one (AVX-512), for
    products of any number of rows."""
    monkeypatch.setattr(kernels, "ONEDNN", torch.backends.mkldnn.is_available())
    monkeypatch.setattr(kernels, "ONEDNN_MIN_ROWS", 0)


@needs_onednn
@pytest.mark.parametrize("shape", [(5, 7), (2, 3, 7)])
@pytest.mark.parametrize("bias", [True, False])
def test_linear_is_f_linear_forward_and_backward_through_onednn(shape, bias):
    torch.manual_seed(0)
    x = torch.randn(*shape, requires_grad=True)
    w = torch.randn(4, 7, requires_grad=True)
    b = torch.randn(4, requires_grad=True) if bias else None
    y = linear(x, w, b)
    assert type(y.grad_fn).__name__ == "_OneDNNLinearBackward"  # not a silent F.linear
    want = F.linear(x, w, b)
    torch.testing.assert_close(y, want, rtol=1e-5, atol=1e-5)
    g = torch.randn_like(y)
    leaves = [t for t in (x, w, b) if t is not None]
    got = torch.autograd.grad(y, leaves, g)
    for a, e in zip(got, torch.autograd.grad(want, leaves, g), strict=True):
        torch.testing.assert_close(a, e, rtol=1e-5, atol=1e-5)
        assert a.is_contiguous()  # the optimizer's layout, no copy at accumulation


@needs_onednn
def test_the_output_through_onednn_takes_an_in_place_relu():
    # model.FeedForward: relu(w1(x), inplace=True); a view out of the Function raised here
    # (the GPU report's CPU training step on an AVX-512 host, 2026-11-26).
    torch.manual_seed(0)
    x, w = torch.randn(2, 3, 7, requires_grad=True), torch.randn(4, 7, requires_grad=True)
    F.relu(linear(x, w), inplace=True).sum().backward()
    got = x.grad, w.grad
    x.grad = w.grad = None
    F.relu(F.linear(x, w)).sum().backward()
    torch.testing.assert_close(got, (x.grad, w.grad), rtol=1e-5, atol=1e-5)


@needs_onednn
def test_linear_takes_strided_weights_as_the_loss_passes_them():
    # loss.py: dz @ W as linear(dz, W^T); dz^T @ h as linear(h^T, dz^T)^T; a weight slice.
    torch.manual_seed(0)
    dz, w, h = torch.randn(6, 11), torch.randn(11, 8), torch.randn(6, 8)
    torch.testing.assert_close(linear(dz, w.t()), dz @ w)
    torch.testing.assert_close(linear(h.t(), dz.t()).t(), dz.t() @ h)
    torch.testing.assert_close(linear(h, w[3:7]), h @ w[3:7].t())


@needs_onednn
def test_products_of_few_rows_stay_on_mkl(monkeypatch):
    """A decoding step's few rows: oneDNN's per-call cost outweighs its arithmetic there."""
    monkeypatch.setattr(kernels, "ONEDNN_MIN_ROWS", 256)
    w = torch.randn(4, 7, requires_grad=True)
    path = lambda rows: type(linear(torch.randn(rows, 7), w).grad_fn).__name__
    assert path(255) != "_OneDNNLinearBackward"
    assert path(256) == "_OneDNNLinearBackward"
    # rows are all but the last dimension: (4, 64, 7) is 256 of them
    assert type(linear(torch.randn(4, 64, 7), w).grad_fn).__name__ == "_OneDNNLinearBackward"


def test_linear_keeps_f_linear_where_onednn_does_not_apply():
    x, w = torch.randn(3, 4, dtype=torch.float64, requires_grad=True), torch.randn(2, 4)
    y = linear(x, w.double())  # fp64: not oneDNN's
    assert type(y.grad_fn).__name__ != "_OneDNNLinearBackward"
    with torch.autocast("cpu", dtype=torch.bfloat16):  # autocast decides the dtype
        assert linear(x.float(), w).dtype == torch.bfloat16


def test_linear_module_is_nn_linear_with_its_state_dict():
    layer = Linear(4, 3)
    assert isinstance(layer, torch.nn.Linear)
    assert set(layer.state_dict()) == {"weight", "bias"}
    x = torch.randn(2, 4)
    torch.testing.assert_close(layer(x), F.linear(x, layer.weight, layer.bias))


def test_dropout_drops_p_and_scales_the_rest_and_backward_uses_the_same_mask():
    torch.manual_seed(0)
    drop = Dropout(0.3)
    x = torch.ones(200_000, requires_grad=True)
    y = drop(x)
    kept = y != 0
    assert abs(1 - kept.float().mean().item() - 0.3) < 0.005  # 60k draws: 4.5 sigma
    torch.testing.assert_close(y[kept], torch.full_like(y[kept], 1 / 0.7))
    (grad,) = torch.autograd.grad(y.sum(), x)
    torch.testing.assert_close(grad, kept.float() / 0.7)
    torch.manual_seed(0)
    assert torch.equal(drop(x), y)  # the default generator: seeded runs repeat
    drop.eval()
    assert torch.equal(drop(x), x)


def test_dropout_of_bf16_keeps_exactly_1_minus_p():
    """A bf16 activation (CPU autocast) is dropped from an fp32 draw: a bf16 draw rounds
    p's threshold and kept 0.6982 at p 0.3: 7.9 sigma under 0.7 at 4M draws)."""
    torch.manual_seed(0)
    y = Dropout(0.3).train()(torch.ones(4_000_000, dtype=torch.bfloat16))
    assert y.dtype == torch.bfloat16
    assert abs((y != 0).float().mean().item() - 0.7) < 0.001  # 4.4 sigma


def test_cpu_bf16_attention_runs_in_fp32():
    """Under a CPU's bf16 autocast the products run in bf16 but attention in fp32 (torch's
    bf16 attention backward on a CPU is several times slower): same output as fp32 inputs,
    gradients flowing back to the bf16 inputs."""
    torch.manual_seed(0)
    q, k, v = (torch.randn(3, 4, 7, 16) for _ in range(3))
    mask = torch.rand(3, 1, 1, 7) > 0.2
    mask[..., 0] = True
    expected = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    q16, k16, v16 = (t.bfloat16().requires_grad_() for t in (q, k, v))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = kernels.attention(q16, k16, v16, mask)
    assert out.dtype == torch.float32
    upcast = [t.detach().float() for t in (q16, k16, v16)]
    assert torch.allclose(out, kernels.attention(*upcast, mask), atol=1e-6)
    assert torch.allclose(out, expected, atol=3e-2)
    out.sum().backward()
    assert q16.grad is not None and q16.grad.dtype == torch.bfloat16


def test_describe_names_what_runs_the_products():
    line = kernels.describe("cpu")
    assert ("oneDNN" in line) == kernels.ONEDNN
    assert "F.linear" in kernels.describe("cuda")


@pytest.mark.parametrize("queries", [1, 4, 9])
@pytest.mark.parametrize(
    "masked, additive",
    [("none", False), ("padding", False), ("per-query", False), ("padding", True),
     ("per-query", True)],
)  # fmt: skip
def test_attention_is_sdpa_for_a_decoding_step_and_falls_back_beyond(
    build, queries, masked, additive, monkeypatch
):
    torch.manual_seed(0)
    q, k, v = torch.randn(3, 2, queries, 8), torch.randn(3, 2, 6, 8), torch.randn(3, 2, 6, 8)
    mask = {
        "none": None,
        "padding": torch.arange(6) < torch.tensor([6, 3, 1])[:, None, None, None],  # (3,1,1,6)
        "per-query": torch.rand(3, 1, queries, 6) < 0.7,
    }[masked]
    if mask is not None:
        mask = mask | (torch.arange(6) == 0)  # every row keeps a key, as the model's masks do
        if additive:  # SDPA's other kind, which the KV cache and cached decoding make
            mask = torch.where(mask, 0.0, float("-inf"))
    want = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    if queries <= kernels.FEW_QUERIES:  # the step's own path, not a silent SDPA

        def refuse(*args, **kwargs):
            raise AssertionError("SDPA called for a decoding step")

        monkeypatch.setattr(F, "scaled_dot_product_attention", refuse)
    with torch.no_grad():
        got = kernels.attention(q, k, v, mask)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_attention_keeps_sdpa_for_training():
    torch.manual_seed(0)
    q = torch.randn(1, 2, 3, 8, requires_grad=True)
    k, v = torch.randn(1, 2, 5, 8), torch.randn(1, 2, 5, 8)
    y = kernels.attention(q, k, v, is_causal=False)
    assert "ScaledDotProduct" in type(y.grad_fn).__name__  # the fused kernel and its backward
    torch.manual_seed(1)
    dropped = kernels.attention(q.detach(), k, v, dropout_p=0.5)
    torch.manual_seed(1)
    want = F.scaled_dot_product_attention(q.detach(), k, v, dropout_p=0.5)
    torch.testing.assert_close(dropped, want)


@pytest.mark.parametrize("rows", [1, 6, 300])
@torch.no_grad()
def test_products_without_gradients_are_f_linear(build, rows, monkeypatch):
    """A Linear without gradients (decoding, validation): cpu_decoding's packed products
    where its kernels run (with oneDNN, an AVX-512 CPU's, only below ONEDNN_MIN_ROWS), else
    torch's; F.linear's to fp32 rounding either way."""
    monkeypatch.setattr(kernels, "ONEDNN", ONEDNN)
    monkeypatch.setattr(kernels, "ONEDNN_MIN_ROWS", 256)
    layer, x = Linear(64, 40), torch.randn(rows, 1, 64)
    packed = build != "torch" and not (ONEDNN and rows >= 256)
    assert (layer.panels(x) is not None) == packed
    torch.testing.assert_close(
        layer(x), F.linear(x, layer.weight, layer.bias), rtol=1e-5, atol=1e-4
    )
