"""The flow under stress, as processes: signals, two flows at once, tampered work dirs,
kills at random moments. Every run here is the real `python -m flows.wmt14_ende` on the
shipped smoke corpus, with a training short enough for CI."""

from __future__ import annotations

import json
import os
import pickle
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from conftest import TINY_FLOW, run_dir, wait_for
from mlflow.tracking import MlflowClient
from prefect.exceptions import TerminationSignal

from flows.stop import STOP
from tasks.stages import STAGES
from transformer.model_file import load_model_file
from transformer.training.checkpoint import list_files

ROOT = Path(__file__).resolve().parents[1]
SMOKE = str(ROOT / "params" / "smoke.yaml")
TINY = [*TINY_FLOW, "train.save_every=5", "export.formats=[]"]  # kills land between saves
ENV = {**os.environ, "PYTHONUNBUFFERED": "1"}
MARKER = Path("/tmp/transformer-mt-tampered-marker")

pytestmark = pytest.mark.timeout(1800)


def flow(work: Path, *extra: str, **popen) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "flows.wmt14_ende", SMOKE, *TINY, *extra, "--work-dir", str(work)]
    return subprocess.Popen(cmd, cwd=ROOT, env=ENV, start_new_session=True, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, **popen)  # fmt: skip


def finish(proc: subprocess.Popen, timeout: float = 900) -> tuple[int, str]:
    out, _ = proc.communicate(timeout=timeout)
    return proc.returncode, out


def parent_runs(work: Path) -> list:
    client = MlflowClient(f"sqlite:///{work / 'mlflow.db'}")
    exp = client.get_experiment_by_name("wmt14-ende")
    return client.search_runs([exp.experiment_id], filter_string="tags.stage = 'pipeline'")


def children(work: Path, run_id: str) -> list:
    client = MlflowClient(f"sqlite:///{work / 'mlflow.db'}")
    exp = client.get_experiment_by_name("wmt14-ende")
    return client.search_runs([exp.experiment_id],
                              filter_string=f"tags.mlflow.parentRunId = '{run_id}'")  # fmt: skip


@pytest.mark.slow  # the default suite: a group's SIGINT below, and the trainer's SIGTERM
def test_sigterm_saves_training_and_every_process_exits_within_30_s(tmp_path):
    work = tmp_path / "work"
    proc = flow(work)
    wait_for(lambda: any(work.glob("train/*/checkpoints/state-*")), 600, proc, "a checkpoint")
    os.killpg(proc.pid, signal.SIGTERM)  # as a scheduler stops a job: the whole group
    stopped = time.monotonic()
    code, out = finish(proc, timeout=60)
    assert code in (-signal.SIGTERM, 128 + signal.SIGTERM), out[-3000:]  # Prefect re-raises it
    while not _group_gone(proc.pid):  # the trainer too, once it has saved
        assert time.monotonic() - stopped < 30, "a process of the flow outlived it by 30 s"
        time.sleep(0.2)
    log = (run_dir(work) / "train.log").read_text()
    assert "stopped by SIGTERM" in log and "checkpoint saved" in log, log[-2000:]
    # The rerun resumes there and ends as if never stopped: the slow suite's
    # test_a_stop_in_the_last_save_interval_ends_like_an_uninterrupted_run.


@pytest.mark.parametrize("nproc", [  # torchrun and its workers; the slow suite: the trainer alone
    2, pytest.param(1, marks=pytest.mark.slow)])  # fmt: skip
