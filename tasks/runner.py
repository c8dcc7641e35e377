"""One Prefect task runs any row of the stage table: find or make the stage's folder, reuse
a finished one, else run the library function in an MLflow child run and record it.

Reuse has one rule: a folder whose `stage.json` verifies (its stage, its key = the folder's
name, every file it lists at its size) and, for a stage that can be extended, satisfies
the params. Nothing else is trusted: not Prefect's result cache (it pickles), not a
folder's existence. A stage holds a lock on its folder while it decides and runs, so a
second flow on the same work dir waits for the first and then reuses its output.
"""

from __future__ import annotations

import json
import logging
import shutil
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from prefect import get_run_logger, task
from prefect.cache_policies import NO_CACHE
from prefect.states import Completed, Failed, State

from tasks.settings import RunParams
from tasks.stages import Stage, StageRun, named, stage_key
from tasks.tracking import TrackingLost, log_metrics, numbers, redact, stage_run, store_errors
from transformer.cli import USER_ERRORS, UserError
from transformer.config import fingerprint
from transformer.files import STAGE_RECORD, atomic_write, locked, remove_leftovers

RECORD_FORMAT = "transformer-mt/stage/1"
# The names of Failed states whose message is the whole story: the user's to fix (exit 2),
# or a tracking server that stopped answering (exit 1).
USER_ERROR, SERVER_LOST = "UserError", "TrackingServerLost"
ONE_LINE = (USER_ERROR, SERVER_LOST)


class _NoEmptyTraceback(logging.Filter):
    """Prefect logs a task that returns a Failed state with exc_info=True and no exception
    active, which prints "NoneType: None" under the error line: drop the empty traceback."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.exc_info and record.exc_info[0] is None:
            record.exc_info = None
        return True


logging.getLogger("prefect.task_runs").addFilter(_NoEmptyTraceback())


class RecordError(UserError, RuntimeError):
    """A stage.json that does not describe its folder: tampered with, or of another stage."""


def is_user_error(err: BaseException) -> bool:
    """Errors of input, params, files, disk or permissions (their message names the
    culprit), the library's or a trainer's that exited with one: one line for the user.
    Anything else is a bug and keeps its traceback."""
    return isinstance(err, USER_ERRORS) or getattr(err, "user_error", False)


@task(persist_result=False, cache_policy=NO_CACHE)
def run_stage(name: str, params: RunParams, run: dict, upstream: dict[str, dict], refresh: bool):
    """`params`: the run's params, as the flow read them; `run`: the pipeline run
    (params_file, work_dir, uri, run_id); `upstream`: the records of the stages this one
    reads (less those the params do not ask for). Returns this stage's record (Cached if
    reused), or a Failed state with a one-line message for a user error."""
    stage, log = named(name), get_run_logger()
    try:
        inputs = {n: record["fingerprint"] for n, record in upstream.items()}
        key = stage_key(stage, params, inputs)  # reads the inputs from outside: may fail
        out = Path(run["work_dir"]) / stage.name / key
        with folder_lock(out, log):
            record = None if refresh else read_record(out, stage, key)
            if record and (stage.satisfied is None or stage.satisfied(params, record)):
                log.info("%s: reusing %s", stage.name, out)
                return Completed(name="Cached", message=str(out), data=record)
            if refresh and out.exists():
                shutil.rmtree(out)
            # The stage runs (again): until it finishes, no record describes the folder. A
            # training killed while it extends a finished run resumes, never trusted as done.
            (out / STAGE_RECORD).unlink(missing_ok=True)
            record = execute(stage, params, run, upstream, key, out)
    except Exception as err:
        return user_failure(stage.name, err)
    log.info("%s: done in %s", stage.name, out)
    return record


def user_failure(where: str, err: Exception) -> State:
    """A Failed state whose message is one line, for a user error; a bug is raised again,
    and keeps its traceback."""
    if not is_user_error(err):
        raise err
    message = redact(str(err).splitlines()[0]) if str(err) else type(err).__name__
    get_run_logger().error("%s failed: %s", where, message)
    name = SERVER_LOST if isinstance(err, TrackingLost) else USER_ERROR
    return Failed(name=name, message=f"{where}: {message}")


def execute(
    stage: Stage, params: RunParams, run: dict, upstream: dict, key: str, out: Path
) -> dict:
    """Run the stage's function in a child MLflow run; record and return what it made."""
    with stage_run(run["uri"], run["run_id"], stage.name) as (client, child):
        r = StageRun(
            params=params,
            inputs={n: Path(record["path"]) for n, record in upstream.items()},
            reports={n: record["report"] for n, record in upstream.items()},
            out=out,
            params_file=Path(run["params_file"]),
            tracking={**run, "stage_run_id": child},
            device="cuda" if torch.cuda.is_available() else "cpu",
        )
        start = time.monotonic()
        report = _jsonable(stage.run(r))
        record = write_record(stage, key, upstream, report, out)
        with store_errors(run["uri"]):
            log_metrics(client, child, {"stage_seconds": time.monotonic() - start})
            log_metrics(client, child, numbers(report))
            for name in stage.artifacts:  # files or folders; those a stage did not write: none
                path = out / name
                if path.is_dir():
                    client.log_artifacts(child, str(path), name)
                elif path.is_file():
                    client.log_artifact(child, str(path))
    return record


