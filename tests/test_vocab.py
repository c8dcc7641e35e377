"""The joint sentencepiece vocabulary: fixed special ids, determinism, clear errors."""

from __future__ import annotations

import io
import json
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import sentencepiece as spm

from transformer.config import VocabConfig
from transformer.data.vocab import VocabError, learn_vocab, load_spm, sample_indices
from transformer.files import file_sha256
from transformer.tokens import BOS, EOS, PAD, SPECIAL_IDS, UNK

SMOKE = Path(__file__).resolve().parents[1] / "data" / "smoke"


@pytest.fixture(scope="module")
def train_parquet(tmp_path_factory) -> Path:
    """2,000 pairs of the shipped smoke data, as the clean stage writes them."""
    lines = {lang: (SMOKE / f"train.{lang}").read_text(encoding="utf-8").splitlines()[:2000]
             for lang in ("en", "de")}  # fmt: skip
    path = tmp_path_factory.mktemp("clean") / "train.parquet"
    pq.write_table(pa.table({"src": lines["en"], "tgt": lines["de"]}), path)
    return path


def test_special_ids_and_outputs(train_parquet, tmp_path):
    cfg = VocabConfig(size=300, sample_size=3000, seed=3)
    model = learn_vocab(train_parquet, cfg, tmp_path / "vocab")
    assert model == tmp_path / "vocab" / "spm.model"
    sp = load_spm(model)
    assert (sp.pad_id(), sp.unk_id(), sp.bos_id(), sp.eos_id()) == (PAD, UNK, BOS, EOS)
    assert sp.get_piece_size() == 300
    ids = sp.encode("Der kleine Hund schläft.")
    assert ids and min(ids) > EOS  # ordinary text never encodes to a special id
    meta = json.loads((tmp_path / "vocab" / "vocab.json").read_text())
    assert meta["special_ids"] == SPECIAL_IDS
    assert meta["size"] == 300 and meta["sampled_sentences"] == 3000
    assert meta["spm_model_sha256"] == file_sha256(model)
    vocab_lines = (tmp_path / "vocab" / "spm.vocab").read_text(encoding="utf-8").splitlines()
    assert len(vocab_lines) == 300 and vocab_lines[0].split("\t")[0] == "<pad>"
    assert load_spm(model.read_bytes()).encode("Der Hund") == sp.encode("Der Hund")


def test_same_seed_same_bytes(train_parquet, tmp_path):
    cfg = VocabConfig(size=300, sample_size=1500, seed=7)
    first = learn_vocab(train_parquet, cfg, tmp_path / "a").read_bytes()
    second = learn_vocab(train_parquet, cfg, tmp_path / "b").read_bytes()
    assert first == second
    other = learn_vocab(train_parquet, cfg.model_copy(update={"seed": 8}), tmp_path / "c")
    assert other.read_bytes() != first  # another sample of the 4,000 sentences


def test_sample_indices_cover_both_sides_without_repeats():
    cfg = VocabConfig(sample_size=500, seed=1)
    indices = sample_indices(1000, cfg)
    assert len(np.unique(indices)) == 500 and np.all(np.diff(indices) > 0)
    assert indices.min() < 1000 <= indices.max()  # source and target sentences both drawn
    assert np.array_equal(indices, sample_indices(1000, cfg))
    assert len(sample_indices(100, cfg)) == 200  # fewer than asked: all of them


def test_vocab_size_too_large_is_a_clear_error(train_parquet, tmp_path):
    with pytest.raises(VocabError, match=r"vocab\.size = 100000.*too high.*lower vocab\.size"):
        learn_vocab(train_parquet, VocabConfig(size=100000, sample_size=500), tmp_path / "v")
    assert not (tmp_path / "v").exists()


def test_foreign_special_ids_are_rejected(train_parquet, tmp_path):
    sentences = pq.read_table(train_parquet).column("src").to_pylist()
    model = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(sentences), model_writer=model, vocab_size=200, minloglevel=2
    )  # sentencepiece's defaults: unk 0, bos 1, eos 2, no pad
    with pytest.raises(VocabError, match=r"special ids .* differ from the fixed"):
        load_spm(model.getvalue())
    with pytest.raises(VocabError, match=r"no such sentencepiece model"):
        load_spm(tmp_path / "missing.model")
    (tmp_path / "junk.model").write_bytes(b"not a model")
    with pytest.raises(VocabError, match=r"not a sentencepiece model"):
        load_spm(tmp_path / "junk.model")