def test_a_group_sigint_stops_a_flow_that_ignores_it_as_a_ctrl_c_does(tmp_path, nproc):
    """A flow started with `&` by a script ignores SIGINT (the shell sets SIG_IGN, Python
    keeps it); the trainer, or torchrun and its workers, take it: they save and stop. The
    flow then says what a Ctrl-C makes it say, with its exit code, and no traceback."""
    work = tmp_path / "work"
    ignore = lambda: signal.signal(signal.SIGINT, signal.SIG_IGN)
    proc = flow(work, f"pipeline.nproc_per_node={nproc}", preexec_fn=ignore)
    wait_for(lambda: any(work.glob("train/*/checkpoints/state-*")), 600, proc, "a checkpoint")
    os.killpg(proc.pid, signal.SIGINT)
    code, out = finish(proc, timeout=60)
    assert code == 128 + signal.SIGINT, out[-3000:]
    assert "error: stopped by SIGINT; training saved what it had" in out, out[-3000:]
    assert "Traceback" not in out, out[-3000:]
    assert "stopped by SIGINT" in (run_dir(work) / "train.log").read_text()


def _group_gone(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return True
    return False


@pytest.mark.slow  # a flow process that waits out the API start
def test_a_local_api_that_cannot_start_ends_the_flow_in_one_line(tmp_path):
    """The flow's own Prefect API dying as it starts (here the real server, with a module it
    imports made unimportable, as on a machine that lacks it) ends the flow with exit 1 and
    one line quoting the server's last words: not a traceback, and not the one that killing
    the dead server's process group raised on top of it."""
    (tmp_path / "sitecustomize.py").write_text("import sys\nsys.modules['asyncpg'] = None\n")
    env = {k: v for k, v in ENV.items() if k != "PREFECT_API_URL"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(tmp_path), env.get("PYTHONPATH")]))
    cmd = [sys.executable, "-m", "flows.wmt14_ende", SMOKE, "--work-dir", str(tmp_path / "w")]
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 1, done.stderr[-3000:]
    assert done.stderr.strip().splitlines() == [
        "error: Prefect's local API did not start: `prefect server start` exited with 1: "
        "ModuleNotFoundError: import of asyncpg halted; None in sys.modules "
        "(or set PREFECT_API_URL to a running server)"
    ]


@pytest.mark.slow
def test_two_flows_on_a_new_work_dir_do_the_work_once(tmp_path):
    work = tmp_path / "work"
    first, second = flow(work), flow(work)
    (code1, out1), (code2, out2) = finish(first), finish(second)
    assert code1 == 0, out1[-3000:]
    assert code2 == 0, out2[-3000:]
    runs = parent_runs(work)
    assert len(runs) == 1  # the same params: one MLflow run
    stages = [c.data.tags["stage"] for c in children(work, runs[0].info.run_id)]
    assert sorted(stages) == sorted(set(stages)), stages  # each stage ran once
    assert "waiting for another flow" in out1 + out2


class Marker:
    """Unpickles to a shell command: whatever runs it has executed code from the disk."""

    def __reduce__(self):
        return (os.system, (f"touch {MARKER}",))


def _stage(work: Path, name: str) -> Path:
    return next(p for p in (work / name).iterdir() if not p.name.startswith("."))


def _forget(work: Path, *stages: str) -> None:
    """Make the flow run these stages again (their records gone)."""
    for name in stages:
        (_stage(work, name) / "stage.json").unlink(missing_ok=True)


