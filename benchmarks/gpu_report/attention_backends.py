"""The report's environment section: the machine (machine.py), and for each kind of
attention call model.py makes the SDPA backend that runs it (transformer/nn/attention.py's
choice, and torch's default) with every backend's time at representative shapes and over a
sweep of new shapes: the measurement behind attention.CUDA_BACKENDS, where a backend is
admitted only if it is also right (its outputs and gradients beside the math backend's)."""

from __future__ import annotations

import contextlib
import warnings

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from benchmarks.gpu_report import machine
from benchmarks.gpu_report.section import Ctx
from benchmarks.measure import first_line, timed
from transformer.nn import attention

ENCODER, CAUSAL, CROSS, BEAM = (
    "encoder self-attention",
    "decoder causal self-attention",
    "cross-attention",
    "beam-search step",
)
KINDS = (ENCODER, CAUSAL, CROSS, BEAM)
BACKENDS = (
    SDPBackend.FLASH_ATTENTION,
    SDPBackend.EFFICIENT_ATTENTION,
    SDPBackend.CUDNN_ATTENTION,
    SDPBackend.MATH,
)
# A backend's output and gradients may differ from the math backend's by this much, relative
# to the largest value: bf16 rounding gives ~1e-2; a wrong kernel far more, or NaN.
AGREES = 0.05


def environment(ctx: Ctx) -> None:
    machine.environment(ctx)
    rows = attention_rows(ctx)
    ctx.add("attention backends", *rows)
    ctx.note(attention.describe(ctx.device), *verdict(rows, ctx.device))


def attention_rows(ctx: Ctx) -> list[dict]:
    """Per call kind and backend: whether ours / torch's default picks it, its time at the
    representative shapes, and over new shapes (first calls, then the same calls again)."""
    shapes = {kind: kind_shapes(kind, ctx.sizes.shapes) for kind in KINDS}
    # torch's default first: its priority order is set up at the first SDPA call, and a
    # set_priority context entered before that restores the order it found, not torch's.
    default = {k: chosen(k, shapes[k][0][0], ctx, contextlib.nullcontext()) for k in KINDS}
    rows = []
    for kind in KINDS:
        warm, sweep = shapes[kind]
        ours = chosen(kind, warm[0], ctx, attention.attention_context(ctx.device))
        for backend in BACKENDS:
            row = {
                "call": kind,
                "backend": attention.NAMES[backend],
                "ours": ours == backend,
                "torch default": default[kind] == backend,
            }
            rows.append({**row, **backend_times(backend, kind, warm, sweep, ctx)})
    return rows


