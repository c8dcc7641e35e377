"""The joint sentencepiece vocabulary, with the fixed special ids of tokens.py.

The ids are fixed (not read from each model) so that shards, checkpoints and decoders agree
without passing a vocabulary object around; `learn_vocab` trains sentencepiece with them.
One model covers both languages: the paper shares one source-target vocabulary (5.1) and,
through it, one embedding matrix (3.4).
"""

from __future__ import annotations

import io
import json
import logging
import os
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pyarrow.compute as pc
import pyarrow.parquet as pq
import sentencepiece as spm

from transformer.cli import UserError
from transformer.config import VocabConfig
from transformer.data.sources import read_batches
from transformer.files import SPM_MODEL, SPM_VOCAB, VOCAB_REPORT, atomic_dir, file_sha256
from transformer.tokens import BOS, EOS, PAD, SPECIAL_IDS, UNK

log = logging.getLogger(__name__)


class VocabError(UserError, ValueError):
    """A vocabulary cannot be learned from this data, or a model has the wrong special ids."""


def learn_vocab(train_parquet: Path, cfg: VocabConfig, out_dir: Path) -> Path:
    """Train one joint model on a seeded sample of both sides of the training split.

    Writes `out_dir/spm.model`, `out_dir/spm.vocab` and `out_dir/vocab.json`; returns the
    path of spm.model. The same seed and input give a byte-identical spm.model on machines
    with the same number of cores (sentencepiece records num_threads in the model).
    """
    train_parquet, out_dir = Path(train_parquet), Path(out_dir)
    indices = sample_indices(pq.ParquetFile(train_parquet).metadata.num_rows, cfg)
    log.info(
        "learning a %d-piece %s vocabulary from %d sentences",
        cfg.size,
        cfg.model_type,
        len(indices),
    )
    start = time.monotonic()
    model = _train(sampled_sentences(train_parquet, indices), cfg)
    with atomic_dir(out_dir) as tmp:
        (tmp / SPM_MODEL).write_bytes(model)
        processor = load_spm(model)
        _write_vocab(processor, tmp / SPM_VOCAB)
        meta = {
            "special_ids": SPECIAL_IDS,
            "size": processor.get_piece_size(),
            "model_type": cfg.model_type,
            "sample_size": cfg.sample_size,
            "sampled_sentences": len(indices),
            "seed": cfg.seed,
            "character_coverage": cfg.character_coverage,
            "spm_model_sha256": file_sha256(tmp / SPM_MODEL),
        }
        (tmp / VOCAB_REPORT).write_text(json.dumps(meta, indent=2) + "\n")
    log.info("learned %d pieces in %.0f s", meta["size"], time.monotonic() - start)
    return out_dir / SPM_MODEL


def sample_indices(rows: int, cfg: VocabConfig) -> np.ndarray:
    """Sorted sentence indices into [0, 2 * rows): i < rows is source row i, else target row
    i - rows. Drawn without replacement from cfg.seed; all sentences if there are fewer."""
    total = 2 * rows
    if cfg.sample_size >= total:
        return np.arange(total)
    rng = np.random.default_rng(cfg.seed)
    return np.sort(rng.choice(total, size=cfg.sample_size, replace=False))


def sampled_sentences(train_parquet: Path, indices: np.ndarray) -> Iterator[str]:
    """Stream the sampled sentences in index order (all sources, then all targets); empty
    sentences are skipped and line breaks inside one become spaces."""
    rows = pq.ParquetFile(train_parquet).metadata.num_rows
    for side, wanted in (
        ("src", indices[indices < rows]),
        ("tgt", indices[indices >= rows] - rows),
    ):
        start = 0
        for batch in read_batches(train_parquet, [side]):
            end = start + batch.num_rows
            take = wanted[(wanted >= start) & (wanted < end)] - start
            if len(take):
                text = pc.replace_substring_regex(batch.column(side).take(take), r"[\r\n]+", " ")
                yield from (s for s in text.to_pylist() if s)
            start = end