@pytest.mark.parametrize("victim", [
    "model",  # ~15 s each: the default suite; the slow one tampers with the rest
    *(pytest.param(v, marks=pytest.mark.slow)
      for v in ["record", "manifest", "shard", "state", "params", "snapshot", "emptied record",
                "shard, its times restored"]),
])  # fmt: skip
def test_a_tampered_work_dir_runs_no_code_and_names_the_file(fresh_flow, victim, tmp_path):
    """Each file the pipeline reads back, tampered with: the rerun fails in one line that
    names it (or, for the resolved params, which are written afresh, ignores it) and no
    code from the work dir ever runs."""
    work = tmp_path / "work"
    subprocess.run(["cp", "-a", str(fresh_flow), str(work)], check=True)  # never in place
    MARKER.unlink(missing_ok=True)
    if victim == "record":  # a stage's record: data, here not even JSON
        path = _stage(work, "clean") / "stage.json"
        path.write_bytes(pickle.dumps(Marker()))
    elif victim == "manifest":  # another checksum: training must not use these shards
        manifest_path = _stage(work, "shards") / "manifest.json"
        manifest = json.loads(manifest_path.read_text())
        entry = manifest["roles"]["train"]["files"][0]
        entry["sha256"] = "0" * 64  # the same size: the stage record's checksum tells
        manifest_path.write_text(json.dumps(manifest, indent=1))
        path = manifest_path
        _forget(work, "train")
    elif victim.startswith("shard"):  # one flipped byte in a shard
        path = next((_stage(work, "shards") / "train").glob("*.arrow"))
        times = path.stat()
        _flip(path)
        if "restored" in victim:  # what `touch -r` would do: the record's checksum tells
            os.utime(path, ns=(times.st_atime_ns, times.st_mtime_ns))
        _forget(work, "train")
    elif victim == "snapshot":  # averaged from, without a word, before checksums
        path = next((_stage(work, "train") / "checkpoints").glob("model-*.pt"))
        _flip(path)
        _forget(work, "average")
    elif victim == "emptied record":  # a record listing no files, of a model that is gone
        path = _stage(work, "average") / "stage.json"
        record = json.loads(path.read_text())
        path.write_text(json.dumps({**record, "files": {}}))
        (path.parent / "model.pt").unlink()
    elif victim == "state":  # every training state: a pickle that would run a command
        for path in list_files(_stage(work, "train"), "state"):
            torch.save({"format": "transformer-mt/state/1", "x": Marker()}, path)
        _forget(work, "train")
    elif victim == "model":
        path = _stage(work, "average") / "model.pt"
        torch.save({"format": "transformer-mt/model/1", "model": Marker()}, path)
        _forget(work, "decode")
    else:  # the resolved params: written afresh by every run, never read from before
        path = next((work / "runs").glob("*/params.yaml"))
        path.write_text(f"!!python/object/apply:os.system ['touch {MARKER}']\n")
    code, out = finish(flow(work))
    assert not MARKER.exists(), "code from the work dir ran"
    if victim == "params":
        assert code == 0, out[-3000:]
        return
    assert code == 2, out[-3000:]
    error = [line for line in out.splitlines() if line.startswith("error:")]
    assert len(error) == 1 and str(path) in error[0], out[-3000:]


@pytest.mark.slow  # a flow in the copy
def test_a_copied_work_dir_writes_only_into_the_copy(fresh_flow, tmp_path):
    """`cp -a` of a finished work dir into a path with a space and a non-ASCII letter, and a
    rerun that decodes again (a stage run, its artifacts logged): the original is unchanged
    to the byte, and every artifact location in the copy's store is in the copy."""
    before = _digest(fresh_flow)
    work = tmp_path / "copy of wörk"
    subprocess.run(["cp", "-a", str(fresh_flow), str(work)], check=True)
    _forget(work, "decode")
    code, out = finish(flow(work))
    assert code == 0, out[-3000:]
    assert _digest(fresh_flow) == before, "the rerun of the copy wrote into the original"
    client = MlflowClient(f"sqlite:///{work / 'mlflow.db'}")
    exp = client.get_experiment_by_name("wmt14-ende")
    mine = (work / "mlartifacts").as_uri()
    assert exp.artifact_location.startswith(mine)
    runs = client.search_runs([exp.experiment_id])
    assert runs and all(r.info.artifact_uri.startswith(mine) for r in runs)
    decodes = [r for r in runs if r.data.tags.get("stage") == "decode"]
    assert len(decodes) == 2 and all(client.list_artifacts(r.info.run_id) for r in decodes)


# Stops land between the saves at 20 and 40: the whole window is the last save interval.
LAST_INTERVAL = ["train.save_every=20"]


