"""The proof's compile: eager-after's update with each layer compiled
(transformer/training/compiled.py): the first update's seconds (compiling), graphs,
recompiles and graph breaks, then the rates. Off CUDA dynamo and AOTAutograd trace (fullgraph,
the counts; the backward's graph, functionalized and partitioned, as inductor gets it) but
generate no code: inductor's C++ would take minutes of a CPU rehearsal."""

from __future__ import annotations

import contextlib

import torch
import torch._dynamo
from torch._dynamo.utils import counters

from benchmarks.gpu_report.fixed_shapes import batch_shapes, cycle, prepare, rates, rates_note
from benchmarks.gpu_report.section import Ctx
from transformer.training.compiled import compile_layers, compile_stats

OFF_CUDA_BACKEND = "aot_eager"


def compiled(ctx: Ctx) -> None:
    """Dynamo's counts are this config's (the difference over its updates)."""
    backend = "inductor" if ctx.cuda else OFF_CUDA_BACKEND
    name = ctx.sizes.base  # big compiles in the real loop's best case
    torch._dynamo.reset()
    counters.clear()
    ctx.add("", {**compiled_case(ctx, name), **compile_stats()})
    ctx.note(
        f"{name} only (big: the real loop's best case compiles it); compile_layers: each "
        f"encoder and decoder layer compiled (fullgraph, symbolic sizes), the loss's chunks "
        f"too; backend {backend}"
        + ("" if ctx.cuda else " off CUDA (dynamo's and AOTAutograd's tracing, no code generated)"),
        "first update s: its compilation included; warm-up s: the other fixed shapes' "
        "updates (a recompilation only where a shape specialises)",
        rates_note(ctx),
    )


def compiled_case(ctx: Ctx, name: str) -> dict:
    params, batches, net = prepare(ctx, name)
    model_step = ctx.tree.model_step
    adam = model_step.build_optimizer(net, params.train, params.model.d_model)[0]
    with contextlib.nullcontext() if ctx.cuda else compiler_backend(OFF_CUDA_BACKEND):
        step = model_step.make_step(net, adam, ctx.cuda, compile_layers=compile_layers)
    measured = rates(ctx, cycle(step, batches), batches, params, progress=name)
    return {"config": name, **batch_shapes(batches), **measured}


@contextlib.contextmanager
def compiler_backend(backend: str):
    """torch.compile calls made inside use `backend` (the library's compile_layers and
    loss name none: on a GPU they get inductor)."""
    real = torch.compile

    def with_backend(*args, **kwargs):
        return real(*args, **{**kwargs, "backend": backend})

    torch.compile = with_backend
    try:
        yield
    finally:
        torch.compile = real
