"""Self-describing files: atomic writes, safe loads, and the exported model format.

A training checkpoint and an exported (averaged) model are both plain dicts of tensors and
JSON-able values saved with `torch.save`, so they load with `torch.load(weights_only=True)`:
no pickled code runs when a file from elsewhere is opened.
"""

from __future__ import annotations

import os
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

MODEL_FORMAT = "transformer-mt/model/1"


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


def load_file(path: str | os.PathLike, map_location: str | torch.device = "cpu") -> dict:
    """torch.load with weights_only=True; any failure is a CheckpointError naming the file."""
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"{path}: no such file")
    try:
        obj = torch.load(path, map_location=map_location, weights_only=True)
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