# --------------------------------------------------------------------------- records


def write_record(stage: Stage, key: str, upstream: dict, report: dict, out: Path) -> dict:
    output = stage.output(report) if stage.output else None
    record = {
        "format": RECORD_FORMAT,
        "stage": stage.name,
        "key": key,
        "path": str(out),
        "fingerprint": key if output is None else fingerprint(key, output),
        "inputs": {n: record["fingerprint"] for n, record in upstream.items()},
        "report": report,
        "files": _listing(out),
    }
    atomic_write(out / STAGE_RECORD, json.dumps(record, indent=1))
    return record


def read_record(out: Path, stage: Stage, key: str) -> dict | None:
    """The folder's record if it has one, verified against the folder; None if it has
    none (never finished); RecordError naming the file if it lies."""
    path = out / STAGE_RECORD
    if not path.is_file():
        return None
    try:
        record = json.loads(path.read_text(encoding="utf-8"))
        ok = record["format"] == RECORD_FORMAT and record["stage"] == stage.name
        ok = ok and record["key"] == key
        files = record["files"]
    except (OSError, ValueError, KeyError, TypeError) as err:
        raise RecordError(f"{path}: not a stage record ({err}); delete {out} to rebuild") from None
    if not ok:
        raise RecordError(f"{path}: records another stage or folder; delete {out} to rebuild")
    listing = _listing(out)
    for name, size in files.items():
        if listing.get(name) != size:
            found = "missing" if name not in listing else f"{listing[name]} bytes"
            raise RecordError(
                f"{out / name}: {found}, its stage record says {size} bytes; "
                f"delete {out} to rebuild"
            )
    return {**record, "path": str(out)}  # where it is now: a work dir can be moved


def _listing(out: Path) -> dict[str, int]:
    """Size of every file under `out` but the record and hidden files (locks, stamps)."""
    return {
        str(p.relative_to(out)): p.stat().st_size
        for p in sorted(out.rglob("*"))
        if p.is_file() and p.name != STAGE_RECORD and not p.name.startswith(".")
    }


def _jsonable(report: Any) -> dict:
    """What a library function returned, as JSON data (a path or nothing: no report)."""
    return json.loads(json.dumps(report)) if isinstance(report, dict) else {}


@contextmanager
def folder_lock(out: Path, log) -> Iterator[None]:
    """One runner per stage folder, across processes; leftovers of killed runs go first."""
    waiting = lambda: log.info("another flow is building %s: waiting for it", out)
    with locked(out.parent / f".{out.name}.lock", waiting):
        for leftover in remove_leftovers(out):
            log.info("removed %s, left by a killed run", leftover)
        yield
