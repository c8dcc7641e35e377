"""The GPU proof (python -m benchmarks.gpu_report --plan proof) on toy sizes on the CPU:
every phase runs its code, in its own process, as on the GPU machine (without the packages
its image lacks, "before" on the base commit's tree as `make gpu-baseline` writes it), so
that the one GPU run a lease allows runs right the first time."""

from __future__ import annotations

import json
import math
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from gpu_rehearsal import COMMAND, ROOT, rehearsal

from benchmarks.gpu_report import proof, report, runner
from benchmarks.gpu_report.section import Ctx

PHASES = ["environment", "eager-before", "eager-after", "compile", "cuda-graphs", "real-loop",
          "beam"]  # fmt: skip


def run_proof(*args: str) -> subprocess.CompletedProcess:
    cmd = [*COMMAND, "--plan", "proof", *args]
    return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)


def records(out: Path) -> list[dict]:
    """The sections' records in the order they ran, each with its title as "phase"."""
    sections = json.loads((out / "report.json").read_text())["sections"]
    return [{"phase": title, **record} for title, record in sections.items()]


@pytest.fixture(scope="module")
def tiny_proof(request) -> tuple[Path, list[dict], str]:
    """One `--device cpu --tiny` run without the GPU image's missing packages: its folder,
    its records and what it printed."""
    out, printed = rehearsal("proof", request)
    return out, records(out), printed


@pytest.mark.slow  # the whole proof rehearsed: ~1 min
def test_every_phase_runs_once_and_records_its_rows(tiny_proof):
    out, found, printed = tiny_proof
    assert [r["phase"] for r in found] == PHASES  # one record a phase, in order
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


@pytest.mark.slow  # the rehearsal of the test above
def test_each_phase_measures_what_it_names(tiny_proof):
    out, found, _ = tiny_proof
    phase = {r["phase"]: r for r in found}
    versions = {r["item"]: r["value"] for r in phase["environment"]["tables"]["versions"]}
    assert versions["host CPU"] and versions["commit"] and "triton" in versions
    before, after = (phase[p]["tables"][""][0] for p in ("eager-before", "eager-after"))
    assert before["tree"] == "before: the-base" and after["tree"].startswith("after: ")
    assert before["B x S x T"] == after["B x S x T"]  # the same fixed batches
    assert before["tgt tok/s"] > 0 and after["tgt tok/s"] > 0 and after["aten ops/update"] > 0
    # "before" ran the baseline's own code, "after" today's
    assert "/baseline/transformer/" in " ".join(phase["eager-before"]["notes"])
    assert f"{ROOT}/transformer/" in " ".join(phase["eager-after"]["notes"])
    (compiled,) = phase["compile"]["tables"][""]
    assert compiled["graph_breaks"] == 0 and compiled["tgt tok/s"] > 0
    # AOTAutograd's part rehearsed too (functionalized, partitioned): inductor's input on a GPU
    assert "backend aot_eager off CUDA" in " ".join(phase["compile"]["notes"])
    graphs = phase["cuda-graphs"]["tables"][""]
    assert len(graphs[0]["B x S x T"].split()) == 2  # two shape classes
    assert all(math.isfinite(g["loss at end"]) and g["tgt tok/s"] > 0 for g in graphs)
    assert all(g["graphs / eager"] > 0 for g in graphs)  # eager on the same two batches
    notes = " ".join(phase["cuda-graphs"]["notes"])  # the rate kept before the profiler ran
    assert f"{graphs[0]['config']}, graphs: {graphs[0]['tgt tok/s']:,.0f} tgt tok/s" in notes
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
    """Killed at its limit and recorded so; one whose tree is missing is skipped saying
    so; the next one runs."""
    out = tmp_path / "proof"
    done = run_proof("--device", "cpu", "--tiny", "--out", str(out), "--only", "environment",
                     "--only", "eager-before", "--only", "eager-after", "--limit",
                     "environment=0.5", "--baseline", "nowhere")  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    killed, skipped, after = records(out)
    assert killed["phase"] == "environment"
    assert killed["status"] == "killed: over its time limit of 0.5 s" and "log tail" in killed
    assert skipped["status"].startswith("skipped: no baseline tree in")
    assert skipped["seconds"] == 0.0
    assert after["phase"] == "eager-after" and after["status"] == "ok" and after["tables"][""]
    markdown = (out / "report.md").read_text()
    assert "killed: over its time limit" in markdown and "\n## eager-after\n" in markdown


