"""The `wmt14-ende` flow end to end on the smoke data: real Prefect, real MLflow (SQLite),
real torchrun, with a shortened training so the whole file takes a few minutes."""

from __future__ import annotations

import json
import logging
import os
import shlex
import signal
import subprocess
import sys
import time
import urllib.request
from datetime import UTC, datetime, timedelta
from pathlib import Path

import mlflow
import pytest
import torch
import yaml
from conftest import TINY_FLOW, answers, free_port
from mlflow.tracking import MlflowClient
from prefect.client.orchestration import SyncPrefectClient, get_client
from prefect.client.schemas.filters import (
    ArtifactFilter,
    ArtifactFilterKey,
    DeploymentFilter,
    DeploymentFilterId,
    FlowRunFilter,
    FlowRunFilterId,
)
from prefect.client.schemas.objects import StateType
from prefect.client.schemas.schedules import IntervalSchedule
from prefect.exceptions import ObjectNotFound

from flows.pipeline import wmt14_ende
from tasks import stages
from tasks.settings import load_run_params
from tasks.stages import Shown, Stage, StageRun
from tasks.train import TrainingFailed, train_cooldowns
from transformer.config import loading
from transformer.model_file import load_model_file

ROOT = Path(__file__).resolve().parents[1]
SMOKE = str(ROOT / "params" / "smoke.yaml")
STAGES = {"prepare", "clean", "vocab", "shards", "train", "average", "decode", "export"}

pytestmark = [pytest.mark.timeout(900), pytest.mark.usefixtures("prefect_api")]


