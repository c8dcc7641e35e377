"""Token-budget batches of example indices, shared out by rank, resumable.

Batches hold sentences of similar length (one length bucket at a time, sorted inside it)
up to a token budget, as in the paper (5.1) and fairseq's batch_by_size. With
`shape_classes=K` (train.shape_classes) every batch has one of at most K static padded
shapes (B, S, T) instead (shape_classes.py), for torch.compile without recompiling and
CUDA-graph capture:

    sampler = TokenBatchSampler.from_dataset(ds, 4096, shape_classes=16)
    shape_report(sampler)                      # ({(B, S, T): batches}, real/padded tokens)
"""

from __future__ import annotations

import logging
import math
from collections.abc import Iterator
from typing import NamedTuple

import numpy as np

from transformer.data.dataset import ShardDataset
from transformer.data.shape_classes import ShapeClasses, fit_shape_classes

log = logging.getLogger(__name__)


class TokenBatchSampler:
    """Token-budget batches of example indices, the same on every rank, shared out by rank.

    A batch is cut from one length bucket sorted by length, and holds as many examples as
    fit `n_sentences * max(longest src, longest tgt) <= max_tokens`: the size of the larger
    padded tensor, padding counted. Each epoch breaks ties between equal lengths and orders
    the batches at random from (seed, epoch); every rank builds the same list and takes
    batches[rank::world_size], so ranks are disjoint and together see every example once
    per epoch. The batch boundaries depend only on the sorted lengths, so every epoch has
    the same number of batches.

    Shape classes (`shape_classes=K` > 0; needs `src_lens` and `tgt_lens`): the examples
    fall in at most K classes that `fit_shape_classes` chooses from the corpus' lengths,
    and every batch of a class has its static padded shape (B, S, T): the class's longest
    source and longest target, apart, and as many rows as fit `B * max(S, T) <= max_tokens`.
    Each epoch draws a class's examples in random order from (seed, epoch) (inside a class
    the padded size is fixed, so random company costs nothing), cuts them in batches of B,
    and fills the class's last batch with padding rows (index -1, after the examples; see
    Batch), so every batch of every epoch has one of the K shapes and every epoch the same
    number of batches; `padded_shape(batch)` gives the loader its (S, T). The guarantees
    above hold as they are.

    Iterating is an endless stream, epoch after epoch, from (`epoch`, `position`);
    `epoch_batches(e)` is one finite epoch (validation, decoding) and leaves the state alone.
    An example longer than max_tokens is an error (ValueError naming it), never dropped.
    """

    def __init__(
        self,
        lengths: np.ndarray,
        buckets: np.ndarray,
        max_tokens: int,
        *,
        seed: int = 1,
        rank: int = 0,
        world_size: int = 1,
        shuffle: bool = True,
        ids: np.ndarray | None = None,
        shape_classes: int = 0,
        src_lens: np.ndarray | None = None,
        tgt_lens: np.ndarray | None = None,
    ):
        self.lengths = np.asarray(lengths, dtype=np.int64)
        self.buckets = np.asarray(buckets, dtype=np.int64)
        if self.lengths.shape != self.buckets.shape or self.lengths.ndim != 1:
            raise ValueError("lengths and buckets must be 1-D arrays of the same length")
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is not in [0, {world_size})")
        if shape_classes < 0:
            raise ValueError(f"shape_classes {shape_classes} < 0 (0: no shape classes)")
        self.max_tokens, self.seed, self.shuffle = max_tokens, seed, shuffle
        self.rank, self.world_size, self.shape_classes = rank, world_size, shape_classes
        _check_lengths(self.lengths, max_tokens, ids)
        self.src_lens = self.tgt_lens = None  # each side's lengths, where given
        if src_lens is not None or tgt_lens is not None:
            self.src_lens = np.asarray(src_lens, dtype=np.int64)
            self.tgt_lens = np.asarray(tgt_lens, dtype=np.int64)
            if not np.array_equal(np.maximum(self.src_lens, self.tgt_lens), self.lengths):
                raise ValueError("lengths must be the longer side of src_lens and tgt_lens")
        self._pads: list[int] | None = None  # padding rows of each batch (shape classes)
        self.classes: ShapeClasses | None = None
        self.shapes: list[tuple[int, int, int]] = []  # (B, S, T) of each shape class
        if shape_classes:
            if self.src_lens is None:
                raise ValueError("shape classes need src_lens and tgt_lens")
            self.classes = fit_shape_classes(
                self.src_lens, self.tgt_lens, max_tokens, shape_classes
            )
            self.shapes = self.classes.shapes
            key = self.classes.classify(self.src_lens, self.tgt_lens)
            self._key = key.astype(np.min_scalar_type(len(self.shapes)))  # an example's class
            self._sorted = np.argsort(self._key, kind="stable")  # by class, corpus order inside
            counts = np.bincount(self._key, minlength=len(self.shapes))
            self._bounds, self._pads = _class_bounds(counts, [b for b, _, _ in self.shapes])
        else:
            # Bucket first, then length: one sort gives every bucket's run, shortest first.
            # The narrowest dtype (uint16 for WMT) lets numpy's stable sort use radix sort,
            # faster than its timsort of wider keys
            # (benchmarks/results/2026-11-29-zen3-code-figures/NOTES.md).
            key = self.buckets * (int(self.lengths.max()) + 1) + self.lengths
            self._key = key.astype(np.min_scalar_type(key.max()))
            self._sorted = np.argsort(self._key, kind="stable")
            self._bounds = _batch_bounds(
                self.lengths[self._sorted], self.buckets[self._sorted], max_tokens
            )
        self.n_batches = len(self._bounds)
        if self.n_batches < world_size:
            raise ValueError(f"{self.n_batches} batches cannot feed {world_size} ranks")
        self.batches_per_rank = len(range(rank, self.n_batches, world_size))
        self.epoch = 0
        self.position = 0  # batches of `epoch` this rank has consumed
        self._cache: tuple[int, list[np.ndarray]] | None = None
        if shape_classes and rank == 0:
            log.info(
                "%d shape classes (B, S, T) for max_tokens %d: %s; real/padded tokens %.3f",
                len(self.shapes), max_tokens, ", ".join(map(str, self.shapes)),
                self._class_ratio(),
            )  # fmt: skip

    @classmethod
    def from_dataset(cls, dataset: ShardDataset, max_tokens: int, **kwargs) -> TokenBatchSampler:
        return cls(
            dataset.lengths,
            dataset.buckets,
            max_tokens,
            ids=dataset.ids,
            src_lens=dataset.src_lens,
            tgt_lens=dataset.tgt_lens,
            **kwargs,
        )

    def epoch_batches(self, epoch: int) -> list[np.ndarray]:
        """This rank's batches of `epoch`, in order (arrays of example indices)."""
        if self._cache is None or self._cache[0] != epoch:
            self._cache = (epoch, self._all_batches(epoch)[self.rank :: self.world_size])
        return self._cache[1]

    def padded_shape(self, indices: np.ndarray) -> tuple[int, int] | None:
        """(S, T), the widths this sampler's batch `indices` is padded to: its shape class's;
        None without shape classes (the batch's longest source and target)."""
        if not self.shape_classes:
            return None
        _, src_width, tgt_width = self.shapes[self._key[indices[0]]]
        return src_width, tgt_width

    def __iter__(self) -> Iterator[np.ndarray]:
        while True:
            batches = self.epoch_batches(self.epoch)
            while self.position < len(batches):
                self.position += 1  # before yielding: the state counts the batch handed out
                yield batches[self.position - 1]
            self.epoch, self.position = self.epoch + 1, 0

    def state_dict(self) -> dict:
        """`consumed` (batches this rank has had since epoch 0) is what a resume uses: ranks
        step in lockstep, so rank 0's state restores every rank, uneven epochs included."""
        return {
            "epoch": self.epoch,
            "position": self.position,
            "consumed": self.epoch * self.batches_per_rank + self.position,
            **self._identity(),
        }

    def load_state_dict(self, state: dict) -> None:
        """Continue after the batches `state` had consumed. If they were other batches
        (another world size, token budget, shape classes or data), continue at the same
        fraction of the same epoch instead, with a warning: the run goes on, no longer bit
        for bit."""
        saved = {**_IDENTITY_BEFORE, **state}  # a state from before a key existed
        differs = {k: v for k, v in self._identity().items() if saved.get(k) != v}
        if not differs:
            self.epoch, self.position = divmod(int(state["consumed"]), self.batches_per_rank)
            return
        log.warning(
            "data position: the batches differ from the checkpoint's (%s); continuing from "
            "the same point of epoch %d",
            ", ".join(f"{k} {saved.get(k)} -> {v}" for k, v in differs.items()),
            state["epoch"],
        )
        old_per_rank = math.ceil(state["n_batches"] / state["world_size"])
        fraction = state["position"] / old_per_rank
        self.epoch = int(state["epoch"])
        self.position = min(self.batches_per_rank - 1, round(fraction * self.batches_per_rank))

    def _identity(self) -> dict:
        return {
            "seed": self.seed,
            "max_tokens": self.max_tokens,
            "shuffle": self.shuffle,
            "world_size": self.world_size,
            "n_examples": len(self.lengths),
            "n_batches": self.n_batches,
            "shape_classes": self.shape_classes,
        }

    def _all_batches(self, epoch: int) -> list[np.ndarray]:
        """Every rank's batches of `epoch`, in order."""
        rng = np.random.default_rng([self.seed, epoch]) if self.shuffle else None
        if rng is None:
            order = self._sorted
        else:
            perm = rng.permutation(len(self.lengths))
            order = perm[np.argsort(self._key[perm], kind="stable")]  # equal keys at random
        batches = [order[s:e] for s, e in self._bounds]
        if self._pads is not None:  # a class's last batch: padding rows after its examples
            pads = zip(batches, self._pads, strict=True)
            batches = [np.append(b, np.full(p, -1)) if p else b for b, p in pads]
        if rng is None:
            return batches
        return [batches[i] for i in rng.permutation(len(batches))]

    def _class_ratio(self) -> float:
        rows = np.bincount(self._key, minlength=len(self.shapes))
        padded = sum(
            math.ceil(n / b) * b * (s + t) for n, (b, s, t) in zip(rows, self.shapes, strict=True)
        )
        return float((self.src_lens.sum() + self.tgt_lens.sum()) / padded)


