"""Sequence-level distillation as stages: the library function on random models, then
teachers -> distill -> student through the real flow on a corpus cut from the smoke data
(real Prefect, MLflow, torchrun), a second student over the same teachers, and a kill inside
the distill stage with its rerun, byte for byte."""

from __future__ import annotations

import functools
import json
import logging
import multiprocessing
import os
import pickle
import re
import shutil
import signal
import subprocess
import sys
import textwrap
from pathlib import Path
from types import SimpleNamespace

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from conftest import count_arenas, ends_within, wait_for
from mlflow.tracking import MlflowClient
from prefect.client.orchestration import get_client
from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterKey
from test_translate import write_model_file

from flows.pipeline import wmt14_ende
from tasks.distill import check_teachers, fetch_registered, gather_teachers, teacher_files
from tasks.registry import register
from tasks.runner import is_user_error
from tasks.settings import load_run_params
from tasks.stages import StageRun
from transformer.config import DataConfig, DistillConfig, ParamsError, ScoreConfig, load_params
from transformer.data import DataError
from transformer.decoding import distill as distill_module
from transformer.decoding import evaluate as evaluate_module
from transformer.decoding import helpers as helpers_module
from transformer.decoding import translate as translate_module
from transformer.decoding.distill import distill_corpus
from transformer.decoding.translate import load_ensemble, translate_lines
from transformer.nn import kv_cache

ROOT = Path(__file__).resolve().parents[1]
pytestmark = [pytest.mark.usefixtures("one_thread"), pytest.mark.timeout(1800)]


# --------------------------------------------------------------------------- the library


@pytest.fixture(scope="module")
def cleaned(tmp_path_factory) -> Path:
    """A cleaned corpus of test_translate's words, 7 training pairs, 3 valid, 2 test."""
    folder = tmp_path_factory.mktemp("cleaned")
    train = ["the cat sat", "a house", "the mat is small", "das haus", "", "a cat", "the cat sat"]
    splits = {"train": train, "valid": ["the cat", "a mat", "das"], "test": ["a small cat", "x"]}
    for role, src in splits.items():
        table = pa.table({"src": src, "tgt": [s.upper() for s in src]})
        pq.write_table(table, folder / f"{role}.parquet")
    return folder


@pytest.fixture(scope="module")
def teachers(tmp_path_factory) -> list[Path]:
    folder = tmp_path_factory.mktemp("teachers")
    return [write_model_file(folder / f"t{seed}.pt", seed) for seed in (1, 2)]


DATA = DataConfig(source={"path": "unused"}, src_lang="en", tgt_lang="de")
TINY_SEARCH = {"beam_size": 2, "max_len_b": 6}


def distill_cfg(**keys) -> DistillConfig:
    keys = {"part_pairs": 3, "decode": TINY_SEARCH} | keys
    return DistillConfig(teachers={"models": ["t1.pt"]}, **keys)


def test_the_training_targets_are_the_ensembles_beam_translations(cleaned, teachers, tmp_path):
    cfg = distill_cfg()
    report = distill_corpus(cleaned, teachers, cfg, DATA, ScoreConfig(), tmp_path, ["cpu"])
    models, sp, _ = load_ensemble([str(t) for t in teachers], "cpu")
    sources = pq.read_table(cleaned / "train.parquet")["src"].to_pylist()
    made = translate_lines(models, sp, sources, cfg.decode, "cpu")
    want = [(s, t) for s, t in zip(sources, made, strict=True) if t]  # empty ones dropped
    got = pq.read_table(tmp_path / "train.parquet")
    assert list(zip(got["src"].to_pylist(), got["tgt"].to_pylist(), strict=True)) == want
    assert report["pairs"] == report["distilled"] == len(want)
    assert report["dropped_empty"] == len(sources) - len(want) >= 1  # the empty line
    assert sorted(p.name for p in (tmp_path / "parts").iterdir()) == [
        "00000.parquet", "00001.parquet", "00002.parquet"
    ]  # fmt: skip
    for role in ("valid", "test"):  # untouched: the student is scored on the real references
        assert (tmp_path / f"{role}.parquet").read_bytes() == (
            cleaned / f"{role}.parquet"
        ).read_bytes()
        assert (tmp_path / f"{role}.hyp").is_file()
    assert set(report["scores"]) == {"valid", "test"} and "bleu" in report["scores"]["valid"]


