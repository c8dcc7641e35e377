"""Encode the cleaned corpus with sentencepiece into length-bucketed Arrow shards.

Layout of the output folder (the "shards"):

    manifest.json                       counts, checksums, inputs, the data fingerprint
    spm.model                           the vocabulary the ids belong to
    {train,valid,test}/bKKKK-NNNN.arrow Arrow IPC files, columns id, src, tgt

Bucket k holds the pairs whose longer side, EOS included, has k * bucket_width to
(k + 1) * bucket_width - 1 subwords, so a batch drawn from one bucket wastes little on
padding (paper 5.1: "sentence pairs were batched together by approximate sequence
length"). `id` is the row of the pair in its cleaned parquet file; `src` and `tgt` end
with EOS, and the trainer builds the decoder input as [BOS] + tgt[:-1].

The corpus streams through in chunks of READ_ROWS rows, encoded by a pool of processes
that each load the model once (no more than a role has chunks; none for a corpus of one
chunk a role); only the per-bucket buffers (at most rows_per_shard rows each) sit in
memory. The chunk results come back in order and every file but a bucket's last holds
exactly rows_per_shard rows, so the output is byte-identical for any number of workers,
and the fingerprint names the data, not the run.

BPE-dropout (`src_bpe_dropout` or `tgt_bpe_dropout` > 0; Provilkov et al., 2020) is the
exception: the training split is encoded `copies` times (`id` repeats), the merges of a side
dropped at random at that side's rate, so that the model sees a word split several ways and
learns its pieces' composition. The draws are sentencepiece's, and they cannot be replayed:
with sentencepiece 0.2.3, a seed (`set_random_generator_seed`) repeats them within a
process, not in another process (nor in a forkserver worker), so no seed is offered here.
A rebuild is new data, with a fingerprint of its own; the stage cache, keyed on params,
reuses a finished build as it does any other stage's.

One module past the ~450 lines the library keeps to: the pool, the bucket buffers and the
manifest are one streaming pass, and its promise (the same bytes for any number of
workers) is kept by their order together; split, no file would hold the whole of it.
"""

from __future__ import annotations

import contextlib
import hashlib
import itertools
import json
import logging
import os
import shutil
from collections import defaultdict, deque
from collections.abc import Callable, Iterator
from concurrent.futures import ProcessPoolExecutor
from contextlib import contextmanager
from multiprocessing import get_context
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from transformer.config import ShardConfig, fingerprint, identity, to_dict
from transformer.console import Progress
from transformer.data import ROLES, DataError
from transformer.data.vocab import load_spm
from transformer.files import MANIFEST, SPM_MODEL, atomic_dir, atomic_write, file_sha256
from transformer.tokens import SPECIAL_IDS

log = logging.getLogger(__name__)

FORMAT = "transformer-mt/shards/1"
VERIFIED = ".verified.json"  # hidden: when the checksums were last found right
READ_ROWS = 50_000  # rows per encoding task: large enough to amortise the IPC, small in RAM
SCHEMA = pa.schema(
    [("id", pa.int64()), ("src", pa.list_(pa.int32())), ("tgt", pa.list_(pa.int32()))]
)

# (row id of the first pair, source texts, target texts, (source, target) BPE-dropout rates)
Chunk = tuple[int, pa.Array, pa.Array, tuple[float, float]]
# bucket -> the chunk's pairs that fall in it
Encoded = dict[int, pa.RecordBatch]
# chunks -> their encodings, in order
Encode = Callable[[Iterator[Chunk]], Iterator[Encoded]]


