"""The train stage as one Slurm job, through Slurm's own commands.

`sbatch` submits a batch script (written into the run folder's `slurm/`) in which `srun`
starts one torchrun agent per node; the agents meet at the job's first node (c10d
rendezvous at its address in Slurm). The flow follows the job with `scontrol` (`sacct`
once slurmctld has forgotten it), streams rank 0's log (train.log), and maps the
job's end to the stage's result in one line. Every node reads and writes the same run
folder: the work dir must be on a file system the nodes share.

Stopping: `--signal=B:USR1@N` warns the batch script N seconds before the time limit, and
it passes SIGTERM to the agents, which pass it to the ranks: they finish their update, save
and stop, and a rerun resumes. Cancelling the flow cancels the job: Slurm sends SIGTERM,
then SIGKILL after its KillWait, the time a save has.
"""

from __future__ import annotations

import re
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

from tasks.launch import Layout, TrainingFailed, exit_error, torchrun
from transformer.cli import UserError
from transformer.training.checkpoint import describe_run

ENDED = ("COMPLETED", "FAILED", "TIMEOUT", "PREEMPTED", "CANCELLED", "NODE_FAIL", "BOOT_FAIL",
         "DEADLINE", "OUT_OF_MEMORY")  # fmt: skip
ENDINGS = {
    "TIMEOUT": "reached its time limit before the trainers saved (raise "
    "pipeline.slurm.signal_seconds)",
    "PREEMPTED": "was preempted",
    "CANCELLED": "was cancelled",
    "NODE_FAIL": "lost a node",
    "BOOT_FAIL": "could not boot its nodes",
    "DEADLINE": "reached its deadline",
    "OUT_OF_MEMORY": "ran out of memory",
}
POLL_S = 3.0  # between two questions to slurmctld, which serves every user of the cluster
STOP_S = 90.0  # how long a cancelled job gets to end (Slurm's KillWait, 30 s by default)

BATCH = """\
#!/bin/bash
# The train stage's Slurm job (tasks/slurm.py): one torchrun agent per node, meeting at
# the first node, at its address in Slurm and a port that is a function of the job (two
# jobs on one node do not collide, every node knows it beforehand).
set -u
out={out}  # the run folder, quoted once here; everything below reads "$out"
head=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)
addr=$(sinfo -h -N -n "$head" -o %o | head -n 1)
export RDZV_ENDPOINT="$addr:$((20000 + SLURM_JOB_ID % 20000))"
marker="$out/.slurm-$SLURM_JOB_ID.limit"  # hidden: no part of the stage's output
# Slurm's warning before the time limit: SIGTERM to the agents (not to this script), which
# pass it to the ranks; they save and stop.
warned() {{ touch "$marker"; scancel --signal=TERM "$SLURM_JOB_ID"; }}
trap warned USR1
srun --ntasks-per-node=1 --kill-on-bad-exit=0 bash "$out/slurm/node.sh" &
step=$!
wait "$step"
code=$?
if [ -e "$marker" ]; then  # the trap cut the wait short: wait for the step's end
    wait "$step"
    code=$?
fi
exit "$code"
"""
NODE = """\
#!/bin/bash
# One node of the train stage's job: its torchrun agent, its stores on this node's address.
# Node 0 hosts the rendezvous. Each agent logs to a file of its node; rank 0, wherever the
# rendezvous puts it, to the run's train.log (tasks/train_worker.py), which the flow follows.
out={out}
addr=$(sinfo -h -N -n "$SLURMD_NODENAME" -o %o | head -n 1)
host=0
if [ "$SLURM_NODEID" = 0 ]; then host=1; fi
export RANK0_LOG="$out/train.log"
exec {command} >> "$out/train.node$SLURM_NODEID.log" 2>&1
"""


class Expanded(str):
    """A word of the agent's command line that the node's shell expands: written by this
    module, never taken from params or paths, which are quoted whole (shlex.quote)."""


class SlurmError(UserError, RuntimeError):
    """Slurm refused the job or cannot be reached; the message quotes it."""


def submit(layout: Layout, cfg, work: list[str], out: Path, env: dict, log) -> SlurmJob:
    """Write the job's scripts into `out/slurm`, submit it (sbatch takes `env`), return it.
    `cfg`: the params' pipeline.slurm; `work`: what each rank runs after `python`."""
    for where, path in (("the run folder", out), ("the working directory", Path.cwd())):
        if "%" in str(path) or "\\" in str(path):
            raise SlurmError(f"{where} {path}: Slurm reads '%' and '\\' in a job's paths as "
                             "patterns: choose a work dir without them")  # fmt: skip
    folder = out / "slurm"
    folder.mkdir(parents=True, exist_ok=True)
    rdzv = ["--rdzv-id", Expanded('"$SLURM_JOB_ID"'), "--rdzv-conf", Expanded('is_host="$host"')]
    agent = [sys.executable, *torchrun(layout, Expanded('"$RDZV_ENDPOINT"'), Expanded('"$addr"'),
                                       *rdzv), *work]  # fmt: skip
    node = folder / "node.sh"
    node.write_text(NODE.format(out=shlex.quote(str(out)), command=_join(agent)))
    batch = folder / "train.sbatch"
    batch.write_text(BATCH.format(out=shlex.quote(str(out))))
    cmd = ["sbatch", "--parsable", f"--job-name=train-{out.name[:12]}",
           f"--nodes={layout.nnodes}", "--ntasks-per-node=1", f"--chdir={Path.cwd()}",
           f"--output={folder}/%j.out", "--open-mode=append",
           f"--signal=B:USR1@{cfg.signal_seconds}"]  # fmt: skip
    cmd += [f"--time={cfg.time_limit_minutes}"] if cfg.time_limit_minutes else []
    cmd += [f"--partition={cfg.partition}"] if cfg.partition else []
    cmd += [f"--account={cfg.account}"] if cfg.account else []
    cmd += [*cfg.sbatch_options, str(batch)]
    done = slurm_command(cmd, env)
    job = SlurmJob(done.stdout.strip().split(";")[0], env, out, log)
    log.info("submitted Slurm job %s: %s", job.job_id, shlex.join(cmd))
    return job


