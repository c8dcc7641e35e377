"""Self-describing files: atomic saves, safe loads, the exported model format, and the
checkpoint manager of a run folder.

Every file is a plain dict of tensors and JSON-able values saved with `torch.save`, loaded
with `torch.load(weights_only=True)`: no pickled code runs when a file from elsewhere is
opened. A run folder holds, under `checkpoints/`:

    state-NNNNNNN.pt   everything resuming needs (model, optimizer, schedule, sampler, every
                       rank's RNG, progress, early stopping): the newest KEEP_STATES, and
                       the one at the lr cooldown's start, where more cooldowns branch off
    model-NNNNNNN.pt   model-only snapshots with their step and validation score, for
                       averaging: the last `keep_last` and the `keep_best` best

so the disk a run needs is bounded: for big (213M parameters) two 2.6 GB states and
0.9 GB a snapshot, not 2.6 GB for each of the 20 checkpoints it averages.
"""

from __future__ import annotations

import logging
import math
import os
import pickle
import random
import re
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from transformer.config import ModelConfig, TrainConfig, flatten, operational_keys, to_dict
from transformer.distributed import all_gather_objects
from transformer.files import CHECKPOINTS, atomic_write

MODEL_FORMAT = "transformer-mt/model/1"
STATE_FORMAT = "transformer-mt/state/1"
SNAPSHOT_FORMAT = "transformer-mt/snapshot/1"
KEEP_STATES = 2  # the newest training state, and one to fall back on if it is unreadable
_NAME = re.compile(r"(state|model)-(\d{7})\.pt")

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
        os.chmod(tmp, 0o666 & ~_umask())  # mkstemp makes 0600; a run folder is shared
        os.replace(tmp, path)
    except (OSError, RuntimeError) as err:  # torch reports a full disk as a RuntimeError
        Path(tmp).unlink(missing_ok=True)
        free = shutil.disk_usage(path.parent).free / 1e9
        reason = str(err).splitlines()[0] if str(err) else type(err).__name__
        raise CheckpointError(f"{path}: cannot write ({reason}; {free:.2f} GB free)") from None
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


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
    return obj


def _reason(err: Exception) -> str:
    # torch's message for a pickle that needs code runs to paragraphs and ends by advising
    # weights_only=False, which is exactly what must not be done with a file from elsewhere.
    if "weights_only" in str(err) or isinstance(err, pickle.UnpicklingError):
        return "it holds objects that only running code could rebuild: refused"
    return f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}"


def load_typed(path: str | os.PathLike, kind: str, mmap: bool = False) -> dict:
    """A file of format `kind` (STATE_FORMAT, SNAPSHOT_FORMAT, MODEL_FORMAT), loaded safely."""
    obj = load_file(path, mmap=mmap)
    if obj.get("format") != kind:
        raise CheckpointError(f"{path}: a {obj.get('format')!r} file, not {kind!r}")
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
    try:
        return ModelFile(
            params=obj["params"],
            model=obj["model"],
            spm_model=obj["spm_model"].numpy().tobytes(),
            meta=obj["meta"],
        )
    except (KeyError, AttributeError, TypeError) as err:
        raise CheckpointError(f"{path}: an incomplete model file ({err})") from None


# --------------------------------------------------------------------------- run folders


def checkpoint_path(run_dir: str | os.PathLike, kind: str, step: int) -> Path:
    return Path(run_dir) / CHECKPOINTS / f"{kind}-{step:07d}.pt"


def list_files(run_dir: str | os.PathLike, kind: str) -> list[Path]:
    """The run's `state` or `model` files, oldest first (by step, not by file time)."""
    found = [
        p
        for p in (Path(run_dir) / CHECKPOINTS).glob(f"{kind}-*.pt")
        if (m := _NAME.fullmatch(p.name)) and m[1] == kind
    ]
    return sorted(found, key=file_step)


def file_step(path: str | os.PathLike) -> int:
    match = _NAME.fullmatch(Path(path).name)
    return int(match[2]) if match else -1


