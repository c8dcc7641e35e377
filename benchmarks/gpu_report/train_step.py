"""The report's train step: target tokens/s, TFLOP/s and MFU of a training step of base and
big in bf16 at two micro-batch sizes, beside torch.nn.Transformer and MarianMTModel of the
same dimensions (benchmarks/model_step.py), and of the smoke model on the CPU."""

from __future__ import annotations

from benchmarks import model_step
from benchmarks.gpu_report.plan import config
from benchmarks.gpu_report.section import Ctx
from benchmarks.measure import PEAK_TFLOPS


def train_step(ctx: Ctx) -> None:
    s = ctx.sizes
    for name, max_tokens, where in s.step_cases:
        rows = model_step.measure(
            name, config(name), ctx.on(where), max_tokens, s.timed_steps, s.warmup_steps
        )
        ctx.add("", *rows)
    ctx.note(
        *model_step.ratios(ctx.tables.get("", [])),
        f"{s.timed_steps} timed steps after {s.warmup_steps} untimed, Adam "
        "included; the same WMT-like synthetic batches and fused loss for all three; bf16 "
        "autocast on CUDA, fp32 on CPU; under transformer.nn.attention's kernels "
        "(python -m benchmarks.model_step --configs base,big --max-tokens 8192,32768 "
        "--optimizer for the same measurement alone)",
        f"MFU against {PEAK_TFLOPS:.0f} TFLOP/s (what a large bf16 product reaches on one H100 "
        "SXM; its data sheet says 989); FLOPs: 6 x non-embedding params x real tokens + "
        "6 D V per target token + attention",
    )