def encode_and_shard(clean_dir: Path, spm_model: Path, cfg: ShardConfig, out_dir: Path) -> dict:
    """Encode `{train,valid,test}.parquet` of `clean_dir` into shards at `out_dir`.

    Built in a temporary folder beside `out_dir` and renamed into place at the end (an
    existing `out_dir` is replaced), so a killed run leaves no `out_dir` to trust.
    Shard files are fsynced as they are written; atomic_dir flushes the top-level ones.
    Returns the manifest.
    """
    clean_dir, spm_model, out_dir = Path(clean_dir), Path(spm_model), Path(out_dir)
    parquets = {role: clean_dir / f"{role}.parquet" for role in ROLES}
    for path in [*parquets.values(), spm_model]:
        if not path.is_file():
            raise DataError(f"{path}: no such file")
    load_spm(spm_model)  # wrong special ids: fail here, not in a worker
    with atomic_dir(out_dir) as tmp:
        shutil.copyfile(spm_model, tmp / SPM_MODEL)
        plain = (1, (0.0, 0.0))  # valid and test: as the decoder sees text
        sampled = (cfg.copies, (cfg.src_bpe_dropout, cfg.tgt_bpe_dropout))
        plans = {role: sampled if role == "train" else plain for role in ROLES}
        rows = {role: pq.ParquetFile(path).metadata.num_rows for role, path in parquets.items()}
        chunks = max(-(-rows[role] // READ_ROWS) * plans[role][0] for role in ROLES)
        with _encoder(tmp / SPM_MODEL, cfg.bucket_width, _n_workers(cfg.workers, chunks)) as encode:
            roles = {}
            for role, path in parquets.items():
                copies, dropout = plans[role]
                roles[role] = _shard_role(
                    path, rows[role] * copies, encode, tmp / role, cfg.rows_per_shard, copies,
                    dropout,
                )  # fmt: skip
        manifest = _manifest(cfg, parquets, tmp / SPM_MODEL, roles)
        (tmp / MANIFEST).write_text(json.dumps(manifest, indent=1), encoding="utf-8")
    return manifest


def verify_shards(out_dir: Path) -> dict:
    """Check that the manifest exists and every file it lists is whole; return it.

    Sizes and row counts are checked every time; sha256 (every byte read) once per folder:
    a hidden stamp of the files' sizes, inodes, and modification and change times records
    that they were verified, and any file written since (the manifest included) makes the
    next call verify again. The change time is the kernel's: a write sets it, and nothing
    but the clock can set it back, so a byte changed with its modification time restored
    is seen too. Raises DataError naming the first bad file.
    """
    out_dir = Path(out_dir)
    manifest = load_manifest(out_dir)
    try:
        entries = [(SPM_MODEL, manifest["spm_model"]["bytes"], manifest["spm_model"]["sha256"])]
        for role in ROLES:
            for e in manifest["roles"][role]["files"]:
                entries.append((e["path"], e["bytes"], e["sha256"], e["rows"]))
    except (KeyError, TypeError) as err:
        raise DataError(f"{out_dir / MANIFEST}: malformed manifest (no {err})") from None
    stamp = _stamp(out_dir, [MANIFEST] + [e[0] for e in entries])
    checksum = _read_stamp(out_dir) != stamp
    for name, size, sha256, *rows in entries:
        _check_size_and_hash(out_dir / name, size, sha256, checksum)
        if rows and _count_rows(out_dir / name) != rows[0]:
            found = _count_rows(out_dir / name)
            raise DataError(f"{out_dir / name}: {found} rows, the manifest says {rows[0]}")
    if checksum:
        with contextlib.suppress(OSError):  # a read-only shards folder verifies every time
            atomic_write(out_dir / VERIFIED, json.dumps(stamp))
    return manifest


def _stamp(out_dir: Path, names: list[str]) -> dict[str, list[int]]:
    stamp = {}
    for name in names:
        try:
            st = (out_dir / name).stat()
        except OSError:
            raise DataError(f"{out_dir / name}: missing") from None
        stamp[name] = [st.st_size, st.st_ino, st.st_mtime_ns, st.st_ctime_ns]
    return stamp


def _read_stamp(out_dir: Path) -> dict | None:
    try:
        return json.loads((out_dir / VERIFIED).read_text())
    except (OSError, ValueError):
        return None


def load_manifest(out_dir: Path) -> dict:
    """The parsed manifest.json of a shards folder; DataError if absent or not ours."""
    path = Path(out_dir) / MANIFEST
    if not path.is_file():
        raise DataError(f"{path}: no manifest (shards never written, or the run was killed)")
    try:
        manifest = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as err:
        raise DataError(f"{path}: unreadable manifest ({err})") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise DataError(f"{path}: not a shards manifest of format {FORMAT}")
    return manifest


# --------------------------------------------------------------------------- encoding


class _ChunkEncoder:
    """Encodes a chunk of pairs and splits it by length bucket."""

    def __init__(self, spm_model: Path, bucket_width: int):
        self.sp = load_spm(spm_model)
        self.bucket_width = bucket_width

    def __call__(self, chunk: Chunk) -> Encoded:
        first_id, src_text, tgt_text, (src_dropout, tgt_dropout) = chunk
        src = self._encode(src_text, src_dropout)
        tgt = self._encode(tgt_text, tgt_dropout)
        longer = np.maximum(np.diff(src.offsets), np.diff(tgt.offsets))
        bucket = longer // self.bucket_width
        order = np.argsort(bucket, kind="stable")  # stable: rows stay in corpus order
        ends = np.flatnonzero(np.diff(bucket[order])) + 1
        out = {}
        for rows in np.split(order, ends):
            take = pa.array(rows)
            ids = pa.array(rows.astype(np.int64) + first_id)
            out[int(bucket[rows[0]])] = pa.record_batch(
                [ids, src.take(take), tgt.take(take)], schema=SCHEMA
            )
        return out

    def _encode(self, texts: pa.Array, dropout: float) -> pa.ListArray:
        # One thread per process: the parallelism is the process pool.
        sampling = {"enable_sampling": True, "alpha": dropout} if dropout else {}
        seqs = self.sp.encode(texts.to_pylist(), add_eos=True, num_threads=1, **sampling)
        # Flattening through numpy is faster than pa.array(list_of_lists), which reads the
        # lists as Python objects (benchmarks/results/2026-11-29-zen3-code-figures/NOTES.md).
        offsets = np.zeros(len(seqs) + 1, dtype=np.int32)
        np.cumsum(np.fromiter(map(len, seqs), np.int32, len(seqs)), out=offsets[1:])
        values = np.fromiter(itertools.chain.from_iterable(seqs), np.int32, int(offsets[-1]))
        return pa.ListArray.from_arrays(pa.array(offsets), pa.array(values))


_WORKER: _ChunkEncoder | None = None


def _init_worker(spm_model: Path, bucket_width: int) -> None:
    global _WORKER
    _WORKER = _ChunkEncoder(spm_model, bucket_width)


def _encode_in_worker(chunk: Chunk) -> Encoded:
    assert _WORKER is not None, "worker not initialised"
    return _WORKER(chunk)


@contextmanager
def _encoder(spm_model: Path, bucket_width: int, workers: int):
    """Yield `encode(chunks) -> iterator of Encoded`, in order, with bounded memory."""
    if workers == 1:
        encoder = _ChunkEncoder(spm_model, bucket_width)
        yield lambda chunks: map(encoder, chunks)
        return
    # forkserver: unlike fork, safe when the caller (a Prefect worker) holds threads and
    # locks; unlike spawn, the caller's main module is imported once, not in every worker.
    with ProcessPoolExecutor(
        workers,
        mp_context=get_context("forkserver"),
        initializer=_init_worker,
        initargs=(spm_model, bucket_width),
    ) as pool:
        yield lambda chunks: _ordered_map(pool, chunks, window=2 * workers)


def _ordered_map(pool: ProcessPoolExecutor, chunks: Iterator[Chunk], window: int):
    # pool.map would read the whole corpus ahead; at most `window` chunks are in flight here.
    pending = deque()
    for chunk in chunks:
        pending.append(pool.submit(_encode_in_worker, chunk))
        if len(pending) >= window:
            yield pending.popleft().result()
    while pending:
        yield pending.popleft().result()


def _n_workers(workers: int, chunks: int) -> int:
    """`workers` (0: the cores), but no more than `chunks`, the most chunks a role has: the
    pool encodes one role at a time, and starting it costs seconds (its forkserver imports
    the caller's main module: under the flow, Prefect, MLflow and torch), so a corpus of one
    chunk a role is encoded in this process."""
    return max(1, min(workers or len(os.sched_getaffinity(0)), chunks))


# --------------------------------------------------------------------------- one role


def _read_chunks(path: Path, copies: int, dropout: tuple[float, float]) -> Iterator[Chunk]:
    """The corpus in chunks, `copies` times over."""
    for _ in range(copies):
        for first, src, tgt in _read_text(path):
            yield first, src, tgt, dropout


def _read_text(path: Path) -> Iterator[tuple[int, pa.Array, pa.Array]]:
    try:
        reader = pq.ParquetFile(path)
        types = [reader.schema_arrow.field(name).type for name in ("src", "tgt")]
    except (pa.ArrowException, OSError, KeyError) as err:
        raise DataError(f"{path}: not a cleaned corpus with src/tgt columns ({err})") from None
    if not all(pa.types.is_string(t) or pa.types.is_large_string(t) for t in types):
        raise DataError(f"{path}: src/tgt must be string columns, not {types}")
    first = 0
    for batch in reader.iter_batches(batch_size=READ_ROWS, columns=["src", "tgt"]):
        src, tgt = batch.column("src"), batch.column("tgt")
        if src.null_count or tgt.null_count:
            nulls = pc.or_(src.is_null(), tgt.is_null()).to_numpy(zero_copy_only=False)
            raise DataError(f"{path}: row {first + int(np.flatnonzero(nulls)[0])} is null")
        yield first, src, tgt
        first += batch.num_rows


def _shard_role(
    parquet: Path,
    rows: int,
    encode: Encode,
    role_dir: Path,
    limit: int,
    copies: int,
    dropout: tuple[float, float],
) -> dict:
    """`parquet`'s `rows` pairs (its copies counted) into shards at `role_dir`."""
    writer = _RoleWriter(role_dir, limit)
    progress = Progress(f"encoding {role_dir.name}", rows, "pairs", log)
    for encoded in encode(_read_chunks(parquet, copies, dropout)):
        for bucket, batch in encoded.items():
            writer.add(bucket, batch)
        progress.update(sum(batch.num_rows for batch in encoded.values()))
    progress.close()
    writer.close()
    summary = _role_summary(writer.files, rows, parquet) | {"copies": copies}
    log.info(
        "sharded %s: %d pairs, %d + %d subwords, %d files",
        role_dir.name,
        summary["rows"],
        summary["src_tokens"],
        summary["tgt_tokens"],
        len(summary["files"]),
    )
    return summary


class _RoleWriter:
    """Buffers pairs per bucket and writes a file every `limit` rows of a bucket."""

    def __init__(self, role_dir: Path, limit: int):
        role_dir.mkdir()
        self.dir = role_dir
        self.limit = limit
        self.pending: dict[int, list[pa.RecordBatch]] = defaultdict(list)
        self.files: list[dict] = []
        self._written = defaultdict(int)  # files per bucket so far

    def add(self, bucket: int, batch: pa.RecordBatch) -> None:
        self.pending[bucket].append(batch)
        if sum(b.num_rows for b in self.pending[bucket]) >= self.limit:
            self._flush(bucket, final=False)

    def close(self) -> None:
        for bucket in sorted(self.pending):
            self._flush(bucket, final=True)
        self.files.sort(key=lambda f: f["path"])

    def _flush(self, bucket: int, final: bool) -> None:
        table = pa.Table.from_batches(self.pending.pop(bucket), schema=SCHEMA)
        while table.num_rows >= self.limit or (final and table.num_rows):
            self._write(bucket, table.slice(0, self.limit))
            table = table.slice(self.limit)
        if table.num_rows:
            self.pending[bucket] = table.to_batches()

    def _write(self, bucket: int, table: pa.Table) -> None:
        name = f"b{bucket:04d}-{self._written[bucket]:04d}.arrow"
        self._written[bucket] += 1
        batch = _compact(table)
        sink = pa.BufferOutputStream()
        with pa.ipc.new_file(sink, SCHEMA) as ipc:
            ipc.write_batch(batch)
        data = sink.getvalue()
        _write_durably(self.dir / name, data)
        src_lens = np.diff(batch.column("src").offsets)
        tgt_lens = np.diff(batch.column("tgt").offsets)
        self.files.append(
            {
                "path": f"{self.dir.name}/{name}",
                "bucket": bucket,
                "rows": batch.num_rows,
                "src_tokens": int(src_lens.sum()),
                "tgt_tokens": int(tgt_lens.sum()),
                "max_len": int(np.maximum(src_lens, tgt_lens).max()),
                "bytes": data.size,
                "sha256": hashlib.sha256(data).hexdigest(),
            }
        )


def _compact(table: pa.Table) -> pa.RecordBatch:
    """The rows as one record batch (a reader then holds one ListArray per column and
    file) on fresh, exact-size buffers: the IPC bytes, hence the checksums, then depend
    only on the rows, not on how chunks were sliced and joined on the way."""
    ids = np.concatenate([c.to_numpy() for c in table.column("id").chunks])
    return pa.record_batch(
        [pa.array(ids), _compact_lists(table.column("src")), _compact_lists(table.column("tgt"))],
        schema=SCHEMA,
    )


def _compact_lists(column: pa.ChunkedArray) -> pa.ListArray:
    lens = np.concatenate([np.diff(c.offsets) for c in column.chunks])
    offsets = np.zeros(len(lens) + 1, dtype=np.int32)
    np.cumsum(lens, out=offsets[1:])
    values = [
        c.values.to_numpy()[c.offsets[0].as_py() : c.offsets[-1].as_py()] for c in column.chunks
    ]
    return pa.ListArray.from_arrays(pa.array(offsets), pa.array(np.concatenate(values)))


def _role_summary(files: list[dict], expected_rows: int, parquet: Path) -> dict:
    rows = sum(f["rows"] for f in files)
    if rows != expected_rows:  # a broken invariant of this module, never bad input
        raise RuntimeError(f"{parquet}: {expected_rows} rows in, {rows} rows sharded")
    buckets: dict[str, dict] = {}
    for f in files:
        b = buckets.setdefault(str(f["bucket"]), {"rows": 0, "src_tokens": 0, "tgt_tokens": 0})
        for key in b:
            b[key] += f[key]
    return {
        "rows": rows,
        "src_tokens": sum(f["src_tokens"] for f in files),
        "tgt_tokens": sum(f["tgt_tokens"] for f in files),
        "max_len": max((f["max_len"] for f in files), default=0),
        "buckets": buckets,
        "files": files,
    }


# --------------------------------------------------------------------------- manifest, files


def _manifest(cfg: ShardConfig, parquets: dict[str, Path], spm_copy: Path, roles: dict) -> dict:
    manifest = {
        "format": FORMAT,
        "config": to_dict(cfg),
        "special_ids": dict(SPECIAL_IDS),
        "inputs": {p.name: file_sha256(p) for p in parquets.values()},
        "spm_model": {"bytes": spm_copy.stat().st_size, "sha256": file_sha256(spm_copy)},
        "roles": roles,
    }
    manifest["inputs"][SPM_MODEL] = manifest["spm_model"]["sha256"]
    # Operational keys (workers) change how fast, never what: not the data's identity.
    manifest["fingerprint"] = fingerprint({**manifest, "config": identity(cfg)})
    return manifest


def _check_size_and_hash(path: Path, size: int, sha256: str, checksum: bool) -> None:
    if not path.is_file():
        raise DataError(f"{path}: missing")
    actual = path.stat().st_size
    if actual != size:
        raise DataError(f"{path}: {actual} bytes, the manifest says {size}")
    if checksum and file_sha256(path) != sha256:
        raise DataError(f"{path}: sha256 differs from the manifest (corrupt file)")


def _count_rows(path: Path) -> int:
    try:
        with pa.memory_map(str(path)) as source:
            reader = pa.ipc.open_file(source)
            return sum(reader.get_batch(i).num_rows for i in range(reader.num_record_batches))
    except pa.ArrowException as err:
        raise DataError(f"{path}: unreadable Arrow file ({err})") from None


def _write_durably(path: Path, data) -> None:
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
