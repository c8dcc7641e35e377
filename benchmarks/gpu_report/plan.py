"""What a plan is: its sections in order, each run here or in a process of its own under a
time limit, its sizes (on a GPU, on a CPU, toy), its targets; and the model configs that
the sections name."""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]  # the checkout: params/, tests/, .baseline/
TINY = [
    "model.n_layers=1",
    "model.d_model=32",
    "model.d_ff=64",
    "model.n_heads=2",
    "vocab.size=64",
    "train.batch_tokens=256",
    "train.max_tokens=256",
]
CONFIGS = {  # name: (params file, overrides)
    "base": ("params/base.yaml", []),
    "big": ("params/big.yaml", []),
    # the same params under torch.compile (dynamic shapes): measured beside them, the
    # params' default left to what the numbers say
    "base compile": ("params/base.yaml", ["train.compile=true"]),
    "big compile": ("params/big.yaml", ["train.compile=true"]),
    "smoke": ("params/smoke.yaml", []),
    "tiny": ("params/smoke.yaml", TINY),
}


def config(name: str, *extra: str, root: Path = ROOT):
    """CONFIGS[name]'s params, as the tree at `root` loads them."""
    # Imported here: a process that measures the base commit has that tree's transformer
    # (tree.py), and everything it imports at its top must load there too.
    from transformer.config import load_params

    path, overrides = CONFIGS[name]
    return load_params(root / path, [*overrides, *extra])


@dataclass(frozen=True)
class Section:
    title: str
    run: str  # "module:function" in this package, imported when it runs (tree.py says why)
    limit: float | None = None  # seconds in a process of its own, then killed; None: here
    before: bool = False  # measures the base commit's tree (--baseline), in its own process

    def function(self) -> Callable:
        """What runs it, its module imported now (tree.py says why not before)."""
        module, name = self.run.split(":")
        return getattr(importlib.import_module(f"benchmarks.gpu_report.{module}"), name)


@dataclass(frozen=True)
class Plan:
    name: str
    title: str  # of report.md
    sections: tuple[Section, ...]
    sizes: dict[str, Any]  # "gpu", "cpu", "tiny": what each section measures, at that scale
    budget: float  # seconds, the default --budget
    targets: Callable[[dict, str, Any], list[dict]]  # (sections, device name, sizes)
    summary: Callable[[dict, Any], dict[str, list[dict]]] | None = None  # tables after them

    def section(self, title: str) -> Section:
        return next(s for s in self.sections if s.title == title)
