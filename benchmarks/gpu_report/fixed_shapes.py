"""The proof's eager-before and eager-after: base and big updates in bf16 on a few fixed
batch shapes (model_step.wmt_like_batches, the same seed), reused in turn: ms per update,
target tokens/s, MFU, CUDA kernels and aten ops per update and how busy the GPU is
(torch.profiler). "before" runs the base commit's own code, "after" today's; the compile
and cuda-graphs sections measure the same batches with these functions.

Everything of the library comes through ctx.tree (the base commit's in "before"), and this
module imports none of it (tree.py says why).
"""

from __future__ import annotations

import gc
from collections.abc import Callable

import torch

from benchmarks.gpu_report.section import Ctx
from benchmarks.measure import PEAK_TFLOPS, profiled, timed


def eager(ctx: Ctx) -> None:
    """Ours' update on the fixed batches, as this tree's model_step makes it."""
    bf16_copies = hasattr(ctx.tree.model_step, "ComputeWeights")  # the base commit has none
    update = "bf16 copies of the matrix weights" if bf16_copies else "autocast's casts"
    ctx.note(f"{ctx.tree.label}: ours' update: {update}; code: {ctx.tree.library}")
    for name in ctx.sizes.configs:
        ctx.add("", eager_case(ctx, name))
        release()
    ctx.note(rates_note(ctx))


def eager_case(ctx: Ctx, name: str) -> dict:
    params, batches, net = prepare(ctx, name)
    adam = ctx.tree.model_step.build_optimizer(net, params.train, params.model.d_model)[0]
    step = ctx.tree.model_step.make_step(net, adam, ctx.cuda)
    row = {"config": name, "tree": ctx.tree.label, **batch_shapes(batches)}
    return {**row, **rates(ctx, cycle(step, batches), batches, params)}


def prepare(ctx: Ctx, name: str):
    """(params, the fixed batches on the device, ours built there)."""
    s, model_step = ctx.sizes, ctx.tree.model_step
    params = ctx.tree.config(name)
    made = model_step.wmt_like_batches(s.fixed, s.max_tokens, params.vocab.size, 1)
    batches = [tuple(x.to(ctx.device) for x in b) for b in made]
    return params, batches, model_step.build("ours", params, ctx.device, seed=1)


def cycle(step: Callable, batches: list) -> Callable[[int], torch.Tensor]:
    """update(i): the step on batches[i % n]."""
    return lambda i: step(batches[i % len(batches)])


def batch_shapes(batches: list) -> dict:
    shapes = [f"{b[0].size(0)}x{b[0].size(1)}x{b[1].size(1)}" for b in batches]
    return {"B x S x T": " ".join(shapes)}


def rates(ctx: Ctx, update: Callable, batches: list, params, progress: str = "") -> dict:
    """The first update alone, the rest of the warm-up, then sizes.steps timed updates and
    sizes.profiled profiled ones; update(i) runs on batches[i % n]. `progress`: a name under
    which the warm-up's times and the timed rate are noted as they come (a section killed,
    or one whose profiling fails, then keeps them)."""
    s, dev, model_step = ctx.sizes, ctx.device, ctx.tree.model_step
    run = lambda first, n: [update(i) for i in range(first, first + n)]
    with model_step.attention_context(dev):
        first = timed(lambda: run(0, 1), dev)
        if progress:
            ctx.note(f"{progress}: the first update took {first:.1f} s")
        warm = timed(lambda: run(1, s.warmup - 1), dev)
        if progress:
            ctx.note(f"{progress}: {s.warmup - 1} more warm-up updates took {warm:.1f} s")
        seconds = timed(lambda: run(s.warmup, s.steps), dev)
    measured = [batches[i % len(batches)] for i in range(s.warmup, s.warmup + s.steps)]
    tokens = sum(b[3].numel() for b in measured)
    if progress:
        ctx.note(f"{progress}: {tokens / seconds:,.0f} tgt tok/s over {s.steps} timed updates")
    work = lambda: run(0, s.profiled)
    summary = profiled(dev, lambda: None, work, "", model_step.attention_context(dev))[0]
    with torch.device("meta"):  # shapes only, for the FLOP count
        shape = model_step.Transformer(params.model, params.vocab.size)
    flops = sum(model_step.step_flops(shape, b) for b in measured)
    per = lambda key: None if summary[key] is None else summary[key] / s.profiled
    return {
        "first update s": first,
        "warm-up s": warm,
        "ms/update": 1000 * seconds / s.steps,
        "tgt tok/update": tokens / s.steps,
        "tgt tok/s": tokens / seconds,
        "TFLOP/s": flops / seconds / 1e12,
        "MFU": flops / seconds / 1e12 / PEAK_TFLOPS if ctx.cuda else None,
        "kernels/update": per("kernels"),
        "GPU busy": summary["GPU busy"],
        "aten ops/update": per("aten ops"),
    }


def rates_note(ctx: Ctx) -> str:
    s = ctx.sizes
    precision = "bf16 autocast" if ctx.cuda else "fp32"
    return (
        f"{s.fixed} fixed WMT-like batches of <= {s.max_tokens:,} padded tokens "
        f"(model_step.wmt_like_batches, seed 1), one per update in turn: {s.warmup} updates "
        f"untimed, {s.steps} timed, {s.profiled} under torch.profiler (kernels, aten ops, GPU "
        f"busy: the kernels' time over the wall time); {precision}; MFU against "
        f"{PEAK_TFLOPS:.0f} TFLOP/s (benchmarks/measure.py's PEAK_TFLOPS)"
    )


def release() -> None:
    """The last config's memory back to the device, before the next one's."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
