"""The data stages: a source's splits to parquet (prepare), then cleaning.

Every source kind (text, gzip text, parquet, jsonl, a hub-style `datasets.Dataset`) must
give the same `src`/`tgt` rows; bad input must fail with a message naming the file and the
line; a failed stage must leave no output directory behind.
"""

from __future__ import annotations

import gzip
import json
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from transformer.config import CleanConfig, DataConfig
from transformer.data import DataError
from transformer.data import sources as sources_module
from transformer.data.clean import clean_corpus
from transformer.data.sources import InvalidPolicy, dataset_batches, prepare_source

REPO = Path(__file__).resolve().parents[1]
MULTI30K = REPO.parent / "shared" / "data" / "multi30k"

PAIRS = {
    "train": [("the dog sleeps .", "der Hund schläft ."), ("a red ball", "ein roter Ball")],
    "valid": [("hello", "hallo")],
    "test": [("good morning", "guten Morgen"), ("", ""), ("bye", "tschüss")],
}


def data_config(path: Path, fmt: str = "text", **extra) -> DataConfig:
    return DataConfig.model_validate(
        {
            "source": {"path": str(path), "format": fmt},
            "src_lang": "en",
            "tgt_lang": "de",
            "splits": {"train": "train", "valid": "valid", "test": "test"},
            **extra,
        }
    )


def write_text(folder: Path, pairs=PAIRS, gz: bool = False) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    for split, rows in pairs.items():
        for side, lang in enumerate(("en", "de")):
            data = "".join(row[side] + "\n" for row in rows).encode()
            name = f"{split}.{lang}" + (".gz" if gz else "")
            (folder / name).write_bytes(gzip.compress(data, mtime=0) if gz else data)
    return folder


def translation_rows(rows) -> list[dict]:
    return [{"translation": {"de": de, "en": en}} for en, de in rows]


def read_pairs(path: Path) -> list[tuple[str, str]]:
    table = pq.read_table(path)
    assert table.schema.names == ["src", "tgt"]
    assert table.schema.field("src").type == pa.string()
    return list(zip(table.column("src").to_pylist(), table.column("tgt").to_pylist(), strict=True))


def assert_prepared(out: Path, manifest: dict) -> None:
    for role, rows in PAIRS.items():
        assert read_pairs(out / f"{role}.parquet") == rows
        assert manifest["counts"][role] == {"pairs": len(rows), "dropped_invalid": 0}
    assert json.loads((out / "prepare.json").read_text()) == manifest


# --------------------------------------------------------------------------- sources


@pytest.mark.parametrize("gz", [False, True], ids=["plain", "gzip"])
def test_text_folder_to_parquet(tmp_path, gz):
    src = write_text(tmp_path / "src", gz=gz)
    out = tmp_path / "out"
    manifest = prepare_source(data_config(src), out)
    assert_prepared(out, manifest)
    suffix = ".gz" if gz else ""
    names = {f"{split}.{lang}{suffix}" for split in PAIRS for lang in ("en", "de")}
    assert set(manifest["fingerprints"]) == names
    assert manifest["source"] == {"path": str(src), "format": "text"}


def test_relative_path_and_direction(tmp_path, monkeypatch):
    write_text(tmp_path / "src")
    monkeypatch.chdir(tmp_path)
    cfg = data_config(Path("src")).model_copy(update={"src_lang": "de", "tgt_lang": "en"})
    manifest = prepare_source(cfg, Path("out"))
    assert manifest["source"]["path"] == str(tmp_path / "src")
    first = read_pairs(tmp_path / "out" / "train.parquet")[0]
    assert first == ("der Hund schläft .", "the dog sleeps .")


def test_parquet_and_jsonl_in_translation_schema(tmp_path):
    for fmt in ("parquet", "jsonl"):
        folder = tmp_path / fmt
        folder.mkdir()
        for split, rows in PAIRS.items():
            if fmt == "parquet":
                table = pa.Table.from_pylist(translation_rows(rows))
                pq.write_table(table, folder / f"{split}.parquet")
            else:
                lines = [json.dumps(r, ensure_ascii=False) + "\n" for r in translation_rows(rows)]
                (folder / f"{split}.jsonl").write_text("".join(lines), encoding="utf-8")
        manifest = prepare_source(data_config(folder, fmt), tmp_path / f"out-{fmt}")
        assert_prepared(tmp_path / f"out-{fmt}", manifest)


