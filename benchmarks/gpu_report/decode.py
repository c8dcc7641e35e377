"""Beam search's sentences/s, ours beside its peers on the same weights and sources
(benchmarks/decode.py's functions): the report's decode section (base and big, and the smoke
model on the CPU, beside CTranslate2 and MarianMTModel.generate; CTranslate2's wheels need
CUDA 12's cuBLAS) and the proof's beam phase (each of ours' searches, and on the CPU
CTranslate2)."""

from __future__ import annotations

import ctypes
from collections.abc import Callable
from functools import partial

import torch

from benchmarks import decode as decode_bench
from benchmarks.gpu_report.machine import package_version
from benchmarks.gpu_report.plan import config
from benchmarks.gpu_report.section import Ctx, Skipped, peer
from benchmarks.measure import failure
from transformer.config import Params
from transformer.nn import attention
from transformer.nn.model import Transformer
from transformer.tokens import PAD

WIDER = 4  # the report's wide-batch row: decode.max_tokens times this
PROOF_MODES = ("beam", "beam-static")  # the proof's: the shrinking search and the static one


def decode(ctx: Ctx) -> None:
    """The report's: per config, ours, ours under torch's default attention kernels,
    MarianMTModel, CTranslate2, ours in batches WIDER times as large."""
    for name, where, n in ctx.sizes.decode_cases:
        device = ctx.on(where)
        row = {"config": name, "device": device.type, "search": "beam 4, ours"}
        if ctx.left() <= 0:  # this section has no time of its own: the run's budget
            ctx.add("", {**row, "status": "skipped: the time budget is spent"})
            continue
        try:
            case = decode_case(ctx, name, device, n)
        except Exception as err:  # big out of memory, say: the other configs' rows stay
            ctx.add("", {**row, "status": failure(err)})
            continue
        ctx.add("", *case)
        ctx.note(*ratios(name, *case))
    ctx.note(
        "random weights, WMT-like random sources (lognormal lengths, mean ~27 subwords), "
        "each batch's sources evened to its longest and every output ending where its source "
        "does, for both decoders (benchmarks/decode.py; python -m benchmarks.decode --configs "
        "base,big --modes beam,ct2-beam measures the same alone); the params' decode section "
        "(beam 4, alpha 0.6, max length source + 50, decode.max_tokens per batch)",
        f"ours, <N>-token batches: the same search with decode.max_tokens {WIDER}x the "
        "params' (sources evened to the longest of these larger batches: longer outputs, so "
        "compare tok/s)",
        "torch default attention: the same search with no sdpa_kernel restriction "
        "(beam_search's restrict_attention=False), on the first sentences only and first "
        "calls included, as a translate run without transformer.nn.attention would pay them",
        " ".join(decode_bench.DIFFERENCES.split()),
    )


def ratios(name: str, ours: dict, default: dict, marian: dict, ct2: dict, wide: dict) -> list:
    """The decode_case rows' ratios that were measured, as notes."""
    on, lines = f"{name} on {ours['device']}", []
    if "tok/s" in ours and "tok/s" in wide:
        ratio = wide["tok/s"] / ours["tok/s"]
        lines.append(f"{on}: {WIDER}x wider batches / the params' = {ratio:.2f}x target tokens/s")
    for peer_row, peer_name in ((ct2, "CTranslate2"), (marian, "MarianMTModel")):
        if "sent/s" in ours and "sent/s" in peer_row:
            ratio = ours["sent/s"] / peer_row["sent/s"]
            lines.append(f"{on}: ours / {peer_name} = {ratio:.2f}x sentences/s")
    return lines


def decode_case(ctx: Ctx, name: str, device: torch.device, n: int) -> list[dict]:
    params, model, sources, searcher = setup(name, device, n)
    cfg, dev = params.decode, device.type
    go = lambda s, cfg=cfg, restrict=True: decode_bench.run(searcher, s, cfg, "beam", dev, restrict)
    # The same search in batches WIDER times as large: if a GPU's step costs the host the
    # same for 4x the sentences, these show it. Sources evened per larger batch, so longer
    # on average: compare tok/s.
    wide_cfg = cfg.model_copy(update={"max_tokens": WIDER * cfg.max_tokens})
    wide_sources = decode_sources(params, n, wide_cfg.max_tokens)
    row = {"config": name, "device": dev, "precision": "bf16" if dev == "cuda" else "fp32"}
    with attention.attention_context(device):
        ours = {**row, "search": "beam 4, ours", **rate(go, sources, warm_up=True)}
        wide = {
            **row,
            "search": f"beam 4, ours, {wide_cfg.max_tokens:,}-token batches",
            **rate(lambda s: go(s, wide_cfg), wide_sources),
        }
    default = {**row, "search": "beam 4, ours, torch default attention"}
    if dev == "cuda":
        first = sources[: ctx.sizes.default_sentences]
        default = peer(default, lambda: rate(partial(go, restrict=False), first))
    else:
        default["status"] = "skipped: on CPU attention.py leaves torch's choice as it is"
    marian = peer(
        {**row, "search": "beam 4, MarianMTModel (transformers)"},
        lambda: marian_rate(model, sources, cfg, dev),
    )
    ct2 = peer(
        {**row, "search": "beam 4, CTranslate2"},
        lambda: ctranslate2_rate(model, sources, cfg, dev),
    )
    return [ours, default, marian, ct2, wide]


