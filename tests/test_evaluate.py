"""Scores agree with the sacreBLEU command line; compounds split as get_ende_bleu.sh does."""

import gzip
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from sacrebleu.metrics import BLEU

from transformer.config import ScoreConfig
from transformer.decoding.evaluate import (
    compound_split,
    compound_split_bleu,
    main,
    read_lines,
    score,
    score_split,
    tokenized_lc_bleu,
)

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
    scores = score(read_lines(hyp), read_lines(ref), lowercase=lowercase)
    assert scores["bleu"] == pytest.approx(cli(ref, "-i", hyp, *lc), abs=1e-5)
    assert scores["chrf"] == pytest.approx(cli(ref, "-i", hyp, "-m", "chrf", *lc), abs=1e-5)
    assert scores["bleu_signature"].startswith("nrefs:1|case:" + ("lc" if lowercase else "mixed"))
    assert "tok:13a" in scores["bleu_signature"] and "nc:6" in scores["chrf_signature"]


def test_compounds_split_as_in_get_ende_bleu():
    """get_ende_bleu.sh: s{(\\S)-(\\S)}{$1 ##AT##-##AT## $2}g after tokenizing; "a-b-c" splits
    once only (Perl's s///g, matched alike); a free-standing dash is no compound."""
    hyp = ["Das Rich-Text-Format ist a-b-c alt."]
    ref = ["Das Rich-Text-Dokument ist a-b-c alt - sehr."]
    at = "##AT##-##AT##"
    expected = BLEU(tokenize="none", smooth_method="none").corpus_score(
        [f"Das Rich {at} Text {at} Format ist a {at} b-c alt ."],
        [[f"Das Rich {at} Text {at} Dokument ist a {at} b-c alt - sehr ."]],
    )
    assert expected.score > 0 and compound_split_bleu(hyp, ref) == pytest.approx(expected.score)


# get_ende_bleu.sh's own scripts on five sentences of hard cases (quotes, abbreviations, a
# number's comma and dots, "&" and '"' escaped, compounds, a sentence-final "10."): Moses'
# tokenizer.perl -l de and multi-bleu.perl as of the paper (mosesdecoder 59bad94, May 2017),
# the commands in docs/results/bleu.md. sacreBLEU's 13a gives 73.233144 here.
MOSES_HYPS = [
    "„Das ist z.B. ein Test“, sagte Dr. Müller am 3. Oktober in Berlin-Mitte.",
    "Die E-Mail-Adresse (info@example.com) kostet 1.000,50 Euro - oder 20 % mehr?",
    'Er kam um 10 Uhr ... und ging & lachte: "Wir sehen uns!"',
    "Die 3-jährige Tochter spielt im Rich-Text-Format mit der Nummer 10.",
    "Sie hat's gesagt, aber niemand glaubte es ihr.",
]
MOSES_REFS = [
    "„Das ist z.B. ein Test“, sagte Dr. Müller am 3. Oktober im Berlin-Mitte.",
    "Die E-Mail-Adresse (info@example.com) kostet 1.000,50 Euro – oder 20 % mehr.",
    'Er kam um 10 Uhr ... und ging & lachte: "Bis bald!"',
    "Die 3-jährige Tochter spielt mit der Nummer 10.",
    "Sie hat's gesagt, doch keiner glaubte es ihr.",
]
AT = "##AT##-##AT##"
MOSES_HYPS_SPLIT = [
    f"„ Das ist z.B. ein Test “ , sagte Dr. Müller am 3. Oktober in Berlin {AT} Mitte .",
    f"Die E {AT} Mail {AT} Adresse ( info @ example.com ) kostet 1.000,50 Euro - oder 20 % mehr ?",
    "Er kam um 10 Uhr ... und ging &amp; lachte : &quot; Wir sehen uns ! &quot;",
    f"Die 3 {AT} jährige Tochter spielt im Rich {AT} Text {AT} Format mit der Nummer 10.",
    "Sie hat &apos; s gesagt , aber niemand glaubte es ihr .",
]
MOSES_BLEU = 70.999288  # multi-bleu.perl, its "%.2f" widened to "%.6f" (it prints 71.00)


def test_paper_bleu_is_what_the_moses_scripts_give():
    """get_ende_bleu.sh's figure exactly: its tokenization, line for line, and its BLEU."""
    assert compound_split(MOSES_HYPS) == MOSES_HYPS_SPLIT
    assert compound_split_bleu(MOSES_HYPS, MOSES_REFS) == pytest.approx(MOSES_BLEU, abs=1e-6)


def test_scores_follow_the_params_and_say_what_they_are():
    plain = score_split(HYPS, REFS, ScoreConfig(), "de", None)
    assert set(plain) == {"bleu", "chrf", "bleu_lc", "bleu_signature", "chrf_signature",
                          "bleu_lc_signature"}  # fmt: skip
    assert "bleu_tok_compound" in score_split(HYPS, REFS, ScoreConfig(compound_split=True),
                                              "de", None)  # fmt: skip


