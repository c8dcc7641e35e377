"""The `wmt14-ende` flow: the rows of the stage table (tasks/stages.py) that the params ask
for, in order, prepare -> clean -> (teachers -> distill) -> vocab -> shards -> train ->
(cooldowns) -> average -> decode -> (export), every stage tracked in MLflow, then the
results published. A distillation's teachers are runs of this flow too, as subflows.
`run` is the command line's (flows/wmt14_ende.py) part that needs Prefect: the checks that
would fail after hours, then the flow on Prefect's temporary local API, or a server's.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import sys
from collections.abc import Callable
from pathlib import Path

# The temporary local API gets 20 s to start by default: too little on a busy 2-core box.
os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "180")
os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
# MLflow's download bar (registering a model) would end the run's output in bar fragments.
os.environ.setdefault("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", "false")
# The library's own log lines (pairs read, filtered, vocabulary, shards) go to the run's log.
os.environ.setdefault("PREFECT_LOGGING_EXTRA_LOGGERS", "transformer")

import logging

from prefect import flow, get_client, task
from prefect.cache_policies import NO_CACHE
from prefect.exceptions import TerminationSignal
from prefect.runtime import flow_run
from prefect.states import Failed, State

from flows.local_api import LocalApiError, check_api, local_api
from flows.stop import STOP
from tasks import stages
from tasks.credentials import holds_credential, redact, redact_logs
from tasks.distill import check_teachers, fetch_registered
from tasks.publish import publish, summary_lines
from tasks.runner import ONE_LINE, SERVER_LOST, reading, run_stage, user_failure
from tasks.settings import Overrides, RunParams, experiment_name, load_run_params
from tasks.tracking import (
    check_store,
    client_for,
    experiment_id,
    finish_run,
    mark_failed,
    open_parent_run,
    store_errors,
    tracking_uri,
)
from transformer.config import params_hash, to_yaml
from transformer.files import PARAMS, atomic_write, locked
from transformer.training.preflight import preflight

logging.getLogger("transformer").setLevel(logging.INFO)


@task(name="open-run", persist_result=False, cache_policy=NO_CACHE)
def open_run(params: RunParams, key: str, stem: str, work_dir: str):
    """Write the resolved params down and open (or resume) the MLflow run of their hash
    `key`; `stem`: the params file's name, which names the run and its registered model."""
    try:
        work = Path(work_dir)
        uri = tracking_uri(params, work)
        model = params.pipeline.registered_model or f"{experiment_name(params)}-{stem}"
        check_store(uri, model)
        # The copy of the params that the run logs: a credential in a URI is no record.
        params_file = atomic_write(work / "runs" / key / PARAMS, redact(to_yaml(params)))
        store = work / ".mlflow.lock"
        with locked(store, waiting(store)), store_errors(uri):  # one flow creates the store
            client = client_for(uri)
            exp = experiment_id(client, experiment_name(params), uri, work)
            run_id = open_parent_run(client, exp, params, key, params_file, f"{stem}-{key[:8]}")
    except Exception as err:
        return user_failure("open-run", err)
    return {
        "params_file": str(params_file),
        "work_dir": str(work),
        "uri": uri,
        "run_id": run_id,
        "experiment_id": exp,
        "registered_model": model,
    }


@flow(name="wmt14-ende", log_prints=True, persist_result=False)
def wmt14_ende(
    params: str = "params/smoke.yaml",
    overrides: Overrides | None = None,
    work_dir: str = "work",
    refresh: bool = False,
):
    """The whole pipeline for one params file. `refresh` recomputes every stage (scheduled
    retraining); otherwise finished stages are reused, and a killed training resumes."""
    STOP.take_over()  # the command line's stop, not Prefect's: flows/stop.py
    redact_logs()
    forget_credentials(list(overrides or []))
    try:
        # Read and validated here, once: every task gets the tree, none reads the file.
        resolved = load_run_params(params, list(overrides or []))
        check_teachers(resolved, Path(params))
        key = params_hash(resolved)
        work = Path(work_dir).resolve()
        # One flow per params in a work dir: a second one waits, then finds the stages done.
        lock = work / "runs" / f".{key}.lock"
        with locked(lock, waiting(lock)), reading():  # what it reads held: tasks/runner.py
            return run_stages(resolved, key, Path(params), work, refresh)
    except Exception as err:
        return user_failure("wmt14-ende", err)


