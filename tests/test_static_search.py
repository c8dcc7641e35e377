"""The static beam search (static_search.StaticSearch on kv_cache.StaticKVCache) against the
shrinking one: the same hypotheses, bitwise, on a CPU in fp32; one compilation of its step
for all steps; its ops per step; its host reads (its CUDA graphs: tests/test_gpu.py)."""

from pathlib import Path

import pytest
import torch
from opcount import OpCounter
from test_search import HostReads, batch, real_sources, tiny_transformer
from torch._dynamo.testing import CompileCounterWithBackend
from torch._dynamo.utils import counters

from transformer.config import ModelConfig
from transformer.decoding import static_search
from transformer.decoding.beams import max_lengths
from transformer.decoding.search import beam_search
from transformer.decoding.static_search import StaticSearch
from transformer.decoding.translate import batch_by_tokens, load_translator, pad_batch
from transformer.nn import kernels
from transformer.nn.kv_cache import StaticKVCache
from transformer.nn.model import Transformer
from transformer.tokens import BOS, EOS, PAD

ROOT = Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.usefixtures("one_thread", "row_independent_products")


@pytest.fixture
def row_independent_products(monkeypatch):
    """Every product on oneDNN where the CPU runs it (kernels.ONEDNN), whatever its rows: a
    row's result then does not depend on how many rows the batch holds, so the two searches
    must agree bitwise. By default products of few rows run on MKL (kernels.ONEDNN_MIN_ROWS),
    and a search whose batch shrinks past that size rounds the rest of its steps apart."""
    monkeypatch.setattr(kernels, "ONEDNN_MIN_ROWS", 0)


needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def assert_equal(static, shrinking) -> None:
    """Bitwise (tokens, scores, log-probabilities) where a row's matrix products do not
    depend on the other rows of the batch, which the shrinking search shrinks and the
    static one does not: oneDNN's (kernels.ONEDNN, AVX-512) do for two rows or more. MKL's
    need not: there the scores agree to rounding."""
    if kernels.ONEDNN:
        assert static == shrinking
        return
    assert [[h.tokens for h in s] for s in static] == [[h.tokens for h in s] for s in shrinking]
    scores = [h.score for hyps in static for h in hyps]
    assert scores == pytest.approx([h.score for hyps in shrinking for h in hyps], abs=1e-5)


def cases(beam: int, n: int = 10):
    """Random batches (1-9 sentences of 1-9 tokens) and settings: length penalty, n-best,
    early stop, a length cap. With beam 1 each sentence comes twice: twins end together,
    so the shrinking batch never holds a single row (a product of one row runs another
    kernel, whose rounding differs: see test_one_row_products_round_differently)."""
    g = torch.Generator().manual_seed(beam)
    for i in range(n):
        size = int(torch.randint(1, 10, (1,), generator=g))
        lengths = torch.randint(1, 10, (size,), generator=g).tolist()
        sources = [torch.randint(4, 40, (m,), generator=g).tolist() for m in lengths]
        if beam == 1:
            sources = [s for s in sources for _ in range(2)]
        alpha = (0.0, 0.6, 1.0)[i % 3]
        n_best = 1 + i % beam
        early_stop = ("exact", "beam")[i % 2]
        cap = 3 if i % 4 == 3 else None
        yield batch(*sources), alpha, n_best, early_stop, cap


@pytest.mark.parametrize("beam", [1, 2, 3, 4, 5])
def test_static_search_finds_the_shrinking_searchs_hypotheses(beam):
    model = tiny_transformer()
    for src, alpha, n_best, early_stop, cap in cases(beam):
        found = [
            beam_search(
                model, src, beam, alpha, 1.0, 5, n_best, cap, early_stop=early_stop, static=s
            )
            for s in (True, False)
        ]
        assert_equal(*found)
        assert all(len(hyps) == n_best for hyps in found[0])


def test_one_row_products_round_differently():
    """Why beam 1 above doubles its sentences: the same row, alone or beside another."""
    weight, x = torch.randn(96, 32), torch.randn(2, 1, 32)
    assert not torch.equal(kernels.linear(x[:1], weight), kernels.linear(x, weight)[:1])


def test_static_ensemble_finds_the_shrinking_ensembles_hypotheses():
    models, src = [tiny_transformer(seed=0), tiny_transformer(seed=1)], batch(*real_sources())
    for beam, n_best in ((2, 2), (4, 3)):
        static, shrinking = (
            beam_search(models, src, beam, 0.6, 1.0, 5, n_best, static=s) for s in (True, False)
        )
        assert_equal(static, shrinking)


