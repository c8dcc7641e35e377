"""benchmarks/gpu_report.py on toy sizes on the CPU: every section runs its code, so the
report a GPU machine makes cannot rot between the times one is lent."""

from __future__ import annotations

import ctypes
import dataclasses
import importlib.util
import json
import os
import re
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
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
SECTIONS = [
    "environment",
    "gpu tests",
    "train step",
    "train loop",
    "decode",
    "bf16 vs fp32",
    "checkpoint",
    "profile",
    "train loop, compiled",
]


def report(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    cmd = [sys.executable, str(ROOT / "benchmarks" / "gpu_report.py"), *args]
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)


def as_on_gpu_image(folder: Path) -> dict:
    """An environment in which NOT_ON_GPU_IMAGE cannot be imported, by the report and by
    every Python process it starts (a sitecustomize module on PYTHONPATH)."""
    (folder / "sitecustomize.py").write_text(BLOCKER.format(blocked=set(NOT_ON_GPU_IMAGE)))
    path = os.pathsep.join(filter(None, [str(folder), os.environ.get("PYTHONPATH")]))
    return dict(os.environ, PYTHONPATH=path)


@pytest.fixture(scope="module")
def tiny_report(tmp_path_factory) -> tuple[Path, str]:
    """The report folder of one `--device cpu --tiny` run, and what the run printed, run
    without the packages that the GPU machines' image lacks."""
    out = tmp_path_factory.mktemp("gpu_report") / "report"
    env = as_on_gpu_image(tmp_path_factory.mktemp("gpu_image"))
    done = report("--device", "cpu", "--tiny", "--out", str(out), env=env)
    assert done.returncode == 0, done.stdout + done.stderr
    return out, done.stdout


def test_the_tiny_cpu_report_writes_every_section(tiny_report):
    out, printed = tiny_report
    assert printed.strip().splitlines()[-1] == str(out)  # it names its folder
    data = json.loads((out / "report.json").read_text())
    markdown = (out / "report.md").read_text()
    assert list(data["sections"]) == SECTIONS
    for title, section in data["sections"].items():
        # A missing package or device feature is a skip, never a failure of the report.
        ok = section["status"] == "ok" or section["status"].startswith("skipped: ")
        assert ok, (title, section.get("traceback") or section["status"])
        assert f"\n## {title}\n" in markdown
    assert [t["result"] for t in data["targets"]] == (
        ["not measured (see its section)"] * 3 + ["not judged: --tiny sizes"] * 2
    )
    assert data["command"].endswith(f"--device cpu --tiny --out {out}")  # beside its figures
    assert data["complete"] and "Unfinished" not in markdown
    assert not list(out.glob(".work-*"))  # its temporary files are gone


def test_each_section_measures_what_it_names(tiny_report):
    sections = json.loads((tiny_report[0] / "report.json").read_text())["sections"]
    versions = {r["item"]: r["value"] for r in sections["environment"]["tables"]["versions"]}
    assert versions["host CPU"] not in ("", "unknown")  # host-bound decoding follows it
    backends = sections["environment"]["tables"]["attention backends"]
    assert len({r["call"] for r in backends}) == 4
    ran = [r for r in backends if "status" not in r]  # math at least, for every call kind
    assert {r["backend"] for r in ran} >= {"math"} and all(r["diff vs math"] < 1e-3 for r in ran)
    steps = sections["train step"]["tables"][""]
    assert {"ours", "torch.nn.Transformer"} <= {r["model"] for r in steps}
    assert all(r["tgt_tok/s"] > 0 for r in steps if "status" not in r)
    assert sections["train loop"]["tables"][""][0]["tgt tok/s"] > 0
    decode = {r["search"]: r for r in sections["decode"]["tables"][""]}
    assert decode["beam 4, ours"]["sent/s"] > 0
    (wide,) = [r for k, r in decode.items() if k.endswith("-token batches")]  # 4x the params'
    assert wide["tok/s"] > 0 and wide["sentences"] == decode["beam 4, ours"]["sentences"]
    assert decode["beam 4, MarianMTModel (transformers)"]["sent/s"] > 0  # the GPU's peer
    assert sections["checkpoint"]["tables"][""][0]["GB"] > 0
    profiled = sections["profile"]["tables"]
    assert [r["work"] for r in profiled["summary"]] == ["train tiny 256", "beam tiny 8"]
    assert all(r["wall ms"] > 0 and r["aten ops"] > 0 for r in profiled["summary"])
    # torch's products, or oneDNN's where a CPU has AVX-512 (transformer/kernels.py)
    products = {"aten::mm", "aten::addmm", "mkldnn::_linear_pointwise"}
    assert products & {r["op"] for r in profiled["ops, train tiny 256"]}
    assert any(r["op"].startswith("aten::") for r in profiled["ops, beam tiny 8"])
    assert sections["bf16 vs fp32"]["notes"][0].startswith(("agree", "DISAGREE"))
    (counts,) = sections["gpu tests"]["tables"]["counts"]  # every gpu test module imports
    assert counts["failed"] == counts["error"] == 0 and sum(counts.values()) > 0


