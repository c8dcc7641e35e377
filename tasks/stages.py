"""Where each stage's output lives, and when Prefect may reuse it.

A stage writes into `<work>/<stage>/<key>`, the key a hash of its params section and of the
keys of the stages it reads. So two runs that differ only in `train.*` share the folders of
download, clean, vocab and shards, and a finished stage is found again by any run needing it.
Prefect's own cache (persisted results, keyed by that folder) skips finished tasks; the flow
refreshes a task whose folder has gone, so a deleted output is rebuilt, never trusted.
"""

from __future__ import annotations

import hashlib
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from prefect.context import TaskRunContext

from transformer.config import Params, fingerprint, params_hash, to_yaml


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


def plan(params: Params, work_dir: str | Path) -> Layout:
    work = Path(work_dir).resolve()
    d = params.data
    prepare = fingerprint(
        "prepare",
        d.source,
        d.splits,
        d.src_lang,
        d.tgt_lang,
        d.clean.on_invalid,
        _local_inputs(d.source.path),
    )
    clean = fingerprint("clean", prepare, d.clean)
    vocab = fingerprint("vocab", clean, params.vocab)
    shards = fingerprint("shards", vocab, params.shard)
    train = fingerprint("train", shards, params.model, params.train)
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


def write_params(params: Params, layout: Layout) -> Path:
    layout.params_file.parent.mkdir(parents=True, exist_ok=True)
    tmp = layout.params_file.with_suffix(".tmp")
    tmp.write_text(to_yaml(params))
    tmp.replace(layout.params_file)
    return layout.params_file


def output_key(context: TaskRunContext, inputs: dict[str, Any]) -> str:
    """Prefect cache key of a stage task: its output folder (the folder's name is already a
    hash of everything the stage depends on)."""
    return f"stage-{fingerprint(str(Path(inputs['out_dir']).resolve()))}"


def refresh_needed(out_dir: str | Path, refresh: bool) -> bool:
    """Bypass Prefect's cache when asked to, or when the output it points at is gone."""
    return refresh or not Path(out_dir).exists()


def fresh(out_dir: str | Path, refresh: bool) -> bool:
    """True when the stage must run: asked to refresh (its old output is removed first),
    or no finished output is there. Library stages write atomically, so a folder that
    exists is a finished one."""
    out = Path(out_dir)
    if refresh and out.exists():
        shutil.rmtree(out)
    return not out.exists()


def _local_inputs(path: str | None) -> list:
    """Content hashes of local source files: an edited corpus is a different input."""
    if path is None:
        return []
    root = Path(path)
    files = sorted(root.iterdir()) if root.is_dir() else [root]
    return [(f.name, _sha256(f)) for f in files if f.is_file()]


def _sha256(path: Path) -> str:
    with path.open("rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()
