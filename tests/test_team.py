"""The README's team commands as written, against a real Prefect server: the server on
another port through Prefect's own settings (its UI then calls that port), a work pool,
`python -m flows.deploy --pool`, a worker, `prefect deployment run` of the pool's
deployment; the served names stay free. Slow: a fresh smoke flow trains in the worker."""

from __future__ import annotations

import json
import os
import shlex
import signal
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest
import yaml
from conftest import TINY_FLOW, answers, free_port
from prefect.client.orchestration import SyncPrefectClient
from prefect.client.schemas.objects import StateType
from prefect.exceptions import ObjectNotFound
from test_flow import _wait
from test_readme import commands

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]


def readme(starts: str) -> list[str]:
    """The README command that starts with `starts`, as its words."""
    found = [c for c in commands(ROOT / "README.md") if " ".join(c).startswith(starts)]
    assert len(found) == 1, (starts, found)
    return found[0]


def run(words: list[str], env: dict, **kw) -> subprocess.CompletedProcess:
    cmd = [str(BIN / words[0]) if words[0] in ("prefect", "mlflow") else words[0], *words[1:]]
    if cmd[0] == "python":
        cmd[0] = sys.executable
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, **kw)
    assert done.returncode == 0, shlex.join(cmd) + "\n" + (done.stdout + done.stderr)[-3000:]
    return done


def test_the_work_pool_path_and_the_servers_port(tmp_path):
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MLFLOW_", "PREFECT_"))}
    env.update(PREFECT_HOME=str(tmp_path / "prefect"), PREFECT_SERVER_ANALYTICS_ENABLED="false")
    env["PATH"] = f"{BIN}:{env['PATH']}"  # as after `. .venv/bin/activate`
    start = readme("PREFECT_SERVER_API_PORT=4300 prefect server start")
    assert start[0] == "PREFECT_SERVER_API_PORT=4300"
    server = subprocess.Popen(
        [str(BIN / "prefect"), *start[2:]],
        cwd=ROOT,
        env=dict(env, PREFECT_SERVER_API_PORT=str(port)),
        start_new_session=True,
        stdout=(tmp_path / "server.log").open("w"),
        stderr=subprocess.STDOUT,
    )
    api = f"http://127.0.0.1:{port}/api"
    try:
        _wait(lambda: answers(f"{api}/health"), 120, "prefect server")
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/ui-settings", timeout=10) as r:
            assert json.loads(r.read())["api_url"] == api  # the UI calls this server's port
        env["PREFECT_API_URL"] = api
        _worker_runs_the_pools_deployment(env, tmp_path)
    finally:
        os.killpg(server.pid, signal.SIGTERM)
        server.wait(timeout=60)


def _worker_runs_the_pools_deployment(env: dict, tmp_path: Path) -> None:
    work = tmp_path / "wmt14-work"
    run(readme("prefect work-pool create gpu"), env, timeout=120)
    # The repository's smoke deployment, with TINY_FLOW's short training.
    smoke = yaml.safe_load((ROOT / "prefect.yaml").read_text())["deployments"][-1]
    assert smoke["name"] == "smoke"
    smoke["parameters"]["overrides"] = TINY_FLOW
    smoke["schedules"] = []  # the nightly retrain must not come due in the test
    spec = tmp_path / "prefect.yaml"
    spec.write_text(yaml.safe_dump({"deployments": [smoke]}))
    deploy = readme("python -m flows.deploy --pool gpu")
    deploy = [w.replace("/data/wmt14-work", str(work)) for w in deploy]
    out = run([*deploy, "--file", str(spec)], env, timeout=300).stdout
    assert "registered wmt14-ende/smoke-gpu for work pool gpu" in out
    with SyncPrefectClient(env["PREFECT_API_URL"]) as client:
        deployment = client.read_deployment_by_name("wmt14-ende/smoke-gpu")
        assert deployment.work_pool_name == "gpu"
        assert deployment.parameters["work_dir"] == str(work)  # absolute, a parameter
        with pytest.raises(ObjectNotFound):  # the served name stays a served deployment's
            client.read_deployment_by_name("wmt14-ende/smoke")
        run(readme("prefect deployment run wmt14-ende/smoke-gpu"), env, timeout=120)
        worker = readme("prefect worker start --pool gpu")
        run([*worker, "--run-once"], env, timeout=800)  # takes the run, runs it, exits
        runs = client.read_flow_runs()
        assert [r.state_type for r in runs] == [StateType.COMPLETED], runs
    assert (work / "mlflow.db").exists() and any((work / "decode").iterdir())
