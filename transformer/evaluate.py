"""Detokenize and score translations: sacreBLEU (the reproducible standard) and the paper's
tokenized, compound-split BLEU.

- `bleu`, `chrf`: sacreBLEU on detokenized output against the raw references, each with
  sacreBLEU's signature so a number can be compared only with numbers made the same way.
- `bleu_tok_compound`: what the paper reports for EN-DE (tensor2tensor's get_ende_bleu.sh):
  tokenized hypotheses and references, compounds split as "rich ##AT##-##AT## text", then
  multi-bleu.perl. Here the tokenizer is sacreBLEU's 13a instead of Moses' tokenizer.perl
  (no Perl, no Moses checkout), so the figure is close to the paper's method, not identical
  to it; multi-bleu.perl does not smooth, and neither does this.

`python -m transformer.evaluate HYP REF [--lowercase]` prints the scores as JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys

from sacrebleu.metrics import BLEU, CHRF
from sacrebleu.tokenizers.tokenizer_13a import Tokenizer13a

# get_ende_bleu.sh: perl -ple 's{(\S)-(\S)}{$1 ##AT##-##AT## $2}g'. Python's re.sub, like
# Perl's s///g, replaces non-overlapping matches left to right, so "a-b-c" gives
# "a ##AT##-##AT## b-c" in both: the script's quirk is kept, to stay comparable.
_COMPOUND = re.compile(r"(\S)-(\S)")


def detokenize(sp, ids: list[list[int]]) -> list[str]:
    """Subword ids (no BOS/EOS) to text with the sentencepiece model."""
    return [sp.decode(x) for x in ids]


def split_compounds(line: str) -> str:
    return _COMPOUND.sub(r"\1 ##AT##-##AT## \2", line)


def tokenize_compound(lines: list[str]) -> list[str]:
    """get_ende_bleu.sh's preprocessing, with the 13a tokenizer standing in for Moses'."""
    tok = Tokenizer13a()
    return [split_compounds(tok(line)) for line in lines]


def score(hyps: list[str], refs: list[str], lowercase: bool = False) -> dict:
    """BLEU and chrF (sacreBLEU, with signatures) and the paper's tokenized compound BLEU."""
    if len(hyps) != len(refs):
        raise ValueError(f"{len(hyps)} hypotheses but {len(refs)} references")
    bleu, chrf = BLEU(lowercase=lowercase), CHRF(lowercase=lowercase)
    tok_bleu = BLEU(lowercase=lowercase, tokenize="none", smooth_method="none", force=True)
    return {
        "bleu": bleu.corpus_score(hyps, [refs]).score,
        "chrf": chrf.corpus_score(hyps, [refs]).score,
        "bleu_tok_compound": tok_bleu.corpus_score(
            tokenize_compound(hyps), [tokenize_compound(refs)]
        ).score,
        "bleu_signature": str(bleu.get_signature()),
        "chrf_signature": str(chrf.get_signature()),
    }


def read_lines(path: str | os.PathLike) -> list[str]:
    """One sentence per line, split on "\\n" only (as sacreBLEU reads files)."""
    with open(path, encoding="utf-8", newline="\n") as f:
        return [line.rstrip("\r\n") for line in f]


def score_files(
    hyp_path: str | os.PathLike, ref_path: str | os.PathLike, lowercase: bool = False
) -> dict:
    hyps, refs = read_lines(hyp_path), read_lines(ref_path)
    if len(hyps) != len(refs):
        raise ValueError(f"{hyp_path} has {len(hyps)} lines but {ref_path} has {len(refs)}")
    return score(hyps, refs, lowercase)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m transformer.evaluate", description=__doc__)
    parser.add_argument("hyp", help="detokenized translations, one per line")
    parser.add_argument("ref", help="raw references, one per line")
    parser.add_argument("--lowercase", action="store_true", help="case-insensitive scores")
    args = parser.parse_args(argv)
    try:
        scores = score_files(args.hyp, args.ref, args.lowercase)
    except (OSError, UnicodeDecodeError, ValueError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(json.dumps(scores, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
