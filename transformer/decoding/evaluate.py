"""Decode and score: the decode stage's library function, and the scores it reports.

- `bleu`, `chrf` (sacreBLEU on detokenized output against the raw references, each with
  sacreBLEU's signature), and `bleu_lc` (the same, case-insensitive): the reproducible
  standard, comparable wherever the signature matches.
- `bleu_tok_compound` (ScoreConfig.compound_split; WMT14 EN-DE): what the paper reports
  (tensor2tensor's get_ende_bleu.sh): hypotheses and references tokenized as Moses'
  `tokenizer.perl -l de` does (sacremoses), compounds split as "rich ##AT##-##AT## text",
  unsmoothed `multi-bleu.perl`: the figure those scripts give, as of the paper
  (docs/results/bleu.md: the check against them).
- `bleu_tok_lc` (ScoreConfig.tokenized_refs; Multi30k): the scale papers on a corpus quote
  when the corpus ships its own tokenized references: hypotheses lowercased,
  punctuation-normalised and tokenized with sacremoses (Moses' scripts, maintained in
  Python), unsmoothed BLEU against those references. Not sacreBLEU: never compare the two.

`python -m transformer.evaluate HYP REF [--lowercase]` prints sacreBLEU scores as JSON;
`--compound-split` adds `bleu_tok_compound`, `--tokenized-refs FILE` adds `bleu_tok_lc`
against FILE (its language the name's last suffix: test_2016_flickr.lc.norm.tok.de.gz).
"""

from __future__ import annotations

import gzip
import json
import os
import re
import sys
from pathlib import Path

import pyarrow.parquet as pq
from sacrebleu.metrics import BLEU, CHRF

from transformer.cli import ArgumentParser
from transformer.config import DataConfig, DecodeConfig, ScoreConfig
from transformer.data import DataError
from transformer.files import SCORES, atomic_dir, file_sha256, gzip_damage, hypotheses

# get_ende_bleu.sh: perl -ple 's{(\S)-(\S)}{$1 ##AT##-##AT## $2}g'. Python's re.sub, like
# Perl's s///g, replaces non-overlapping matches left to right, so "a-b-c" gives
# "a ##AT##-##AT## b-c" in both: the script's quirk is kept, to stay comparable. That perl
# reads bytes, so its \s is ASCII whitespace only (a no-break space is \S): re.ASCII.
_COMPOUND = re.compile(r"(\S)-(\S)", re.ASCII)
_UNSMOOTHED = {"tokenize": "none", "smooth_method": "none", "force": True}
ATTENTION_SENTENCES = 2  # test sentences whose attention maps the decode stage draws


def score(hyps: list[str], refs: list[str], lowercase: bool = False) -> dict:
    """sacreBLEU's BLEU and chrF, with their signatures."""
    if len(hyps) != len(refs):
        raise ValueError(f"{len(hyps)} hypotheses but {len(refs)} references")
    if not hyps:
        raise ValueError("no hypotheses to score")
    bleu, chrf = BLEU(lowercase=lowercase), CHRF(lowercase=lowercase)
    return {
        "bleu": bleu.corpus_score(hyps, [refs]).score,
        "chrf": chrf.corpus_score(hyps, [refs]).score,
        "bleu_signature": str(bleu.get_signature()),
        "chrf_signature": str(chrf.get_signature()),
    }


def compound_split(lines: list[str]) -> list[str]:
    """get_ende_bleu.sh's preprocessing of German: `tokenizer.perl -l de` (its defaults:
    escaped, no aggressive dash splits) as of the paper, then the compounds split. (Since
    November 2018 tokenizer.perl also splits the dot off a sentence's last word that is a
    nonbreaking prefix, "Nummer 10." to "Nummer 10 ."; sacremoses, like the paper's, not.)"""
    from sacremoses import MosesTokenizer

    tok = MosesTokenizer("de")
    return [
        _COMPOUND.sub(r"\1 ##AT##-##AT## \2", tok.tokenize(line, return_str=True, escape=True))
        for line in lines
    ]


def compound_split_bleu(hyps: list[str], refs: list[str]) -> float:
    """get_ende_bleu.sh: both sides through `compound_split`, then multi-bleu.perl's
    unsmoothed BLEU (sacreBLEU's, on the whitespace-split tokens)."""
    return BLEU(**_UNSMOOTHED).corpus_score(compound_split(hyps), [compound_split(refs)]).score


