"""The MLflow store and the Prefect API as a user can break them, through the real flow
command: each failure is one line naming the store or URL, exit 2, checked before any stage
runs; a credential given in a URI appears nowhere (output, work dir, MLflow, Prefect).

A real Prefect server and a real MLflow server, started once for the module, so that each
case costs one flow process and not a temporary API's start."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import requests
from conftest import answers, free_port
from mlflow.tracking import MlflowClient
from prefect.client.orchestration import SyncPrefectClient
from prefect.exceptions import ObjectNotFound

from tasks.credentials import redact
from tasks.tracking import (
    TrackingError,
    client_for,
    create_sqlite_store,
    experiment_id,
    store_errors,
)

ROOT = Path(__file__).resolve().parents[1]
SMOKE = str(ROOT / "params" / "smoke.yaml")
SECRET = "s3cr3t-t0ken"

pytestmark = pytest.mark.timeout(600)


def _serve(cmd: list[str], env: dict, health: str, log: Path) -> subprocess.Popen:
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, start_new_session=True,
                            stdout=log.open("w"), stderr=subprocess.STDOUT)  # fmt: skip
    deadline = time.monotonic() + 180
    while not answers(health):
        assert proc.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
        time.sleep(0.5)
    return proc


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    """A Prefect API and an MLflow tracking server on 127.0.0.1, each with its own store."""
    root = tmp_path_factory.mktemp("servers")
    bin_ = Path(sys.executable).parent
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MLFLOW_", "PREFECT_"))}
    env |= {"PREFECT_HOME": str(root / "prefect"), "PREFECT_SERVER_ANALYTICS_ENABLED": "false"}
    prefect_port, mlflow_port = free_port(), free_port()
    api = f"http://127.0.0.1:{prefect_port}/api"
    prefect = _serve([str(bin_ / "prefect"), "server", "start", "--host", "127.0.0.1",
                      "--port", str(prefect_port), "--no-ui"],
                     env, f"{api}/health", root / "prefect.log")  # fmt: skip
    tracking = f"http://127.0.0.1:{mlflow_port}"
    mlflow = _serve([str(bin_ / "mlflow"), "server", "--host", "127.0.0.1", "--port",
                     str(mlflow_port), "--backend-store-uri", f"sqlite:///{root / 'mlflow.db'}",
                     "--artifacts-destination", str(root / "mlartifacts"), "--workers", "1"],
                    env, f"{tracking}/health", root / "mlflow.log")  # fmt: skip
    yield {"env": {**env, "PREFECT_API_URL": api}, "root": root, "tracking": tracking}
    for proc in (prefect, mlflow):
        os.killpg(proc.pid, 15)
        proc.wait(timeout=60)


def run_flow(servers: dict, work: Path, *overrides: str, **env: str):
    cmd = [sys.executable, "-m", "flows.wmt14_ende", SMOKE, *overrides, "--work-dir", str(work)]
    done = subprocess.run(cmd, cwd=ROOT, env={**servers["env"], **env}, capture_output=True,
                          text=True, timeout=300)  # fmt: skip
    return done.returncode, done.stdout + done.stderr


def one_error(code: int, out: str, expected_code: int = 2) -> str:
    errors = [line for line in out.splitlines() if line.startswith("error:")]
    assert code == expected_code and len(errors) == 1, out[-3000:]
    assert "Traceback" not in out, out[-3000:]
    return errors[0]


DEAD = "http://user:" + SECRET + "@127.0.0.1:9"  # port 9 (discard): nothing listens
# A database's URI with its credential, a '/' in the password (no driver installed for it).
POSTGRES = f"postgresql://alice:{SECRET}/x@127.0.0.1:9/db"

# (id, overrides, environment, what the error line must hold). Params hold no credential
# (tests/test_boundaries.py); the environment's do, and a tracking server's leave its URI for
# MLFLOW_TRACKING_USERNAME/PASSWORD at once.
SLOW = pytest.mark.slow  # ~9 s a flow process: the default suite keeps one of each kind
CASES = [
    pytest.param("a scheme MLflow has not", ["pipeline.tracking_uri=ftp://host/runs"], {},
                 "pipeline.tracking_uri ftp://host/runs: scheme 'ftp'", marks=SLOW),
    ("no tracking server", ["pipeline.tracking_uri=http://127.0.0.1:9"], {},
     "pipeline.tracking_uri http://127.0.0.1:9: no MLflow server answers"),
    pytest.param("no tracking server, from the environment", [], {"MLFLOW_TRACKING_URI": DEAD},
                 "pipeline.tracking_uri http://127.0.0.1:9: no MLflow server answers",
                 marks=SLOW),
    pytest.param("a database without its driver", [], {"MLFLOW_TRACKING_URI": POSTGRES},
                 "pipeline.tracking_uri postgresql://***@127.0.0.1:9/db: the database's driver "
                 "is not installed (No module named 'psycopg2')", marks=SLOW),  # and in-process:
    # tests/test_boundaries.py's test_a_database_store_without_its_driver_is_one_line
    pytest.param("a registered model name with a slash", ["pipeline.registered_model=team/model"],
                 {}, "pipeline.registered_model: Invalid model name 'team/model'", marks=SLOW),
    ("no Prefect API", [], {"PREFECT_API_URL": DEAD + "/api"},
     "PREFECT_API_URL http://***@127.0.0.1:9/api: no Prefect API answers"),
]  # fmt: skip


@pytest.mark.parametrize(
    ("name", "overrides", "env", "culprit"), CASES,
    ids=[c.values[0] if hasattr(c, "values") else c[0] for c in CASES],
)  # fmt: skip
def test_a_store_or_api_misconfigured_is_one_line_before_any_stage(
    servers, tmp_path, name, overrides, env, culprit
):
    work = tmp_path / "work"
    code, out = run_flow(servers, work, *overrides, **env)
    assert culprit in one_error(code, out), out[-3000:]
    assert SECRET not in out
    assert not [p for p in work.glob("*") if p.name in ("prepare", "clean", "mlflow.db")]


def test_a_locked_store_and_a_store_that_is_no_database_are_one_line(tmp_path):
    """`sqlite3 work/mlflow.db 'BEGIN EXCLUSIVE'` held open by another process, then a file
    in the store's place that SQLite cannot read, as open-run opens the store (the flow
    makes every TrackingError its one line: the cases above)."""
    from tasks.tracking import (
        TrackingError,
    )

    db = tmp_path / "mlflow.db"
    uri = f"sqlite:///{db}"
    create_sqlite_store(db)
    holder = subprocess.Popen([sys.executable, "-c", HOLD_LOCK, str(db)], stdout=subprocess.PIPE)
    try:
        assert holder.stdout.readline() == b"locked\n"
        with pytest.raises(TrackingError, match=rf"MLflow store {uri}: .*locked"):
            open_store(uri, tmp_path)
    finally:
        holder.kill()
        holder.wait()
    db.write_bytes(b"not a database, " * 100)
    with pytest.raises(TrackingError, match=rf"MLflow store {uri}: .*not a database"):
        open_store(uri, tmp_path)
    assert db.read_bytes() == b"not a database, " * 100  # nothing written over it


def open_store(uri: str, work: Path) -> None:
    """As the flow's open-run task opens the store."""
    with store_errors(uri):
        experiment_id(client_for(uri), "wmt14-ende", uri, work)


