"""Scores agree with the sacreBLEU command line; compounds split as get_ende_bleu.sh does."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
from sacrebleu.metrics import BLEU

from transformer.evaluate import main, score, score_files, split_compounds, tokenize_compound

HYPS = [
    "Das Haus ist klein.",
    "Die Katze sitzt auf der Matte, sagte er.",
    "Wir treffen uns um 5 Uhr im Rich-Text-Format-Büro.",
    "Ein völlig anderer Satz",
    "„Ja“, antwortete sie – ganz ruhig.",
]
REFS = [
    "Das Haus ist sehr klein.",
    "Die Katze saß auf der Matte, sagte er.",
    "Wir treffen uns um 17 Uhr im Büro.",
    "Ein ganz anderer Satz.",
    "„Ja“, antwortete sie ruhig.",
]


@pytest.fixture
def files(tmp_path):
    hyp, ref = tmp_path / "hyp.txt", tmp_path / "ref.txt"
    hyp.write_text("\n".join(HYPS) + "\n", encoding="utf-8")
    ref.write_text("\n".join(REFS) + "\n", encoding="utf-8")
    return hyp, ref


def cli(*args) -> float:
    exe = Path(sys.executable).with_name("sacrebleu")
    out = subprocess.run([exe, *map(str, args), "-b", "-w", "6"], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    return float(out.stdout)


@pytest.mark.parametrize("lowercase", [False, True])
def test_bleu_and_chrf_match_the_sacrebleu_command_line(files, lowercase):
    hyp, ref = files
    lc = ["-lc"] if lowercase else []
    scores = score_files(hyp, ref, lowercase=lowercase)
    assert scores["bleu"] == pytest.approx(cli(ref, "-i", hyp, *lc), abs=1e-5)
    assert scores["chrf"] == pytest.approx(cli(ref, "-i", hyp, "-m", "chrf", *lc), abs=1e-5)
    assert scores["bleu_signature"].startswith("nrefs:1|case:" + ("lc" if lowercase else "mixed"))
    assert "tok:13a" in scores["bleu_signature"] and "nc:6" in scores["chrf_signature"]


def test_compounds_split_as_in_get_ende_bleu():
    assert split_compounds("rich-text format") == "rich ##AT##-##AT## text format"
    assert split_compounds("a - b") == "a - b"  # a free-standing dash is no compound
    assert split_compounds("a-b-c") == "a ##AT##-##AT## b-c"  # Perl's s///g, matched alike
    assert tokenize_compound(["Das Rich-Text-Format."]) == [
        "Das Rich ##AT##-##AT## Text ##AT##-##AT## Format ."
    ]


def test_tokenized_compound_bleu_credits_compound_parts():
    hyp, ref = ["Das Rich-Text-Format ist alt ."], ["Das Rich-Text-Dokument ist alt ."]
    expected = BLEU(tokenize="none", smooth_method="none").corpus_score(
        ["Das Rich ##AT##-##AT## Text ##AT##-##AT## Format ist alt ."],
        [["Das Rich ##AT##-##AT## Text ##AT##-##AT## Dokument ist alt ."]],
    )
    scores = score(hyp, ref)
    assert scores["bleu_tok_compound"] == pytest.approx(expected.score)
    assert scores["bleu_tok_compound"] > scores["bleu"]  # parts of the compound now match


def test_mismatched_files_are_an_error(files, tmp_path, capsys):
    hyp, _ = files
    short = tmp_path / "short.txt"
    short.write_text("eins\n", encoding="utf-8")
    with pytest.raises(ValueError, match="5 lines"):
        score_files(hyp, short)
    assert main([str(hyp), str(short)]) == 2
    assert "error:" in capsys.readouterr().err


def test_command_line_prints_json(files, capsys):
    hyp, ref = files
    assert main([str(hyp), str(ref)]) == 0
    assert json.loads(capsys.readouterr().out)["bleu"] == pytest.approx(score(HYPS, REFS)["bleu"])
