"""Self-describing files: atomic writes, safe loads, the exported model format, and the
training checkpoints of a run folder.

A training checkpoint and an exported (averaged) model are both plain dicts of tensors and
JSON-able values saved with `torch.save`, so they load with `torch.load(weights_only=True)`:
no pickled code runs when a file from elsewhere is opened.

A run folder holds its training checkpoints as `checkpoints/step-{step:07d}.pt` (the last
`keep_last` kept) and `checkpoints/checkpoint_best.pt`, the one of lowest validation loss.
"""

from __future__ import annotations

import logging
import os
import random
import re
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

MODEL_FORMAT = "transformer-mt/model/1"
TRAIN_FORMAT = "transformer-mt/train/1"
CHECKPOINTS = "checkpoints"
BEST = "checkpoint_best.pt"
_STEP_NAME = re.compile(r"step-(\d+)\.pt")

log = logging.getLogger(__name__)


class CheckpointError(RuntimeError):
    """A checkpoint or model file is missing, truncated, corrupt or of another kind."""


def atomic_save(obj: dict[str, Any], path: str | os.PathLike) -> Path:
    """Write `obj` beside `path`, fsync, then rename: a kill leaves the old file or none."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            torch.save(obj, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


def load_file(
    path: str | os.PathLike, map_location: str | torch.device = "cpu", mmap: bool = False
) -> dict:
    """torch.load with weights_only=True; any failure is a CheckpointError naming the file.

    `mmap` maps the tensors instead of reading them: only what is used comes off the disk
    (the model of a checkpoint that also holds the optimizer), and ranks share the pages.
    """
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"{path}: no such file")
    try:
        obj = torch.load(path, map_location=map_location, weights_only=True, mmap=mmap)
    except Exception as err:  # truncated zip, bad pickle, foreign format: all the same to us
        raise CheckpointError(f"{path}: unreadable ({type(err).__name__}: {err})") from None
    if not isinstance(obj, dict):
        raise CheckpointError(f"{path}: not a checkpoint (top level is {type(obj).__name__})")
    return obj


@dataclass(frozen=True)
class ModelFile:
    """An exported model: everything `translate` needs, in one file."""

    params: dict[str, Any]  # the resolved params tree of the run that trained it
    model: dict[str, torch.Tensor]  # state_dict
    spm_model: bytes  # the sentencepiece model, serialized
    meta: dict[str, Any]  # step, averaged_from, data fingerprint, ...


def save_model_file(path: str | os.PathLike, m: ModelFile) -> Path:
    blob = torch.frombuffer(bytearray(m.spm_model), dtype=torch.uint8)
    return atomic_save(
        {
            "format": MODEL_FORMAT,
            "params": m.params,
            "model": m.model,
            "spm_model": blob,
            "meta": m.meta,
        },
        path,
    )


def load_model_file(path: str | os.PathLike, map_location: str = "cpu") -> ModelFile:
    obj = load_file(path, map_location)
    if obj.get("format") != MODEL_FORMAT:
        raise CheckpointError(
            f"{path}: not an exported model (format {obj.get('format')!r}, "
            f"expected {MODEL_FORMAT!r}); export one with `python -m transformer.average`"
        )
    return ModelFile(
        params=obj["params"],
        model=obj["model"],
        spm_model=obj["spm_model"].numpy().tobytes(),
        meta=obj["meta"],
    )


# --------------------------------------------------------------------------- run folders


def step_path(run_dir: str | os.PathLike, step: int) -> Path:
    return Path(run_dir) / CHECKPOINTS / f"step-{step:07d}.pt"


def best_path(run_dir: str | os.PathLike) -> Path:
    return Path(run_dir) / CHECKPOINTS / BEST


def checkpoint_step(path: str | os.PathLike) -> int | None:
    """The step in a `step-NNNNNNN.pt` name, None for any other name."""
    match = _STEP_NAME.fullmatch(Path(path).name)
    return int(match[1]) if match else None


def list_checkpoints(run_dir: str | os.PathLike) -> list[Path]:
    """The run's step checkpoints, oldest first (by step, not by file time)."""
    folder = Path(run_dir) / CHECKPOINTS
    found = [p for p in folder.glob("step-*.pt") if checkpoint_step(p) is not None]
    return sorted(found, key=checkpoint_step)


def load_checkpoint(path: str | os.PathLike, mmap: bool = True) -> dict:
    """A training checkpoint (not an exported model), loaded safely."""
    obj = load_file(path, mmap=mmap)
    if obj.get("format") != TRAIN_FORMAT:
        raise CheckpointError(
            f"{path}: not a training checkpoint (format {obj.get('format')!r}, "
            f"expected {TRAIN_FORMAT!r})"
        )
    return obj


