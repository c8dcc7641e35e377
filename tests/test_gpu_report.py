"""The GPU report (python -m benchmarks.gpu_report) on toy sizes on the CPU: every section
runs its code, so the report a GPU machine makes cannot rot between the times one is lent."""

from __future__ import annotations

import ctypes
import dataclasses
import json
import re
import subprocess
import sys
import time
import warnings
from pathlib import Path

import pytest
import torch
from gpu_rehearsal import COMMAND, NOT_ON_GPU_IMAGE, ROOT, as_on_gpu_image, rehearsal

from benchmarks.gpu_report import (
    attention_backends,
    decode,
    gpu_tests,
    report,
    runner,
    train_loop,
)
from benchmarks.gpu_report.section import Ctx, peer
from transformer.decoding.beams import decoding_context

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


def run_report(*args: str) -> subprocess.CompletedProcess:
    cmd = [*COMMAND, *args]
    return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)


@pytest.fixture(scope="module")
def tiny_report(request) -> tuple[Path, str]:
    """The report folder of one `--device cpu --tiny` run, and what the run printed, run
    without the packages that the GPU machines' image lacks."""
    return rehearsal("report", request)


@pytest.mark.slow  # the whole report rehearsed on the CPU
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
    assert data["plan"] == "report" and data["sizes"] == "tiny"
    assert data["complete"] and "Unfinished" not in markdown
    assert not list(out.glob(".work-*"))  # its temporary files are gone


@pytest.mark.slow  # the rehearsal of the test above
def test_each_section_measures_what_it_names(tiny_report):
    sections = json.loads((tiny_report[0] / "report.json").read_text())["sections"]
    versions = {r["item"]: r["value"] for r in sections["environment"]["tables"]["versions"]}
    assert versions["host CPU"] not in ("", "unknown")  # host-bound decoding follows it
    (smi,) = sections["environment"]["tables"]["nvidia-smi"]  # a row per GPU, or why none
    assert smi.get("name") or smi["status"].startswith("skipped: ")
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
    # torch's products, or oneDNN's where a CPU has AVX-512 (transformer/nn/kernels.py)
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
    """What a short lease uses to give one section (the compiled loop, say) all its time;
    with --limit, in a process of its own, killed at the limit with the rows it had."""
    out = tmp_path / "report"
    done = run_report("--device", "cpu", "--tiny", "--out", str(out), "--only", "checkpoint",
                      "--limit", "checkpoint=120")  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    data = json.loads((out / "report.json").read_text())
    assert list(data["sections"]) == ["checkpoint"] and data["complete"]
    (checkpoint,) = data["sections"].values()
    assert checkpoint["tables"][""][0]["GB"] > 0 and checkpoint["limit_s"] == 120
    assert {t["result"] for t in data["targets"]} <= {"not measured (see its section)",
                                                      "not judged: --tiny sizes"}  # fmt: skip


NO_GPU = pytest.mark.skipif(torch.cuda.is_available(), reason="needs a CUDA device absent")


@pytest.mark.parametrize(
    "args, error",
    [
        (["--only", "train loop compiled"], "--only: no section 'train loop compiled' in the "
                                            "report plan"),  # the comma is missing
        (["--plan", "proof", "--limit", "decode=9"], "--limit: no section 'decode' in the proof"),
        (["--limit", "decode"], "--limit: SECTION=SECONDS, got ['decode']"),
        pytest.param(["--device", "cuda"], "--device cuda: no CUDA device", marks=NO_GPU),
    ],
)  # fmt: skip
def test_a_command_the_plan_cannot_run_is_a_usage_error(args, error, capsys):
    with pytest.raises(SystemExit) as stopped:
        runner.parse_args(args)
    assert stopped.value.code == 2 and error in capsys.readouterr().err


def test_a_report_stopped_from_outside_keeps_the_sections_it_finished(tmp_path):
    """As the GPU machine's time limit stops it: killed once its first section is done."""
    out = tmp_path / "report"
    cmd = [*COMMAND, "--device", "cpu", "--tiny", "--out", str(out)]
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