@pytest.fixture(scope="module")
def straight_flow(tmp_path_factory) -> Path:
    work = tmp_path_factory.mktemp("straight") / "work"
    code, out = finish(flow(work, *LAST_INTERVAL))
    assert code == 0, out[-3000:]
    return work


@pytest.mark.slow
@pytest.mark.parametrize("stop", ["SIGTERM to the group", "SIGKILL to the flow alone",
                                  "two SIGINTs to the group, 0.3 s apart"])  # fmt: skip
def test_a_stop_in_the_last_save_interval_ends_like_an_uninterrupted_run(
    straight_flow, tmp_path, stop
):
    """The documented stop (SIGTERM to the process group), the flow's process killed
    alone (its trainer, told by Linux, saves and stops), and an impatient Ctrl-C (the
    trainer stops at once, after the save under way if any): the trainer's state at the
    step it stopped on is no snapshot, so the rerun averages what an uninterrupted run
    averages, bitwise, from the same files, under one MLflow parent run."""
    work = tmp_path / "work"
    proc = flow(work, *LAST_INTERVAL)
    wait_for(lambda: any(work.glob("train/*/checkpoints/state-0000020.pt")), 600, proc,
             "the state of step 20")  # fmt: skip
    if stop.startswith("SIGTERM"):
        os.killpg(proc.pid, signal.SIGTERM)
    elif stop.startswith("SIGKILL"):
        proc.kill()
    else:
        os.killpg(proc.pid, signal.SIGINT)
        time.sleep(0.3)
        os.killpg(proc.pid, signal.SIGINT)
    code, out = finish(proc, timeout=120)
    if not stop.startswith("SIGKILL"):
        signum = signal.SIGTERM if stop.startswith("SIGTERM") else signal.SIGINT
        assert code == 128 + signum, out[-3000:]
        assert _error_lines(out) == [
            f"error: stopped by {signum.name}; training saved what "
            "it had: rerun the same command to resume"
        ], out[-3000:]
        assert "Traceback" not in out, out[-3000:]
    deadline = time.monotonic() + 60
    while not _group_gone(proc.pid):  # the trainer saves, then exits
        assert time.monotonic() < deadline, "the trainer outlived the flow by 60 s"
        time.sleep(0.2)
    stopped_at = max(p.name for p in run_dir(work).glob("checkpoints/state-*"))
    if not stop.startswith("two"):  # an impatient stop saves no state of its own
        assert stopped_at not in ("state-0000020.pt", "state-0000040.pt"), "no stop between"
    code, out = finish(flow(work, *LAST_INTERVAL))
    assert code == 0, out[-3000:]
    folder = lambda w: sorted(p.name for p in (run_dir(w) / "checkpoints").iterdir())
    assert folder(work) == folder(straight_flow)
    averaged = [load_model_file(next((w / "average").glob("*/model.pt"))).model
                for w in (work, straight_flow)]  # fmt: skip
    assert all(torch.equal(averaged[0][k], averaged[1][k]) for k in averaged[0])
    assert len(parent_runs(work)) == 1
    finished = lambda w: sorted(c.data.tags["stage"]
                                for c in children(w, parent_runs(w)[0].info.run_id)
                                if c.info.status == "FINISHED")  # fmt: skip
    assert finished(work) == finished(straight_flow)


def _flip(path: Path) -> None:
    """One byte of `path` changed, in the middle (a tensor's bytes, in a checkpoint)."""
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


def _error_lines(out: str) -> list[str]:
    return [line for line in out.splitlines() if line.startswith("error")]


def _digest(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*"))
            if p.is_file() and not p.name.endswith(".lock")}  # fmt: skip


