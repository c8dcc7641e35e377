"""The project's outer boundary, table by table: what a deployment parameter, a params key,
a work dir or a file argument may hold, and what each gets. A shell never sees a value
unquoted; no credential reaches Prefect, a log or an error line; nothing in a work dir's
registry runs; a schedule that would flood the machine, or an API that does not answer, is
one line and exit 2; a file argument is checked for what it must be, and no error quotes
its content. The cases that start a flow or a Prefect server are the few at the end."""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tasks import slurm
from tasks.launch import Layout, TrainingFailed
from tasks.settings import load_run_params
from transformer.config import ParamsError

ROOT = Path(__file__).resolve().parents[1]
SMOKE = ROOT / "params" / "smoke.yaml"
log = logging.getLogger(__name__)


# --- A shell never sees a value unquoted (tasks/slurm.py) ----------------------------------

WORDS = [
    "w$(touch PWNED)",
    "w`touch PWNED`",
    "it's",
    'say "hi"',
    "two  spaces",
    "a;touch PWNED",
    "$HOME",
    "line\nbreak",
    "star*",
    "back\\slash",
]


@pytest.mark.parametrize("word", WORDS)
def test_a_word_of_the_node_script_reaches_bash_as_it_is(word, tmp_path):
    """The agent's command line as the node's bash reads it: each argument the same string,
    nothing run (bash itself parses what tasks/slurm.py writes)."""
    line = slurm._join(["printf", "%s\\0", word, slurm.Expanded('"$X"')])
    done = subprocess.run(["bash", "-c", line], cwd=tmp_path, env={"X": "x"},
                          capture_output=True, text=True, timeout=30)  # fmt: skip
    assert done.stdout.split("\0")[:2] == [word, "x"]
    assert not (tmp_path / "PWNED").exists()


@pytest.mark.parametrize("name", ["per%jcent", "back\\slash"])
def test_a_work_dir_slurm_reads_as_a_pattern_is_one_line_before_sbatch(name, tmp_path):
    out = tmp_path / name / "train" / "key"
    cfg = load_run_params(SMOKE).pipeline.slurm
    with pytest.raises(slurm.SlurmError) as err:
        slurm.submit(Layout("slurm", 1, 1), cfg, ["-c", "pass"], out, {}, log)
    assert str(err.value) == (
        f"the run folder {out}: Slurm reads '%' and '\\' in a job's paths as patterns: "
        "choose a work dir without them"
    )
    assert not out.exists()


@pytest.mark.parametrize(
    "option, said",
    [
        ("--wra=echo hi", "'--wra=echo hi' sets --wrap, which is set by the launcher"),
        ("--wrap=echo hi", "'--wrap=echo hi' sets --wrap, which is set by the launcher"),
        ("--sig=B:USR1@9", "'--sig=B:USR1@9' sets --signal, which is set by pipeline.slurm"),
        ("--ntasks-per=3", "'--ntasks-per=3' sets --ntasks-per-node, which is set by the launcher"),
        ("-t5", "'-t5' sets -t, which is set by pipeline.slurm.time_limit_minutes"),
        ("-vN2", "'-vN2' sets -N, which is set by pipeline.nnodes"),
        ("--", "'--' is not one sbatch option ('--name=value', a list item each)"),
    ],
)
def test_an_sbatch_option_the_launcher_sets_is_refused_however_spelled(option, said):
    with pytest.raises(ParamsError) as err:
        load_run_params(SMOKE, [f"pipeline.slurm.sbatch_options=[{option!r}]"])
    assert f"pipeline.slurm.sbatch_options: {said}" in str(err.value)
    assert "\n" not in str(err.value)


def test_sbatch_options_of_their_own_pass():
    opts = "pipeline.slurm.sbatch_options=[--gpus-per-node=8, --exclusive, --qos=high]"
    assert load_run_params(SMOKE, [opts]).pipeline.slurm.sbatch_options[0] == "--gpus-per-node=8"


def test_a_job_that_failed_to_launch_is_one_line_not_a_signal_it_never_got(tmp_path):
    """Slurm's ExitCode 0:53 (a launch failure) reads as 181: no signal's number."""
    with pytest.raises(TrainingFailed, match=r"^Slurm job 7 failed: the trainer exited with 181"):
        slurm.raise_for_end("7", "FAILED", 181, False, [], tmp_path)


