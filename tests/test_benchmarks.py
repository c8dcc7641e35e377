"""The benchmark scripts' own command lines, on toy sizes on the CPU: a refactor of the
library that breaks them fails here, not on the next GPU machine."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from benchmarks import model_step
from benchmarks import train_throughput as tt

ROOT = Path(__file__).resolve().parents[1]
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}


def run(module: str, *args: str) -> str:
    cmd = [sys.executable, "-m", f"benchmarks.{module}", *args]
    done = subprocess.run(cmd, cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout


def test_model_step_measures_the_three_peers():
    out = run("model_step", "--configs", "smoke", "--steps", "1", "--warmup", "0",
              "--max-tokens", "128", "--device", "cpu", "--optimizer")  # fmt: skip
    assert "ours / torch.nn.Transformer = " in out
    assert "ours / MarianMTModel = " in out or "skipped: transformers" in out


def test_a_peer_that_fails_drops_out_and_the_others_are_timed():
    """On a GPU machine a peer's own error (a library version, say) is a row's status, not
    the end of the train-step section."""

    def broken(batch):
        raise RuntimeError("no kernel for this\nsecond line")

    batches = [(torch.zeros(2, 3),)] * 3
    seconds = model_step.time_steps(
        {"ours": lambda b: None, "peer": broken}, batches, 1, torch.device("cpu")
    )
    assert seconds["peer"] == "failed: RuntimeError: no kernel for this"
    assert isinstance(seconds["ours"], float)


@pytest.mark.slow  # a real training loop; the other benchmarks stay
def test_train_throughput_runs_the_real_loop_on_a_synthetic_corpus(tmp_path):
    out = run("train_throughput", "--corpus", "synthetic", "--pairs", "300", "--steps", "2",
              "--work", str(tmp_path), "--threads", "1")  # fmt: skip
    rows = [line.split() for line in out.splitlines() if line.startswith("smoke")]
    assert [r[:3] for r in rows] == [["smoke", "1", "pass"], ["smoke", "2", "passes"]]


def test_a_case_out_of_time_says_how_far_it_got(tmp_path, capsys):
    """The GPU report's torch.compile cases have run out of time before: the row then says
    how many updates were done, how slow the first (compiling) window was, and how often
    torch recompiled, from what the killed process had written."""
    recorder = tt.Recorder()
    recorder.log({"train/step_time": 2.5, "train/tokens_per_update": 9.0}, step=10)
    recorder.log({"valid/loss": 1.0}, step=20)  # not a training window
    recorder.log({"train/step_time": 0.05, "train/tokens_per_update": 9.0}, step=20)
    stderr = capsys.readouterr().err + "V1126 [0/1] [__recompiles] Recompiling function fwd\n"
    assert tt.progress(stderr.encode()) == (  # bytes: what subprocess's timeout error holds
        "20 updates done, 2.50 s per update in the first logging window, 0.050 s in the "
        "last; 1 recompilation(s) logged"
    )
    # A real case killed before its first window (a hundredth of a second: still importing).
    with pytest.raises(RuntimeError, match=r"did not finish in 0 s: no logging window ended"):
        tt.measure("smoke", "params/smoke.yaml", ["train.compile=true"], tmp_path, 2, tmp_path,
                   timeout=0.01)  # fmt: skip


def test_cpu_gemm_compares_the_two_libraries_on_every_shape():
    out = run("cpu_gemm", "--threads", "1", "--seconds", "0.01")
    rows = [line for line in out.splitlines() if " -> " in line and "GFLOP" not in line]
    assert len(rows) == 7
    assert all(float(row.split()[-1]) < 1e-3 for row in rows)  # the same product