def test_every_part_decodes_into_one_cache_memory(cleaned, teachers, tmp_path, monkeypatch):
    """An Arena a part, freed after it, grew the stage's process by about a GB a part of
    2,000 sentences (three teachers on a CPU: glibc keeps the freed heap); the flow that
    distilled 13 of Multi30k's 15 parts peaked at 18.9 GB. The stage keeps one for all."""
    made = count_arenas(monkeypatch, distill_module, translate_module)
    models, sp, _ = load_ensemble([str(t) for t in teachers], "cpu")
    source = cleaned / "train.parquet"
    read = functools.partial(distill_module._read_rows, source, "src")
    total = pq.read_metadata(source).num_rows
    hyps = distill_module._translate_parts(
        models, sp, read, total, distill_cfg(), tmp_path, ["cpu"], []
    )
    assert len(list(tmp_path.glob("*.parquet"))) == 3 and len(hyps) == total
    assert len(made) == 1


def test_valid_and_test_decode_into_one_cache_memory(cleaned, teachers, tmp_path, monkeypatch):
    """The ensemble's scores, as the decode stage's: both splits in one cache memory."""
    made = count_arenas(monkeypatch, kv_cache, translate_module)  # evaluate imports it late
    models, sp, _ = load_ensemble([str(t) for t in teachers], "cpu")
    scores, _ = evaluate_module.translate_and_score(
        models, sp, cleaned, DATA, distill_cfg().decode, ScoreConfig(), tmp_path, "cpu"
    )
    assert set(scores) == {"valid", "test"} and len(made) == 1


def test_a_share_is_read_through_the_file_range_by_range(tmp_path):
    """A process reads its parts' rows only, a range at a time as it asks (here batches of
    a row group of 3 rows): ranges across batches, an empty one; none asked, no read; a
    range past the end of the file is one line naming it."""
    path = tmp_path / "train.parquet"
    lines = [f"line {i}" for i in range(10)]
    pq.write_table(pa.table({"src": lines}), path, row_group_size=3)
    read = functools.partial(distill_module._read_rows, path, "src")
    got = read([slice(0, 1), slice(2, 5), slice(5, 5), slice(8, 10)])
    assert next(got) == lines[0:1]
    assert list(got) == [lines[2:5], [], lines[8:10]]
    assert list(read([])) == []
    with pytest.raises(DataError, match=r"train.parquet: 10 rows, where rows up to 12 were"):
        list(read([slice(8, 12)]))


def test_a_stopped_distillation_resumes_at_its_first_missing_part(
    cleaned, teachers, tmp_path, caplog
):
    whole, resumed = tmp_path / "whole", tmp_path / "resumed"
    distill_corpus(cleaned, teachers, distill_cfg(), DATA, ScoreConfig(), whole, ["cpu"])
    (resumed / "parts").mkdir(parents=True)
    shutil.copy(whole / "parts" / "00000.parquet", resumed / "parts")
    (resumed / "parts" / ".00001.parquet.0123.tmp").write_bytes(b"half a part")
    # A part found is read back, not translated again: a wrong one shows in the corpus.
    caplog.set_level(logging.INFO, logger="transformer")
    distill_corpus(cleaned, teachers, distill_cfg(), DATA, ScoreConfig(), resumed, ["cpu"])
    assert "distilling: 1/3 parts written by a stopped run, read back" in caplog.messages
    assert (resumed / "train.parquet").read_bytes() == (whole / "train.parquet").read_bytes()
    assert not list((resumed / "parts").glob(".*"))