@pytest.mark.slow
def test_ten_kills_at_random_moments_each_end_like_an_uninterrupted_run(tmp_path):
    """Seeded random moments, from Prefect's start to the last stage: after each kill of
    the whole flow (SIGKILL, no warning), a rerun completes with bitwise the same averaged
    weights as an uninterrupted run, and one MLflow parent run."""
    straight = tmp_path / "straight"
    start = time.monotonic()
    code, out = finish(flow(straight))
    assert code == 0, out[-3000:]
    duration = time.monotonic() - start
    reference = load_model_file(next((straight / "average").glob("*/model.pt"))).model
    rng = random.Random(13)
    report = []
    for kill in range(10):
        work = tmp_path / f"kill{kill}"
        moment = rng.uniform(3.0, duration * 0.95)
        proc = flow(work)
        try:
            proc.wait(timeout=moment)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        done = [s.name for s in STAGES if list((work / s.name).glob("*/stage.json"))]
        asked = [s.name for s in STAGES if s.asked is None]  # these params: no further cooldowns
        killed_in = next((name for name in asked if name not in done), "publish")
        code, out = finish(flow(work))
        assert code == 0, out[-3000:]
        averaged = load_model_file(next((work / "average").glob("*/model.pt"))).model
        same = all(torch.equal(reference[k], averaged[k]) for k in reference)
        runs = parent_runs(work)
        report.append((round(moment, 1), killed_in, same, len(runs)))
        assert same and len(runs) == 1, report
    print("kills (seconds after start, stage, same weights, MLflow parent runs):", report)


def test_a_new_mlflow_store_appears_whole_or_not_at_all(tmp_path, monkeypatch):
    """A flow killed while MLflow created its SQLite store (migrations run in place) left a
    half-made schema every later run failed on ("table _alembic_tmp_params already
    exists", found by the ten-kills test). Now a failed creation leaves no store."""
    import mlflow.store.db.utils as db_utils

    from tasks.tracking import client_for

    db = tmp_path / "work" / "mlflow.db"
    real = db_utils._initialize_tables

    def killed_midway(engine):
        raise KeyboardInterrupt  # as a SIGKILL would, after some of the migrations

    monkeypatch.setattr(db_utils, "_initialize_tables", killed_midway)
    with pytest.raises(KeyboardInterrupt):
        client_for(f"sqlite:///{db}")
    assert not db.exists() and list(db.parent.iterdir()) == []  # no store, no leftovers

    monkeypatch.setattr(db_utils, "_initialize_tables", real)
    client = client_for(f"sqlite:///{db}")
    assert client.create_experiment("e") and db.exists()
    client_for(f"sqlite:///{db}")  # an existing store is used as it is
    assert client.get_experiment_by_name("e") is not None


def test_a_stop_raised_inside_a_finalizer_still_stops(tmp_path):
    """Python runs a signal's handler between any two bytecodes, a `__del__`'s too, and
    drops an exception that leaves one ("Exception ignored in"): a SIGTERM during decode
    was so swallowed, and the flow ran on to the end. The command line's handler raises it
    again from outside; a second signal, while the first unwinds, is noted, not raised."""

    class SignalledInside:
        def __del__(self):
            os.kill(os.getpid(), signal.SIGTERM)
            for _ in range(1000):  # the handler runs in here: its exception is dropped
                pass

    before = signal.getsignal(signal.SIGTERM)
    with STOP.handling():
        with pytest.raises(TerminationSignal):
            SignalledInside()
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline:  # the flow, running on
                sum(range(1000))
        os.kill(os.getpid(), signal.SIGINT)  # while the first stop unwinds
        sum(range(1000))
        assert STOP.signum == signal.SIGTERM
    assert signal.getsignal(signal.SIGTERM) == before  # the test process's handler is back


