"""Stage "prepare": a source's train/valid/test splits as parquet files of `src`, `tgt`.

A source is either the Hugging Face hub dataset of the paper's data (`wmt/wmt14`, config
`de-en`, at a pinned revision) or a local folder: plain-text parallel files `{split}.{lang}`
(gzip allowed), or `{split}.parquet` / `{split}.jsonl` in the hub's schema, a `translation`
column of {lang: text} dicts. Every kind ends in the same stream of record batches, and the
hub and parquet/jsonl kinds share one schema function, `translation_batches`. Everything
streams in batches: WMT14's 4.5M pairs never sit whole in memory.

One module past the ~450 lines the library keeps to: every reader ends in the one schema
and shares the bounded reading (line length, gzip damage, JSON depth) that makes a bad file
one line naming it; the bounds in one place are what keeps each reader honest.
"""

from __future__ import annotations

import gzip
import json
import logging
import re
import stat
import time
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from itertools import zip_longest
from pathlib import Path
from typing import IO, Any

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.json as pa_json
import pyarrow.parquet as pq

from transformer.config import DataConfig, SourceConfig
from transformer.data import ROLES, DataError
from transformer.files import PREPARE_REPORT, atomic_dir, file_sha256, gzip_damage

log = logging.getLogger(__name__)

BATCH_ROWS = 65_536  # pairs per record batch: large enough for vectorised ops, small in RAM
SCHEMA = pa.schema([("src", pa.string()), ("tgt", pa.string())])
PROGRESS_ROWS = 1_000_000  # a log line per million pairs read
# A line of a text source is a sentence (clean.max_len bounds the training split's at 250
# words): one of more than a MiB is no sentence, and is refused as it is read, never held.
MAX_LINE_BYTES = 1 << 20
HUB_ATTEMPTS = 3
HUB_BACKOFF_S = 10.0  # doubled after each failed attempt
OFFLINE_HINT = (
    "Without access to the hub, set data.source.path to a local copy (text files, or "
    "parquet/jsonl in the hub's 'translation' schema), or set HF_HUB_OFFLINE=1 with the "
    "dataset already in the Hugging Face cache (HF_HOME / HF_DATASETS_CACHE)."
)


@dataclass
class InvalidPolicy:
    """What to do with a bad pair (invalid UTF-8, missing text): stop, or drop and count."""

    mode: str  # DataConfig.on_invalid: "error" | "drop"
    dropped: int = 0

    def reject(self, message: str) -> None:
        if self.mode == "error":
            raise DataError(message)
        if self.dropped == 0:
            log.warning("dropping bad pairs (data.on_invalid=drop); first: %s", message)
        self.dropped += 1


# --------------------------------------------------------------------------- the stage


def prepare_source(cfg: DataConfig, out_dir: Path) -> dict:
    """Write `out_dir/{train,valid,test}.parquet` and `out_dir/prepare.json`; return the latter.

    prepare.json: the source, languages, split names, input fingerprints, and
    counts = {role: {"pairs": rows written, "dropped_invalid": bad pairs dropped}}.
    """
    out_dir = Path(out_dir)
    manifest: dict[str, Any] = {
        "source": _describe_source(cfg.source),
        "src_lang": cfg.src_lang,
        "tgt_lang": cfg.tgt_lang,
        "splits": {role: getattr(cfg.splits, role) for role in ROLES},
        "fingerprints": input_fingerprints(cfg),
        "counts": {},
    }
    with atomic_dir(out_dir) as tmp:
        for role in ROLES:
            split = getattr(cfg.splits, role)
            invalid = InvalidPolicy(cfg.on_invalid)
            rows = write_pairs(split_batches(cfg, split, invalid), tmp / f"{role}.parquet")
            if rows == 0:  # nothing to learn from, or to score: never a finished stage
                raise DataError(
                    f"{_split_name(cfg, split)}: no {role} pairs (empty, or all invalid)"
                )
            manifest["counts"][role] = {"pairs": rows, "dropped_invalid": invalid.dropped}
            log.info(
                "prepared %s (split %r): %d pairs, %d dropped", role, split, rows, invalid.dropped
            )
        (tmp / PREPARE_REPORT).write_text(json.dumps(manifest, indent=2) + "\n")
    return manifest