def test_the_missing_parts_are_dealt_out_to_a_process_a_device(
    cleaned, teachers, tmp_path, monkeypatch
):
    """Three devices, three parts: this process translates the first, a helper process
    each of the others, and the corpus is the one a single process writes. A helper is
    sent its parts' rows, not their lines (tens of MB a helper at WMT scale)."""
    alone, dealt = tmp_path / "alone", tmp_path / "dealt"
    distill_corpus(cleaned, teachers, distill_cfg(), DATA, ScoreConfig(), alone, ["cpu"])
    here, translate = [], distill_module.translate_lines
    monkeypatch.setattr(distill_module, "translate_lines",
                        lambda m, sp, lines, *a, **kw: here.append(lines) or translate(
                            m, sp, lines, *a, **kw))  # fmt: skip
    sent = _record_helpers_args(monkeypatch)
    devices = ["cpu"] * 3
    distill_corpus(cleaned, teachers, distill_cfg(), DATA, ScoreConfig(), dealt, devices)
    sources = pq.read_table(cleaned / "train.parquet")["src"].to_pylist()
    assert here == [sources[:3]]  # the stage's own share; valid and test: evaluate's
    assert (dealt / "train.parquet").read_bytes() == (alone / "train.parquet").read_bytes()
    assert not multiprocessing.active_children()
    assert len(sent) == 2 and not any(b"das haus" in pickle.dumps(a) for a in sent)


def _record_helpers_args(monkeypatch) -> list[tuple]:
    """What the stage sends each helper process it starts."""
    sent, spawn = [], multiprocessing.get_context("spawn")

    def process(*a, args=(), **kw):
        sent.append(args)
        return spawn.Process(*a, args=args, **kw)

    context = SimpleNamespace(Pipe=spawn.Pipe, Process=process)
    monkeypatch.setattr(helpers_module, "multiprocessing",
                        SimpleNamespace(get_context=lambda kind: context))  # fmt: skip
    return sent


def test_a_helper_that_fails_ends_the_stage_naming_its_device(cleaned, teachers, tmp_path):
    """A user error in a helper (its part's path taken by a folder) is one line naming the
    device and the path; a bug (a CUDA device on this CPU build) keeps its traceback. The
    stage's own parts (the first and the third) are kept for the rerun, no corpus is."""
    taken = tmp_path / "user" / "parts" / "00001.parquet"
    taken.mkdir(parents=True)
    with pytest.raises(helpers_module.HelperFailed) as failed:
        distill_corpus(cleaned, teachers, distill_cfg(), DATA, ScoreConfig(),
                       tmp_path / "user", ["cpu", "cpu"])  # fmt: skip
    message = str(failed.value)
    assert message.startswith("distill helper 1 (cpu): ") and "\n" not in message
    assert "00001.parquet" in message and is_user_error(failed.value)
    with pytest.raises(helpers_module.HelperCrashed) as crashed:
        distill_corpus(cleaned, teachers, distill_cfg(), DATA, ScoreConfig(),
                       tmp_path / "bug", ["cpu", "cuda:7"])  # fmt: skip
    assert str(crashed.value).startswith("distill helper 1 (cuda:7): Traceback")
    assert not is_user_error(crashed.value)
    parts = sorted(p.name for p in (tmp_path / "bug" / "parts").iterdir())
    assert parts == ["00000.parquet", "00002.parquet"]
    assert not (tmp_path / "bug" / "train.parquet").exists()
    assert not multiprocessing.active_children()


def _killed(path: Path, hyps: list[str]) -> None:  # a helper's write: the OOM killer's way
    os.kill(os.getpid(), signal.SIGKILL)


def _a_house(wanted: list[slice]) -> list[list[str]]:  # a helper's lines
    return [["a house"] for _ in wanted]


def test_a_helper_killed_without_a_word_is_named_with_its_signal(teachers, tmp_path):
    share = [("cpu", {tmp_path / "00000.parquet": slice(0, 1)})]
    teacher_paths, cfg = [str(t) for t in teachers], distill_cfg().decode
    killed = r"distill helper 1 \(cpu\) ended: killed by signal 9 \(Killed\)"
    with (
        helpers_module.helped(share, _a_house, teacher_paths, cfg, 1, _killed) as helpers,
        pytest.raises(helpers_module.HelperCrashed, match=killed),
    ):
        helpers.wait(lambda: None)
    assert not multiprocessing.active_children()


