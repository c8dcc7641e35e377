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
from transformer.data.batching import (
    BatchLoader,
    Example,
    ShardDataset,
    TokenBatchSampler,
    collate,
)
from transformer.data.shard import encode_and_shard
from transformer.vocab import BOS, EOS, PAD


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


def test_a_state_from_another_setup_is_refused():
    state = _sampler(seed=1).state_dict()
    with pytest.raises(ValueError, match="seed=1"):
        _sampler(seed=2).load_state_dict(state)
    with pytest.raises(ValueError, match="world_size"):
        _sampler(world_size=2).load_state_dict(state)


def test_a_sentence_over_the_budget_is_an_error_naming_it():
    lengths = np.array([3, 4, 50, 2])
    with pytest.raises(ValueError, match="id 1002 with 50 subwords"):
        TokenBatchSampler(lengths, lengths // 8, 40, ids=np.arange(1000, 1004))


# --------------------------------------------------------------------------- collate


def test_collate_pads_right_and_shifts_the_target():
    batch = collate(
        [
            Example(7, np.array([5, 6, EOS]), np.array([8, EOS])),
            Example(9, [5, EOS], [8, 9, 10, EOS]),
        ]
    )
    assert batch.src.tolist() == [[5, 6, EOS], [5, EOS, PAD]]
    assert batch.tgt_out.tolist() == [[8, EOS, PAD, PAD], [8, 9, 10, EOS]]
    assert batch.tgt_in.tolist() == [[BOS, 8, PAD, PAD], [BOS, 8, 9, 10]]
    assert batch.ids.tolist() == [7, 9]
    assert (batch.n_src_tokens, batch.n_tgt_tokens) == (5, 6)
    assert batch.src.dtype == batch.tgt_in.dtype == torch.long and len(batch) == 2
    moved = batch.to("cpu")
    assert torch.equal(moved.tgt_in, batch.tgt_in)


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
    for i in (0, 123, 399):
        example = dataset[i]
        assert example.src[-1] == EOS and example.tgt[-1] == EOS
        assert (len(example.src), len(example.tgt)) == (dataset.src_lens[i], dataset.tgt_lens[i])


def test_dataset_batch_equals_collate_across_files(dataset):
    # Examples from several files and buckets in one call (the sampler never does that,
    # but the gather must not care).
    indices = np.array([0, 29, 30, 31, 150, 399, 200, 5])
    fast = dataset.batch(indices)
    slow = collate([dataset[int(i)] for i in indices])
    for field in ("src", "tgt_in", "tgt_out", "ids"):
        assert torch.equal(getattr(fast, field), getattr(slow, field)), field
    assert (fast.n_src_tokens, fast.n_tgt_tokens) == (slow.n_src_tokens, slow.n_tgt_tokens)
    assert not (fast.tgt_in == EOS).any()


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
