"""The GPU report's and the GPU proof's `--device cpu --tiny` rehearsals, run as on a GPU
machine: without the packages its image lacks, the project not installed, the proof's
"before" on the base commit's tree. Both start together, the first time a test asks for
either (where the session's tests need both): each runs on one thread, so on two cores the
pair takes about the time of the longer."""

from __future__ import annotations

import atexit
import functools
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
COMMAND = [sys.executable, "-m", "benchmarks.gpu_report"]
# What the GPU machines' image lacks of this project's dependencies, beyond what `make
# gpu-wheels` carries there (pydantic, CTranslate2, sacremoses): its package list, read
# 2026-11-17 (the device tool's KINDS.md), holds torch, transformers, sentencepiece,
# pyarrow, sacrebleu, pyyaml, numpy, tqdm, matplotlib, psutil and pytest, not these. The
# report runs here with them unimportable, so that it runs there; and, as there, with this
# project not installed (the checkout is copied, not pip-installed): it finds its own code.
NOT_ON_GPU_IMAGE = ("prefect", "mlflow", "datasets", "fastapi", "sqlalchemy")
BLOCKER = """\
import importlib.abc, sys

class NotOnGpuImage(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] in {blocked!r}:
            raise ModuleNotFoundError(f"{{name}}: not on the GPU image", name=name)

editable = lambda f: "__editable__" in getattr(f, "__module__", "")  # pip install -e's hooks
sys.meta_path[:] = [NotOnGpuImage(), *(f for f in sys.meta_path if not editable(f))]
sys.path_hooks[:] = [h for h in sys.path_hooks if not editable(h)]
sys.path_importer_cache.clear()
"""
TESTS = {"report": "test_gpu_report.py", "proof": "test_gpu_proof.py"}  # what needs each


def as_on_gpu_image(folder: Path) -> dict:
    """An environment in which NOT_ON_GPU_IMAGE cannot be imported, by the report and by
    every Python process it starts (a sitecustomize module on PYTHONPATH)."""
    (folder / "sitecustomize.py").write_text(BLOCKER.format(blocked=set(NOT_ON_GPU_IMAGE)))
    path = os.pathsep.join(filter(None, [str(folder), os.environ.get("PYTHONPATH")]))
    return dict(os.environ, PYTHONPATH=path)


def baseline(folder: Path) -> Path:
    """The tree `make gpu-baseline` writes: the Makefile's BASELINE commit's transformer,
    benchmarks and params (the library's old flat layout), where git has that commit; else
    a copy of this tree."""
    commit = re.search(r"^BASELINE \?= (\S+)", (ROOT / "Makefile").read_text(), re.M)[1]
    folder.mkdir()
    archive = subprocess.run(["git", "archive", commit, "transformer", "benchmarks", "params"],
                             cwd=ROOT, capture_output=True)  # fmt: skip
    if archive.returncode == 0:
        subprocess.run(["tar", "-x", "-C", str(folder)], input=archive.stdout, check=True)
    else:
        skip = shutil.ignore_patterns("__pycache__", "results")
        for name in ("transformer", "benchmarks", "params"):
            shutil.copytree(ROOT / name, folder / name, ignore=skip)
    (folder / "COMMIT").write_text("the-base\n")
    return folder


class Rehearsal:
    """One plan's tiny run, started in the background in `folder`."""

    def __init__(self, plan: str, folder: Path):
        self.out = folder / plan
        args = ["--plan", plan, "--device", "cpu", "--tiny", "--out", str(self.out)]
        if plan == "proof":
            args += ["--baseline", str(baseline(folder / "baseline"))]
        (folder / "image").mkdir()
        self.proc = subprocess.Popen(
            [*COMMAND, *args],
            cwd=ROOT,
            env=as_on_gpu_image(folder / "image"),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        atexit.register(self.proc.kill)  # a session that ends first leaves none running

    @functools.cached_property
    def printed(self) -> str:
        stdout, stderr = self.proc.communicate(timeout=600)
        assert self.proc.returncode == 0, stdout + stderr
        return stdout


STARTED: dict[str, Rehearsal] = {}


def rehearsal(plan: str, request: pytest.FixtureRequest) -> tuple[Path, str]:
    """`plan`'s rehearsal, once it ended well: its folder and what it printed. Started now,
    with the other plan's where this session runs the tests of both."""
    if plan not in STARTED:
        ran = {item.path.name for item in request.session.items}
        tmp = request.getfixturevalue("tmp_path_factory")
        for name, tests in TESTS.items():
            if name not in STARTED and (name == plan or tests in ran):
                STARTED[name] = Rehearsal(name, tmp.mktemp(f"gpu_{name}"))
    return STARTED[plan].out, STARTED[plan].printed
