"""benchmarks/gpu_proof.py on toy sizes on the CPU: every phase runs its code, in its own
process, as on the GPU machine (without the packages its image lacks), so that the one GPU
run a lease allows runs right the first time."""

from __future__ import annotations

import importlib.util
import json
import math
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from test_gpu_report import as_on_gpu_image

ROOT = Path(__file__).resolve().parents[1]
PHASES = ["environment", "eager-before", "eager-after", "compile", "cuda-graphs", "real-loop",
          "beam"]  # fmt: skip


def proof(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    cmd = [sys.executable, str(ROOT / "benchmarks" / "gpu_proof.py"), *args]
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)


def records(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "proof.jsonl").read_text().splitlines()]


def baseline(folder: Path) -> Path:
    """A tree as `make gpu-baseline` writes one (a copy of this one: no git needed)."""
    skip = shutil.ignore_patterns("__pycache__", "results")
    for name in ("transformer", "benchmarks", "params"):
        shutil.copytree(ROOT / name, folder / name, ignore=skip)
    (folder / "COMMIT").write_text("a-copy\n")
    return folder


@pytest.fixture(scope="module")
def tiny_proof(tmp_path_factory) -> tuple[Path, list[dict], str]:
    """One `--device cpu --tiny` run without the GPU image's missing packages: its folder,
    its records and what it printed."""
    tmp = tmp_path_factory.mktemp("gpu_proof")
    (tmp / "image").mkdir()
    env = as_on_gpu_image(tmp / "image")
    out, tree = tmp / "proof", baseline(tmp / "baseline")
    done = proof("--device", "cpu", "--tiny", "--out", str(out), "--baseline", str(tree), env=env)
    assert done.returncode == 0, done.stdout + done.stderr
    return out, records(out), done.stdout


def test_every_phase_runs_once_and_records_its_rows(tiny_proof):
    out, found, printed = tiny_proof
    assert [r["phase"] for r in found] == PHASES  # one JSONL record a phase, in order
    for r in found:
        why = r.get("traceback") or r.get("log tail") or r["status"]
        if r["phase"] == "cuda-graphs":  # the same update ran eagerly: its rows are there
            assert r["status"].startswith("skipped: CUDA graphs need a GPU"), why
        else:
            assert r["status"] == "ok", (r["phase"], why)
        assert all(r["tables"].values()) and r["tables"], r["phase"]
    markdown = (out / "report.md").read_text()
    assert all(f"\n## {phase}\n" in markdown for phase in PHASES)
    assert "Unfinished" not in markdown and "\n## Fixed shapes, target tokens/s\n" in markdown
    assert printed.strip().splitlines()[-1] == str(out)


def test_each_phase_measures_what_it_names(tiny_proof):
    out, found, _ = tiny_proof
    phase = {r["phase"]: r for r in found}
    versions = {r["item"]: r["value"] for r in phase["environment"]["tables"]["versions"]}
    assert versions["host CPU"] and versions["commit"] and "triton" in versions
    before, after = (phase[p]["tables"][""][0] for p in ("eager-before", "eager-after"))
    assert before["tree"] == "before: a-copy" and after["tree"].startswith("after: ")
    assert before["B x S x T"] == after["B x S x T"]  # the same fixed batches
    assert before["tgt tok/s"] > 0 and after["tgt tok/s"] > 0 and after["aten ops/update"] > 0
    # "before" ran the baseline's own code, "after" today's
    assert "/baseline/transformer/" in " ".join(phase["eager-before"]["notes"])
    assert f"{ROOT}/transformer/" in " ".join(phase["eager-after"]["notes"])
    (compiled,) = phase["compile"]["tables"][""]
    assert compiled["graph_breaks"] == 0 and compiled["tgt tok/s"] > 0
    graphs = phase["cuda-graphs"]["tables"][""]
    assert len(graphs[0]["B x S x T"].split()) == 2  # two shape classes
    assert all(math.isfinite(g["loss at end"]) and g["tgt tok/s"] > 0 for g in graphs)
    loop = phase["real-loop"]["tables"][""]
    assert [r["settings"] for r in loop] == ["today's", "best"]
    assert all(r["tgt tok/s"] > 0 for r in loop)
    beam = {r["search"]: r for r in phase["beam"]["tables"][""]}
    assert beam["beam 4, ours (beam)"]["sent/s"] > 0
    assert beam["beam 4, CTranslate2"]["sent/s"] > 0  # the CPU target's peer
    static = beam["beam 4, ours (beam-static)"]  # decode.py's new mode, or why it is absent
    assert static.get("sent/s", 0) > 0 or static["status"].startswith("skipped: ")
    assert "not judged: --tiny sizes" in (out / "report.md").read_text()