# Identity keys added since checkpoints were first written, and what those checkpoints did.
_IDENTITY_BEFORE = {"shape_classes": 0}


def _check_lengths(lengths: np.ndarray, max_tokens: int, ids: np.ndarray | None) -> None:
    if len(lengths) == 0:
        raise ValueError("no examples to batch")
    if lengths.min() < 1:
        raise ValueError("every example holds at least its EOS (length >= 1)")
    too_long = np.flatnonzero(lengths > max_tokens)
    if too_long.size:
        i = too_long[np.argmax(lengths[too_long])]
        name = int(ids[i]) if ids is not None else int(i)
        raise ValueError(
            f"{too_long.size} example(s) longer than max_tokens={max_tokens}, e.g. id {name} "
            f"with {lengths[i]} subwords: raise train.max_tokens or lower clean.max_len"
        )


def _batch_bounds(sorted_lens: np.ndarray, sorted_buckets: np.ndarray, max_tokens: int):
    """[(start, end)] into the sorted order: greedy token-budget batches within each bucket."""
    bounds = []
    bucket_ends = np.append(np.flatnonzero(np.diff(sorted_buckets)) + 1, len(sorted_lens))
    start = 0
    for end in bucket_ends:
        while start < end:
            # Lengths ascend, so n * len[start + n - 1] grows with n: the batch is the run of
            # leading True values, at most max_tokens // len[start] long.
            window = sorted_lens[start : min(end, start + max_tokens // sorted_lens[start])]
            fits = window * np.arange(1, len(window) + 1) <= max_tokens
            stop = start + (len(window) if fits[-1] else int(np.argmin(fits)))
            bounds.append((start, stop))
            start = stop
    return bounds


def _class_bounds(counts: np.ndarray, rows: list[int]) -> tuple[list, list[int]]:
    """[(start, end)] into the order sorted by class, and each batch's padding rows."""
    bounds, pads, start = [], [], 0
    for n, b in zip(counts.tolist(), rows, strict=True):
        for s in range(start, start + n, b):
            bounds.append((s, min(s + b, start + n)))
            pads.append(s + b - bounds[-1][1])
        start += n
    return bounds, pads


class ShapeReport(NamedTuple):
    shapes: dict[tuple[int, int, int], int]  # (B, S, T) -> batches of that padded shape
    ratio: float  # real tokens / padded tensor sizes, source and target together


def shape_report(sampler: TokenBatchSampler, epoch: int = 0) -> ShapeReport:
    """The padded shapes of an epoch's batches, every rank's, and how much of them is
    real: what torch.compile or CUDA graphs would meet, and what padding costs. Needs
    the sampler's src_lens and tgt_lens (from_dataset gives them)."""
    if sampler.src_lens is None or sampler.tgt_lens is None:
        raise ValueError("a shape report needs the sampler's src_lens and tgt_lens")
    shapes: dict[tuple[int, int, int], int] = {}
    real = padded = 0
    for batch in sampler._all_batches(epoch):
        examples = batch[batch >= 0]
        widths = sampler.padded_shape(batch) or (
            int(sampler.src_lens[examples].max()),
            int(sampler.tgt_lens[examples].max()),
        )
        shape = (len(batch), *widths)
        shapes[shape] = shapes.get(shape, 0) + 1
        real += int(sampler.src_lens[examples].sum() + sampler.tgt_lens[examples].sum())
        padded += len(batch) * sum(widths)
    return ShapeReport(dict(sorted(shapes.items())), real / padded)