def input_fingerprints(cfg: DataConfig) -> dict[str, str]:
    """What identifies the input: the hub repo at its revision, or sha256 of each local file."""
    source = cfg.source
    if source.hub is not None:
        return {"hub": source.hub, "config": source.config, "revision": source.revision}
    return {path.name: file_sha256(path) for path in _local_files(cfg)}


def split_batches(cfg: DataConfig, split: str, invalid: InvalidPolicy) -> Iterator[pa.RecordBatch]:
    """One split of the configured source as record batches of `src`, `tgt` (in line order)."""
    source = cfg.source
    if source.hub is not None:
        dataset = load_hub_split(source, split)
        return dataset_batches(
            dataset, cfg.src_lang, cfg.tgt_lang, f"{source.hub}:{split}", invalid
        )
    root = _local_root(source)
    if source.format == "text":
        src_path = _text_file(root, split, cfg.src_lang)
        tgt_path = _text_file(root, split, cfg.tgt_lang)
        return text_batches(src_path, tgt_path, invalid)
    path = _required(root / f"{split}.{source.format}")
    if source.format == "parquet":
        tables = read_batches(path, ["translation"])
    else:
        tables = _jsonl_tables(path)
    return translation_batches(tables, cfg.src_lang, cfg.tgt_lang, str(path), invalid)


def read_batches(path: Path, columns: list[str] | None = None) -> Iterator[pa.RecordBatch]:
    """A parquet file's record batches, one row group at a time."""
    # Row group by row group rather than ParquetFile.iter_batches, whose buffers grew with
    # the file in our measurements (pyarrow 25); a row group is bounded by its writer.
    try:
        parquet = pq.ParquetFile(path)
        for i in range(parquet.metadata.num_row_groups):
            yield from parquet.read_row_group(i, columns=columns).to_batches()
    except (pa.ArrowException, OSError) as err:  # not parquet, truncated, a damaged page
        raise DataError(f"{path}: not a readable parquet file ({_first_line(err)})") from None


def _first_line(err: Exception) -> str:
    return str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__


def write_pairs(batches: Iterable[pa.RecordBatch], path: Path) -> int:
    """Stream batches into one parquet file of SCHEMA; return the number of rows."""
    rows = 0
    with pq.ParquetWriter(path, SCHEMA) as writer:
        for batch in batches:
            writer.write_batch(batch)
            if (rows + batch.num_rows) // PROGRESS_ROWS > rows // PROGRESS_ROWS:  # a big corpus
                log.info("%s: %s pairs so far", path.stem, f"{rows + batch.num_rows:,}")
            rows += batch.num_rows
    return rows


# --------------------------------------------------------------------------- hub and schema


def load_hub_split(source: SourceConfig, split: str):
    """`datasets.load_dataset` at the pinned revision, retried with backoff on network errors."""
    import datasets  # a heavy import that only the hub path needs

    what = (
        f"the Hugging Face dataset {source.hub!r} (config {source.config!r}, "
        f"revision {source.revision}, split {split!r})"
    )
    # Offline mode fails the same way every time: retrying would only delay the error.
    attempts = 1 if datasets.config.HF_HUB_OFFLINE else HUB_ATTEMPTS
    for attempt in range(1, attempts + 1):
        try:
            return datasets.load_dataset(
                source.hub, source.config, revision=source.revision, split=split
            )
        except (FileNotFoundError, ValueError) as err:  # no such repo, config, revision, split
            raise DataError(f"{what} was not found: {err}") from err
        except OSError as err:  # ConnectionError, HfHubHTTPError, timeouts
            if attempt == attempts:
                raise DataError(
                    f"cannot load {what} after {attempts} attempt(s): {err}. {OFFLINE_HINT}"
                ) from err
            wait = HUB_BACKOFF_S * 2 ** (attempt - 1)
            log.warning(
                "hub %s attempt %d failed (%s); retry in %.0f s", source.hub, attempt, err, wait
            )
            time.sleep(wait)
    raise AssertionError("unreachable")


