"""The train stage on a real Slurm (tests/slurm_cluster.py: munged, slurmctld and two
slurmd on this host): the smoke flow under `launcher: slurm` trains bitwise as the local
launcher does, two nodes as one node with the same ranks, a time limit and a cancelled
flow each leave a state that the rerun resumes, and the job's end is the stage's result in
one line."""

from __future__ import annotations

import inspect
import json
import logging
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from conftest import TINY_FLOW, assert_same_training, run_dir, wait_for
from mlflow.tracking import MlflowClient
from slurm_cluster import require, slurm_cluster

from tasks import slurm as slurm_launcher
from tasks.launch import Layout, LocalRun, TrainingFailed, follow, local_command, worker
from tasks.settings import load_run_params
from transformer import model_file
from transformer.training import checkpoint as ckpt

ROOT = Path(__file__).resolve().parents[1]
SMOKE = str(ROOT / "params" / "smoke.yaml")
ON_SLURM = ["pipeline.launcher=slurm", "pipeline.nproc_per_node=1"]
# Dropout 0: the ranks' dropout streams differ from the single process's.
SAME_UPDATES = ["model.dropout=0.0", "train.max_steps=3", "train.save_every=3",
                "train.valid_every=3", "train.log_every=1", "train.batch_tokens=512",
                "train.max_tokens=256"]  # fmt: skip
LONG = ["train.max_steps=100000", "train.save_every=5", "export.formats=[]"]  # stopped midway
log = logging.getLogger(__name__)

pytestmark = pytest.mark.timeout(1800)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    """The environment that Slurm's commands, and the flows the tests start, see."""
    require("munged", "slurmctld", "slurmd", "sbatch", "srun", "scontrol", "scancel")
    with slurm_cluster(tmp_path_factory.mktemp("slurm"), nodes=2) as env:
        yield {k: v for k, v in env.items() if not k.startswith(("MLFLOW_", "PREFECT_"))}


def flow(cluster: dict, work: Path, *extra: str) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "flows.wmt14_ende", SMOKE, *TINY_FLOW, *extra,
           "--work-dir", str(work)]  # fmt: skip
    env = {**cluster, "PYTHONUNBUFFERED": "1"}
    return subprocess.Popen(cmd, cwd=ROOT, env=env, start_new_session=True, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)  # fmt: skip


def finish(proc: subprocess.Popen, timeout: float = 900) -> tuple[int, str]:
    out, _ = proc.communicate(timeout=timeout)
    return proc.returncode, out


def final(run: Path) -> dict:
    return model_file.load_typed(ckpt.list_files(run, "state")[-1], ckpt.STATE_FORMAT)


def job_state(cluster: dict, job_id: str) -> str:
    return slurm_launcher.job_fields(job_id, cluster)["JobState"]


def stage_params(work: Path, stage: str) -> list[dict]:
    client = MlflowClient(f"sqlite:///{work / 'mlflow.db'}")
    exp = client.get_experiment_by_name("wmt14-ende")
    runs = client.search_runs([exp.experiment_id], filter_string=f"tags.stage = '{stage}'")
    return [r.data.params for r in runs]


@pytest.mark.slow  # 2.5 min on 2 cores; the two-node test below is the default suite's
def test_the_smoke_flow_on_slurm_trains_bitwise_as_the_local_launcher(
    cluster, fresh_flow, tmp_path
):
    work = tmp_path / "work"
    code, out = finish(flow(cluster, work, *ON_SLURM))
    assert code == 0, out[-3000:]
    assert_same_training(final(run_dir(work)), final(run_dir(fresh_flow)))
    (params,) = stage_params(work, "train")
    assert params["launcher"] == "slurm" and params["nodes"] == "1" and params["ranks"] == "1"
    assert job_state(cluster, params["slurm_job_id"]) == "COMPLETED"
    assert f"submitted Slurm job {params['slurm_job_id']}" in out
    # Rank 0's log streamed into the flow's, once.
    assert out.count("step 40/40 (100%)") == 1, out[-3000:]


def launch(run, out: Path) -> None:
    follow(run, out / "train.log", 0, log, None)


# What a work dir, a deployment parameter, may hold: each a way out of a quoted word ('%'
# and '\\' are refused: Slurm reads them as patterns in a job's paths).
HOSTILE = "w $(touch PWNED) `touch PWNED` ' \" $HOME ; touch PWNED"


