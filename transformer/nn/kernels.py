"""The model's matrix products and dropout, with faster paths than torch's defaults on a CPU.

Matrix products (`linear`, `Linear`): torch's PyPI CPU wheels run F.linear and `@` on MKL,
which picks its kernels by CPU vendor: on AMD CPUs it runs its AVX2 kernels. oneDNN, which
torch also ships (and CTranslate2 runs on AMD CPUs), picks by instruction set: with
AVX-512 it is faster than MKL on this project's shapes (AMD Zen 4 and 5), the same results
up to fp32 rounding (benchmarks/cpu_gemm.py; results in benchmarks/results/), so products
go there on such a CPU (`ONEDNN`). oneDNN's linear (the op torch.compile's CPU backend
calls) has no autograd formula, so `_OneDNNLinear` gives it one in two more oneDNN
products. On a CPU without AVX-512 both libraries run AVX2 kernels, and oneDNN is no faster
on large products and slower on a decoding step's few rows (it reorders the weights at each
call), so it is not used there.

Without gradients (decoding, validation) a `Linear` runs its products on its weight packed
once for cpu_decoding's `linear` (`Linear.panels`) where those C kernels are built: MKL and
oneDNN pack the weight at every call, and torch's call into either costs more than a
product of a decoding step's few rows takes. With AVX-512 only products of fewer than
ONEDNN_MIN_ROWS rows go there (a decoding step's hypotheses), where oneDNN runs the larger
ones as fast; without it every product does, where MKL's are slower at every size
(benchmarks/cpu_gemm.py). With gradients it is oneDNN (ONEDNN) or MKL's F.linear; anywhere
else (GPU, bf16, autocast, torch.compile tracing, a torch without oneDNN, no C kernels)
F.linear.

Dropout (`Dropout`): torch's CPU dropout draws its mask with bernoulli_, slower than a
uniform draw and a comparison; on a CPU the mask is drawn so (same distribution, same
generator). On a GPU it is F.dropout's fused kernel, native_dropout, called directly.

Attention (`attention`): F.scaled_dot_product_attention, except for a decoding step on a CPU
(a few queries, no gradient), where SDPA's flash kernel, tiled for long blocks of queries,
is slower than one product, a softmax and a second product, and those are slower than
cpu_decoding's C kernel, which runs there (its docstring says where it declines and what
runs then: the two products); and under a CPU's bf16 autocast, where it runs in fp32
(`attention`'s comment says why).

A decoding step's log-probabilities (`log_softmax_`): the logits' log_softmax in
cpu_decoding's C on a CPU without gradients, where the logits are the largest tensor of a
step and torch's AVX2 kernel takes several times as long; torch's anywhere else.

Residual connections (`add_norm`): LayerNorm(x + y) in one pass of cpu_decoding's C on a
CPU without gradients (decoding, validation), where torch's add and layer_norm take two ops
and more passes over a decoding step's rows; torch's ops anywhere else.

Keys in tiles (`reads_tiles`): where cpu_decoding's attention kernel will read a decoding
cache's keys, the cache keeps them in its tiles (kv_cache.py).

bf16 on a CPU (`CPU_BF16`): where the CPU has bf16 dot-product instructions, the trainer's
`train.precision: bf16` runs its products in bf16 autocast there too, as on a GPU
(benchmarks/model_step.py measures a training step both ways).

Decoding, validation and training on a CPU all run through here (benchmarks/model_step.py
measures a training step against torch's defaults; benchmarks/decode.py, decoding).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from transformer.nn import cpu_decoding
from transformer.nn.cpu_decoding import TILE

# oneDNN for fp32 products on a CPU with AVX-512 (see the module docstring).
ONEDNN = (
    torch.backends.mkldnn.is_available() and "AVX512" in torch.backends.cpu.get_cpu_capability()
)
# bf16 dot products in hardware (AVX512_BF16: AMD Zen 4 on, Intel Cooper Lake on; AMX:
# Sapphire Rapids on), where oneDNN's bf16 products run faster than fp32's; elsewhere bf16
# is emulated, slower than fp32.
# A torch without get_capabilities (pyproject allows 2.5 on) counts as no such CPU.
_capabilities = getattr(torch.cpu, "get_capabilities", dict)()
CPU_BF16: str | None = next((n for n in ("amx_bf16", "avx512_bf16") if _capabilities.get(n)), None)
# With oneDNN (ONEDNN), products of fewer rows go to cpu_decoding's packed products where
# they are built, else to MKL: oneDNN's per-call cost (see the docstring) outweighs its
# arithmetic there.
ONEDNN_MIN_ROWS = 256
FEW_QUERIES = 8  # a beam of up to 8 hypotheses at one step, as decode.py's steps query
# False runs a CPU the way a GPU is run (F.linear, F.dropout, SDPA, the loss's logits in
# the product's dtype, beam search's add and topk): tests count the GPU's ops on a CPU so.
CPU_PATHS = True


def cpu_path(t: Tensor) -> bool:
    """Whether `t` takes this module's CPU paths (see CPU_PATHS)."""
    return CPU_PATHS and t.is_cpu


