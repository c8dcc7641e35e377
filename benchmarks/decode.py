"""Decoding speed: sentences/s and target tokens/s of beam search with the params' decode
section (the paper's beam 4, alpha 0.6, input length + 50) against its peers in the same
run: the static beam search (beam-static: fixed shapes, a CUDA graph per batch on CUDA;
beam is the shrinking one: see transformer/decoding/search.py), greedy search, beam search without
the key/value cache (the decoder re-run over the whole prefix every step), CTranslate2's
beam and greedy search on the same weights (exported with transformer.export), inputs,
batches, beam size and number of threads, and Hugging Face's MarianMTModel.generate on the
same weights (hf-beam: the model that `transformer.export --format huggingface` writes).

    python -m benchmarks.decode                                   # smoke model, CPU
    python -m benchmarks.decode --configs smoke,base,big --device cuda
    python -m benchmarks.decode --model model.pt --threads 1     # a trained model
    python -m benchmarks.decode --configs base --device cuda --modes beam,beam-static \
        --sentences 2000 --ops                                   # and host ops per step
    python -m benchmarks.decode --kernels portable --threads 1  # another build of the C kernels

On a CPU the report names the CPU, its instruction sets and the build of the C decoding
kernels that ran (transformer/nn/cpu_decoding.py: avx512, avx2, portable, or torch's ops
alone); --kernels runs another build, any that this CPU can run (torch: none), so that one
machine measures each path. Torch's own ops follow the CPU (ATEN_CPU_CAPABILITY=avx2, set
before the run, makes an AVX-512 CPU's torch run its AVX2 code as well).

Models have random weights (speed does not depend on them), sources are random token ids
with WMT-like lengths (lognormal, mean ~27 subwords, tail clipped at 250), batched as
`translate` does (longest first, decode.max_tokens source tokens per batch). Random weights
would end every output at once or never; instead each output ends where its source does
(EOS is made near-certain there and impossible before), so target lengths are realistic
(EN-DE subword counts are close) and the report gives their mean. On CUDA the search runs
in bf16 autocast (CTranslate2: compute type bfloat16).

--ops counts, on the first batch, the aten ops (views excluded) the host issues per decoder
step of each of our searches (a CUDA graph's replay issues none).

With --model, a trained model file decodes the first --sentences lines of --input, and
its outputs end where the model ends them; the report also counts the CTranslate2 outputs
that equal ours.

CTranslate2 limits lengths per batch, not per sentence: it may decode
int(max_len_a * longest source + max_len_b) + 1 steps, as many as ours for the batch's
longest source. With random weights it cannot be made to end each output where its source
does, so each batch's sources are lengthened to its longest (random tokens where padding
was: the same batches, the same encoder work) and CTranslate2 decodes exactly that many
tokens (min = max decoding length): every output of both ends at the same step.
"""

from __future__ import annotations

import argparse
import importlib.util
import math
import statistics
import tempfile
import time
from pathlib import Path

import torch
from torch import Tensor, nn
from torch.utils._python_dispatch import TorchDispatchMode

from benchmarks.measure import sync
from transformer.cli import ArgumentParser
from transformer.config import DecodeConfig, load_params
from transformer.decoding.search import beam_search, greedy_search
from transformer.decoding.translate import batch_by_tokens, load_translator, pad_batch
from transformer.nn import cpu_decoding
from transformer.nn.kv_cache import Arena
from transformer.nn.model import Transformer
from transformer.tokens import EOS, PAD

ROOT = Path(__file__).resolve().parents[1]