def test_two_nodes_train_as_one_node_with_the_same_ranks(
    cluster, tiny_params, tiny_shards, tmp_path, monkeypatch
):
    """Two torchrun agents, one a node, meeting at the first (c10d), and one agent of two
    processes on this machine: the same two ranks, the same updates, bit for bit. The job's
    files are in a work dir holding command substitutions, quotes, a variable and spaces:
    the job's scripts quote every path whole, and no command in it runs."""
    cwd = tmp_path / "cwd"  # the job's working directory (sbatch --chdir): where PWNED would be
    cwd.mkdir()
    monkeypatch.chdir(cwd)
    hostile = tmp_path / HOSTILE
    hostile.mkdir()
    shutil.copy(tiny_params, hostile / "params.yaml")
    shutil.copytree(tiny_shards, hostile / "shards")
    env = {**cluster, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}
    two, one = hostile / "two", tmp_path / "one"
    cfg = load_run_params(tiny_params).pipeline.slurm
    for out in (two, one):
        out.mkdir()
        (out / "train.log").touch()  # what tasks.train.launch does first
    work = worker(hostile / "params.yaml", hostile / "shards", two, SAME_UPDATES)
    job = slurm_launcher.submit(Layout("slurm", 2, 1), cfg, work, two, env, log)
    launch(job, two)
    with open(one / "train.log", "ab") as logfile:
        cmd = local_command(
            Layout("local", 1, 2), worker(tiny_params, tiny_shards, one, SAME_UPDATES)
        )
        launch(LocalRun(cmd, env, logfile, one / "train.log"), one)
    a, b = final(two), final(one)
    assert a["world_size"] == b["world_size"] == 2
    assert_same_training(a, b)
    assert job_state(cluster, job.job_id) == "COMPLETED"
    # Rank 0 logs into train.log, wherever the rendezvous put it; rank 1 says nothing.
    assert (two / "train.log").read_text().count("step 3/3 (100%)") == 1
    for node in (0, 1):
        assert "step " not in (two / f"train.node{node}.log").read_text()
    pwned = [*tmp_path.rglob("PWNED"), *(d / "PWNED" for d in (ROOT, Path.home(), Path("/tmp")))]
    assert not [p for p in pwned if p.exists()]


def test_a_job_slurm_refuses_fails_in_one_line_naming_it(
    cluster, tiny_params, tiny_shards, tmp_path
):
    params = load_run_params(tiny_params, [*ON_SLURM, "pipeline.slurm.partition=nowhere"])
    work = worker(tiny_params, tiny_shards, tmp_path)
    with pytest.raises(
        slurm_launcher.SlurmError, match=r"^sbatch failed: .*Invalid partition name"
    ):
        slurm_launcher.submit(Layout("slurm", 1, 1), params.pipeline.slurm, work, tmp_path,
                              cluster, log)  # fmt: skip


@pytest.mark.parametrize(
    "state, code, limited, what",
    [
        ("COMPLETED", 0, True, "reached its time limit; the trainers saved and stopped"),
        ("FAILED", 143, True, "reached its time limit; the trainers saved and stopped"),
        ("TIMEOUT", 0, False, "reached its time limit before the trainers saved (raise "
         "pipeline.slurm.signal_seconds)"),
        ("PREEMPTED", 0, False, "was preempted"),
        ("CANCELLED", 0, False, "was cancelled"),
        ("NODE_FAIL", 0, False, "lost a node"),
        ("FAILED", 143, False, "ended: its trainers were stopped by SIGTERM and saved"),
    ],
)  # fmt: skip
def test_each_end_of_a_job_is_one_line_that_says_where_a_rerun_resumes(
    state, code, limited, what, tmp_path
):
    with pytest.raises(TrainingFailed) as err:
        slurm_launcher.raise_for_end("7", state, code, limited, [], tmp_path)
    assert str(err.value) == f"Slurm job 7 {what}: no checkpoint yet: a rerun starts over"
    assert err.value.user_error


def test_a_trainer_error_in_a_job_is_its_one_line(tmp_path):
    with pytest.raises(TrainingFailed, match=r"^Slurm job 7 failed: error: bad\Z") as err:
        slurm_launcher.raise_for_end("7", "FAILED", 2, False, ["x", "error: bad"], tmp_path)
    assert err.value.user_error
    slurm_launcher.raise_for_end("7", "COMPLETED", 0, False, [], tmp_path)  # done: no error


def saved_step(work: Path) -> int:
    return max(int(p.stem.split("-")[1]) for p in run_dir(work).glob("checkpoints/state-*"))


