"""The real training loop, `python -m transformer.train` with its data loading, on synthetic
WMT-like shards (benchmarks/train_throughput.py), a process per case: the report's train
loop and its compiled cases; the proof's today's and best settings."""

from __future__ import annotations

from functools import partial
from pathlib import Path

from benchmarks import train_throughput
from benchmarks.gpu_report.plan import CONFIGS, config
from benchmarks.gpu_report.section import Ctx, Skipped, peer
from benchmarks.measure import PEAK_TFLOPS

SHAPE_CLASSES = 16  # the best settings' train.shape_classes (params/base.yaml's comment)


def train_loop(ctx: Ctx) -> None:
    """The report's: each config as its params are."""
    for name, steps in ctx.sizes.loop_cases:  # a case that fails keeps the others' rows
        ctx.add("", peer({"config": name}, partial(loop_case, ctx, name, steps)))
    how = "a fresh process per config, its own params (batch_tokens, max_tokens, precision)"
    ctx.note(loop_note(ctx, how))


def compiled_loop(ctx: Ctx) -> None:
    """The report's, under torch.compile, last: compilation time is unknown until measured,
    so it runs after the sections with known costs, each case with its share of the time
    left (a case that runs out says how far it got and how often it recompiled)."""
    cases = ctx.sizes.compile_cases
    if not cases:
        raise Skipped("no compiled cases at these sizes (the compiler's time would be all of it)")
    for i, (name, steps) in enumerate(cases):
        share = max(60.0, ctx.left() / (len(cases) - i))
        ctx.add("", peer({"config": name}, partial(loop_case, ctx, name, steps, (), share)))
    ctx.note(
        "the params' train.compile=true: torch.compile(dynamic=True) of the model; the first "
        "fifth of the steps (compilation included) left out, as in the train loop",
        loop_note(ctx, "a fresh process per config"),
    )


def real_loop(ctx: Ctx) -> None:
    """The proof's: base and big with the params as they are ("today's"), then with the
    best settings (--best-overrides)."""
    s = ctx.sizes
    best, why = best_settings(ctx)
    for name in s.configs:  # before any case starts: a case's share of the time is its own
        shards(ctx, name)
    # Today's settings first (their time is known), the best ones sharing what is left.
    cases = [(name, "today's", []) for name in s.configs]
    cases += [(name, "best", best) for name in s.configs]
    for i, (name, settings, extra) in enumerate(cases):
        timeout = max(10.0, ctx.left() / (len(cases) - i))  # an overrun leaves the rest time
        row = {"config": name, "settings": settings, "overrides": " ".join(extra) or "-"}
        measure = partial(loop_case, ctx, name, s.loop_steps, extra, timeout)
        ctx.add("", peer(row, measure))
    how = "a process per case, its time limit its share of what the phase has left"
    ctx.note(why, loop_note(ctx, how))


def best_settings(ctx: Ctx) -> tuple[list[str], str]:
    """(the "best" overrides, a note): --best-overrides, else the layers compiled on static
    batch shapes (not compiled at --tiny sizes: the CPU's compiler would take all the time)."""
    if ctx.best is not None:
        return ctx.best, "best: --best-overrides"
    best = [f"train.shape_classes={SHAPE_CLASSES}"]
    if not ctx.tiny:
        best.insert(0, "train.compile=true")
    return best, f"best: {' '.join(best)}"


def loop_note(ctx: Ctx, how: str) -> str:
    s = ctx.sizes
    return (
        f"python -m transformer.train <params> --data <shards> in {how}, on {s.loop_pairs:,} "
        f"synthetic pairs (random words, WMT-like lengths <= {s.loop_max_len}, a word "
        "vocabulary of the params' size); the first fifth of the updates left out "
        "(python -m benchmarks.train_throughput --corpus synthetic)"
    )


def shards(ctx: Ctx, name: str) -> Path:
    """The synthetic corpus of `name`'s vocabulary size, made once under the work folder."""
    s = ctx.sizes
    vocab = config(name).vocab.size
    return train_throughput.synthetic_shards(ctx.work, vocab, s.loop_pairs, s.loop_max_len)


def loop_case(
    ctx: Ctx, name: str, steps: int, extra: tuple | list = (), timeout: float | None = None
) -> dict:
    path, overrides = CONFIGS[name]
    r = train_throughput.measure(
        name,
        path,
        [*overrides, *extra],
        shards(ctx, name),
        steps,
        ctx.work,
        ctx.threads,
        cpu=not ctx.cuda,
        timeout=timeout or max(60.0, ctx.left()),  # a hung case must not eat the others' time
    )
    tflops = r["tokens_per_s"] * r["flops_per_token"] / 1e12
    return {
        "device": r["device"],
        "updates": steps,
        "tgt tok/update": r["tokens_per_update"],
        "s/update": r["step_time"],
        "tgt tok/s": r["tokens_per_s"],
        "TFLOP/s": tflops,
        "MFU": tflops / PEAK_TFLOPS if ctx.cuda else None,
        "peak mem GiB": r["peak_mem_gb"],
        "recompiles logged": r.get("recompiles_logged"),
        "compile log": " / ".join(r.get("compile_log", [])) or None,
    }
