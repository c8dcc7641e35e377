"""Encode + shard: ids decode back to the text, counts add up, writes are atomic, and
verify_shards catches damaged files."""

import json
import random
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import sentencepiece as spm

from transformer.config import ShardConfig
from transformer.data import DataError, shard
from transformer.data.shard import VERIFIED, encode_and_shard, verify_shards
from transformer.tokens import EOS, PAD

WORDS_EN = [
    "the",
    "a",
    "man",
    "woman",
    "dog",
    "runs",
    "walks",
    "in",
    "park",
    "street",
    "red",
    "blue",
    "big",
    "small",
    "child",
    "plays",
]
WORDS_DE = [
    "der",
    "die",
    "das",
    "mann",
    "frau",
    "hund",
    "rennt",
    "geht",
    "im",
    "park",
    "strasse",
    "rot",
    "blau",
    "gross",
    "klein",
]


def _sentences(words: list[str], n: int, rng: random.Random) -> list[str]:
    # Lengths 0..40 words spread the pairs over several length buckets.
    return [" ".join(rng.choices(words, k=rng.randint(1, 40))) for _ in range(n)]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> tuple[Path, Path]:
    """A cleaned corpus (train 300, valid 40 with an empty line, test 30) and its spm.model."""
    root = tmp_path_factory.mktemp("corpus")
    rng = random.Random(0)
    clean = root / "clean"
    clean.mkdir()
    for role, n in [("train", 300), ("valid", 40), ("test", 30)]:
        src, tgt = _sentences(WORDS_EN, n, rng), _sentences(WORDS_DE, n, rng)
        if role == "valid":
            src[5] = ""  # valid/test are never filtered: an empty line must survive
        pq.write_table(pa.table({"src": src, "tgt": tgt}), clean / f"{role}.parquet")
    text = root / "text.txt"
    lines = [*_sentences(WORDS_EN, 500, rng), *_sentences(WORDS_DE, 500, rng)]
    text.write_text("\n".join(lines))
    spm.SentencePieceTrainer.train(
        input=str(text),
        model_prefix=str(root / "spm"),
        vocab_size=120,
        model_type="bpe",
        pad_id=0,
        unk_id=1,
        bos_id=2,
        eos_id=3,
        minloglevel=2,
    )
    return clean, root / "spm.model"


CFG = ShardConfig(bucket_width=8, rows_per_shard=40, workers=1)


@pytest.fixture(scope="module")
def shards(corpus, tmp_path_factory) -> Path:
    clean, model = corpus
    out = tmp_path_factory.mktemp("shards") / "shards"
    encode_and_shard(clean, model, CFG, out)
    return out


def _read(path: Path) -> pa.Table:
    return pa.ipc.open_file(pa.memory_map(str(path))).read_all()


def _rows(shards: Path, role: str) -> dict[int, tuple[list[int], list[int], str]]:
    """id -> (src ids, tgt ids, file name) over all of a role's files."""
    out = {}
    for path in sorted((shards / role).glob("*.arrow")):
        t = _read(path).to_pydict()
        for i, s, g in zip(t["id"], t["src"], t["tgt"], strict=True):
            out[i] = (s, g, path.name)
    return out


def test_round_trip_decodes_to_the_text(corpus, shards):
    clean, model = corpus
    sp = spm.SentencePieceProcessor(model_file=str(model))
    for role in ("train", "valid", "test"):
        table = pq.read_table(clean / f"{role}.parquet").to_pydict()
        rows = _rows(shards, role)
        assert sorted(rows) == list(range(len(table["src"])))  # every row once, ids = rows
        for i, (src, tgt, _) in rows.items():
            assert src[-1] == EOS and tgt[-1] == EOS and EOS not in src[:-1] + tgt[:-1]
            assert sp.decode(src[:-1]) == table["src"][i]
            assert sp.decode(tgt[:-1]) == table["tgt"][i]
    assert _rows(shards, "valid")[5][0] == [EOS]  # the empty source line


