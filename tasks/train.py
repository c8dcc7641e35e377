"""The train stage: the library's trainer in a subprocess (under torchrun for several
processes) or a Slurm job of several nodes (tasks/launch.py, tasks/slurm.py), rank 0's
output streamed to the run's log, its metrics in MLflow; and the cooldowns stage,
the further cooldowns branched from the run that `average.cooldowns` asks for.

The same run folder serves every params that differ only in operational keys: the trainer
resumes from its newest state by itself, so a raised `train.max_steps` or `patience`
continues the run, and a killed run loses at most `train.save_every` steps.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Sequence
from pathlib import Path

from mlflow.system_metrics.system_metrics_monitor import SystemMetricsMonitor
from prefect import get_run_logger

from tasks import slurm
from tasks.launch import Layout, LocalRun, TrainingFailed, follow, local_command, worker
from tasks.tracking import client_for
from transformer.files import TRAIN_LOG
from transformer.training.checkpoint import checkpoint_path, describe_run
from transformer.training.optim import cooldown_start
from transformer.training.plan import batch_plan

# Keys that say where training ends: a finished record that asked for other values is
# extended (or, if already past them, confirmed) by running the trainer again.
STOP_KEYS = ("max_steps", "patience", "best_metric", "valid_every", "valid_bleu", "valid_beam")


def training_request(params) -> dict:
    return {key: getattr(params.train, key) for key in STOP_KEYS}


def trained(report: dict) -> dict:
    """What of a run folder's report the stages after it depend on: the step it reached and
    the snapshots it kept."""
    return {key: report[key] for key in ("step", "snapshots")}


def launch_training(r, shards: Path) -> dict:
    """Train (or resume) in `r.out` on the `shards` folder until the params' stopping point;
    return where it got. `r`: a tasks.stages.StageRun."""
    with system_metrics(r.tracking):
        launch(r.params, r.params_file, shards, r.out, r.tracking)
    return {**describe_run(r.out), "request": training_request(r.params)}


def train_cooldowns(r, run: Path, shards: Path) -> dict:
    """The further cooldowns `average.cooldowns` asks for, trained (or resumed) on `shards`
    in `r.out/cooldown-<i>`: each a branch of the training `run` from its state at the
    cooldown's start, with train.seed + i; metrics in the stage's own MLflow run. Returns
    where each got, by folder name."""
    train = r.params.train
    start = cooldown_start(train.max_steps, train.cooldown)
    state = checkpoint_path(run, "state", start)
    if not state.is_file():  # a run trained before the state was kept, or extended after
        raise TrainingFailed(
            f"{state}: no training state at the cooldown's start (update {start}) to branch "
            "average.cooldowns from",
            user_error=True,
        )
    tracking = {**r.tracking, "run_id": r.tracking["stage_run_id"]}
    branches = cooldown_runs(r.out, r.params.average.cooldowns)
    with system_metrics(r.tracking):
        for i, out in enumerate(branches, 1):
            branch = ["--init-from", str(state), f"train.seed={train.seed + i}"]
            launch(r.params, r.params_file, shards, out, tracking, extra=branch,
                   label=f"{out.name}.")  # fmt: skip
    return {out.name: describe_run(out) for out in branches}


def cooldown_runs(folder: Path | None, cooldowns: int) -> list[Path]:
    """The run folders of the further cooldowns in the cooldowns stage's `folder`, in order
    (none without one: the params ask for no further cooldown)."""
    return [] if folder is None else [folder / f"cooldown-{i}" for i in range(1, cooldowns)]


@contextlib.contextmanager
def system_metrics(tracking: dict):
    monitor = SystemMetricsMonitor(
        tracking["stage_run_id"], sampling_interval=5, tracking_uri=tracking["uri"]
    )
    monitor.start()
    try:
        yield
    finally:
        monitor.finish()


def launch(
    params, params_file: Path, shards: Path, out: Path, tracking: dict,
    extra: Sequence[str] = (), label: str = "",
) -> None:  # fmt: skip
    """Run the trainer in `out` to the params' stopping point, on this machine or as a Slurm
    job (pipeline.launcher), following its log; raise TrainingFailed if it did not get
    there. `extra`: the trainer's further arguments; `label`: a prefix for this launch's
    own MLflow params (a cooldown's job id)."""
    log = get_run_logger()
    layout = Layout.of(params.pipeline)
    record_layout(params, layout, tracking, log)
    # The trainer finds the pipeline's MLflow run through the environment (rank 0 logs).
    env = dict(os.environ, MLFLOW_RUN_ID=tracking["run_id"], MLFLOW_TRACKING_URI=tracking["uri"],
               PYTHONUNBUFFERED="1")  # fmt: skip
    out.mkdir(parents=True, exist_ok=True)
    work = worker(params_file, shards, out, extra)
    timeout_s = params.pipeline.train_timeout_minutes * 60 or None
    # The trainer writes straight into the run folder's train.log, not into a pipe to this
    # process: if this process dies, the trainer still has somewhere to write while it saves
    # (a pipe would break under it), and it stops on its own (--die-with-parent).
    with open(out / TRAIN_LOG, "ab") as logfile:
        start = logfile.tell()
        if layout.launcher == "slurm":
            run = slurm.submit(layout, params.pipeline.slurm, work, out, env, log)
            client_for(tracking["uri"]).log_param(tracking["stage_run_id"],
                                                  f"{label}slurm_job_id", run.job_id)  # fmt: skip
        else:
            cmd = local_command(layout, work)
            log.info("launching: %s", " ".join(cmd))
            run = LocalRun(cmd, env, logfile, out / TRAIN_LOG)
        follow(run, out / TRAIN_LOG, start, log, timeout_s)


def record_layout(params, layout: Layout, tracking: dict, log) -> None:
    """Where the ranks run, in the log and in the stage's MLflow run (not the pipeline's:
    that one outlives a change of nodes, which is no stage's identity). The update is the
    params' on any layout: update_freq follows from nodes x processes x max_tokens."""
    update_freq, _ = batch_plan(params.train.batch_tokens, params.train.max_tokens, layout.ranks)
    log.info("training on %d node(s) x %d process(es) = %d rank(s), %d micro-batch(es) an "
             "update", layout.nnodes, layout.nproc, layout.ranks, update_freq)  # fmt: skip
    record = {"launcher": layout.launcher, "nodes": layout.nnodes, "nproc_per_node": layout.nproc,
              "ranks": layout.ranks, "update_freq": update_freq}  # fmt: skip
    client = client_for(tracking["uri"])
    for key, value in record.items():
        client.log_param(tracking["stage_run_id"], key, value)