# --- No credential in a Prefect store, a log or an error line (tasks/credentials.py) -------

SECRET = "s3cr3t-pw"
CREDENTIALS = [  # (override, the key its error names)
    (f"pipeline.tracking_uri=http://alice:{SECRET}/ss@host", "pipeline.tracking_uri"),
    (f"pipeline.tracking_uri=http://alice:{SECRET}#ss@host", "pipeline.tracking_uri"),
    (f"pipeline.tracking_uri=http://alice:{SECRET}@x@host/path", "pipeline.tracking_uri"),
    (f"pipeline.tracking_uri=https://{SECRET}@host", "pipeline.tracking_uri"),
    (f"pipeline.tracking_uri=postgresql://alice:{SECRET}/et@host/db", "pipeline.tracking_uri"),
    (f"pipeline.tracking_uri=postgresql://host/db?sslmode=x&Password={SECRET}",
     "pipeline.tracking_uri"),
    (f"pipeline={{tracking_uri: 'http://alice:{SECRET}@host'}}", "pipeline"),
    (f"data.source.path=https://alice:{SECRET}@host/corpus", "data.source.path"),
]  # fmt: skip


@pytest.mark.parametrize("override, key", CREDENTIALS)
def test_a_credential_in_an_override_is_one_line_before_prefect_starts(
    override, key, tmp_path, capsys
):
    from flows import wmt14_ende as flow

    assert flow.main([str(SMOKE), override, "--work-dir", str(tmp_path / "work")]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: {SMOKE} (override): {key}: holds a credential")
    assert "MLFLOW_TRACKING_PASSWORD" in err and err.count("\n") == 1
    assert SECRET not in err
    assert not (tmp_path / "work").exists()


def test_a_params_error_comes_before_prefect_mlflow_and_torch_load(tmp_path):
    """The command reads the params with pydantic alone: a typo's one line in about a
    second, not after the seconds those three take to import."""
    probe = (
        "import sys\nfrom flows.wmt14_ende import main\n"
        f"code = main([{str(SMOKE)!r}, 'model.d_model=abc', '--work-dir', {str(tmp_path)!r}])\n"
        "print(code, sorted(m for m in ('prefect', 'mlflow', 'torch') if m in sys.modules))"
    )
    got = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, capture_output=True, text=True)
    assert got.stdout.split("\n")[0] == "2 []", got.stdout + got.stderr
    assert (
        got.stderr == f"error: {SMOKE} (override): model.d_model: Input should be a valid integer\n"
    )


def test_a_credential_in_a_params_file_is_refused_naming_the_key(tmp_path):
    params = tmp_path / "team.yaml"
    params.write_text(
        f"extends: {SMOKE}\npipeline: {{tracking_uri: 'postgresql://alice:{SECRET}@h/db'}}\n"
    )
    with pytest.raises(ParamsError) as err:
        load_run_params(params)
    assert str(err.value).startswith(f"{params}: pipeline.tracking_uri: holds a credential")
    assert SECRET not in str(err.value)


@pytest.mark.parametrize(
    "uri", ["sqlite:////data/a@b/mlflow.db", "http://127.0.0.1:5000", "file:///w/x@y/mlruns"]
)
def test_a_store_without_a_credential_passes(uri):
    assert load_run_params(SMOKE, [f"pipeline.tracking_uri={uri}"]).pipeline.tracking_uri == uri


@pytest.mark.parametrize("override, key", CREDENTIALS[:3])
def test_prefects_server_refuses_a_run_whose_override_holds_a_credential_quoting_none(
    override, key
):
    """Prefect's own check, the one its server runs before it creates (and stores) a
    deployment's run, on the flow's parameter schema."""
    from prefect.utilities.callables import parameter_schema
    from prefect.utilities.schema_tools.validation import ValidationError, validate

    from flows.pipeline import wmt14_ende

    schema = parameter_schema(wmt14_ende).model_dump()
    with pytest.raises(ValidationError) as err:
        validate({"overrides": ["train.max_steps=3", override]}, schema, raise_on_error=True)
    assert "Too many items match the given schema (expected at most 0)" in str(err.value)
    assert SECRET not in str(err.value)
    validate({"overrides": ["train.max_steps=3", "pipeline.tracking_uri=sqlite:////a@b/m.db"]},
             schema, raise_on_error=True)  # fmt: skip