def test_files_are_bucketed_by_the_longer_side(shards):
    manifest = json.loads((shards / "manifest.json").read_text())
    for role, summary in manifest["roles"].items():
        per_bucket: dict[int, list[int]] = {}
        for entry in summary["files"]:
            bucket = entry["bucket"]
            assert (
                entry["path"] == f"{role}/b{bucket:04d}-{len(per_bucket.get(bucket, [])):04d}.arrow"
            )
            per_bucket.setdefault(bucket, []).append(entry["rows"])
            t = _read(shards / entry["path"]).to_pydict()
            longer = [max(len(s), len(g)) for s, g in zip(t["src"], t["tgt"], strict=True)]
            assert all(bucket * 8 <= n < (bucket + 1) * 8 for n in longer)
            assert t["id"] == sorted(t["id"])  # corpus order inside a file
        for counts in per_bucket.values():  # full files, then the remainder
            assert all(c == CFG.rows_per_shard for c in counts[:-1])
            assert 0 < counts[-1] <= CFG.rows_per_shard


def test_manifest_counts_and_inputs(corpus, shards):
    _, model = corpus
    manifest = json.loads((shards / "manifest.json").read_text())
    assert manifest["special_ids"] == {"pad": 0, "unk": 1, "bos": 2, "eos": 3}
    assert manifest["config"] == {
        "bucket_width": 8,
        "rows_per_shard": 40,
        "workers": 1,
        "src_bpe_dropout": 0.0,
        "tgt_bpe_dropout": 0.0,
        "copies": 1,
    }
    assert manifest["inputs"]["spm.model"] == manifest["spm_model"]["sha256"]
    assert (shards / "spm.model").read_bytes() == model.read_bytes()
    for role, n in [("train", 300), ("valid", 40), ("test", 30)]:
        summary = manifest["roles"][role]
        rows = _rows(shards, role)
        assert summary["rows"] == n == len(rows)
        assert summary["src_tokens"] == sum(len(s) for s, _, _ in rows.values())
        assert summary["tgt_tokens"] == sum(len(g) for _, g, _ in rows.values())
        assert summary["max_len"] == max(max(len(s), len(g)) for s, g, _ in rows.values())
        assert sum(b["rows"] for b in summary["buckets"].values()) == n
        for entry in summary["files"]:
            assert entry["bytes"] == (shards / entry["path"]).stat().st_size
    assert verify_shards(shards)["fingerprint"] == manifest["fingerprint"]


def test_output_is_the_same_for_any_workers_and_chunking(corpus, shards, tmp_path, monkeypatch):
    clean, model = corpus
    monkeypatch.setattr(shard, "READ_ROWS", 37)  # chunks that split buckets unevenly
    other = encode_and_shard(clean, model, CFG.model_copy(update={"workers": 2}), tmp_path / "o")
    first = json.loads((shards / "manifest.json").read_text())
    assert other["fingerprint"] == first["fingerprint"]
    assert other["roles"] == first["roles"]  # byte-identical files (same sha256)
    assert other["config"]["workers"] == 2  # recorded, but not part of the fingerprint


@pytest.mark.parametrize(("read_rows", "pool"), [(100, 3), (100_000, None)])
def test_no_more_workers_start_than_a_role_has_chunks(
    corpus, tmp_path, monkeypatch, read_rows, pool
):
    """Starting a worker costs seconds (it imports the caller's main module): a corpus of one
    chunk a role (300 rows here) is encoded in this process."""
    clean, model = corpus
    monkeypatch.setattr(shard, "READ_ROWS", read_rows)
    started = []
    real = shard.ProcessPoolExecutor
    monkeypatch.setattr(
        shard, "ProcessPoolExecutor", lambda n, **kw: started.append(n) or real(n, **kw)
    )
    encode_and_shard(clean, model, CFG.model_copy(update={"workers": 8}), tmp_path / "o")
    assert started == ([pool] if pool else [])