def dataset_batches(
    dataset, src_lang: str, tgt_lang: str, where: str, invalid: InvalidPolicy
) -> Iterator[pa.RecordBatch]:
    """A `datasets.Dataset` in the hub schema as `src`/`tgt` batches (memory-mapped, streamed)."""
    tables = dataset.with_format("arrow").iter(batch_size=BATCH_ROWS)
    return translation_batches(tables, src_lang, tgt_lang, where, invalid)


def translation_batches(
    tables: Iterable[pa.Table | pa.RecordBatch],
    src_lang: str,
    tgt_lang: str,
    where: str,
    invalid: InvalidPolicy,
) -> Iterator[pa.RecordBatch]:
    """The hub schema (`translation`: {lang: text}) to `src`/`tgt` string batches.

    Shared by the hub path and local parquet/jsonl files, so a local stand-in tests the hub's
    schema handling. `where` names the input in errors; rows are numbered from 1.
    """
    offset = 0
    for table in tables:
        column = _translation_column(table, where, (src_lang, tgt_lang))
        # pc.struct_field (unlike StructArray.field) keeps a null dict's null: missing text.
        src = _as_string(pc.struct_field(column, src_lang))
        tgt = _as_string(pc.struct_field(column, tgt_lang))
        batch = pa.RecordBatch.from_arrays([src, tgt], schema=SCHEMA)
        yield _drop_bad_rows(batch, where, offset, invalid)
        offset += len(column)


def _translation_column(table: pa.Table | pa.RecordBatch, where: str, langs) -> pa.Array:
    if "translation" not in table.column_names:
        raise DataError(f"{where}: no 'translation' column (columns: {table.column_names})")
    column = table.column("translation")
    if isinstance(column, pa.ChunkedArray):
        column = column.combine_chunks()
    if not pa.types.is_struct(column.type):
        raise DataError(f"{where}: 'translation' must hold {{lang: text}} dicts, not {column.type}")
    fields = [column.type.field(i).name for i in range(column.type.num_fields)]
    for lang in langs:
        if lang not in fields:
            raise DataError(f"{where}: 'translation' has no {lang!r} text (languages: {fields})")
    return column


def _as_string(array: pa.Array) -> pa.Array:
    # The hub's files may use large_string; the output schema is one type for every source.
    return array.cast(pa.string()) if array.type != pa.string() else array


def _drop_bad_rows(
    batch: pa.RecordBatch, where: str, offset: int, invalid: InvalidPolicy
) -> pa.RecordBatch:
    """Reject rows with missing text or invalid UTF-8 (parquet does not validate strings)."""
    bad = {}
    for name in SCHEMA.names:
        column = batch.column(name)
        for i in _null_rows(column):
            bad.setdefault(i, f"{where}: row {offset + i + 1}: no {name} text")
        for i in _invalid_utf8_rows(column):
            bad.setdefault(i, f"{where}: row {offset + i + 1}: invalid UTF-8 in {name}")
    if not bad:
        return batch
    for i in sorted(bad):
        invalid.reject(bad[i])
    keep = [i not in bad for i in range(batch.num_rows)]
    return batch.filter(pa.array(keep))


def _null_rows(column: pa.Array) -> list[int]:
    if column.null_count == 0:
        return []
    return pc.indices_nonzero(column.is_null()).to_pylist()


def _invalid_utf8_rows(column: pa.Array) -> list[int]:
    try:
        column.validate(full=True)  # checks UTF-8 in C++; the slow scan below only on failure
        return []
    except pa.ArrowInvalid:
        raw = column.cast(pa.binary()).to_pylist()
        return [i for i, value in enumerate(raw) if value is not None and not _is_utf8(value)]


def _is_utf8(value: bytes) -> bool:
    try:
        value.decode("utf-8")
    except UnicodeDecodeError:
        return False
    return True


