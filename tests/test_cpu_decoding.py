"""transformer.nn.cpu_decoding, each build this CPU runs (avx512, avx2, portable: the
`build` fixture; one this CPU cannot run is skipped, saying so) against torch's ops: a
decoding step's attention in C on a CPU is SDPA's result (to rtol 1e-5, atol 1e-6), the
same bitwise wherever masked keys sit, however many threads run it and whether the keys
come as rows or in tiles (the decoding cache's layout); the beam's best candidates in C are
torch's add and topk (bitwise); add_norm is LayerNorm of the sum (rtol and atol 1e-5); the
packed products are F.linear's (rtol 1e-5, atol 1e-4), each row the same bitwise alone or
among others; all decline what they were not built for; without a compiler (or with a
failing one) decoding falls back to torch's ops with one warning that says how to get the
C kernels; a build the CPU cannot run is refused in one line; builds are cached; and beam
search runs the kernels at every step (attention at every call, the encoder's of a short
batch too)."""

from __future__ import annotations

import logging
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F
from test_search import Ending, batch, real_sources, tiny_transformer
from torch import nn

from transformer.config import ModelConfig
from transformer.decoding.search import beam_search
from transformer.nn import cpu_decoding, kernels, kv_cache
from transformer.nn.kv_cache import Arena
from transformer.nn.model import Transformer
from transformer.tokens import BOS, EOS, PAD

pytestmark = pytest.mark.skipif(
    cpu_decoding.library() is None, reason="no C compiler here: the kernel is not built"
)


def builds() -> list:
    """Each build as a test parameter, skipped where this CPU cannot run it."""
    runs = cpu_decoding.runnable()
    return [
        pytest.param(
            name,
            marks=pytest.mark.skipif(
                name not in runs,
                reason=f"this CPU cannot run the {name} build (it needs "
                f"{' and '.join(sorted(cpu_decoding.NEEDS[name]))})",
            ),
        )
        for name in cpu_decoding.BUILDS
    ]


@pytest.fixture(params=builds())
def build(request):
    """The kernels of this build (the one the CPU would pick, or another it runs), the
    selection put back afterwards."""
    saved = cpu_decoding._wanted
    cpu_decoding.select(request.param)
    assert cpu_decoding.build() == request.param
    yield request.param
    cpu_decoding.select(saved)


def inputs(b=3, h=2, m=4, n=37, d=32, seed=0):
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(b, h, rows, d, generator=g) for rows in (m, n, n))
    return q, k, v


def additive(keep: torch.Tensor) -> torch.Tensor:
    keep = keep | (torch.arange(keep.size(-1)) == 0)  # every row keeps a key, as the model's
    return torch.where(keep, 0.0, float("-inf"))


@pytest.mark.parametrize("d", [8, 20, 32, 64])
@pytest.mark.parametrize("m, n", [(1, 1), (4, 5), (4, 16), (8, 37), (4, 200)])
@pytest.mark.parametrize("masked", ["none", "padding", "per-query", "boolean"])
def test_the_kernel_is_sdpa(build, d, m, n, masked):
    q, k, v = inputs(m=m, n=n, d=d)
    g = torch.Generator().manual_seed(1)
    mask = {
        "none": None,
        "padding": additive(torch.arange(n) < torch.tensor([n, 3, 1])[:, None, None, None]),
        "per-query": additive(torch.rand(3, 1, m, n, generator=g) < 0.6),
        "boolean": (torch.rand(3, 1, m, n, generator=g) < 0.6) | (torch.arange(n) == 0),
    }[masked]
    got = cpu_decoding.attend(q, k, v, mask)
    want = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_it_reads_the_caches_views_where_they_are(build):
    """Keys and values as the KV cache hands them over: the filled slots of a larger
    buffer, keys and values halves of one tensor, sentences narrowed."""
    buffer = torch.randn(2, 5, 2, 50, 32)  # (keys and values, sentences, heads, room, d_k)
    k, v = buffer[0, :3, :, :21], buffer[1, :3, :, :21]
    q = torch.randn(3, 2, 4, 32)
    mask = additive(torch.rand(3, 1, 4, 21) < 0.5)
    want = F.scaled_dot_product_attention(q, k.contiguous(), v.contiguous(), attn_mask=mask)
    torch.testing.assert_close(cpu_decoding.attend(q, k, v, mask), want, rtol=1e-5, atol=1e-6)