def test_a_failure_leaves_no_output_and_keeps_the_old_one(corpus, tmp_path, monkeypatch):
    clean, model = corpus
    out = tmp_path / "shards"
    real_write = shard._RoleWriter._write
    calls = []

    def failing_write(self, bucket, table):
        calls.append(bucket)
        if len(calls) == 3:
            raise OSError("disk full")
        real_write(self, bucket, table)

    monkeypatch.setattr(shard._RoleWriter, "_write", failing_write)
    with pytest.raises(OSError, match="disk full"):
        encode_and_shard(clean, model, CFG, out)
    assert list(tmp_path.iterdir()) == []  # neither out nor a half-written temp folder

    monkeypatch.setattr(shard._RoleWriter, "_write", real_write)
    fingerprint = encode_and_shard(clean, model, CFG, out)["fingerprint"]
    calls.clear()
    monkeypatch.setattr(shard._RoleWriter, "_write", failing_write)
    with pytest.raises(OSError):
        encode_and_shard(clean, model, CFG.model_copy(update={"bucket_width": 4}), out)
    assert verify_shards(out)["fingerprint"] == fingerprint
    assert [p.name for p in tmp_path.iterdir()] == ["shards"]


def _copy(src: Path, dst: Path) -> Path:
    dst.mkdir()
    for path in src.rglob("*"):
        target = dst / path.relative_to(src)
        if path.is_dir():
            target.mkdir()
        else:
            target.write_bytes(path.read_bytes())
    return dst