def c_path(t: Tensor) -> bool:
    """Whether `t` may go to cpu_decoding's C kernels: a CPU path outside compiled code,
    which keeps torch's ops (a call through ctypes cannot be traced, and a branch on a
    shape would guard the graph on it: one more compilation for each side it takes)."""
    return cpu_path(t) and not torch.compiler.is_compiling()


def linear(
    x: Tensor, weight: Tensor, bias: Tensor | None = None, panels: Tensor | None = None
) -> Tensor:
    """x (..., in) @ weight (out, in)^T + bias (out,): F.linear's contract. `weight` may be
    any strided view (a transpose, a slice): the loss passes W^T and activations as weights.
    `panels`: the weight packed by `Linear.panels`, for a product on a CPU without
    gradients."""
    y = None if panels is None else cpu_decoding.linear(x, panels, bias, weight.size(0))
    if y is not None:
        return y
    if not _onednn(x, weight):
        return F.linear(x, weight, bias)
    tracked = (t is not None and t.requires_grad for t in (x, weight, bias))
    if torch.is_grad_enabled() and any(tracked):
        return _OneDNNLinear.apply(x, weight, bias)
    return _pointwise(x, weight, bias)


class Linear(nn.Linear):
    """nn.Linear (same parameters, same state_dict keys) computed by `linear`."""

    # (the weight's address and version, the weight packed for cpu_decoding.linear)
    _panels: tuple[tuple[int, int], Tensor] | None = None

    def forward(self, x: Tensor) -> Tensor:
        return linear(x, self.weight, self.bias, self.panels(x))

    def train(self, mode: bool = True) -> Linear:
        # An optimizer may change the weight in place without a new version (fused Adam
        # on a CPU does): a packing made before a training step is not reused after it.
        self._panels = None
        return super().train(mode)

    def panels(self, x: Tensor, rows: int | None = None) -> Tensor | None:
        """The weight (its first `rows` outputs) packed for cpu_decoding.linear, where x's
        product goes there (on a CPU without gradients: see the module docstring), else
        None. Packed once, again whenever the weight changes (its address or version) and
        after every switch between training and eval mode (`train`)."""
        w = self.weight
        if torch.is_grad_enabled() or w.dtype != torch.float32 or not _packed(x):
            return None
        if self._panels is None or self._panels[0] != (w.data_ptr(), w._version):
            self._panels = ((w.data_ptr(), w._version), cpu_decoding.tile_keys(w.detach()))
        if rows is None or rows == w.size(0):
            return self._panels[1]
        return self._panels[1][: rows // TILE] if rows % TILE == 0 else None


class Dropout(nn.Dropout):
    """nn.Dropout; on a CPU, its mask from a uniform draw rather than bernoulli_."""

    def forward(self, x: Tensor) -> Tensor:
        if not self.training or self.p == 0.0:
            return x  # not even F.dropout's no-op: ~10 dispatched calls a decoding step
        if not cpu_path(x):  # F.dropout's own fused kernel on a GPU, one op
            return torch.native_dropout(x, self.p, True)[0]
        # 1.0 with probability 1 - p, else 0.0; drawn in fp32 (a bf16 draw rounds the
        # threshold p, and keeps measurably fewer than 1 - p: tests/test_kernels.py)
        keep = torch.rand(x.shape, device=x.device).ge_(self.p).to(x.dtype)
        return x * keep.mul_(1.0 / (1.0 - self.p))


def attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    mask: Tensor | None = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
) -> Tensor:
    """F.scaled_dot_product_attention's contract (q (..., L, d), k, v (..., S, d); `mask`
    broadcast to (..., L, S): boolean, True = may attend, or added to the scores), without
    its `scale` argument; k may also be in tiles (..., S / 16, d, 16), cpu_decoding.tile_keys."""
    if k.dim() == 5:  # keys in tiles (a decoding cache's on a CPU): cpu_decoding's layout
        if _few_queries(q, k, v) and (out := cpu_decoding.attend(q, k, v, mask)) is not None:
            return out
        k = cpu_decoding.untile_keys(k, v.size(-2))  # for any other kernel
    if cpu_path(q) and q.dtype == torch.bfloat16:
        # CPU bf16 autocast (training): torch's bf16 attention backward on a CPU is several
        # times slower than fp32's on these shapes, and the products around it, not
        # attention, are where bf16 gains. So attention runs in fp32 here.
        with torch.autocast("cpu", enabled=False):
            if mask is not None and mask.is_floating_point():
                mask = mask.float()
            return attention(q.float(), k.float(), v.float(), mask, dropout_p, is_causal)
    if not _few_queries(q, k, v) or dropout_p or is_causal:
        return F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, dropout_p=dropout_p, is_causal=is_causal
        )
    if (out := cpu_decoding.attend(q, k, v, mask)) is not None:
        return out
    # Where the C kernel is not built or declines: two batched products around a softmax.
    scores = (q * q.size(-1) ** -0.5) @ k.transpose(-2, -1)  # (..., L, S)
    # Every row keeps a key: its own position, or a sentence's EOS. An additive mask is
    # faster here than masked_fill_ of a boolean one, both broadcast over heads.
    if mask is not None and mask.dtype == torch.bool:
        scores.masked_fill_(~mask, float("-inf"))
    elif mask is not None:
        scores += mask
    return scores.softmax(-1) @ v