def tokenized_lc_bleu(hyps: list[str], tok_refs: list[str], lang: str) -> float:
    """Lowercase, normalise punctuation, Moses-tokenize (escaping as tokenizer.perl does),
    then unsmoothed BLEU against references already processed that way."""
    from sacremoses import MosesPunctNormalizer, MosesTokenizer

    normalizer, tokenizer = MosesPunctNormalizer(lang), MosesTokenizer(lang)
    tokenized = [
        tokenizer.tokenize(normalizer.normalize(h.lower()), return_str=True, escape=True)
        for h in hyps
    ]
    if len(tokenized) != len(tok_refs):
        raise ValueError(f"{len(tokenized)} hypotheses but {len(tok_refs)} tokenized references")
    return BLEU(**_UNSMOOTHED).corpus_score(tokenized, [tok_refs]).score


def score_split(
    hyps: list[str], refs: list[str], cfg: ScoreConfig, lang: str, tok_refs: Path | None
) -> dict:
    """Every score the params ask for, for one split."""
    lower = score(hyps, refs, lowercase=True)
    out = score(hyps, refs) | {
        "bleu_lc": lower["bleu"],
        "bleu_lc_signature": lower["bleu_signature"],
    }
    if cfg.compound_split:
        out["bleu_tok_compound"] = compound_split_bleu(hyps, refs)
    if tok_refs is not None:
        out["bleu_tok_lc"] = tokenized_lc_bleu(hyps, read_lines(tok_refs), lang)
    return out


def tokenized_refs(cfg: ScoreConfig, data: DataConfig, role: str) -> Path | None:
    """The corpus's own tokenized reference file for a split, if the params name a folder."""
    if cfg.tokenized_refs is None:
        return None
    split = getattr(data.splits, role)
    base = Path(cfg.tokenized_refs).expanduser().resolve() / f"{split}.lc.norm.tok.{data.tgt_lang}"
    for path in (base, base.with_name(base.name + ".gz")):
        if path.is_file():
            return path
    raise DataError(f"{base}: no such file (nor .gz): score.tokenized_refs names no reference")


def reference_fingerprints(cfg: ScoreConfig, data: DataConfig) -> dict[str, str]:
    """sha256 of the tokenized reference files the scores will read (none if not asked)."""
    found = {role: tokenized_refs(cfg, data, role) for role in ("valid", "test")}
    return {role: file_sha256(path) for role, path in found.items() if path is not None}


def decode_and_score(
    model_path: Path,
    cleaned: Path,
    data: DataConfig,
    decode_cfg: DecodeConfig,
    score_cfg: ScoreConfig,
    out_dir: Path,
    device: str,
) -> dict:
    """Translate the valid and test splits of the cleaned corpus with beam search, score
    them against the raw references; write `{role}.hyp`, scores.json and the attention maps
    of the first test sentences (attention/sentence-N/) atomically."""
    from transformer.decoding.attention_maps import draw_sentence
    from transformer.decoding.translate import load_translator

    model, sp, _ = load_translator(model_path, device)
    with atomic_dir(out_dir) as tmp:
        scores, (sources, hyps) = translate_and_score(model, sp, cleaned, data, decode_cfg,
                                                      score_cfg, tmp, device)  # fmt: skip
        shown = [i for i, line in enumerate(sources) if line.strip()][:ATTENTION_SENTENCES]
        for i in shown:  # the test split's first sentences: the same ones run after run
            draw_sentence(model, sp, sources[i], hyps[i], tmp / "attention" / f"sentence-{i + 1}")
        (tmp / SCORES).write_text(json.dumps(scores, indent=2))
    return scores


def translate_and_score(
    model, sp, cleaned: Path, data: DataConfig, decode_cfg: DecodeConfig,
    score_cfg: ScoreConfig, out_dir: Path, device: str,
) -> tuple[dict, tuple[list[str], list[str]]]:  # fmt: skip
    """Translate the valid and test splits of the cleaned corpus with a model or an
    ensemble (a list) and write `{role}.hyp` into `out_dir`; return the scores by split,
    and the test split's sources and hypotheses."""
    from transformer.decoding.translate import translate_lines
    from transformer.nn.kv_cache import Arena

    scores, arena = {}, Arena()  # one cache memory for both splits
    for role in ("valid", "test"):
        refs_tok = tokenized_refs(score_cfg, data, role)  # missing: fail before decoding
        table = pq.read_table(Path(cleaned) / f"{role}.parquet")
        sources, refs = table["src"].to_pylist(), table["tgt"].to_pylist()
        hyps = translate_lines(model, sp, sources, decode_cfg, device, f"decoding {role}", arena)
        (out_dir / hypotheses(role)).write_text("".join(h + "\n" for h in hyps), "utf-8")
        scores[role] = score_split(hyps, refs, score_cfg, data.tgt_lang, refs_tok)
    return scores, (sources, hyps)