def test_a_phase_over_its_time_limit_is_killed_and_the_run_goes_on(tmp_path):
    out = tmp_path / "proof"
    done = proof("--device", "cpu", "--tiny", "--out", str(out), "--phases",
                 "eager-after,cuda-graphs", "--limit", "eager-after=0.5")  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    killed, graphs = records(out)
    assert killed["phase"] == "eager-after"
    assert killed["status"] == "killed: over its time limit of 0.5 s" and "log tail" in killed
    assert graphs["phase"] == "cuda-graphs" and graphs["tables"][""]
    markdown = (out / "report.md").read_text()
    assert "killed: over its time limit" in markdown and "\n## cuda-graphs\n" in markdown


@pytest.mark.parametrize(
    "args, status",
    [
        (["--phases", "environment", "--budget", "0"], "skipped: the time budget is spent"),
        (["--phases", "eager-before", "--baseline", "nowhere"], "skipped: no baseline tree in"),
    ],
)
def test_a_phase_that_cannot_run_is_skipped_saying_why(tmp_path, args, status):
    out = tmp_path / "proof"
    done = proof("--device", "cpu", "--tiny", "--out", str(out), *args)
    assert done.returncode == 0, done.stdout + done.stderr
    (record,) = records(out)
    assert record["status"].startswith(status) and record["seconds"] == 0.0


@pytest.fixture
def gpu_proof(monkeypatch):
    """benchmarks/gpu_proof.py imported in this process."""
    monkeypatch.setattr(sys, "path", [str(ROOT / "benchmarks"), *sys.path])
    spec = importlib.util.spec_from_file_location("gpu_proof", ROOT / "benchmarks/gpu_proof.py")
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "gpu_proof", module)  # its dataclasses look there
    spec.loader.exec_module(module)
    return module


def test_the_targets_say_which_gpu_measured_them(gpu_proof):
    loop = [{"config": "base", "settings": "today's", "tgt tok/s": 400_000.0},
            {"config": "base", "settings": "best", "tgt tok/s": 600_000.0},
            {"config": "big", "settings": "best", "tgt tok/s": 200_000.0}]  # fmt: skip
    ours, ct2 = "beam 4, ours (beam)", "beam 4, CTranslate2"
    beam = [{"config": "base", "device": "cuda", "search": ours, "sent/s": 1600.0},
            {"config": "smoke", "device": "cpu", "search": ours, "sent/s": 90.0},
            {"config": "smoke", "device": "cpu", "search": ct2, "sent/s": 100.0}]  # fmt: skip
    found = [{"phase": "real-loop", "tables": {"": loop}}, {"phase": "beam", "tables": {"": beam}}]
    h200 = gpu_proof.targets(found, "NVIDIA H200", gpu_proof.GPU)
    assert [t["result"] for t in h200] == ["pass", "FAIL", "pass", "FAIL"]
    assert h200[0]["measured by"] == "best settings" and h200[0]["measured"] == 600_000.0
    assert all(t["on"] == "NVIDIA H200: H200, not an H100" for t in h200[:3])
    h100 = gpu_proof.targets(found, "NVIDIA H100 80GB HBM3", gpu_proof.GPU)
    assert h100[0]["on"] == "NVIDIA H100 80GB HBM3" and h100[3]["measured"] == pytest.approx(0.9)