def test_a_masked_key_changes_nothing_wherever_it_sits(build):
    """What lets the static search (every slot, masked) and the shrinking one (slots
    dropped) agree bitwise: keys that a row does not see, anywhere among those it sees."""
    q, k, v = inputs(n=23)
    mask = additive(torch.rand(3, 1, 4, 23, generator=torch.Generator().manual_seed(2)) < 0.7)
    alone = cpu_decoding.attend(q, k, v, mask)
    before = torch.tensor([0, 5, 5, 17, 23])  # a masked key before each of these keys
    total = 23 + before.numel()
    hidden = torch.zeros(total, dtype=torch.bool)
    hidden[before + torch.arange(before.numel())] = True
    k2, v2 = (torch.randn(3, 2, total, 32) for _ in range(2))  # anything, where hidden
    k2[:, :, ~hidden], v2[:, :, ~hidden] = k, v
    mask2 = torch.full((3, 1, 4, total), float("-inf"))
    mask2[..., ~hidden] = mask
    assert torch.equal(cpu_decoding.attend(q, k2, v2, mask2), alone)


def test_threads_split_the_blocks_not_the_sums(build, monkeypatch):
    """Each kernel with 3 threads gives what it gives with one, bitwise; inputs large enough
    for the kernels to split them (a small one runs on one thread: cpu_decoding.c's team)."""
    if not cpu_decoding._parallel:
        pytest.skip("built without OpenMP: runs with one thread only")
    q, k, v = inputs(b=64, n=100)
    mask = additive(torch.rand(64, 1, 4, 100) < 0.6)
    threads = torch.get_num_threads()
    x, y, norm = torch.randn(3200, 64), torch.randn(3200, 64), torch.nn.LayerNorm(64)
    add_norm = lambda: cpu_decoding.add_norm(x, y.clone(), norm.weight, norm.bias, norm.eps)
    w, logits = torch.randn(384, 64), torch.randn(100, 1000)
    product = lambda: cpu_decoding.linear(x, cpu_decoding.tile_keys(w), None, 384)
    try:
        torch.set_num_threads(1)
        one = cpu_decoding.attend(q, k, v, mask)
        with torch.no_grad():
            normed, multiplied = add_norm(), product()
            normalized = cpu_decoding.log_softmax_(logits.clone())
        torch.set_num_threads(3)
        assert torch.equal(cpu_decoding.attend(q, k, v, mask), one)
        tiles = torch.zeros(64, 2, 7, 32, 16)  # written and moved by 3 threads
        cpu_decoding.put_slots(tiles, k, 0)
        assert torch.equal(cpu_decoding.attend(q, tiles, v, mask), one)
        cpu_decoding.keep_slots(tiles, torch.arange(1, 100).expand(64, 99))
        assert torch.equal(cpu_decoding.untile_keys(tiles, 99), k[:, :, 1:])
        values = torch.zeros(64, 2, 100, 32)
        cpu_decoding.put_slots(values, v, 0)
        cpu_decoding.keep_slots(values, torch.arange(1, 100).expand(64, 99))
        assert torch.equal(values[:, :, :99], v[:, :, 1:])
        with torch.no_grad():
            assert torch.equal(add_norm(), normed)
            assert torch.equal(product(), multiplied)
            assert torch.equal(cpu_decoding.log_softmax_(logits.clone()), normalized)
    finally:
        torch.set_num_threads(threads)


def test_it_declines_what_it_was_not_built_for(build):
    q, k, v = inputs()
    keep = torch.rand(3, 1, 4, 37) < 0.5
    assert cpu_decoding.attend(*inputs(m=cpu_decoding.MAX_QUERIES + 1), None) is None
    assert cpu_decoding.attend(*inputs(d=cpu_decoding.MAX_HEAD + 16), None) is None
    assert cpu_decoding.attend(q.double(), k.double(), v.double(), None) is None
    assert cpu_decoding.attend(q, k.transpose(-2, -1).contiguous().mT, v, None) is None
    assert cpu_decoding.attend(q, k, v, additive(keep)[..., :1]) is None  # broadcast keys