SLOW = """\
import os, sys, time
from pathlib import Path
from transformer.config import DecodeConfig
from transformer.decoding.helpers import helped

def read(wanted):
    return [["a house"] for _ in wanted]

def write(path, hyps):  # a part that takes a minute
    Path(os.environ["HELPER_PID"]).write_text(str(os.getpid()))
    time.sleep(60)

if __name__ == "__main__":
    share = [("cpu", {Path(sys.argv[1]): slice(0, 1)})]
    with helped(share, read, sys.argv[2:], DecodeConfig(beam_size=1), 1, write) as helpers:
        helpers.wait(lambda: None)
"""


def test_a_helper_whose_stage_is_killed_outright_ends_too(teachers, tmp_path):
    """SIGKILL to the stage's process alone (the OOM killer's choice): its helpers end with
    it, not at the end of their part (hours on a GPU at WMT scale), beside the rerun."""
    (tmp_path / "slow.py").write_text(SLOW)
    pid_file = tmp_path / "helper.pid"
    env = {**os.environ, "PYTHONPATH": f"{tmp_path}:{ROOT}", "HELPER_PID": str(pid_file)}
    cmd = [sys.executable, "-m", "slow", str(tmp_path / "part.parquet"), *map(str, teachers)]
    stage = subprocess.Popen(cmd, cwd=tmp_path, env=env, stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT, text=True)  # fmt: skip
    wait_for(pid_file.is_file, 120, stage, "the helper's first part")
    helper = int(pid_file.read_text())
    stage.kill()
    stage.wait()
    assert ends_within(helper, 30), "the helper outlived its stage by 30 s"


def test_a_stop_in_the_stage_ends_its_helpers(cleaned, teachers, tmp_path, monkeypatch):
    """Ctrl-C (or the flow's stop) in the stage's process while helpers translate: none
    outlives the stage, and what they wrote is whole parts only."""

    def stop(self):
        raise KeyboardInterrupt

    monkeypatch.setattr(distill_module._Written, "count", stop)
    with pytest.raises(KeyboardInterrupt):
        distill_corpus(cleaned, teachers, distill_cfg(part_pairs=1), DATA, ScoreConfig(),
                       tmp_path, ["cpu"] * 2)  # fmt: skip
    assert not multiprocessing.active_children()
    for part in (tmp_path / "parts").glob("*.parquet"):
        assert pq.read_table(part).num_rows == 1


def test_the_originals_can_stay_beside_the_distilled_pairs(cleaned, teachers, tmp_path):
    cfg = distill_cfg(keep_originals=True)
    report = distill_corpus(cleaned, teachers, cfg, DATA, ScoreConfig(), tmp_path, ["cpu"])
    got = pq.read_table(tmp_path / "train.parquet")
    original = pq.read_table(cleaned / "train.parquet")
    assert got.slice(0, original.num_rows).to_pylist() == original.to_pylist()
    assert report["originals"] == original.num_rows
    assert report["pairs"] == original.num_rows + report["distilled"]


def test_the_source_side_needs_teachers_of_the_reverse_direction(cleaned, teachers, tmp_path):
    cfg = distill_cfg(replace="source")
    with pytest.raises(DataError, match=r"t1\.pt: translates en->de; .*teachers of de->en"):
        distill_corpus(cleaned, teachers, cfg, DATA, ScoreConfig(), tmp_path, ["cpu"])
    assert not (tmp_path / "train.parquet").exists()


# ------------------------------------------------------------- teachers from the registry