def test_published_scale_bleu_lowercases_normalises_and_moses_tokenizes(tmp_path):
    """Multi30k papers: hypotheses lowercased, punctuation-normalised, Moses-tokenized
    (escaped as tokenizer.perl does), multi-bleu against the corpus's tokenized references."""
    hyps = ['Ein Mann sagt: "Hallo, Welt!"', "Zwei Hunde laufen im Park."]
    refs = ["ein mann sagt : &quot; hallo , welt ! &quot;", "zwei hunde rennen im park ."]
    one_miss = BLEU(tokenize="none", smooth_method="none").corpus_score(
        ["ein mann sagt : &quot; hallo , welt ! &quot;", "zwei hunde laufen im park ."], [refs]
    )
    assert tokenized_lc_bleu(hyps, refs, "de") == pytest.approx(one_miss.score)
    assert tokenized_lc_bleu(hyps[:1], refs[:1], "de") == pytest.approx(100.0)
    path = tmp_path / "test.lc.norm.tok.de"
    path.write_text("\n".join(refs) + "\n", encoding="utf-8")
    scores = score_split(hyps, ["x", "y"], ScoreConfig(), "de", path)
    assert scores["bleu_tok_lc"] == pytest.approx(one_miss.score)


def test_mismatched_files_are_an_error(files, tmp_path, capsys):
    hyp, _ = files
    short = tmp_path / "short.txt"
    short.write_text("eins\n", encoding="utf-8")
    assert main([str(hyp), str(short)]) == 2
    assert "error:" in capsys.readouterr().err


def test_command_line_prints_json(files, capsys):
    hyp, ref = files
    assert main([str(hyp), str(ref)]) == 0
    assert json.loads(capsys.readouterr().out)["bleu"] == pytest.approx(score(HYPS, REFS)["bleu"])


def test_command_line_scores_on_the_papers_scales(tmp_path, capsys):
    """A hypothesis file from anywhere (an ad hoc ensemble's) on the scales the decode stage
    reports: the paper's compound-split BLEU, and a corpus's tokenized references."""
    hyp, ref = tmp_path / "hyp.de", tmp_path / "ref.de"
    hyp.write_text("\n".join(MOSES_HYPS) + "\n", encoding="utf-8")
    ref.write_text("\n".join(MOSES_REFS) + "\n", encoding="utf-8")
    tok = tmp_path / "test_2016_flickr.lc.norm.tok.de.gz"
    tok.write_bytes(gzip.compress(("\n".join(MOSES_REFS).lower() + "\n").encode()))
    args = [str(hyp), str(ref), "--compound-split", "--tokenized-refs", str(tok)]
    assert main(args) == 0
    got = json.loads(capsys.readouterr().out)
    assert got["bleu_tok_compound"] == pytest.approx(MOSES_BLEU, abs=1e-6)
    lowered = [line.lower() for line in MOSES_REFS]
    assert got["bleu_tok_lc"] == pytest.approx(tokenized_lc_bleu(MOSES_HYPS, lowered, "de"))
    for name in ("refs.gz", "refs.tok.gz", "refs.txt"):  # no language Moses knows
        nameless = tmp_path / name
        nameless.write_bytes(tok.read_bytes())
        assert main([str(hyp), str(ref), "--tokenized-refs", str(nameless)]) == 2
        assert capsys.readouterr().err == (
            f"error: {nameless}: name the language as the file's last suffix, as the corpus "
            "does (test_2016_flickr.lc.norm.tok.de)\n"
        )


def test_attention_maps_are_the_models_own_weights(tmp_path):
    """Recomputed from the module's projections, the weights are what SDPA used: applied to
    the values they give the attention's output (before W^O)."""
    from transformer.config import ModelConfig
    from transformer.decoding.attention_maps import attention_weights, plot_attention
    from transformer.nn.model import Transformer

    torch.manual_seed(0)
    model = Transformer(ModelConfig(n_layers=2, d_model=16, d_ff=32, n_heads=4), 30).eval()
    src, tgt = [5, 6, 7, 3], [8, 9, 3]
    weights = attention_weights(model, src, tgt)
    assert set(weights) == {"encoder.0", "encoder.1", "cross.0", "cross.1"}
    assert weights["encoder.0"].shape == (4, 4, 4) and weights["cross.1"].shape == (4, 3, 4)
    for w in weights.values():
        torch.testing.assert_close(w.sum(-1), torch.ones(w.shape[:2]))
    layer = model.encoder[0].self_attn
    x = model._embed(torch.tensor([src]), model.src_embed, None, 0)
    q, k, v = layer._project(x, None, None)
    expected = torch.nn.functional.scaled_dot_product_attention(q, k, v)[0]  # (h, S, d_k)
    torch.testing.assert_close(weights["encoder.0"] @ v[0], expected, rtol=1e-5, atol=1e-6)
    paths = plot_attention(weights, list("abcd"), list("xyz"), tmp_path)
    assert sorted(p.name for p in paths) == ["cross-1.png", "cross-2.png", "encoder-1.png",
                                             "encoder-2.png"]  # fmt: skip