HOLD_LOCK = """import sqlite3, sys, time
con = sqlite3.connect(sys.argv[1]); con.execute("BEGIN EXCLUSIVE")
print("locked", flush=True); time.sleep(600)"""


def test_a_credential_in_the_tracking_uri_appears_nowhere(servers, tmp_path):
    """The run opens on a real tracking server whose URI, in the environment, holds
    `user:password@` with a '/', a '#' and an '@' in the password (the server takes any),
    logs its params and params file, then its first stage fails (a test split whose German
    side is a line short, which preflight does not read): the password is in no output, no
    file of the work dir, nothing the MLflow server stored and nothing the Prefect server
    stored."""
    work = tmp_path / "work"
    source = tmp_path / "short_test"
    shutil.copytree(ROOT / "data" / "smoke", source)
    lines = (source / "test.de").read_text(encoding="utf-8").splitlines(keepends=True)
    (source / "test.de").write_text("".join(lines[:-1]), encoding="utf-8")
    with_token = servers["tracking"].replace("http://", f"http://user:{SECRET}/#@x@")
    code, out = run_flow(servers, work, f"data.source.path={source}",
                         MLFLOW_TRACKING_URI=with_token)  # fmt: skip
    assert "parallel files differ in length" in one_error(code, out)
    assert SECRET not in out
    runs = MlflowClient(servers["tracking"]).search_runs(
        [MlflowClient(servers["tracking"]).get_experiment_by_name("wmt14-ende").experiment_id]
    )
    assert runs, "the run was not opened on the server"
    stores = [work, servers["root"]]
    leaks = [p for base in stores for p in base.rglob("*")
             if p.is_file() and SECRET.encode() in p.read_bytes()]  # fmt: skip
    assert not leaks, leaks