@pytest.mark.parametrize(
    "uri",
    [
        f"http://alice:{SECRET}/ss@host:5000",
        f"http://alice:{SECRET} x@host:5000",
        f"postgresql://alice:{SECRET}#/x@host/db",
    ],
)
def test_the_environments_credential_is_stars_in_every_line(uri):
    """A URI from MLFLOW_TRACKING_URI (the one place a credential may be): from then on
    redact() stars it wherever a line quotes it, its URI or a library's message."""
    from tasks.credentials import credentials_to_env, redact

    password = uri.partition("alice:")[2].rpartition("@")[0]
    kept = credentials_to_env(uri)
    for line in (kept, f"could not reach {uri}: refused", f"password was {password}!"):
        assert SECRET not in redact(line)


def test_a_database_store_without_its_driver_is_one_line(monkeypatch):
    from tasks.credentials import credentials_to_env
    from tasks.tracking import TrackingError, check_store

    uri = credentials_to_env(f"postgresql://alice:{SECRET}/x@host/db")
    with pytest.raises(TrackingError) as err:
        check_store(uri, "wmt14-ende-smoke")
    assert str(err.value) == (
        "pipeline.tracking_uri postgresql://***@host/db: the database's driver is not installed "
        "(No module named 'psycopg2'): install it, or use an MLflow tracking server"
    )


