"""The report's profile: where ours spends its time, by torch.profiler, in a training step
and in beam search: per aten op (the device time of the kernels it launched itself; off
CUDA its own CPU time), per CUDA kernel, how busy the GPU was and how many kernels it was
sent: what to fix first where a rate is short of its target."""

from __future__ import annotations

from collections.abc import Callable

import torch

from benchmarks import decode as decode_bench
from benchmarks import model_step
from benchmarks.gpu_report.decode import decode_sources
from benchmarks.gpu_report.plan import config
from benchmarks.gpu_report.section import Ctx
from benchmarks.measure import profiled
from transformer.nn import attention
from transformer.nn.model import Transformer
from transformer.tokens import PAD
from transformer.training.optim import build_optimizer

PROFILED_STEPS = 3  # profiled training steps, after as many untimed


def profile(ctx: Ctx) -> None:
    for kind, name, size in ctx.sizes.profile_cases:
        work = (training_work if kind == "train" else beam_work)(ctx, name, size)
        summary, ops, kernels = profiled(ctx.device, *work, attention.attention_context(ctx.device))
        label = f"{kind} {name} {size}"
        ctx.add("summary", {"work": label, **summary})
        ctx.add(f"ops, {label}", *ops)
        if kernels:
            ctx.add(f"kernels, {label}", *kernels)
    ctx.note(
        f"train <config> <max_tokens>: ours, {PROFILED_STEPS} training steps (Adam included) "
        f"after {PROFILED_STEPS} untimed, on the train step section's WMT-like batches",
        "beam <config> <sentences>: ours, beam 4 as the decode section runs it (the params' "
        "decode section, random weights, WMT-like sources) after a warm-up batch",
        "bf16 autocast on CUDA; the profiler's own cost is in the wall time; ms are in all "
        "(the summary's 'per' says over what); 'share' is of all the device time (CPU time "
        "off CUDA); op names are aten's, kernel names cut at 90 characters",
    )


def training_work(ctx: Ctx, name: str, max_tokens: int) -> tuple[Callable, Callable, str]:
    """(warm up, the profiled work, what it is) for training steps of ours."""
    params, device, n = config(name), ctx.device, PROFILED_STEPS
    batches = model_step.wmt_like_batches(2 * n, max_tokens, params.vocab.size, seed=1)
    batches = [tuple(x.to(device) for x in b) for b in batches]
    net = model_step.build("ours", params, device, seed=1)
    adam = build_optimizer(net, params.train, params.model.d_model)[0]
    step = model_step.make_step(net, adam, bf16=ctx.cuda)
    steps = lambda some: [step(b) for b in some]
    return lambda: steps(batches[:n]), lambda: steps(batches[n:]), f"{n} steps"


def beam_work(ctx: Ctx, name: str, sentences: int) -> tuple[Callable, Callable, str]:
    """(warm up, the profiled work, what it is) for beam search of ours."""
    params, dev = config(name), ctx.device.type
    torch.manual_seed(0)
    model = Transformer(params.model, params.vocab.size, pad_id=PAD).to(ctx.device).eval()
    sources = decode_sources(params, sentences, params.decode.max_tokens)
    searcher = decode_bench.EndsWithSource(model)
    go = lambda some: decode_bench.run(searcher, some, params.decode, "beam", dev)
    return lambda: go(sources[:16]), lambda: go(sources), f"{sentences} sentences"