def kind_shapes(kind: str, s) -> tuple[list, list]:
    """(representative shapes, new shapes) of a kind at the plan's Shapes `s`: (rows,
    length), or for beam search (sentences, cache slots), 4 slots more at each step."""
    if kind == BEAM:  # the representative shape is none of the sweep's: those stay new
        sweep = [(s.sentences, 4 * t) for t in range(1, s.steps + 1)]
        return [(s.sentences, 4 * (s.steps // 2) + 2)], sweep
    return list(s.train), list(s.sweep)


def sdpa_call(kind: str, shape: tuple[int, int], ctx: Ctx):
    """(a call of model.py's kind at `shape`, with backward for the training kinds; its
    SDPA arguments). q, k, v are views of one projection as MultiHeadAttention's are."""
    s, dev = ctx.sizes.shapes, ctx.device
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    (b, n), train = shape, kind != BEAM
    if kind == BEAM:  # 4 hypotheses a sentence, one new position each, n filled cache slots
        q = torch.randn(b, s.heads, 4, s.d_k, device=dev, dtype=dtype)
        kv = torch.randn(2, b, s.heads, n + 8, s.d_k, device=dev, dtype=dtype)[..., :n, :]
        seen = torch.rand(b, 1, 4, n, device=dev) < 0.7
        seen[..., -1] = True  # every hypothesis sees at least its own newest slot
        # The cache's kind of mask, additive, in the dtype autocast gives it.
        mask = torch.zeros(seen.shape, device=dev, dtype=dtype).masked_fill_(~seen, float("-inf"))
        args, leaves = (q, kv[0], kv[1], mask, False), []
    else:
        keys = n + n // 8 if kind == CROSS else n  # a source a little longer than the target
        x = torch.randn(b, n, 3, s.heads, s.d_k, device=dev, dtype=dtype, requires_grad=True)
        m = torch.randn(b, keys, 2, s.heads, s.d_k, device=dev, dtype=dtype, requires_grad=True)
        q, k, v = x.permute(2, 0, 3, 1, 4).unbind(0)  # (B, h, T, d_k) each
        if kind == CROSS:
            k, v = m.permute(2, 0, 3, 1, 4).unbind(0)
        lengths = torch.randint(keys // 2, keys + 1, (b,), device=dev)
        mask = (torch.arange(keys, device=dev) < lengths[:, None])[:, None, None, :]
        args = (q, k, v, None, True) if kind == CAUSAL else (q, k, v, mask, False)
        leaves = [x, m]

    def call() -> None:
        y = F.scaled_dot_product_attention(*args[:3], attn_mask=args[3], is_causal=args[4])
        if train:
            y.backward(torch.ones_like(y))
            for leaf in leaves:
                leaf.grad = None

    return call, args


def chosen(kind: str, shape, ctx: Ctx, context) -> SDPBackend | None:
    """The backend SDPA selects for this call under `context` (torch's own selector)."""
    _, (q, k, v, mask, causal) = sdpa_call(kind, shape, ctx)
    try:
        with context:
            return SDPBackend(torch._fused_sdp_choice(q, k, v, mask, 0.0, causal))
    except (AttributeError, RuntimeError, TypeError, ValueError):  # a private op: may change
        return None


def backend_times(backend: SDPBackend, kind: str, warm: list, sweep: list, ctx: Ctx) -> dict:
    with sdpa_kernel([backend]), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch explains at length why a kernel does not fit
        try:
            ms, reps = {}, ctx.sizes.shapes.reps
            for shape in warm:
                call, _ = sdpa_call(kind, shape, ctx)
                call()  # the first call at a shape: plans, kernels loaded, memory
                ms["x".join(map(str, shape))] = 1000 * timed(call, ctx.device, reps)
            calls = [sdpa_call(kind, shape, ctx)[0] for shape in sweep]
            cold = [timed(call, ctx.device) for call in calls]
            again = [timed(call, ctx.device) for call in calls]
            diff = disagreement(backend, kind, warm[0], ctx)
        except RuntimeError as err:
            return {"status": f"unsupported: {first_line(err)[:80]}"}
    return {
        "ms at shape": ms,
        "new shapes": len(sweep),
        "first calls ms": 1000 * sum(cold),
        "same again ms": 1000 * sum(again),
        "diff vs math": diff,
    }


def disagreement(backend: SDPBackend, kind: str, shape, ctx: Ctx) -> float:
    """The largest difference of `backend`'s output, and for the training kinds its
    gradients, from the math backend's on the same inputs, relative to the largest math
    value (inf for a NaN): a fast backend must also be right to be admitted."""
    _, (q, k, v, mask, causal) = sdpa_call(kind, shape, ctx)
    results = []
    for b in (backend, SDPBackend.MATH):
        with sdpa_kernel([b]), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal)
            grads = torch.autograd.grad(y, (q, k, v), torch.ones_like(y)) if y.requires_grad else ()
        results.append([y.detach().float(), *(g.float() for g in grads)])
    pairs = zip(*results, strict=True)
    diffs = torch.stack([(a - b).abs().max() / b.abs().max().clamp_min(1e-6) for a, b in pairs])
    return float("inf") if diffs.isnan().any() else diffs.max().item()


def verdict(rows: list[dict], device: torch.device) -> list[str]:
    """Whether cuDNN beats attention.py's choice at every call kind, new shapes counted."""
    if device.type != "cuda":
        return ["cuDNN attention does not run on a CPU: nothing to decide here"]
    lines, slower = [], []
    for kind in KINDS:
        ours = next((r for r in rows if r["call"] == kind and r["ours"]), None)
        cudnn = next(r for r in rows if r["call"] == kind and r["backend"] == "cuDNN")
        if ours is None or "first calls ms" not in cudnn or "first calls ms" not in ours:
            lines.append(f"{kind}: no comparison (cuDNN or ours did not run)")
            slower.append(kind)
            continue
        warm = lambda r: sum(r["ms at shape"].values())
        faster = warm(cudnn) < warm(ours) and cudnn["first calls ms"] < ours["first calls ms"]
        faster = faster and cudnn["diff vs math"] <= AGREES  # and right
        lines.append(
            f"{kind}: ours ({ours['backend']}) {warm(ours):.3g} ms warm, "
            f"{ours['first calls ms']:.4g} ms over {ours['new shapes']} new shapes; cuDNN "
            f"{warm(cudnn):.3g} ms, {cudnn['first calls ms']:.4g} ms, "
            f"{cudnn['diff vs math']:.2g} from math (at most {AGREES})"
        )
        slower += [] if faster else [kind]
    if slower:
        lines.append(
            f"keep attention.CUDA_BACKENDS: cuDNN is not measured faster and right at "
            f"{', '.join(slower)}"
        )
    else:
        lines.append(
            "cuDNN is faster at every call kind, new shapes counted: admit it first "
            "in attention.CUDA_BACKENDS, citing this report"
        )
    return lines
