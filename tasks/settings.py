"""The pipeline's own settings: the `pipeline` section of a params file.

The library (`transformer/`) validates the sections that describe the model, the data and
training, and leaves this one alone; the pipeline validates the whole tree, with this
section added. No stage reads it, so nothing here changes a stage's output: every key is
operational, and none is part of a run's identity.
"""

from __future__ import annotations

import os
from pathlib import Path

from pydantic import Field

from tasks.tracking import TrackingError, credentials_to_env
from transformer.config import Params, Section, load_params, operational


class PipelineConfig(Section):
    # MLflow: None = sqlite:///<work dir>/mlflow.db. MLFLOW_TRACKING_URI and
    # MLFLOW_EXPERIMENT_NAME win over these, as everywhere in MLflow.
    tracking_uri: str | None = operational(None)
    experiment: str = operational("wmt14-ende")
    nproc_per_node: int | None = operational(None, ge=1)  # None: one per GPU, or 1 on CPU
    train_timeout_minutes: float = operational(0.0, ge=0.0)  # 0: no limit
    # The MLflow Model Registry name of the averaged model; None: <experiment>-<params stem>
    registered_model: str | None = operational(None)


class RunParams(Params):
    pipeline: PipelineConfig = Field(default_factory=PipelineConfig)


def load_run_params(path: str | os.PathLike, overrides: list[str] | tuple = ()) -> RunParams:
    """The whole params tree, the pipeline section included (ParamsError names the key)."""
    return load_params(Path(path), overrides, schema=RunParams)


def tracking_uri(params: RunParams, work_dir: Path) -> str:
    """The MLflow store's URI, a server's credentials moved to the environment."""
    uri = os.environ.get("MLFLOW_TRACKING_URI") or params.pipeline.tracking_uri
    if uri:
        return credentials_to_env(uri)
    db = work_dir.resolve() / "mlflow.db"
    if "?" in str(db) or not str(db).isprintable():  # a URL's query starts at "?"
        raise TrackingError(f"work dir {work_dir}: a '?' or a control character in its path "
                            "cannot be in an MLflow store's URL: choose another")  # fmt: skip
    return f"sqlite:///{db}"


def experiment_name(params: RunParams) -> str:
    return os.environ.get("MLFLOW_EXPERIMENT_NAME") or params.pipeline.experiment
