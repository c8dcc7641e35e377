"""MLflow lineage: one parent run per params hash, a nested child run per executed stage.

Everything goes through an explicit `MlflowClient` and run ids (never the thread-local
"active run"), so tasks in any thread, the torchrun ranks, and a rerun days later all write
to the same runs.
"""

from __future__ import annotations

import contextlib
import importlib.metadata
import logging
import os
import re
import sqlite3
import subprocess
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import requests
from mlflow.entities import Metric, Param, RunStatus
from mlflow.exceptions import MlflowException
from mlflow.store.tracking.sqlalchemy_store import SqlAlchemyStore
from mlflow.tracking import MlflowClient
from mlflow.utils.validation import _validate_model_name
from sqlalchemy.engine import make_url
from sqlalchemy.exc import ArgumentError, SQLAlchemyError

from tasks.credentials import credentials_to_env, redact
from tasks.settings import RunParams
from transformer.cli import UserError
from transformer.config import Params, flatten, to_dict

PACKAGES = ("torch", "prefect", "mlflow", "sentencepiece", "sacrebleu", "datasets", "pyarrow")
PARAMS_HASH_TAG = "params_hash"
STAGE_TAG = "stage"
# MLflow 3's UI opens an experiment of this kind on its training runs, not on the GenAI
# overview (traces) it shows an experiment of no kind.
EXPERIMENT_KIND = {"mlflow.experimentKind": "custom_model_development"}

# The stores MLflow's client opens: a typo'd scheme would otherwise be a traceback deep in
# MLflow's store registry, after Prefect has started.
SCHEMES = ("sqlite", "http", "https", "postgresql", "mysql", "mssql", "databricks", "file")
DATABASES = ("postgresql", "mysql", "mssql")  # through SQLAlchemy and a driver of their own


class TrackingError(UserError, RuntimeError):
    """The MLflow store cannot be used as configured (URI, lock, permissions, disk, name)."""


class TrackingLost(TrackingError):
    """A tracking server that answered at the start stopped answering (exit code 1)."""


# --------------------------------------------------------------------------- the store


def tracking_uri(params: RunParams, work_dir: Path) -> str:
    """The MLflow store's URI: the environment's (a server's credentials moved to the
    variables MLflow reads them from), else the params' (which hold no credential)."""
    uri = os.environ.get("MLFLOW_TRACKING_URI") or params.pipeline.tracking_uri
    if uri:
        return credentials_to_env(uri)
    db = work_dir.resolve() / "mlflow.db"
    if "?" in str(db) or not str(db).isprintable():  # a URL's query starts at "?"
        raise TrackingError(f"work dir {work_dir}: a '?' or a control character in its path "
                            "cannot be in an MLflow store's URL: choose another")  # fmt: skip
    return f"sqlite:///{db}"


@contextlib.contextmanager
def store_errors(uri: str) -> Iterator[None]:
    """MLflow's, SQLite's and HTTP errors as one line naming the store (redacted)."""
    try:
        yield
    except (MlflowException, SQLAlchemyError, sqlite3.Error, requests.RequestException) as err:
        lost = isinstance(err, requests.ConnectionError | requests.Timeout)
        text = str(getattr(err, "message", None) or err).strip().splitlines() or [repr(err)]
        message = f"MLflow store {redact(uri)}: {redact(text[0])[:300]}"
        raise (TrackingLost if lost else TrackingError)(message) from None


def check_store(uri: str, registered_model: str) -> None:
    """What can be checked before any stage runs: the URI's scheme, that a tracking server
    answers, the registered model's name (MLflow's own rules)."""
    named = re.match(r"([a-z][a-z0-9.-]*)(\+[a-z0-9]+)?:", uri, re.IGNORECASE)
    scheme = named[1] if named else ""  # of SQLAlchemy's dialect+driver, the dialect
    if scheme not in SCHEMES:
        raise TrackingError(
            f"pipeline.tracking_uri {redact(uri)}: scheme {scheme!r} is none of MLflow's "
            f"({', '.join(SCHEMES)})"
        )
    if scheme in DATABASES:
        database_driver(uri)
    if scheme in ("http", "https"):
        try:
            requests.get(f"{uri.rstrip('/')}/health", timeout=10).raise_for_status()
        except requests.RequestException as err:
            raise TrackingError(
                f"pipeline.tracking_uri {redact(uri)}: no MLflow server answers "
                f"({type(err).__name__}): start it, or fix the URI"
            ) from None
    try:
        _validate_model_name(registered_model)
    except MlflowException as err:
        raise TrackingError(f"pipeline.registered_model: {err.message}") from None


