"""Decoding speed: sentences/s and target tokens/s of beam search with the params' decode
section (the paper's beam 4, alpha 0.6, input length + 50) against its peers in the same
run: greedy search, and beam search without the key/value cache (the decoder re-run over
the whole prefix every step).

    python benchmarks/decode.py                                  # smoke model, CPU
    python benchmarks/decode.py --configs smoke,base,big --device cuda

Models have random weights (speed does not depend on them), sources are random token ids
with WMT-like lengths (lognormal, mean ~27 subwords, tail clipped at 250), batched as
`translate` does (longest first, decode.max_tokens source tokens per batch). Random weights
would end every output at once or never; instead each output ends where its source does
(EOS is made near-certain there and impossible before), so target lengths are realistic
(EN-DE subword counts are close) and the report gives their mean. On CUDA the search runs
in bf16 autocast.
"""

from __future__ import annotations

import argparse
import math
import time
from pathlib import Path

import torch

from transformer.config import DecodeConfig, load_params
from transformer.model import Transformer
from transformer.search import beam_search, greedy_search
from transformer.translate import batch_by_tokens, pad_batch
from transformer.vocab import EOS, PAD

ROOT = Path(__file__).resolve().parents[1]


class EndsWithSource:
    """A model whose outputs end where their sources do: target length = source length."""

    def __init__(self, model: Transformer):
        self.model, self.cfg = model, model.cfg
        self.encode, self.new_cache = model.encode, model.new_cache

    def decode(self, tgt_in, memory, src_padding, cache=None):
        logits = self.model.decode(tgt_in, memory, src_padding, cache).float()  # (B, T, V)
        end = tgt_in.size(1) if cache is None else cache.length  # positions so far
        made = torch.arange(end - tgt_in.size(1), end, device=logits.device)  # tokens before
        wanted = (~src_padding).sum(1, keepdim=True) - 1  # (B, 1): source subwords
        logits[..., EOS] = torch.where(made >= wanted, 30.0, -30.0)  # (B, T)
        return logits


def wmt_like_sources(n: int, vocab: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    sigma = 0.6  # mean of the lognormal = exp(mu + sigma^2 / 2) = 27
    lengths = (torch.randn(n, generator=g) * sigma + math.log(27) - sigma**2 / 2).exp()
    lengths = lengths.round().clamp(2, 250).long().tolist()  # EOS included
    return [[*torch.randint(4, vocab, (m - 1,), generator=g).tolist(), EOS] for m in lengths]


def run(model, sources, cfg: DecodeConfig, mode: str, device: str) -> tuple[float, int]:
    """Seconds and target tokens (EOS included) to decode all sources in `mode`."""
    if device == "cuda":
        torch.cuda.synchronize()
    start, tokens = time.perf_counter(), 0
    for batch in batch_by_tokens(sources, cfg.max_tokens):
        src = pad_batch([sources[j] for j in batch], device)
        if mode == "greedy":
            outs = greedy_search(model, src, cfg.max_len_a, cfg.max_len_b)
        else:
            hyps = beam_search(
                model, src, cfg.beam_size, cfg.len_penalty, cfg.max_len_a, cfg.max_len_b,
                cached=mode == "beam",
            )  # fmt: skip
            outs = [h[0].tokens for h in hyps]
        tokens += sum(len(o) + 1 for o in outs)
    if device == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - start, tokens


MODES = ("beam", "greedy", "beam-uncached")


def bench_config(name: str, args: argparse.Namespace) -> None:
    params = load_params(ROOT / "params" / f"{name}.yaml")
    torch.manual_seed(0)
    model = Transformer(params.model, params.vocab.size, pad_id=PAD).to(args.device).eval()
    model = EndsWithSource(model)
    sources = wmt_like_sources(args.sentences, params.vocab.size, seed=0)
    src_len = sum(map(len, sources)) / len(sources)
    cfg = params.decode
    if args.max_tokens:
        cfg = cfg.model_copy(update={"max_tokens": args.max_tokens})
    precision = "bf16" if args.device == "cuda" else "fp32"
    print(
        f"\n{name}: {sum(p.numel() for p in model.model.parameters()) / 1e6:.1f}M parameters, "
        f"{len(sources)} sentences, mean source length {src_len:.1f} (max {max(map(len, sources))})"
        f", {cfg.max_tokens} source tokens per batch, {args.device} {precision}"
    )
    print(f"decode: beam size {cfg.beam_size}, alpha {cfg.len_penalty}, max length "
          f"{cfg.max_len_a} * source + {cfg.max_len_b}")  # fmt: skip
    print(f"{'mode':<16}{'seconds':>9}{'sent/s':>9}{'tok/s':>10}{'mean len':>10}")
    for mode in args.modes.split(","):
        run(model, sources[:16], cfg, mode, args.device)  # warm-up
        seconds, tokens = run(model, sources, cfg, mode, args.device)
        print(
            f"{mode:<16}{seconds:>9.2f}{len(sources) / seconds:>9.1f}{tokens / seconds:>10.0f}"
            f"{tokens / len(sources):>10.1f}"
        )


def main() -> None:
    cuda = torch.cuda.is_available()
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument(
        "--configs",
        default="smoke,base,big" if cuda else "smoke",
        help="params/<name>.yaml model sections, comma-separated",
    )
    p.add_argument("--sentences", type=int, default=1000)
    p.add_argument("--device", choices=["cpu", "cuda"], default="cuda" if cuda else "cpu")
    p.add_argument("--modes", default=",".join(MODES), help=f"comma-separated, of {MODES}")
    p.add_argument("--max-tokens", type=int, help="source tokens per batch (default: params')")
    p.add_argument(
        "--threads",
        type=int,
        help="CPU threads (default: torch's; use 1 on a "
        "shared machine, where spinning threads slow each other down)",
    )
    args = p.parse_args()
    if unknown := set(args.modes.split(",")) - set(MODES):
        p.error(f"unknown modes {sorted(unknown)}; choose from {MODES}")
    if args.threads:
        torch.set_num_threads(args.threads)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} CPU threads")
    for name in args.configs.split(","):
        bench_config(name, args)


if __name__ == "__main__":
    main()