class EndsWithSource(nn.Module):
    """A model whose outputs end where their sources do: target length = source length.
    A module, so that .to() and copies take the model along; device ops only (the position
    may be a device tensor), so that a CUDA graph can replay it. Each row's source length
    is worked out once per batch (and again when sentences leave it), not at every step:
    CTranslate2, told its lengths, pays nothing for them."""

    def __init__(self, model: Transformer):
        super().__init__()
        self.model, self.cfg = model, model.cfg
        self._wanted: tuple[Tensor, int, Tensor, Tensor] | None = None

    def encode(self, src):
        return self.model.encode(src)

    def new_cache(self, max_len: int = 0, arena=None):
        return self.model.new_cache(max_len, arena)

    def decode(self, tgt_in, memory, src_padding, cache=None):
        start = 0 if cache is None else cache.length  # before decode(), which may advance it
        logits = self.model.decode(tgt_in, memory, src_padding, cache).float()  # (B, T, V)
        wanted, eos = self._wanted_of(src_padding, tgt_in.size(0))
        if isinstance(start, int) and tgt_in.size(1) == 1:  # a cached step: one copy
            logits[:, 0, EOS] = eos[:, min(start, eos.size(1) - 1)]
            return logits
        made = start  # tokens before each new position: (T,), or the one's
        if tgt_in.size(1) > 1:
            made = start + torch.arange(tgt_in.size(1), device=logits.device)
        logits[..., EOS] = torch.where(made >= wanted, 30.0, -30.0)
        return logits

    def _wanted_of(self, padding: Tensor, rows: int) -> tuple[Tensor, Tensor]:
        """(B, 1): each target row's source subwords, and (B, W) the EOS logit after each
        number of tokens made (the last column for any more). Each source row serves
        B / B' consecutive target rows (beam search's hypotheses)."""
        if self._wanted is None or self._wanted[0] is not padding or self._wanted[1] != rows:
            wanted = (~padding).sum(1) - 1  # (B',)
            wanted = wanted.repeat_interleave(rows // wanted.size(0)).unsqueeze(1)
            made = torch.arange(padding.size(1) + 1, device=padding.device)
            eos = torch.where(made >= wanted, 30.0, -30.0)
            self._wanted = (padding, rows, wanted, eos)
        return self._wanted[2:]


def wmt_like_sources(n: int, vocab: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    sigma = 0.6  # mean of the lognormal = exp(mu + sigma^2 / 2) = 27
    lengths = (torch.randn(n, generator=g) * sigma + math.log(27) - sigma**2 / 2).exp()
    lengths = lengths.round().clamp(2, 250).long().tolist()  # EOS included
    return [[*torch.randint(4, vocab, (m - 1,), generator=g).tolist(), EOS] for m in lengths]


def even_batches(sources: list[list[int]], max_tokens: int, vocab: int, seed: int):
    """Each batch's sources lengthened to its longest with random tokens before EOS: the
    batches stay the same, and the outputs of a batch end together (see the docstring)."""
    g = torch.Generator().manual_seed(seed)
    out = list(sources)
    for batch in batch_by_tokens(sources, max_tokens):
        longest = len(sources[batch[0]])
        for j in batch:
            extra = torch.randint(4, vocab, (longest - len(sources[j]),), generator=g).tolist()
            out[j] = [*sources[j][:-1], *extra, EOS]
    return out


class OpsPerStep(TorchDispatchMode):
    """Aten ops (views excluded) the host issues, and decoder steps: Transformer.decode()
    calls, except those a CUDA graph captures, and the graph's replays."""

    def __init__(self):
        super().__init__()
        self.ops = self.steps = 0
        self.patched = [(Transformer, "decode"), (torch.cuda.CUDAGraph, "replay")]
        self.patched += [(torch.cuda.CUDAGraph, "capture_begin")]

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops += not func.is_view
        return func(*args, **(kwargs or {}))

    def __enter__(self):
        self.saved = [getattr(owner, name) for owner, name in self.patched]
        for (owner, name), method in zip(self.patched, self.saved, strict=True):
            step = -1 if name == "capture_begin" else 1  # the captured decode() runs nothing

            def counted(*args, method=method, step=step, **kwargs):
                self.steps += step
                return method(*args, **kwargs)

            setattr(owner, name, counted)
        return super().__enter__()

    def __exit__(self, *exc):
        for (owner, name), method in zip(self.patched, self.saved, strict=True):
            setattr(owner, name, method)
        return super().__exit__(*exc)


def ops_per_step(model, sources, cfg: DecodeConfig, mode: str, device: str) -> float:
    """Host ops per decoder step of `mode` on the first batch, after a warm-up run."""
    first = [sources[j] for j in next(iter(batch_by_tokens(sources, cfg.max_tokens)))]
    run(model, first, cfg, mode, device)
    with OpsPerStep() as counter:
        run(model, first, cfg, mode, device)
    return counter.ops / max(counter.steps, 1)


def run(model, sources, cfg: DecodeConfig, mode: str, device: str, restrict_attention=True):
    """Seconds, target tokens (EOS included) and the outputs, to decode all sources;
    `restrict_attention=False`: beam search under torch's own attention kernels."""
    sync(torch.device(device))
    start, tokens, outputs = time.perf_counter(), 0, [[] for _ in sources]
    arena = Arena()  # as translate keeps one from batch to batch
    for batch in batch_by_tokens(sources, cfg.max_tokens):
        src = pad_batch([sources[j] for j in batch], device)
        if mode == "greedy":
            outs = greedy_search(model, src, cfg.max_len_a, cfg.max_len_b, arena=arena)
        else:
            hyps = beam_search(
                model, src, cfg.beam_size, cfg.len_penalty, cfg.max_len_a, cfg.max_len_b,
                cached=mode != "beam-uncached",
                early_stop="beam" if mode == "beam-early" else "exact",
                static=mode == "beam-static", restrict_attention=restrict_attention,
                arena=arena,
            )  # fmt: skip
            outs = [h[0].tokens for h in hyps]
        tokens += sum(len(o) + 1 for o in outs)
        for j, out in zip(batch, outs, strict=True):
            outputs[j] = out
    sync(torch.device(device))
    return time.perf_counter() - start, tokens, outputs


def ctranslate2_translator(model: Transformer, pieces: list[str], device: str):
    """A ctranslate2.Translator of the same weights, with as many threads as torch."""
    import ctranslate2

    from transformer.decoding.export import write_ctranslate2

    with tempfile.TemporaryDirectory() as tmp:
        write_ctranslate2(model, pieces, Path(tmp))
        return ctranslate2.Translator(
            tmp,
            device=device,
            compute_type="bfloat16" if device == "cuda" else "float32",
            intra_threads=torch.get_num_threads(),
        )


def run_ctranslate2(translator, sources, pieces, cfg: DecodeConfig, mode: str, fixed: bool):
    """As `run`, with CTranslate2; `fixed`: each output is as long as its batch's sources."""
    start, tokens, outputs = time.perf_counter(), 0, [[] for _ in sources]
    ids = {piece: i for i, piece in enumerate(pieces)}
    for batch in batch_by_tokens(sources, cfg.max_tokens):
        longest = len(sources[batch[0]])
        steps = int(cfg.max_len_a * longest + cfg.max_len_b) + 1  # tokens, EOS included
        lengths = {"min_decoding_length": longest} if fixed else {}
        results = translator.translate_batch(
            [[pieces[i] for i in sources[j][:-1]] for j in batch],  # the model appends EOS
            beam_size=cfg.beam_size if mode == "ct2-beam" else 1,
            length_penalty=cfg.len_penalty,
            max_decoding_length=longest if fixed else steps,
            return_end_token=True,
            **lengths,
        )
        for j, result in zip(batch, results, strict=True):
            out = [ids[piece] for piece in result.hypotheses[0]]
            tokens += len(out)
            outputs[j] = out[:-1] if out[-1:] == [EOS] else out
    return time.perf_counter() - start, tokens, outputs


def marian_generator(model: Transformer, cfg: DecodeConfig, device: str):
    """Hugging Face's MarianMTModel with the same weights (transformer.export's mapping,
    what `--format huggingface` writes), in bf16 on CUDA."""
    from transformer.decoding.export import marian_model

    marian = marian_model(model, cfg).to(device).eval()
    return marian.to(torch.bfloat16) if device == "cuda" else marian


def run_marian(marian, sources, cfg: DecodeConfig, fixed: bool, device: str):
    """As `run`, with MarianMTModel.generate's beam search; `fixed`: each output is as long
    as its batch's sources (as run_ctranslate2)."""
    sync(torch.device(device))
    start, tokens, outputs = time.perf_counter(), 0, [[] for _ in sources]
    for batch in batch_by_tokens(sources, cfg.max_tokens):
        src = pad_batch([sources[j] for j in batch], device)
        longest = src.size(1)  # EOS included
        steps = longest if fixed else int(cfg.max_len_a * longest + cfg.max_len_b) + 1
        with torch.inference_mode():
            out = marian.generate(
                input_ids=src,
                attention_mask=src != PAD,
                max_length=steps + 1,  # BOS included
                min_length=longest + 1 if fixed else 0,
                early_stopping=True,  # done once beam_size hypotheses finished
            )
        for j, row in zip(batch, out[:, 1:].tolist(), strict=True):  # after BOS
            end = row.index(EOS) if EOS in row else len([t for t in row if t != PAD])
            outputs[j] = row[:end]
            tokens += min(end + 1, len(row))  # EOS counted, where it came
    sync(torch.device(device))
    return time.perf_counter() - start, tokens, outputs


MODES = (
    "beam",
    "beam-static",
    "beam-early",
    "greedy",
    "beam-uncached",
    "ct2-beam",
    "ct2-greedy",
    "hf-beam",
)
DIFFERENCES = """\
ct2-*: CTranslate2. Its length penalty divides by len^alpha (len without EOS), ours by GNMT's
  ((5 + len) / 6)^alpha (len with EOS); its beam search ends a sentence once beam_size
  hypotheses finished, as ours with early_stop="beam" (beam-early); ours by default
  (beam) ends it once none can still beat the best finished one. hf-beam: Hugging Face's
  MarianMTModel.generate on the same weights, CTranslate2's length penalty and stopping."""


def bench_config(name: str, args: argparse.Namespace) -> None:
    """A random-weight model of params/<name>.yaml on WMT-like random sources."""
    params = load_params(ROOT / "params" / f"{name}.yaml")
    torch.manual_seed(0)
    model = Transformer(params.model, params.vocab.size, pad_id=PAD).to(args.device).eval()
    sources = wmt_like_sources(args.sentences, params.vocab.size, seed=0)
    cfg = decode_config(params, args)
    if any(m.startswith(("ct2", "hf")) for m in args.modes.split(",")):
        sources = even_batches(sources, cfg.max_tokens, params.vocab.size, seed=1)
    # CTranslate2 takes token strings: the special ones by name, made-up ones for the rest.
    pieces = ["<pad>", "<unk>", "<s>", "</s>", *(f"w{i}" for i in range(4, params.vocab.size))]
    bench(name, model, sources, pieces, cfg, args, random_weights=True)


def bench_model(path: Path, args: argparse.Namespace) -> None:
    """A trained model file on the first --sentences lines of --input."""
    from transformer.decoding.export import vocabulary

    model, sp, params = load_translator(path, args.device)
    lines = [line for line in Path(args.input).read_text().splitlines() if line.strip()]
    sources = sp.encode(lines[: args.sentences], add_eos=True)
    cfg = decode_config(params, args)
    bench(path.name, model, sources, vocabulary(sp), cfg, args, random_weights=False)


def decode_config(params, args: argparse.Namespace) -> DecodeConfig:
    if args.max_tokens:
        return params.decode.model_copy(update={"max_tokens": args.max_tokens})
    return params.decode


def bench(name, model: Transformer, sources, pieces, cfg, args, random_weights: bool) -> None:
    """Decode `sources` in each of --modes and print a row each, then ours against CTranslate2."""
    src_len = sum(map(len, sources)) / len(sources)
    precision = "bf16" if args.device == "cuda" else "fp32"
    print(
        f"\n{name}: {sum(p.numel() for p in model.parameters()) / 1e6:.1f}M parameters, "
        f"{len(sources)} sentences, mean source length {src_len:.1f} (max {max(map(len, sources))})"
        f", {cfg.max_tokens} source tokens per batch, {args.device} {precision}"
    )
    print(f"decode: beam size {cfg.beam_size}, alpha {cfg.len_penalty}, max length "
          f"{cfg.max_len_a} * source + {cfg.max_len_b}; seconds: each mode's best of "
          f"{args.repeat} rounds")  # fmt: skip
    ops = "ops/step" if args.ops else ""
    print(f"{'mode':<16}{'seconds':>9}{'sent/s':>9}{'tok/s':>10}{'mean len':>10}{ops:>10}")
    modes = args.modes.split(",")
    searcher = EndsWithSource(model) if random_weights else model
    if any(m.startswith("ct2") for m in modes):
        translator = ctranslate2_translator(model, pieces, args.device)
    if "hf-beam" in modes:
        marian = marian_generator(model, cfg, args.device)
    go = {}
    for mode in modes:
        if mode.startswith("ct2"):
            go[mode] = lambda s, m=mode: run_ctranslate2(
                translator, s, pieces, cfg, m, random_weights
            )
        elif mode == "hf-beam":
            go[mode] = lambda s: run_marian(marian, s, cfg, random_weights, args.device)
        else:
            go[mode] = lambda s, m=mode: run(searcher, s, cfg, m, args.device)
        go[mode](sources[:16])  # warm-up
    # Each mode's best of --repeat rounds, the modes taking turns within a round: on a shared
    # machine a neighbour's load slows some runs down and never speeds one up. Ratios are
    # also taken round by round, between runs that followed each other, of seconds and of
    # the process's CPU seconds (which a neighbour's load changes less).
    rounds = {mode: [] for mode in modes}
    for _ in range(args.repeat):
        for mode in modes:
            cpu = time.process_time()
            seconds, tokens, outputs = go[mode](sources)
            rounds[mode].append((seconds, tokens, outputs, time.process_time() - cpu))
    best = {mode: min(results, key=lambda r: r[0]) for mode, results in rounds.items()}
    ours = [m for m in modes if not m.startswith(("ct2", "hf"))]
    per_step = lambda m: f"{ops_per_step(searcher, sources, cfg, m, args.device):.1f}"
    ops = {m: per_step(m) for m in ours} if args.ops else {}
    for mode, (seconds, tokens, *_) in best.items():
        print(
            f"{mode:<16}{seconds:>9.2f}{len(sources) / seconds:>9.1f}{tokens / seconds:>10.0f}"
            f"{tokens / len(sources):>10.1f}{ops.get(mode, ''):>10}"
        )
    compare(rounds, len(sources), random_weights)


def compare(rounds: dict, n: int, random_weights: bool) -> None:
    """Ours against CTranslate2, mode by mode: speed (the ratio of the bests, and of each
    round's two runs: min / median / max), and (trained model) equal outputs."""
    pairs = [("beam", "ct2-beam"), ("beam-static", "ct2-beam"), ("beam-early", "ct2-beam")]
    pairs += [("greedy", "ct2-greedy"), ("beam", "hf-beam"), ("beam-early", "hf-beam")]
    pairs = [pair for pair in pairs if set(pair) <= rounds.keys()]
    for ours, theirs in pairs:
        (ours_s, _, ours_out, _), (theirs_s, _, theirs_out, _) = (
            min(rounds[mode], key=lambda r: r[0]) for mode in (ours, theirs)
        )
        peer = "ctranslate2" if theirs.startswith("ct2") else "marian"
        line = f"ours / {peer} sent/s, {ours} / {theirs}: {theirs_s / ours_s:.2f}"
        if len(rounds[ours]) > 1:
            pairs = list(zip(rounds[ours], rounds[theirs], strict=True))
            line += f" (best of each); round by round {spread([t[0] / o[0] for o, t in pairs])}"
            line += f", CPU seconds {spread([t[3] / o[3] for o, t in pairs])}"
        if not random_weights:
            line += f"; outputs equal to ours: {sum(map(list.__eq__, ours_out, theirs_out))}/{n}"
        print(line)
    if any(m.startswith(("ct2", "hf")) for m in rounds):
        print(DIFFERENCES)
        if random_weights:
            print("  Random weights: every output of both ends at its (evened) source's length.")


def spread(values: list[float]) -> str:
    return f"min {min(values):.2f} median {statistics.median(values):.2f} max {max(values):.2f}"


def main() -> None:
    cuda = torch.cuda.is_available()
    p = ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument(
        "--configs",
        default="smoke,base,big" if cuda else "smoke",
        help="params/<name>.yaml model sections, comma-separated",
    )
    p.add_argument("--model", type=Path, help="a trained model file instead of --configs")
    p.add_argument("--input", default=ROOT / "data/smoke/test.en", help="sentences for --model")
    p.add_argument("--sentences", type=int, default=1000)
    p.add_argument("--device", choices=["cpu", "cuda"], default="cuda" if cuda else "cpu")
    p.add_argument("--modes", default=",".join(MODES), help=f"comma-separated, of {MODES}")
    p.add_argument("--max-tokens", type=int, help="source tokens per batch (default: params')")
    p.add_argument("--repeat", type=int, default=3, help="rounds of every mode; the best counts")
    p.add_argument(
        "--ops", action="store_true", help="host ops per decoder step of our modes (first batch)"
    )
    p.add_argument(
        "--threads",
        type=int,
        help="CPU threads (default: torch's; use 1 on a "
        "shared machine, where spinning threads slow each other down)",
    )
    p.add_argument(
        "--kernels",
        choices=(*cpu_decoding.BUILDS, "torch"),
        help="the build of the C decoding kernels on a CPU (default: the fastest this CPU "
        "runs); torch: none, torch's ops only",
    )
    args = p.parse_args()
    if args.repeat < 1:
        p.error(f"--repeat {args.repeat}: at least 1 round")
    if unknown := set(args.modes.split(",")) - set(MODES):
        p.error(f"unknown modes {sorted(unknown)}; choose from {MODES}")
    if "ct2" in args.modes and importlib.util.find_spec("ctranslate2") is None:
        p.error("the ct2-* modes need ctranslate2 (pip install 'ctranslate2>=4,<5'); see --modes")
    if args.kernels:
        try:
            cpu_decoding.select(args.kernels)
        except ValueError as e:
            p.error(f"--kernels {args.kernels}: {e}")
    if args.threads:
        torch.set_num_threads(args.threads)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} CPU threads")
    if args.device == "cpu":
        print(cpu_decoding.describe_cpu())
        print(cpu_decoding.describe())
    if args.model:
        bench_model(args.model, args)
        return
    for name in args.configs.split(","):
        bench_config(name, args)


if __name__ == "__main__":
    main()
