"""Batches from the shards: memory-mapped reading, token-budget batching, padding, prefetch.

    ds = ShardDataset(shards_dir, "train")
    sampler = TokenBatchSampler.from_dataset(ds, max_tokens=4096, seed=1, rank=r, world_size=w)
    loader = BatchLoader(ds, sampler)          # infinite, prefetched in a thread
    for batch in loader: ...                   # batch.src, batch.tgt_in, batch.tgt_out
    ckpt["data"] = loader.state_dict()         # position after the batches consumed

Batches hold sentences of similar length (one length bucket at a time, sorted inside it)
up to a token budget, as in the paper (5.1) and fairseq's batch_by_size. With
`shape_classes=K` (train.shape_classes) every batch has one of at most K static padded
shapes (B, S, T) instead, for torch.compile without recompiling and CUDA-graph capture:

    sampler = TokenBatchSampler.from_dataset(ds, 4096, shape_classes=16)
    shape_report(sampler)                      # ({(B, S, T): batches}, real/padded tokens)
"""

from __future__ import annotations

import logging
import math
import queue
import threading
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import NamedTuple

import numpy as np
import pyarrow as pa
import torch

from transformer.data import DataError
from transformer.data.shard import load_manifest
from transformer.files import SPM_MODEL
from transformer.tokens import BOS, EOS, PAD

log = logging.getLogger(__name__)


@dataclass
class Batch:
    """A padded batch; every row of `src` and `tgt_out` ends with EOS, then PAD.

    Padding rows (id -1; shape classes fill a class's last batch with them so that B is
    static) are no example: `src` [EOS, PAD, ...], `tgt_in` [BOS, PAD, ...], `tgt_out` all
    PAD, as a pair with an empty target. No target position of theirs is in `tgt_positions`,
    and no token of theirs in the counts, so the loss and its normalisation never see them,
    and their gradient is exactly zero. The source's EOS gives attention a key to attend to:
    a row whose keys are all padding is a softmax over nothing, NaN wherever a kernel does
    not special-case it (kernels.attention's own softmax assumes every row keeps a key), and
    a NaN row would reach the weights' gradients through 0 x NaN. The decoder's causal
    mask leaves each target position a key of its own already.
    """

    src: torch.Tensor  # (B, S) long
    tgt_in: torch.Tensor  # (B, T) long: [BOS] + tgt[:-1], the decoder input
    tgt_out: torch.Tensor  # (B, T) long: tgt, the targets of the loss
    # (n_tgt_tokens,) long: flat indices into (B * T) of the non-pad targets, so the loss
    # reads only them without a boolean mask (whose size the GPU would report to the host)
    tgt_positions: torch.Tensor
    # (B,) long, stays on the CPU: bookkeeping, never model input; -1 in a padding row
    ids: torch.Tensor
    n_src_tokens: int  # the examples' source tokens (padding rows' EOS not counted)
    n_tgt_tokens: int  # non-pad targets: what the loss is normalised by

    def __len__(self) -> int:
        return self.src.shape[0]

    def to(self, device: torch.device | str, non_blocking: bool = True) -> Batch:
        return self._map(lambda t: t.to(device, non_blocking=non_blocking))

    def pin_memory(self) -> Batch:
        return self._map(torch.Tensor.pin_memory)

    def _map(self, fn) -> Batch:
        moved = ("src", "tgt_in", "tgt_out", "tgt_positions")
        return replace(self, **{f: fn(getattr(self, f)) for f in moved})


# --------------------------------------------------------------------------- dataset


