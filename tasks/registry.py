"""The MLflow Model Registry: a run's averaged model becomes a version of its deployment's
registered model (`pipeline.registered_model`, default `<experiment>-<params file stem>`),
tagged with its scores; the alias `best` follows the version of highest validation BLEU
(picked on the valid split, as the checkpoints are: the test split only reports).

    mlflow.pyfunc.load_model("models:/wmt14-ende-base@best")
"""

from __future__ import annotations

import importlib.metadata
import warnings
from pathlib import Path

import mlflow
from mlflow.models import ModelSignature
from mlflow.types import ColSpec, Schema

import transformer
from tasks.tracking import client_for

BEST = "best"
SERVING = Path(__file__).with_name("serving.py")  # the pyfunc's code
# What the pyfunc imports, at the versions this run used.
REQUIREMENTS = ("torch", "sentencepiece", "pyarrow", "pydantic", "pyyaml", "numpy", "mlflow")


def register(
    run: dict, model_path: Path, scores: dict, fingerprint: str, lineage: dict[str, str]
) -> str:
    """Log the model as a pyfunc of the pipeline run and register it (once per model: a
    cached rerun finds its version), tagged with its scores and `lineage` (what it was
    trained on: the data, a distillation's teachers); returns the version."""
    client, name = client_for(run["uri"]), run["registered_model"]
    versions = client.search_model_versions(f"name = '{name}' and run_id = '{run['run_id']}'")
    for version in versions:
        if version.tags.get("model_fingerprint") == fingerprint:
            return version.version
    mlflow.set_tracking_uri(run["uri"])
    # MLflow's advice on logging (type hints on predict, an input example: two UserWarnings)
    # is for models whose signature it infers; this one's is given, a list of sentences.
    # log_model resets the filters to show each warning once, so they are caught, not shown.
    with mlflow.start_run(run_id=run["run_id"]), warnings.catch_warnings(record=True):
        info = mlflow.pyfunc.log_model(
            name="translator",
            python_model=str(SERVING),
            artifacts={"model": str(model_path)},
            code_paths=[str(Path(transformer.__file__).parent)],
            pip_requirements=[f"{p}=={importlib.metadata.version(p)}" for p in REQUIREMENTS],
            signature=ModelSignature(Schema([ColSpec("string")]), Schema([ColSpec("string")])),
            registered_model_name=name,
        )
    version = str(info.registered_model_version)
    test = scores["test"]
    tags = {
        "valid_bleu": scores["valid"]["bleu"],
        "test_bleu": test["bleu"],
        "test_bleu_lc": test["bleu_lc"],
        "test_chrf": test["chrf"],
        "sacrebleu_signature": test["bleu_signature"],
        "model_fingerprint": fingerprint,
        **lineage,
    }
    for key, value in tags.items():
        client.set_model_version_tag(name, version, key, str(value))
    promote_if_best(client, name, version, tags["valid_bleu"])
    return version


def promote_if_best(client, name: str, version: str, valid_bleu: float) -> None:
    """Point the alias `best` at `version` if no version has it yet, or its validation BLEU
    is higher; a holder without a `valid_bleu` tag (registered before the alias followed
    it) yields."""
    try:
        holder = client.get_model_version_by_alias(name, BEST)
        current = float(holder.tags.get("valid_bleu", "-inf"))
    except mlflow.exceptions.MlflowException:  # no version holds the alias yet
        current = float("-inf")
    if valid_bleu > current:
        client.set_registered_model_alias(name, BEST, version)