def resumes(cluster: dict, work: Path) -> None:
    """The rerun, a few steps past the saved state, resumes there and finishes."""
    saved = saved_step(work)
    code, out = finish(flow(cluster, work, *ON_SLURM, *LONG, f"train.max_steps={saved + 5}"))
    assert code == 0, out[-3000:]
    assert f"at step {saved}" in (run_dir(work) / "train.log").read_text()


@pytest.mark.slow
def test_a_cancelled_flow_cancels_its_job_which_saves_and_the_rerun_resumes(cluster, tmp_path):
    work = tmp_path / "work"
    proc = flow(cluster, work, *ON_SLURM, *LONG)
    wait_for(lambda: any(work.glob("train/*/checkpoints/state-*")), 600, proc, "a checkpoint")
    os.killpg(proc.pid, signal.SIGTERM)  # as Prefect cancels a flow run, or a scheduler
    code, out = finish(proc, timeout=300)
    assert code in (-signal.SIGTERM, 128 + signal.SIGTERM), out[-3000:]  # Prefect re-raises it
    assert "cancelled Slurm job" in out, out[-3000:]
    (params,) = stage_params(work, "train")
    assert job_state(cluster, params["slurm_job_id"]) == "CANCELLED"
    assert "stopped by SIGTERM" in (run_dir(work) / "train.log").read_text()
    resumes(cluster, work)


@pytest.mark.slow
def test_a_job_at_its_time_limit_saves_and_the_rerun_resumes(cluster, tmp_path):
    """slurmctld looks at time limits every 30 s: a 2-minute job is warned 60 to 90 s in."""
    work = tmp_path / "work"
    limit = ["pipeline.slurm.time_limit_minutes=2", "pipeline.slurm.signal_seconds=60"]
    code, out = finish(flow(cluster, work, *ON_SLURM, *LONG, *limit))
    assert code == 2, out[-3000:]
    saved = saved_step(work)
    line = (
        f"reached its time limit; the trainers saved and stopped: rerun to resume at step {saved}"
    )
    assert line in out, out[-3000:]
    (params,) = stage_params(work, "train")
    assert job_state(cluster, params["slurm_job_id"]) != "TIMEOUT"  # it ended before the limit
    resumes(cluster, work)


def test_the_params_hash_and_the_stages_ignore_the_launcher():
    from tasks.stages import named, stage_key
    from transformer.config import params_hash

    local = load_run_params(SMOKE)
    far = load_run_params(SMOKE, [*ON_SLURM, "pipeline.nnodes=2", "pipeline.slurm.partition=gpu"])
    assert params_hash(local) == params_hash(far)
    inputs = {"shards": "x"}
    assert stage_key(named("train"), local, inputs) == stage_key(named("train"), far, inputs)


GUIDE = ROOT / "docs" / "guides" / "many-nodes.md"


def guide_commands() -> list[list[str]]:
    text = GUIDE.read_text(encoding="utf-8")
    return [shlex.split(line) for block in re.findall(r"```bash\n(.*?)```", text, flags=re.S)
            for line in block.splitlines() if line.strip()]  # fmt: skip


def test_the_guide_runs_what_the_tests_run():
    """docs/guides/many-nodes.md: the deployment run names a deployment of prefect.yaml, the
    flow's own parameter, a Prefect option, and overrides that validate against its params;
    the flow command is the one the smoke flow test above runs on a real Slurm."""
    from flows.pipeline import wmt14_ende

    deploy, run = guide_commands()
    assert deploy[:3] == ["prefect", "deployment", "run"] and deploy[4] == "-p"
    deployments = yaml.safe_load((ROOT / "prefect.yaml").read_text())["deployments"]
    # `flows.deploy --pool gpu` registers each deployment for the pool as NAME-gpu
    (deployment,) = [d for d in deployments if f"wmt14-ende/{d['name']}-gpu" == deploy[3]]
    name, _, value = deploy[5].partition("=")
    assert name in inspect.signature(wmt14_ende.fn).parameters
    params = load_run_params(ROOT / deployment["parameters"]["params"], json.loads(value))
    assert params.pipeline.launcher == "slurm" and params.pipeline.nnodes == 4
    done = subprocess.run([str(Path(sys.executable).parent / "prefect"), "deployment", "run",
                           "--help"], capture_output=True, text=True, timeout=120)  # fmt: skip
    assert "--param -p" in done.stdout
    assert run[:4] == ["python", "-m", "flows.wmt14_ende", "params/smoke.yaml"]
    assert run[4:] == [*ON_SLURM, "--work-dir", "work"]