def test_verify_names_a_corrupt_or_truncated_file_and_checksums_once(shards, tmp_path):
    damaged = _copy(shards, tmp_path / "flip")
    verify_shards(damaged)  # checksums read once, then stamped
    stamp = damaged / VERIFIED
    assert stamp.is_file()
    victim = damaged / "train" / "b0002-0000.arrow"
    data = bytearray(victim.read_bytes())
    data[len(data) // 2] ^= 0xFF  # same size, one byte off: only the checksum sees it
    victim.write_bytes(bytes(data))  # a write: a new modification time, so verified again
    with pytest.raises(DataError, match=r"b0002-0000\.arrow: sha256"):
        verify_shards(damaged)

    tampered = _copy(shards, tmp_path / "manifest")
    manifest = json.loads((tampered / "manifest.json").read_text())
    manifest["roles"]["test"]["files"][0]["sha256"] = "0" * 64
    (tampered / "manifest.json").write_text(json.dumps(manifest))
    name = manifest["roles"]["test"]["files"][0]["path"]
    with pytest.raises(DataError, match=f"{name}: sha256"):
        verify_shards(tampered)

    truncated = _copy(shards, tmp_path / "cut")
    victim = truncated / "valid" / "b0001-0000.arrow"
    victim.write_bytes(victim.read_bytes()[:-100])
    with pytest.raises(DataError, match=r"b0001-0000\.arrow: \d+ bytes"):
        verify_shards(truncated)

    (truncated / "manifest.json").write_text('{"format": "transformer-mt/shards/1"}')
    with pytest.raises(DataError, match="malformed manifest"):
        verify_shards(truncated)
    (truncated / "manifest.json").unlink()
    with pytest.raises(DataError, match="no manifest"):
        verify_shards(truncated)


def test_missing_or_malformed_input_is_a_data_error(corpus, tmp_path):
    clean, model = corpus
    bad = _copy(clean, tmp_path / "clean")
    (bad / "test.parquet").unlink()
    with pytest.raises(DataError, match=r"test\.parquet: no such file"):
        encode_and_shard(bad, model, CFG, tmp_path / "out")
    pq.write_table(pa.table({"src": ["a", None], "tgt": ["b", "c"]}), bad / "test.parquet")
    with pytest.raises(DataError, match=r"test\.parquet: row 1 is null"):
        encode_and_shard(bad, model, CFG, tmp_path / "out")
    pq.write_table(pa.table({"source": ["a"], "tgt": ["b"]}), bad / "test.parquet")
    with pytest.raises(DataError, match=r"test\.parquet: not a cleaned corpus"):
        encode_and_shard(bad, model, CFG, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_ids_fit_the_schema(shards):
    t = _read(next((shards / "train").glob("*.arrow")))
    assert t.schema == shard.SCHEMA
    assert np.asarray(t.column("src").combine_chunks().values).min() > PAD


def test_bpe_dropout_encodes_train_copies_times_each_split_another_way(corpus, shards, tmp_path):
    clean, model = corpus
    sp = spm.SentencePieceProcessor(model_file=str(model))
    cfg = ShardConfig(bucket_width=8, rows_per_shard=40, workers=2, src_bpe_dropout=0.3,
                      tgt_bpe_dropout=0.3, copies=3)  # fmt: skip
    manifest = encode_and_shard(clean, model, cfg, tmp_path / "sampled")
    table = pq.read_table(clean / "train.parquet").to_pydict()
    plain = _rows(shards, "train")
    segmentations: dict[int, set] = {}
    for path in sorted((tmp_path / "sampled" / "train").glob("*.arrow")):
        t = _read(path).to_pydict()
        for i, src, tgt in zip(t["id"], t["src"], t["tgt"], strict=True):
            assert sp.decode(src[:-1]) == table["src"][i]  # another split, the same text
            assert sp.decode(tgt[:-1]) == table["tgt"][i]
            segmentations.setdefault(i, set()).add((tuple(src), tuple(tgt)))
    assert manifest["roles"]["train"]["rows"] == 3 * 300
    assert manifest["roles"]["train"]["copies"] == 3
    assert sorted(segmentations) == list(range(300))  # every pair, in its copies
    # Dropped merges make more, shorter pieces; the copies are draws of their own.
    assert manifest["roles"]["train"]["tgt_tokens"] > 3 * sum(len(g) for _, g, _ in plain.values())
    assert sum(len(s) > 1 for s in segmentations.values()) > 250
    for role in ("valid", "test"):  # as the decoder sees text: the plain encoding
        assert _rows(tmp_path / "sampled", role) == _rows(shards, role)
        assert manifest["roles"][role]["copies"] == 1


def test_source_side_bpe_dropout_leaves_every_target_plain(corpus, shards, tmp_path):
    """The decoder learns one segmentation, the one it is scored in; the encoder sees many."""
    clean, model = corpus
    cfg = ShardConfig(bucket_width=8, rows_per_shard=40, workers=2, src_bpe_dropout=0.3, copies=3)
    encode_and_shard(clean, model, cfg, tmp_path / "sampled")
    plain = _rows(shards, "train")
    sources: dict[int, set] = {}
    for path in sorted((tmp_path / "sampled" / "train").glob("*.arrow")):
        t = _read(path).to_pydict()
        for i, src, tgt in zip(t["id"], t["src"], t["tgt"], strict=True):
            assert tgt == plain[i][1]
            sources.setdefault(i, set()).add(tuple(src))
    assert sum(len(s) > 1 for s in sources.values()) > 250


def test_an_epoch_over_copies_counts_as_that_many_passes(corpus, tmp_path):
    from transformer.data.dataset import ShardDataset
    from transformer.data.loader import BatchLoader
    from transformer.data.sampler import TokenBatchSampler

    clean, model = corpus
    cfg = ShardConfig(bucket_width=8, rows_per_shard=40, workers=1, src_bpe_dropout=0.1, copies=4)
    encode_and_shard(clean, model, cfg, tmp_path / "sampled")
    dataset = ShardDataset(tmp_path / "sampled", "train")
    loader = BatchLoader(dataset, TokenBatchSampler.from_dataset(dataset, max_tokens=400))
    batches = sum(1 for _ in zip(range(loader.sampler.batches_per_rank), loader, strict=False))
    loader.close()
    assert dataset.copies == 4 and len(dataset) == 1200
    assert loader.epochs_done == pytest.approx(4.0) and batches == loader.sampler.batches_per_rank