def run_stages(params: RunParams, key: str, params_file: Path, work: Path, refresh: bool):
    opened = open_run(params, key, params_file.stem, str(work), return_state=True)
    if opened.name in ONE_LINE:  # a state of its own: a task's would count as "1 failed"
        return Failed(name=opened.name, message=opened.message)
    run = opened.result()
    try:  # registered teachers: fetched from the run's registry, then files like any other
        params = fetch_registered(params, run["uri"], work)
    except BaseException as err:
        mark_failed(run)
        return user_failure("teachers", err)  # a bug, or a stop, is raised again
    records: dict[str, dict] = {}
    try:
        for stage in stages.STAGES:  # the DAG, in order
            STOP.raise_if_stopped()
            if stage.asked is not None and not stage.asked(params):
                continue  # no record: the stages that read it leave it out
            upstream = {name: records[name] for name in stage.inputs if name in records}
            pipelines = run_pipelines(stage, params, params_file, work)
            if isinstance(pipelines, State):
                mark_failed(run)
                return pipelines
            upstream |= pipelines
            state = run_stage.with_options(name=stage.name)(
                stage.name, params, run, upstream, refresh, return_state=True
            )
            if state.name in ONE_LINE:
                mark_failed(run)
                return Failed(name=state.name, message=state.message)
            records[stage.name] = state.result()
        STOP.raise_if_stopped()
        published = publish(run, records, return_state=True)
        if published.name in ONE_LINE:
            mark_failed(run)
            return Failed(name=published.name, message=published.message)
        summary = published.result()
    except BaseException:
        mark_failed(run)
        raise
    with store_errors(run["uri"]):
        finish_run(client_for(run["uri"]), run["run_id"])
    return summary


def forget_credentials(overrides: list[str]) -> None:
    """A run created past its deployment's parameter schema (through the API, or by calling
    this flow from Python) may hold a credential in its overrides. The flow refuses them
    (load_run_params) after it replaces each such override in the run's stored parameters
    with ***, so that Prefect keeps none."""
    if not any(holds_credential(o) for o in overrides):
        return
    kept = ["***" if holds_credential(o) else o for o in overrides]
    with get_client(sync_client=True) as client:
        client.update_flow_run(flow_run.id, parameters={**flow_run.parameters, "overrides": kept})


def run_pipelines(stage, params: RunParams, params_file: Path, work: Path) -> dict | State:
    """The pipeline runs the stage reads (`Stage.runs`: a distillation's teachers), each a
    subflow that reuses what it finds done, as inputs by label; a Failed state if one
    fails with one line."""
    inputs = {}
    for label, (path, overrides) in (stage.runs(params, params_file) if stage.runs else {}).items():
        state = wmt14_ende.with_options(flow_run_name=f"{stage.name}: {label}")(
            path, overrides, str(work), return_state=True
        )
        if state.name in ONE_LINE:
            return Failed(name=state.name, message=f"{label}: {state.message}")
        inputs[label] = pipeline_record(state.result())
    return inputs


def pipeline_record(summary: dict) -> dict:
    """A finished pipeline run as a stage's input: its model's folder and fingerprint, and
    its summary as the report."""
    return {
        "path": str(Path(summary["model"]).parent),
        "fingerprint": summary["model_fingerprint"],
        "report": summary,
    }


def waiting(lock: Path) -> Callable[[], None]:
    """What a flow says when another holds `lock` (transformer.files.locked)."""
    return lambda: print(f"waiting for another flow, which holds {lock}", flush=True)


def run(args: argparse.Namespace, params: RunParams) -> int:
    """The flow for the command line's `args` and their `params` (read and valid)."""
    with STOP.handling():  # first: a stop at any moment from here on is one line
        try:
            return _run(args, params)
        except (TerminationSignal, KeyboardInterrupt) as err:
            signum = STOP.signum or getattr(err, "signal", signal.SIGINT)
            print(f"error: stopped by {signal.Signals(signum).name}; training saved what it "
                  "had: rerun the same command to resume", file=sys.stderr)  # fmt: skip
            return 128 + signum


def _run(args: argparse.Namespace, params: RunParams) -> int:
    # Fail fast, before Prefect starts, with what the params would fail at after hours
    # (transformer/training/preflight.py), a UserError the command says in one line. The
    # flow reads the file again (a deployment starts it with the file's path, not a tree).
    check_teachers(params, Path(args.params))
    plan = preflight(params, args.params, args.overrides)
    server = os.environ.get("PREFECT_API_URL")
    if server:
        check_api(server)
    print("\n".join(plan), flush=True)
    try:  # (an override that holds a credential was refused before: load_run_params)
        with local_api() if not server else contextlib.nullcontext():
            state = wmt14_ende(args.params, args.overrides, args.work_dir, args.refresh,
                               return_state=True)  # fmt: skip
    except LocalApiError as err:  # the environment, not the params: exit 1, one line
        print(f"error: Prefect's local API did not start: {err} (or set PREFECT_API_URL to "
              "a running server)", file=sys.stderr)  # fmt: skip
        return 1
    if state.name in ONE_LINE:
        print(f"error: {state.message}", file=sys.stderr)
        return 1 if state.name == SERVER_LOST else 2
    print("\n" + "\n".join(summary_lines(state.result())))  # a bug raises here, traced
    return 0