def _jsonl_tables(path: Path) -> Iterator[pa.RecordBatch]:
    # Streams blocks of lines; the `translation` struct type is inferred from the first one.
    _check_depth(path)
    try:
        with pa_json.open_json(path) as reader:
            yield from reader
    except pa.ArrowInvalid as err:
        raise DataError(f"{path}: not valid JSON lines: {err}") from None


# The hub's schema nests two deep ({"translation": {"en": ...}}). Arrow's JSON reader
# recurses once a level on the C stack: a line nested 100k deep overflows it, and the
# process dies (SIGSEGV) with no error. Lines are checked first, in Python.
MAX_JSON_DEPTH = 64
_JSON_STRING = re.compile(rb'"(?:[^"\\]|\\.)*"')
_JSON_BRACKET = re.compile(rb"[\[\]{}]")


def _check_depth(path: Path) -> None:
    """DataError naming the first line of `path` nested deeper than MAX_JSON_DEPTH."""
    with _lines(path) as lines:
        for number, line in enumerate(lines, 1):
            # Few brackets cannot nest deep (the common case, counted in C); else count.
            if line.count(b"[") + line.count(b"{") > MAX_JSON_DEPTH and _too_deep(line):
                raise DataError(f"{path}: line {number}: JSON nested more than "
                                f"{MAX_JSON_DEPTH} deep: no translation pair")  # fmt: skip


def _too_deep(line: bytes) -> bool:
    """Whether the brackets of `line`, outside its strings, nest past MAX_JSON_DEPTH."""
    depth = 0
    for bracket in _JSON_BRACKET.findall(_JSON_STRING.sub(b"", line)):
        depth += 1 if bracket in b"[{" else -1
        if depth > MAX_JSON_DEPTH:
            return True
    return False


# --------------------------------------------------------------------------- plain text


def text_batches(
    src_path: Path, tgt_path: Path, invalid: InvalidPolicy
) -> Iterator[pa.RecordBatch]:
    """Two line-aligned text files (optionally gzipped) as `src`/`tgt` batches.

    Lines are split on b"\\n" only (never on Unicode line separators, which `str.splitlines`
    would honour and which would misalign the two sides); a trailing "\\r" is removed.
    """
    src_lines: list[bytes] = []
    tgt_lines: list[bytes] = []
    first_line = 1
    with _lines(src_path) as src_file, _lines(tgt_path) as tgt_file:
        for src, tgt in zip_longest(src_file, tgt_file):
            if src is None or tgt is None:
                n = first_line + len(src_lines)  # the line number the shorter file lacks
                _raise_mismatch(src_path, tgt_path, src_file, tgt_file, n, src is None)
            src_lines.append(src)
            tgt_lines.append(tgt)
            if len(src_lines) == BATCH_ROWS:
                yield _text_batch(src_lines, tgt_lines, (src_path, tgt_path), first_line, invalid)
                first_line += len(src_lines)
                src_lines, tgt_lines = [], []
    if src_lines:
        yield _text_batch(src_lines, tgt_lines, (src_path, tgt_path), first_line, invalid)


def _raise_mismatch(
    src_path: Path, tgt_path: Path, src_file: IO, tgt_file: IO, n: int, src_ended: bool
) -> None:
    # Count the rest of the longer file, so that the message gives both real line counts.
    longer = tgt_file if src_ended else src_file
    longer_count = n + sum(1 for _ in longer)
    src_count, tgt_count = (n - 1, longer_count) if src_ended else (longer_count, n - 1)
    shorter = src_path if src_ended else tgt_path
    raise DataError(
        f"parallel files differ in length: {src_path} has {src_count} lines, "
        f"{tgt_path} has {tgt_count} lines ({shorter} ends after line {n - 1})"
    )