def database_driver(uri: str) -> None:
    """The database's driver is installed (psycopg2 for postgresql, ...): MLflow would
    import it at its first query, a ModuleNotFoundError deep in SQLAlchemy."""
    try:
        make_url(uri).get_dialect().import_dbapi()
    except ImportError as err:
        raise TrackingError(
            f"pipeline.tracking_uri {redact(uri)}: the database's driver is not installed "
            f"({err}): install it, or use an MLflow tracking server"
        ) from None
    except (ArgumentError, ValueError) as err:
        raise TrackingError(f"pipeline.tracking_uri {redact(uri)}: {redact(str(err))}") from None


def client_for(uri: str) -> MlflowClient:
    with store_errors(uri):
        if uri.startswith("sqlite:///"):
            create_sqlite_store(Path(uri.removeprefix("sqlite:///")))
        return MlflowClient(tracking_uri=uri)


def create_sqlite_store(db: Path) -> None:
    """MLflow makes a new SQLite store by running its schema migrations in place: a flow
    killed midway left a half-made schema that every later run failed to open. Made aside
    and linked into place (a link, unlike a rename, never replaces a store another flow
    made meanwhile), the store exists whole or not at all."""
    if db.exists():
        return
    db.parent.mkdir(parents=True, exist_ok=True)
    tmp = db.with_name(f".{db.name}.{uuid.uuid4().hex}.tmp")
    try:
        store = SqlAlchemyStore(f"sqlite:///{tmp}", tmp.parent.as_uri())  # migrates
        store.engine.dispose()
        os.link(tmp, db)
    except FileExistsError:
        pass  # another flow's store won the race: use it
    finally:
        tmp.unlink(missing_ok=True)


ARTIFACTS = "mlartifacts"
# Where MLflow's schema keeps artifact locations, each an absolute URI.
_LOCATIONS = (
    ("experiments", "artifact_location"),
    ("runs", "artifact_uri"),
    ("logged_models", "artifact_location"),
    ("model_versions", "source"),
    ("model_versions", "storage_location"),
)


def relocate_artifacts(db: Path, work_dir: Path) -> list[str]:
    """A work dir's SQLite store keeps absolute artifact locations: in a copy (`cp -a`) or
    a moved work dir they name the original's `mlartifacts`, and a rerun would write there.
    Rewritten to this work dir's, in one transaction; returns the old roots. The caller
    holds the store's lock."""
    new = (work_dir.resolve() / ARTIFACTS).as_uri()
    con = sqlite3.connect(db, timeout=30)
    try:
        with con:
            rows = con.execute("SELECT artifact_location FROM experiments").fetchall()
            marker = f"/{ARTIFACTS}"
            old_roots = {
                loc[: loc.index(marker) + len(marker)]
                for (loc,) in rows
                if loc and marker in loc and not loc.startswith(new)
            }
            for old in old_roots:
                for table, column in _LOCATIONS:
                    con.execute(
                        f"UPDATE {table} SET {column} = ? || substr({column}, ?) "
                        f"WHERE substr({column}, 1, ?) = ?",
                        (new, len(old) + 1, len(old), old),
                    )
    finally:
        con.close()
    return sorted(old_roots)