class ShardDataset:
    """One role's shards, memory-mapped: the token ids stay in the page cache, not the heap.

    Example i is row i of the role's files in manifest order. `src_lens`/`tgt_lens` count
    EOS; `buckets` is the length bucket of each example; `ids` its row in the cleaned corpus.
    """

    def __init__(self, shards_dir: Path, role: str):
        shards_dir = Path(shards_dir)
        manifest = load_manifest(shards_dir)
        if role not in manifest["roles"]:
            raise DataError(f"{shards_dir}: no role '{role}' in the manifest")
        self.shards_dir = shards_dir
        self.fingerprint: str = manifest["fingerprint"]
        self.copies: int = manifest["roles"][role].get("copies", 1)  # BPE-dropout draws
        self.spm_model = shards_dir / SPM_MODEL
        self._src: list[tuple[np.ndarray, np.ndarray]] = []  # per file: (offsets, values)
        self._tgt: list[tuple[np.ndarray, np.ndarray]] = []
        ids, buckets, rows = [], [], []
        for entry in manifest["roles"][role]["files"]:
            table = _map_file(shards_dir / entry["path"])
            self._src.append(_ragged(table.column("src").chunk(0)))
            self._tgt.append(_ragged(table.column("tgt").chunk(0)))
            ids.append(table.column("id").chunk(0).to_numpy())
            buckets.append(np.full(table.num_rows, entry["bucket"], dtype=np.int64))
            rows.append(table.num_rows)
        self.ids = np.concatenate(ids) if ids else np.zeros(0, np.int64)
        self.buckets = np.concatenate(buckets) if buckets else np.zeros(0, np.int64)
        self.src_lens = _lengths(self._src)
        self.tgt_lens = _lengths(self._tgt)
        self._file_starts = np.concatenate([[0], np.cumsum(rows, dtype=np.int64)])

    def __len__(self) -> int:
        return len(self.ids)

    @property
    def lengths(self) -> np.ndarray:
        """The longer side of each example: its padded width in a batch."""
        return np.maximum(self.src_lens, self.tgt_lens)

    def batch(
        self,
        indices: Sequence[int],
        pad_id: int = PAD,
        bos_id: int = BOS,
        pad_to: tuple[int, int] | None = None,
        eos_id: int = EOS,
    ) -> Batch:
        """The padded Batch of these examples, gathered without a Python loop over rows.
        An index -1 is a padding row (see Batch); `pad_to` (S, T) pads the source and the
        target to these widths (a shape class's) rather than to the batch's longest."""
        indices = np.asarray(indices, dtype=np.int64)
        real = indices >= 0
        if not real.any():
            raise ValueError("a batch needs examples, not only padding rows")
        take = indices[real]
        files = np.searchsorted(self._file_starts, take, side="right") - 1
        rows = take - self._file_starts[files]
        src_lens, tgt_lens = self.src_lens[take], self.tgt_lens[take]
        if pad_to is None:
            pad_to = (int(src_lens.max()), int(tgt_lens.max()))
        elif src_lens.max() > pad_to[0] or tgt_lens.max() > pad_to[1]:
            raise ValueError(f"examples longer than the widths {pad_to} they are padded to")
        src = np.full((len(indices), pad_to[0]), pad_id, dtype=np.int64)  # (B, S)
        tgt = np.full((len(indices), pad_to[1]), pad_id, dtype=np.int64)  # (B, T)
        src[real] = _gather(self._src, files, rows, src_lens, pad_id, pad_to[0])
        tgt[real] = _gather(self._tgt, files, rows, tgt_lens, pad_id, pad_to[1])
        src[~real, 0] = eos_id  # a padding row: one source key, an empty target
        ids = np.full(len(indices), -1, dtype=np.int64)
        ids[real] = self.ids[take]
        all_src, all_tgt = np.ones(len(indices), np.int64), np.zeros(len(indices), np.int64)
        all_src[real], all_tgt[real] = src_lens, tgt_lens
        return _make_batch(ids, src, all_src, tgt, all_tgt, pad_id, bos_id, real)


def _map_file(path: Path) -> pa.Table:
    try:
        reader = pa.ipc.open_file(pa.memory_map(str(path)))
        batches = [reader.get_batch(i) for i in range(reader.num_record_batches)]
    except (OSError, pa.ArrowException) as err:
        raise DataError(
            f"{path}: unreadable shard ({err}): delete the shards folder to rebuild it"
        ) from None
    # The writer puts one batch in a file, so this is zero-copy; more would be concatenated.
    return pa.Table.from_batches(batches, schema=reader.schema).combine_chunks()


def _ragged(column: pa.ListArray) -> tuple[np.ndarray, np.ndarray]:
    # `offsets` index into `values` directly (values ignores the array's own slice offset).
    return column.offsets.to_numpy(), column.values.to_numpy()


def _lengths(parts: list[tuple[np.ndarray, np.ndarray]]) -> np.ndarray:
    return np.concatenate([np.diff(off) for off, _ in parts] or [np.zeros(0)]).astype(np.int64)


def _gather(parts, files: np.ndarray, rows: np.ndarray, lens: np.ndarray, pad_id: int, width: int):
    out = np.full((len(rows), width), pad_id, dtype=np.int64)  # (B, L)
    for f in np.unique(files):  # a batch comes from one bucket: one file, rarely two
        sel = np.flatnonzero(files == f)
        offsets, values = parts[f]
        out[sel] = _pad_rows(values, offsets[rows[sel]], lens[sel], out.shape[1], pad_id)
    return out


def _pad_rows(values, starts, lens, width: int, pad_id: int) -> np.ndarray:
    """Row b = values[starts[b] : starts[b] + lens[b]], right-padded to `width`."""
    cols = np.arange(width)
    valid = cols < lens[:, None]  # (B, width)
    pos = np.where(valid, starts[:, None] + cols, 0)  # 0: any in-bounds index, masked below
    return np.where(valid, values[pos], pad_id).astype(np.int64)


