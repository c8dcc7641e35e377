"""One Prefect task runs any row of the stage table: find or make the stage's folder, reuse
a finished one, else run the library function in an MLflow child run and record it.

Reuse has one rule: a folder whose `stage.json` verifies (its stage, its key = the folder's
name, its own checksum, and the folder's files exactly those it lists, each of its size and
sha256) and, for a stage that can be extended, satisfies the params. Nothing else is
trusted: not Prefect's result cache (it pickles), not a folder's existence.

Two locks per folder keep flows on one work dir apart. A stage holds the folder's lock while
it decides and runs, so a second flow waits for the first and then reuses its output. And
a flow that has made or reused a folder holds it for reading (shared) until the flow ends,
since a later stage of it may read it; a stage that would change a finished folder (train
extended, `--refresh`) takes that lock exclusively, so it waits for every such flow to end.
"""

from __future__ import annotations

import hashlib
import json
import logging
import shutil
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import IO, Any

import torch
from prefect import get_run_logger, task
from prefect.cache_policies import NO_CACHE
from prefect.states import Completed, Failed, State

from tasks.credentials import redact
from tasks.settings import RunParams
from tasks.stages import Stage, StageRun, named, stage_key
from tasks.tracking import TrackingLost, log_metrics, numbers, stage_run, store_errors
from transformer.cli import USER_ERRORS, UserError, one_line
from transformer.config import fingerprint
from transformer.files import (
    STAGE_RECORD,
    atomic_write,
    file_sha256,
    lock_file,
    locked,
    read_bounded,
    remove_leftovers,
)

RECORD_FORMAT = "transformer-mt/stage/2"
# Records written before checksums list sizes only. One is verified by its sizes, as then,
# and upgraded: its checksums are taken and it is written again in RECORD_FORMAT. A byte
# changed before that goes unseen, as it did then; every change after it is seen.
SIZES_ONLY = "transformer-mt/stage/1"
# The names of Failed states whose message is the whole story: the user's to fix (exit 2),
# or a tracking server that stopped answering (exit 1).
USER_ERROR, SERVER_LOST = "UserError", "TrackingServerLost"
ONE_LINE = (USER_ERROR, SERVER_LOST)
RECORD_BYTES = 64 << 20  # a record lists files and a report: far less than this


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
    out = None
    try:
        inputs = {n: record["fingerprint"] for n, record in upstream.items()}
        key = stage_key(stage, params, inputs)  # reads the inputs from outside: may fail
        out = Path(run["work_dir"]) / stage.name / key
        with folder_lock(out, log):
            record = None if refresh else read_record(out, stage, key, log)
            if record and (stage.satisfied is None or stage.satisfied(params, record)):
                log.info("%s: reusing %s", stage.name, out)
                hold_for_reading(out)
                return Completed(name="Cached", message=str(out), data=record)
            with changing(out, log):
                if refresh and out.exists():
                    shutil.rmtree(out)
                # The stage runs (again): until it finishes, no record describes the folder. A
                # training killed while it extends a finished run resumes, never trusted as done.
                (out / STAGE_RECORD).unlink(missing_ok=True)
                record = execute(stage, params, run, upstream, key, out)
            hold_for_reading(out)
    except Exception as err:
        return user_failure(stage.name, _located(err, out))
    log.info("%s: done in %s", stage.name, out)
    return record


def user_failure(where: str, err: Exception) -> State:
    """A Failed state whose message is one line, for a user error; a bug is raised again,
    and keeps its traceback."""
    if not is_user_error(err):
        raise err
    message = one_line(redact(str(err).strip())) if str(err).strip() else type(err).__name__
    get_run_logger().error("%s failed: %s", where, message)
    name = SERVER_LOST if isinstance(err, TrackingLost) else USER_ERROR
    return Failed(name=name, message=f"{where}: {message}")


def _located(err: Exception, out: Path | None) -> Exception:
    """An OSError that names no file (a write that found the disk full) names the stage's
    folder: the disk to free is the one it is on."""
    if isinstance(err, OSError) and err.errno and err.filename is None and out is not None:
        return OSError(err.errno, err.strerror, str(out))
    return err


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
        "files": {name: {"bytes": size, "sha256": file_sha256(out / name)}
                  for name, size in _listing(out).items()},
    }  # fmt: skip
    _save_record(out, record)
    return record


def _save_record(out: Path, record: dict) -> None:
    # Its own checksum: an edited or damaged record (a report, a file list) is no record.
    atomic_write(out / STAGE_RECORD, json.dumps({**record, "sha256": _digest(record)}, indent=1))