def experiment_id(client: MlflowClient, name: str, uri: str, work_dir: Path) -> str:
    own = work_dir.resolve() / "mlflow.db"
    if uri == f"sqlite:///{own}":  # the work dir's own store: the work dir is the unit
        for old in relocate_artifacts(own, work_dir):
            logging.getLogger(__name__).info("MLflow artifacts: %s is now %s", old, work_dir)
    exp = client.get_experiment_by_name(name)
    if exp is not None:
        for key, value in EXPERIMENT_KIND.items():
            if key not in exp.tags:  # an experiment made before the tag, or by hand
                client.set_experiment_tag(exp.experiment_id, key, value)
        return exp.experiment_id
    # With a local SQLite store, artifacts sit beside it in the work dir; a tracking server
    # decides for itself where artifacts go (somewhere all its readers can reach).
    local = uri.startswith("sqlite:")
    artifacts = (work_dir.resolve() / ARTIFACTS).as_uri() if local else None
    return client.create_experiment(name, artifact_location=artifacts, tags=EXPERIMENT_KIND)


def open_parent_run(
    client: MlflowClient, exp_id: str, params: Params, key: str, params_file: Path, run_name: str
) -> str:
    """The run of these params, whose hash is `key`: resumed if one exists (same hash), else
    created and filled."""
    found = client.search_runs(
        [exp_id],
        filter_string=f"tags.{PARAMS_HASH_TAG} = '{key}' and tags.{STAGE_TAG} = 'pipeline'",
        max_results=1,
        order_by=["attributes.start_time ASC"],
    )
    if found:
        run_id = found[0].info.run_id
        client.update_run(run_id, status="RUNNING")
        kill_orphans(client, run_id)
        return run_id
    tags = {PARAMS_HASH_TAG: key, STAGE_TAG: "pipeline", **_provenance()}
    run = client.create_run(exp_id, run_name=run_name, tags=tags)
    run_id = run.info.run_id
    flat = flatten(to_dict(params))  # the orchestration's settings are no run parameter
    flat = {k: v for k, v in flat.items() if not k.startswith("pipeline.")}
    for start in range(0, len(flat), 100):  # MLflow caps a batch at 100 params
        items = list(flat.items())[start : start + 100]
        client.log_batch(run_id, params=[_param(k, v) for k, v in items])
    client.log_artifact(run_id, str(params_file))
    return run_id


def kill_orphans(client: MlflowClient, run_id: str) -> list[str]:
    """Child runs left RUNNING by a killed flow (the caller holds the run's lock, so no
    live flow owns them) are marked KILLED."""
    exp = client.get_run(run_id).info.experiment_id
    orphans = client.search_runs(
        [exp],
        filter_string=f"tags.mlflow.parentRunId = '{run_id}' and attributes.status = 'RUNNING'",
    )
    for orphan in orphans:
        client.set_terminated(orphan.info.run_id, RunStatus.to_string(RunStatus.KILLED))
    return [o.info.run_id for o in orphans]


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


@contextlib.contextmanager
def stage_run(uri: str, parent_id: str, stage: str) -> Iterator[tuple[MlflowClient, str]]:
    """A nested child run for one executed stage: FAILED if the stage raises, KILLED if it
    is interrupted. The store's errors in the body are the body's to map (store_errors)."""
    client = client_for(uri)
    with store_errors(uri):
        parent = client.get_run(parent_id)
        run = client.create_run(
            parent.info.experiment_id,
            run_name=stage,
            tags={"mlflow.parentRunId": parent_id, STAGE_TAG: stage},
        )
    try:
        yield client, run.info.run_id
    except BaseException as err:
        status = RunStatus.FAILED if isinstance(err, Exception) else RunStatus.KILLED
        with contextlib.suppress(Exception):  # the stage's error is the one to report
            client.set_terminated(run.info.run_id, RunStatus.to_string(status))
        raise
    with store_errors(uri):
        finish_run(client, run.info.run_id)


def log_metrics(client: MlflowClient, run_id: str, metrics: dict[str, float], step: int = 0):
    now = int(time.time() * 1000)
    batch = [Metric(k, float(v), now, step) for k, v in metrics.items()]
    for start in range(0, len(batch), 1000):  # MLflow caps a batch at 1000 metrics
        client.log_batch(run_id, metrics=batch[start : start + 1000])


def numbers(report: dict) -> dict[str, float]:
    """The numeric leaves of a stage's report, by dotted path: its MLflow metrics."""
    return {
        k.replace(".", "/"): float(v)
        for k, v in flatten(report).items()
        if isinstance(v, int | float) and not isinstance(v, bool)
    }


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