def test_hub_path_with_a_local_stand_in(tmp_path, monkeypatch):
    """The hub branch end to end, `datasets.load_dataset` answering from local parquet files
    in the hub's schema; retries on network errors, then a clear error."""
    datasets = pytest.importorskip("datasets")
    for split, rows in PAIRS.items():
        pq.write_table(pa.Table.from_pylist(translation_rows(rows)), tmp_path / f"{split}.parquet")
    real_load = datasets.load_dataset
    calls = []

    def fake_load(hub, config, revision, split):
        calls.append((hub, config, revision, split))
        if len(calls) == 1:
            raise ConnectionError("network down")  # the first attempt fails: retried
        files = str(tmp_path / f"{split}.parquet")
        return real_load("parquet", data_files=files, split="train", cache_dir=str(tmp_path / "hf"))

    monkeypatch.setattr(datasets, "load_dataset", fake_load)
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(sources_module, "HUB_BACKOFF_S", 0.0)
    hub = {"hub": "wmt/wmt14", "config": "de-en", "revision": "abc123"}
    cfg = DataConfig.model_validate(
        {"source": hub, "src_lang": "en", "tgt_lang": "de", "splits": {"valid": "valid"}}
    )
    out = tmp_path / "out"
    manifest = prepare_source(cfg, out)
    assert_prepared(out, manifest)
    assert manifest["fingerprints"] == hub
    assert calls[0] == ("wmt/wmt14", "de-en", "abc123", "train")

    def unreachable(*args, **kwargs):
        raise ConnectionError("Couldn't reach 'wmt/wmt14' on the Hub")

    monkeypatch.setattr(datasets, "load_dataset", unreachable)
    with pytest.raises(DataError, match=r"wmt/wmt14.*revision abc123.*3 attempt.*HF_HUB_OFFLINE"):
        prepare_source(cfg, tmp_path / "out2")
    assert not (tmp_path / "out2").exists()

    def not_found(*args, **kwargs):
        calls.append("not found")
        raise datasets.exceptions.DatasetNotFoundError("Dataset 'wmt/wmt14' doesn't exist")

    monkeypatch.setattr(datasets, "load_dataset", not_found)
    calls.clear()
    with pytest.raises(DataError, match=r"'wmt/wmt14'.*revision abc123.*was not found"):
        prepare_source(cfg, tmp_path / "out3")
    assert calls == ["not found"]  # no retries: no retry will find it


def test_dataset_object_through_the_shared_schema_function(tmp_path):
    datasets = pytest.importorskip("datasets")
    rows = [*PAIRS["test"], ("no german", None)]
    dataset = datasets.Dataset.from_list(
        [{"translation": {"en": en, "de": de}, "id": str(i)} for i, (en, de) in enumerate(rows)]
    )
    invalid = InvalidPolicy("drop")
    batches = list(dataset_batches(dataset, "en", "de", "hub:test", invalid))
    got = [pair for b in batches for pair in zip(*b.to_pydict().values(), strict=True)]
    assert got == PAIRS["test"]
    assert invalid.dropped == 1
    with pytest.raises(DataError, match=r"hub:test: row 4: no tgt text"):
        list(dataset_batches(dataset, "en", "de", "hub:test", InvalidPolicy("error")))
    with pytest.raises(DataError, match=r"hub:test: 'translation' has no 'fr' text"):
        list(dataset_batches(dataset, "en", "fr", "hub:test", invalid))


# --------------------------------------------------------------------------- bad input


