"""The preflight (transformer/training/preflight.py): every file the params name, every
cross-key constraint, the learning rate's peak, the updates and epochs, found from the
params alone, before any stage; through `python -m transformer.config --check` and the
flow's start, one line and exit code 2."""

from __future__ import annotations

import gzip
import subprocess
import sys
from pathlib import Path

import pytest

from flows import wmt14_ende as flow
from transformer.config import load_params
from transformer.training import preflight as pf
from transformer.training.preflight import PreflightError, preflight

ROOT = Path(__file__).resolve().parents[1]
SMOKE = ROOT / "params" / "smoke.yaml"
MULTI30K = ROOT / "params" / "multi30k.yaml"


def _corpus(root: Path, pairs: int = 40, langs=("en", "cs")) -> Path:
    """A tiny parallel corpus of another pair, `{split}.{lang}`, and its tokenized
    references `tok/{split}.lc.norm.tok.{lang}`."""
    (root / "tok").mkdir(parents=True)
    for split in ("train", "dev", "test"):
        for lang in langs:
            lines = "".join(f"{lang} sentence number {i} .\n" for i in range(pairs))
            (root / f"{split}.{lang}").write_text(lines, encoding="utf-8")
            (root / "tok" / f"{split}.lc.norm.tok.{lang}").write_text(lines, encoding="utf-8")
    return root


def _params(tmp_path: Path, corpus: Path, extends: Path = SMOKE, body: str = "") -> Path:
    path = tmp_path / "en-cs.yaml"
    path.write_text(
        f"extends: {extends}\n"
        "data:\n"
        f"  source: {{hub: null, config: null, revision: null, path: {corpus}, format: text}}\n"
        "  src_lang: en\n  tgt_lang: cs\n"
        "  splits: {train: train, valid: dev, test: test}\n"
        "score:\n  compound_split: false\n  tokenized_refs: null\n" + body,
        encoding="utf-8",
    )
    return path


def _run(path: Path, *overrides: str) -> list[str]:
    return preflight(load_params(path, list(overrides)), path, list(overrides))


def _error(path: Path, *overrides: str) -> str:
    with pytest.raises(PreflightError) as err:
        _run(path, *overrides)
    message = str(err.value)
    assert "\n" not in message
    return message


@pytest.fixture
def corpus(tmp_path) -> Path:
    return _corpus(tmp_path / "en-cs")


# --------------------------------------------------------------------------- files


def test_a_corpus_of_another_pair_passes_and_is_counted(tmp_path, corpus):
    lines = _run(_params(tmp_path, corpus))
    said = "\n".join(lines)
    assert f"corpus    {corpus} (text, en-cs): train 40 pairs; valid, test found" in said
    # 40 pairs of 5 words + EOS: 240 tokens at least; 600 updates of 2,048 tokens
    assert "at most ~5,120 epochs" in said
    assert not [line for line in lines if line.startswith("warning")]


def test_a_missing_side_names_the_split_and_the_language(tmp_path, corpus):
    (corpus / "dev.cs").unlink()
    message = _error(_params(tmp_path, corpus))
    assert message.startswith("data.splits.valid ('dev'), data.src_lang/tgt_lang: ")
    assert f"{corpus}/dev.cs: no such file (nor dev.cs.gz)" in message


def test_a_source_path_that_is_no_folder(tmp_path, corpus):
    message = _error(_params(tmp_path, tmp_path / "nowhere"))
    assert message == f"{tmp_path / 'nowhere'}: data.source.path is not a directory"


def test_inherited_references_of_another_language_fail_before_anything_runs(tmp_path):
    """The issue's first run: multi30k.yaml's score.tokenized_refs names German and French
    references; a Czech target has none there."""
    corpus = _corpus(tmp_path / "c", langs=("en", "de"))
    for split in ("train", "dev", "test"):
        (corpus / f"{split}.cs").write_text("x\n" * 40)
    refs = f"score.tokenized_refs={corpus / 'tok'}"  # multi30k.yaml's holds de, en, fr
    message = _error(_params(tmp_path, corpus, MULTI30K), refs)
    assert message.startswith("score.tokenized_refs, data.tgt_lang: ")
    assert f"{corpus / 'tok'} has no dev.lc.norm.tok.cs (nor .gz) (it holds de, en)" in message
    (corpus / "tok" / "dev.lc.norm.tok.cs").write_text("x\n")
    with gzip.open(corpus / "tok" / "test.lc.norm.tok.cs.gz", "wt") as f:
        f.write("x\n")
    _run(_params(tmp_path, corpus, MULTI30K), refs)