def slurm_command(cmd: list[str], env: dict, check: bool = True) -> subprocess.CompletedProcess:
    try:
        done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120)
    except FileNotFoundError:
        raise SlurmError(f"{cmd[0]}: not found; pipeline.launcher slurm needs Slurm's "
                         "commands on this machine") from None  # fmt: skip
    except subprocess.TimeoutExpired:
        raise SlurmError(f"{cmd[0]}: no answer from Slurm in 120 s") from None
    if check and done.returncode != 0:
        said = (done.stderr.strip() or done.stdout.strip()).splitlines()
        raise SlurmError(f"{cmd[0]} failed: {said[-1] if said else done.returncode}")
    return done


class SlurmJob:
    """A submitted job, as tasks.launch.follow sees a run."""

    def __init__(self, job_id: str, env: dict, out: Path, log):
        self.job_id, self.env, self.out, self.log = job_id, env, out, log
        self.state, self.code = "PENDING", 0
        self._asked = 0.0

    def done(self) -> bool:
        if self.state in ENDED:
            return True
        if time.monotonic() - self._asked < POLL_S:
            return False
        self._asked = time.monotonic()
        fields = job_fields(self.job_id, self.env)
        if fields is None:  # slurmctld busy or restarting: ask again later
            return False
        state = fields["JobState"].split()[0]
        if state != self.state and state in ("PENDING", "RUNNING"):
            where = fields.get("NodeList") if state == "RUNNING" else fields.get("Reason")
            self.log.info("Slurm job %s: %s (%s)", self.job_id, state, where)
        self.state = state
        # ExitCode=status:signal; a script killed by a signal has no status of its own.
        status, _, sig = fields.get("ExitCode", "0:0").partition(":")
        self.code = int(status) or (128 + int(sig) if sig and int(sig) else 0)
        return state in ENDED

    def stop(self) -> None:
        """Cancel the job (Slurm: SIGTERM to every process, so the ranks save, then SIGKILL
        after KillWait) and wait for its end, so that a rerun finds what they saved."""
        if self.done():
            return
        slurm_command(["scancel", self.job_id], self.env, check=False)
        self.log.warning("cancelled Slurm job %s", self.job_id)
        deadline = time.monotonic() + STOP_S
        while not self.done() and time.monotonic() < deadline:
            time.sleep(1)

    def result(self, tail: list[str]) -> None:
        limited = (self.out / f".slurm-{self.job_id}.limit").exists()
        raise_for_end(self.job_id, self.state, self.code, limited, tail, self.out)


def job_fields(job_id: str, env: dict) -> dict[str, str] | None:
    """The job's JobState, ExitCode, Reason, NodeList...: from slurmctld while it keeps the
    job (MinJobAge), then from the accounting (sacct); None if neither answers now."""
    done = slurm_command(["scontrol", "show", "job", "-o", job_id], env, check=False)
    if done.returncode == 0:
        return dict(re.findall(r"(\w+)=(\S*)", done.stdout))
    acct = slurm_command(["sacct", "-j", job_id, "-X", "-n", "-P", "-o", "State,ExitCode"],
                         env, check=False)  # fmt: skip
    line = acct.stdout.strip().splitlines()[:1]
    if acct.returncode != 0 or not line:
        return None
    state, code = line[0].split("|")
    return {"JobState": state, "ExitCode": code}


def raise_for_end(
    job_id: str, state: str, code: int, limited: bool, tail: list[str], out: Path
) -> None:
    """The stage's result from the job's end: nothing if it completed, else TrainingFailed
    in one line (what happened, and where a rerun resumes), or with the log's tail for a
    trainer that failed on its own."""
    job = f"Slurm job {job_id}"
    if state == "COMPLETED" and not limited:
        return
    if limited:
        what = "reached its time limit; the trainers saved and stopped"
    elif state == "FAILED" and (name := signal_name(code)):
        what = f"ended: its trainers were stopped by {name} and saved"
    elif state in ("FAILED", "COMPLETED"):
        err = exit_error(code, tail, out / "train.log")
        agents = "" if code == 2 else f"\n(each node's torchrun agent: {out}/train.node*.log)"
        raise TrainingFailed(f"{job} failed: {err}{agents}", user_error=err.user_error)
    else:
        what = ENDINGS.get(state, f"ended {state}")
    raise TrainingFailed(f"{job} {what}: {resumes(out)}", user_error=True)


def signal_name(code: int) -> str | None:
    """SIGTERM for 143; None for a code that is no signal's (Slurm's 0:53, a launch that
    failed, reads as 181)."""
    try:
        return signal.Signals(code - 128).name if code > 128 else None
    except ValueError:
        return None


def resumes(out: Path) -> str:
    try:
        return f"rerun to resume at step {describe_run(out)['step']}"
    except UserError:
        return "no checkpoint yet: a rerun starts over"


def _join(args: list[str]) -> str:
    """A command line for the node's shell: each argument quoted whole, but the Expanded
    words this module wrote for the shell."""
    return " ".join(a if isinstance(a, Expanded) else shlex.quote(a) for a in args)
