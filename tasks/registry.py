"""The MLflow Model Registry: a run's averaged model becomes a version of its deployment's
registered model (`pipeline.registered_model`, default `<experiment>-<params file stem>`),
tagged with its scores; the alias `best` follows the version of highest validation BLEU
(picked on the valid split, as the checkpoints are: the test split only reports).

    mlflow.pyfunc.load_model("models:/wmt14-ende-base@best")

A work dir's own store (`mlflow.db`) keeps absolute artifact locations, as MLflow does: in
a moved or copied work dir they name the old place. The flow rewrites them when it opens
the store; to load or serve a model from a moved work dir without running a flow there:

    python -m tasks.registry /new/place/of/work      # rewrites them, prints the models
"""

from __future__ import annotations

import contextlib
import importlib.metadata
import os
import sys
import warnings
from pathlib import Path

import mlflow
from mlflow.models import ModelSignature
from mlflow.types import ColSpec, Schema

from tasks.tracking import TrackingError, client_for, relocate_artifacts, store_errors
from transformer.cli import USER_ERRORS, ArgumentParser
from transformer.files import locked

BEST = "best"
# The pyfunc's code: imported from the installed project at load, never a copy in the
# artifact (tasks/serving.py).
LOADER = "tasks.serving"
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
    # MLflow's advice on logging (type hints on predict, an input example: two UserWarnings)
    # is for models whose signature it infers; this one's is given, a list of sentences.
    # log_model resets the filters to show each warning once, so they are caught, not shown.
    with (
        _fluent_at(run["uri"]),
        mlflow.start_run(run_id=run["run_id"]),
        warnings.catch_warnings(record=True),
    ):
        info = mlflow.pyfunc.log_model(
            name="translator",
            loader_module=LOADER,
            data_path=str(model_path),
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


@contextlib.contextmanager
def _fluent_at(uri: str):
    """MLflow's fluent API (start_run, log_model) at `uri` for the block, and the process
    as it was after it. set_tracking_uri also writes MLFLOW_TRACKING_URI into os.environ,
    which wins over a work dir's own store (tasks/tracking.py): left there, the next flow
    of a process that serves deployments would log into this run's store."""
    variable = os.environ.get("MLFLOW_TRACKING_URI")
    before = mlflow.get_tracking_uri() if mlflow.is_tracking_uri_set() else None
    mlflow.set_tracking_uri(uri)
    try:
        yield
    finally:
        mlflow.set_tracking_uri(before)  # which sets the variable, or drops it: as it was
        if variable is None:
            os.environ.pop("MLFLOW_TRACKING_URI", None)
        else:
            os.environ["MLFLOW_TRACKING_URI"] = variable


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


def open_work_dir(work_dir: Path) -> tuple[str, list[str]]:
    """The URI of `work_dir`'s own store, its artifact locations rewritten to where the work
    dir is now, under the lock the flows take on it; and the old places."""
    work = work_dir.resolve()
    db = work / "mlflow.db"
    if not db.is_file():
        raise TrackingError(f"{db}: no MLflow store here (a work dir's mlflow.db)")
    uri = f"sqlite:///{db}"
    waiting = lambda: print(f"waiting for a flow, which holds {work}/.mlflow.lock")
    with locked(work / ".mlflow.lock", waiting), store_errors(uri):
        return uri, relocate_artifacts(db, work)


def main(argv: list[str] | None = None) -> int:
    parser = ArgumentParser(prog="python -m tasks.registry", description=__doc__.split("\n\n")[0])
    parser.add_argument("work_dir", type=Path, help="a work dir, wherever it now is")
    args = parser.parse_args(argv)
    try:
        uri, moved = open_work_dir(args.work_dir)
        with store_errors(uri):
            models = client_for(uri).search_registered_models()
    except USER_ERRORS as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    for old in moved:
        print(f"artifacts    {old} is now {args.work_dir.resolve()}/mlartifacts")
    for model in models:
        if BEST not in model.aliases:
            print(f"registered   models:/{model.name} (no version is @{BEST})")
            continue
        print(f"registered   models:/{model.name}@{BEST}")
        print(f"serve        MLFLOW_TRACKING_URI={uri} mlflow models serve -m "
              f"models:/{model.name}@{BEST} --env-manager local -p 5001")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