def load_latest(run_dir: str | os.PathLike) -> tuple[Path, dict] | None:
    """The newest readable checkpoint of the run, or None if there is none.

    A newer file that cannot be read (truncated by a crash of the disk, not by a kill:
    saves are atomic) is named in a warning and skipped for the one before it. If none can
    be read, that is an error: starting over would silently throw the run away.
    """
    paths = list_checkpoints(run_dir)
    for path in reversed(paths):
        try:
            return path, load_checkpoint(path)
        except CheckpointError as err:
            log.warning("skipping checkpoint %s: %s; trying the one before", path.name, err)
    if paths:
        raise CheckpointError(
            f"{Path(run_dir) / CHECKPOINTS}: none of the {len(paths)} checkpoints is readable "
            "(see the warnings); move them away, or start over with --reset"
        )
    return None


def save_checkpoint(run_dir: str | os.PathLike, state: dict[str, Any], keep_last: int) -> Path:
    """Write `state` as the checkpoint of its step, then drop all but the last `keep_last`."""
    path = atomic_save({"format": TRAIN_FORMAT, **state}, step_path(run_dir, state["step"]))
    for old in list_checkpoints(run_dir)[:-keep_last]:
        old.unlink(missing_ok=True)
    return path


def save_best(run_dir: str | os.PathLike, state: dict[str, Any]) -> Path:
    """Write `state` as `checkpoint_best.pt` (when the best step is no save step)."""
    return atomic_save({"format": TRAIN_FORMAT, **state}, best_path(run_dir))


def link_best(run_dir: str | os.PathLike, saved: Path) -> Path:
    """Make `checkpoint_best.pt` a hard link to the step file `saved`: no second copy on
    disk, and pruning the step file later leaves the link. Replaced atomically."""
    best = best_path(run_dir)
    tmp = best.with_name(f".{BEST}.link.tmp")
    tmp.unlink(missing_ok=True)
    try:
        os.link(saved, tmp)
    except OSError:  # a file system without hard links
        shutil.copyfile(saved, tmp)
    os.replace(tmp, best)
    return best


def remove_partial_writes(run_dir: str | os.PathLike) -> None:
    """Temporary files of saves that a kill interrupted (never trusted, only in the way)."""
    for tmp in (Path(run_dir) / CHECKPOINTS).glob(".*.tmp"):
        tmp.unlink(missing_ok=True)


def param_differences(
    saved: dict[str, Any], current: dict[str, Any], ignore: frozenset[str] = frozenset()
) -> list[str]:
    """'model.d_model: 64 in checkpoint, 128 now' for each flattened key that differs."""
    old, new = _flatten(saved), _flatten(current)
    return [
        f"{key}: {old.get(key, '<absent>')!r} in checkpoint, {new.get(key, '<absent>')!r} now"
        for key in sorted(old.keys() | new.keys())
        if key not in ignore and old.get(key) != new.get(key)
    ]


def resume_differences(
    state: dict[str, Any],
    params: dict[str, Any],
    fingerprint: str,
    world_size: int,
    ignore: frozenset[str] = frozenset(),
) -> list[str]:
    """What would make a run resumed from training checkpoint `state` another run: its
    model and train params (less `ignore`), its data, its number of ranks."""
    relevant = ("model", "train")
    out = param_differences(
        {k: v for k, v in state["params"].items() if k in relevant},
        {k: v for k, v in params.items() if k in relevant},
        ignore,
    )
    if state["data_fingerprint"] != fingerprint:
        out.append(
            f"data fingerprint differs ({state['data_fingerprint']} in checkpoint, "
            f"{fingerprint} now): other shards"
        )
    if state["world_size"] != world_size:
        out.append(
            f"world size: {state['world_size']} in checkpoint, {world_size} now "
            "(each update would see other batches)"
        )
    return out


def _flatten(tree: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    flat: dict[str, Any] = {}
    for key, value in tree.items():
        if isinstance(value, dict):
            flat.update(_flatten(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value
    return flat


# --------------------------------------------------------------------------- RNG states


def rng_state() -> dict[str, Any]:
    """Every random generator of this process, as tensors and numbers: a dropout mask after
    a resume is the one an uninterrupted run would have drawn."""
    py_version, py_state, py_gauss = random.getstate()
    _, np_keys, np_pos, np_has_gauss, np_gauss = np.random.get_state()
    cuda = torch.cuda.is_available() and torch.cuda.is_initialized()
    return {
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state() if cuda else None,
        "python": {
            "version": py_version,
            "state": torch.tensor(py_state, dtype=torch.int64),
            "gauss": py_gauss,
        },
        "numpy": {
            "keys": torch.from_numpy(np_keys.astype(np.int64)),
            "pos": int(np_pos),
            "has_gauss": int(np_has_gauss),
            "gauss": float(np_gauss),
        },
    }


def set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    if state["cuda"] is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])
    py = state["python"]
    random.setstate((py["version"], tuple(py["state"].tolist()), py["gauss"]))
    np_state = state["numpy"]
    keys = np_state["keys"].numpy().astype(np.uint32)
    np.random.set_state(
        ("MT19937", keys, np_state["pos"], np_state["has_gauss"], np_state["gauss"])
    )