@pytest.fixture(scope="module")
def work(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("work")


@pytest.fixture(scope="module")
def parses() -> list[Path]:
    """The params files that `first` parsed (read and validated), in order."""
    return []


@pytest.fixture(scope="module")
def first(work, parses):
    # Every parse reads its file through loading._read_tree, whatever the name it is called
    # by (load_run_params, load_params): count the reads of a file itself, not of a file it
    # extends.
    read = loading._read_tree

    def counted(path: Path, seen: tuple) -> dict:
        if not seen:
            parses.append(path)
        return read(path, seen)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(loading, "_read_tree", counted)
        state = wmt14_ende(SMOKE, TINY_FLOW, str(work), return_state=True)
    assert state.is_completed(), state
    return state.result(), state.state_details.flow_run_id


def test_a_run_parses_its_params_once(first, parses):
    """The flow reads and validates the params once and hands the tree to every task
    (open-run and the eight stages, each run, not reused): none parses the file again. The
    trainer, a process of its own, reads the resolved params the run wrote; the command
    line reads the file once more, before Prefect starts, to refuse bad params at once."""
    assert parses == [Path(SMOKE)]


def _client(work: Path) -> MlflowClient:
    return MlflowClient(f"sqlite:///{work / 'mlflow.db'}")


def _children(client: MlflowClient, run_id: str) -> list:
    run = client.get_run(run_id)
    return client.search_runs(
        [run.info.experiment_id], filter_string=f"tags.mlflow.parentRunId = '{run_id}'"
    )


def test_the_run_records_metrics_tags_and_artifacts(first, work):
    result, _ = first
    client = _client(work)
    run = client.get_run(result["run_id"])
    metrics = run.data.metrics
    for key in (
        "train/loss",
        "train/lr",
        "train/tokens_per_s",
        "valid/loss",
        "valid/ppl",
        "valid/bleu",
        "test/bleu",
        "test/chrf",
        "test/bleu_lc",
        "test/bleu_tok_compound",
        "dev/bleu",
    ):
        assert key in metrics, key
    assert 0.0 <= metrics["test/bleu"] <= 100.0
    assert metrics["test/bleu"] == pytest.approx(result["scores"]["test"]["bleu"])
    assert len(client.get_metric_history(run.info.run_id, "train/loss")) >= 3
    # One valid/bleu series: the validations during training; the final averaged beam
    # model's score on the same split is dev/bleu.
    assert [m.step for m in client.get_metric_history(run.info.run_id, "valid/bleu")] == [20, 40]
    tags = run.data.tags
    for key in ("params_hash", "git_commit", "version.torch", "data_fingerprint"):
        assert tags.get(key), key
    assert tags["sacrebleu_signature"].startswith("nrefs:1")
    assert run.data.params["model.d_model"] == "128"
    assert run.data.params["train.max_steps"] == "40"

    def listing(path=None):
        return {a.path for a in client.list_artifacts(run.info.run_id, path)}

    top = listing()
    assert {"params.yaml", "curve.png", "attention", "data", "model", "hypotheses"} <= top
    assert "attention/sentence-1/cross-2.png" in listing("attention/sentence-1")
    # MLflow's UI opens the experiment on its training runs; the run says what it scored.
    kind = client.get_experiment(run.info.experiment_id).tags["mlflow.experimentKind"]
    assert kind == "custom_model_development"
    note = tags["mlflow.note.content"]
    test = result["scores"]["test"]
    assert f"| test | {test['bleu']:.2f} | {test['bleu_lc']:.2f} | {test['chrf']:.2f} |" in note
    assert result["registered"] in note and test["bleu_signature"] in note
    assert {"data/manifest.json", "data/spm.model"} <= listing("data")
    assert "model/model.pt" in listing("model")
    assert "hypotheses/test.hyp" in listing("hypotheses")

    stages = {c.data.tags["stage"]: c for c in _children(client, run.info.run_id)}
    assert set(stages) == STAGES
    assert all(c.info.status == "FINISHED" for c in stages.values())
    system = [k for k in stages["train"].data.metrics if k.startswith("system/")]
    assert system, "system metrics were not recorded for training"
    drawn = {a.path for a in client.list_artifacts(stages["decode"].info.run_id,
                                                   "attention/sentence-1")}  # fmt: skip
    assert {"attention/sentence-1/encoder-1.png", "attention/sentence-1/cross-2.png"} <= drawn
    exported = {a.path for a in client.list_artifacts(stages["export"].info.run_id, "ctranslate2")}
    assert {"ctranslate2/model.bin", "ctranslate2/export.json"} <= exported


def test_outputs_are_real(first):
    result, _ = first
    hyps = Path(result["paths"]["hypotheses"]).read_text().splitlines()
    assert result["step"] == 40
    assert len(hyps) == 300
    model = load_model_file(result["model"])
    assert len(model.meta["averaged_from"]) == 2


def test_the_model_is_registered_and_served_as_an_mlflow_pyfunc(first, work, tmp_path):
    """The averaged model is a version of the deployment's registered model, @best; it
    loads as a pyfunc and `mlflow models serve` answers a request (README's commands)."""
    result, _ = first
    uri = f"sqlite:///{work / 'mlflow.db'}"
    client = _client(work)
    version = client.get_model_version_by_alias("wmt14-ende-smoke", "best")
    assert result["registered"] == f"models:/wmt14-ende-smoke/{version.version}"
    for split in ("valid", "test"):
        tag = float(version.tags[f"{split}_bleu"])
        assert tag == pytest.approx(result["scores"][split]["bleu"])
    mlflow.set_tracking_uri(uri)
    model = mlflow.pyfunc.load_model("models:/wmt14-ende-smoke@best")
    sources = (ROOT / "data" / "smoke" / "test.en").read_text().splitlines()[:3]
    expected = Path(result["paths"]["hypotheses"]).read_text().splitlines()[:3]
    assert model.predict(sources) == expected  # the same model, the same beam search

    # README's line as written, from a folder whose `work` is this work dir (the repository
    # root after `make demo`), on a free port: its tracking URI finds the model, and no
    # stray mlflow.db appears where it ran.
    port = free_port()
    venv = Path(sys.executable).parent  # as after `. .venv/bin/activate`: uvicorn on PATH
    line = next(line for line in (ROOT / "README.md").read_text().splitlines()
                if "mlflow models serve" in line)  # fmt: skip
    words = shlex.split(line.replace("-p 5001", f"-p {port}"))
    assigned = dict(w.split("=", 1) for w in words[: words.index("mlflow")])
    assert assigned == {"MLFLOW_TRACKING_URI": "sqlite:///work/mlflow.db"}, line
    env = {k: v for k, v in os.environ.items() if not k.startswith("MLFLOW_")}
    env.update(assigned, PATH=f"{venv}:{os.environ['PATH']}")
    here = tmp_path / "checkout"
    here.mkdir()
    (here / "work").symlink_to(work)
    cmd = [str(venv / "mlflow"), *words[words.index("mlflow") + 1 :]]
    server = subprocess.Popen(cmd, cwd=here, env=env, start_new_session=True,
                              stdout=(tmp_path / "serve.log").open("w"),
                              stderr=subprocess.STDOUT)  # fmt: skip
    try:
        _wait(lambda: answers(f"http://127.0.0.1:{port}/ping"), 120, "mlflow models serve")
        request = urllib.request.Request(
            f"http://127.0.0.1:{port}/invocations",
            data=json.dumps({"inputs": sources}).encode(),
            headers={"Content-Type": "application/json"},
        )
        with urllib.request.urlopen(request, timeout=60) as response:
            assert json.loads(response.read())["predictions"] == expected
    finally:
        os.killpg(server.pid, signal.SIGTERM)
        server.wait(timeout=60)
    assert sorted(p.name for p in here.iterdir()) == ["work"]  # no stray ./mlflow.db


def test_a_rerun_is_served_from_prefects_cache_and_resumes_the_run(first, work):
    result, _ = first
    client = _client(work)
    before = len(_children(client, result["run_id"]))
    model_mtime = Path(result["model"]).stat().st_mtime_ns

    state = wmt14_ende(SMOKE, TINY_FLOW, str(work), return_state=True)
    assert state.is_completed()
    again = state.result()
    assert again["run_id"] == result["run_id"]
    assert len(_children(client, result["run_id"])) == before  # no stage ran again
    assert Path(result["model"]).stat().st_mtime_ns == model_mtime

    # Prefect 3 reports task run states through events, in the background: wait until the
    # API has heard the final state of every stage.
    deadline = time.monotonic() + 60
    while True:
        names = {t.name.rsplit("-", 1)[0]: t.state for t in _task_runs(state)}
        final = names.keys() >= STAGES and all(names[s].is_final() for s in STAGES)
        if final or time.monotonic() > deadline:
            break
        time.sleep(1)
    assert {getattr(names.get(s), "name", None) for s in STAGES} == {"Cached"}, names


def test_a_new_stage_is_one_row_and_one_function(first, work, monkeypatch):
    """A toy stage after decode: its row (what it reads, what the run shows of it) and its
    function are all it takes; the flow runs it, reuses everything else, and the pipeline's
    run shows its file and tag (docs/architecture.md's promise)."""

    def lengths(r: StageRun) -> dict:
        hyps = (r.inputs["decode"] / "test.hyp").read_text().splitlines()
        mean = sum(len(h.split()) for h in hyps) / len(hyps)
        r.out.mkdir(parents=True, exist_ok=True)
        (r.out / "lengths.json").write_text(json.dumps({"mean": mean}))
        return {"mean": mean}

    shown = Shown(files=(("lengths.json", "lengths"),),
                  tags=lambda report: {"test_mean_length": f"{report['mean']:.3f}"})  # fmt: skip
    row = Stage("lengths", (), ("decode",), lengths, shown=shown)
    monkeypatch.setattr(stages, "STAGES", (*stages.STAGES, row))
    state = wmt14_ende(SMOKE, TINY_FLOW, str(work), return_state=True)
    assert state.is_completed(), state
    result = state.result()
    (folder,) = _folders(work / "lengths")
    mean = json.loads((folder / "lengths.json").read_text())["mean"]
    client = _client(work)
    run = client.get_run(result["run_id"])
    assert run.data.tags["test_mean_length"] == f"{mean:.3f}"
    logged = {a.path for a in client.list_artifacts(run.info.run_id, "lengths")}
    assert "lengths/lengths.json" in logged
    children = [c.data.tags["stage"] for c in _children(client, result["run_id"])]
    assert children.count("lengths") == 1 and children.count("train") == 1  # the rest reused


def test_two_fresh_runs_are_bitwise_reproducible(first, fresh_flow):
    """`first` and the same params run from the command line in another work dir."""
    result, _ = first
    other = json.loads(next(fresh_flow.glob("decode/*/scores.json")).read_text())
    assert other["test"]["bleu"] == result["scores"]["test"]["bleu"]
    other_model = next(fresh_flow.glob("average/*/model.pt"))
    a, b = load_model_file(result["model"]).model, load_model_file(other_model).model
    assert a.keys() == b.keys()
    assert all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.slow  # two more flows; tests/test_config.py pins the identities
def test_operational_changes_reuse_every_stage_and_identity_changes_do_not(first, work):
    """Logging, validation and checkpoint cadence, workers, max_steps upward: the data
    stages are reused and training resumes in its folder; an identity key (dropout) trains
    anew in another folder, on the same shards."""
    result, _ = first
    train_dirs = _folders(work / "train")
    operational = [*TINY_FLOW, "train.log_every=5", "train.valid_every=10", "train.save_every=20",
                   "shard.workers=1", "train.valid_bleu=false", "train.max_steps=50"]  # fmt: skip
    state = wmt14_ende(SMOKE, operational, str(work), return_state=True)
    assert state.is_completed(), state
    extended = state.result()
    assert _folders(work / "train") == train_dirs  # the same folder, extended
    assert extended["step"] == 50 and extended["run_id"] != result["run_id"]
    children = {c.data.tags["stage"] for c in _children(_client(work), extended["run_id"])}
    assert children == {"train", "average", "decode", "export"}  # prepare..shards reused
    log = (next(iter(train_dirs)) / "train.log").read_text()
    assert "resumed from" in log and "at step 40" in log

    identity = [*TINY_FLOW, "model.dropout=0.2"]
    other = wmt14_ende(SMOKE, identity, str(work), return_state=True).result()
    assert len(_folders(work / "train") - train_dirs) == 1
    children = {c.data.tags["stage"] for c in _children(_client(work), other["run_id"])}
    assert children == {"train", "average", "decode", "export"}


@pytest.mark.slow  # a flow with two cooldown branches
def test_an_average_over_cooldowns_trains_them_from_the_runs_cooldown_start(first, work):
    """average.cooldowns=2: the run keeps its state where its cooldown begins; the
    cooldowns stage trains one more cooldown from there (train.seed + 1: other batches) in
    its own folder, its curves in its own MLflow run; the average stage averages the last N
    of each (a model soup), and trains nothing."""
    params = [*TINY_FLOW, "train.cooldown=0.5", "average.cooldowns=2"]
    result = wmt14_ende(SMOKE, params, str(work), return_state=True).result()
    (branch,) = (work / "cooldowns").glob("*/cooldown-1")
    assert (branch.parent / "stage.json").is_file()
    log = (branch / "train.log").read_text()
    assert "state-0000020.pt at step 20" in log and "train.seed: 1 in checkpoint, 2 now" in log
    averaged = load_model_file(result["model"]).meta["averaged_from"]
    assert [name.split("/")[1] for name in averaged] == ["model-0000030.pt", "model-0000040.pt"] * 2
    assert [name.split("/")[0] for name in averaged][2:] == ["cooldown-1"] * 2
    assert not list(Path(result["model"]).parent.glob("cooldown-*"))
    client = _client(work)
    stages = {c.data.tags["stage"]: c for c in _children(client, result["run_id"])}
    assert set(stages) == {"train", "cooldowns", "average", "decode", "export"}  # data reused
    assert len(client.get_metric_history(stages["cooldowns"].info.run_id, "train/loss")) >= 2
    assert "train/loss" not in stages["average"].data.metrics


def test_an_average_over_cooldowns_needs_the_state_where_they_begin(tmp_path):
    params = load_run_params(SMOKE, [*TINY_FLOW, "train.cooldown=0.5", "average.cooldowns=2"])
    r = StageRun(params, {}, {}, tmp_path / "out", Path(SMOKE), {}, "cpu")
    with pytest.raises(TrainingFailed, match=r"state-0000020\.pt: no training state at the "
                       r"cooldown's start \(update 20\)") as err:  # fmt: skip
        train_cooldowns(r, tmp_path, tmp_path)
    assert err.value.user_error


@pytest.mark.slow  # and ten kills at random moments in test_reliability.py
def test_a_run_killed_in_training_resumes_and_completes(first, work):
    overrides = [*TINY_FLOW, "train.max_steps=80"]  # the same training folder, extended
    cmd = [sys.executable, "-m", "flows.wmt14_ende", SMOKE, *overrides, "--work-dir", str(work)]
    proc = subprocess.Popen(
        cmd, cwd=ROOT, start_new_session=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    run_dir = Path(first[0]["model"]).parents[2] / "train"
    run_dir = next(
        d for d in run_dir.iterdir() if (d / "checkpoints" / "state-0000040.pt").exists()
    )
    deadline = time.monotonic() + 300
    while not list(run_dir.glob("checkpoints/state-00000[6-7]0.pt")):
        assert proc.poll() is None, "the flow ended before training checkpointed"
        assert time.monotonic() < deadline
        time.sleep(0.5)
    os.killpg(proc.pid, signal.SIGKILL)  # the flow and the trainer, all at once
    proc.wait()

    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "test BLEU" in done.stdout
    assert "resumed from" in (run_dir / "train.log").read_text()

    client = _client(work)
    exp = client.get_experiment_by_name("wmt14-ende")
    runs = client.search_runs([exp.experiment_id], filter_string="tags.stage = 'pipeline'")
    hashes = [r.data.tags["params_hash"] for r in runs]
    assert len(hashes) == len(set(hashes))  # each params once, the killed one resumed
    killed = [c for r in runs for c in _children(client, r.info.run_id)]
    assert not [c for c in killed if c.info.status == "RUNNING"]  # orphans marked KILLED
    assert any(c.info.status == "KILLED" for c in killed)


@pytest.mark.slow  # a Prefect server, a serve process, two flow runs: ~75 s
def test_served_deployments_run_on_schedule_and_from_the_cli(first, work, tmp_path):
    """A real `prefect server` (127.0.0.1, its own PREFECT_HOME, the scheduler looping every
    second) and `python -m flows.deploy` serving the repository's smoke deployment; a
    schedule added once it is served (as `prefect deployment schedule create` adds one),
    due seconds later: the scheduled run completes, so does a run started with
    `prefect deployment run`; stopping the serve process pauses nothing."""
    port = free_port()
    api = f"http://127.0.0.1:{port}/api"
    env = dict(
        os.environ,
        PREFECT_API_URL=api,
        PREFECT_HOME=str(tmp_path / "prefect"),
        PREFECT_SERVER_ANALYTICS_ENABLED="false",
        PREFECT_API_LOG_RETRYABLE_ERRORS="true",  # why a 503 was sent: into server.log
        PREFECT_SERVER_SERVICES_SCHEDULER_LOOP_SECONDS="1",
        PREFECT_RUNNER_POLL_FREQUENCY="2",
    )
    env.pop("PREFECT_SERVER_ALLOW_EPHEMERAL_MODE", None)
    smoke = yaml.safe_load((ROOT / "prefect.yaml").read_text())["deployments"][-1]
    assert smoke["name"] == "smoke"
    smoke["parameters"]["overrides"] = TINY_FLOW  # `first`'s stages: reused, the run is quick
    spec = tmp_path / "prefect.yaml"
    prefect = str(Path(sys.executable).parent / "prefect")
    server = _spawn([prefect, "server", "start", "--host", "127.0.0.1", "--port", str(port)],
                    env, tmp_path / "server.log")  # fmt: skip
    serving = None
    try:
        _wait(lambda: answers(f"{api}/health"), 120, "prefect server")
        # The served schedule (not the nightly retrain from the source, which could come due
        # during the test) is due tomorrow: registered and active, it must not fire.
        tomorrow = datetime.now(UTC) + timedelta(days=1)
        smoke["schedules"] = [{"interval": 86400, "anchor_date": tomorrow.isoformat()}]
        spec.write_text(yaml.safe_dump({"deployments": [smoke]}))
        serving = _spawn([sys.executable, "-m", "flows.deploy", "--file", str(spec),
                          "--work-dir", str(work)], env, tmp_path / "serve.log")  # fmt: skip
        with SyncPrefectClient(api) as client:  # Prefect's own, its retries included
            _served_run_completes(client, work, env, prefect, tmp_path / "serve.log")
            os.killpg(serving.pid, signal.SIGTERM)
            serving.wait(timeout=60)
            serving = None
            schedules = client.read_deployment_by_name("wmt14-ende/smoke").schedules
            assert len(schedules) == 2 and all(s.active for s in schedules)  # runs will wait
    finally:
        for proc in (serving, server):
            if proc is not None:
                os.killpg(proc.pid, signal.SIGTERM)
                proc.wait(timeout=60)


def _served_run_completes(client, work: Path, env: dict, prefect: str, serve_log: Path) -> None:
    """A schedule added to the served deployment fires; then `prefect deployment run`."""
    deployment = _wait(lambda: _deployment(client), 120, "deployment")
    # Due once served, with a margin for the scheduler's loop on a busy machine (a due time
    # already past means the next run an interval later). A write that met "database is
    # locked" (the runner starting the served flow writes too) gets a 503, which the client
    # retries (PREFECT_CLIENT_MAX_RETRIES, 5); the server logs the cause. It also retries a
    # timeout (PREFECT_API_REQUEST_TIMEOUT, 60 s), which could add the schedule twice: the
    # count of schedules below would then fail.
    due = datetime.now(UTC) + timedelta(seconds=15)
    every_hour = IntervalSchedule(interval=timedelta(hours=1), anchor_date=due)
    client.create_deployment_schedules(deployment.id, [(every_hour, True)])
    served = DeploymentFilter(id=DeploymentFilterId(any_=[deployment.id]))

    def scheduled_run_completed() -> bool:
        runs = client.read_flow_runs(deployment_filter=served)
        return any(r.auto_scheduled and r.state_type == StateType.COMPLETED for r in runs)

    logs = lambda: serve_log.read_text()[-3000:]
    _wait(scheduled_run_completed, 300, "the scheduled run", logs)

    # Greedy decoding: the run reuses data and training of `first`, and really decodes.
    decoded = _folders(work / "decode")
    params = json.dumps({"overrides": [*TINY_FLOW, "decode.beam_size=1"]})
    run = subprocess.run(
        [prefect, "deployment", "run", "wmt14-ende/smoke", "--params", params,
         "--watch", "--watch-timeout", "500"],
        env=env, capture_output=True, text=True, timeout=560,
    )  # fmt: skip
    assert run.returncode == 0 and "Completed" in run.stdout, run.stdout[-2000:] + logs()
    new = _folders(work / "decode") - decoded
    assert len(new) == 1 and (new.pop() / "scores.json").exists(), logs()
    results = ArtifactFilter(key=ArtifactFilterKey(any_=["wmt14-ende-results"]))
    artifact = client.read_artifacts(artifact_filter=results)
    assert artifact and "| test |" in artifact[0].data, artifact
    assert "?workflowType=machine_learning)" in artifact[0].data  # links to MLflow's runs view


def _deployment(client):
    """The served smoke deployment, or None until the serve process has registered it."""
    try:
        return client.read_deployment_by_name("wmt14-ende/smoke")
    except ObjectNotFound:
        return None


def _folders(stage_dir: Path) -> set[Path]:
    """A stage's output folders (not the hidden locks beside them)."""
    return {p for p in stage_dir.iterdir() if not p.name.startswith(".")}


def _task_runs(state) -> list:
    async def read():
        async with get_client() as client:
            return await client.read_task_runs(
                flow_run_filter=FlowRunFilter(
                    id=FlowRunFilterId(any_=[state.state_details.flow_run_id])
                )
            )

    import asyncio

    return asyncio.run(read())


def _spawn(cmd, env, log: Path) -> subprocess.Popen:
    return subprocess.Popen(
        cmd,
        cwd=ROOT,
        env=env,
        start_new_session=True,
        stdout=log.open("w"),
        stderr=subprocess.STDOUT,
    )


def _wait(ready, seconds: float, what: str, logs=lambda: ""):
    """`ready()`'s first truthy answer, polled each second for up to `seconds`."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if answer := ready():
            return answer
        time.sleep(1)
    raise AssertionError(f"{what} not ready after {seconds} s\n{logs()}")


def test_trainer_lines_reach_the_pipeline_log_at_their_own_level(caplog):
    from tasks.launch import forward

    log = logging.getLogger("test.forward")
    with caplog.at_level(logging.INFO, logger="test.forward"):
        forward(log, "INFO resumed from state-0000040.pt at step 40")
        forward(log, "WARNING stopped by SIGTERM at step 60, checkpoint saved")
        forward(log, "step 60/80 (75%) | loss 2.1 | lr 1e-3 | 5,000 tok/s | eta 4s")
    assert [(r.levelname, r.getMessage()) for r in caplog.records] == [
        ("INFO", "resumed from state-0000040.pt at step 40"),
        ("WARNING", "stopped by SIGTERM at step 60, checkpoint saved"),
        ("INFO", "step 60/80 (75%) | loss 2.1 | lr 1e-3 | 5,000 tok/s | eta 4s"),
    ]