class CheckpointManager:
    """Writes, prunes and finds a run folder's training states and model snapshots.

    Itself a stateful part of the trainer: its index of kept snapshots (step, score) is
    saved inside every training state, so a resumed run prunes exactly as an uninterrupted
    one. Scores are the validation `best_metric`; `higher_is_better` orders them.
    """

    def __init__(
        self,
        run_dir: Path,
        keep_last: int,
        keep_best: int,
        higher_is_better: bool,
        branch_point: int | None = None,
    ):
        self.run_dir = Path(run_dir)
        self.keep_last, self.keep_best = keep_last, keep_best
        self.higher_is_better = higher_is_better
        self.branch_point = branch_point  # the state of this step is kept too
        self.index: list[dict[str, Any]] = []  # kept snapshots, by step

    def state_dict(self) -> dict[str, Any]:
        return {"snapshots": [dict(s) for s in self.index]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Take the index of a resumed state; snapshots written after that state (the run
        will write them again, identically) and those it had pruned are removed."""
        self.index = [dict(s) for s in state["snapshots"]]
        kept = {s["step"] for s in self.index}
        for path in list_files(self.run_dir, "model"):
            if file_step(path) not in kept:
                path.unlink(missing_ok=True)
        self.index = [s for s in self.index if self.path("model", s["step"]).exists()]

    def path(self, kind: str, step: int) -> Path:
        return checkpoint_path(self.run_dir, kind, step)

    def adopt_snapshots(self, source_run_dir: Path, index: dict[str, Any]) -> list[int]:
        """Bring the snapshots of another run's index into this run folder, so a branch
        averages and prunes as that run would have: hard links (a snapshot is never
        rewritten), copies across file systems; what this folder held at those steps is
        replaced. Returns the steps whose files the source no longer has."""
        missing = []
        for entry in index["snapshots"]:
            source = checkpoint_path(source_run_dir, "model", entry["step"])
            target = self.path("model", entry["step"])
            if not source.exists():
                missing.append(entry["step"])
                continue
            target.parent.mkdir(parents=True, exist_ok=True)
            tmp = target.with_name(f".{target.name}.{os.getpid()}.tmp")
            try:
                os.link(source, tmp)
            except OSError:
                atomic_write(target, source.read_bytes())
            else:
                os.replace(tmp, target)
        return missing

    def snapshot(self, step: int, meta: dict[str, Any], model: dict, score: float | None) -> Path:
        """Write the model of `step` for averaging, then prune the snapshots."""
        path = atomic_save(
            {"format": SNAPSHOT_FORMAT, **meta, "step": step, "score": score, "model": model},
            self.path("model", step),
        )
        self.index = [s for s in self.index if s["step"] != step]
        self.index.append({"step": step, "score": score})
        self.index.sort(key=lambda s: s["step"])
        keep = {s["step"] for s in self.index[-self.keep_last :]}
        keep |= {s["step"] for s in self.best(self.keep_best)}
        for dropped in [s for s in self.index if s["step"] not in keep]:
            self.path("model", dropped["step"]).unlink(missing_ok=True)
        self.index = [s for s in self.index if s["step"] in keep]
        return path

    def best(self, n: int) -> list[dict[str, Any]]:
        """The n best scored snapshots, best first (earlier step on a tie)."""
        scored = [s for s in self.index if s["score"] is not None and math.isfinite(s["score"])]
        sign = -1.0 if self.higher_is_better else 1.0
        return sorted(scored, key=lambda s: (sign * s["score"], s["step"]))[:n]

    def save_state(self, step: int, state: dict[str, Any]) -> Path:
        """Write the training state of `step` (with this manager's index) and keep the
        newest KEEP_STATES, and the one at `branch_point` (the cooldown's start)."""
        path = atomic_save(
            {"format": STATE_FORMAT, **state, "checkpoints": self.state_dict()},
            self.path("state", step),
        )
        for old in list_files(self.run_dir, "state")[:-KEEP_STATES]:
            if file_step(old) != self.branch_point:
                old.unlink(missing_ok=True)
        return path

    def load_latest(self) -> tuple[Path, dict] | None:
        """The newest readable training state, or None if there is none.

        A newer file that cannot be read (damaged by a disk fault, not by a kill: saves are
        atomic) is named in a warning and skipped for the one before. If none can be read,
        that is an error: starting over would silently throw the run away.
        """
        paths = list_files(self.run_dir, "state")
        for path in reversed(paths):
            try:
                return path, load_typed(path, STATE_FORMAT, mmap=True)
            except CheckpointError as err:
                log.warning("skipping %s: %s; trying the one before", path.name, err)
        if paths:
            raise CheckpointError(
                f"{paths[-1]}: unreadable, as the {len(paths) - 1} training state(s) before it "
                "(see the warnings): move them away, or start over with --reset"
            )
        return None

    def remove_partial_writes(self) -> None:
        """Temporary files of saves that a kill interrupted (never trusted, only in the way)."""
        for tmp in (self.run_dir / CHECKPOINTS).glob(".*.tmp"):
            tmp.unlink(missing_ok=True)


def select_snapshots(
    run_dir: str | os.PathLike, select: str, n: int, max_step: int | None = None
) -> list[Path]:
    """The snapshots to average, oldest first: the last `n` (select='last') or the `n` best
    by their validation score ('best'), among those of step <= max_step. Fewer than `n` is
    an error: an average of fewer models is not the one asked for."""
    paths = [
        p for p in list_files(run_dir, "model") if max_step is None or file_step(p) <= max_step
    ]
    if select == "best":
        metas = {p: load_typed(p, SNAPSHOT_FORMAT, mmap=True) for p in paths}
        scored = [p for p in paths if metas[p]["score"] is not None]
        sign = {p: -1.0 if metas[p].get("higher_is_better") else 1.0 for p in scored}
        paths = sorted(
            sorted(scored, key=lambda p: (sign[p] * metas[p]["score"], file_step(p)))[:n],
            key=file_step,
        )
    chosen = paths[-n:]
    if len(chosen) < n:
        names = ", ".join(p.name for p in paths) or "none"
        raise CheckpointError(
            f"{Path(run_dir) / CHECKPOINTS}: {len(chosen)} {select} snapshot(s) ({names}), "
            f"{n} to average (average.last_n): train longer or average fewer"
        )
    return chosen


# --------------------------------------------------------------------------- resuming


def resume_differences(saved_params: dict[str, Any], params: dict[str, Any]) -> list[str]:
    """'model.d_model: 64 in checkpoint, 128 now' for each identity-bearing key of the model
    and train sections that differs: the operational ones (config.operational) may change.
    A key the checkpoint lacks (added to the code since) counts at its default, the
    behaviour the saved run had: a new key at its default refuses no old run."""
    relevant = ("model.", "train.")
    ignore = operational_keys()
    defaults = flatten({"model": to_dict(ModelConfig()), "train": to_dict(TrainConfig())})
    saved, new = flatten(saved_params), flatten(params)
    old = {key: saved.get(key, defaults.get(key, "<absent>")) for key in saved.keys() | new.keys()}
    return [
        f"{key}: {old[key]!r} in checkpoint, {new.get(key, '<absent>')!r} now"
        for key in sorted(old)
        if key.startswith(relevant) and key not in ignore and old[key] != new.get(key, "<absent>")
    ]


# --------------------------------------------------------------------------- RNG states


class RankRNG:
    """Every rank's random generators, as a stateful part of the trainer: `state_dict()` is
    a collective that gathers each rank's state, `load_state_dict` restores this rank's."""

    def __init__(self, rank: int):
        self.rank = rank

    def state_dict(self) -> list[dict[str, Any]]:
        return all_gather_objects(rng_state())

    def load_state_dict(self, states: list[dict[str, Any]]) -> None:
        if self.rank < len(states):
            set_rng_state(states[self.rank])
        else:
            log.warning("no saved RNG state for rank %d: a fresh dropout stream", self.rank)


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


def describe_run(run_dir: str | os.PathLike) -> dict[str, Any]:
    """Where a run folder's training stands: the step of its newest state, whether early
    stopping ended it, and its snapshots ([step, score], by step)."""
    found = CheckpointManager(Path(run_dir), 0, 0, False).load_latest()
    if found is None:
        raise CheckpointError(f"{Path(run_dir) / CHECKPOINTS}: no training state")
    _, state = found
    patience = state["params"]["train"]["patience"]
    return {
        "step": state["progress"]["step"],
        "stopped_early": patience > 0 and state["early_stopping"]["bad"] >= patience,
        "snapshots": [[s["step"], s["score"]] for s in state["checkpoints"]["snapshots"]],
    }