def test_every_gpu_test_is_in_the_module_the_report_runs():
    """The report runs `pytest -m gpu` on one module (the others import what a GPU image
    lacks): a test marked gpu anywhere else would never run there."""
    marks = re.compile(r"^\s*(@pytest\.mark\.gpu\b|pytestmark\s*=.*\bmark\.gpu\b)", re.M)
    marked = [p.name for p in (ROOT / "tests").glob("test_*.py") if marks.search(p.read_text())]
    assert marked == [Path(gpu_tests.GPU_TESTS).name]


def test_the_default_attention_row_lifts_the_restriction_and_only_it():
    """The "torch default attention" decode row runs beam search with
    restrict_attention=False: without the sdpa_kernel restriction the search enters itself
    (which leaves cuDNN out); by default the search keeps it."""
    cuda = torch.device("cuda")  # attention_context restricts on CUDA only; its flags are
    cudnn = torch.backends.cuda.cudnn_sdp_enabled  # process-wide, readable without a GPU
    with warnings.catch_warnings(action="ignore"):  # autocast("cuda") without a GPU warns
        with decoding_context(cuda, restrict_attention=False):
            assert cudnn()
        with decoding_context(cuda):
            assert not cudnn()
    assert cudnn()


def test_ctranslate2_without_cuda_12_cublas_is_a_skipped_peer():
    """CTranslate2's wheels load libcublas.so.12; beside CUDA 13 that is a skip that says
    so, not a failure."""
    try:
        ctypes.CDLL("libcublas.so.12")
        pytest.skip("this machine has libcublas.so.12")
    except OSError:
        pass
    row = peer({"search": "beam 4, CTranslate2"}, decode.needs_cublas12)
    assert row["status"].startswith("skipped: CTranslate2 ")
    assert "loads libcublas.so.12 (CUDA 12)" in row["status"]


def test_a_faster_backend_that_is_wrong_is_not_admitted():
    """cuDNN measured faster at every call kind is admitted only if its outputs and
    gradients match the math backend's; a NaN among them counts as wrong."""

    def rows(cudnn_diff: float) -> list[dict]:
        def row(kind, backend, ms, diff):
            times = {"ms at shape": {"s": ms}, "first calls ms": ms, "new shapes": 3}
            ours = backend == "flash"
            return {"call": kind, "backend": backend, "ours": ours, **times, "diff vs math": diff}

        return [
            r
            for k in attention_backends.KINDS
            for r in (row(k, "flash", 2.0, 0.0), row(k, "cuDNN", 1.0, cudnn_diff))
        ]

    cuda = torch.device("cuda")
    assert attention_backends.verdict(rows(0.01), cuda)[-1].startswith("cuDNN is faster at")
    assert attention_backends.verdict(rows(float("inf")), cuda)[-1].startswith("keep attention")


def test_a_config_that_fails_keeps_the_other_configs_rows(monkeypatch, tmp_path):
    """Big out of memory, say, in the train loop or in decoding: its row says so, and the
    rows measured before and after it stay."""
    sizes = dataclasses.replace(
        report.TINY,
        loop_cases=(("base", 1), ("big", 1), ("smoke", 1)),
        decode_cases=(("base", "cpu", 1), ("big", "cpu", 1)),
    )
    ctx = lambda: Ctx(torch.device("cpu"), sizes, tmp_path, time.time() + 600, ROOT, "today")

    def fails_for_big(ctx, name, *args):
        if name == "big":
            raise torch.OutOfMemoryError("CUDA out of memory")
        return {"tgt tok/s": 1.0}

    monkeypatch.setattr(train_loop, "loop_case", fails_for_big)
    loop = ctx()
    train_loop.train_loop(loop)
    rows = loop.tables[""]
    assert [r["config"] for r in rows] == ["base", "big", "smoke"]
    assert "out of memory" in rows[1]["status"] and rows[0]["tgt tok/s"] == rows[2]["tgt tok/s"]
    ours = {"search": "beam 4, ours", "sent/s": 1.0, "device": "cpu"}

    def decode_case(ctx, name, *args):
        fails_for_big(ctx, name)
        return [ours, {}, {}, {}, {}]  # ours, torch default attention, Marian, CT2, wider

    monkeypatch.setattr(decode, "decode_case", decode_case)
    beams = ctx()
    decode.decode(beams)
    rows = beams.tables[""]
    assert rows[0] == ours and rows[-1]["config"] == "big" and "out of memory" in rows[-1]["status"]
