"""What a section gets (Ctx: the device, the plan's sizes, a work folder, a deadline, the
tree it measures) and gives (tables of rows, notes, a status)."""

from __future__ import annotations

import json
import os
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any

import torch

from benchmarks.gpu_report import tree as trees
from benchmarks.measure import failure

MARGIN_S = 3.0  # a section stops starting new work this long before its deadline


class Skipped(Exception):
    """A whole section cannot run here; the message says why."""


@dataclass
class Ctx:
    """A section's run, and what it has measured so far. Where it runs in a process of its
    own (`result` set), each addition is saved at once: one killed at its time limit keeps
    the rows it had."""

    device: torch.device
    sizes: Any  # its plan's, at this scale
    work: Path  # temporary files, inside the report folder (its disk is the one measured)
    deadline: float  # time.time() by which it should end: its limit's, or the budget's
    tree_root: Path  # the tree measured: this checkout, or the base commit's
    tree_label: str
    best: list[str] | None = None  # --best-overrides
    result: Path | None = None
    tables: dict[str, list[dict]] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)

    @cached_property
    def tree(self) -> trees.Tree:
        return trees.load(self.tree_root, self.tree_label)

    @property
    def cuda(self) -> bool:
        return self.device.type == "cuda"

    @property
    def tiny(self) -> bool:
        return self.sizes.name == "tiny"

    @property
    def threads(self) -> int:
        """CPU threads of the processes it starts: toy models gain nothing from more (0:
        torch's default)."""
        return 1 if self.tiny else 0

    def on(self, where: str) -> torch.device:
        """A case's device: "main" is --device's, "cpu" the CPU."""
        return self.device if where == "main" else torch.device(where)

    def left(self) -> float:
        return self.deadline - time.time() - MARGIN_S

    def add(self, table: str, *rows: dict) -> None:
        self.tables.setdefault(table, []).extend(rows)
        self.save()

    def note(self, *lines: str) -> None:
        self.notes.extend(lines)
        self.save()

    def save(self, status: str = "running", trace: str | None = None) -> None:
        if self.result is not None:
            found = {"status": status, "tables": self.tables, "notes": self.notes}
            write_atomic(self.result, json.dumps({**found, "traceback": trace}, default=str))


def execute(fn: Callable[[Ctx], None], ctx: Ctx) -> tuple[str, str | None]:
    """fn(ctx); (its status, the traceback where it failed), saved with what it measured.
    A section that fails says so; the plan's other sections still run."""
    status, trace = "ok", None
    try:
        fn(ctx)
    except Skipped as why:
        status = f"skipped: {why}"
    except Exception as err:  # a 9-minute report is not lost for one section
        status, trace = failure(err)[:320], traceback.format_exc()
    ctx.save(status, trace)
    return status, trace


def peer(row: dict, measure: Callable[[], dict]) -> dict:
    """`row` with `measure()`'s figures, or with a `status` saying why there are none: a
    missing package, or a failure of this peer (the section goes on without it)."""
    try:
        return {**row, **measure()}
    except ImportError as err:
        return {**row, "status": f"skipped: {err.name or err} not installed"}
    except Skipped as why:
        return {**row, "status": f"skipped: {why}"}
    except Exception as err:  # a peer's failure is a finding, not the end of the section
        return {**row, "status": failure(err)}


def write_atomic(path: Path, text: str) -> None:
    """`path` replaced whole: a reader never sees it half-written."""
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)