@pytest.mark.slow  # 40 s on 2 idle cores, minutes on a loaded one: a served flow runs
def test_a_deployment_run_with_a_credential_is_refused_and_stored_nowhere(servers, tmp_path):
    """Served deployments on the real Prefect server: `prefect deployment run` with a
    credential in an override is refused by the server (the flow's parameter schema), so
    no run exists and nothing stored holds it. A run created through the API with the
    schema's check turned off reaches the flow, which replaces the override in the run's
    parameters (read back from the API) and fails in one line."""
    env = servers["env"]
    spec = tmp_path / "deployments.yaml"
    spec.write_text(f"deployments:\n  - {{name: creds, parameters: {{params: {SMOKE}}}}}\n")
    serving = subprocess.Popen(
        [sys.executable, "-m", "flows.deploy", "--file", str(spec), "--work-dir",
         str(tmp_path / "work")], cwd=ROOT, env=env, start_new_session=True,
        stdout=(tmp_path / "serve.log").open("w"), stderr=subprocess.STDOUT,
    )  # fmt: skip
    api = env["PREFECT_API_URL"]
    uri = f"pipeline.tracking_uri=http://alice:{SECRET}/x@127.0.0.1:9"
    try:
        with SyncPrefectClient(api) as client:
            deployment = wait_until(lambda: deployment_named(client, "wmt14-ende/creds"))
            done = subprocess.run(
                [str(Path(sys.executable).parent / "prefect"), "deployment", "run",
                 "wmt14-ende/creds", "-p", "overrides=" + json.dumps([uri])],
                env=env, capture_output=True, text=True, timeout=120,
            )  # fmt: skip
            assert done.returncode == 1, done.stdout + done.stderr
            assert "Too many items match the given schema" in done.stdout + done.stderr
            assert SECRET not in done.stdout + done.stderr
            assert not client.read_flow_runs(), "a run was created"
            past = requests.post(f"{api}/deployments/{deployment.id}/create_flow_run",
                                 json={"parameters": {"overrides": [uri, "train.max_steps=3"]},
                                       "enforce_parameter_schema": False}, timeout=60)  # fmt: skip
            run_id = past.json()["id"]
            run = wait_until(lambda: final(client, run_id))
            assert run.parameters["overrides"] == ["***", "train.max_steps=3"]
            assert run.state.message.startswith("wmt14-ende: ") and "holds a credential" in (
                run.state.message
            )
    finally:
        os.killpg(serving.pid, 15)
        serving.wait(timeout=60)
    assert SECRET not in (tmp_path / "serve.log").read_text()


def wait_until(ready, seconds: float = 300):
    deadline = time.monotonic() + seconds
    while not (answer := ready()):
        assert time.monotonic() < deadline, "not ready"
        time.sleep(1)
    return answer


def deployment_named(client, name: str):
    try:
        return client.read_deployment_by_name(name)
    except ObjectNotFound:
        return None


def final(client, run_id: str):
    run = client.read_flow_run(run_id)
    return run if run.state is not None and run.state.is_final() else None


def test_redact_hides_user_info_of_every_url_and_nothing_else():
    text = "a http://u:p@h:1/x and https://tok@h/y, sqlite:////w/mlflow.db, me@example.org"
    assert redact(text) == (
        "a http://***@h:1/x and https://***@h/y, sqlite:////w/mlflow.db, me@example.org"
    )


@pytest.fixture
def small_disk(tmp_path):
    """A 4 MiB file system of its own (tmpfs), made read-only on demand; root only."""
    mount = tmp_path / "disk"
    mount.mkdir()
    made = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", str(mount)],
                          capture_output=True, text=True)  # fmt: skip
    if made.returncode:
        pytest.skip(f"cannot mount a tmpfs here: {made.stderr.strip()}")
    yield mount
    subprocess.run(["umount", "-l", str(mount)], check=True)


def test_a_full_disk_and_a_read_only_store_are_one_line_naming_the_store(small_disk):
    filler = small_disk / "filler"
    with pytest.raises(OSError), open(filler, "wb", buffering=0) as f:
        while True:  # the disk full before MLflow makes its store
            f.write(b"x" * 4096)
    uri = f"sqlite:///{small_disk / 'mlflow.db'}"
    with pytest.raises(TrackingError, match=rf"MLflow store {uri}: .*full"):
        client_for(uri)
    assert not (small_disk / "mlflow.db").exists()  # whole or not at all
    filler.unlink()
    client_for(uri)
    read_only = small_disk.parent / "read-only"  # the same store, seen through a ro mount
    read_only.mkdir()
    for args in (["--bind"], ["-o", "remount,ro,bind"]):
        subprocess.run(["mount", *args, str(small_disk), str(read_only)], check=True)
    try:
        uri = f"sqlite:///{read_only / 'mlflow.db'}"
        with pytest.raises(TrackingError, match=rf"MLflow store {uri}: .*readonly"):
            open_store(uri, read_only)
    finally:
        subprocess.run(["umount", "-l", str(read_only)], check=True)