@pytest.mark.parametrize(
    "d, m, n", [(8, 4, 5), (32, 4, 16), (32, 8, 37), (64, 1, 200), (20, 3, 33)]
)
def test_keys_in_tiles_give_what_rows_give_bitwise(build, d, m, n):
    """The layout the decoding caches keep their keys in on a CPU (tile_keys): the results
    of the same keys as rows, bitwise, in a larger buffer, whatever the lanes past the last
    key hold."""
    q, k, v = inputs(m=m, n=n, d=d)
    mask = additive(torch.rand(3, 1, m, n, generator=torch.Generator().manual_seed(4)) < 0.6)
    tiles = cpu_decoding.tile_keys(k)
    assert tiles.shape == (3, 2, -(-n // 16), d, 16)
    room = torch.full((3, 2, tiles.size(2) + 2, d, 16), float("nan"))  # no key there
    room[:, :, : tiles.size(2)] = tiles
    room[:, :, (n - 1) // 16, :, (n - 1) % 16 + 1 :] = float("nan")
    assert torch.equal(cpu_decoding.untile_keys(room, n), k)
    got = cpu_decoding.attend(q, room, v, mask)
    assert torch.equal(got, cpu_decoding.attend(q, k, v, mask))
    want = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_tiles_the_kernel_was_not_built_for_go_to_torch(build):
    q, k, v = inputs(n=37)
    tiles = cpu_decoding.tile_keys(k)
    assert cpu_decoding.attend(q, tiles[:, :, :2], v, None) is None  # 32 keys, not 37
    assert cpu_decoding.attend(q, tiles.transpose(-2, -1).contiguous().mT, v, None) is None
    assert cpu_decoding.attend(q[..., :16], tiles, v[..., :16], None) is None  # d_k 32, not 16
    many = torch.randn(3, 2, cpu_decoding.MAX_QUERIES + 1, 32)  # kernels.attention: rows again
    want = F.scaled_dot_product_attention(many, k, v)
    with torch.no_grad():
        torch.testing.assert_close(kernels.attention(many, tiles, v), want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("tiled", [True, False])
def test_slots_move_into_and_within_a_cache(build, tiled):
    """put_slots writes new keys or values (rows, any strides) into their slots of keys in
    tiles or values as rows; keep_slots moves each row's kept slots to the front in place,
    as a compaction of the cache does: used slots in order, then unused ones (which no row
    reads)."""
    k = torch.randn(3, 2, 40, 8)
    dest = torch.full((3, 2, 4, 8, 16) if tiled else (3, 2, 48, 8), float("nan"))
    read = (lambda n: cpu_decoding.untile_keys(dest, n)) if tiled else (lambda n: dest[:, :, :n])
    cpu_decoding.put_slots(dest, k[:, :, :21], 0)
    cpu_decoding.put_slots(dest, k.transpose(0, 1).contiguous().transpose(0, 1)[:, :, 21:], 21)
    assert torch.equal(read(40), k)
    used = torch.tensor([[0, 3, 17, 18, 33, 39], [5, 6, 7, 20, 21, 22], [1, 2, 30, 0, 3, 4]])
    cpu_decoding.keep_slots(dest, used)
    moved = read(6)
    assert torch.equal(moved[:2], k[torch.arange(2)[:, None], :, used[:2]].transpose(1, 2))
    assert torch.equal(moved[2, :, :3], k[2, :, [1, 2, 30]])  # its last three: unused


@pytest.mark.parametrize("rows, d", [(1, 16), (37, 128), (300, 512)])
def test_add_norm_is_layer_norm_of_the_sum(build, rows, d):
    """The residual connections' add and LayerNorm in one pass, on a decoding step's shapes:
    torch's to fp32 rounding, each row on its own (as many rows or one), written over y."""
    g = torch.Generator().manual_seed(rows)
    x, y = torch.randn(rows, 1, d, generator=g), torch.randn(rows, 1, d, generator=g) * 3 + 1
    norm = torch.nn.LayerNorm(d)
    torch.nn.init.normal_(norm.weight, generator=g), torch.nn.init.normal_(norm.bias, generator=g)
    w, b, eps = norm.weight, norm.bias, norm.eps
    with torch.no_grad():
        want = norm(x + y)
        last = cpu_decoding.add_norm(x[-1:].clone(), y[-1:].clone(), w, b, eps)
        got = cpu_decoding.add_norm(x, y, w, b, eps)
        assert got is y
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        assert torch.equal(got[-1:], last)
        # declined: a row not contiguous, a width not a multiple of 16
        spaced = torch.randn(rows, 1, 2 * d)[..., ::2]
        assert cpu_decoding.add_norm(spaced, spaced.clone(), w, b, eps) is None
        assert cpu_decoding.add_norm(x[..., 1:], y[..., 1:], w[1:], b[1:], eps) is None
    assert cpu_decoding.add_norm(x, y, w, b, eps) is None  # a gradient to keep


@pytest.mark.parametrize("rows, vocab", [(1, 5), (3, 40), (37, 1000), (9, 8003)])
def test_log_softmax_is_torchs(build, rows, vocab):
    """A step's log-probabilities, written over its logits: torch's to fp32 rounding (rtol
    1e-6; atol 4e-6, the rounding of the log of the sum of exps on logits of a spread up
    to 40), each row on its own, -inf where a logit is -inf; it declines what it was not
    built for."""
    g = torch.Generator().manual_seed(vocab)
    logits = torch.randn(rows, vocab, generator=g) * 8
    logits[0, 0] = float("-inf")
    want = torch.log_softmax(logits, -1)
    got = logits.clone()
    assert cpu_decoding.log_softmax_(got) is got
    torch.testing.assert_close(got, want, rtol=1e-6, atol=4e-6)
    alone = cpu_decoding.log_softmax_(logits[-1:].clone())
    assert torch.equal(got[-1:], alone) and got[0, 0] == float("-inf")
    assert cpu_decoding.log_softmax_(logits.double()) is None
    assert cpu_decoding.log_softmax_(logits[:, ::2]) is None  # not contiguous
    with torch.enable_grad():
        assert cpu_decoding.log_softmax_(logits.clone().requires_grad_()) is None


@pytest.mark.parametrize(
    "m, n, k", [(1, 16, 32), (5, 40, 32), (8, 384, 128), (13, 1000, 128), (64, 128, 512)]
)
@torch.no_grad()
def test_packed_products_are_f_linear(build, m, n, k):
    """cpu_decoding.linear on a weight packed as tile_keys packs keys: F.linear's to fp32
    rounding, with and without a bias, each row's result the same bitwise alone or among
    others; it declines what it was not built for."""
    g = torch.Generator().manual_seed(m)
    x, w, b = torch.randn(m, k, generator=g), torch.randn(n, k, generator=g), torch.randn(n)
    panels = cpu_decoding.tile_keys(w)
    for bias in (b, None):
        got = cpu_decoding.linear(x, panels, bias, n)
        torch.testing.assert_close(got, F.linear(x, w, bias), rtol=1e-5, atol=1e-4)
        alone = cpu_decoding.linear(x[-1:].clone(), panels, bias, n)
        assert torch.equal(got[-1:], alone)
    assert cpu_decoding.linear(x.double(), panels.double(), None, n) is None
    assert cpu_decoding.linear(torch.randn(m + 1, 2 * k)[:, :k], panels, None, n) is None
    assert cpu_decoding.linear(x, panels[:, :-1], None, n) is None  # packed for another k


def test_a_validation_after_a_fused_adam_step_reads_the_new_weights(build):
    """The trainer validates in eval mode between updates. Fused Adam on a CPU writes the
    weights in place without a new version, so the packing cannot follow the version
    alone: every switch of mode drops it (a validation read the first one's weights)."""
    model = nn.Sequential(kernels.Linear(32, 40))
    optimizer = torch.optim.Adam(model.parameters(), lr=0.1, fused=True)
    x = torch.randn(6, 1, 32)
    for _ in range(2):
        model.eval()
        with torch.no_grad():
            got, want = model(x), F.linear(x, model[0].weight, model[0].bias)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        model.train()
        model(x).square().sum().backward()
        optimizer.step()


@torch.no_grad()
def test_linear_packs_its_weight_for_few_rows_and_again_when_it_changes(build):
    """kernels.Linear keeps its weight packed for a decoding step's few rows, packs it again
    after an update in place, and leaves products with gradients to torch, and with oneDNN
    (AVX-512) those of many rows; with torch's ops alone it packs nothing."""
    layer = kernels.Linear(32, 40)
    x = torch.randn(6, 1, 32)
    panels = layer.panels(x)
    assert panels is not None and panels.shape == (3, 32, 16)
    torch.testing.assert_close(
        layer(x), F.linear(x, layer.weight, layer.bias), rtol=1e-5, atol=1e-5
    )
    layer.weight.mul_(2.0)
    assert layer.panels(x) is not panels
    torch.testing.assert_close(
        layer(x), F.linear(x, layer.weight, layer.bias), rtol=1e-5, atol=1e-5
    )
    assert layer.panels(x, 16).shape == (1, 32, 16) and layer.panels(x, 20) is None
    many = torch.randn(kernels.ONEDNN_MIN_ROWS, 32)
    assert (layer.panels(many) is None) == kernels.ONEDNN
    with torch.enable_grad():
        assert layer.panels(x) is None
    with torch.autocast("cpu", dtype=torch.bfloat16):  # its products are bf16
        assert layer.panels(x) is None
    cpu_decoding.select("torch")
    assert layer.panels(x) is None


@torch.no_grad()
def test_a_cached_step_copies_nothing_in_torch(build, monkeypatch):
    """After the first step (which stores the encoder-decoder keys), a decoder step with the
    cache on a CPU leaves copies and LayerNorm to C: the attention's heads come out side
    by side for W^O, new keys and values go into the cache by put_slots, each residual's add
    and LayerNorm is add_norm. torch's ops would make them 8 copies and 6 layer_norms here."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Ops(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.names: list[str] = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.names.append(func.__name__)
            return func(*args, **(kwargs or {}))

    model = tiny_transformer().model
    src = batch(*real_sources(3))
    memory, cache = model.encode(src), model.new_cache(8)
    tgt = torch.full((12, 1), BOS)  # 4 rows per sentence: a beam
    model.decode(tgt, memory, src == PAD, cache)
    in_c, linear = [], cpu_decoding.linear
    monkeypatch.setattr(cpu_decoding, "linear", lambda *a: in_c.append(linear(*a)) or in_c[-1])
    with Ops() as ops:
        for token in (5, 6, 7):
            model.decode(torch.full((12, 1), token), memory, src == PAD, cache)
    names = set(ops.names)
    assert not names & {"copy_.default", "clone.default", "native_layer_norm.default"}, names
    products = {"addmm.default", "mm.default", "_linear_pointwise.default"}
    assert not any(name in products for name in ops.names)  # 12 rows: every build packs them
    assert len(in_c) == 3 * 13 and all(y is not None for y in in_c)  # 6 a layer, the output's


@torch.no_grad()
def test_the_search_keeps_its_keys_in_tiles_and_finds_what_rows_find(build, monkeypatch):
    """On a CPU the shrinking search's caches (self-attention's, growing, compacted, rows
    dropped as sentences finish; the encoder-decoder keys) hand the kernel tiles, batch
    after batch in one arena, and find bitwise what the same caches find with keys as rows."""
    model, sources = tiny_transformer(slope=0.15), real_sources(8)
    batches = [batch(*sources[:5]), batch(*sources)]
    layouts, compactions, attend = [], [], cpu_decoding.attend
    compact = kv_cache.SelfAttentionKV.compact
    monkeypatch.setattr(
        cpu_decoding, "attend", lambda q, k, *a: layouts.append(k.dim()) or attend(q, k, *a)
    )
    monkeypatch.setattr(
        kv_cache.SelfAttentionKV,
        "compact",
        lambda self, slots: compactions.append(self.tiled) or compact(self, slots),
    )
    arena = Arena()
    tiled = [beam_search(model, src, 4, 0.6, 1.0, 30, n_best=2, arena=arena) for src in batches]
    assert set(layouts) == {5} and compactions and all(compactions)
    assert len({len(h[0].tokens) for h in tiled[-1]}) > 2  # sentences leave the batch
    monkeypatch.setattr(kernels, "reads_tiles", lambda t: False)
    layouts.clear()
    rows = [beam_search(model, src, 4, 0.6, 1.0, 30, n_best=2, arena=arena) for src in batches]
    assert set(layouts) == {4} and rows == tiled


@pytest.fixture
def fresh(monkeypatch, tmp_path):
    """The module as before its first call, building into an empty cache."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    for name, value in (("_library", None), ("_parallel", False), ("_tried", False)):
        monkeypatch.setattr(cpu_decoding, name, value)
    monkeypatch.setattr(cpu_decoding, "_built", {})
    monkeypatch.setattr(cpu_decoding, "_wanted", None)
    return tmp_path / "transformer-mt"


@pytest.mark.parametrize("boolean", [False, True])
def test_without_a_compiler_attention_falls_back_with_one_warning(
    boolean, fresh, monkeypatch, caplog
):
    monkeypatch.setenv("CC", str(fresh / "no-such-compiler"))
    q, k, v = inputs()
    mask = additive(torch.rand(3, 1, 4, 37) < 0.5)
    mask = mask == 0 if boolean else mask
    with caplog.at_level(logging.WARNING, logger=cpu_decoding.__name__), torch.no_grad():
        first = kernels.attention(q, k, v, mask)
        kernels.attention(q, k, v, mask)
    assert cpu_decoding.library() is None
    cc = fresh / "no-such-compiler"
    assert [r.getMessage() for r in caplog.records] == [
        f"decoding on this CPU: torch's ops, the slow path (no C kernels: {cc} failed: "
        f"[Errno 2] No such file or directory: '{cc}'); a C compiler (gcc or clang; CC "
        "names another) builds them at first use"
    ]
    assert "could not be built: the slow path" in cpu_decoding.describe()
    assert cpu_decoding.build() == "torch"
    want = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    torch.testing.assert_close(first, want, rtol=1e-5, atol=1e-6)
    lprobs, scores = candidates(3, 4, 50)
    assert cpu_decoding.best_extensions(lprobs, scores, 8) is None


def test_a_build_error_is_named_and_nothing_is_left_behind(fresh, monkeypatch, caplog):
    bad = fresh.parent / "bad.c"
    bad.write_text("this is not C;\n")
    monkeypatch.setattr(cpu_decoding, "SOURCE", bad)
    with caplog.at_level(logging.WARNING, logger=cpu_decoding.__name__):
        assert cpu_decoding.library() is None
    (record,) = caplog.records
    assert "cc failed: " in record.getMessage() and "error" in record.getMessage()
    assert not list(fresh.iterdir())  # no half-built library under any name


def test_the_build_is_cached(fresh, monkeypatch):
    assert cpu_decoding.library() is not None
    (built,) = fresh.glob("cpu_decoding-*.so")
    compiled = []
    run = subprocess.run

    def spy(cmd, *args, **kwargs):
        compiled.extend([cmd] if "-o" in cmd else [])
        return run(cmd, *args, **kwargs)

    monkeypatch.setattr(subprocess, "run", spy)
    monkeypatch.setattr(cpu_decoding, "_tried", False)
    assert cpu_decoding.library() is not None
    assert compiled == [] and list(fresh.glob("cpu_decoding-*.so")) == [built]


def candidates(n, beams, vocab, seed=0, at_max=()):
    """A step's log-probabilities (N * beams, V), PAD and BOS banned, and the beams' scores
    (N, beams); the sentences `at_max` may only end (EOS alone is finite)."""
    g = torch.Generator().manual_seed(seed)
    lprobs = torch.randn(n * beams, vocab, generator=g).log_softmax(-1)
    lprobs[:, [PAD, BOS]] = float("-inf")
    for i in at_max:
        lprobs.view(n, beams, vocab)[i, :, torch.arange(vocab) != EOS] = float("-inf")
    return lprobs, torch.randn(n, beams, generator=g) * 5


def torch_topk(lprobs, scores, k):
    n, beams = scores.shape
    return (lprobs.view(n, beams, -1) + scores[..., None]).view(n, -1).topk(k, dim=1)


@pytest.mark.parametrize(
    "n, beams, vocab, k",
    [(1, 1, 5, 2), (3, 1, 50, 8), (5, 4, 1000, 8), (2, 4, 37, 8), (2, 2, 7, 14), (4, 8, 100, 16)],
)
def test_the_best_extensions_are_torchs_topk(build, n, beams, vocab, k):
    lprobs, scores = candidates(n, beams, vocab)
    top, index = cpu_decoding.best_extensions(lprobs, scores, k)
    want = torch_topk(lprobs, scores, k)
    assert torch.equal(top, want.values)
    finite = top > float("-inf")  # torch orders equal ones as it likes: see the next test
    assert torch.equal(index[finite], want.indices[finite])
    assert torch.equal(index.sort(1).values, want.indices.sort(1).values)


def test_ties_go_to_the_lower_position(build):
    """Equal candidates: a sentence at its maximum length (EOS its only finite token per
    beam), and a row repeated: the lower position first, as the scan meets them."""
    lprobs, scores = candidates(3, 4, 40, at_max=[1])
    lprobs[8:12] = lprobs[8]  # sentence 2: four equal beams
    scores[2] = 1.0
    top, index = cpu_decoding.best_extensions(lprobs, scores, 8)
    want = torch_topk(lprobs, scores, 8)
    assert torch.equal(top, want.values)
    assert sorted(index[1, :4].tolist()) == [EOS, 40 + EOS, 80 + EOS, 120 + EOS]
    assert index[1, 4:].tolist() == [PAD, 1, BOS, 4]  # -inf, all
    best = lprobs[8].argsort(descending=True)[:2].tolist()
    assert index[2].tolist() == [b * 40 + t for t in best for b in range(4)]


def test_threads_split_the_sentences_not_a_sentence(build, monkeypatch):
    if not cpu_decoding._parallel:
        pytest.skip("built without OpenMP: one thread only")
    lprobs, scores = candidates(9, 4, 30000)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = cpu_decoding.best_extensions(lprobs, scores, 8)
        torch.set_num_threads(3)
        assert all(map(torch.equal, cpu_decoding.best_extensions(lprobs, scores, 8), one))
    finally:
        torch.set_num_threads(threads)


def test_the_best_extensions_decline_what_they_were_not_built_for(build):
    lprobs, scores = candidates(3, 4, 50)
    assert cpu_decoding.best_extensions(lprobs.double(), scores.double(), 8) is None
    assert cpu_decoding.best_extensions(lprobs.t().contiguous().t(), scores, 8) is None
    assert cpu_decoding.best_extensions(lprobs, scores[:2], 8) is None  # rows != N * beams
    assert cpu_decoding.best_extensions(lprobs, scores, 201) is None  # more than there are


@torch.no_grad()
def test_beam_search_finds_its_candidates_in_c_at_every_step(build, monkeypatch):
    """And its log-probabilities: log_softmax in C at every step too."""
    torch.manual_seed(0)
    cfg = ModelConfig(n_layers=1, d_model=32, d_ff=64, n_heads=2, dropout=0.0)
    model = Ending(Transformer(cfg, 40).eval(), 1.0)
    calls, normalized, best, log_softmax_ = (
        [],
        [],
        cpu_decoding.best_extensions,
        cpu_decoding.log_softmax_,
    )
    steps = []

    def spy(*args):
        calls.append(best(*args))
        return calls[-1]

    monkeypatch.setattr(cpu_decoding, "best_extensions", spy)
    monkeypatch.setattr(
        cpu_decoding, "log_softmax_", lambda x: normalized.append(log_softmax_(x)) or normalized[-1]
    )
    decode = model.decode
    monkeypatch.setattr(model, "decode", lambda *a, **kw: steps.append(1) or decode(*a, **kw))
    beam_search(model, batch([5, 6, 7], [8, 9]), 4, 0.6, 1.0, 5, static=False)
    assert len(calls) == len(steps) > 1 and all(out is not None for out in calls)
    assert len(normalized) == len(steps) and all(out is not None for out in normalized)


@torch.no_grad()
def test_beam_search_runs_the_kernel_at_every_step(build, monkeypatch):
    torch.manual_seed(0)
    cfg = ModelConfig(n_layers=2, d_model=64, d_ff=128, n_heads=2, dropout=0.0)  # d_k 32
    model = Ending(Transformer(cfg, 40).eval(), 1.0)
    calls, attend = [], cpu_decoding.attend

    def spy(*args):
        calls.append(attend(*args))
        return calls[-1]

    monkeypatch.setattr(cpu_decoding, "attend", spy)
    beam_search(model, batch([5, 6, 7], [8, 9]), 4, 0.6, 1.0, 5, static=False)
    assert calls and all(out is not None for out in calls)


def test_each_build_is_the_instruction_set_it_names(build):
    """The flags took: the library says which loops it compiled, as wide as its registers."""
    lib = cpu_decoding.library()
    assert lib.build().decode() == build
    assert lib.lanes() == {"avx512": 16, "avx2": 8, "portable": 4}[build]
    assert f"{build} build" in cpu_decoding.describe()


def test_a_build_this_cpu_cannot_run_is_refused_in_one_line(monkeypatch):
    """Asked for by name (benchmarks/decode.py --kernels): refused, saying what the CPU
    lacks and what it runs, before anything is built; the selection stays as it was."""
    monkeypatch.setattr(cpu_decoding, "cpu_flags", lambda: {"sse2"})
    before = cpu_decoding.build()
    for name, missing in (("avx512", "avx512f"), ("avx2", "avx2, fma")):
        with pytest.raises(ValueError) as refused:
            cpu_decoding.select(name)
        message = str(refused.value)
        assert "\n" not in message
        assert f"cannot run the {name} build (no {missing})" in message
        assert message.endswith("it runs: portable, torch")
    assert cpu_decoding.runnable() == ["portable", "torch"]
    assert cpu_decoding.build() == before


@pytest.mark.parametrize(
    "torch_names", [True, False], ids=["torch's names", "/proc/cpuinfo's names"]
)
def test_both_spellings_of_an_avx512_cpu_run_the_avx512_build(monkeypatch, torch_names):
    """torch's cpuinfo spells AVX-512F "avx512_f" and FMA "fma3", Linux "avx512f" and "fma":
    either way the CPU runs every build, and its line names what it has."""
    if torch_names:
        caps = {"avx512_f": True, "avx512_bf16": True, "amx_bf16": True, "avx2": True}
        monkeypatch.setattr(torch.cpu, "get_capabilities", lambda: {**caps, "fma3": True})
    else:
        monkeypatch.delattr(torch.cpu, "get_capabilities", raising=False)
        flags = "flags\t: sse2 avx2 fma avx512f avx512_bf16 amx_bf16"
        monkeypatch.setattr(cpu_decoding, "_cpuinfo", lambda: ["cpu family\t: 6", flags])
    assert cpu_decoding.runnable() == ["avx512", "avx2", "portable", "torch"]
    assert "; avx512f avx512_bf16 amx_bf16 avx2 fma;" in cpu_decoding.describe_cpu()


@pytest.mark.skipif(
    not (cpu_decoding._cpuinfo() and hasattr(torch.cpu, "get_capabilities")),
    reason="no /proc/cpuinfo or no torch cpuinfo here to compare",
)
def test_torch_and_linux_agree_on_what_this_cpu_runs(monkeypatch):
    """On this machine, the builds torch's cpuinfo allows are those /proc/cpuinfo allows."""
    by_torch = cpu_decoding.runnable()
    monkeypatch.delattr(torch.cpu, "get_capabilities")
    assert cpu_decoding.runnable() == by_torch


def test_the_decode_benchmark_names_and_forces_the_build(monkeypatch, capsys):
    """benchmarks/decode.py reports the CPU, its instruction sets and the build that ran;
    --kernels runs another, and refuses one this CPU cannot run in one line, exit code 2."""
    from benchmarks import decode

    saved, threads = cpu_decoding._wanted, torch.get_num_threads()
    argv = ["decode.py", "--threads", "1", "--device", "cpu", "--modes", "beam"]
    try:
        monkeypatch.setattr(sys, "argv", [*argv, "--sentences", "2", "--kernels", "portable"])
        decode.main()
        out = capsys.readouterr().out
        assert "decoding on this CPU: C kernels, portable build (4 floats a vector" in out
        assert "CPU: " in out and "torch's CPU kernels: " in out
        monkeypatch.setattr(sys, "argv", [*argv, "--kernels", "torch", "--sentences", "2"])
        decode.main()
        assert "torch's ops (the C kernels not selected)" in capsys.readouterr().out
        monkeypatch.setattr(cpu_decoding, "cpu_flags", lambda: {"sse2"})
        monkeypatch.setattr(sys, "argv", [*argv, "--kernels", "avx2"])
        with pytest.raises(SystemExit) as refused:
            decode.main()
        assert refused.value.code == 2
        (line,) = capsys.readouterr().err.splitlines()
        assert line.startswith("error: --kernels avx2: this CPU cannot run the avx2 build")
    finally:
        cpu_decoding.select(saved)
        torch.set_num_threads(threads)


@pytest.mark.slow  # two more builds of the kernels
def test_an_openmp_build_that_does_not_load_gives_way_to_one_without(fresh, monkeypatch):
    """Clang with -fopenmp may build a library that needs a runtime nothing loaded (libomp):
    then the kernel is built without OpenMP and runs with one thread only."""
    build, junk = cpu_decoding._build, fresh.parent / "not-a-library.so"
    junk.write_text("")

    def build_or_junk(cc, flags):
        return junk if "-fopenmp" in flags else build(cc, flags)

    monkeypatch.setattr(cpu_decoding, "_build", build_or_junk)
    assert cpu_decoding.library() is not None and not cpu_decoding._parallel
    assert "one thread only" in cpu_decoding.describe()
    q, k, v = inputs()
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert cpu_decoding.attend(q, k, v, None) is not None
        torch.set_num_threads(2)
        assert cpu_decoding.attend(q, k, v, None) is None  # torch's products, in parallel
    finally:
        torch.set_num_threads(threads)