def _text_batch(
    src_lines: list[bytes],
    tgt_lines: list[bytes],
    paths: tuple[Path, Path],
    first_line: int,
    invalid: InvalidPolicy,
) -> pa.RecordBatch:
    # A zero-copy string view of the bytes; validate() then finds invalid UTF-8 in C++.
    columns = [
        pa.array(lines, type=pa.binary()).view(pa.string()) for lines in (src_lines, tgt_lines)
    ]
    bad = {}
    for column, path in zip(columns, paths, strict=True):
        for i in _invalid_utf8_rows(column):
            bad.setdefault(i, f"{path}: line {first_line + i}: invalid UTF-8")
    if bad:
        for i in sorted(bad):
            invalid.reject(bad[i])
        keep = pa.array([i not in bad for i in range(len(src_lines))])
        columns = [column.filter(keep) for column in columns]
    arrays = [pc.utf8_rtrim(column, characters="\r\n") for column in columns]
    return pa.RecordBatch.from_arrays(arrays, schema=SCHEMA)


@contextmanager
def _lines(path: Path) -> Iterator[Iterator[bytes]]:
    """The file's lines (gzip allowed); a truncated or corrupt gzip file is a DataError
    naming it, wherever in the file the damage is."""

    def read(f: IO[bytes]) -> Iterator[bytes]:
        number = 0
        with gzip_damage(path, DataError):
            while line := f.readline(MAX_LINE_BYTES + 1):  # never more than the bound held
                number += 1
                if len(line) > MAX_LINE_BYTES:
                    limit = f"{MAX_LINE_BYTES:,}"
                    raise DataError(
                        f"{path}: line {number}: longer than {limit} bytes: no sentence"
                    )
                yield line

    with gzip.open(path, "rb") if path.suffix == ".gz" else open(path, "rb") as f:
        yield read(f)


# --------------------------------------------------------------------------- local files


def _local_root(source: SourceConfig) -> Path:
    # Relative paths are relative to the current directory (where the pipeline was started).
    root = Path(source.path).expanduser().resolve()
    if not root.is_dir():
        raise DataError(f"{root}: data.source.path is not a directory")
    return root


def _text_file(root: Path, split: str, lang: str) -> Path:
    plain = root / f"{split}.{lang}"
    gzipped = root / f"{split}.{lang}.gz"
    for path in (plain, gzipped):
        if _is_file(path):
            return path
    raise DataError(f"{plain}: no such file (nor {gzipped.name})")


def _required(path: Path) -> Path:
    if not _is_file(path):
        raise DataError(f"{path}: no such file")
    return path


def _is_file(path: Path) -> bool:
    """Whether a regular file is at `path` (False: nothing); anything else there, a folder
    or a FIFO (whose reading would wait for a writer), is a DataError naming it."""
    try:
        mode = path.stat().st_mode
    except FileNotFoundError:
        return False
    except OSError as err:
        raise DataError(f"{path}: cannot read: {err.strerror}") from None
    if not stat.S_ISREG(mode):
        kind = "a folder" if stat.S_ISDIR(mode) else "not a regular file"
        raise DataError(f"{path}: {kind}, where a data file should be")
    return True


def _local_files(cfg: DataConfig) -> list[Path]:
    return [path for role in ROLES for path in split_files(cfg, getattr(cfg.splits, role))]


def split_files(cfg: DataConfig, split: str) -> list[Path]:
    """The local files of one split: the source side's and the target side's text files, or
    its one parquet/jsonl file; a DataError names the first that is missing."""
    root = _local_root(cfg.source)
    if cfg.source.format == "text":
        return [_text_file(root, split, cfg.src_lang), _text_file(root, split, cfg.tgt_lang)]
    return [_required(root / f"{split}.{cfg.source.format}")]


def _split_name(cfg: DataConfig, split: str) -> str:
    """Where a split comes from, for messages: its file(s), or the hub dataset."""
    source = cfg.source
    if source.hub is not None:
        return f"{source.hub}:{split}"
    root = _local_root(source)
    if source.format == "text":
        return f"{_text_file(root, split, cfg.src_lang)} (and .{cfg.tgt_lang})"
    return str(root / f"{split}.{source.format}")


def _describe_source(source: SourceConfig) -> dict[str, Any]:
    if source.hub is not None:
        return {"hub": source.hub, "config": source.config, "revision": source.revision}
    return {"path": str(_local_root(source)), "format": source.format}