def test_a_phase_that_finished_is_not_held_by_its_teardown(tmp_path, monkeypatch):
    """A hang at interpreter exit (here an atexit handler; on a GPU, compile workers or the
    profiler's teardown) costs nothing once the phase's result is saved."""
    hang = "atexit.register(lambda: '--child' in sys.argv and time.sleep(60))"
    hang = f"import atexit, sys, time\n{hang}\n"
    (tmp_path / "sitecustomize.py").write_text(hang)  # in the phase's process only
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    out = tmp_path / "proof"
    done = run_proof("--device", "cpu", "--tiny", "--out", str(out), "--only", "environment",
                     "--limit", "environment=30")  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    (record,) = records(out)
    assert record["status"] == "ok", record  # not killed at its limit


@pytest.mark.parametrize(
    "plan, title, left",
    [(proof.PLAN, "environment", 7.0), (report.PLAN, "checkpoint", -1.0)],
)
def test_a_section_without_the_time_it_needs_is_skipped_saying_so(tmp_path, plan, title, left):
    """A proof phase needs half its limit of the budget left (environment: 15 s); a report
    section starts while any is left."""
    args = runner.parse_args(["--plan", plan.name, "--device", "cpu"])
    ctx = Ctx(torch.device("cpu"), plan.sizes["tiny"], tmp_path, time.time() + left, ROOT, "")
    record = runner.run(plan.section(title), ctx, args, plan)
    assert record["status"].startswith(f"skipped: the time budget is spent ({left:.0f} s of")
    assert record["seconds"] == 0.0


def test_what_measures_the_base_tree_imports_none_of_todays_library():
    """A process measuring the base commit has that tree's transformer (old layout) first
    on its path (benchmarks/gpu_report/tree.py): the runner and eager's module import no
    transformer module of their own, which would fail there or measure today's."""
    code = (
        "import sys\n"
        "from benchmarks.gpu_report import runner\n"
        "runner.PLANS['proof'].section('eager-before').function()\n"
        "print(sorted(m for m in sys.modules if m.partition('.')[0] == 'transformer'))"
    )
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True)
    assert done.returncode == 0 and done.stdout.strip() == "[]", done.stdout + done.stderr


def test_the_targets_say_which_gpu_measured_them():
    loop = [{"config": "base", "settings": "today's", "tgt tok/s": 400_000.0},
            {"config": "base", "settings": "best", "tgt tok/s": 600_000.0},
            {"config": "big", "settings": "best", "tgt tok/s": 200_000.0}]  # fmt: skip
    ours, ct2 = "beam 4, ours (beam)", "beam 4, CTranslate2"
    beam = [{"config": "base", "device": "cuda", "search": ours, "sent/s": 1600.0},
            {"config": "smoke", "device": "cpu", "search": ours, "sent/s": 90.0},
            {"config": "smoke", "device": "cpu", "search": ct2, "sent/s": 100.0}]  # fmt: skip
    found = {"real-loop": {"tables": {"": loop}}, "beam": {"tables": {"": beam}}}
    h200 = proof.targets(found, "NVIDIA H200", proof.GPU)
    assert [t["result"] for t in h200] == ["pass", "FAIL", "pass", "FAIL"]
    assert h200[0]["measured by"] == "best settings" and h200[0]["measured"] == 600_000.0
    assert all(t["on"] == "NVIDIA H200: H200, not an H100" for t in h200[:3])
    h100 = proof.targets(found, "NVIDIA H100 80GB HBM3", proof.GPU)
    assert h100[0]["on"] == "NVIDIA H100 80GB HBM3" and h100[3]["measured"] == pytest.approx(0.9)