def test_static_search_on_the_trained_smoke_model(smoke_model):
    """The smoke test set, batched as translate does, on a trained model (peaked: its
    outputs are real sentences, ending where the model ends them)."""
    model, sp, _ = load_translator(smoke_model, "cpu")
    lines = (ROOT / "data/smoke/test.en").read_text(encoding="utf-8").splitlines()
    sources = sp.encode(lines, add_eos=True)
    for rows in batch_by_tokens(sources, 4000):
        src = pad_batch([sources[j] for j in rows], "cpu")
        for early_stop in ("exact", "beam"):
            static, shrinking = (
                beam_search(model, src, 4, 0.6, 1.0, 50, 2, early_stop=early_stop, static=s)
                for s in (True, False)
            )
            assert_equal(static, shrinking)


def test_the_step_compiles_once_for_every_step():
    """torch.compile(fullgraph=True, dynamic=False) of the step: one compilation, no graph
    break, for 45 steps (step 0, one row per sentence, runs eagerly: it fills the
    encoder-decoder keys and values). aot_eager: Dynamo and AOTAutograd's functionalisation
    of the in-place updates, without inductor's C++ compile time."""
    model = tiny_transformer().model  # no ending: every output runs to its limit
    src = batch([5, 6, 7], [8, 9, 10, 11])
    torch._dynamo.reset()
    counters.clear()
    backend = CompileCounterWithBackend("aot_eager")
    compiled = StaticSearch.run(model, src, 4, 0.6, 1.0, 45, 2, None, None, compile=backend)
    assert backend.frame_count == 1
    assert not counters["graph_break"] and not counters["recompiles"]
    eager = beam_search(model, src, 4, 0.6, 1.0, 45, n_best=2, static=True)
    assert min(len(h.tokens) for hyps in eager for h in hyps) >= 40
    # The compiled step runs SDPA, the eager one kernels.attention's CPU path: rounding apart.
    assert [[h.tokens for h in s] for s in compiled] == [[h.tokens for h in s] for s in eager]
    assert [h.score for s in compiled for h in s] == pytest.approx(
        [h.score for s in eager for h in s], abs=1e-5
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_step_of_the_base_model_issues_at_most_130_ops(dtype, monkeypatch):
    """Counted as the host issues them on a GPU (kernels.CPU_PATHS off: F.linear, SDPA), under
    no_grad (composite ops counted as what they dispatch): base's 6 layers, d_model 512,
    8 heads, 37000 words, beam 4. The shrinking search's step issued ~190 with autocast's
    casts (146 without). No host read."""
    monkeypatch.setattr(kernels, "CPU_PATHS", False)
    torch.manual_seed(0)
    cfg = ModelConfig(n_layers=6, d_model=512, d_ff=2048, n_heads=8, dropout=0.0)
    model = Transformer(cfg, 37000).eval().to(dtype)
    src = torch.randint(4, 37000, (4, 12))
    src[:, -1] = EOS
    limit = max_lengths(src, 1.0, 10, None)
    with torch.no_grad():
        static = StaticSearch(model, src, 4, 0.6, limit, int(limit.max()), 1, None)
        static.step()  # step 0
        static.beams.pin()
        static.step()
        with OpCounter() as ops:
            static.step()
    assert ops.total <= 130, ops.counts
    assert ops.reads == 0


def test_the_static_search_reads_the_host_once_per_check(monkeypatch):
    """One read per done-check (every 8 steps here, as on CUDA), a few per batch."""
    monkeypatch.setattr(static_search, "CPU_CHECK_EVERY", 8)
    model, src = tiny_transformer(slope=0.0), batch(*real_sources(12))
    with HostReads(monkeypatch) as reads:
        found = beam_search(model, src, 4, 0.6, 1.0, 30, static=True)
    steps = max(len(h.tokens) for hyps in found for h in hyps)
    assert steps >= 30
    assert reads.count <= steps // 8 + 4


def test_static_cache_keeps_each_row_to_its_own_past():
    """The static cache's decode equals re-running the decoder over each row's prefix, as
    rows are reordered within their sentences (a row may continue any row of its own)."""
    model = tiny_transformer().model
    src = batch([5, 6, 7], [8, 9])
    memory, padding = model.encode(src), src == PAD
    k, steps = 3, 6
    step = torch.zeros((), dtype=torch.long)
    cache = StaticKVCache(model.cfg.n_layers, 2, k, steps + 1, step, memory.dtype)
    gen = torch.Generator().manual_seed(0)
    history = torch.full((2, 1), BOS)  # one row per sentence at step 0
    with torch.no_grad():
        for _ in range(steps):
            out = model.decode(history[:, -1:], memory, padding, cache)[:, -1]
            expected = model.decode(history, memory, padding)[:, -1]
            torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
            parents = torch.randint(0, history.size(0) // 2, (2, k), generator=gen)
            cache.reorder(parents)
            rows = (torch.arange(2)[:, None] * (history.size(0) // 2) + parents).flatten()
            new = torch.randint(4, 40, (2 * k, 1), generator=gen)
            history = torch.cat([history[rows], new], 1)
            step.add_(1)
