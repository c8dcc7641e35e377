"""The library a section measures: this checkout's, or the base commit's tree (.baseline/,
which `make gpu-baseline` writes), the "before" of the proof's figures.

The base tree has the library's old flat layout (transformer/model.py, not
transformer/nn/model.py), which this package's modules do not import. So a section that
measures it runs in a process of its own whose working directory is that tree
(process.py): its `transformer` comes first on sys.path, and none of this checkout's can be
imported there by mistake. It reaches the library through the tree's own
benchmarks/model_step.py, which both layouts have with the same functions (build,
make_step, wmt_like_batches, step_flops) and the same imported names (Transformer,
build_optimizer, attention_context). So the runner, the modules it imports and
fixed_shapes.py import no transformer module at their top (tests/test_gpu_proof.py checks).
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

from benchmarks.gpu_report.plan import ROOT, config

TODAY = "after: today's tree"


@dataclass(frozen=True)
class Tree:
    label: str  # "after: today's tree" or "before: <commit>"
    root: Path
    model_step: ModuleType

    def config(self, name: str, *extra: str):
        return config(name, *extra, root=self.root)

    @property
    def library(self) -> str:
        """Where its transformer package was loaded from: the proof's evidence of which."""
        return sys.modules["transformer"].__file__


def load(root: Path, label: str) -> Tree:
    if root == ROOT:
        return Tree(label, root, importlib.import_module("benchmarks.model_step"))
    return Tree(label, root, from_file(root / "benchmarks" / "model_step.py"))


def from_file(path: Path) -> ModuleType:
    """The module at `path`, under a name of its own (not this checkout's model_step)."""
    spec = importlib.util.spec_from_file_location("base_model_step", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # where its classes say they live
    spec.loader.exec_module(module)
    return module


def label(root: Path) -> str:
    """ "before: <the base commit>", as `make gpu-baseline` wrote it into the tree."""
    commit = root / "COMMIT"
    return f"before: {commit.read_text().strip() if commit.is_file() else root}"
