"""Batching: the sampler's invariants (coverage, budget, determinism, exact resume across
ranks and epochs), padding and shifting, and the prefetching loader's exact resume."""

import itertools
import random

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import sentencepiece as spm
import torch

from transformer.config import ShardConfig
from transformer.data.dataset import ShardDataset
from transformer.data.loader import BatchLoader
from transformer.data.sampler import TokenBatchSampler
from transformer.data.shard import encode_and_shard
from transformer.tokens import BOS, EOS, PAD


def _lengths(n: int = 2000, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    lengths = np.random.default_rng(seed).integers(1, 80, size=n)
    return lengths, lengths // 8


def _sampler(world_size=1, rank=0, seed=1, max_tokens=300, **kwargs) -> TokenBatchSampler:
    lengths, buckets = _lengths()
    return TokenBatchSampler(
        lengths, buckets, max_tokens, seed=seed, rank=rank, world_size=world_size, **kwargs
    )


def _ids(batches) -> list[tuple[int, ...]]:
    return [tuple(b.tolist()) for b in batches]


# --------------------------------------------------------------------------- sampler


@pytest.mark.parametrize("world_size", [1, 2, 3])
def test_ranks_cover_every_example_once_per_epoch(world_size):
    for epoch in (0, 1):
        seen = np.concatenate(
            [
                np.concatenate(_sampler(world_size, rank).epoch_batches(epoch))
                for rank in range(world_size)
            ]
        )
        assert np.array_equal(np.sort(seen), np.arange(2000))


def test_batches_respect_the_budget_padding_counted_and_one_bucket():
    lengths, buckets = _lengths()
    for shuffle in (True, False):
        for batch in _sampler(max_tokens=300, shuffle=shuffle).epoch_batches(0):
            assert len(batch) * lengths[batch].max() <= 300
            assert len(np.unique(buckets[batch])) == 1
    # Tight: a greedy batch stops only when the next example would break the budget.
    batches = _sampler(shuffle=False).epoch_batches(0)
    for batch, nxt in itertools.pairwise(batches):
        if buckets[batch[0]] == buckets[nxt[0]]:
            assert (len(batch) + 1) * lengths[nxt[0]] > 300


def test_order_is_a_function_of_seed_and_epoch():
    a, b, c = _sampler(seed=1), _sampler(seed=1), _sampler(seed=2)
    assert _ids(a.epoch_batches(0)) == _ids(b.epoch_batches(0))
    assert _ids(a.epoch_batches(0)) != _ids(c.epoch_batches(0))
    assert _ids(a.epoch_batches(0)) != _ids(a.epoch_batches(1))
    assert len(a.epoch_batches(0)) == len(a.epoch_batches(1)) == a.batches_per_rank


def test_the_stream_runs_epoch_after_epoch():
    s = _sampler(world_size=3, rank=2)
    n = s.batches_per_rank
    stream = _ids(itertools.islice(iter(s), 2 * n + 1))
    assert stream[:n] == _ids(s.epoch_batches(0))
    assert stream[n : 2 * n] == _ids(s.epoch_batches(1))
    assert stream[2 * n] == _ids(s.epoch_batches(2))[0]
    assert (s.epoch, s.position) == (2, 1)


@pytest.mark.parametrize("consumed", [0, 5, "end", "end+3"])
def test_resume_continues_the_exact_sequence(consumed):
    a = _sampler(world_size=2, rank=1)
    n = a.batches_per_rank
    k = {"end": n, "end+3": n + 3}.get(consumed, consumed)
    stream = iter(a)
    for _ in range(k):
        next(stream)
    state = a.state_dict()
    expected = _ids(itertools.islice(stream, 2 * n))

    b = _sampler(world_size=2, rank=1)
    b.load_state_dict(state)
    assert _ids(itertools.islice(iter(b), 2 * n)) == expected


def test_rank_zeros_state_resumes_every_rank_despite_uneven_epochs():
    ranks = [_sampler(world_size=3, rank=r, max_tokens=200) for r in range(3)]
    assert len({s.batches_per_rank for s in ranks}) > 1  # the case that needs care
    streams = [iter(s) for s in ranks]
    steps = max(s.batches_per_rank for s in ranks) + 2  # past every rank's epoch end
    for stream in streams:
        for _ in range(steps):
            next(stream)
    state = ranks[0].state_dict()  # only rank 0 writes the checkpoint
    for rank, stream in enumerate(streams):
        resumed = _sampler(world_size=3, rank=rank, max_tokens=200)
        resumed.load_state_dict(state)
        assert _ids(itertools.islice(iter(resumed), 20)) == _ids(itertools.islice(stream, 20))


def test_a_state_of_other_batches_continues_at_the_same_point_of_the_epoch(caplog):
    """Another world size or token budget (operational: the trainer resumes) cuts other
    batches: the position becomes the same fraction of the same epoch, with a warning."""
    a = _sampler(max_tokens=300)
    stream = iter(a)
    for _ in range(a.batches_per_rank + a.batches_per_rank // 2):  # half-way through epoch 1
        next(stream)
    b = _sampler(max_tokens=150, world_size=2)
    with caplog.at_level("WARNING"):
        b.load_state_dict(a.state_dict())
    assert "max_tokens 300 -> 150" in caplog.text and "world_size 1 -> 2" in caplog.text
    assert b.epoch == 1 and abs(b.position - b.batches_per_rank / 2) <= 1


def test_a_sentence_over_the_budget_is_an_error_naming_it():
    lengths = np.array([3, 4, 50, 2])
    with pytest.raises(ValueError, match="id 1002 with 50 subwords"):
        TokenBatchSampler(lengths, lengths // 8, 40, ids=np.arange(1000, 1004))


# --------------------------------------------------------------------------- shards


@pytest.fixture(scope="module")
def dataset(tmp_path_factory) -> ShardDataset:
    """Train shards of 400 pairs in several buckets and files (rows_per_shard=30)."""
    root = tmp_path_factory.mktemp("data")
    rng = random.Random(0)
    words = ["ein", "hund", "the", "dog", "runs", "rennt", "in", "park", "a", "big"]
    lines = [" ".join(rng.choices(words, k=rng.randint(1, 30))) for _ in range(1200)]
    (root / "text.txt").write_text("\n".join(lines))
    spm.SentencePieceTrainer.train(
        input=str(root / "text.txt"),
        model_prefix=str(root / "spm"),
        vocab_size=60,
        model_type="bpe",
        pad_id=PAD,
        unk_id=1,
        bos_id=BOS,
        eos_id=EOS,
        minloglevel=2,
    )
    clean = root / "clean"
    clean.mkdir()
    for role, (lo, hi) in {"train": (0, 400), "valid": (400, 450), "test": (450, 500)}.items():
        table = pa.table({"src": lines[lo:hi], "tgt": lines[600 + lo : 600 + hi]})
        pq.write_table(table, clean / f"{role}.parquet")
    shards = root / "shards"
    cfg = ShardConfig(bucket_width=4, rows_per_shard=30, workers=1)
    encode_and_shard(clean, root / "spm.model", cfg, shards)
    return ShardDataset(shards, "train")


def test_dataset_exposes_lengths_buckets_and_ids(dataset):
    assert len(dataset) == 400 and sorted(dataset.ids.tolist()) == list(range(400))
    assert np.array_equal(dataset.buckets, dataset.lengths // 4)


def test_a_batch_pads_right_shifts_the_target_and_lists_the_real_targets(dataset):
    # Examples from several files and buckets in one call (the sampler never does that,
    # but the gather must not care), checked against the corpus encoded afresh.
    indices = np.array([0, 29, 30, 31, 150, 399, 200, 5])
    batch = dataset.batch(indices)
    sp = spm.SentencePieceProcessor(model_file=str(dataset.spm_model))
    corpus = pq.read_table(dataset.shards_dir.parent / "clean" / "train.parquet")
    for row, i in enumerate(indices):
        pair = int(dataset.ids[i])
        src = sp.encode(corpus["src"][pair].as_py(), add_eos=True)
        tgt = sp.encode(corpus["tgt"][pair].as_py(), add_eos=True)
        assert batch.ids[row] == pair
        assert _unpad(batch.src[row]) == src and _unpad(batch.tgt_out[row]) == tgt
        assert _unpad(batch.tgt_in[row]) == [BOS, *tgt[:-1]]  # the decoder input, shifted
        assert (len(src), len(tgt)) == (dataset.src_lens[i], dataset.tgt_lens[i])
    assert not (batch.tgt_in == EOS).any()
    real = np.flatnonzero(batch.tgt_out.numpy().reshape(-1) != PAD)
    assert batch.tgt_positions.tolist() == real.tolist() and batch.n_tgt_tokens == len(real)
    assert batch.n_src_tokens == int((batch.src != PAD).sum())
    assert batch.src.dtype == batch.tgt_in.dtype == torch.long and len(batch) == len(indices)
    assert torch.equal(batch.to("cpu").tgt_positions, batch.tgt_positions)


def _unpad(row: torch.Tensor) -> list[int]:
    """The row without its right padding (a row ends with EOS or, shifted, a real token)."""
    values = row.tolist()
    while values and values[-1] == PAD:
        values.pop()
    return values


def _loader(dataset, **kwargs) -> BatchLoader:
    sampler = TokenBatchSampler.from_dataset(dataset, 256, seed=3, world_size=2, rank=1)
    return BatchLoader(dataset, sampler, prefetch=4, **kwargs)


def test_loader_resume_is_exact_despite_prefetch(dataset):
    loader = _loader(dataset)
    n = loader.sampler.batches_per_rank
    stream = iter(loader)
    for _ in range(n - 2):  # stop two batches before the epoch's end
        next(stream)
    state = loader.state_dict()
    assert state["consumed"] == n - 2  # consumed, not the 4 batches prefetched beyond
    expected = [next(stream).ids.tolist() for _ in range(6)]  # crosses into epoch 1

    resumed = _loader(dataset)
    resumed.load_state_dict(state)
    stream2 = iter(resumed)
    assert [next(stream2).ids.tolist() for _ in range(6)] == expected
    loader.close()
    resumed.close()


def test_loader_iterated_again_continues_from_what_was_consumed(dataset):
    loader = _loader(dataset)
    first = []
    for batch in loader:
        first.append(batch.ids.tolist())
        if len(first) == 3:
            break
    again = next(iter(loader)).ids.tolist()
    reference = _loader(dataset)
    expected = [b.ids.tolist() for b in itertools.islice(reference, 4)]
    assert [*first, again] == expected
    loader.close()
    reference.close()


def test_loader_finite_pass_and_errors(dataset):
    sampler = TokenBatchSampler.from_dataset(dataset, 256, shuffle=False)
    batches = list(BatchLoader(dataset, sampler, epoch=0))
    assert [b.ids.tolist() for b in batches] == [
        dataset.ids[idx].tolist() for idx in sampler.epoch_batches(0)
    ]
    assert sum(len(b) for b in batches) == len(dataset)

    class Broken:
        def batch(self, *args):
            raise RuntimeError("unreadable shard")

    with pytest.raises(RuntimeError, match="unreadable shard"):
        next(iter(BatchLoader(Broken(), sampler)))


# --------------------------------------------------------------------------- shape classes
# (the sampler's side: tests/test_shape_classes.py)


def test_padding_rows_and_class_widths(dataset):
    indices = np.array([3, 17, 42, 8])
    natural = dataset.batch(indices)
    (_, s), (_, t) = natural.src.shape, natural.tgt_out.shape
    batch = dataset.batch([*indices, -1, -1], pad_to=(s + 3, t + 2))
    assert batch.src.shape == (6, s + 3) and batch.tgt_in.shape == batch.tgt_out.shape == (6, t + 2)
    for row in range(4):  # the examples as they were, wider
        assert _unpad(batch.src[row]) == _unpad(natural.src[row])
        assert _unpad(batch.tgt_in[row]) == _unpad(natural.tgt_in[row])
        assert _unpad(batch.tgt_out[row]) == _unpad(natural.tgt_out[row])
    assert batch.ids.tolist() == [*natural.ids.tolist(), -1, -1]
    # A padding row: one source key (EOS), an empty target: in no loss position, no count.
    assert batch.src[4:, 0].tolist() == [EOS, EOS] and (batch.src[4:, 1:] == PAD).all()
    assert batch.tgt_in[4:, 0].tolist() == [BOS, BOS] and (batch.tgt_in[4:, 1:] == PAD).all()
    assert (batch.tgt_out[4:] == PAD).all()
    assert (batch.tgt_positions < 4 * (t + 2)).all()
    assert batch.tgt_out.flatten()[batch.tgt_positions].tolist() == (
        natural.tgt_out.flatten()[natural.tgt_positions].tolist()
    )
    assert (batch.n_src_tokens, batch.n_tgt_tokens) == (natural.n_src_tokens, natural.n_tgt_tokens)
    with pytest.raises(ValueError, match="longer than the widths"):
        dataset.batch(indices, pad_to=(s - 1, t))
    with pytest.raises(ValueError, match="not only padding rows"):
        dataset.batch([-1, -1], pad_to=(s, t))


def test_padding_rows_change_neither_the_loss_nor_its_gradient(dataset):
    """The model on a class-padded batch (wider, with padding rows) gives the loss and the
    gradient of the batch as it was: the padding rows' EOS keeps their attention finite."""
    from transformer.config import ModelConfig
    from transformer.nn.model import Transformer

    cfg = ModelConfig(n_layers=1, d_model=16, d_ff=32, n_heads=2, dropout=0.0)
    torch.manual_seed(0)
    model = Transformer(cfg, 60, pad_id=PAD)
    indices = np.array([3, 17, 42, 8])
    natural = dataset.batch(indices)
    (_, s), (_, t) = natural.src.shape, natural.tgt_out.shape
    padded = dataset.batch([*indices, -1, -1, -1], pad_to=(s + 5, t + 4))

    def loss_and_grads(batch):
        model.zero_grad()
        logits = model(batch.src, batch.tgt_in).flatten(0, 1)[batch.tgt_positions]
        targets = batch.tgt_out.flatten()[batch.tgt_positions]
        loss = torch.nn.functional.cross_entropy(logits, targets, reduction="sum")
        loss.backward()
        return loss.detach(), [p.grad.clone() for p in model.parameters() if p.grad is not None]

    loss, grads = loss_and_grads(natural)
    loss2, grads2 = loss_and_grads(padded)
    assert torch.isfinite(loss2) and all(torch.isfinite(g).all() for g in grads2)
    torch.testing.assert_close(loss2, loss, rtol=1e-5, atol=1e-5)
    assert len(grads2) == len(grads)
    for g2, g in zip(grads2, grads, strict=True):
        torch.testing.assert_close(g2, g, rtol=1e-4, atol=1e-6)


def _class_loader(dataset, **kwargs) -> BatchLoader:
    sampler = TokenBatchSampler.from_dataset(
        dataset, 256, seed=3, world_size=2, rank=1, shape_classes=4
    )
    return BatchLoader(dataset, sampler, prefetch=4, **kwargs)


def test_loader_pads_every_batch_to_its_class_shape(dataset):
    seen = []
    for rank in (0, 1):
        sampler = TokenBatchSampler.from_dataset(
            dataset, 256, seed=3, world_size=2, rank=rank, shape_classes=4
        )
        shapes = set(sampler.shapes)
        assert 1 < len(shapes) <= 4
        for batch in BatchLoader(dataset, sampler, epoch=1):
            assert (len(batch), batch.src.shape[1], batch.tgt_out.shape[1]) in shapes
            real = batch.ids >= 0
            seen += batch.ids[real].tolist()
            assert batch.n_tgt_tokens == len(batch.tgt_positions)
            assert batch.n_src_tokens == int((batch.src[real] != PAD).sum())
            assert (batch.tgt_out[~real] == PAD).all() and (batch.src[~real, 0] == EOS).all()
    assert sorted(seen) == list(range(len(dataset)))  # every example once, both ranks


def test_loader_resume_with_shape_classes_is_exact_despite_prefetch(dataset):
    loader = _class_loader(dataset)
    n = loader.sampler.batches_per_rank
    stream = iter(loader)
    for _ in range(n - 1):
        next(stream)
    state = loader.state_dict()
    expected = [next(stream).ids.tolist() for _ in range(4)]  # crosses into epoch 1
    resumed = _class_loader(dataset)
    resumed.load_state_dict(state)
    stream2 = iter(resumed)
    assert [next(stream2).ids.tolist() for _ in range(4)] == expected
    loader.close()
    resumed.close()