def test_compound_splitting_for_a_target_other_than_german_is_a_warning(tmp_path, corpus):
    lines = _run(_params(tmp_path, corpus), "score.compound_split=true")
    assert "warning: score.compound_split: splits German compounds; data.tgt_lang is 'cs'" in (
        "\n".join(lines)
    )


def test_a_hub_source_is_not_counted(tmp_path):
    said = "\n".join(_run(ROOT / "params" / "base.yaml"))
    assert "wmt/wmt14 (de-en, revision b199e406369e): its size is unknown until prepare" in said
    assert "epochs unknown until prepare" in said


def test_a_large_file_is_counted_from_a_sample(tmp_path, monkeypatch):
    text = tmp_path / "big.en"
    text.write_bytes(b"one two three\n" * 10_000)  # 140,000 bytes
    assert pf._count_words(text) == (10_000, 30_000, True)
    monkeypatch.setattr(pf, "SAMPLE_BYTES", 14_000)
    lines, words, exact = pf._count_words(text)
    assert not exact and 9_000 <= lines <= 11_000 and words == pytest.approx(3 * lines, rel=0.01)
    packed = tmp_path / "big.en.gz"
    packed.write_bytes(gzip.compress(text.read_bytes()))
    assert pf._count_words(packed)[2] is False
    monkeypatch.setattr(pf, "SAMPLE_BYTES", 1 << 20)
    assert pf._count_words(packed) == (10_000, 30_000, True)


def test_words_split_between_blocks_count_once(tmp_path, monkeypatch):
    text = tmp_path / "t.en"
    text.write_bytes(b"abc def" * 3 + b"\nlast line without end")
    assert pf._count_words(text) == (2, 8, True)  # "abc defabc defabc def", "last line ..."


# --------------------------------------------------------------------------- cross-key


def test_averaging_more_snapshots_than_training_keeps(tmp_path, corpus):
    """The issue's second run: 120 updates saved every 60 leave 2 snapshots; 5 to average."""
    path = _params(tmp_path, corpus)
    message = _error(
        path, "train.max_steps=120", "train.save_every=60", "train.keep_last=5", "average.last_n=5"
    )
    assert message == (
        "average.last_n, train.save_every, train.max_steps: 5 last "
        "snapshots to average, but training is sure to keep 2 snapshots (train.save_every 60, "
        "and the last update): average fewer, or save more often"
    )
    said = "\n".join(_run(path, "train.max_steps=130", "train.save_every=60"))
    assert "average   the last 3 of 3 snapshots (train.save_every 60, and the last update)" in said


def test_the_best_snapshots_count_only_where_validations_and_saves_meet(tmp_path, corpus):
    path = _params(tmp_path, corpus)
    best = ["train.keep_best=5", "average.select=best", "average.last_n=5"]
    # validations at 100..600 and saves at 150..600 meet at 300 and 600, the first (100)
    # is always a new best: 3 sure of 6 validations
    message = _error(path, *best, "train.valid_every=100", "train.save_every=150")
    assert (
        "training is sure to keep 3 scored snapshots (scored where train.valid_every 100 "
        "meets save_every 150, and at the last update)" in message
    )
    said = "\n".join(_run(path, *best, "train.valid_every=100", "train.save_every=100"))
    assert "average   the best 5 of 6 scored snapshots" in said
    # without keep_best, off-cadence validations save nothing: the first is not sure either
    assert pf.cadence(300, 600) == 2 and pf.cadence(7, 20) == 3


def test_snapshots_in_the_cooldown_and_of_each_cooldown(tmp_path, corpus):
    path = _params(tmp_path, corpus)
    said = "\n".join(_run(path, "train.cooldown=0.25", "average.cooldowns=2"))
    # updates 451-600 anneal: the snapshots of 500 and 600 of the last 3 (400, 500, 600)
    assert (
        "the last 3 of 6 snapshots (train.save_every 100, and the last update), from "
        "each of 2 cooldowns; 2 of the 3 in the cooldown" in said
    )
    assert "to ~0 over updates 451-600" in said


