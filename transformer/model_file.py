"""The project's files of tensors: saved atomically with torch.save, loaded with
torch.load(weights_only=True), so that no pickled code runs when a file from elsewhere is
opened; each says what it is (`format`). The exported model (`ModelFile`), everything
translate needs in one file, is defined here: decoding reads it without the trainer.

Each file carries the sha256 of its content (`sha256`: every tensor's bytes, dtype and
shape, and every other value, in order), checked by every load: a flipped byte is an error
naming the file, never a model that is silently another. Files saved before it existed
have none, and load as they did.
"""

from __future__ import annotations

import hashlib
import os
import pickle
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from pydantic import ValidationError

from transformer.cli import UserError
from transformer.config import Params, params_from_dict
from transformer.files import atomic_write

MODEL_FORMAT = "transformer-mt/model/1"
DIGEST = "sha256"  # the key of a file's content checksum


class CheckpointError(UserError, RuntimeError):
    """A checkpoint or model file is missing, truncated, corrupt or of another kind."""


def atomic_save(obj: dict[str, Any], path: str | os.PathLike) -> Path:
    """torch.save `obj` to `path` atomically (files.atomic_write); a failure, a full disk
    included, is a CheckpointError that says how much room is left."""
    path = Path(path)
    body = {k: v for k, v in obj.items() if k != DIGEST}
    try:
        return atomic_write(path, lambda f: torch.save({**body, DIGEST: content_sha256(body)}, f))
    except (OSError, RuntimeError) as err:  # torch reports a full disk as a RuntimeError
        free = shutil.disk_usage(path.parent).free / 1e9
        reason = str(err).splitlines()[0] if str(err) else type(err).__name__
        raise CheckpointError(f"{path}: cannot write ({reason}; {free:.2f} GB free)") from None


def load_file(
    path: str | os.PathLike, map_location: str | torch.device = "cpu", mmap: bool = False
) -> dict:
    """torch.load with weights_only=True; any failure is a CheckpointError naming the file.

    `mmap` maps the tensors instead of reading them: only what is used comes off the disk
    (the model of a state that also holds the optimizer), and ranks share the pages.
    """
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"{path}: no such file")
    try:
        obj = torch.load(path, map_location=map_location, weights_only=True, mmap=mmap)
    except Exception as err:  # truncated zip, foreign format, a pickle that would run code
        raise CheckpointError(f"{path}: unreadable ({_reason(err)})") from None
    if not isinstance(obj, dict):
        raise CheckpointError(f"{path}: not a checkpoint (top level is {type(obj).__name__})")
    saved = obj.pop(DIGEST, None)
    if saved is not None and saved != content_sha256(obj):
        raise CheckpointError(f"{path}: content differs from its sha256 (a damaged file)")
    return obj


def content_sha256(obj: Any) -> str:
    """sha256 of a file's content as loaded: the bytes of every tensor with its dtype and
    shape, every other value by its repr, keys and items in order."""
    digest = hashlib.sha256()
    _feed(digest, obj)
    return digest.hexdigest()


def _feed(digest, value: Any) -> None:
    if isinstance(value, torch.Tensor):
        flat = value.detach().cpu().contiguous().reshape(-1)
        digest.update(f"T{value.dtype}{tuple(value.shape)}".encode())
        digest.update(flat.view(torch.uint8).numpy())
    elif isinstance(value, dict):
        digest.update(f"D{len(value)}".encode())
        for key, item in value.items():
            _feed(digest, key)
            _feed(digest, item)
    elif isinstance(value, (list, tuple)):
        digest.update(f"{type(value).__name__[0]}{len(value)}".encode())
        for item in value:
            _feed(digest, item)
    else:  # what weights_only loads besides: numbers, strings, None, dtypes
        digest.update(f"{type(value).__name__}:{value!r};".encode())


def _reason(err: Exception) -> str:
    # torch's message for a pickle that needs code runs to paragraphs and ends by advising
    # weights_only=False, which is exactly what must not be done with a file from elsewhere.
    if "weights_only" in str(err) or isinstance(err, pickle.UnpicklingError):
        return "it holds objects that only running code could rebuild: refused"
    return f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}"


def load_typed(
    path: str | os.PathLike, kind: str, mmap: bool = False, fields: dict[str, type] | None = None
) -> dict:
    """A file of format `kind` (STATE_FORMAT, SNAPSHOT_FORMAT, MODEL_FORMAT), loaded safely;
    with `fields`, each of those keys must hold a value of its type (check_fields)."""
    obj = load_file(path, mmap=mmap)
    if obj.get("format") != kind:
        raise CheckpointError(f"{path}: a {obj.get('format')!r} file, not {kind!r}")
    return check_fields(path, obj, fields or {})


def check_fields(path: str | os.PathLike, obj: dict, fields: dict[str, type]) -> dict:
    """`obj` if each key of `fields` holds a value of its type, and a `model` is a state dict
    (names to tensors); else a CheckpointError naming the file and the key. A file with the
    right format tag and the wrong contents (edited, or written by other code) is refused
    here, in one line, not as a traceback wherever the value is first used."""
    for key, kind in fields.items():
        if not isinstance(obj.get(key), kind):
            found = "missing" if key not in obj else f"a {type(obj[key]).__name__}"
            raise CheckpointError(f"{path}: {key}: {found}, not a {kind.__name__}")
    model = obj.get("model")
    odd = (
        [k for k, v in model.items() if not isinstance(v, torch.Tensor)]
        if isinstance(model, dict)
        else []
    )
    if odd:
        raise CheckpointError(
            f"{path}: model.{odd[0]}: a {type(model[odd[0]]).__name__}, not a tensor"
        )
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


def params_of(path: str | os.PathLike, tree: dict) -> Params:
    """The params a file holds, validated; CheckpointError naming the file and the key."""
    try:
        return params_from_dict(tree)
    except ValidationError as err:
        first = err.errors()[0]
        where = ".".join(map(str, first["loc"])) or "<top>"
        raise CheckpointError(f"{path}: invalid params: {where}: {first['msg']}") from None


MODEL_FIELDS = {"params": dict, "model": dict, "spm_model": torch.Tensor, "meta": dict}


def load_model_file(path: str | os.PathLike, map_location: str = "cpu") -> ModelFile:
    obj = load_file(path, map_location)
    if obj.get("format") != MODEL_FORMAT:
        raise CheckpointError(
            f"{path}: not an exported model (format {obj.get('format')!r}, "
            f"expected {MODEL_FORMAT!r}); export one with `python -m transformer.average`"
        )
    check_fields(path, obj, MODEL_FIELDS)
    return ModelFile(
        params=obj["params"],
        model=obj["model"],
        spm_model=obj["spm_model"].numpy().tobytes(),
        meta=obj["meta"],
    )