def test_the_report_runs_where_the_gpu_image_lacks_packages(tmp_path):
    """The tiny report's environment really hides them and this project's installation
    (else it proves nothing)."""
    env = as_on_gpu_image(tmp_path)
    for name in NOT_ON_GPU_IMAGE:
        done = subprocess.run([sys.executable, "-c", f"import {name}"], env=env, cwd=ROOT,
                              capture_output=True, text=True)  # fmt: skip
        assert done.returncode == 1 and f"{name}: not on the GPU image" in done.stderr
    done = subprocess.run([sys.executable, "-c", "import transformer"], env=env, cwd=tmp_path,
                          capture_output=True, text=True)  # fmt: skip
    assert done.returncode == 1 and "No module named 'transformer'" in done.stderr


def test_only_runs_the_sections_it_names(tmp_path):
    """What a short lease uses to give one section (the compiled loop, say) all its time."""
    out = tmp_path / "report"
    done = report("--device", "cpu", "--tiny", "--out", str(out), "--only", "checkpoint")
    assert done.returncode == 0, done.stdout + done.stderr
    data = json.loads((out / "report.json").read_text())
    assert list(data["sections"]) == ["checkpoint"] and data["complete"]
    assert data["sections"]["checkpoint"]["tables"][""][0]["GB"] > 0
    assert {t["result"] for t in data["targets"]} <= {"not measured (see its section)",
                                                      "not judged: --tiny sizes"}  # fmt: skip
    done = report("--device", "cpu", "--only", "train loop compiled")  # the comma is missing
    assert done.returncode == 2 and "invalid choice: 'train loop compiled'" in done.stderr


@pytest.mark.skipif(torch.cuda.is_available(), reason="asks for a CUDA device that is absent")
def test_asking_for_an_absent_gpu_is_a_usage_error():
    done = report("--device", "cuda")
    assert done.returncode == 2 and "--device cuda: no CUDA device" in done.stderr


def test_a_report_stopped_from_outside_keeps_the_sections_it_finished(tmp_path):
    """As the GPU machine's time limit stops it: killed once its first section is done."""
    out = tmp_path / "report"
    cmd = [sys.executable, str(ROOT / "benchmarks" / "gpu_report.py"), "--device", "cpu",
           "--tiny", "--out", str(out)]  # fmt: skip
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, text=True)
    try:
        first = proc.stdout.readline()
        assert first.startswith("environment: "), first
    finally:
        proc.kill()
        proc.wait()
    data = json.loads((out / "report.json").read_text())
    assert list(data["sections"]) == ["environment"] and not data["complete"]
    assert data["sections"]["environment"]["status"] == "ok"
    assert "Unfinished" in (out / "report.md").read_text()


@pytest.fixture
def gpu_report(monkeypatch):
    """benchmarks/gpu_report.py imported in this process."""
    spec = importlib.util.spec_from_file_location("gpu_report", ROOT / "benchmarks/gpu_report.py")
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "gpu_report", module)  # its dataclasses look there
    monkeypatch.setattr(sys, "path", list(sys.path))  # it puts benchmarks/ on the path
    spec.loader.exec_module(module)
    return module