def _digest(record: dict) -> str:
    body = {k: v for k, v in record.items() if k not in ("sha256", "path")}
    return hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()


def read_record(out: Path, stage: Stage, key: str, log=None) -> dict | None:
    """The folder's record if it has one, verified against the folder (every file read);
    None if it has none (never finished); RecordError naming the file if it lies."""
    path = out / STAGE_RECORD
    if not path.is_file():
        return None
    rebuild = f"delete {out} to rebuild"
    try:
        record = json.loads(read_bounded(path, RECORD_BYTES, "stage record", RecordError))
        old = record["format"] == SIZES_ONLY
        ok = record["format"] in (RECORD_FORMAT, SIZES_ONLY) and record["stage"] == stage.name
        ok = ok and record["key"] == key and (old or record["sha256"] == _digest(record))
        files = {name: _expected(entry, old) for name, entry in record["files"].items()}
    except (ValueError, KeyError, TypeError, AttributeError, RecursionError) as err:
        raise RecordError(f"{path}: not a stage record ({_short(err)}); {rebuild}") from None
    if not ok:
        raise RecordError(f"{path}: records another stage or folder, or was edited; {rebuild}")
    listing = _listing(out)
    for name in sorted(files.keys() | listing.keys()):
        _check_file(out, name, files.get(name), listing.get(name), rebuild)
    if old and not files:  # format 1 had no checksum of its own: an emptied list is no record
        raise RecordError(f"{path}: lists no files; {rebuild}")
    if old:
        _upgrade(out, record, log)
    return {**record, "path": str(out)}  # where it is now: a work dir can be moved


def _expected(entry, old: bool) -> tuple[int, str | None]:
    """(bytes, sha256) a record lists for a file; format 1 listed the size alone."""
    if old:
        return int(entry), None
    return int(entry["bytes"]), str(entry["sha256"])


def _check_file(out: Path, name: str, expected, size: int | None, rebuild: str) -> None:
    if expected is None:
        raise RecordError(f"{out / name}: not in its stage record; {rebuild}")
    want_size, want_sha = expected
    if size != want_size:
        found = "missing" if size is None else f"{size} bytes"
        raise RecordError(
            f"{out / name}: {found}, its stage record says {want_size} bytes; {rebuild}"
        )
    if want_sha is not None and file_sha256(out / name) != want_sha:
        raise RecordError(f"{out / name}: sha256 differs from its stage record; {rebuild}")


def _upgrade(out: Path, record: dict, log) -> None:
    """A format 1 record, its sizes verified: checksums taken now, written as RECORD_FORMAT."""
    files = {name: {"bytes": size, "sha256": file_sha256(out / name)}
             for name, size in record["files"].items()}  # fmt: skip
    record.update(format=RECORD_FORMAT, files=files)
    _save_record(out, {k: v for k, v in record.items() if k != "sha256"})
    if log is not None:
        log.info("%s: a record without checksums: sizes verified, checksums taken now", out)


def _short(err: Exception) -> str:
    return str(err).splitlines()[0][:200] if str(err) else type(err).__name__


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


WAIT_READERS = "other flows read %s: waiting for them to end before it changes"
# The folders the flows of this process read, each held (shared) until the outermost of them
# ends: a subflow's outputs (a distillation's teachers) are read by the flow that ran it.
_READING: dict[Path, IO] = {}
_flows = 0


@contextmanager
def reading() -> Iterator[None]:
    """A flow's run: the folders its stages make or reuse stay held until the outermost
    flow of this process ends; then they may change."""
    global _flows
    _flows += 1
    try:
        yield
    finally:
        _flows -= 1
        if not _flows:
            while _READING:
                _READING.popitem()[1].close()


def _readers(out: Path) -> Path:
    """The lock that flows reading `out` share (taken only under its folder_lock, so that
    no flow changes `out` between being done with it and holding it for reading)."""
    return out.parent / f".{out.name}.read.lock"


def changing(out: Path, log) -> IO:
    """The exclusive lock of a stage about to change `out`, once no flow reads it."""
    if out in _READING:  # waiting for itself would never end
        raise RecordError(f"{out}: a flow of this process reads it, another would change it: "
                          "run them one after the other")  # fmt: skip
    return lock_file(_readers(out), lambda: log.info(WAIT_READERS, out))


def hold_for_reading(out: Path) -> None:
    """Hold `out` (shared) until the outermost flow of this process ends (`reading`)."""
    if _flows and out not in _READING:  # outside a flow (a test's task call): nothing held
        never = lambda: None  # only a stage changing `out` holds it exclusively, under its lock
        _READING[out] = lock_file(_readers(out), never, shared=True)