# A line is a sentence: one of more than a MiB is none (a file without line breaks, a
# device such as /dev/zero), and a file to score of more than 256 MiB is no test set: both
# refused as they are read, before they are held.
MAX_LINE_BYTES = 1 << 20
MAX_TEXT_BYTES = 1 << 28


def read_lines(path: str | os.PathLike) -> list[str]:
    """One sentence per line, split on "\\n" only (as sacreBLEU reads files); gzip allowed.
    DataError naming the file (and the line) for anything else."""
    path = Path(path)
    opener = gzip.open if path.suffix == ".gz" else open
    lines, total = [], 0
    with gzip_damage(path, DataError), opener(path, "rb") as f:
        while line := f.readline(MAX_LINE_BYTES + 2):  # the bound, "\r\n" and no more
            total += len(line)
            body = line.rstrip(b"\r\n")
            if len(body) > MAX_LINE_BYTES:
                raise DataError(f"{path}: line {len(lines) + 1}: longer than "
                                 f"{MAX_LINE_BYTES:,} bytes: not a sentence")  # fmt: skip
            if total > MAX_TEXT_BYTES:
                raise DataError(f"{path}: larger than {MAX_TEXT_BYTES:,} bytes: no test set")
            lines.append(_text(body, path, len(lines) + 1))
    return lines


def _text(line: bytes, path: Path, number: int) -> str:
    try:
        return line.decode("utf-8")
    except UnicodeDecodeError as err:
        raise DataError(f"{path}: not UTF-8 text ({err.reason} at byte {err.start} of "
                         f"line {number})") from None  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    parser = ArgumentParser(prog="python -m transformer.evaluate", description=__doc__)
    parser.add_argument("hyp", help="detokenized translations, one per line")
    parser.add_argument("ref", help="raw references, one per line")
    parser.add_argument("--lowercase", action="store_true",
                        help="case-insensitive bleu and chrf (the tokenized scales keep "
                             "their own rules)")  # fmt: skip
    parser.add_argument("--compound-split", action="store_true",
                        help="add bleu_tok_compound: the paper's WMT14 EN-DE BLEU")  # fmt: skip
    parser.add_argument("--tokenized-refs", metavar="FILE",
                        help="add bleu_tok_lc against this corpus's lowercased, tokenized "
                             "references (Multi30k's tok/*.lc.norm.tok.de.gz)")  # fmt: skip
    args = parser.parse_args(argv)
    try:
        lang = _lang(args.tokenized_refs) if args.tokenized_refs else ""
        hyps = read_lines(args.hyp)
        if not hyps:
            raise ValueError(f"{args.hyp}: no lines to score")
        refs = _same_length(hyps, args.hyp, args.ref)
        scores = score(hyps, refs, args.lowercase)
        if args.compound_split:
            scores["bleu_tok_compound"] = compound_split_bleu(hyps, refs)
        if args.tokenized_refs:
            tok_refs = _same_length(hyps, args.hyp, args.tokenized_refs)
            scores["bleu_tok_lc"] = tokenized_lc_bleu(hyps, tok_refs, lang)
    except (OSError, UnicodeDecodeError, ValueError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(json.dumps(scores, indent=2))
    return 0


def _same_length(hyps: list[str], hyp: str, path: str) -> list[str]:
    lines = read_lines(path)
    if len(hyps) != len(lines):
        raise ValueError(f"{hyp} has {len(hyps)} lines but {path} has {len(lines)}")
    return lines


def _lang(path: str) -> str:
    """The language of a tokenized reference file: its name's last suffix, past any .gz,
    one Moses knows (its tokenizer takes any name, and a wrong one scores quietly)."""
    from sacremoses.corpus import NonbreakingPrefixes

    lang = Path(Path(path).name.removesuffix(".gz")).suffix[1:]
    if len(lang) != 2 or lang not in NonbreakingPrefixes().available_langs:
        raise ValueError(f"{path}: name the language as the file's last suffix, as the "
                         "corpus does (test_2016_flickr.lc.norm.tok.de)")  # fmt: skip
    return lang
