"""Checkpoint averaging (paper 6.1: the last 5 checkpoints for base, the last 20 for big),
and the export of the average as one self-contained model file.

    python -m transformer.average RUN_DIR [BRANCH_DIR...] [--last N | --best N] --out model.pt
    python -m transformer.average RUN_DIR/checkpoints/model-*.pt --out model.pt [--spm SPM]

BRANCH_DIR: run folders of further cooldowns of RUN_DIR (branched with `--init-from` at its
cooldown's start): the same selection from each, all averaged (a model soup).

Exit codes: 0 written; 2 bad arguments or checkpoints (one line on stderr).
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Sequence
from pathlib import Path

import torch

from transformer.cli import USER_ERRORS, ArgumentParser, existing_file
from transformer.config import AverageConfig
from transformer.console import setup_logging
from transformer.data.vocab import VocabError, load_spm
from transformer.files import SPM_MODEL, check_output, read_bounded
from transformer.model_file import (
    CheckpointError,
    ModelFile,
    load_file,
    load_typed,
    params_of,
    save_model_file,
)
from transformer.training.checkpoint import SNAPSHOT_FIELDS, SNAPSHOT_FORMAT, select_snapshots

log = logging.getLogger("transformer.average")  # not "__main__" under -m
# A sentencepiece model of the largest vocabularies is a few MB: a file over this is none.
MAX_SPM_BYTES = 1 << 26


def average_checkpoints(paths: Sequence[str | Path]) -> dict[str, torch.Tensor]:
    """The element-wise mean of the `model` state dicts of `paths` (training checkpoints
    or exported models), accumulated in fp32 at least and cast back to each tensor's dtype.

    Every file must hold the same keys with the same shapes as the first; the error names
    the file and the key. Non-float tensors (none in this model) are taken from the last
    file. Tensors that share storage (the tied embeddings) stay shared in the result.
    """
    if not paths:
        raise ValueError("no checkpoints to average")
    paths = [Path(p) for p in paths]
    log.info("averaging %d checkpoints: %s", len(paths), ", ".join(p.name for p in paths))
    first = _model_of(paths[0])
    sums = {k: _accumulator(v) for k, v in first.items()}
    for path in paths[1:]:
        model = _model_of(path)
        _check_same_layout(first, paths[0], model, path)
        for key, value in model.items():
            if value.is_floating_point():
                sums[key] += value.to(sums[key].dtype)
            else:
                sums[key] = value.clone()
    return _tie_like(first, {k: _mean(v, first[k], len(paths)) for k, v in sums.items()})


def export_average(
    run_dir: Path,
    cfg: AverageConfig,
    out: Path,
    max_step: int | None = None,
    branches: Sequence[Path] = (),
) -> Path:
    """Average the snapshots of `run_dir` that `cfg` selects (the last or the best
    `last_n`, of step <= max_step), and as many of each run folder in `branches` (further
    cooldowns of the run: a model soup), into the model file `out`, with the run's
    sentencepiece model and params."""
    runs = (run_dir, *branches)
    paths = [p for d in runs for p in select_snapshots(d, cfg.select, cfg.last_n, max_step)]
    return export_checkpoints(paths, Path(run_dir) / SPM_MODEL, out)


def export_checkpoints(paths: Sequence[Path], spm_model: Path, out: Path) -> Path:
    """Average model snapshots `paths` into a model file (see checkpoint.ModelFile);
    params and data fingerprint are those of the newest (the first of that step)."""
    check_output(out, [*paths, spm_model])
    infos = [load_typed(p, SNAPSHOT_FORMAT, True, SNAPSHOT_FIELDS) for p in paths]  # inputs first
    # Bundled into the model file, so read by sentencepiece first: any other file (a model,
    # /etc/passwd) is one line naming it, and its bytes go nowhere.
    spm_bytes = read_bounded(spm_model, MAX_SPM_BYTES, "sentencepiece model", VocabError)
    load_spm(spm_model)
    newest = max(infos, key=lambda info: info["step"])
    meta = {
        "averaged_from": _names(paths),
        "steps": [info["step"] for info in infos],
        "step": newest["step"],
        "data_fingerprint": newest["data_fingerprint"],
    }
    model = average_checkpoints(paths)
    saved = save_model_file(out, ModelFile(newest["params"], model, spm_bytes, meta))
    log.info("wrote %s (average of steps %s)", saved, meta["steps"])
    return saved


def _names(paths: Sequence[Path]) -> list[str]:
    """The files' names; from several run folders, each after its folder's name."""
    paths = [Path(p) for p in paths]
    if len({p.parent for p in paths}) == 1:
        return [p.name for p in paths]
    return [f"{p.parent.parent.name}/{p.name}" for p in paths]


def _model_of(path: Path) -> dict[str, torch.Tensor]:
    # mmap: only the model's tensors are read, not the optimizer's (twice the model's size).
    obj = load_file(path, mmap=True)
    model = obj.get("model")
    if not isinstance(model, dict):
        raise CheckpointError(f"{path}: holds no model state dict")
    return model


def _accumulator(value: torch.Tensor) -> torch.Tensor:
    if not value.is_floating_point():
        return value.clone()
    return value.to(torch.promote_types(value.dtype, torch.float32), copy=True)


def _mean(total: torch.Tensor, like: torch.Tensor, n: int) -> torch.Tensor:
    return (total / n).to(like.dtype) if like.is_floating_point() else total


def _check_same_layout(ref: dict, ref_path: Path, model: dict, path: Path) -> None:
    if model.keys() != ref.keys():
        missing = sorted(ref.keys() - model.keys())
        extra = sorted(model.keys() - ref.keys())
        raise CheckpointError(
            f"{path}: keys differ from {ref_path.name} (missing {missing}, unexpected {extra})"
        )
    for key, value in model.items():
        if value.shape != ref[key].shape:
            raise CheckpointError(
                f"{path}: {key} has shape {tuple(value.shape)}, "
                f"{ref_path.name} has {tuple(ref[key].shape)}"
            )


def _tie_like(ref: dict[str, torch.Tensor], out: dict[str, torch.Tensor]):
    """Where `ref` holds one tensor under several keys, make `out` do so too."""
    seen: dict[tuple, str] = {}
    for key, value in ref.items():
        ident = (value.data_ptr(), value.shape, value.stride(), value.dtype)
        if value.numel() and ident in seen:
            out[key] = out[seen[ident]]
        else:
            seen.setdefault(ident, key)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = ArgumentParser(
        prog="python -m transformer.average",
        description="Average checkpoints into one exported model file.",
    )
    parser.add_argument(
        "inputs",
        nargs="+",
        type=Path,
        help="a run folder (then those of its further cooldowns), or snapshots",
    )
    which = parser.add_mutually_exclusive_group()
    which.add_argument("--last", type=_positive, help="run folder: the last N snapshots")
    which.add_argument("--best", type=_positive, help="run folder: the N best by validation")
    parser.add_argument("--out", type=Path, required=True, help="the model file to write")
    parser.add_argument("--spm", type=existing_file("a sentencepiece model"),
                        help="snapshots: sentencepiece model to bundle")  # fmt: skip
    try:
        args = parser.parse_args(argv)
    except SystemExit as exit_:  # argparse: usage on stderr, exit 2 (0 for --help)
        return int(exit_.code or 0)
    setup_logging(is_main=True)
    files = [path for path in args.inputs if not path.is_dir()]
    try:
        if files and len(files) < len(args.inputs):
            raise argparse.ArgumentTypeError(
                f"{files[0]}: not a run folder, as the other "
                "inputs are: give run folders, or snapshot files"
            )
        for path in files:
            existing_file("a snapshot")(str(path))
    except argparse.ArgumentTypeError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    try:
        if not files:
            run_dir, *branches = args.inputs
            cfg = _configured(run_dir, args.last, args.best)
            export_average(run_dir, cfg, args.out, branches=branches)
        else:
            spm_model = args.spm or args.inputs[0].resolve().parent.parent / SPM_MODEL
            export_checkpoints(args.inputs, spm_model, args.out)
    except USER_ERRORS as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    return 0


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, not {value}")
    return value


def _configured(run_dir: Path, last: int | None, best: int | None) -> AverageConfig:
    """--last/--best as given, else the run's own average section (from its newest
    snapshot's params)."""
    if last or best:
        return AverageConfig(last_n=last or best, select="last" if last else "best")
    newest = select_snapshots(run_dir, "last", 1)[-1]
    params = load_typed(newest, SNAPSHOT_FORMAT, True, SNAPSHOT_FIELDS)["params"]
    return params_of(newest, params).average
