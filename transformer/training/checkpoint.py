"""The checkpoints of a run folder: its training states and model snapshots, the resume
policy, every rank's RNG. The files are model_file.py's: plain dicts of tensors and JSON-able
values, loaded with weights_only.

A run folder holds, under `checkpoints/`:

    state-NNNNNNN.pt   everything resuming needs (model, optimizer, schedule, sampler, every
                       rank's RNG, progress, early stopping): the newest KEEP_STATES of the
                       `save_every` cadence, the one at the lr cooldown's start, where more
                       cooldowns branch off, and the newest if a stop wrote it off the
                       cadence (until the next one on it: a stopped and resumed run ends
                       with the files of an uninterrupted one)
    model-NNNNNNN.pt   model-only snapshots with their step and validation score, for
                       averaging: the last `keep_last` and the `keep_best` best

so the disk a run needs is bounded: for big (213M parameters) two 2.6 GB states and
0.9 GB a snapshot, not 2.6 GB for each of the 20 checkpoints it averages.
"""

from __future__ import annotations

import logging
import math
import os
import random
import re
from pathlib import Path
from typing import Any

import numpy as np
import torch

from transformer.config import ModelConfig, TrainConfig, flatten, operational_keys, to_dict
from transformer.files import CHECKPOINTS, atomic_write
from transformer.model_file import CheckpointError, atomic_save, load_typed
from transformer.training.distributed import all_gather_objects
from transformer.training.lifecycle import whole_save

STATE_FORMAT = "transformer-mt/state/1"
SNAPSHOT_FORMAT = "transformer-mt/snapshot/1"
SNAPSHOT_FIELDS = {"step": int, "params": dict, "data_fingerprint": str, "model": dict}
KEEP_STATES = 2  # the newest training state, and one to fall back on if it is unreadable
_NAME = re.compile(r"(state|model)-(\d{7})\.pt")

log = logging.getLogger(__name__)


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
        save_every: int = 1,
        last_step: int | None = None,
    ):
        self.run_dir = Path(run_dir)
        self.keep_last, self.keep_best = keep_last, keep_best
        self.higher_is_better = higher_is_better
        self.branch_point = branch_point  # the state of this step is kept too
        self.save_every, self.last_step = save_every, last_step  # what the cadence saves
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
        with whole_save():
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
        newest KEEP_STATES on the cadence, the one at `branch_point` (the cooldown's start)
        and the newest of all (a stop's, off the cadence, until a newer one is written)."""
        with whole_save():
            path = atomic_save(
                {"format": STATE_FORMAT, **state, "checkpoints": self.state_dict()},
                self.path("state", step),
            )
        states = list_files(self.run_dir, "state")
        on_cadence = [p for p in states if self.on_cadence(file_step(p))]
        keep = {states[-1], *on_cadence[-KEEP_STATES:]}
        for old in states:
            if old not in keep and file_step(old) != self.branch_point:
                old.unlink(missing_ok=True)
        return path

    def on_cadence(self, step: int) -> bool:
        """Whether an uninterrupted run saves the state of `step` too (a stop's does not)."""
        return step % self.save_every == 0 or step in (self.branch_point, self.last_step)

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
        metas = {p: load_typed(p, SNAPSHOT_FORMAT, True, SNAPSHOT_FIELDS) for p in paths}
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
