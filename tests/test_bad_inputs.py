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

from flows import deploy
from flows import wmt14_ende as flow
from tasks.stages import STAGES
from transformer import config, train
from transformer.decoding import evaluate, export, translate
from transformer.training import average

ROOT = Path(__file__).resolve().parents[1]
SMOKE = ROOT / "params" / "smoke.yaml"

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def env(tiny_params, tiny_shards, tiny_run, tmp_path_factory) -> dict[str, Path]:
    """Good files (a trained run, its model, texts) and bad ones, made once."""
    root = tmp_path_factory.mktemp("bad")
    run, model = tiny_run
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
    files.update(_bad_yaml(root))
    files.update(_bad_models(model, run, root))
    files["long_line"] = _write(root / "long.en", b"a cat\n" + b"dog " * 300_000 + b"\n")
    files.update(_damaged_copies(run, model, tiny_shards, root))
    return files


def _damaged_copies(run: Path, model: Path, shards: Path, root: Path) -> dict[str, Path]:
    """Good files with one byte changed where only a checksum can see it (#57), and texts
    that no reader may hold whole."""
    from transformer.data.shard import verify_shards

    flipped_run = root / "flipped_run"
    shutil.copytree(run, flipped_run)
    snapshot = max((flipped_run / "checkpoints").glob("model-*.pt"))
    _flip_tensor(snapshot)
    states_run = root / "flipped_states"
    shutil.copytree(run, states_run)
    for state in (states_run / "checkpoints").glob("state-*.pt"):
        _flip_tensor(state)
    flipped_model = root / "flipped_model.pt"
    shutil.copyfile(model, flipped_model)
    _flip_tensor(flipped_model)
    restored = root / "shards_restored"
    shutil.copytree(shards, restored)
    verify_shards(restored)  # checksummed once, then stamped
    victim = max((restored / "train").glob("*.arrow"))
    times = victim.stat()
    data = bytearray(victim.read_bytes())
    data[len(data) // 2] ^= 0xFF
    victim.write_bytes(bytes(data))
    os.utime(victim, ns=(times.st_atime_ns, times.st_mtime_ns))  # as `touch -r` would
    deep = root / "corpus_deep"
    deep.mkdir()
    pair = b'{"translation": {"en": "a dog", "de": "ein hund"}}\n'
    for split in ("train", "valid", "test"):
        (deep / f"{split}.jsonl").write_bytes(pair * 3)
    (deep / "train.jsonl").write_bytes(pair + b"[" * 100_000 + b"]" * 100_000 + b"\n")
    return {
        "flipped_run": flipped_run, "flipped_snapshot": snapshot, "flipped_states": states_run,
        "flipped_state": max((states_run / "checkpoints").glob("state-*.pt")),
        "flipped_model": flipped_model, "shards_restored": restored, "restored_shard": victim,
        "corpus_deep": deep,
        "empty": _write(root / "empty.txt", b""),
        "gz_cut": _write(root / "cut.en.gz", gzip.compress(b"a dog\n" * 1000)[:40]),
        "nul_line": _write(root / "nul.en", b"a dog\n" + b"\0" * (2 << 20) + b"\n"),
    }  # fmt: skip


def _flip_tensor(path: Path) -> None:
    """One byte changed in the middle of the largest tensor of a torch.save file."""
    import zipfile

    with zipfile.ZipFile(path) as archive:
        tensors = [e for e in archive.infolist() if "/data/" in e.filename]
        entry = max(tensors, key=lambda e: e.file_size)
    data = bytearray(path.read_bytes())
    name_len, extra_len = (int.from_bytes(data[entry.header_offset + i : entry.header_offset + i + 2], "little") for i in (26, 28))  # fmt: skip
    data[entry.header_offset + 30 + name_len + extra_len + entry.file_size // 2] ^= 0x01
    path.write_bytes(bytes(data))


def _bad_yaml(root: Path) -> dict[str, Path]:
    """Params and deployments files of odd shapes, or that lead to something no file is."""
    os.mkfifo(root / "fifo")  # reading it would wait for a writer forever
    good = "deployments:\n  - {name: x, parameters: {params: p.yaml}, schedules: [%s]}\n"
    files = {
        "yaml_list": b"- data\n- model\n",
        "yaml_section_list": b"data: {source: {path: x}, src_lang: en, tgt_lang: de}\nmodel: [1, 2]\n",
        "yaml_zero": b"extends: /dev/zero\n",
        "yaml_fifo": b"extends: fifo\n",
        "yaml_deep": b"data: " + b"[" * 5000 + b"]" * 5000 + b"\n",
        "yaml_big": b"# " + b"x" * (2 << 20) + b"\n",
        "deploy_cron": (good % "{cron: 'at noon'}").encode(),
        "deploy_interval": (good % "{interval: hourly}").encode(),
        "deploy_negative": (good % "{interval: -60}").encode(),
        "deploy_list": (good % "[cron, '0 2 * * *']").encode(),
        "deploy_scalar": good.replace("[%s]", "'0 2 * * *'").encode(),
        "deploy_unknown": (good % "{cron: '0 2 * * *', timezon: UTC}").encode(),
        "yaml_list_key": b"data: {source: {path: x}, src_lang: en, tgt_lang: de}\n? [a, b]\n: 1\n",
        "yaml_mapping_key": b"data: {source: {path: x}, src_lang: en, tgt_lang: de}\n? {a: 1}\n: 1\n",
        "yaml_shadow": b"extends: shadow\n",
    }  # fmt: skip
    _write(root / "shadow", SHADOW)  # a file named by mistake, with a secret in it
    out = {name: _write(root / f"{name}.yaml", data) for name, data in files.items()}
    for i in range(10):  # chain0 -> chain1 -> ... -> chain9, 10 files deep
        _write(root / f"chain{i}.yaml", f"extends: chain{i + 1}.yaml\n".encode())
    _write(root / "chain10.yaml", b"data: {source: {path: x}, src_lang: en, tgt_lang: de}\n")
    return out | {"yaml_chain": root / "chain0.yaml", "fifo": root / "fifo"}


SHADOW = b"root:$6$s4lt$S3CR3Tha5h:19000:0:99999:7:::\ndaemon:*:19000:0:99999:7:::\n"


def _bad_models(model: Path, run: Path, root: Path) -> dict[str, Path]:
    """Files with the right format tag and the wrong contents."""
    import dataclasses

    from transformer.model_file import atomic_save, load_file, load_model_file, save_model_file

    mf = load_model_file(model)
    weights = dict(mf.model)
    first = next(iter(weights))
    variants = {
        "model_bad_params": {"params": {**mf.params, "model": {**mf.params["model"], "d_ff": 0}}},
        "model_params_list": {"params": [1, 2]},
        "model_missing_tensor": {"model": {k: v for k, v in weights.items() if k != first}},
        "model_odd_shape": {"model": weights | {first: weights[first][:-1]}},
        "model_not_tensor": {"model": weights | {first: "weights"}},
        "model_inf_params": {"params": {**mf.params,
                                        "decode": {**mf.params["decode"], "max_len_a": float("inf")}}},
    }  # fmt: skip
    out = {name: save_model_file(root / f"{name}.pt", dataclasses.replace(mf, **change))
           for name, change in variants.items()}  # fmt: skip
    snapshot = load_file(next((run / "checkpoints").glob("model-*.pt")))
    del snapshot["data_fingerprint"]
    out["snapshot_no_fingerprint"] = atomic_save(snapshot, root / "model-0000009.pt")
    return out


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
    for name in ("short", "latin1", "gz", "empty", "no_test", "folder", "long"):
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
    (root / "corpus_folder" / "train.en").unlink()
    (root / "corpus_folder" / "train.en").mkdir()
    (root / "corpus_long" / "train.en").write_bytes(
        b"".join([english[0], b"dog " * 300_000 + b"\n", *english[2:]])
    )
    parquet = root / "corpus_parquet"
    parquet.mkdir()
    for split in ("train", "valid", "test"):  # parquet's magic bytes, nothing valid between
        (parquet / f"{split}.parquet").write_bytes(b"PAR1" + b"\0" * 64 + b"PAR1")
    out["corpus_parquet"] = parquet
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
    ("config: top-level list", config.main, ["{yaml_list}"], "yaml_list.yaml: <top>: must be a mapping of sections, got list"),
    ("config: section is a list", config.main, ["{yaml_section_list}"], "yaml_section_list.yaml: model: Input should be a valid dictionary"),
    ("config: extends /dev/zero", config.main, ["{yaml_zero}"], "/dev/zero: not a regular file, not a params file"),
    ("config: extends a FIFO", config.main, ["{yaml_fifo}"], "{fifo}: not a regular file, not a params file"),
    ("config: params is a folder", config.main, ["{shards}"], "shards: a folder, not a params file"),
    ("config: nested too deeply", config.main, ["{yaml_deep}"], "yaml_deep.yaml: malformed YAML: nested too deeply"),
    ("config: too large", config.main, ["{yaml_big}"], "yaml_big.yaml: larger than 1,048,576 bytes"),
    ("config: extends too deep", config.main, ["{yaml_chain}"], "extends: more than 8 files deep"),
    ("config: negative seed", config.main, ["{params}", "train.seed=-1"], "train.seed: Input should be greater than or equal to 0"),
    ("config: seed past 2**32", config.main, ["{params}", "train.seed=4294967296"], "train.seed: Input should be less than 4294967296"),
    ("config: negative vocab seed", config.main, ["{params}", "vocab.seed=-5"], "vocab.seed: Input should be greater than or equal to 0"),
    ("config: branch seed past 2**32", config.main, ["{params}", "train.seed=4294967295", "train.cooldown=0.5", "average.cooldowns=2"], "train.seed: 4294967295 + average.cooldowns - 1 must be below"),
    ("config: learned positions too few", config.main, ["{params}", "model.positional=learned", "model.max_positions=64"], "model.max_positions: 64 learned positions, the decode max length needs 264"),
    ("train: learned positions shorter than the shards", train.main, ["{params}", "model.positional=learned", "model.max_positions=5", "clean.max_len=4", "decode.max_len_a=0", "decode.max_len_b=1", "--data", "{shards}", "--out", "{root}/r6"], "model.max_positions: 5 learned positions, but {shards} holds a train sequence of"),
    ("translate: a 1.2 MB line", translate.main, ["--model", "{model}", "--input", "{long_line}"], "long.en: line 2: longer than 1,048,576 bytes"),
    ("translate: params do not validate", translate.main, ["--model", "{model_bad_params}", "--input", "{text}"], "model_bad_params.pt: invalid params: model.d_ff: Input should be greater than or equal to 1"),
    ("translate: params not a mapping", translate.main, ["--model", "{model_params_list}", "--input", "{text}"], "model_params_list.pt: params: a list, not a dict"),
    ("translate: a tensor missing", translate.main, ["--model", "{model_missing_tensor}", "--input", "{text}"], "model_missing_tensor.pt: weights do not fit its params: 1 missing keys"),
    ("translate: a tensor of odd shape", translate.main, ["--model", "{model_odd_shape}", "--input", "{text}"], "model_odd_shape.pt: weights do not fit its params:"),
    ("translate: a weight not a tensor", translate.main, ["--model", "{model_not_tensor}", "--input", "{text}"], "model_not_tensor.pt: model."),
    ("export: params do not validate", export.main, ["{model_bad_params}", "--format", "ctranslate2", "--out", "{root}/x"], "model_bad_params.pt: invalid params: model.d_ff"),
    ("average: snapshot without its fingerprint", average.main, ["{snapshot_no_fingerprint}", "--out", "{root}/avg.pt"], "model-0000009.pt: data_fingerprint: missing, not a str"),
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
    # Outputs that would destroy what the command reads or what it did not make (#43).
    ("export: --out holds the model", export.main, ["{model}", "--format", "ctranslate2", "--out", "{root}"], "holds the input"),
    ("export: --out is the model", export.main, ["{model}", "--format", "ctranslate2", "--out", "{model}"], "holds the input"),
    ("export: --out someone's folder", export.main, ["{model}", "--format", "ctranslate2", "--out", "{run}"], "a non-empty folder this command did not make"),
    ("export: --out a file", export.main, ["{model}", "--format", "ctranslate2", "--out", "{a_file}"], "a_file: a file, not a folder"),
    ("translate: --output the model", translate.main, ["--model", "{model}", "--input", "{text}", "--output", "{model}"], "holds the input"),
    ("translate: --output kept, bad model", translate.main, ["--model", "{not_a_model}", "--input", "{text}", "--output", "{three}"], "notes.txt: unreadable"),
    ("translate: --output kept, --beam 0", translate.main, ["--model", "{model}", "--input", "{text}", "--output", "{three}", "--beam", "0"], "beam"),
    ("translate: --output kept, bad input", translate.main, ["--model", "{model}", "--input", "{latin1}", "--output", "{three}"], "latin1.en"),
    ("average: --out its own snapshot", average.main, ["{run}", "--last", "2", "--out", "{run}/checkpoints/model-0000004.pt"], "holds the input"),
    ("average: --out a snapshot given", average.main, ["{run}/checkpoints/model-0000002.pt", "{run}/checkpoints/model-0000004.pt", "--out", "{run}/checkpoints/model-0000002.pt"], "holds the input"),
    ("average: --out the vocabulary", average.main, ["{run}", "--last", "2", "--out", "{run}/spm.model"], "holds the input"),
    # The flow's and the deployments' commands, up to where they stop: before Prefect starts.
    ("deploy: cron does not parse", deploy.main, ["--file", "{deploy_cron}"], "deploy_cron.yaml: deployment x: schedules.0: Invalid cron string"),
    ("deploy: interval not a number", deploy.main, ["--file", "{deploy_interval}"], "deploy_interval.yaml: deployment x: schedules.0.interval: Input should be a valid number"),
    ("deploy: negative interval", deploy.main, ["--file", "{deploy_negative}"], "deploy_negative.yaml: deployment x: schedules.0.interval: Input should be greater than 0"),
    ("deploy: schedule a list", deploy.main, ["--file", "{deploy_list}"], "deploy_list.yaml: deployment x: schedules.0: Input should be a valid dictionary"),
    ("deploy: schedules a scalar", deploy.main, ["--file", "{deploy_scalar}"], "deploy_scalar.yaml: deployment x: schedules: Input should be a valid list"),
    ("deploy: unknown schedule key", deploy.main, ["--file", "{deploy_unknown}"], "deploy_unknown.yaml: deployment x: schedules.0.timezon: unknown key"),
    ("deploy: file is /dev/zero", deploy.main, ["--file", "/dev/zero"], "/dev/zero: not a regular file, not a deployments file"),
    ("deploy: file is a FIFO", deploy.main, ["--file", "{fifo}"], "{fifo}: not a regular file, not a deployments file"),
    ("deploy: not a list of deployments", deploy.main, ["--file", "{yaml_list}"], "yaml_list.yaml: deployments: must be a list"),
    ("flow: params extend /dev/zero", flow.main, ["{yaml_zero}", "--work-dir", "{root}/work"], "/dev/zero: not a regular file"),
    ("flow: negative seed", flow.main, [str(SMOKE), "train.seed=-1", "--work-dir", "{root}/work"], "train.seed: Input should be greater than or equal to 0"),
    ("flow: bad override", flow.main, [str(SMOKE), "train.max_steps=x", "--work-dir", "{root}/work"], "train.max_steps"),
    ("flow: pipeline key", flow.main, [str(SMOKE), "pipeline.nproc_per_node=0", "--work-dir", "{root}/work"], "pipeline.nproc_per_node"),
    ("flow: nodes need slurm", flow.main, [str(SMOKE), "pipeline.nnodes=2", "--work-dir", "{root}/work"], "pipeline.nnodes: 2 nodes need pipeline.launcher: slurm"),
    ("flow: override after an option", flow.main, [str(SMOKE), "--work-dir", "{root}/work", "train.max_steps=x"], "train.max_steps: Input should be"),
    ("deploy: unknown deployment", deploy.main, ["--only", "tiny"], "no deployment tiny"),
    # #57: readers bounded, a flipped byte named wherever it is read.
    ("evaluate: empty files", evaluate.main, ["{empty}", "{empty}"], "empty.txt: no lines to score"),
    ("evaluate: /dev/zero as hypotheses", evaluate.main, ["/dev/zero", "{text}"], "/dev/zero: line 1: longer than 1,048,576 bytes"),
    ("evaluate: /dev/zero as references", evaluate.main, ["{text}", "/dev/zero"], "/dev/zero: line 1: longer than 1,048,576 bytes"),
    ("evaluate: a 1.2 MB line", evaluate.main, ["{long_line}", "{long_line}"], "long.en: line 2: longer than 1,048,576 bytes"),
    ("evaluate: a line of 2 MB of NULs", evaluate.main, ["{text}", "{nul_line}"], "nul.en: line 2: longer than"),
    ("evaluate: truncated gzip", evaluate.main, ["{gz_cut}", "{text}"], "cut.en.gz: truncated or corrupt gzip"),
    ("evaluate: a folder", evaluate.main, ["{run}", "{text}"], "run'"),
    ("average: a flipped byte in a run's snapshot", average.main, ["{flipped_run}", "--last", "2", "--out", "{root}/avg.pt"], "{flipped_snapshot}: content differs from its sha256"),
    ("average: a flipped byte in a snapshot given", average.main, ["{flipped_snapshot}", "--out", "{root}/avg.pt"], "{flipped_snapshot}: content differs from its sha256"),
    ("translate: a flipped byte in the model", translate.main, ["--model", "{flipped_model}", "--input", "{text}"], "flipped_model.pt: content differs from its sha256"),
    ("export: a flipped byte in the model", export.main, ["{flipped_model}", "--format", "ctranslate2", "--out", "{root}/x"], "flipped_model.pt: content differs from its sha256"),
    ("train: every state flipped", train.main, ["{params}", "--data", "{shards}", "--out", "{flipped_states}"], "{flipped_state}: unreadable, as the 1 training state(s) before it"),
    # #57: values checked where they are read; keys that are no keys; no file's text echoed.
    ("config: decode.max_len_a=.inf", config.main, ["{params}", "decode.max_len_a=.inf"], "decode.max_len_a: Input should be a finite number"),
    ("config: train.lr_scale=.inf", config.main, ["{params}", "train.lr_scale=.inf"], "train.lr_scale: Input should be a finite number"),
    ("config: train.lr_scale=.nan", config.main, ["{params}", "train.lr_scale=.nan"], "train.lr_scale: Input should be a finite number"),
    ("config: model.dropout=-.inf", config.main, ["{params}", "model.dropout=-.inf"], "model.dropout: Input should be a finite number"),
    ("config: lr_scale past 100", config.main, ["{params}", "train.lr_scale=1.0e+9"], "train.lr_scale: Input should be less than or equal to 100"),
    ("config: max_len_b past 4096", config.main, ["{params}", "decode.max_len_b=1000000000"], "decode.max_len_b: Input should be less than or equal to 4096"),
    ("config: a key that is a list", config.main, ["{yaml_list_key}"], "yaml_list_key.yaml: line 2, column 3: malformed YAML: a key that is a list"),
    ("config: a key that is a mapping", config.main, ["{yaml_mapping_key}"], "yaml_mapping_key.yaml: line 2, column 3: malformed YAML: a key that is a dict"),
    ("config: extends a file of other text", config.main, ["{yaml_shadow}"], "yaml_shadow.yaml: 2 unknown key(s) that are no names (not shown"),
    ("config: a NUL in an override key", config.main, ["{params}", "model.d\0model=3"], "override 'model.d\\x00model=3' is not of the form"),
    ("config: a newline in an override key", config.main, ["{params}", "model.d\nmodel=3"], "override 'model.d\\nmodel=3' is not of the form"),
    ("translate: a model whose params hold .inf", translate.main, ["--model", "{model_inf_params}", "--input", "{text}"], "model_inf_params.pt: invalid params: decode.max_len_a: Input should be a finite number"),
    ("flow: sbatch --wra= (--wrap)", flow.main, [str(SMOKE), "pipeline.slurm.sbatch_options=['--wra=id']", "--work-dir", "{root}/work"], "sbatch_options: '--wra=id' sets --wrap, which is set by the launcher"),
    ("flow: sbatch -t5 (--time)", flow.main, [str(SMOKE), "pipeline.slurm.sbatch_options=[-t5]", "--work-dir", "{root}/work"], "sbatch_options: '-t5' sets -t, which is set by pipeline.slurm.time_limit_minutes"),
    ("flow: sbatch -vN2 (--nodes)", flow.main, [str(SMOKE), "pipeline.slurm.sbatch_options=[-vN2]", "--work-dir", "{root}/work"], "sbatch_options: '-vN2' sets -N, which is set by pipeline.nnodes"),
    ("flow: sbatch --", flow.main, [str(SMOKE), "pipeline.slurm.sbatch_options=['--']", "--work-dir", "{root}/work"], "sbatch_options: '--' is not one sbatch option"),
    ("flow: train_timeout_minutes=.inf", flow.main, [str(SMOKE), "pipeline.train_timeout_minutes=.inf", "--work-dir", "{root}/work"], "pipeline.train_timeout_minutes: Input should be a finite number"),
    ("train: a shard flipped, its times restored", train.main, ["{params}", "--data", "{shards_restored}", "--out", "{root}/r7"], "{restored_shard}: sha256 differs"),
]  # fmt: skip

PROCESSES = [
    ("flow: corrupt parquet source", [sys.executable, "-m", "flows.wmt14_ende", str(SMOKE), "data.source.path={corpus_parquet}", "data.source.format=parquet", "--work-dir", "{root}/work"], "corpus_parquet/train.parquet: not a readable parquet file"),
    ("flow: a folder where a source file should be", [sys.executable, "-m", "flows.wmt14_ende", str(SMOKE), "data.source.path={corpus_folder}", "--work-dir", "{root}/work"], "corpus_folder/train.en: a folder, where a data file should be"),
    ("flow: a source line of 1.2 MB", [sys.executable, "-m", "flows.wmt14_ende", str(SMOKE), "data.source.path={corpus_long}", "--work-dir", "{root}/work"], "corpus_long/train.en: line 2: longer than 1,048,576 bytes"),
    ("python -m transformer.config", [sys.executable, "-m", "transformer.config", "{root}/missing.yaml"], "missing.yaml"),
    ("python -m transformer.average", [sys.executable, "-m", "transformer.average", "{run}", "--last", "0", "--out", "{root}/a.pt"], "--last"),
    ("python -m transformer.translate", [sys.executable, "-m", "transformer.translate", "--model", "{not_a_model}"], "notes.txt"),
    ("flow: no params file", [sys.executable, "-m", "flows.wmt14_ende", "{root}/none.yaml", "--work-dir", "{root}/work"], "none.yaml: no such params file"),
    ("flow: source is a file", [sys.executable, "-m", "flows.wmt14_ende", str(SMOKE), "data.source.path={a_file}", "--work-dir", "{root}/work"], "a_file: data.source.path is not a directory"),
    ("flow: line counts differ", [sys.executable, "-m", "flows.wmt14_ende", str(SMOKE), "data.source.path={corpus_short}", "--work-dir", "{root}/work"], "corpus_short/train.de has 8999 lines"),
    ("flow: invalid UTF-8", [sys.executable, "-m", "flows.wmt14_ende", str(SMOKE), "data.source.path={corpus_latin1}", "--work-dir", "{root}/work"], "corpus_latin1/train.en: line 2: invalid UTF-8"),
    ("flow: truncated gzip", [sys.executable, "-m", "flows.wmt14_ende", str(SMOKE), "data.source.path={corpus_gz}", "--work-dir", "{root}/work"], "train.en.gz: truncated or corrupt gzip"),
    ("flow: no training text", [sys.executable, "-m", "flows.wmt14_ende", str(SMOKE), "data.source.path={corpus_empty}", "--work-dir", "{root}/work"], "corpus_empty (split 'train'): all 2 training pairs were dropped"),
    ("flow: missing split", [sys.executable, "-m", "flows.wmt14_ende", str(SMOKE), "data.source.path={corpus_no_test}", "--work-dir", "{root}/work"], "corpus_no_test/test.de: no such file"),
    ("flow: work dir is a file", [sys.executable, "-m", "flows.wmt14_ende", str(SMOKE), "--work-dir", "{a_file}"], "a_file"),
    ("deploy: no such file", [sys.executable, "-m", "flows.deploy", "--file", "{root}/none.yaml"], "none.yaml"),
    ("python -m transformer.evaluate on /dev/zero", [sys.executable, "-m", "transformer.evaluate", "{text}", "/dev/zero"], "/dev/zero: line 1: longer than"),
    ("python -m transformer.average, a flipped snapshot", [sys.executable, "-m", "transformer.average", "{flipped_run}", "--last", "2", "--out", "{root}/a.pt"], "{flipped_snapshot}: content differs from its sha256"),
    ("flow: a JSON line nested 100k deep", [sys.executable, "-m", "flows.wmt14_ende", str(SMOKE), "data.source.path={corpus_deep}", "data.source.format=jsonl", "--work-dir", "{root}/work"], "corpus_deep/train.jsonl: line 2: JSON nested more than 64 deep"),
    ("flow: a work dir with a newline", [sys.executable, "-m", "flows.wmt14_ende", str(SMOKE), "--work-dir", "{root}/new\nline"], "work dir {root}/new\\nline: a '?' or a control character"),
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
    guarded = [env["run"], env["model"], env["shards"], env["params"], env["three"], env["a_file"]]
    before = digest(guarded)
    capsys.readouterr()
    try:
        code = command(_fill(args, env))
    except SystemExit as exit_:  # argparse inside main
        code = exit_.code
    _check(code, capsys.readouterr().err, _fill([culprit], env)[0], before, digest(guarded))


# Each of these runs the flow up to a data stage (~12 s): the slow suite takes them.
SLOW_PROCESSES = {"flow: corrupt parquet source", "flow: a folder where a source file should be",
                  "flow: a source line of 1.2 MB", "flow: invalid UTF-8", "flow: missing split",
                  "flow: source is a file", "flow: line counts differ", "flow: truncated gzip",
                  "flow: no training text", "flow: work dir is a file",
                  "flow: a JSON line nested 100k deep", "flow: a work dir with a newline"}  # fmt: skip


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


def test_no_error_quotes_a_files_content(env, capsys):
    """`extends:` naming a file that is no params file (here a shadow password file): the
    error says so and counts its lines, and quotes none of them."""
    assert config.main([str(env["yaml_shadow"])]) == 2
    err = capsys.readouterr().err
    assert "S3CR3T" not in err and "19000" not in err and "daemon" not in err, err


def test_there_are_forty_and_more():
    assert len(IN_PROCESS) + len(PROCESSES) >= 40