def beam(ctx: Ctx) -> None:
    """The proof's: each of ours' searches, on the GPU and on the CPU; on the CPU also
    CTranslate2, on the same weights and sources."""
    if ctx.cuda:
        beam_case(ctx, ctx.device, *ctx.sizes.beam)
    beam_case(ctx, torch.device("cpu"), *ctx.sizes.cpu_beam)
    ctx.note(
        f"ours: benchmarks/decode.py's run() in its modes {', '.join(PROOF_MODES)}; after a "
        f"warm-up on 16 sentences, on the GPU the best of {ctx.sizes.rounds} round(s), the "
        "first round's rate beside it; on the CPU one round, as CTranslate2's",
        " ".join(decode_bench.DIFFERENCES.split()),
    )


def beam_case(ctx: Ctx, device: torch.device, name: str, n: int) -> None:
    params, model, sources, searcher = setup(name, device, n)
    cfg = params.decode
    row = {"config": name, "device": device.type, "sentences": n}
    for mode in PROOF_MODES:
        found = {**row, "search": f"beam {cfg.beam_size}, ours ({mode})"}
        ctx.add("", peer(found, partial(ours_rate, ctx, searcher, sources, cfg, mode, device)))
    if device.type == "cpu":
        go = partial(ctranslate2_rate, model, sources, cfg, "cpu")
        ctx.add("", peer({**row, "search": f"beam {cfg.beam_size}, CTranslate2"}, go))


def ours_rate(ctx: Ctx, searcher, sources: list, cfg, mode: str, device) -> dict:
    """On the GPU the best of the plan's rounds (a host-bound search varies), the first's
    rate beside it."""
    go = lambda some: decode_bench.run(searcher, some, cfg, mode, device.type)
    with attention.attention_context(device):
        n = ctx.sizes.rounds if device.type == "cuda" else 1
        rounds = [rate(go, sources, warm_up=i == 0) for i in range(n)]
    best = max(rounds, key=lambda r: r["sent/s"])
    return {**best, "first round sent/s": rounds[0]["sent/s"]}


def setup(name: str, device: torch.device, n: int):
    """(params, a random-weight model of `name` on `device`, n sources, ours' searcher)."""
    params = config(name)
    torch.manual_seed(0)
    model = Transformer(params.model, params.vocab.size, pad_id=PAD).to(device).eval()
    sources = decode_sources(params, n, params.decode.max_tokens)
    return params, model, sources, decode_bench.EndsWithSource(model)


def decode_sources(params: Params, n: int, max_tokens: int) -> list[list[int]]:
    """n WMT-like random sources, each batch of `max_tokens` evened to its longest
    (benchmarks/decode.py says why)."""
    sources = decode_bench.wmt_like_sources(n, params.vocab.size, seed=0)
    return decode_bench.even_batches(sources, max_tokens, params.vocab.size, seed=1)


def rate(go: Callable, sources: list, warm_up: bool = False) -> dict:
    if warm_up:
        go(sources[:16])
    seconds, tokens, _ = go(sources)
    return {
        "sentences": len(sources),
        "seconds": seconds,
        "sent/s": len(sources) / seconds,
        "tok/s": tokens / seconds,
        "mean tgt len": tokens / len(sources),
    }


def ctranslate2_rate(model: Transformer, sources: list, cfg, dev: str) -> dict:
    if dev == "cuda":
        needs_cublas12()
    # CTranslate2 takes token strings: the special ones by name, made-up ones for the rest.
    vocab = model.out_proj.weight.size(0)
    pieces = ["<pad>", "<unk>", "<s>", "</s>", *(f"w{i}" for i in range(4, vocab))]
    translator = decode_bench.ctranslate2_translator(model, pieces, dev)
    go = lambda s: decode_bench.run_ctranslate2(translator, s, pieces, cfg, "ct2-beam", True)
    return rate(go, sources, warm_up=True)


def marian_rate(model: Transformer, sources: list, cfg, dev: str) -> dict:
    marian = decode_bench.marian_generator(model, cfg, dev)
    go = lambda s: decode_bench.run_marian(marian, s, cfg, True, dev)
    return rate(go, sources, warm_up=True)


def needs_cublas12() -> None:
    """CTranslate2's PyPI wheels (4.x) are built for CUDA 12 and load libcublas.so.12 at
    their first product; beside a torch built for CUDA 13 it is usually absent."""
    try:
        ctypes.CDLL("libcublas.so.12")
    except OSError:
        version = package_version("ctranslate2")
        raise Skipped(
            f"CTranslate2 {version}'s CUDA build loads libcublas.so.12 (CUDA 12), absent "
            f"here (torch is built for CUDA {torch.version.cuda})"
        ) from None