def test_registered_teachers_are_fetched_once_into_the_work_dir(teachers, tmp_path):
    """`models:/NAME/VERSION` and `models:/NAME@ALIAS` teachers: versions registered as the
    flow registers its models (a real SQLite store), fetched into the work dir once, then
    model files like any other, named by their version in the teachers' record."""
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    client = MlflowClient(uri)
    run = {"uri": uri, "registered_model": "teacher",
           "run_id": client.create_run(client.create_experiment(
               "e", artifact_location=str(tmp_path / "mlartifacts"))).info.run_id}  # fmt: skip
    test = {"bleu": 1.0, "bleu_lc": 1.0, "chrf": 1.0, "bleu_signature": "-"}
    for i, model in enumerate(teachers):  # version 1, then 2 (@best: the higher valid BLEU)
        register(run, model, {"valid": {"bleu": float(i)}, "test": test}, f"fp{i}", {})
    student = tmp_path / "student.yaml"
    student.write_text(f"extends: {ROOT / 'params' / 'smoke.yaml'}\ndistill:\n  teachers:\n"
                       "    models: [models:/teacher/1, models:/teacher@best]\n")  # fmt: skip
    params = load_run_params(student)
    check_teachers(params, student)
    work = tmp_path / "work"
    fetched = fetch_registered(params, uri, work).distill.teachers.models
    assert fetched == [str(work / "registry" / "teacher" / v / "model.pt") for v in ("1", "2")]
    for path, model in zip(fetched, teachers, strict=True):
        assert Path(path).read_bytes() == model.read_bytes()
    shutil.rmtree(tmp_path / "mlartifacts")  # fetched once: the work dir's copies serve
    resolved = fetch_registered(params, uri, work)
    assert resolved.distill.teachers.models == fetched
    r = StageRun(resolved, {}, {}, work / "teachers" / "k", student, {}, "cpu")
    report = gather_teachers(r)["teachers"]
    assert [t["registered"] for t in report] == ["models:/teacher/1", "models:/teacher/2"]
    assert report[0]["model"] == "registry/teacher/1/model.pt"  # a moved work dir finds it
    # What keys the stages is each file's sha256, not its path: a copy is the same teacher.
    moved = shutil.copy(fetched[0], tmp_path / "moved.pt")
    teachers_moved = resolved.distill.teachers.model_copy(update={"models": [moved, fetched[1]]})
    distill_moved = resolved.distill.model_copy(update={"teachers": teachers_moved})
    assert teacher_files(resolved.model_copy(update={"distill": distill_moved})) == (
        teacher_files(resolved)
    )


@pytest.mark.parametrize("model, message", [
    ("models:/teacher/9", "models:/teacher/9: no such registered model version"),
    ("models:/nobody@best", "models:/nobody@best: no such registered model version"),
])  # fmt: skip
def test_a_registered_teacher_that_is_not_there_is_one_line(model, message, tmp_path):
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    client = MlflowClient(uri)
    client.create_registered_model("teacher")
    student = tmp_path / "student.yaml"
    student.write_text(f"extends: {ROOT / 'params' / 'smoke.yaml'}\n"
                       f"distill: {{teachers: {{models: [{model}]}}}}\n")  # fmt: skip
    with pytest.raises(ParamsError, match=f"^distill.teachers.models: {re.escape(message)}"):
        fetch_registered(load_run_params(student), uri, tmp_path / "work")
    assert not (tmp_path / "work" / "registry").exists()


def test_a_registered_name_that_is_no_folder_name_is_one_line(tmp_path):
    student = tmp_path / "student.yaml"
    student.write_text(f"extends: {ROOT / 'params' / 'smoke.yaml'}\n"
                       "distill: {teachers: {models: ['models:/../x/1']}}\n")  # fmt: skip
    with pytest.raises(ParamsError, match=r"models:/\.\./x/1: not models:/NAME/VERSION"):
        check_teachers(load_run_params(student), student)


# --------------------------------------------------------------------------- the flow

STEPS = """\
    model: {n_layers: 1, d_model: 64, d_ff: 128, n_heads: 2}
    train:
      batch_tokens: 1024
      max_tokens: 1024
      max_steps: 20
      warmup_steps: 10
      save_every: 10
      valid_every: 20
      valid_bleu: false
      log_every: 10
      keep_last: 2
    average: {last_n: 2}
    decode: {beam_size: 2, max_len_b: 10}
    export: {formats: []}
"""


