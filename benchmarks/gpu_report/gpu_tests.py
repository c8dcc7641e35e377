"""The report's gpu tests: `pytest -m gpu` in a subprocess, each test's outcome read from
its JUnit XML."""

from __future__ import annotations

import importlib.util
import os
import shlex
import subprocess
import sys
import xml.etree.ElementTree as ET
from collections import Counter
from pathlib import Path

from benchmarks.gpu_report.plan import ROOT
from benchmarks.gpu_report.section import Ctx, Skipped

# Every test marked gpu lives here (tests/test_gpu_report.py checks it). The other modules
# import prefect and mlflow, which a GPU image lacks: collected, they would be errors.
GPU_TESTS = "tests/test_gpu.py"
GPU_TESTS_S = 180.0  # at most, of the run's 480 s


def gpu_tests(ctx: Ctx) -> None:
    if importlib.util.find_spec("pytest") is None:
        raise Skipped("pytest is not installed")
    xml = ctx.work / "gpu-tests.xml"
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    if not ctx.cuda:  # the report's device only
        env["CUDA_VISIBLE_DEVICES"] = ""
    cmd = [sys.executable, "-m", "pytest", "-m", "gpu", "-q", "-p", "no:cacheprovider"]
    # A test module that cannot be imported here is counted as an error, not the end.
    cmd += ["--continue-on-collection-errors", f"--junitxml={xml}", GPU_TESTS]
    timeout = max(60.0, min(GPU_TESTS_S, ctx.left()))  # a hung test leaves the rest time
    try:
        done = subprocess.run(
            cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout
        )
    except subprocess.TimeoutExpired:
        raise RuntimeError(f"pytest did not finish in {timeout:.0f} s") from None
    if done.returncode in (2, 3, 4):  # interrupted, internal error, usage error: no results
        raise RuntimeError(f"pytest exit code {done.returncode}: {done.stdout[-500:]}")
    cases = junit_cases(xml) if xml.is_file() else []
    counts = Counter(c["outcome"] for c in cases)
    ctx.add("counts", {k: counts.get(k, 0) for k in ("passed", "failed", "error", "skipped")})
    ctx.add("tests", *cases)
    ctx.note(f"{shlex.join(['python', *cmd[1:-2], GPU_TESTS])}: exit code {done.returncode}")
    if done.returncode == 1:  # some test failed, or some module could not be collected
        ctx.note("output tail: " + (done.stdout + done.stderr)[-1500:])


def junit_cases(xml: Path) -> list[dict]:
    cases = []
    for case in ET.parse(xml).iter("testcase"):
        outcome, message = "passed", ""
        for tag in ("failure", "error", "skipped"):
            found = case.find(tag)
            if found is not None:
                outcome = "failed" if tag == "failure" else tag
                message = (found.get("message") or "").strip().split("\n")[0][:200]
                break
        name = f"{case.get('classname', '')}::{case.get('name', '')}"
        cases.append({"test": name, "outcome": outcome, "message": message})
    return cases