def test_every_gpu_test_is_in_the_module_the_report_runs(gpu_report):
    """The report runs `pytest -m gpu` on one module (the others import what a GPU image
    lacks): a test marked gpu anywhere else would never run there."""
    marks = re.compile(r"^\s*(@pytest\.mark\.gpu\b|pytestmark\s*=.*\bmark\.gpu\b)", re.M)
    marked = [p.name for p in (ROOT / "tests").glob("test_*.py") if marks.search(p.read_text())]
    assert marked == [Path(gpu_report.GPU_TESTS).name]


def test_the_default_attention_row_lifts_the_restriction_and_only_it(gpu_report):
    """The "torch default attention" decode row runs beam search without search.py's
    sdpa_kernel restriction (which the search enters itself); the rows after it keep it."""
    from transformer import search

    cuda = torch.device("cuda")  # attention_context restricts on CUDA only
    lifted = gpu_report.unrestricted(lambda: type(search.attention_context(cuda)).__name__)
    assert lifted == "nullcontext"
    assert type(search.attention_context(cuda)).__name__ != "nullcontext"


def test_ctranslate2_without_cuda_12_cublas_is_a_skipped_peer(gpu_report):
    """CTranslate2's wheels load libcublas.so.12; beside CUDA 13 that is a skip that says
    so, not a failure."""
    try:
        ctypes.CDLL("libcublas.so.12")
        pytest.skip("this machine has libcublas.so.12")
    except OSError:
        pass
    row = gpu_report.peer({"search": "beam 4, CTranslate2"}, gpu_report.needs_cublas12)
    assert row["status"].startswith("skipped: CTranslate2 ")
    assert "loads libcublas.so.12 (CUDA 12)" in row["status"]


def test_a_faster_backend_that_is_wrong_is_not_admitted(gpu_report):
    """cuDNN measured faster at every call kind is admitted only if its outputs and
    gradients match the math backend's; a NaN among them counts as wrong."""
    run = SimpleNamespace(device=torch.device("cuda"))
    kinds = (gpu_report.ENCODER, gpu_report.CAUSAL, gpu_report.CROSS, gpu_report.BEAM)

    def rows(cudnn_diff: float) -> list[dict]:
        def row(kind, backend, ms, diff):
            times = {"ms at shape": {"s": ms}, "first calls ms": ms, "new shapes": 3}
            ours = backend == "flash"
            return {"call": kind, "backend": backend, "ours": ours, **times, "diff vs math": diff}

        return [
            r for k in kinds for r in (row(k, "flash", 2.0, 0.0), row(k, "cuDNN", 1.0, cudnn_diff))
        ]

    assert gpu_report.verdict(rows(0.01), run)[-1].startswith("cuDNN is faster at every")
    assert gpu_report.verdict(rows(float("inf")), run)[-1].startswith("keep attention.CUDA_BACK")


def test_a_config_that_fails_keeps_the_other_configs_rows(gpu_report, monkeypatch, tmp_path):
    """Big out of memory, say, in the train loop or in decoding: its row says so, and the
    rows measured before and after it stay."""
    plan = dataclasses.replace(
        gpu_report.TINY_PLAN,
        loop_cases=(("base", 1), ("big", 1), ("smoke", 1)),
        decode_cases=(("base", "cpu", 1), ("big", "cpu", 1)),
    )
    run = gpu_report.Run(torch.device("cpu"), plan, tmp_path, budget=600.0, threads=1)

    def fails_for_big(run, name, *args):
        if name == "big":
            raise torch.OutOfMemoryError("CUDA out of memory")
        return {"tgt tok/s": 1.0}

    monkeypatch.setattr(gpu_report, "loop_case", fails_for_big)
    rows = gpu_report.train_loop(run).tables[""]
    assert [r["config"] for r in rows] == ["base", "big", "smoke"]
    assert "out of memory" in rows[1]["status"] and rows[0]["tgt tok/s"] == rows[2]["tgt tok/s"]
    ours = {"search": "beam 4, ours", "sent/s": 1.0}

    def decode_case(run, name, *args):
        fails_for_big(run, name)
        return [ours, {}, {}, {}, {}]  # ours, torch default attention, Marian, CT2, wider

    monkeypatch.setattr(gpu_report, "decode_case", decode_case)
    rows = gpu_report.decode(run).tables[""]
    assert rows[0] == ours and rows[-1]["config"] == "big" and "out of memory" in rows[-1]["status"]
