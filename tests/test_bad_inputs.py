"""Bad input, through the real command lines: every user error is one line on stderr that
names the culprit (file, key, line or option), exit code 2, and nothing already written is
changed. The library's commands run in this process through their `main(argv)` (what
`python -m` calls), a few also as `python -m` to show the exit code gets out; the flow and
the deployment server run as processes."""

from __future__ import annotations

import gzip
import hashlib
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tasks.stages import STAGES
from transformer import config, train
from transformer.config import AverageConfig
from transformer.decoding import evaluate, export, translate
from transformer.training import average

ROOT = Path(__file__).resolve().parents[1]
SMOKE = ROOT / "params" / "smoke.yaml"

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def env(tiny_params, tiny_shards, tmp_path_factory) -> dict[str, Path]:
    """Good files (a trained run, its model, texts) and bad ones, made once."""
    root = tmp_path_factory.mktemp("bad")
    run = root / "run"
    steps = ["train.max_steps=4", "train.save_every=2", "train.valid_every=4"]
    assert (
        train.main([str(tiny_params), *steps, "--data", str(tiny_shards), "--out", str(run)]) == 0
    )
    model = average.export_average(run, AverageConfig(last_n=2), root / "model.pt")
    files = {
        "params": tiny_params, "shards": tiny_shards, "run": run, "model": model,
        "text": _write(root / "good.en", b"the dog runs\na cat\n"),
        "latin1": _write(root / "latin1.en", b"the dog\ncaf\xe9 au lait\n"),
        "three": _write(root / "three.de", b"a\nb\nc\n"),
        "not_a_model": _write(root / "notes.txt", b"not a model\n"),
        "truncated_model": _write(root / "cut.pt", model.read_bytes()[:2000]),
        "a_file": _write(root / "a_file", b"x"),
        "yaml_dup": _write(root / "dup.yaml", b"data: {source: {path: x}}\nmodel:\n  d_ff: 1\n  d_ff: 2\n"),
        "yaml_bad": _write(root / "bad.yaml", b"data:\n  source: {path: x\n"),
        "yaml_cycle": _write(root / "cycle.yaml", b"extends: cycle.yaml\n"),
        "prenorm": _prenorm_model(model, root / "prenorm.pt"),
    }  # fmt: skip
    shards = root / "shards_damaged"
    shutil.copytree(tiny_shards, shards)
    victim = next((shards / "train").glob("*.arrow"))
    data = bytearray(victim.read_bytes())
    data[len(data) // 2] ^= 0xFF
    victim.write_bytes(bytes(data))
    files["damaged_shards"], files["damaged_shard"] = shards, victim
    bare = root / "no_manifest"
    shutil.copytree(tiny_shards, bare)
    (bare / "manifest.json").unlink()
    files["no_manifest"] = bare
    files.update(_bad_corpora(root))
    return files


def _write(path: Path, data: bytes) -> Path:
    path.write_bytes(data)
    return path


def _prenorm_model(model: Path, out: Path) -> Path:
    from transformer.model_file import load_model_file, save_model_file

    mf = load_model_file(model)
    params = {**mf.params, "model": {**mf.params["model"], "norm_first": True}}
    import torch

    state = dict(mf.model)
    d = params["model"]["d_model"]
    state |= {k: torch.ones(d) if k.endswith("weight") else torch.zeros(d)
              for k in ("enc_norm.weight", "enc_norm.bias", "dec_norm.weight", "dec_norm.bias")}  # fmt: skip
    return save_model_file(out, type(mf)(params, state, mf.spm_model, mf.meta))


def _bad_corpora(root: Path) -> dict[str, Path]:
    """Copies of the shipped smoke corpus, each with one defect."""
    smoke = ROOT / "data" / "smoke"
    out = {}
    for name in ("short", "latin1", "gz", "empty", "no_test"):
        folder = root / f"corpus_{name}"
        shutil.copytree(smoke, folder, ignore=shutil.ignore_patterns("*.py"))
        out[f"corpus_{name}"] = folder
    lines = (smoke / "train.de").read_bytes().splitlines(keepends=True)
    (root / "corpus_short" / "train.de").write_bytes(b"".join(lines[:-1]))
    english = (smoke / "train.en").read_bytes().splitlines(keepends=True)
    latin1 = [english[0], b"na\xefve\n", *english[2:]]  # line 2 is not UTF-8
    (root / "corpus_latin1" / "train.en").write_bytes(b"".join(latin1))
    gz = gzip.compress((smoke / "train.en").read_bytes())
    (root / "corpus_gz" / "train.en").unlink()
    (root / "corpus_gz" / "train.en.gz").write_bytes(gz[: len(gz) // 2])
    (root / "corpus_empty" / "train.en").write_bytes(b"   \n\n")
    (root / "corpus_empty" / "train.de").write_bytes(b"\n \n")
    (root / "corpus_no_test" / "test.de").unlink()
    return out  # fmt: skip


def digest(paths) -> dict[str, str]:
    """sha256 of every file under `paths`: what must not change when a command fails."""
    out = {}
    for base in paths:
        for path in sorted(Path(base).rglob("*")) if Path(base).is_dir() else [Path(base)]:
            if path.is_file():
                out[str(path)] = hashlib.sha256(path.read_bytes()).hexdigest()
    return out


# (id, command, arguments (templates over the env's paths), what stderr must name)
IN_PROCESS = [
    ("config: no such file", config.main, ["{root}/missing.yaml"], "missing.yaml: no such params file"),
    ("config: malformed YAML", config.main, ["{yaml_bad}"], "bad.yaml: line 3, column 1: malformed YAML"),
    ("config: duplicate key", config.main, ["{yaml_dup}"], "dup.yaml: line 4, column 3: malformed YAML: duplicate key 'd_ff'"),
    ("config: extends cycle", config.main, ["{yaml_cycle}"], "cycle.yaml: extends: cycle"),
    ("config: unknown key", config.main, ["{params}", "model.d_modl=3"], "model.d_modl: unknown key"),
    ("config: bool for int", config.main, ["{params}", "train.max_steps=true"], "train.max_steps: Input should be a valid integer"),
    ("config: inconsistent", config.main, ["{params}", "model.d_model=33"], "model.d_model: 33 is not divisible by n_heads"),
    ("config: bad override", config.main, ["{params}", "model.d_model"], "override 'model.d_model' is not of the form"),
    ("train: no shards", train.main, ["{params}", "--data", "{root}/nowhere", "--out", "{root}/r1"], "nowhere/manifest.json: no manifest"),
    ("train: no manifest", train.main, ["{params}", "--data", "{no_manifest}", "--out", "{root}/r2"], "no_manifest/manifest.json: no manifest"),
    ("train: damaged shard", train.main, ["{params}", "--data", "{damaged_shards}", "--out", "{root}/r3"], "{damaged_shard}: sha256 differs"),
    ("train: unknown key", train.main, ["{params}", "model.x=1", "--data", "{shards}", "--out", "{root}/r4"], "model.x: unknown key"),
    ("train: other params", train.main, ["{params}", "model.d_ff=128", "--data", "{shards}", "--out", "{run}"], "model.d_ff: 64 in checkpoint, 128 now"),
    ("train: out is a file", train.main, ["{params}", "--data", "{shards}", "--out", "{a_file}"], "a_file"),
    ("train: bad option", train.main, ["{params}", "--data", "{shards}", "--out", "{root}/r5", "--resett"], "unrecognized arguments: --resett"),
    ("average: no snapshots", average.main, ["{root}", "--last", "2", "--out", "{root}/avg.pt"], "0 last snapshot(s)"),
    ("average: --last 0", average.main, ["{run}", "--last", "0", "--out", "{root}/avg.pt"], "argument --last: must be at least 1, not 0"),
    ("average: --last -1", average.main, ["{run}", "--last", "-1", "--out", "{root}/avg.pt"], "must be at least 1, not -1"),
    ("average: too many", average.main, ["{run}", "--last", "9", "--out", "{root}/avg.pt"], "9 to average"),
    ("average: not a checkpoint", average.main, ["{not_a_model}", "{model}", "--out", "{root}/avg.pt"], "notes.txt: unreadable"),
    ("average: truncated", average.main, ["{truncated_model}", "--out", "{root}/avg.pt"], "cut.pt: unreadable"),
    ("evaluate: line counts", evaluate.main, ["{text}", "{three}"], "good.en has 2 lines but"),
    ("evaluate: no such file", evaluate.main, ["{root}/nope.de", "{three}"], "nope.de"),
    ("evaluate: not UTF-8", evaluate.main, ["{latin1}", "{text}"], "latin1.en: not UTF-8"),
    ("translate: no model", translate.main, ["--model", "{root}/none.pt", "--input", "{text}"], "none.pt: no such file"),
    ("translate: not a model", translate.main, ["--model", "{not_a_model}", "--input", "{text}"], "notes.txt: unreadable"),
    ("translate: truncated model", translate.main, ["--model", "{truncated_model}", "--input", "{text}"], "cut.pt: unreadable"),
    ("translate: output dir missing", translate.main, ["--model", "{model}", "--input", "{text}", "--output", "{root}/no/dir/out"], "no/dir"),
    ("translate: disk full", translate.main, ["--model", "{model}", "--input", "{text}", "--output", "/dev/full"], "/dev/full"),
    ("translate: input not UTF-8", translate.main, ["--model", "{model}", "--input", "{latin1}"], "latin1.en"),
    ("translate: no input file", translate.main, ["--model", "{model}", "--input", "{root}/nope.en"], "nope.en"),
    ("translate: beam 0", translate.main, ["--model", "{model}", "--input", "{text}", "--beam", "0"], "beam"),
    ("translate: nbest > beam", translate.main, ["--model", "{model}", "--input", "{text}", "--beam", "2", "--nbest", "3"], "nbest"),
    ("translate: no CUDA", translate.main, ["--model", "{model}", "--input", "{text}", "--device", "cuda:7"], "cuda"),
    ("export: unknown format", export.main, ["{model}", "--format", "onnx", "--out", "{root}/x"], "--format 'onnx'"),
    ("export: bad quantization", export.main, ["{model}", "--format", "ctranslate2", "--quantization", "int4", "--out", "{root}/x"], "--quantization 'int4'"),
    ("export: pre-norm to Marian", export.main, ["{prenorm}", "--format", "huggingface", "--out", "{root}/x"], "model.norm_first"),
    ("export: out under a file", export.main, ["{model}", "--format", "ctranslate2", "--out", "{a_file}/x"], "a_file"),
]  # fmt: skip

PROCESSES = [
    ("python -m transformer.config", [sys.executable, "-m", "transformer.config", "{root}/missing.yaml"], "missing.yaml"),
    ("python -m transformer.average", [sys.executable, "-m", "transformer.average", "{run}", "--last", "0", "--out", "{root}/a.pt"], "--last"),
    ("python -m transformer.translate", [sys.executable, "-m", "transformer.translate", "--model", "{not_a_model}"], "notes.txt"),
    ("flow: no params file", [sys.executable, "-m", "flows.wmt14_ende", "{root}/none.yaml", "--work-dir", "{root}/work"], "none.yaml: no such params file"),
    ("flow: bad override", [sys.executable, "-m", "flows.wmt14_ende", str(SMOKE), "train.max_steps=x", "--work-dir", "{root}/work"], "train.max_steps"),
    ("flow: pipeline key", [sys.executable, "-m", "flows.wmt14_ende", str(SMOKE), "pipeline.nproc_per_node=0", "--work-dir", "{root}/work"], "pipeline.nproc_per_node"),
    ("flow: nodes need slurm", [sys.executable, "-m", "flows.wmt14_ende", str(SMOKE), "pipeline.nnodes=2", "--work-dir", "{root}/work"], "pipeline.nnodes: 2 nodes need pipeline.launcher: slurm"),
    ("flow: source is a file", [sys.executable, "-m", "flows.wmt14_ende", str(SMOKE), "data.source.path={a_file}", "--work-dir", "{root}/work"], "a_file: data.source.path is not a directory"),
    ("flow: line counts differ", [sys.executable, "-m", "flows.wmt14_ende", str(SMOKE), "data.source.path={corpus_short}", "--work-dir", "{root}/work"], "corpus_short/train.de has 8999 lines"),
    ("flow: invalid UTF-8", [sys.executable, "-m", "flows.wmt14_ende", str(SMOKE), "data.source.path={corpus_latin1}", "--work-dir", "{root}/work"], "corpus_latin1/train.en: line 2: invalid UTF-8"),
    ("flow: truncated gzip", [sys.executable, "-m", "flows.wmt14_ende", str(SMOKE), "data.source.path={corpus_gz}", "--work-dir", "{root}/work"], "train.en.gz: truncated or corrupt gzip"),
    ("flow: no training text", [sys.executable, "-m", "flows.wmt14_ende", str(SMOKE), "data.source.path={corpus_empty}", "--work-dir", "{root}/work"], "corpus_empty (split 'train'): all 2 training pairs were dropped"),
    ("flow: missing split", [sys.executable, "-m", "flows.wmt14_ende", str(SMOKE), "data.source.path={corpus_no_test}", "--work-dir", "{root}/work"], "corpus_no_test/test.de: no such file"),
    ("flow: override after an option", [sys.executable, "-m", "flows.wmt14_ende", str(SMOKE), "--work-dir", "{root}/work", "train.max_steps=x"], "train.max_steps: Input should be"),
    ("flow: work dir is a file", [sys.executable, "-m", "flows.wmt14_ende", str(SMOKE), "--work-dir", "{a_file}"], "a_file"),
    ("deploy: unknown deployment", [sys.executable, "-m", "flows.deploy", "--only", "tiny"], "no deployment tiny"),
    ("deploy: no such file", [sys.executable, "-m", "flows.deploy", "--file", "{root}/none.yaml"], "none.yaml"),
]  # fmt: skip


def _fill(items: list[str], env: dict[str, Path]) -> list[str]:
    paths = {k: str(v) for k, v in env.items()} | {"root": str(Path(env["run"]).parent)}
    return [item.format(**paths) for item in items]


def _check(code: int, err: str, culprit: str, before: dict, after: dict, logs=False) -> None:
    """Exit code 2, one error line naming the culprit, no traceback, nothing changed.
    `logs`: the flow's stderr also carries Prefect's log lines; they may stay."""
    lines = [line for line in err.splitlines() if line.strip()]
    errors = [line for line in lines if line.startswith("error:")]
    assert code == 2, err[-3000:]
    assert len(errors) == 1 and (logs or len(lines) == 1), err[-3000:]
    assert culprit in errors[0], err[-3000:]
    assert "Traceback" not in err and "Error logging to API" not in err, err[-3000:]
    assert "NoneType: None" not in err, err[-3000:]  # Prefect's empty traceback, filtered
    assert before == after, "a failed command changed files that were already there"


@pytest.mark.parametrize(
    ("name", "command", "args", "culprit"), IN_PROCESS, ids=[c[0] for c in IN_PROCESS]
)
def test_library_commands(name, command, args, culprit, env, capsys):  # fmt: skip
    guarded = [env["run"], env["model"], env["shards"], env["params"]]
    before = digest(guarded)
    capsys.readouterr()
    try:
        code = command(_fill(args, env))
    except SystemExit as exit_:  # argparse inside main
        code = exit_.code
    _check(code, capsys.readouterr().err, _fill([culprit], env)[0], before, digest(guarded))


# Each of these runs the flow up to a data stage (~12 s): the slow suite takes them.
SLOW_PROCESSES = {"flow: source is a file", "flow: line counts differ", "flow: truncated gzip",
                  "flow: no training text", "flow: work dir is a file"}  # fmt: skip


@pytest.mark.parametrize(("name", "cmd", "culprit"), [
    pytest.param(*case, id=case[0], marks=[pytest.mark.slow] if case[0] in SLOW_PROCESSES else [])
    for case in PROCESSES
])  # fmt: skip
def test_commands_as_processes(name, cmd, culprit, env):
    guarded = [env["run"], env["model"]]
    before = digest(guarded)
    process_env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run(_fill(cmd, env), cwd=ROOT, env=process_env, capture_output=True,
                          text=True, timeout=300)  # fmt: skip
    flow = "flows." in " ".join(cmd)
    culprit = _fill([culprit], env)[0]
    _check(done.returncode, done.stderr, culprit, before, digest(guarded), logs=flow)
    work = Path(env["run"]).parent / "work"
    for stage in (work / s.name for s in STAGES if (work / s.name).is_dir()):
        for entry in stage.iterdir():  # only finished folders, and the locks beside them
            assert entry.suffix == ".lock" or (entry / "stage.json").is_file(), entry


def test_there_are_forty_and_more():
    assert len(IN_PROCESS) + len(PROCESSES) >= 40