@pytest.fixture(scope="module")
def params(tmp_path_factory) -> dict[str, Path]:
    """The teachers' params (the smoke recipe shrunk to one small layer, 20 updates of
    1,024 tokens, on 600 of its pairs), a student distilled from two seeds of them, and a
    second student of another size."""
    folder = tmp_path_factory.mktemp("distill_params")
    corpus = folder / "corpus"
    corpus.mkdir()
    for role, n in (("train", 600), ("valid", 20), ("test", 20)):
        for lang in ("en", "de"):
            lines = (ROOT / "data" / "smoke" / f"{role}.{lang}").read_text().splitlines()[:n]
            (corpus / f"{role}.{lang}").write_text("\n".join(lines) + "\n")
    files = {
        "teacher": f"extends: {ROOT / 'params' / 'smoke.yaml'}\n"
        f"data: {{source: {{path: {corpus}}}}}\nvocab: {{size: 300}}\n" + textwrap.dedent(STEPS),
        "student": "extends: teacher.yaml\ndistill:\n  teachers: {params: teacher.yaml, "
        "seeds: [1, 2]}\n  part_pairs: 200\n  decode: {beam_size: 2, max_len_b: 10}\n",
        "student2": "extends: student.yaml\nmodel: {d_ff: 256}\n",
        # The same teachers as the registry holds them (seed 1 registered first).
        "student3": "extends: student.yaml\ndistill:\n  teachers: {params: null, seeds: [], "
        "models: [models:/wmt14-ende-teacher/1, models:/wmt14-ende-teacher/2]}\n",
    }
    for name, text in files.items():
        (folder / f"{name}.yaml").write_text(text)
    return {name: folder / f"{name}.yaml" for name in files}


@pytest.fixture(scope="module")
def flows(params, prefect_api, tmp_path_factory):
    """The three students in one work dir, in this process (the Prefect test server), in
    order."""
    work = tmp_path_factory.mktemp("distill_work")
    results = {}
    for name in ("student", "student2", "student3"):
        state = wmt14_ende(str(params[name]), [], str(work), return_state=True)
        assert state.is_completed(), state
        results[name] = state.result()
    with get_client(sync_client=True) as client:
        artifacts = client.read_artifacts(
            artifact_filter=ArtifactFilter(key=ArtifactFilterKey(any_=["wmt14-ende-results"]))
        )
    results["artifacts"] = [a.data for a in artifacts]
    return work, results


def _folders(work: Path, stage: str) -> list[Path]:
    return sorted(p for p in (work / stage).iterdir() if not p.name.startswith("."))


def test_teachers_distill_and_student_run_as_stages(flows, params):
    work, results = flows
    result = results["student"]
    assert set(result["rows"]) == {"teacher-1", "teacher-2", "ensemble", "model"}
    # Three trainings for the first student (two teachers, itself), one more for the second;
    # one distilled corpus, made once; one vocabulary, the teachers' (the corpus's).
    # The third student's teachers are files (from the registry): a corpus and training of
    # its own.
    assert len(_folders(work, "train")) == 5
    assert len(_folders(work, "distill")) == len(_folders(work, "teachers")) == 2
    assert len(_folders(work, "vocab")) == 1
    distilled = _distilled(work)
    corpus = pq.read_table(distilled / "train.parquet")
    cleaned = pq.read_table(_folders(work, "clean")[0] / "train.parquet")
    assert corpus["src"].to_pylist() == cleaned["src"].to_pylist()[: corpus.num_rows]
    # The targets are the teachers' ensemble's translations: check a few against it.
    ensemble, sp, _ = load_ensemble([t["model"] for t in _teacher_runs(work)], "cpu")
    cfg = load_params(params["student"]).distill.decode
    some = corpus["src"].to_pylist()[:5]
    assert translate_lines(ensemble, sp, some, cfg, "cpu") == corpus["tgt"].to_pylist()[:5]


def _record(folder: Path) -> dict:
    return json.loads((folder / "stage.json").read_text())


def _teachers(work: Path, registry: bool = False) -> Path:
    """The teachers folder of the students that name seeds (or, `registry`, models)."""
    return next(f for f in _folders(work, "teachers")
                if ("run_id" in _record(f)["report"]["teachers"][0]) != registry)  # fmt: skip


def _distilled(work: Path, registry: bool = False) -> Path:
    teachers = _record(_teachers(work, registry))["fingerprint"]
    return next(f for f in _folders(work, "distill")
                if _record(f)["inputs"]["teachers"] == teachers)  # fmt: skip