@pytest.mark.slow  # two flows; the default suite stops one in training
def test_sigterm_during_decode_stops_the_flow_in_one_line(fresh_flow, tmp_path):
    """SIGTERM to the group while decode runs (swallowed before, the flow then decoding,
    exporting and publishing to exit 0; or exit -15 with no line, Prefect's re-sent signal
    meeting Python's default handler): one line, exit 143, nothing of decode kept; the
    rerun decodes what an uninterrupted run decoded, to the byte."""
    work = tmp_path / "work"
    subprocess.run(["cp", "-a", str(fresh_flow), str(work)], check=True)
    _forget(work, "decode")
    proc = flow(work)
    wait_for(lambda: list((work / "decode").glob(".*.tmp")), 600, proc, "decode at work")
    os.killpg(proc.pid, signal.SIGTERM)
    code, out = finish(proc, timeout=120)
    assert code == 128 + signal.SIGTERM, out[-3000:]
    assert len(_error_lines(out)) == 1 and "stopped by SIGTERM" in out, out[-3000:]
    assert "Traceback" not in out and "Exception ignored" not in out, out[-3000:]
    assert not (_stage(work, "decode") / "stage.json").exists()
    code, out = finish(flow(work))
    assert code == 0, out[-3000:]
    hyps = lambda w: (_stage(w, "decode") / "test.hyp").read_bytes()
    assert hyps(work) == hyps(fresh_flow)
    decodes = [c for c in children(work, parent_runs(work)[0].info.run_id)
               if c.data.tags["stage"] == "decode"]  # fmt: skip
    assert sorted(c.info.status for c in decodes) == ["FINISHED", "KILLED"]  # stopped, rerun


@pytest.mark.slow
def test_refresh_waits_for_the_flows_that_read_a_folder(tmp_path):
    """A flow with --refresh removed a train folder the moment a running flow released its
    stage lock, and that flow then failed reading it. Now every flow holds what it made or
    reused (shared) until it ends, and a refresh waits for them: both flows succeed."""
    work = tmp_path / "work"
    first = flow(work)  # other params (beam 3), the same stages up to average
    wait_for(lambda: any(work.glob("train/*/checkpoints/state-*")), 600, first, "training")
    second = flow(work, "decode.beam_size=3", "--refresh")
    (code1, out1), (code2, out2) = finish(first), finish(second)
    assert code1 == 0, out1[-3000:]
    assert code2 == 0, out2[-3000:]
    assert "waiting for them to end before it changes" in out2, out2[-3000:]
    assert all(f"{stage}: done in" in out2 for stage in ("prepare", "train", "decode")), out2


@pytest.mark.slow
@pytest.mark.skipif(os.geteuid() != 0, reason="mounts a 3 MB tmpfs: root only")
def test_a_full_disk_names_the_folder_whole_even_with_a_newline(tmp_path):
    """A work dir on a 3 MB file system: the stage that fills it fails in one line naming
    where ("No space left on device" named no path), the newline in the work dir's name
    escaped, not a line break that cuts the error in two."""
    disk = tmp_path / "disk"
    disk.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=3m", "tmpfs", str(disk)], check=True)
    try:
        work = disk / "wo\nrk"
        code, out = finish(flow(work))
    finally:
        subprocess.run(["umount", "-l", str(disk)], check=True)
    assert code == 2, out[-3000:]
    errors = _error_lines(out)
    assert len(errors) == 1 and "No space left on device" in errors[0], out[-3000:]
    assert str(disk / "wo\\nrk") in errors[0], errors


