"""The benchmark scripts' own command lines, on toy sizes on the CPU: a refactor of the
library that breaks them fails here, not on the next GPU machine."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}


def run(script: str, *args: str) -> str:
    cmd = [sys.executable, str(ROOT / "benchmarks" / script), *args]
    done = subprocess.run(cmd, cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout


def test_model_step_measures_the_three_peers():
    out = run("model_step.py", "--configs", "smoke", "--steps", "1", "--warmup", "0",
              "--max-tokens", "128", "--device", "cpu", "--optimizer")  # fmt: skip
    assert "ours / torch.nn.Transformer = " in out
    assert "ours / MarianMTModel = " in out or "skipped: transformers" in out


def test_train_throughput_runs_the_real_loop_on_a_synthetic_corpus(tmp_path):
    out = run("train_throughput.py", "--corpus", "synthetic", "--pairs", "300", "--steps", "2",
              "--work", str(tmp_path), "--threads", "1")  # fmt: skip
    rows = [line.split() for line in out.splitlines() if line.startswith("smoke")]
    assert [r[:3] for r in rows] == [["smoke", "1", "pass"], ["smoke", "2", "passes"]]


def test_cpu_gemm_compares_the_two_libraries_on_every_shape():
    out = run("cpu_gemm.py", "--threads", "1", "--seconds", "0.01")
    rows = [line for line in out.splitlines() if " -> " in line and "GFLOP" not in line]
    assert len(rows) == 7
    assert all(float(row.split()[-1]) < 1e-3 for row in rows)  # the same product
