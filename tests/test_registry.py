"""The registry in a real MLflow store: the alias `best` follows validation BLEU, never test;
the names a run's experiment and registered model take from its params; the smoke flow's
registered model loads from a moved work dir and carries no code."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import mlflow
import pytest
import yaml
from mlflow import MlflowClient
from mlflow.exceptions import MlflowException
from test_translate import write_model_file

from flows.pipeline import open_run
from tasks import registry
from tasks.registry import BEST, promote_if_best
from tasks.settings import experiment_name, load_run_params
from tasks.tracking import tracking_uri
from transformer.config import params_hash

PARAMS = Path(__file__).resolve().parents[1] / "params"

NAME = "wmt14-ende-smoke"
SOURCE = "file:///nonexistent/model"  # the alias reads tags only: no model files needed


def _version(client: MlflowClient, valid: float, test: float) -> str:
    # As register() leaves a version before promoting it: its scores are tags.
    version = client.create_model_version(NAME, source=SOURCE).version
    client.set_model_version_tag(NAME, version, "valid_bleu", str(valid))
    client.set_model_version_tag(NAME, version, "test_bleu", str(test))
    promote_if_best(client, NAME, version, valid)
    return version


def test_best_follows_validation_bleu_and_a_higher_test_score_does_not_move_it(tmp_path):
    client = MlflowClient(tracking_uri=f"sqlite:///{tmp_path / 'mlflow.db'}")
    client.create_registered_model(NAME)
    first = _version(client, valid=30.0, test=20.0)
    assert client.get_model_version_by_alias(NAME, BEST).version == first
    _version(client, valid=29.0, test=35.0)  # better on test, worse on val: not chosen
    assert client.get_model_version_by_alias(NAME, BEST).version == first
    third = _version(client, valid=31.0, test=10.0)
    assert client.get_model_version_by_alias(NAME, BEST).version == third


def test_a_holder_without_a_validation_score_yields_to_a_version_with_one(tmp_path):
    """A version registered before the alias followed validation BLEU carries no valid_bleu."""
    client = MlflowClient(tracking_uri=f"sqlite:///{tmp_path / 'mlflow.db'}")
    client.create_registered_model(NAME)
    old = client.create_model_version(NAME, source=SOURCE).version
    client.set_model_version_tag(NAME, old, "test_bleu", "50.0")
    client.set_registered_model_alias(NAME, BEST, old)
    new = _version(client, valid=1.0, test=1.0)
    assert client.get_model_version_by_alias(NAME, BEST).version == new


@pytest.mark.parametrize(
    "file, overrides, experiment",
    [
        ("base.yaml", [], "wmt14-ende"),
        ("big.yaml", [], "wmt14-ende"),
        ("smoke.yaml", [], "wmt14-ende"),
        ("multi30k.yaml", [], "wmt14-ende"),
        ("multi30k-enfr.yaml", [], "wmt14-enfr"),
        ("multi30k.yaml", ["data.tgt_lang=cs"], "wmt14-encs"),
        ("multi30k-enfr.yaml", ["pipeline.experiment=mine"], "mine"),
    ],
)
def test_the_experiment_follows_the_language_pair(file, overrides, experiment, monkeypatch):
    """The WMT14 params keep `wmt14-ende` (the deployments' and README's names); another
    pair never inherits it from base.yaml."""
    monkeypatch.delenv("MLFLOW_EXPERIMENT_NAME", raising=False)
    assert experiment_name(load_run_params(PARAMS / file, overrides)) == experiment
    monkeypatch.setenv("MLFLOW_EXPERIMENT_NAME", "theirs")  # MLflow's variable wins
    assert experiment_name(load_run_params(PARAMS / file, overrides)) == "theirs"


def test_an_english_czech_run_registers_under_its_own_pair(tmp_path, monkeypatch):
    """Where the flow makes the names (open-run): an English-Czech run of the params stem
    `encs` opens its run in experiment wmt14-encs and registers as wmt14-encs-encs, never
    as wmt14-ende-encs."""
    for name in ("MLFLOW_EXPERIMENT_NAME", "MLFLOW_TRACKING_URI"):
        monkeypatch.delenv(name, raising=False)
    params = load_run_params(PARAMS / "multi30k.yaml", ["data.tgt_lang=cs"])
    run = open_run.fn(params, params_hash(params), "encs", str(tmp_path))
    assert run["registered_model"] == "wmt14-encs-encs"
    assert MlflowClient(run["uri"]).get_experiment(run["experiment_id"]).name == "wmt14-encs"


@pytest.mark.parametrize("where", ["nowhere", "the shell", "the process"])
def test_registering_leaves_the_next_flow_its_own_store(where, tmp_path, monkeypatch):
    """A process that serves deployments runs flow after flow. Registering one run's model
    leaves the tracking URI as it found it: unset, the next flow's store is its own work
    dir's, not this run's; set by the shell (the variable), still the shell's; set in the
    process (mlflow.set_tracking_uri, no variable), still the process's."""
    monkeypatch.delenv("MLFLOW_EXPERIMENT_NAME", raising=False)
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.setattr(mlflow.tracking._tracking_service.utils, "_tracking_uri", None)
    params = load_run_params(PARAMS / "smoke.yaml")
    run = open_run.fn(params, params_hash(params), "smoke", str(tmp_path / "first"))
    elsewhere = "sqlite:////srv/mlflow.db"
    if where == "the shell":
        monkeypatch.setenv("MLFLOW_TRACKING_URI", elsewhere)
    if where == "the process":
        monkeypatch.setattr(mlflow.tracking._tracking_service.utils, "_tracking_uri", elsewhere)
    test = {"bleu": 1.0, "bleu_lc": 1.0, "chrf": 1.0, "bleu_signature": "-"}
    model = write_model_file(tmp_path / "model.pt", 1)
    assert registry.register(run, model, {"valid": {"bleu": 1.0}, "test": test}, "fp", {}) == "1"
    shell = elsewhere if where == "the shell" else None
    assert os.environ.get("MLFLOW_TRACKING_URI") == shell
    assert mlflow.get_tracking_uri() != run["uri"]
    if where != "nowhere":
        assert mlflow.get_tracking_uri() == elsewhere
    second = tmp_path / "second"
    assert tracking_uri(params, second) == (shell or f"sqlite:///{second / 'mlflow.db'}")


