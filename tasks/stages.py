"""Where each stage's output lives, and when Prefect may reuse it.

A stage writes into `<work>/<stage>/<key>`, the key a hash of its params section and of the
keys of the stages it reads. So two runs that differ only in `train.*` share the folders of
download, clean, vocab and shards, and a finished stage is found again by any run needing it.
Prefect's own cache (persisted results, keyed by that folder) skips finished tasks; the flow
refreshes a task whose folder has gone, so a deleted output is rebuilt, never trusted.
"""

from __future__ import annotations

import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from prefect.context import TaskRunContext

from transformer.config import Params, fingerprint, params_hash, to_yaml
from transformer.data.sources import input_fingerprints


@dataclass(frozen=True)
class Layout:
    """Every path a pipeline run reads or writes, fixed before anything runs."""

    work_dir: Path
    params_file: Path  # the resolved params, written once per params hash
    prepare: Path
    clean: Path
    vocab: Path
    shards: Path
    train: Path
    average: Path
    decode: Path


# Keys that change how a stage runs, not what it produces: kept out of its folder's name.
OPERATIONAL = {
    "shard": {"workers"},
    "train": {"log_every", "timeout_minutes", "max_bad_steps"},
}


def plan(params: Params, work_dir: str | Path) -> Layout:
    work = Path(work_dir).resolve()
    d = params.data
    inputs = input_fingerprints(d)  # hub revision, or each local file's sha256
    prepare = fingerprint("prepare", d.source, d.splits, d.src_lang, d.tgt_lang,
                          d.clean.on_invalid, inputs)  # fmt: skip
    clean = fingerprint("clean", prepare, d.clean)
    vocab = fingerprint("vocab", clean, params.vocab)
    shards = fingerprint("shards", vocab, _identity(params, "shard"))
    train = fingerprint("train", shards, params.model, _identity(params, "train"))
    average = fingerprint("average", train, params.average)
    decode = fingerprint("decode", average, params.decode)
    run = work / "runs" / params_hash(params)
    return Layout(
        work_dir=work,
        params_file=run / "params.yaml",
        prepare=work / "prepare" / prepare,
        clean=work / "clean" / clean,
        vocab=work / "vocab" / vocab,
        shards=work / "shards" / shards,
        train=work / "train" / train,
        average=work / "average" / average,
        decode=work / "decode" / decode,
    )


def write_params(params: Params, path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(to_yaml(params))
    tmp.replace(path)
    return path


def output_key(context: TaskRunContext, inputs: dict[str, Any]) -> str:
    """Prefect cache key of a stage task: its output folder (the folder's name is already a
    hash of everything the stage depends on)."""
    return f"stage-{fingerprint(str(Path(inputs['out_dir']).resolve()))}"


def refresh_needed(done: str | Path, refresh: bool) -> bool:
    """Bypass Prefect's cache when asked to, or when the output it points at is not there
    (`done`: the output folder, or for training the marker of a finished run)."""
    return refresh or not Path(done).exists()


def fresh(out_dir: str | Path, refresh: bool) -> bool:
    """True when the stage must run: asked to refresh (its old output is removed first),
    or no finished output is there. Library stages write atomically, so a folder that
    exists is a finished one."""
    out = Path(out_dir)
    if refresh and out.exists():
        shutil.rmtree(out)
    return not out.exists()


def _identity(params: Params, section: str) -> dict:
    return getattr(params, section).model_dump(mode="json", exclude=OPERATIONAL[section])
