"""A real Slurm on this machine for the tests: munged, slurmctld and one slurmd per node,
Debian's packages (`slurm-wlm`, `munge`), every file in a temporary folder, every port on
127.0.0.1. The nodes are slurmd processes of one host (`slurmd -N NAME`, each with a port
of its own), so a job of two nodes runs two torchrun agents that rendezvous over the
loopback interface as two machines would over their network.

    with slurm_cluster(tmp, nodes=2) as env: subprocess.run(["sbatch", ...], env=env)

`env` is os.environ with SLURM_CONF pointing at the cluster's slurm.conf: Slurm's commands
find the cluster through it, nothing is written to /etc.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

from conftest import free_port

# KillWait: what a trainer gets between scancel's SIGTERM and the SIGKILL, a save's time.
# MinJobAge: how long a finished job stays in slurmctld's memory, where the flow reads its
# end (no slurmdbd here, so no sacct).
SLURM_CONF = """\
ClusterName=tests
SlurmctldHost={host}(127.0.0.1)
SlurmctldPort={ctld_port}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
AuthInfo=socket={root}/munge.socket
CredType=cred/munge
StateSaveLocation={root}/state
SlurmdSpoolDir={root}/spool/%n
SlurmctldPidFile={root}/slurmctld.pid
SlurmdPidFile={root}/slurmd-%n.pid
SlurmctldLogFile={root}/slurmctld.log
SlurmdLogFile={root}/slurmd-%n.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SchedulerType=sched/builtin
MpiDefault=none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
SlurmdParameters=config_overrides
ReturnToService=2
MinJobAge=600
KillWait=30
InactiveLimit=0
Waittime=0
SlurmdTimeout=300
{nodes}
PartitionName=tests Nodes=ALL Default=YES MaxTime=INFINITE State=UP
"""
NODE = "NodeName={name} NodeHostname={host} NodeAddr=127.0.0.1 Port={port} CPUs=2 State=UNKNOWN"


@contextlib.contextmanager
def slurm_cluster(root: Path, nodes: int = 2) -> Iterator[dict[str, str]]:
    root.mkdir(parents=True, exist_ok=True)
    (root / "state").mkdir(exist_ok=True)
    host = socket.gethostname()
    names = [f"node{i}" for i in range(1, nodes + 1)]
    lines = [NODE.format(name=n, host=host, port=free_port()) for n in names]
    conf = root / "slurm.conf"
    conf.write_text(SLURM_CONF.format(host=host, ctld_port=free_port(), root=root,
                                      nodes="\n".join(lines)))  # fmt: skip
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM")}
    env["SLURM_CONF"] = str(conf)
    daemons: list[subprocess.Popen] = []
    try:
        daemons.append(_munged(root))
        daemons.append(_start(["slurmctld", "-D", "-i"], env, root / "slurmctld.out"))
        for name in names:
            (root / "spool" / name).mkdir(parents=True, exist_ok=True)
            daemons.append(_start(["slurmd", "-D", "-N", name], env, root / f"{name}.out"))
        _wait_idle(env, len(names), daemons, root)
        yield env
    finally:
        for proc in reversed(daemons):
            _stop(proc)


def _munged(root: Path) -> subprocess.Popen:
    """munged with a key of its own (root may run it with --force: the tests' user)."""
    key = root / "munge.key"
    key.write_bytes(os.urandom(1024))
    key.chmod(0o400)
    cmd = ["munged", "-F", "--force", f"--socket={root}/munge.socket", f"--key-file={key}",
           f"--pid-file={root}/munged.pid", f"--log-file={root}/munged.log",
           f"--seed-file={root}/munged.seed"]  # fmt: skip
    proc = _start(cmd, dict(os.environ), root / "munged.out")
    deadline = time.monotonic() + 60
    while not (root / "munge.socket").exists():
        assert proc.poll() is None, (root / "munged.out").read_text()
        assert time.monotonic() < deadline, "munged did not open its socket"
        time.sleep(0.1)
    return proc


def _start(cmd: list[str], env: dict, out: Path) -> subprocess.Popen:
    with open(out, "wb") as log:
        return subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True)  # fmt: skip


def _wait_idle(env: dict, n: int, daemons: list[subprocess.Popen], root: Path) -> None:
    deadline = time.monotonic() + 120
    while True:
        done = subprocess.run(["sinfo", "-h", "-N", "-o", "%N %t"], env=env,
                              capture_output=True, text=True, timeout=30)  # fmt: skip
        states = [line.split()[1] for line in done.stdout.splitlines() if line.strip()]
        if len(states) == n and all(s == "idle" for s in states):
            return
        dead = [p.args[0] for p in daemons if p.poll() is not None]
        logs = "".join(p.read_text()[-1500:] for p in sorted(root.glob("*.log")))
        assert not dead, f"{dead} exited: {logs}"
        assert time.monotonic() < deadline, f"nodes not idle: {done.stdout}{done.stderr}{logs}"
        time.sleep(0.5)


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def require(*commands: str) -> None:
    """The cluster's commands are installed (`.ci/run` installs them on a fresh machine)."""
    missing = [c for c in commands if shutil.which(c) is None]
    assert not missing, f"{missing} not installed: apt-get install -y slurm-wlm munge"
