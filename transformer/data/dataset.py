"""One role's shards as examples, and the padded `Batch` that a list of them makes.

    ds = ShardDataset(shards_dir, "train")     # memory-mapped: ids stay in the page cache
    batch = ds.batch([3, 7, 9])                # batch.src, batch.tgt_in, batch.tgt_out

Which examples go together is the sampler's (sampler.py); the loader (loader.py) collates
the sampler's batches through `ShardDataset.batch` in a background thread.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
import pyarrow as pa
import torch

from transformer.data import DataError
from transformer.data.shard import load_manifest
from transformer.files import SPM_MODEL
from transformer.tokens import BOS, EOS, PAD


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