ROOT = Path(__file__).resolve().parents[1]
MARKER = "/tmp/transformer-mt-registry-ran-code"
PLANTED = f"open({MARKER!r}, 'w').write('ran')\n"


def test_a_moved_work_dirs_model_loads_by_its_alias_and_no_code_of_it_runs(
    fresh_flow, tmp_path, monkeypatch
):
    """The smoke flow's work dir, moved: its store names the old place until it is opened
    here (`python -m tasks.registry`), then `models:/NAME@best` loads from the new place and
    translates. The registered artifact holds weights and metadata, no code: Python planted
    where a model from code would keep it does not run at the load; the model translates as
    the flow's decode stage did."""
    first, moved = tmp_path / "first", tmp_path / "moved"
    subprocess.run(["cp", "-a", str(fresh_flow), str(first)], check=True)  # never in place
    assert registry.main([str(first)]) == 0  # as a flow there would: locations at `first`
    first.rename(moved)
    uri = f"sqlite:///{moved / 'mlflow.db'}"
    monkeypatch.setattr(mlflow.tracking._tracking_service.utils, "_tracking_uri", uri)
    with pytest.raises(MlflowException, match="No such artifact"):  # it names `first`, gone
        mlflow.pyfunc.load_model(f"models:/{NAME}@{BEST}")
    assert registry.main([str(moved)]) == 0
    client = MlflowClient(uri)
    best = client.get_model_version_by_alias(NAME, BEST).version
    artifact = Path(client.get_model_version_download_uri(NAME, best).removeprefix("file://"))
    assert artifact.is_relative_to(moved / "mlartifacts")
    assert not [p for p in artifact.rglob("*") if p.suffix in (".py", ".pyc", ".pkl")]
    flavor = yaml.safe_load((artifact / "MLmodel").read_text())["flavors"]["python_function"]
    assert flavor["loader_module"] == "tasks.serving" and flavor.get("code") is None
    for planted in (artifact / "serving.py", artifact / "code" / "tasks" / "serving.py"):
        planted.parent.mkdir(parents=True, exist_ok=True)
        planted.write_text(PLANTED)
    Path(MARKER).unlink(missing_ok=True)
    model = mlflow.pyfunc.load_model(f"models:/{NAME}@{BEST}")
    source = (ROOT / "data" / "smoke" / "test.en").read_text().splitlines()[:3]
    decoded = next(moved.glob("decode/*/test.hyp")).read_text().splitlines()[:3]
    assert model.predict(source) == decoded  # as the decode stage translated them
    assert not Path(MARKER).exists()


def test_a_folder_with_no_store_is_one_line(tmp_path, capsys):
    assert registry.main([str(tmp_path)]) == 2
    assert capsys.readouterr().err == (
        f"error: {tmp_path}/mlflow.db: no MLflow store here (a work dir's mlflow.db)\n"
    )