def reads_tiles(t: Tensor) -> bool:
    """Whether a decoding cache keeps keys like `t` (..., d_k) in tiles: cpu_decoding's
    attention kernel reads them (cpu_decoding.reads_tiles) on a CPU path outside compiled
    code (c_path)."""
    return c_path(t) and cpu_decoding.reads_tiles(t)


def add_norm(x: Tensor, y: Tensor, norm: nn.LayerNorm) -> Tensor:
    """norm(x + y); y may be overwritten. On a CPU path outside compiled code, without
    gradients, cpu_decoding's one pass (a decoding step's residual connections)."""
    out = cpu_decoding.add_norm(x, y, norm.weight, norm.bias, norm.eps) if c_path(x) else None
    return norm(x + y) if out is None else out


def log_softmax_(x: Tensor) -> Tensor:
    """torch.log_softmax(x, -1) written over x (contiguous): cpu_decoding's passes over
    each row on a CPU path outside compiled code without gradients (a decoding step's
    logits), torch's elsewhere."""
    out = cpu_decoding.log_softmax_(x) if c_path(x) else None
    return torch.log_softmax(x, dim=-1, out=x) if out is None else out


def describe(device: torch.device | str) -> str:
    """One line for a log: what runs the matrix products."""
    if torch.device(device).type == "cpu" and ONEDNN:
        return "matrix products: oneDNN (transformer/nn/kernels.py), not torch's MKL"
    return "matrix products: torch's F.linear"


def _onednn(x: Tensor, weight: Tensor) -> bool:
    return (
        ONEDNN
        and cpu_path(x)
        and x.numel() >= ONEDNN_MIN_ROWS * x.size(-1)
        and x.dtype == weight.dtype == torch.float32
        and not torch.is_autocast_enabled("cpu")
        and not torch.compiler.is_compiling()
    )


def _packed(x: Tensor) -> bool:
    """Products for cpu_decoding's packed weights: on a CPU path outside compiled code and
    autocast (whose products are bf16), where its kernels run; with oneDNN (ONEDNN) only
    those of fewer than ONEDNN_MIN_ROWS rows, without it all (see the module docstring)."""
    few = not ONEDNN or x.numel() < ONEDNN_MIN_ROWS * x.shape[-1]
    return few and c_path(x) and cpu_decoding.available() and not torch.is_autocast_enabled("cpu")


def _few_queries(q: Tensor, k: Tensor, v: Tensor) -> bool:
    return (
        c_path(q)
        and q.dtype == torch.float32
        and q.size(-2) <= FEW_QUERIES
        and not (torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v)))
    )


def _pointwise(x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")


class _OneDNNLinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
        ctx.save_for_backward(x, weight)
        ctx.has_bias = bias is not None
        out = _pointwise(x, weight, bias)  # an N-D input's result is a view of its 2-D rows
        # Not a view to autograd (aten's matmul does the same): a view made inside a custom
        # Function cannot be modified in place, and the FFN's ReLU is.
        return torch.ops.aten._unsafe_view(out, out.shape) if out._is_view() else out

    @staticmethod
    def backward(ctx, grad: Tensor):
        x, weight = ctx.saved_tensors
        g = grad.reshape(-1, grad.size(-1))  # (N, out)
        grad_x = grad_w = grad_b = None
        if ctx.needs_input_grad[0]:
            grad_x = _pointwise(grad, weight.t(), None)  # (..., in) = grad @ W
        if ctx.needs_input_grad[1]:
            # (in, N) @ (N, out), transposed back: oneDNN's fast orientation for dW = g^T x
            # (faster than asking for (out, in) directly).
            x2 = x.reshape(-1, x.size(-1))
            grad_w = _pointwise(x2.t().contiguous(), g.t(), None).t().contiguous()
        if ctx.has_bias and ctx.needs_input_grad[2]:
            grad_b = g.sum(0)
        return grad_x, grad_w, grad_b