def _teacher_runs(work: Path) -> list[dict]:
    folder = _teachers(work)
    return [{**t, "model": str(work / t["model"])} for t in _record(folder)["report"]["teachers"]]


def test_the_student_run_names_its_teachers(flows):
    work, results = flows
    result = results["student"]
    client = MlflowClient(f"sqlite:///{work / 'mlflow.db'}")
    run = client.get_run(result["run_id"])
    teachers = _teacher_runs(work)
    assert run.data.tags["distill.teacher_runs"] == ", ".join(t["run_id"] for t in teachers)
    for t in teachers:
        teacher = client.get_run(t["run_id"])  # a pipeline run of its own, finished
        assert teacher.info.status == "FINISHED"
        assert t["registered"] in run.data.tags["distill.teacher_models"]
        assert t["run_id"] in run.data.tags["mlflow.note.content"]
    assert "| ensemble | test |" in run.data.tags["mlflow.note.content"]
    assert {"ensemble/dev/bleu", "teacher-1/test/bleu", "dev/bleu"} <= set(run.data.metrics)
    name, version = result["registered"].removeprefix("models:/").split("/")
    tags = client.get_model_version(name, version).tags
    assert tags["distill.teacher_runs"] == run.data.tags["distill.teacher_runs"]
    table = next(a for a in results["artifacts"] if result["run_id"] in a)
    for row in ("| teacher-1 | test |", "| teacher-2 | test |", "| ensemble | test |",
                "| model | test |"):  # fmt: skip
        assert row in table


def test_teachers_from_the_registry_make_the_corpus_their_runs_made(flows):
    """The third student names the first one's teachers as registered versions: fetched
    from the registry, the same models, so the same distilled corpus, byte for byte; its
    run names them by version."""
    work, results = flows
    ours, fetched = _distilled(work), _distilled(work, registry=True)
    assert ours != fetched
    assert (fetched / "train.parquet").read_bytes() == (ours / "train.parquet").read_bytes()
    run = MlflowClient(f"sqlite:///{work / 'mlflow.db'}").get_run(results["student3"]["run_id"])
    assert run.data.tags["distill.teacher_models"] == (
        "models:/wmt14-ende-teacher/1, models:/wmt14-ende-teacher/2"
    )


def test_a_kill_inside_distill_and_its_rerun_make_the_same_corpus(flows, params, tmp_path):
    """SIGKILL to the flow's process group while the distill stage writes its parts; the
    rerun resumes and writes the corpus byte for byte as the unbroken run did. (The third
    student's: its teachers are files, so no teacher's subflow runs before the stage.) Both
    translate on two CPU processes (the kill takes the helper too), the unbroken run on one."""
    work, _ = flows
    copy = tmp_path / "work"
    shutil.copytree(work, copy)
    unbroken = _distilled(work, registry=True)
    out = copy / "distill" / unbroken.name
    shutil.rmtree(out)
    cmd = [sys.executable, "-m", "flows.wmt14_ende", str(params["student3"]),
           "pipeline.nproc_per_node=2", "--work-dir", str(copy)]  # fmt: skip
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MLFLOW_", "PREFECT_"))}
    proc = subprocess.Popen(
        cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        start_new_session=True,
    )  # fmt: skip
    first = out / "parts" / "00000.parquet"
    wait_for(first.is_file, 600, proc, "the first distilled part")
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    assert not (out / "stage.json").exists()
    written = first.stat().st_ino
    rerun = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert rerun.returncode == 0, (rerun.stdout + rerun.stderr)[-3000:]
    assert "distill: reusing" not in rerun.stdout + rerun.stderr
    assert first.stat().st_ino == written  # resumed: the part made before the kill is kept
    # Every other stage is the copy's own, found done: no new teachers, corpus or student.
    for stage in ("teachers", "distill", "train"):
        assert len(_folders(copy, stage)) == len(_folders(work, stage))
    for name in ("train.parquet", "valid.hyp", "test.hyp"):
        assert (out / name).read_bytes() == (unbroken / name).read_bytes()
