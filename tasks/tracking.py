"""MLflow lineage: one parent run per params hash, a nested child run per executed stage.

Everything goes through an explicit `MlflowClient` and run ids (never the thread-local
"active run"), so tasks in any thread, the torchrun ranks, and a rerun days later all write
to the same runs.
"""

from __future__ import annotations

import importlib.metadata
import logging
import os
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from mlflow.entities import Metric, Param, RunStatus
from mlflow.tracking import MlflowClient

from transformer.config import (
    Params,
    TrackingConfig,
    flatten,
    load_params,
    params_hash,
    to_dict,
)

PACKAGES = ("torch", "prefect", "mlflow", "sentencepiece", "sacrebleu", "datasets", "pyarrow")
PARAMS_HASH_TAG = "params_hash"
STAGE_TAG = "stage"


def tracking_uri(params: Params, work_dir: str | os.PathLike) -> str:
    """The params' URI (or MLFLOW_TRACKING_URI), else SQLite in the work dir (MLflow 3's
    default store; the ./mlruns file store is deprecated)."""
    return params.tracking.uri or f"sqlite:///{Path(work_dir).resolve() / 'mlflow.db'}"


def client_for(uri: str) -> MlflowClient:
    return MlflowClient(tracking_uri=uri)


def experiment_id(client: MlflowClient, tracking: TrackingConfig, work_dir) -> str:
    exp = client.get_experiment_by_name(tracking.experiment)
    if exp is not None:
        return exp.experiment_id
    # With a local SQLite store, artifacts sit beside it in the work dir; a tracking server
    # decides for itself where artifacts go (somewhere all its readers can reach).
    local = tracking.uri is None or tracking.uri.startswith("sqlite:")
    artifacts = (Path(work_dir).resolve() / "mlartifacts").as_uri() if local else None
    return client.create_experiment(tracking.experiment, artifact_location=artifacts)


def open_parent_run(
    client: MlflowClient, exp_id: str, params: Params, params_file: Path, run_name: str
) -> str:
    """The run of these params: resumed if one exists (same hash), else created and filled."""
    key = params_hash(params)
    found = client.search_runs(
        [exp_id],
        filter_string=f"tags.{PARAMS_HASH_TAG} = '{key}' and tags.{STAGE_TAG} = 'pipeline'",
        max_results=1,
        order_by=["attributes.start_time ASC"],
    )
    if found:
        run_id = found[0].info.run_id
        client.update_run(run_id, status="RUNNING")
        return run_id
    tags = {PARAMS_HASH_TAG: key, STAGE_TAG: "pipeline", **_provenance()}
    run = client.create_run(exp_id, run_name=run_name, tags=tags)
    run_id = run.info.run_id
    flat = flatten(to_dict(params))
    for start in range(0, len(flat), 100):  # MLflow caps a batch at 100 params
        items = list(flat.items())[start : start + 100]
        client.log_batch(run_id, params=[_param(k, v) for k, v in items])
    client.log_artifact(run_id, str(params_file))
    return run_id


def finish_run(client: MlflowClient, run_id: str, ok: bool = True) -> None:
    client.set_terminated(
        run_id, RunStatus.to_string(RunStatus.FINISHED if ok else RunStatus.FAILED)
    )


def mark_failed(tracking: dict) -> None:
    """Best effort: a tracking error here must not hide the error that failed the run."""
    try:
        finish_run(client_for(tracking["uri"]), tracking["run_id"], ok=False)
    except Exception as err:
        logging.getLogger(__name__).warning("could not mark the MLflow run failed: %s", err)


@contextmanager
def stage_run(client: MlflowClient, parent_id: str, stage: str) -> Iterator[str]:
    """A nested child run for one executed stage; FAILED if the stage raises."""
    parent = client.get_run(parent_id)
    run = client.create_run(
        parent.info.experiment_id,
        run_name=stage,
        tags={"mlflow.parentRunId": parent_id, STAGE_TAG: stage},
    )
    start = time.time()
    try:
        yield run.info.run_id
    except BaseException:
        finish_run(client, run.info.run_id, ok=False)
        raise
    client.log_metric(run.info.run_id, "stage_seconds", time.time() - start)
    finish_run(client, run.info.run_id)


@contextmanager
def executing(stage: str, params_file: str, tracking: dict) -> Iterator[tuple]:
    """What a stage task works in: its params, an MLflow client, and its nested run."""
    client = client_for(tracking["uri"])
    with stage_run(client, tracking["run_id"], stage) as run_id:
        yield load_params(params_file), client, run_id


def log_metrics(client: MlflowClient, run_id: str, metrics: dict[str, float], step: int = 0):
    now = int(time.time() * 1000)
    batch = [Metric(k, float(v), now, step) for k, v in metrics.items()]
    client.log_batch(run_id, metrics=batch)


class MlflowLogger:
    """The trainer's metrics-logger protocol (`log(metrics, step)`, `close()`), for rank 0.

    Buffers and sends in batches: a sqlite store costs milliseconds a write, a training step
    on a GPU less than that."""

    def __init__(self, run_id: str, uri: str, flush_every: float = 10.0):
        self.client = client_for(uri)
        self.run_id = run_id
        self.flush_every = flush_every
        self._buffer: list[Metric] = []
        self._last = time.monotonic()

    @classmethod
    def from_env(cls) -> MlflowLogger | None:
        run_id, uri = os.environ.get("MLFLOW_RUN_ID"), os.environ.get("MLFLOW_TRACKING_URI")
        return cls(run_id, uri) if run_id and uri else None

    def log(self, metrics: dict[str, float], step: int) -> None:
        now = int(time.time() * 1000)
        self._buffer.extend(Metric(k, float(v), now, step) for k, v in metrics.items())
        if time.monotonic() - self._last > self.flush_every or any(
            k.startswith("valid/") for k in metrics
        ):
            self.flush()

    def flush(self) -> None:
        for start in range(0, len(self._buffer), 1000):  # MLflow caps a batch at 1000 metrics
            self.client.log_batch(self.run_id, metrics=self._buffer[start : start + 1000])
        self._buffer.clear()
        self._last = time.monotonic()

    def close(self) -> None:
        self.flush()


def _param(key: str, value) -> Param:
    return Param(key, str(value)[:6000])


def _provenance() -> dict[str, str]:
    tags = {f"version.{p}": _version(p) for p in PACKAGES}
    try:
        commit = subprocess.run(
            ["git", "rev-parse", "HEAD"], capture_output=True, text=True, check=True, timeout=10
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"],
            capture_output=True,
            text=True,
            timeout=10,
        ).stdout.strip()
        tags["git_commit"] = commit + ("-dirty" if dirty else "")
    except (OSError, subprocess.SubprocessError):
        tags["git_commit"] = "unknown"
    return tags


def _version(package: str) -> str:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return "absent"
