"""Static shape classes (train.shape_classes): few (B, S, T) shapes an epoch on WMT-like
lengths, most of their tokens real, and every guarantee of the bucket sampler kept (ranks,
every example once, determinism, exact resume, the fallback, the error naming an example).
The padding rows' content and what the model makes of them: tests/test_batching.py."""

import itertools

import numpy as np
import pytest

from transformer.data import shape_classes
from transformer.data.sampler import TokenBatchSampler, shape_report
from transformer.data.shape_classes import fit_shape_classes


def wmt_like(n: int = 150_000, seed: int = 0, longer_targets: float = 1.0):
    """(src_lens, tgt_lens) as benchmarks/train_throughput.py's synthetic corpus draws them:
    sources lognormal with mean ~27, the tail clipped at 250; targets the source times a
    ratio lognormal around `longer_targets` (sigma 0.15), kept in clean.max_ratio's
    [1/1.5, 1.5], clipped to [1, 250]."""
    rng = np.random.default_rng(seed)
    src = np.clip(np.round(rng.lognormal(np.log(27) - 0.18, 0.6, n)), 1, 250).astype(np.int64)
    ratio = np.clip(rng.lognormal(np.log(longer_targets), 0.15, n), 1 / 1.5, 1.5)
    tgt = np.clip(np.round(src * ratio), 1, 250).astype(np.int64)
    return src, tgt


def _sampler(src, tgt, max_tokens, shape_classes=16, **kwargs) -> TokenBatchSampler:
    longer = np.maximum(src, tgt)
    return TokenBatchSampler(
        longer, longer // 8, max_tokens, src_lens=src, tgt_lens=tgt,
        shape_classes=shape_classes, **kwargs,
    )  # fmt: skip


def _small(n=3000, seed=1):
    """A corpus small enough to step through: classes of a few batches each."""
    return wmt_like(n, seed)


def _ids(batches) -> list[tuple[int, ...]]:
    return [tuple(b.tolist()) for b in batches]


@pytest.fixture(scope="module")
def wmt():
    return {"even": wmt_like(), "en-de": wmt_like(longer_targets=1.1)}


# --------------------------------------------------------------------------- the shapes


@pytest.mark.parametrize("max_tokens", [4096, 32768])
@pytest.mark.parametrize("corpus", ["even", "en-de"])
def test_wmt_like_lengths_fall_in_at_most_16_shapes_mostly_real(wmt, corpus, max_tokens):
    src, tgt = wmt[corpus]
    buckets = shape_report(_sampler(src, tgt, max_tokens, shape_classes=0))
    sampler = _sampler(src, tgt, max_tokens)
    shapes, ratio = shape_report(sampler)
    assert len(shapes) <= 16 and len(buckets.shapes) > 80  # the buckets: ~100-180
    # 0.869-0.870 at 4,096 tokens, 0.859-0.861 at 32,768 (a class's last batch, of up to
    # ~3,000 rows, is mostly padding rows on 150k examples: 0.871 on WMT14's 4.5M); the
    # buckets: 0.93-0.94.
    assert ratio >= 0.85 and buckets.ratio > ratio
    assert list(shapes) == sorted(sampler.shapes)  # every class in use
    assert sum(shapes.values()) == sampler.n_batches
    assert all(b * max(s, t) <= max_tokens for b, s, t in shapes)
    assert shape_report(sampler, epoch=3).shapes == shapes  # the same shapes every epoch
    if corpus == "en-de":  # targets ~10% longer: source and target padded apart
        assert sum(s < t for _, s, t in shapes) >= 12


def test_padding_the_sides_apart_beats_one_length(wmt, monkeypatch):
    src, tgt = wmt["en-de"]
    apart = shape_report(_sampler(src, tgt, 4096)).ratio  # 0.870
    # Bands of the longer side only:
    monkeypatch.setattr(shape_classes, "SLOPES", [shape_classes.DEN])
    one_length = _sampler(src, tgt, 4096)
    assert all(s == t for _, s, t in one_length.shapes[1:])  # a large corpus fills each band
    assert apart > shape_report(one_length).ratio + 0.01  # 0.856


