"""What names a result: the identity of a section (its keys less the operational ones),
the fingerprints hashed from identities, the run's params hash, and the plain dumps of a
tree they are made of. Stage folders, the data fingerprint, the trainer's resume check and
the MLflow parent run all read these, so the schema's one declaration of each key
(schema.py: `operational`, `added`) decides them all.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from typing import Any

import yaml
from pydantic import BaseModel
from pydantic.fields import FieldInfo
from pydantic_core import to_jsonable_python

from transformer.config.schema import FOREIGN_SECTIONS, Params, is_added, is_operational


def _tree(node: BaseModel, leave_out: Callable[[FieldInfo], bool]) -> dict[str, Any]:
    """A section as plain JSON-able values, less the keys `leave_out(info)` names and less
    the added keys at their default (`added`)."""
    out: dict[str, Any] = {}
    for name, info in type(node).model_fields.items():
        value = getattr(node, name)
        if leave_out(info) or (is_added(info) and value == info.default):
            continue
        out[name] = _tree(value, leave_out) if isinstance(value, BaseModel) else _json(value)
    return out


def to_dict(params: BaseModel) -> dict[str, Any]:
    """Plain JSON-able dict of a params tree or one section."""
    return params.model_dump(mode="json")


def to_yaml(params: BaseModel) -> str:
    return yaml.safe_dump(to_dict(params), sort_keys=False)


def identity(node: BaseModel) -> dict[str, Any]:
    """The identity-bearing part of a section: its keys less the operational ones (and the
    added ones at their default), nested sections likewise. Two sections with equal
    identities give the same stage output."""
    return _tree(node, is_operational)


def operational_keys(schema: type[BaseModel] = Params, prefix: str = "") -> set[str]:
    """Dotted names of every operational key of `schema` ('train.max_steps', ...)."""
    keys = set()
    for name, info in schema.model_fields.items():
        dotted = f"{prefix}{name}"
        if is_operational(info):
            keys.add(dotted)
        elif isinstance(info.annotation, type) and issubclass(info.annotation, BaseModel):
            keys |= operational_keys(info.annotation, f"{dotted}.")
    return keys


def _json(value: Any) -> Any:
    return to_jsonable_python(value)


def fingerprint(*parts: Any) -> str:
    """A short stable hash of JSON-able parts (identities, input fingerprints)."""
    blob = json.dumps(
        [to_dict(p) if isinstance(p, BaseModel) else p for p in parts],
        sort_keys=True,
        separators=(",", ":"),
    )
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def params_hash(params: Params) -> str:
    """Identity of a pipeline run (one MLflow parent run): every key of the params, the
    operational ones too (not the added ones at their default), but not the orchestration's
    own sections."""
    tree = _tree(params, leave_out=lambda info: False)
    return fingerprint({k: v for k, v in tree.items() if k not in FOREIGN_SECTIONS})


def flatten(tree: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """{'model': {'d_model': 512}} -> {'model.d_model': 512}."""
    flat: dict[str, Any] = {}
    for key, value in tree.items():
        dotted = f"{prefix}{key}"
        if isinstance(value, dict):
            flat.update(flatten(value, dotted + "."))
        else:
            flat[dotted] = value
    return flat