@pytest.mark.parametrize(
    "parameters, where",
    [
        (f"{{params: p.yaml, overrides: ['pipeline.tracking_uri=http://a:{SECRET}@h']}}",
         "parameters: overrides"),
        ("{params: p.yaml}, schedules: [{interval: 86400, parameters: {overrides: "
         f"['pipeline.tracking_uri=https://{SECRET}@h']}}}}]", "schedules.0.parameters: overrides"),
        (f"{{params: p.yaml, work_dir: 'http://a:{SECRET}@h/w'}}", "parameters: work_dir"),
    ],
)  # fmt: skip
def test_a_deployment_whose_parameters_hold_a_credential_is_refused(
    parameters, where, tmp_path, capsys
):
    from flows import deploy

    spec = tmp_path / "deployments.yaml"
    spec.write_text(f"deployments:\n  - {{name: x, parameters: {parameters}}}\n")
    assert deploy.main(["--file", str(spec)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: {spec}: deployment x: {where}: holds a credential")
    assert SECRET not in err and err.count("\n") == 1


# --- A deployment runs once at a time, at most hourly (flows/deploy.py) -------------------

SCHEDULES = [  # (a schedule, the line's end after "schedules.0")
    ("{interval: 1e308}", ": interval: 1e+308 s is outside 3600 (hourly) to 31622400 (yearly)"),
    ("{interval: .inf}", ": interval: inf s is outside 3600 (hourly) to 31622400 (yearly)"),
    ("{interval: .nan}", ".interval: Input should be greater than 0"),
    ("{interval: 0.001}", ": interval: 0.001 s is outside 3600 (hourly) to 31622400 (yearly)"),
    ("{interval: 3599}", ": interval: 3599 s is outside 3600 (hourly) to 31622400 (yearly)"),
    ("{interval: -60}", ".interval: Input should be greater than 0"),
    ("{cron: '* * * * * *'}",
     ": cron: '* * * * * *' is not five fields (minute hour day month weekday)"),
    ("{cron: '*/30 * * * *'}", ": cron: '*/30 * * * *' fires 1800 s apart, more often than hourly"),
    ("{cron: '0,30 1 * * *'}", ": cron: '0,30 1 * * *' fires 1800 s apart, more often than hourly"),
    ("{cron: '5-5 * * * *'}", ": cron: '5-5 * * * *' fires 60 s apart, more often than hourly"),
    ("{cron: '*/5 * 29 2 *'}", ": cron: '*/5 * 29 2 *' fires 300 s apart, more often than hourly"),
    ("{cron: '0 0 31 2 *'}", ": cron: '0 0 31 2 *' never fires"),
]  # fmt: skip


def _deployments(tmp_path: Path, schedules: str = "[]", params: str = "p.yaml") -> Path:
    spec = tmp_path / "deployments.yaml"
    spec.write_text(
        f"deployments:\n  - {{name: x, parameters: {{params: {params}}}, schedules: {schedules}}}\n"
    )
    return spec


@pytest.mark.parametrize("schedule, said", SCHEDULES)
def test_a_schedule_out_of_range_is_one_line_before_anything_is_served(
    schedule, said, tmp_path, capsys
):
    from flows import deploy

    spec = _deployments(tmp_path, f"[{schedule}]")
    assert deploy.main(["--file", str(spec)]) == 2
    out, err = capsys.readouterr()
    assert err == f"error: {spec}: deployment x: schedules.0{said}\n"
    assert out == ""  # not even the API was asked


@pytest.mark.parametrize(
    "schedule", [{"interval": 3600}, {"cron": "0 3 * * *"}, {"cron": "@daily"},
                 {"cron": "0 * * * *", "timezone": "Europe/Berlin"}],
)  # fmt: skip
def test_an_hourly_or_rarer_schedule_passes(schedule):
    from flows.deploy import ScheduleSpec

    ScheduleSpec.model_validate(schedule)


def test_every_deployment_of_prefect_yaml_runs_one_flow_at_a_time(tmp_path):
    """The repository's deployments, as `python -m flows.deploy` serves them: each with a
    concurrency limit of one that cancels a colliding run (Prefect's CANCEL_NEW)."""
    from prefect.client.schemas.objects import ConcurrencyLimitStrategy

    from flows.deploy import declared, deployments

    specs = declared(ROOT / "prefect.yaml")
    served = deployments(specs, str(tmp_path), list(specs))
    assert {"base", "big", "smoke"} <= {d.name for d in served}
    for deployment in served:
        assert deployment.concurrency_limit == 1
        strategy = deployment.concurrency_options.collision_strategy
        assert strategy == ConcurrencyLimitStrategy.CANCEL_NEW


@pytest.mark.parametrize(
    "url, why",
    [
        ("http://127.0.0.1:9/api", "within 0.5 s (URLError: [Errno 111] Connection refused)"),
        ("http://alice:pw@127.0.0.1:9/api", "within 0.5 s (URLError:"),
        ("notaurl", "(ValueError: unknown url type: 'notaurl/health')"),
        (None, None),
    ],
)
def test_an_api_that_does_not_answer_is_one_line_after_a_bounded_wait(url, why, tmp_path, capsys):
    from prefect.settings import PREFECT_API_URL, temporary_settings

    from flows import deploy

    spec = _deployments(tmp_path)
    setting = (
        {"updates": {PREFECT_API_URL: url}} if url else {"restore_defaults": {PREFECT_API_URL}}
    )
    with temporary_settings(**setting):
        assert deploy.main(["--file", str(spec), "--wait", "0.5"]) == 2
    out, err = capsys.readouterr()
    assert err.count("\n") == 1 and "Traceback" not in err and "pw" not in out + err
    if url is None:
        assert (
            err == "error: no Prefect API to serve on: start one (prefect server start) and "
            "set PREFECT_API_URL=http://127.0.0.1:4200/api in this shell\n"
        )
        return
    shown = url.replace("alice:pw@", "***@")
    assert err.startswith(f"error: PREFECT_API_URL {shown}: no Prefect API answers")
    assert why in err and err.endswith("or fix PREFECT_API_URL\n")
    if not url.startswith("notaurl"):  # a URL that can be one: waited for, said once
        assert out.startswith(f"waiting up to 0.5 s for the Prefect API at {shown} (URLError")
        assert out.count("\n") == 1


@pytest.mark.slow  # a Prefect server, a serve process, two flow runs, two registrations
@pytest.mark.timeout(900)
def test_deploy_waits_for_a_starting_server_and_each_path_runs_one_flow_at_a_time(tmp_path):
    """A real Prefect server started after `python -m flows.deploy`: the serve process says
    once that it waits, then serves; two runs of its deployment started together: one runs,
    the other is cancelled by the concurrency limit. `--pool` for a pool that does not exist
    is one line; for one that does, it registers the deployment with the same limit."""
    from conftest import answers, free_port
    from prefect.client.orchestration import SyncPrefectClient
    from prefect.client.schemas.actions import WorkPoolCreate
    from prefect.client.schemas.objects import ConcurrencyLimitStrategy, StateType

    CANCEL_NEW = ConcurrencyLimitStrategy.CANCEL_NEW
    port = free_port()
    api = f"http://127.0.0.1:{port}/api"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MLFLOW_", "PREFECT_"))}
    env |= {
        "PREFECT_HOME": str(tmp_path / "prefect"),
        "PREFECT_API_URL": api,
        "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
        "PREFECT_RUNNER_POLL_FREQUENCY": "2",
    }
    spec = _deployments(tmp_path, params=str(SMOKE))  # a flow that runs for minutes
    deploy = [sys.executable, "-m", "flows.deploy", "--file", str(spec), "--work-dir",
              str(tmp_path / "work")]  # fmt: skip
    serving = _spawn([*deploy, "--wait", "600"], env, tmp_path / "serve.log")
    server = None
    try:
        _until(lambda: "waiting up to 600 s" in (tmp_path / "serve.log").read_text(), 300)
        server = _spawn([str(Path(sys.executable).parent / "prefect"), "server", "start",
                         "--host", "127.0.0.1", "--port", str(port), "--no-ui"],
                        env, tmp_path / "server.log")  # fmt: skip
        _until(lambda: answers(f"{api}/health"), 300)
        with SyncPrefectClient(api) as client:
            served = _until(lambda: _deployment(client, "wmt14-ende/x"), 300)
            runs = [client.create_flow_run_from_deployment(served.id) for _ in range(2)]
            states = lambda: [client.read_flow_run(r.id).state for r in runs]
            _until(
                lambda: {s.type for s in states()} == {StateType.RUNNING, StateType.CANCELLED}, 300
            )
            (cancelled,) = [s for s in states() if s.type == StateType.CANCELLED]
            assert cancelled.message == "Deployment concurrency limit reached."
            log = (tmp_path / "serve.log").read_text()
            assert log.count("waiting up to 600 s for the Prefect API") == 1
            assert "each deployment runs one flow at a time" in log
            os.killpg(serving.pid, signal.SIGTERM)  # and its running flow with it
            serving.wait(timeout=120)
            missing = subprocess.run([*deploy, "--pool", "gpu"], env=env, capture_output=True,
                                     text=True, timeout=300)  # fmt: skip
            assert missing.returncode == 2 and missing.stderr.count("\n") == 1, missing.stderr
            assert "Could not find work pool 'gpu'" in missing.stderr
            client.create_work_pool(WorkPoolCreate(name="gpu", type="process"))
            pooled = subprocess.run([*deploy, "--pool", "gpu"], env=env, capture_output=True,
                                    text=True, timeout=300)  # fmt: skip
            assert pooled.returncode == 0, pooled.stdout + pooled.stderr
            assert "registered wmt14-ende/x-gpu for work pool gpu" in pooled.stdout
            registered = client.read_deployment_by_name("wmt14-ende/x-gpu")
            assert registered.work_pool_name == "gpu"
            assert registered.global_concurrency_limit.limit == 1
            assert registered.concurrency_options.collision_strategy == CANCEL_NEW
            assert registered.parameters["work_dir"] == str(tmp_path / "work")
    finally:
        for proc in (serving, server):
            if proc is not None and proc.poll() is None:
                os.killpg(proc.pid, signal.SIGTERM)
                proc.wait(timeout=120)


def _spawn(cmd: list[str], env: dict, log: Path) -> subprocess.Popen:
    return subprocess.Popen(cmd, cwd=ROOT, env=env, start_new_session=True,
                            stdout=log.open("w"), stderr=subprocess.STDOUT)  # fmt: skip


def _until(ready, seconds: float):
    deadline = time.monotonic() + seconds
    while not (answer := ready()):
        assert time.monotonic() < deadline, "not ready"
        time.sleep(1)
    return answer


def _deployment(client, name: str):
    from prefect.exceptions import ObjectNotFound

    try:
        return client.read_deployment_by_name(name)
    except ObjectNotFound:
        return None


# --- Each file argument is what it must be, and no error quotes a file (the commands) -----

CONTENT = "root:x:0:0:boundary-content-marker:/root:/bin/bash"


@pytest.fixture(scope="module")
def files(tiny_shards, tiny_run, tmp_path_factory) -> dict[str, Path]:
    """A trained run, its snapshot, its model file and sentencepiece model, and files that
    are none of these."""
    root = tmp_path_factory.mktemp("files")
    run, model = tiny_run
    (root / "folder").mkdir()
    (root / "passwd").write_text(CONTENT + "\n")
    return {
        "run": run, "snapshot": next((run / "checkpoints").glob("model-*.pt")), "model": model,
        "spm": tiny_shards / "spm.model", "folder": root / "folder", "passwd": root / "passwd",
        "zero": Path("/dev/zero"), "missing": root / "missing", "out": root / "out.pt",
    }  # fmt: skip


FILE_ARGUMENTS = [  # (command, its arguments, what the one line holds)
    ("average", ["{snapshot}", "--spm", "{passwd}"], "{passwd}: not a sentencepiece model"),
    ("average", ["{snapshot}", "--spm", "{model}"], "{model}: not a sentencepiece model"),
    ("average", ["{snapshot}", "--spm", "{folder}"],
     "{folder}: a folder, not a sentencepiece model"),
    ("average", ["{snapshot}", "--spm", "{zero}"],
     "/dev/zero: not a regular file, not a sentencepiece model"),
    ("average", ["{snapshot}", "--spm", "{missing}"], "argument --spm: {missing}: no such file"),
    ("average", ["{run}", "{snapshot}"], "{snapshot}: not a run folder, as the other inputs are"),
    ("average", ["{zero}", "--spm", "{spm}"], "/dev/zero: not a regular file, not a snapshot"),
    ("translate", ["--model", "{folder}"], "--model: {folder}: a folder, not a model file"),
    ("translate", ["--model", "{zero}"], "/dev/zero: not a regular file, not a model file"),
    ("translate", ["--model", "{passwd}"], "{passwd}: unreadable"),
    ("translate", ["--model", "{spm}"], "{spm}: unreadable"),
    ("translate", ["--model", "{snapshot}"], "{snapshot}: not an exported model"),
    ("export", ["{folder}", "--format", "ctranslate2"], "{folder}: a folder, not a model file"),
    ("export", ["/dev/null", "--format", "ctranslate2"], "/dev/null: not a regular file"),
    ("export", ["{passwd}", "--format", "ctranslate2"], "{passwd}: unreadable"),
]  # fmt: skip


@pytest.mark.parametrize("command, argv, said", FILE_ARGUMENTS)
def test_a_file_argument_that_is_not_what_it_must_be_is_one_line(
    command, argv, said, files, tmp_path, capsys
):
    from transformer.decoding import export, translate
    from transformer.training import average

    out = tmp_path / "out"
    main, extra = {
        "average": (average.main, ["--out", str(out)]),
        "translate": (translate.main, ["--input", str(files["passwd"]), "--output", str(out)]),
        "export": (export.main, ["--out", str(out)]),
    }[command]
    named = {k: str(v) for k, v in files.items()}
    try:
        code = main([a.format(**named) for a in argv] + extra)
    except SystemExit as stop:  # argparse's own error line
        code = stop.code
    err = capsys.readouterr().err
    assert code == 2 and err.startswith("error: ") and err.count("\n") == 1, err
    assert said.format(**named) in err
    assert "boundary-content-marker" not in err  # the file's content is never quoted
    assert not out.exists()


def test_a_sentencepiece_model_is_bundled(files, tmp_path):
    from transformer.model_file import load_model_file
    from transformer.training import average

    out = tmp_path / "model.pt"
    assert (
        average.main([str(files["snapshot"]), "--spm", str(files["spm"]), "--out", str(out)]) == 0
    )
    assert load_model_file(out).spm_model == files["spm"].read_bytes()
