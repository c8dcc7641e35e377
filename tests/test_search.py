"""Greedy and beam search on stub models whose next-token probabilities are set by hand,
so the right answer is known exactly; then on a tiny random Transformer, ensembles, and a
trained smoke model."""

import math
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from transformer.config import ModelConfig
from transformer.decoding.search import Hypothesis, beam_search, greedy_search
from transformer.decoding.translate import batch_by_tokens, load_translator, pad_batch
from transformer.nn.kv_cache import Arena
from transformer.nn.model import Transformer
from transformer.tokens import BOS, EOS, PAD, UNK

ROOT = Path(__file__).resolve().parents[1]

A, B = 4, 5  # two ordinary tokens


# Tiny models gain nothing from threads (see conftest.one_thread).
pytestmark = pytest.mark.usefixtures("one_thread")


class StubCache:
    """Keeps each row's prefix and each sentence's memory; reorder() moves them as the real
    KV cache moves its keys and values."""

    def __init__(self):
        self.prefix = self.memory = self.pad = None

    @property
    def length(self) -> int:
        return 0 if self.prefix is None else self.prefix.size(1)

    def reorder(self, rows, shrink=None):
        """As the real cache: a row may only continue a row of its own sentence."""
        kept = torch.arange(self.memory.size(0)) if shrink is None else shrink.kept
        sentence = kept.repeat_interleave(rows.size(0) // kept.size(0))  # of each new row
        assert torch.equal(rows // (self.prefix.size(0) // self.memory.size(0)), sentence)
        self.prefix, self.memory, self.pad = self.prefix[rows], self.memory[kept], self.pad[kept]


class StubModel:
    """Next-token log-probabilities from `dist(source, prefix)`: source = the real source
    ids (padding dropped), prefix = the tokens after BOS. As the Transformer, it takes
    one memory row per sentence, shared by consecutive target rows. `rows` records each
    decode's batch."""

    def __init__(self, dist, vocab: int):
        self.dist, self.vocab, self.rows = dist, vocab, []

    def new_cache(self, max_len: int = 0, arena=None):
        return StubCache()

    def encode(self, src):
        return src.float().unsqueeze(-1)  # (B, S, 1): the source travels in the memory

    def decode(self, tgt_in, memory, src_padding, cache=None):
        prefix = tgt_in
        if cache is not None:
            if cache.memory is None:  # a fresh cache takes the memory, as the real one does
                cache.memory, cache.pad = memory, src_padding
            cache.prefix = tgt_in if cache.prefix is None else torch.cat([cache.prefix, tgt_in], 1)
            prefix, memory, src_padding = cache.prefix, cache.memory, cache.pad
        assert (prefix[:, 0] == BOS).all()
        self.rows.append(prefix.size(0))
        group = prefix.size(0) // memory.size(0)
        memory, src_padding = (
            memory.repeat_interleave(group, 0),
            src_padding.repeat_interleave(group, 0),
        )
        last = [
            self.dist(tuple(mem[~pad, 0].long().tolist()), tuple(pre[1:].tolist()))
            for mem, pad, pre in zip(memory, src_padding, prefix, strict=True)
        ]
        logits = torch.zeros(prefix.size(0), tgt_in.size(1), self.vocab)
        logits[:, -1] = torch.stack(last)  # only the last position is ever read
        return logits


def probs(vocab: int, **p: float) -> torch.Tensor:
    """Log-probabilities from {token name: probability}; unnamed tokens get 0."""
    ids = {"unk": UNK, "eos": EOS, "a": A, "b": B}
    out = torch.zeros(vocab)
    for name, value in p.items():
        out[ids[name]] = value
    return out.log()


def batch(*sentences: list[int], width: int = 0) -> torch.Tensor:
    """PAD-padded source batch; each sentence gets its EOS."""
    rows = [[*s, EOS] for s in sentences]
    src = torch.full((len(rows), max(width, *map(len, rows))), PAD)
    for i, row in enumerate(rows):
        src[i, : len(row)] = torch.tensor(row)
    return src


# "a" is likely but short; "b b b b b" less likely but long: the length penalty decides.
def lp_case(source, prefix):
    if prefix == ():
        return probs(6, a=0.5, b=0.45, unk=0.05)
    if set(prefix) == {B} and len(prefix) < 5:
        return probs(6, b=1.0)
    return probs(6, eos=1.0)


def lp(length: int, alpha: float) -> float:
    return ((5 + length) / 6) ** alpha


def test_without_length_penalty_the_likeliest_wins():
    model = StubModel(lp_case, 6)
    (hyps,) = beam_search(model, batch([7]), 4, 0.0, 0.0, 10, n_best=2)
    assert [h.tokens for h in hyps] == [[A], [B] * 5]
    assert hyps[0].score == pytest.approx(math.log(0.5))
    assert hyps[1].logprob == pytest.approx(math.log(0.45))


def test_length_penalty_changes_the_winner():
    model = StubModel(lp_case, 6)
    (hyps,) = beam_search(model, batch([7]), 4, 0.6, 0.0, 10, n_best=2)
    assert [h.tokens for h in hyps] == [[B] * 5, [A]]
    assert hyps[0].score == pytest.approx(math.log(0.45) / lp(6, 0.6))
    assert hyps[0].logprob == pytest.approx(math.log(0.45))
    assert hyps[1].score == pytest.approx(math.log(0.5) / lp(2, 0.6))


def test_early_stop_only_when_no_live_hypothesis_can_win():
    # alpha 0: once "a" is finished, "b..." (raw score already lower) cannot beat it.
    model = StubModel(lp_case, 6)
    beam_search(model, batch([7]), 4, 0.0, 0.0, 10)
    assert len(model.rows) == 2
    # alpha 0.6: "b..." might still win, so the search must go on to find it.
    model = StubModel(lp_case, 6)
    (hyps,) = beam_search(model, batch([7]), 4, 0.6, 0.0, 10)
    assert hyps[0].tokens == [B] * 5


# "a" then EOS or "a a" then EOS finish early; "b b b b b" finishes last, and wins at 0.6.
def early_case(source, prefix):
    if prefix == ():
        return probs(6, a=0.5, b=0.45, unk=0.05)
    if prefix == (A,):
        return probs(6, eos=0.6, a=0.4)
    if set(prefix) == {B} and len(prefix) < 5:
        return probs(6, b=1.0)
    return probs(6, eos=1.0)


def test_early_stop_beam_ends_a_sentence_once_beam_size_hypotheses_finished():
    model = StubModel(early_case, 6)
    (exact,) = beam_search(model, batch([7]), 2, 0.6, 0.0, 10)
    assert exact[0].tokens == [B] * 5 and len(model.rows) > 3
    # fairseq's rule: "a" and "a a" have finished after step 2, two of a beam of two.
    model = StubModel(early_case, 6)
    (early,) = beam_search(model, batch([7]), 2, 0.6, 0.0, 10, n_best=2, early_stop="beam")
    assert [h.tokens for h in early] == [[A], [A, A]] and len(model.rows) == 3
    assert early[0].score == pytest.approx(math.log(0.3) / lp(2, 0.6))


def always_a(source, prefix):
    return probs(5, a=0.8, eos=0.2)


def test_maximum_length_forces_eos():
    # Scores of a^n EOS: (n log .8 + log .2) / lp(n + 1); with alpha 1 the longest wins.
    model = StubModel(always_a, 5)
    (hyps,) = beam_search(model, batch([7]), 2, 1.0, 0.0, 3, n_best=2)
    assert [h.tokens for h in hyps] == [[A] * 3, [A] * 2]
    logprob = 3 * math.log(0.8) + math.log(0.2)
    assert hyps[0].logprob == pytest.approx(logprob)
    assert hyps[0].score == pytest.approx(logprob / lp(4, 1.0))
    # With alpha 0 the empty output wins; greedy runs to the limit.
    (hyps,) = beam_search(StubModel(always_a, 5), batch([7]), 2, 0.0, 0.0, 3)
    assert hyps == [
        Hypothesis(tokens=[], score=pytest.approx(math.log(0.2)), logprob=hyps[0].logprob)
    ]
    assert greedy_search(StubModel(always_a, 5), batch([7]), 0.0, 3) == [[A] * 3]
    # A hard cap (a learned position table's size) beats a * src_len + b.
    assert greedy_search(StubModel(always_a, 5), batch([7]), 0.0, 3, max_len=2) == [[A] * 2]


def test_limits_follow_each_source_length_and_finished_sentences_leave_the_batch():
    model = StubModel(always_a, 5)
    src = batch([], [7], [7, 7], [7, 7, 7])  # real lengths 1..4 (EOS counted)
    assert greedy_search(model, src, 1.0, 0) == [[A], [A] * 2, [A] * 3, [A] * 4]
    assert model.rows == [4, 4, 3, 2, 1]
    model = StubModel(always_a, 5)
    beam_search(model, src, 2, 1.0, 1.0, 0)
    assert model.rows == [4, 8, 6, 4, 2]  # the first step extends each BOS once


def random_tree(vocab: int):
    """Deterministic random next-token distributions for each (source, prefix)."""

    def dist(source, prefix):
        g = torch.Generator().manual_seed(hash((source, prefix)) % 2**31)
        logits = 2 * torch.randn(vocab, generator=g)
        logits[EOS] += 0.3 * len(prefix)  # endings grow likelier, as in real outputs
        return torch.log_softmax(logits, -1)

    return dist


SOURCES = [[5, 6, 7], [8], [9, 10, 11, 12, 13, 14], [6, 6]]


@pytest.mark.parametrize("alpha", [0.0, 0.6])
def test_a_sentence_does_not_depend_on_its_batch_or_padding(alpha):
    model = StubModel(random_tree(12), 12)
    together = beam_search(model, batch(*SOURCES, width=9), 3, alpha, 1.0, 4, n_best=3)
    for i, source in enumerate(SOURCES):
        assert beam_search(model, batch(source), 3, alpha, 1.0, 4, n_best=3) == [together[i]]
    reverse = beam_search(model, batch(*SOURCES[::-1]), 3, alpha, 1.0, 4, n_best=3)
    assert reverse == together[::-1]


def test_cached_and_uncached_search_agree_on_the_stub():
    model = StubModel(random_tree(12), 12)
    src = batch(*SOURCES)
    assert beam_search(model, src, 4, 0.6, 1.0, 5, cached=False) == beam_search(
        model, src, 4, 0.6, 1.0, 5
    )
    assert greedy_search(model, src, 1.0, 5, cached=False) == greedy_search(model, src, 1.0, 5)


def test_beam_one_without_penalty_is_greedy():
    model = StubModel(random_tree(12), 12)
    src = batch(*SOURCES)
    beams = beam_search(model, src, 1, 0.0, 1.0, 5)
    assert [h[0].tokens for h in beams] == greedy_search(model, src, 1.0, 5)


def test_outputs_respect_the_limit_and_are_sorted():
    model = StubModel(random_tree(12), 12)
    found = beam_search(model, batch(*SOURCES), 4, 0.6, 1.0, 2, n_best=4)
    for source, hyps in zip(SOURCES, found, strict=True):
        assert len(hyps) == 4
        assert all(len(h.tokens) <= len(source) + 1 + 2 for h in hyps)
        assert all(t not in (PAD, BOS, EOS) for h in hyps for t in h.tokens)
        assert [h.score for h in hyps] == sorted((h.score for h in hyps), reverse=True)


def test_settings_the_search_cannot_honour_are_errors():
    model = StubModel(always_a, 5)
    with pytest.raises(ValueError, match="n_best"):
        beam_search(model, batch([7]), 2, 0.6, 1.0, 3, n_best=3)
    with pytest.raises(ValueError, match="len_penalty"):
        beam_search(model, batch([7]), 2, -0.5, 1.0, 3)


# --------------------------------------------------------------------------- the real model


class Ending(torch.nn.Module):
    """A model whose EOS logit grows by `slope` per target position: random weights alone
    repeat one token to the length limit, and real searches end at varied lengths. The
    cache's length is read before decode() (KVCache advances it there; the static cache's
    is a device tensor that the search advances)."""

    def __init__(self, model, slope: float):
        super().__init__()
        self.model, self.slope, self.cfg = model, slope, model.cfg

    def encode(self, src):
        return self.model.encode(src)

    def new_cache(self, max_len: int = 0, arena=None):
        return self.model.new_cache(max_len, arena)

    def decode(self, tgt_in, memory, src_padding, cache=None):
        start = 0 if cache is None else cache.length
        logits = self.model.decode(tgt_in, memory, src_padding, cache)  # (B, T, V)
        logits[..., EOS] += self.slope * (start + torch.arange(tgt_in.size(1)))
        return logits


def tiny_transformer(vocab: int = 40, seed: int = 0, slope: float = 1.0) -> Ending:
    torch.manual_seed(seed)
    cfg = ModelConfig(n_layers=2, d_model=32, d_ff=64, n_heads=4, dropout=0.0)
    model = Transformer(cfg, vocab).eval()
    with torch.no_grad():  # large weights: outputs that depend more on their context
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0.0, 1.0)
    return Ending(model, slope)


def real_sources(n: int = 6, vocab: int = 40) -> list[list[int]]:
    g = torch.Generator().manual_seed(1)
    lengths = torch.randint(2, 10, (n,), generator=g).tolist()
    return [torch.randint(4, vocab, (m,), generator=g).tolist() for m in lengths]


def assert_same(a: list[list[Hypothesis]], b: list[list[Hypothesis]]) -> None:
    assert [[h.tokens for h in hyps] for hyps in a] == [[h.tokens for h in hyps] for hyps in b]
    scores = [h.score for hyps in a for h in hyps]
    assert scores == pytest.approx([h.score for hyps in b for h in hyps], abs=1e-4)


def test_real_model_cached_and_uncached_search_agree():
    model, src = tiny_transformer(), batch(*real_sources())
    assert_same(
        beam_search(model, src, 4, 0.6, 1.0, 5, n_best=2),
        beam_search(model, src, 4, 0.6, 1.0, 5, n_best=2, cached=False),
    )
    assert greedy_search(model, src, 1.0, 5) == greedy_search(model, src, 1.0, 5, cached=False)


def test_real_model_batch_independence_and_beam_one_is_greedy():
    model, sources = tiny_transformer(), real_sources()
    together = beam_search(model, batch(*sources, width=12), 4, 0.6, 1.0, 5)
    for i, source in enumerate(sources):
        assert_same(beam_search(model, batch(source), 4, 0.6, 1.0, 5), [together[i]])
    beams = beam_search(model, batch(*sources), 1, 0.0, 1.0, 5)
    assert [h[0].tokens for h in beams] == greedy_search(model, batch(*sources), 1.0, 5)
    assert len({len(h[0].tokens) for h in together}) > 2  # real endings, not all at the limit


def test_searches_that_share_an_arena_find_what_fresh_ones_do():
    """Batch after batch in one arena (kv_cache.Arena), an ensemble of two different models
    (two caches at once): the same hypotheses, bitwise, as searches with fresh memory; the
    second batch of a size takes no new memory, a larger one grows the blocks, another
    dtype gets its own."""
    models, sources = [tiny_transformer(seed=0), tiny_transformer(seed=1)], real_sources(8)
    batches = [batch(*sources[:4]), batch(*sources[4:7]), batch(*sources)]
    arena = Arena()
    for src in batches:
        for search in (beam_search, greedy_search):
            args = (src, 4, 0.6, 1.0, 5) if search is beam_search else (src, 1.0, 5)
            fresh = search(models, *args)
            assert search(models, *args, arena=arena) == fresh
    blocks = [(b.data_ptr(), b.numel()) for b in arena._blocks]
    beam_search(models, batches[-1], 4, 0.6, 1.0, 5, arena=arena)
    assert [(b.data_ptr(), b.numel()) for b in arena._blocks] == blocks
    assert len(blocks) == 2 * 2 * 2  # members x layers x (first step's, then the beams')
    arena.rewind()
    assert arena.take((2, 3), torch.zeros(1, dtype=torch.float64)).dtype == torch.float64


class HostReads(TorchDispatchMode):
    """Counts what makes a GPU wait for the host: reading values (tolist, item, bool, int)
    and ops whose output size depends on values (nonzero, boolean-mask indexing)."""

    def __init__(self, monkeypatch):
        super().__init__()
        self.count = 0
        tolist = torch.Tensor.tolist
        monkeypatch.setattr(torch.Tensor, "tolist", lambda t: self.read() or tolist(t))

    def read(self) -> None:
        self.count += 1

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.__name__
        masks = name.startswith("index.") and any(
            i is not None and i.dtype == torch.bool for i in args[1]
        )
        if masks or name.split(".")[0] in (
            "item",
            "_local_scalar_dense",
            "nonzero",
            "masked_select",
        ):
            self.read()
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("search", ["beam", "beam-static", "greedy"])
def test_the_search_reads_the_host_once_a_step(search, monkeypatch):
    """One read a step (which sentences are done), and a few a batch: the lengths, the
    results, and one per compaction of the cache (as its slots double). The static search
    on a CPU checks for done sentences every step too (tests/test_static_search.py: every
    few steps, as on CUDA)."""
    model, src = tiny_transformer(), batch(*real_sources(12))
    decode, steps = model.decode, []
    model.decode = lambda *args: steps.append(1) or decode(*args)
    with HostReads(monkeypatch) as reads:
        if search == "greedy":
            greedy_search(model, src, 1.0, 5)
        else:
            beam_search(model, src, 4, 0.6, 1.0, 5, static=search == "beam-static")
    assert len(steps) >= 8
    assert reads.count <= len(steps) + 3


# --------------------------------------------------------------------------- ensembles


def test_an_ensemble_of_a_model_with_itself_is_the_model():
    model, src = tiny_transformer(), batch(*real_sources())
    alone = beam_search(model, src, 4, 0.6, 1.0, 5, n_best=3)
    assert_same(beam_search([model, model], src, 4, 0.6, 1.0, 5, n_best=3), alone)
    assert greedy_search([model, model], src, 1.0, 5) == greedy_search(model, src, 1.0, 5)


def mean_probability_logprob(models, source: list[int], tokens: list[int]) -> float:
    """sum over the steps of log(mean of the members' p(token | prefix)), EOS included,
    each member decoding the whole prefix without a cache."""
    src, tgt = batch(source), torch.tensor([[BOS, *tokens]])
    with torch.no_grad():
        probs = [F.softmax(m.decode(tgt, m.encode(src), src == PAD)[0], -1) for m in models]
    mean = torch.stack(probs).mean(0)  # (T + 1, V)
    return mean[torch.arange(len(tokens) + 1), [*tokens, EOS]].log().sum().item()


def test_an_ensemble_predicts_the_mean_of_its_members_probabilities():
    models, sources = [tiny_transformer(seed=0), tiny_transformer(seed=1)], real_sources()
    found = beam_search(models, batch(*sources), 4, 0.6, 1.0, 5, n_best=4)
    alone = beam_search(models[0], batch(*sources), 4, 0.6, 1.0, 5)
    assert [h[0].tokens for h in found] != [h[0].tokens for h in alone]
    for source, hyps in zip(sources, found, strict=True):
        for h in hyps:
            # Each step's log-probability is within the C kernels' products' tolerance
            # (test_cpu_decoding: 1e-4) of torch's; a hypothesis sums one a token, EOS too.
            assert h.logprob == pytest.approx(
                mean_probability_logprob(models, source, h.tokens), abs=1e-4 * (len(h.tokens) + 1)
            )


# --------------------------------------------------------------------------- a trained model


def test_trained_model_search_equals_the_uncached_reference_on_the_smoke_test_set(smoke_model):
    """The whole smoke test set, batched as translate does: the cache, the shared memory and
    the compaction change nothing against re-running the decoder over every prefix."""
    model, sp, _ = load_translator(smoke_model, "cpu")
    lines = (ROOT / "data/smoke/test.en").read_text(encoding="utf-8").splitlines()
    sources = sp.encode(lines, add_eos=True)
    for rows in batch_by_tokens(sources, 4000):
        src = pad_batch([sources[j] for j in rows], "cpu")
        fast, reference = (
            beam_search(model, src, 4, 0.6, 1.0, 50, cached=c) for c in (True, False)
        )
        assert_same(fast, reference)
        assert greedy_search(model, src, 1.0, 50) == greedy_search(
            model, src, 1.0, 50, cached=False
        )


def test_decode_benchmark_runs_and_outputs_end_with_their_sources():
    root = ROOT
    argv = [
        "--sentences",
        "8",
        "--modes",
        "beam,beam-static,beam-uncached,greedy",
        "--threads",
        "1",
    ]
    argv += ["--device", "cpu", "--repeat", "1", "--ops"]
    out = subprocess.run(
        [sys.executable, "-m", "benchmarks.decode", *argv],
        capture_output=True,
        text=True,
        cwd=root,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    source_len = float(out.stdout.split("mean source length ")[1].split()[0])
    rows = [line.split() for line in out.stdout.splitlines() if line.startswith(("beam", "greedy"))]
    assert [r[0] for r in rows] == ["beam", "beam-static", "beam-uncached", "greedy"]
    assert all(float(r[-2]) == pytest.approx(source_len, abs=0.051) for r in rows)
    assert all(10 < float(r[-1]) < 200 for r in rows)  # host ops per step


def test_decoding_on_cuda_keeps_the_cast_weights_of_autocast():
    """Under inference_mode, autocast casts every weight again at every call (torch keeps
    no cast weights there); under no_grad it casts each once. Counted with the CPU's
    autocast (the same cache); the search on CUDA, in bf16 autocast, uses no_grad."""
    from torch.profiler import profile

    from transformer.decoding.beams import decoding_context

    layer, x = torch.nn.Linear(8, 8), torch.randn(4, 8)

    def casts(mode) -> int:
        with profile() as prof, mode(), torch.autocast("cpu", dtype=torch.bfloat16):
            for _ in range(5):
                layer(x)
        return sum(e.count for e in prof.key_averages() if e.key == "aten::_to_copy")

    assert casts(torch.inference_mode) == 15 and casts(torch.no_grad) == 7  # x 5, w, b once
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # autocast("cuda") without a GPU: off, with a warning
        with decoding_context(torch.device("cuda")):
            assert not torch.is_grad_enabled() and not torch.is_inference_mode_enabled()
