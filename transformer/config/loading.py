"""Reading a params file: `extends:` chains, `dotted.key=value` overrides, validation.

`load_params("params/base.yaml", ["model.dropout=0.2"])` reads a YAML file (which may
`extends:` another and state only what differs), applies the overrides and validates the
result against the schema (schema.py). Every error names the file and the dotted key, and
`python -m transformer.config` (`main`) turns it into one line on stderr and exit code 2.
"""

from __future__ import annotations

import os
import re
import sys
from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError

from transformer.cli import UserError
from transformer.config.identities import to_yaml
from transformer.config.schema import FOREIGN_SECTIONS, Params
from transformer.files import read_bounded


class ParamsError(UserError, ValueError):
    """A params file or override is wrong; the message names the file and the key."""


def load_params(
    path: str | os.PathLike,
    overrides: list[str] | tuple[str, ...] = (),
    schema: type[Params] = Params,
) -> Params:
    """Read `path` (following `extends:`), apply `key=value` overrides, validate against
    `schema` (the library's Params, or a subclass that adds the foreign sections)."""
    path = Path(path)
    tree = _read_tree(path, seen=())
    for item in overrides:
        _apply_override(tree, item, path)
    if schema is Params:
        tree = {k: v for k, v in tree.items() if k not in FOREIGN_SECTIONS}
    try:
        return schema.model_validate(tree)
    except ValidationError as err:
        raise ParamsError(_describe(err, path, overrides)) from None


def params_from_dict(tree: dict[str, Any]) -> Params:
    """Rebuild a Params tree from a resolved dump (a checkpoint's params)."""
    return Params.model_validate(tree)


class _UniqueKeyLoader(yaml.SafeLoader):
    """safe_load that refuses a key given twice in one mapping (YAML would keep the last)."""

    def construct_mapping(self, node, deep=False):
        seen = set()
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)
            if key in seen:
                raise yaml.constructor.ConstructorError(
                    None, None, f"duplicate key {key!r}", key_node.start_mark
                )
            seen.add(key)
        return super().construct_mapping(node, deep=deep)


# A params or deployments file is a few kB: the bound only stops a wrong path (a dataset, a
# device, an endless FIFO) from being read whole into memory; `extends` chains are a few
# files deep (smoke -> base), and a longer one is a mistake, not a design.
MAX_YAML_BYTES = 1 << 20
MAX_EXTENDS = 8


def read_yaml(path: Path, what: str, error: type[Exception]) -> Any:
    """The data of the YAML file `path` (files.read_bounded's bound and checks; a key given
    twice is refused); every failure is `error`, one line naming the file."""
    data = read_bounded(path, MAX_YAML_BYTES, what, error)
    try:
        return yaml.load(data.decode("utf-8"), Loader=_UniqueKeyLoader)  # a SafeLoader: data only
    except UnicodeDecodeError as err:
        raise error(f"{path}: not UTF-8 text (byte {err.start})") from None
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        where = f" line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        problem = getattr(err, "problem", None) or str(err)
        raise error(f"{path}:{where}: malformed YAML: {problem}") from None
    except RecursionError:  # PyYAML builds nested collections recursively
        raise error(f"{path}: malformed YAML: nested too deeply") from None


def _read_tree(path: Path, seen: tuple[Path, ...]) -> dict[str, Any]:
    if path.resolve() in seen:
        raise ParamsError(f"{path}: extends: cycle through {', '.join(map(str, seen))}")
    if len(seen) > MAX_EXTENDS:
        raise ParamsError(f"{path}: extends: more than {MAX_EXTENDS} files deep ({seen[0]} ...)")
    tree = read_yaml(path, "params file", ParamsError)
    tree = {} if tree is None else tree
    if not isinstance(tree, dict):
        kind = type(tree).__name__
        raise ParamsError(f"{path}: <top>: must be a mapping of sections, got {kind}")
    parent = tree.pop("extends", None)
    if parent is None:
        return tree
    if not isinstance(parent, str):
        raise ParamsError(f"{path}: extends: must be a path to another params file")
    base = _read_tree(path.parent / parent, (*seen, path.resolve()))
    return _merge(base, tree)


def _merge(base: dict[str, Any], child: dict[str, Any]) -> dict[str, Any]:
    """Deep merge: mappings merge key by key, anything else in `child` replaces."""
    out = dict(base)
    for key, value in child.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = _merge(out[key], value)
        else:
            out[key] = value
    return out


def _apply_override(tree: dict[str, Any], item: str, path: Path) -> None:
    key, sep, raw = item.partition("=")
    if not sep or not key or any(not part for part in key.split(".")):
        raise ParamsError(f"{path}: override '{item}' is not of the form dotted.key=value")
    try:
        value = yaml.safe_load(raw) if raw else None
    except yaml.YAMLError:
        value = raw  # not YAML: take the text as a string and let validation judge it
    node = tree
    parts = key.split(".")
    for i, part in enumerate(parts[:-1]):
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            dotted = ".".join(parts[: i + 1])
            raise ParamsError(f"{path}: override '{item}': {dotted} is not a section")
        node = child
    node[parts[-1]] = value


def _describe(err: ValidationError, path: Path, overrides) -> str:
    lines = []
    for e in err.errors():
        dotted = ".".join(str(p) for p in e["loc"] if not isinstance(p, int))
        if e["type"] == "extra_forbidden":
            msg = "unknown key"
        elif e["type"] == "missing":
            msg = "required key is missing"
        else:
            msg = e["msg"].removeprefix("Value error, ")
            # Cross-field checks name their key first ("d_model: ..."): point at that key.
            named = re.match(r"([a-z_][a-z_.]*): (.*)", msg, flags=re.S)
            if named:
                dotted = ".".join(filter(None, [dotted, named[1]]))
                msg = named[2]
        from_override = any(o.partition("=")[0] == dotted for o in overrides)
        origin = f"{path} (override)" if from_override else str(path)
        lines.append(f"{origin}: {dotted or '<top>'}: {msg}")
    return "; ".join(lines)  # one line, as every user error


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help"):
        print("usage: python -m transformer.config PARAMS [dotted.key=value ...] [--check]\n"
              "  --check  what a run of the params will do, or why it cannot finish")  # fmt: skip
        return 0 if argv else 2
    try:
        params = load_params(argv[0], argv[1:])
    except ParamsError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    sys.stdout.write(to_yaml(params))
    return 0