def test_a_stage_record_is_verified_to_the_byte_and_an_old_one_is_upgraded(tmp_path):
    """A record of format 1 (sizes only) is trusted by its sizes and upgraded in place to
    checksums; from then on a flipped byte, a file added or gone, or a record edited is a
    RecordError naming the file, never a reuse."""
    from tasks.runner import SIZES_ONLY, RecordError, read_record, write_record

    stage = next(s for s in STAGES if s.name == "average")
    out = tmp_path / "average" / "k"
    out.mkdir(parents=True)
    (out / "model.pt").write_bytes(b"weights" * 100)
    write_record(stage, "k", {}, {}, out)
    fresh = json.loads((out / "stage.json").read_text())
    old = {**fresh, "format": SIZES_ONLY, "files": {"model.pt": 700}}
    del old["sha256"]
    (out / "stage.json").write_text(json.dumps(old))
    assert read_record(out, stage, "k")["files"] == fresh["files"]  # upgraded, same checksums
    assert json.loads((out / "stage.json").read_text())["format"] == fresh["format"]

    _flip(out / "model.pt")
    with pytest.raises(RecordError, match=r"k/model\.pt: sha256 differs from its stage record"):
        read_record(out, stage, "k")
    _flip(out / "model.pt")
    (out / "extra.txt").write_text("x")
    with pytest.raises(RecordError, match=r"k/extra\.txt: not in its stage record"):
        read_record(out, stage, "k")
    (out / "extra.txt").unlink()
    record = json.loads((out / "stage.json").read_text())
    (out / "stage.json").write_text(json.dumps({**record, "files": {}}))
    with pytest.raises(RecordError, match=r"k/stage\.json: records another stage or folder, or"):
        read_record(out, stage, "k")
    (out / "stage.json").write_text(json.dumps(record))
    assert read_record(out, stage, "k")["key"] == "k"


def test_a_stop_inside_a_database_call_waits_for_its_end(tmp_path):
    """A SIGTERM that landed inside a query of MLflow's SQLite store left its cursor open
    in the traceback's frames: marking the run failed then found the store locked (and
    printed SQLAlchemy's traceback). Now the stop waits for the call to return."""
    import sqlalchemy

    engine = sqlalchemy.create_engine(f"sqlite:///{tmp_path / 'store.db'}")

    @sqlalchemy.event.listens_for(engine, "connect")
    def _stop_inside(dbapi_connection, _):  # a function the query calls: SIGTERM in there
        dbapi_connection.create_function("stop", 1, lambda x: os.kill(os.getpid(), 15) or x)

    with engine.begin() as db:
        db.exec_driver_sql("create table runs (x)")
        db.exec_driver_sql("insert into runs values (1), (2), (3)")
    answered = None
    with STOP.handling(), pytest.raises(TerminationSignal):
        with engine.connect() as db:
            answered = db.exec_driver_sql("select stop(x) from runs").fetchall()
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:  # the flow, going on: the stop comes here
            sum(range(1000))
    assert answered == [(1,), (2,), (3,)]
    with engine.begin() as db:  # what mark_failed does next: the store is not locked
        db.exec_driver_sql("insert into runs values (4)")


ENDS_WITH = (  # told a pid, or its parent's as it started
    "import os, sys; from transformer.processes import die_with_parent; "
    "die_with_parent(os.getppid() if sys.argv[1] == 'mine' else int(sys.argv[1])); print('alive')"
)


def test_a_process_ends_at_once_if_its_parent_is_gone_and_pid_1_is_no_sign(tmp_path):
    """processes.die_with_parent: a process told its parent's pid, which is no longer its
    parent, ends at once; one whose parent is pid 1 (a torchrun that is a container's
    first process) from its start lives on (it killed itself on an old rule)."""
    gone = subprocess.run([sys.executable, "-c", ENDS_WITH, str(os.getpid() + 10**6)],
                          cwd=ROOT, capture_output=True, text=True)  # fmt: skip
    assert gone.returncode == -signal.SIGTERM and "alive" not in gone.stdout
    first = "import subprocess, sys; sys.exit(subprocess.run(sys.argv[1:]).returncode)"
    cmd = ["unshare", "--pid", "--fork", "--mount-proc", sys.executable, "-c", first,
           sys.executable, "-c", ENDS_WITH, "mine"]  # fmt: skip
    try:
        child_of_1 = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=60)
    except FileNotFoundError:
        pytest.skip("no unshare here")
    if "Operation not permitted" in child_of_1.stderr:
        pytest.skip("no PID namespace for this user")
    assert child_of_1.returncode == 0 and child_of_1.stdout == "alive\n", child_of_1.stderr