def test_every_example_fits_its_batch_shape_and_only_last_batches_pad():
    src, tgt = _small()
    sampler = _sampler(src, tgt, 1024)
    pads = {}
    for batch in sampler.epoch_batches(0):
        real = batch[batch >= 0]
        b, s, t = sampler.shapes[sampler._key[real[0]]]
        assert len(batch) == b and sampler.padded_shape(batch) == (s, t)
        assert src[real].max() <= s and tgt[real].max() <= t
        assert np.all(batch[: len(real)] == real)  # padding rows after the examples
        assert len({sampler._key[i] for i in real}) == 1
        if len(real) < b:
            assert (s, t) not in pads  # one partial batch a class
            pads[(s, t)] = b - len(real)
    counts = np.bincount(sampler._key, minlength=len(sampler.shapes))
    for (b, s, t), n in zip(sampler.shapes, counts, strict=True):
        assert pads.get((s, t), 0) == -n % b


def _padded(src, tgt, key, edges, max_tokens):
    """Tokens an epoch pads to with these bands of `key`, padding rows counted."""
    cls, total = np.searchsorted(edges, key), 0
    for c in np.unique(cls):
        s, t = src[cls == c].max(), tgt[cls == c].max()
        b = max_tokens // max(s, t)
        total += -(-(cls == c).sum() // b) * b * (s + t)
    return total


@pytest.mark.parametrize("slope", [shape_classes.DEN, 72])
def test_the_classes_are_the_least_padding_bands(slope):
    src, tgt = wmt_like(400, seed=2, longer_targets=1.1)
    src, tgt = np.minimum(src, 60), np.minimum(tgt, 60)  # few distinct keys: brute force
    classes = fit_shape_classes(src, tgt, 512, 3, slopes=[slope])
    key = np.maximum(src * slope, tgt * shape_classes.DEN)
    values = np.unique(key)
    best = min(  # every split of the distinct keys in at most 3 bands
        _padded(src, tgt, key, np.array([*cut, values[-1]]), 512)
        for k in range(3)
        for cut in itertools.combinations(values[:-1], k)
    )
    assert _padded(src, tgt, key, classes.edges, 512) == best
    cls = classes.classify(src, tgt)
    assert classes.shapes == [
        (512 // max(src[cls == c].max(), tgt[cls == c].max()), src[cls == c].max(),
         tgt[cls == c].max())
        for c in range(len(classes.shapes))
    ]  # fmt: skip


def test_the_slope_that_pads_least_is_chosen():
    src, tgt = wmt_like(5000, longer_targets=1.1)
    chosen = fit_shape_classes(src, tgt, 4096, 8)
    key = lambda slope: np.maximum(src * slope, tgt * shape_classes.DEN)
    padded = _padded(src, tgt, key(chosen.slope), chosen.edges, 4096)
    assert chosen.slope > shape_classes.DEN  # targets longer: sources weigh more in the key
    for slope in shape_classes.SLOPES:
        edges = fit_shape_classes(src, tgt, 4096, 8, slopes=[slope]).edges
        assert padded <= _padded(src, tgt, key(slope), edges, 4096)


def test_few_distinct_lengths_make_fewer_classes():
    src = tgt = np.array([3, 3, 5, 5, 5, 9])
    classes = fit_shape_classes(src, tgt, 64, 16)
    assert len(classes.shapes) <= 3 and classes.shapes[-1] == (7, 9, 9)
    assert _sampler(src, tgt, 64, 1).shapes == [(7, 9, 9)]  # one class: the longest


# --------------------------------------------------------------------------- guarantees


@pytest.mark.parametrize("world_size", [1, 2, 3])
def test_ranks_are_disjoint_and_together_see_every_example_once(world_size):
    src, tgt = _small()
    for epoch in (0, 1):
        ranks = [
            _sampler(src, tgt, 1024, world_size=world_size, rank=r).epoch_batches(epoch)
            for r in range(world_size)
        ]
        seen = np.concatenate([b for batches in ranks for b in batches])
        assert np.array_equal(np.sort(seen[seen >= 0]), np.arange(len(src)))
        # Every rank cut the same epoch: theirs interleave into rank 0's single-rank list.
        whole = _sampler(src, tgt, 1024).epoch_batches(epoch)
        for r, batches in enumerate(ranks):
            assert _ids(batches) == _ids(whole[r::world_size])


def test_order_is_a_function_of_seed_and_epoch():
    src, tgt = _small()
    a, b, c = (_sampler(src, tgt, 1024, seed=s) for s in (1, 1, 2))
    assert _ids(a.epoch_batches(0)) == _ids(b.epoch_batches(0))
    assert _ids(a.epoch_batches(0)) != _ids(c.epoch_batches(0))
    assert _ids(a.epoch_batches(0)) != _ids(a.epoch_batches(1))
    # A class's examples meet other company each epoch; the shapes stay.
    assert {frozenset(x) for x in _ids(a.epoch_batches(0))} != {
        frozenset(x) for x in _ids(a.epoch_batches(1))
    }
    assert len(a.epoch_batches(0)) == len(a.epoch_batches(1)) == a.batches_per_rank
    fixed = _sampler(src, tgt, 1024, shuffle=False)
    assert _ids(fixed.epoch_batches(0)) == _ids(fixed.epoch_batches(5))


@pytest.mark.parametrize("consumed", [0, 5, "end", "end+3"])
def test_resume_continues_the_exact_sequence(consumed):
    src, tgt = _small()
    a = _sampler(src, tgt, 1024, world_size=2, rank=1)
    n = a.batches_per_rank
    k = {"end": n, "end+3": n + 3}.get(consumed, consumed)
    stream = iter(a)
    for _ in range(k):
        next(stream)
    state = a.state_dict()
    assert state["shape_classes"] == 16
    expected = _ids(itertools.islice(stream, 2 * n))
    b = _sampler(src, tgt, 1024, world_size=2, rank=1)
    b.load_state_dict(state)
    assert _ids(itertools.islice(iter(b), 2 * n)) == expected


def test_rank_zeros_state_resumes_every_rank_despite_uneven_epochs():
    src, tgt = _small()
    ranks = [_sampler(src, tgt, 1000, world_size=3, rank=r) for r in range(3)]
    assert len({s.batches_per_rank for s in ranks}) > 1  # 98 batches: 33, 33, 32
    streams = [iter(s) for s in ranks]
    for stream in streams:
        for _ in range(max(s.batches_per_rank for s in ranks) + 2):
            next(stream)
    state = ranks[0].state_dict()
    for rank, stream in enumerate(streams):
        resumed = _sampler(src, tgt, 1000, world_size=3, rank=rank)
        resumed.load_state_dict(state)
        assert _ids(itertools.islice(iter(resumed), 20)) == _ids(itertools.islice(stream, 20))


def test_turning_shape_classes_on_continues_at_the_same_point_of_the_epoch(caplog):
    src, tgt = _small()
    a = _sampler(src, tgt, 1024, shape_classes=0)
    stream = iter(a)
    for _ in range(a.batches_per_rank + a.batches_per_rank // 2):  # half-way through epoch 1
        next(stream)
    state = a.state_dict()
    b = _sampler(src, tgt, 1024)
    with caplog.at_level("WARNING"):
        b.load_state_dict(state)
    assert "shape_classes 0 -> 16" in caplog.text
    assert b.epoch == 1 and abs(b.position - b.batches_per_rank / 2) <= 1
    # A checkpoint from before the key existed: the buckets' batches, resumed exactly.
    old = {k: v for k, v in state.items() if k != "shape_classes"}
    c = _sampler(src, tgt, 1024, shape_classes=0)
    caplog.clear()
    with caplog.at_level("WARNING"):
        c.load_state_dict(old)
    assert not caplog.text and (c.epoch, c.position) == (a.epoch, a.position)


def test_errors_name_the_example_and_the_missing_lengths():
    src, tgt = np.array([3, 4, 50, 2]), np.array([3, 60, 2, 2])
    with pytest.raises(ValueError, match="id 1001 with 60 subwords"):
        _sampler(src, tgt, 40, ids=np.arange(1000, 1004))
    longer = np.maximum(src, tgt)
    with pytest.raises(ValueError, match="need src_lens and tgt_lens"):
        TokenBatchSampler(longer, longer // 8, 100, shape_classes=4)
    with pytest.raises(ValueError, match="longer side of src_lens and tgt_lens"):
        TokenBatchSampler(longer, longer // 8, 100, src_lens=src, tgt_lens=src)