def _train(sentences: Iterator[str], cfg: VocabConfig) -> bytes:
    # The sample is streamed to sentencepiece, not written to a text file: a file's path is
    # recorded in the model (trainer_spec.input), and a temporary one differs on every run.
    model = io.BytesIO()
    spm.set_random_generator_seed(cfg.seed)  # unigram's sampling; BPE is deterministic anyway
    try:
        spm.SentencePieceTrainer.train(
            sentence_iterator=sentences,
            model_writer=model,
            model_type=cfg.model_type,
            vocab_size=cfg.size,
            character_coverage=cfg.character_coverage,
            # The sample is already drawn (and bounded): take all of it, in order.
            input_sentence_size=cfg.sample_size,
            shuffle_input_sentence=False,
            pad_id=PAD,
            unk_id=UNK,
            bos_id=BOS,
            eos_id=EOS,
            num_threads=_cores(),
            minloglevel=1,  # sentencepiece's info log is thousands of lines
        )
    except RuntimeError as err:
        raise VocabError(_train_error(err, cfg)) from None
    return model.getvalue()


def _cores() -> int:
    # The cores this process may use (a container's or taskset's share); macOS lacks the call.
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def _train_error(err: RuntimeError, cfg: VocabConfig) -> str:
    reason = str(err).split("] ", 1)[-1]  # drop the C++ source location
    if "too high" in reason:
        hint = "lower vocab.size, or give more (or more varied) training text"
    elif "smaller than required_chars" in reason:
        hint = "raise vocab.size, or lower vocab.character_coverage"
    else:
        hint = "check vocab.* in the params"
    return f"vocab.size = {cfg.size}: sentencepiece cannot learn this vocabulary: {reason} ({hint})"


def _write_vocab(processor: spm.SentencePieceProcessor, path: Path) -> None:
    """The human-readable piece list, in sentencepiece's own .vocab format (piece TAB score)."""
    with open(path, "w", encoding="utf-8") as f:
        for i in range(processor.get_piece_size()):
            f.write(f"{processor.id_to_piece(i)}\t{processor.get_score(i):g}\n")


def load_spm(model: str | os.PathLike | bytes) -> spm.SentencePieceProcessor:
    """A sentencepiece model from a path or from its bytes, checked for the fixed special ids."""
    processor = spm.SentencePieceProcessor()
    where = "<spm model bytes>" if isinstance(model, bytes) else str(model)
    if not isinstance(model, bytes) and not Path(model).is_file():
        raise VocabError(f"{where}: no such sentencepiece model")
    try:
        if isinstance(model, bytes):
            processor.LoadFromSerializedProto(model)
        else:
            processor.Load(where)
    except (RuntimeError, OSError) as err:
        raise VocabError(f"{where}: not a sentencepiece model ({err})") from None
    check_special_ids(processor, where)
    return processor


class Lowercasing:
    """The sentencepiece processor of a model trained on lowercased text (clean.lowercase):
    what it encodes is lowercased first, as the clean stage lowercased the training data,
    so every caller (translate, the MLflow model, the benchmarks) feeds the model the text
    it was trained on. Everything else is the wrapped processor's."""

    def __init__(self, processor: spm.SentencePieceProcessor):
        self._processor = processor

    def encode(self, text: str | list[str], **kwargs):
        lowered = text.lower() if isinstance(text, str) else [line.lower() for line in text]
        return self._processor.encode(lowered, **kwargs)

    def __getattr__(self, name: str):
        return getattr(self._processor, name)


def check_special_ids(processor: spm.SentencePieceProcessor, where: str = "model") -> None:
    """Raise VocabError unless pad/unk/bos/eos have the ids that shards and models assume."""
    actual = {
        "pad": processor.pad_id(),
        "unk": processor.unk_id(),
        "bos": processor.bos_id(),
        "eos": processor.eos_id(),
    }
    if actual != SPECIAL_IDS:
        raise VocabError(
            f"{where}: special ids {actual} differ from the fixed {SPECIAL_IDS}; "
            "learn the vocabulary with transformer.data.vocab.learn_vocab"
        )