def _make_batch(ids, src, src_lens, tgt_out, tgt_lens, pad_id: int, bos_id: int, real) -> Batch:
    """`real`: which rows are examples; the others are padding rows (an empty target)."""
    if len(ids) == 0 or min(src_lens[real].min(), tgt_lens[real].min()) < 1:
        raise ValueError("a batch needs examples, each side holding at least its EOS")
    tgt_in = np.empty_like(tgt_out)  # (B, T)
    tgt_in[:, 0] = bos_id
    tgt_in[:, 1:] = tgt_out[:, :-1]
    # Shifting moved each row's EOS into its first padding position: pad it again.
    short = np.flatnonzero(real & (tgt_lens < tgt_out.shape[1]))
    tgt_in[short, tgt_lens[short]] = pad_id
    return Batch(
        src=torch.from_numpy(src),
        tgt_in=torch.from_numpy(tgt_in),
        tgt_out=torch.from_numpy(tgt_out),
        tgt_positions=torch.from_numpy(np.flatnonzero(tgt_out != pad_id)),
        ids=torch.from_numpy(np.asarray(ids, dtype=np.int64)),
        n_src_tokens=int(src_lens[real].sum()),
        n_tgt_tokens=int(tgt_lens[real].sum()),
    )


# --------------------------------------------------------------------------- sampler


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
            # The narrowest dtype (uint16 for WMT) lets numpy's stable sort use radix sort:
            # ~10x faster.
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


# --------------------------------------------------------------------------- shape classes


# Shape classes are bands of key = max(slope * src_len, DEN * tgt_len): a slope of DEN bands
# the longer side; another follows the corpus' target/source ratio (a band then holds
# sources up to about edge / slope and targets up to edge / DEN). The slopes tried: ratios
# 2^(i/16), 0.68 to 1.48 (clean.max_ratio's 1.5 and its inverse), 1 first: ties keep it.
DEN = 64
SLOPES = sorted({round(DEN * 2 ** (i / 16)) for i in range(-9, 10)}, key=lambda s: abs(s - DEN))


class ShapeClasses(NamedTuple):
    """Class c holds the examples whose key max(slope * src_len, DEN * tgt_len) lies in
    (edges[c - 1], edges[c]], every batch padded to shapes[c] = (B, S, T)."""

    slope: int
    edges: np.ndarray
    shapes: list[tuple[int, int, int]]

    def classify(self, src_lens: np.ndarray, tgt_lens: np.ndarray) -> np.ndarray:
        key = np.maximum(np.asarray(src_lens) * self.slope, np.asarray(tgt_lens) * DEN)
        return np.searchsorted(self.edges, key)


def fit_shape_classes(
    src_lens: np.ndarray,
    tgt_lens: np.ndarray,
    max_tokens: int,
    k: int,
    slopes: Sequence[int] | None = None,
) -> ShapeClasses:
    """At most `k` shape classes for these lengths, padding the fewest tokens an epoch.

    A class pads its batches to S and T, its longest source and longest target, apart, with
    B = max_tokens // max(S, T) rows; the class's last batch is filled with padding rows. For
    each slope, dynamic programming over the distinct keys (a few hundred) finds the bands
    that minimise the tokens an epoch pads to, both sides and padding rows counted (a band
    of N examples: ceil(N / B) * B * (S + T)); the slope that pads least wins. On WMT-like
    lengths this matches what a local search over any 16 (S, T) corners finds; banding the
    longer side alone (slope DEN) pads both sides to one length once the corpus is large,
    ~1.5 points of real tokens worse where targets run ~10% longer than sources.
    `slopes`: those to try, SLOPES if None.
    """
    src, tgt = np.asarray(src_lens, np.int64), np.asarray(tgt_lens, np.int64)
    if k < 1 or len(src) == 0 or min(src.min(), tgt.min()) < 1:
        raise ValueError("shape classes need k >= 1 and lengths >= 1")
    if max(src.max(), tgt.max()) > max_tokens:
        raise ValueError(f"shape classes: an example is longer than max_tokens={max_tokens}")
    # The length histogram: distinct (source, target) pairs and how many of each.
    codes, counts = np.unique(src * (tgt.max() + 1) + tgt, return_counts=True)
    pair_src, pair_tgt = codes // (tgt.max() + 1), codes % (tgt.max() + 1)
    best = None
    for slope in SLOPES if slopes is None else slopes:
        key = np.maximum(pair_src * slope, pair_tgt * DEN)
        cost, edges, shapes = _bands(key, pair_src, pair_tgt, counts, max_tokens, k)
        if best is None or cost < best[0]:
            best = cost, ShapeClasses(slope, edges, shapes)
    return best[1]