def test_mismatched_line_counts_name_both_files(tmp_path):
    src = write_text(tmp_path / "src")
    (src / "train.de").write_text("der Hund schläft .\nein roter Ball\nextra\n", encoding="utf-8")
    with pytest.raises(DataError) as err:
        prepare_source(data_config(src), tmp_path / "out")
    message = str(err.value)
    assert f"{src / 'train.en'} has 2 lines" in message
    assert f"{src / 'train.de'} has 3 lines" in message
    assert "train.en ends after line 2" in message
    assert not (tmp_path / "out").exists()


def test_missing_split_file_names_the_path(tmp_path):
    src = write_text(tmp_path / "src")
    (src / "valid.de").unlink()
    with pytest.raises(DataError, match=r"valid\.de: no such file \(nor valid\.de\.gz\)"):
        prepare_source(data_config(src), tmp_path / "out")


def test_invalid_utf8_error_names_file_and_line(tmp_path):
    src = write_text(tmp_path / "src")
    (src / "train.de").write_bytes(b"der Hund\n\xff\xfe kaputt\n")
    with pytest.raises(DataError, match=r"train\.de: line 2: invalid UTF-8"):
        prepare_source(data_config(src), tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_invalid_utf8_drop_mode_counts_the_pair(tmp_path):
    src = write_text(tmp_path / "src")
    (src / "train.de").write_bytes(b"der Hund\n\xff\xfe kaputt\n")
    manifest = prepare_source(data_config(src, on_invalid="drop"), tmp_path / "out")
    assert read_pairs(tmp_path / "out" / "train.parquet") == [("the dog sleeps .", "der Hund")]
    assert manifest["counts"]["train"] == {"pairs": 1, "dropped_invalid": 1}
    assert manifest["counts"]["test"] == {"pairs": 3, "dropped_invalid": 0}


def test_failure_mid_write_leaves_no_output(tmp_path, monkeypatch):
    src = write_text(tmp_path / "src")
    out = tmp_path / "out"
    real_write = sources_module.write_pairs

    def write_then_fail(batches, path):
        rows = real_write(batches, path)
        if path.name == "valid.parquet":  # train.parquet is already written by now
            raise KeyboardInterrupt  # as a kill would, mid-stage
        return rows

    monkeypatch.setattr(sources_module, "write_pairs", write_then_fail)
    with pytest.raises(KeyboardInterrupt):
        prepare_source(data_config(src), out)
    assert list(tmp_path.iterdir()) == [src]  # neither out/ nor a temporary sibling


def test_rerun_replaces_an_existing_output(tmp_path):
    src = write_text(tmp_path / "src")
    out = tmp_path / "out"
    prepare_source(data_config(src), out)
    (src / "valid.en").write_text("hi\n", encoding="utf-8")
    (src / "valid.de").write_text("servus\n", encoding="utf-8")
    prepare_source(data_config(src), out)
    assert read_pairs(out / "valid.parquet") == [("hi", "servus")]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out", "src"]


# --------------------------------------------------------------------------- cleaning

CORPUS = [
    ("  the dog sleeps . ", "der Hund schläft .\t"),  # kept, stripped
    ("", "leer"),  # empty
    ("   ", "\t"),  # empty after stripping
    ("hi", "hallo"),  # too short with min_len 2
    ("one two three four five six", "eins zwei drei vier fünf sechs"),  # too long, max_len 5
    ("a b", "a b c d"),  # ratio 2.0 > 1.5
    ("the dog sleeps .", "der Hund schläft ."),  # a duplicate after stripping
    ("the cat  sleeps", "die Katze schläft"),  # kept: "  " is one separator
    ("the cat  sleeps", "die Katze döst"),  # kept: a different pair
]


def test_clean_counts_each_filter_and_leaves_valid_test_whole(tmp_path):
    raw = tmp_path / "raw"
    raw.mkdir()
    tests = [("  spaced  ", " x "), ("", ""), ("a b c d e f g", "a")]
    for role, rows in {"train": CORPUS, "valid": tests, "test": tests}.items():
        table = pa.table({"src": [r[0] for r in rows], "tgt": [r[1] for r in rows]})
        pq.write_table(table, raw / f"{role}.parquet")
    cfg = CleanConfig(min_len=2, max_len=5, max_ratio=1.5, dedup=True)
    report = clean_corpus(raw, cfg, tmp_path / "clean")
    assert report["train"] == {
        "read": 9,
        "kept": 3,
        "dropped_empty": 2,
        "dropped_too_short": 1,
        "dropped_too_long": 1,
        "dropped_ratio": 1,
        "dropped_duplicate": 1,
    }
    assert read_pairs(tmp_path / "clean" / "train.parquet") == [
        ("the dog sleeps .", "der Hund schläft ."),
        ("the cat  sleeps", "die Katze schläft"),
        ("the cat  sleeps", "die Katze döst"),
    ]
    for role in ("valid", "test"):
        assert read_pairs(tmp_path / "clean" / f"{role}.parquet") == [
            ("spaced", "x"),
            ("", ""),
            ("a b c d e f g", "a"),
        ]
        assert report[role]["kept"] == report[role]["read"] == 3
    assert json.loads((tmp_path / "clean" / "clean.json").read_text()) == report


def test_clean_without_dedup_keeps_duplicates(tmp_path):
    src = write_text(tmp_path / "src", {**PAIRS, "train": PAIRS["train"] * 3})
    prepare_source(data_config(src), tmp_path / "raw")
    report = clean_corpus(tmp_path / "raw", CleanConfig(dedup=False), tmp_path / "clean")
    assert report["train"]["kept"] == 6
    report = clean_corpus(tmp_path / "raw", CleanConfig(dedup=True), tmp_path / "clean")
    assert report["train"]["kept"] == 2
    assert report["train"]["dropped_duplicate"] == 4


def test_clean_lowercase_lowercases_every_split_on_both_sides(tmp_path):
    src = write_text(tmp_path / "src")
    prepare_source(data_config(src), tmp_path / "raw")
    clean_corpus(tmp_path / "raw", CleanConfig(lowercase=True), tmp_path / "clean")
    for role, pairs in PAIRS.items():
        lowered = [(s.lower(), t.lower()) for s, t in pairs]
        assert read_pairs(tmp_path / "clean" / f"{role}.parquet") == lowered


def test_clean_missing_input_leaves_no_output(tmp_path):
    with pytest.raises(DataError, match=r"train\.parquet: no such file"):
        clean_corpus(tmp_path / "nothing", CleanConfig(), tmp_path / "clean")
    assert not (tmp_path / "clean").exists()


# --------------------------------------------------------------------------- real and shipped data


@pytest.mark.skipif(not MULTI30K.is_dir(), reason="no ../shared/data/multi30k here")
def test_multi30k_counts(tmp_path):
    cfg = DataConfig.model_validate(
        {
            "source": {"path": str(MULTI30K), "format": "text"},
            "src_lang": "en",
            "tgt_lang": "de",
            "splits": {"train": "train", "valid": "val", "test": "test_2016_flickr"},
        }
    )
    manifest = prepare_source(cfg, tmp_path / "raw")
    pairs = {role: counts["pairs"] for role, counts in manifest["counts"].items()}
    assert pairs == {"train": 29000, "valid": 1014, "test": 1000}
    report = clean_corpus(tmp_path / "raw", CleanConfig(), tmp_path / "clean")
    assert report["test"]["kept"] == 1000
    assert 25000 < report["train"]["kept"] < 29000


def test_smoke_data_is_reproduced_by_its_generator(tmp_path):
    smoke = REPO / "data" / "smoke"
    subprocess.run([sys.executable, str(smoke / "generate.py"), str(tmp_path)], check=True)
    for name in ("train", "valid", "test"):
        for lang in ("en", "de"):
            fresh = (tmp_path / f"{name}.{lang}").read_bytes()
            assert fresh == (smoke / f"{name}.{lang}").read_bytes(), f"{name}.{lang} differs"
    train = set((smoke / "train.en").read_text(encoding="utf-8").splitlines())
    for name in ("valid", "test"):
        assert not train & set((smoke / f"{name}.en").read_text(encoding="utf-8").splitlines())