def test_cadences_longer_than_the_run_are_warnings(tmp_path, corpus):
    lines = _run(
        _params(tmp_path, corpus),
        "train.max_steps=50",
        "train.save_every=100",
        "train.valid_every=200",
        "train.log_every=60",
        "train.patience=2",
        "average.last_n=1",
    )
    warnings = [line for line in lines if line.startswith("warning: ")]
    assert warnings == [
        "warning: train.save_every 100 > train.max_steps 50: nothing is saved before the last "
        "update (a stop before it loses the run)",
        "warning: train.valid_every 200 > train.max_steps 50: one validation, at the end",
        "warning: train.log_every 60 > train.max_steps 50: no training line before the end",
        "warning: train.patience 2: training validates 1 time(s) (train.valid_every, "
        "max_steps): it never stops early",
    ]


# --------------------------------------------------------------------------- learning rate


def test_the_peak_is_printed_and_a_shortened_warmup_warns(tmp_path, corpus):
    """The issue's third run: warmup_steps 60 under multi30k.yaml's lr_scale is 4.1x its
    peak; the line says which lr_scale keeps the parent's."""
    path = _params(tmp_path, corpus, MULTI30K, "train:\n  warmup_steps: 60\n")
    lines = _run(path)
    peak = 128**-0.5 * 60**-0.5 * 0.894
    assert (
        f"lr        peak {peak:.1e} at update 60 = d_model^-0.5 x warmup_steps^-0.5 x "
        "lr_scale = 128^-0.5 x 60^-0.5 x 0.894; held, to ~0 over updates 3,745-4,680"
    ) in lines
    assert lines[-1] == (
        "warning: train.warmup_steps 60: the learning rate's peak is 1.0e-02, 4.1x "
        "multi30k.yaml's 2.5e-03 (lr_scale unchanged); train.lr_scale=0.219 keeps "
        "multi30k.yaml's peak"
    )
    chosen = _run(path, "train.lr_scale=0.3")  # a run that sets lr_scale chose its peak
    assert not [line for line in chosen if line.startswith("warning")]
    # an override is measured against the file as written
    assert "4.1x en-cs.yaml's" not in "\n".join(_run(path, "train.warmup_steps=50"))
    assert "2.2x smoke.yaml's" in "\n".join(_run(SMOKE, "train.warmup_steps=20"))


@pytest.mark.parametrize("name", sorted(p.stem for p in (ROOT / "params").glob("*.yaml")))
def test_the_shipped_params_pass_without_a_warning(name):
    path = ROOT / "params" / f"{name}.yaml"
    source = load_params(path).data.source.path  # relative to where the flow runs
    if source is not None and not Path(source).is_dir():
        pytest.skip(f"no {source} here")
    lines = _run(path)
    assert [line.split()[0] for line in lines] == ["corpus", "lr", "updates", "average"]


# --------------------------------------------------------------------------- commands


def test_the_flow_stops_before_prefect_starts(tmp_path, corpus, capsys):
    path = _params(tmp_path, corpus)
    code = flow.main(
        [str(path), "average.last_n=7", "train.keep_last=7", "--work-dir", str(tmp_path / "work")]
    )
    err = capsys.readouterr().err.strip()
    assert code == 2 and err.startswith(
        "error: average.last_n, train.save_every, train.max_steps: 7 last"
    )
    assert "\n" not in err and not (tmp_path / "work").exists()


def test_config_check_runs_it_alone(tmp_path, corpus):
    path = _params(tmp_path, corpus)
    check = [sys.executable, "-m", "transformer.config", str(path), "--check"]
    run = subprocess.run(check, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    assert run.stdout.splitlines()[0].startswith("corpus ")
    (corpus / "test.en").unlink()
    run = subprocess.run(check, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert run.returncode == 2 and run.stdout == ""
    assert run.stderr.startswith("error: data.splits.test ('test')") and run.stderr.count("\n") == 1