def _bands(key, src, tgt, counts, max_tokens: int, k: int):
    """(padded tokens, edges, shapes) of the best at most k bands of `key` (exact DP)."""
    values, inverse = np.unique(key, return_inverse=True)
    n = len(values)
    rows = np.bincount(inverse, weights=counts, minlength=n).astype(np.int64)
    max_src, max_tgt = np.zeros(n, np.int64), np.zeros(n, np.int64)
    np.maximum.at(max_src, inverse, src)
    np.maximum.at(max_tgt, inverse, tgt)
    cum = np.concatenate([[0], np.cumsum(rows)])
    cost = np.full((n, n), np.int64(2**62))  # cost[i, j]: band values[i..j]; i > j: none
    for i in range(n):
        s, t = np.maximum.accumulate(max_src[i:]), np.maximum.accumulate(max_tgt[i:])
        b = max_tokens // np.maximum(s, t)
        cost[i, i:] = (s + t) * b * -(-(cum[i + 1 :] - cum[i]) // b)
    # least[j]: the least cost of values[0..j] in at most m bands; starts[m - 1][j]: where
    # the last of those bands starts (0: it is the only one).
    least, starts = cost[0].copy(), [np.zeros(n, np.int64)]
    for _ in range(1, min(k, n)):
        cand = np.concatenate([cost[:1], least[:-1, None] + cost[1:]])  # row i: last band at i
        start = cand.argmin(axis=0)
        least, starts = cand[start, np.arange(n)], [*starts, start]
    bands, j = [], n - 1
    for start in reversed(starts):
        i = int(start[j])
        bands.insert(0, (i, j))
        if i == 0:
            break
        j = i - 1
    shapes = []
    for i, j in bands:
        s, t = int(max_src[i : j + 1].max()), int(max_tgt[i : j + 1].max())
        shapes.append((max_tokens // max(s, t), s, t))
    return int(least[-1]), values[[j for _, j in bands]], shapes


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


# --------------------------------------------------------------------------- loader


_END = object()


class BatchLoader:
    """Collates batches in a background thread, `prefetch` ahead of the training step.

    `epoch=None`: the sampler's endless stream, from its current state. `state_dict()` is
    the sampler's state after the last batch *yielded* (not the last prefetched), so a
    checkpoint taken between steps resumes exactly. `epoch=k`: one pass over the rank's
    batches of epoch k, for validation. While iterating, the loader owns the sampler.
    """

    def __init__(
        self,
        dataset: ShardDataset,
        sampler: TokenBatchSampler,
        *,
        epoch: int | None = None,
        prefetch: int = 2,
        pin_memory: bool = False,
        pad_id: int = PAD,
        bos_id: int = BOS,
    ):
        self.dataset, self.sampler, self.epoch = dataset, sampler, epoch
        self.pin_memory, self.pad_id, self.bos_id = pin_memory, pad_id, bos_id
        self._queue: queue.Queue = queue.Queue(maxsize=prefetch)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._state = sampler.state_dict()

    def state_dict(self) -> dict:
        return dict(self._state)

    @property
    def epochs_done(self) -> float:
        """Passes over the corpus so far (fractional): a pass over this rank's batches of
        shards holding the corpus `copies` times is that many."""
        return self.dataset.copies * self._state["consumed"] / max(self.sampler.batches_per_rank, 1)

    def load_state_dict(self, state: dict) -> None:
        self.close()
        self.sampler.load_state_dict(state)
        self._state = self.sampler.state_dict()

    def __iter__(self) -> Iterator[Batch]:
        self.close()
        if self.epoch is None:  # the producer ran ahead of the consumer: rewind to it
            self.sampler.load_state_dict(self._state)
        self._stop = threading.Event()
        self._queue = queue.Queue(maxsize=self._queue.maxsize)
        self._thread = threading.Thread(target=self._produce, daemon=True, name="BatchLoader")
        self._thread.start()
        try:
            while (item := self._queue.get()) is not _END:
                if isinstance(item, BaseException):
                    raise item
                batch, state = item
                if state is not None:
                    self._state = state
                yield batch
        finally:
            self.close()

    def close(self) -> None:
        """Stop the producer thread (iterating again restarts it from the consumed state)."""
        if self._thread is not None:
            self._stop.set()
            self._thread.join()
            self._thread = None

    def _produce(self) -> None:
        try:
            finite = self.epoch is not None
            source = self.sampler.epoch_batches(self.epoch) if finite else self.sampler
            for indices in source:
                pad_to = self.sampler.padded_shape(indices)
                batch = self.dataset.batch(indices, self.pad_id, self.bos_id, pad_to)
                if self.pin_memory:
                    batch = batch.pin_memory()
                if not self._put((batch, None if finite else self.sampler.state_dict())):
                    return
            self._put(_END)
        except BaseException as err:  # handed to the consumer, raised there
            self._put(err)

    def _put(self, item) -> bool:
        while not self._stop.is_set():
            try:
                self._queue.put(item, timeout=0.05)
                return True
            except queue.Full:
                continue
        return False
