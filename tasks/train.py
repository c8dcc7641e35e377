"""The train stage: `torchrun` in a subprocess, its output streamed, its metrics in MLflow.

Training runs under plain torchrun (the same command scales to many GPUs and nodes); this
task only launches it, watches it, and records it. A rerun of the same params resumes from
the run folder's last checkpoint, because the trainer does that by itself.
"""

from __future__ import annotations

import collections
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

import torch
from mlflow.system_metrics.system_metrics_monitor import SystemMetricsMonitor
from prefect import get_run_logger, task

from tasks.report import plot_training_curve
from tasks.stages import fresh, output_key
from tasks.tracking import executing

DONE = "DONE"  # written when torchrun exits 0: the run folder holds a finished training


class TrainingFailed(RuntimeError):
    pass


@task(name="train", cache_key_fn=output_key, persist_result=True)
def train(
    params_file: str, shards: str, out_dir: str, tracking: dict, refresh: bool = False
) -> str:
    if fresh(out_dir, refresh) or not (Path(out_dir) / DONE).exists():
        with executing("train", params_file, tracking) as (params, client, run_id):
            monitor = SystemMetricsMonitor(
                run_id, sampling_interval=5, tracking_uri=tracking["uri"]
            )
            monitor.start()
            try:
                launch(
                    params_file,
                    shards,
                    out_dir,
                    tracking,
                    nproc=nproc_per_node(params.train.nproc_per_node),
                    timeout_s=params.train.timeout_minutes * 60 or None,
                )
            finally:
                monitor.finish()
            (Path(out_dir) / DONE).touch()
            client.log_artifact(run_id, str(Path(out_dir) / "train.log"))
            png = plot_training_curve(client, tracking["run_id"], Path(out_dir) / "curve.png")
            client.log_artifact(tracking["run_id"], str(png))
    return out_dir


def nproc_per_node(configured: int | None) -> int:
    """Processes per node: as configured, else one per visible GPU, else 1 on CPU."""
    return configured or torch.cuda.device_count() or 1


def launch(
    params_file: str, shards: str, out_dir: str, tracking: dict, nproc: int, timeout_s: float | None
) -> None:
    """Run torchrun to completion, streaming its output; raise with its tail on failure."""
    log = get_run_logger()
    cmd = [
        sys.executable, "-m", "torch.distributed.run",
        "--standalone", "--nnodes", "1", "--nproc_per_node", str(nproc),
        "-m", "tasks.train_worker", params_file, "--data", shards, "--out", out_dir,
    ]  # fmt: skip
    # The ranks find the run through the environment; only rank 0 logs to it.
    env = dict(
        os.environ,
        MLFLOW_RUN_ID=tracking["run_id"],
        MLFLOW_TRACKING_URI=tracking["uri"],
        PYTHONUNBUFFERED="1",
    )
    Path(out_dir).mkdir(parents=True, exist_ok=True)
    log.info("launching: %s", " ".join(cmd))
    tail: collections.deque[str] = collections.deque(maxlen=40)
    timed_out = threading.Event()
    # torchrun stays in our process group, so a cancelled flow run's signal reaches it too.
    with (
        open(Path(out_dir) / "train.log", "a", buffering=1) as logfile,
        subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                         text=True, bufsize=1) as proc,
    ):  # fmt: skip
        # A timer, not a check per line: a hung rank prints nothing.
        watchdog = threading.Timer(timeout_s or 0, _stop, args=(proc, timed_out))
        if timeout_s:
            watchdog.start()
        try:
            for line in proc.stdout:
                logfile.write(line)
                tail.append(line.rstrip())
                log.info(line.rstrip())
            code = proc.wait()
        except BaseException:  # the task itself was interrupted: leave no trainer behind
            _stop(proc)
            raise
        finally:
            watchdog.cancel()
    last = "\n".join(tail)
    if timed_out.is_set():
        raise TrainingFailed(f"training exceeded train.timeout_minutes; last lines:\n{last}")
    if code != 0:
        raise TrainingFailed(
            f"torchrun exited with {code}; last lines of {out_dir}/train.log:\n{last}"
        )


def _stop(proc: subprocess.Popen, timed_out: threading.Event | None = None) -> None:
    """SIGTERM torchrun alone (it forwards one SIGTERM to each rank, which finishes its
    update and checkpoints; a second signal would make the ranks stop without saving),
    then SIGKILL if it has not exited within a minute."""
    if proc.poll() is not None:
        return
    if timed_out is not None:
        timed_out.set()
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        proc.kill()
