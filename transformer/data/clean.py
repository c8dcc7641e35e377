"""Stage "clean": strip every split, filter the training split.

The filters are those of the usual WMT recipe (Moses' clean-corpus-n.perl: 1..250 tokens
per side, length ratio 1.5), plus optional deduplication. They run vectorised on record
batches with pyarrow.compute, so WMT14's 4.5M pairs stream through in bounded memory.
Tokens are whitespace tokens of the raw (untokenized) text. With `clean.lowercase` every
split is lowercased, both sides, so the vocabulary, the shards and the references agree.
"""

from __future__ import annotations

import hashlib
import json
import logging
from collections import Counter
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from transformer.config import CleanConfig
from transformer.console import Progress
from transformer.data import ROLES, DataError
from transformer.data.sources import SCHEMA, read_batches
from transformer.files import CLEAN_REPORT, PREPARE_REPORT, atomic_dir

log = logging.getLogger(__name__)

COUNTS = (
    "read",
    "kept",
    "dropped_empty",
    "dropped_too_short",
    "dropped_too_long",
    "dropped_ratio",
    "dropped_duplicate",
)


def clean_corpus(in_dir: Path, cfg: CleanConfig, out_dir: Path) -> dict:
    """Write `out_dir/{train,valid,test}.parquet` and `out_dir/clean.json`; return the latter:
    {role: {count name: number}} with the names of COUNTS."""
    in_dir, out_dir = Path(in_dir), Path(out_dir)
    report = {}
    with atomic_dir(out_dir) as tmp:
        for role in ROLES:
            source = in_dir / f"{role}.parquet"
            if not source.is_file():
                raise DataError(f"{source}: no such file (run the prepare stage first)")
            # Only the training data is filtered: valid and test are scored as the official
            # sets, line for line (newstest2014 has 3,003 lines), so every pair stays, even an
            # empty one (kept as empty strings); they are only stripped of outer whitespace.
            train_cfg = cfg if role == "train" else None
            counts = _clean_file(source, tmp / f"{role}.parquet", train_cfg, cfg.lowercase)
            if role == "train" and counts["kept"] == 0:
                dropped = ", ".join(f"{k} {v}" for k, v in counts.items() if v and k != "read")
                raise DataError(
                    f"{_origin(in_dir)}: all {counts['read']} training pairs were dropped "
                    f"({dropped}): check the data, or clean.*"
                )
            report[role] = counts
            log.info("cleaned %s: %s", role, ", ".join(f"{k} {v}" for k, v in counts.items()))
        (tmp / CLEAN_REPORT).write_text(json.dumps(report, indent=2) + "\n")
    return report


def _origin(in_dir: Path) -> str:
    """Where the prepared training data came from, for messages (prepare.json says)."""
    try:
        report = json.loads((in_dir / PREPARE_REPORT).read_text())
        return f"{report['source']['path']} (split {report['splits']['train']!r})"
    except (OSError, ValueError, KeyError, TypeError):
        return str(in_dir / "train.parquet")


def _clean_file(
    source: Path, dest: Path, cfg: CleanConfig | None, lowercase: bool
) -> dict[str, int]:
    counts = Counter(dict.fromkeys(COUNTS, 0))
    seen = SeenHashes() if cfg is not None and cfg.dedup else None
    with pq.ParquetWriter(dest, SCHEMA) as writer:
        progress = Progress(f"cleaning {source.stem}", pq.ParquetFile(source).metadata.num_rows,
                            "pairs", log)  # fmt: skip
        for batch in read_batches(source):
            progress.update(batch.num_rows)
            src = pc.utf8_trim_whitespace(batch.column("src").cast(pa.string()))
            tgt = pc.utf8_trim_whitespace(batch.column("tgt").cast(pa.string()))
            if lowercase:
                src, tgt = pc.utf8_lower(src), pc.utf8_lower(tgt)
            counts["read"] += len(src)
            if cfg is not None:
                keep = filter_mask(src, tgt, cfg, seen, counts)
                src, tgt = src.filter(keep), tgt.filter(keep)
            counts["kept"] += len(src)
            writer.write_batch(pa.RecordBatch.from_arrays([src, tgt], schema=SCHEMA))
        progress.close()
    return dict(counts)


def filter_mask(
    src: pa.Array, tgt: pa.Array, cfg: CleanConfig, seen: SeenHashes | None, counts: Counter
) -> pa.Array:
    """Which stripped pairs to keep; each dropped pair is counted under its first reason
    (so a test like the ratio only ever sees pairs that passed the ones before it)."""
    n_src, n_tgt = token_counts(src), token_counts(tgt)
    shorter, longer = np.minimum(n_src, n_tgt), np.maximum(n_src, n_tgt)
    keep = np.ones(len(n_src), dtype=bool)
    reasons = (
        ("dropped_empty", shorter == 0),
        ("dropped_too_short", shorter < cfg.min_len),
        ("dropped_too_long", longer > cfg.max_len),
        # As clean-corpus-n.perl: drop when longer / shorter > max_ratio.
        ("dropped_ratio", longer > cfg.max_ratio * shorter),
    )
    for name, drop in reasons:
        drop &= keep
        counts[name] += int(drop.sum())
        keep &= ~drop
    if seen is not None:
        first = np.zeros_like(keep)
        first[keep] = seen.first_time(pair_hashes(src.filter(keep), tgt.filter(keep)))
        counts["dropped_duplicate"] += int(keep.sum() - first.sum())
        keep = first
    return pa.array(keep)


def token_counts(text: pa.Array) -> np.ndarray:
    """Whitespace tokens per (stripped) string; 0 for the empty string."""
    n = pc.list_value_length(pc.utf8_split_whitespace(text)).to_numpy(zero_copy_only=False)
    # Splitting "" gives [""]: one (empty) token, which is none.
    return np.where(pc.binary_length(text).to_numpy(zero_copy_only=False) == 0, 0, n)


def pair_hashes(src: pa.Array, tgt: pa.Array) -> np.ndarray:
    """A stable 64-bit hash per pair (blake2b), so dedup keeps the same pairs on every run."""
    # 0xFF never occurs in UTF-8: "a" + "bc" and "ab" + "c" cannot join to the same bytes.
    joined = pc.binary_join_element_wise(src.cast(pa.binary()), tgt.cast(pa.binary()), b"\xff")
    digests = b"".join(hashlib.blake2b(v, digest_size=8).digest() for v in joined.to_pylist())
    return np.frombuffer(digests, dtype="<u8")


class SeenHashes:
    """The set of pair hashes seen so far, as one sorted array (8 bytes per pair: WMT14's
    4.5M pairs take 36 MB, a Python set of ints about eight times that)."""

    def __init__(self) -> None:
        self.sorted = np.empty(0, dtype=np.uint64)

    def first_time(self, hashes: np.ndarray) -> np.ndarray:
        """True where a hash occurs for the first time (earlier batches and this one)."""
        unique, first = np.unique(hashes, return_index=True)  # index of first occurrence
        pos = np.searchsorted(self.sorted, unique)
        known = np.zeros(len(unique), dtype=bool)
        inside = pos < len(self.sorted)
        known[inside] = self.sorted[pos[inside]] == unique[inside]
        self.sorted = np.insert(self.sorted, pos[~known], unique[~known])
        mask = np.zeros(len(hashes), dtype=bool)
        mask[first[~known]] = True
        return mask
