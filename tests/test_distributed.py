"""Ranks come from the environment; two ranks under torchrun make the same updates as one
process accumulating the same two micro-batches."""

from __future__ import annotations

import functools
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import assert_same_training, assert_same_updates

from transformer import model_file
from transformer.config import ModelConfig
from transformer.nn.model import Transformer
from transformer.training import checkpoint as ckpt
from transformer.training.distributed import (
    DistEnv,
    all_gather_objects,
    all_reduce_sum,
    distribute,
    init_distributed,
)

ROOT = Path(__file__).resolve().parents[1]
# 2 CPU ranks (gloo) on any host: on a CUDA host with one GPU, rank 1 would ask for cuda:1.
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "CUDA_VISIBLE_DEVICES": ""}
# Dropout 0: the ranks' dropout streams differ from the single process's.
SAME_UPDATES = [
    "model.dropout=0.0",
    "train.max_steps=3",
    "train.save_every=3",
    "train.valid_every=3",
    "train.log_every=1",
]


def test_one_process_without_torchrun(monkeypatch):
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(var, raising=False)
    env = init_distributed()
    assert (env.rank, env.world_size, env.is_main, env.distributed) == (0, 1, True, False)
    assert env.device.type == ("cuda" if torch.cuda.is_available() else "cpu")
    assert all_reduce_sum(torch.tensor([2.0])).item() == 2.0  # collectives are no-ops
    assert all_gather_objects({"a": 1}) == [{"a": 1}]


def _train(out: Path, params: Path, shards: Path, launcher: list[str], *extra: str) -> str:
    cmd = [
        *launcher,
        "-m",
        "transformer.train",
        str(params),
        "--data",
        str(shards),
        "--out",
        str(out),
        *SAME_UPDATES,
        *extra,
    ]
    done = subprocess.run(cmd, env=ENV, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout


def test_two_ranks_equal_one_rank_accumulating_two_batches(tiny_params, tiny_shards, tmp_path):
    # The pipeline's launcher: torchrun with its stores on the loopback interface only.
    torchrun = [sys.executable, "-m", "tasks.torchrun", "--nnodes", "1", "--nproc_per_node",
                "2", "--rdzv-backend", "c10d", "--rdzv-endpoint", "127.0.0.1:0"]  # fmt: skip
    # The same update of 512 tokens: 2 ranks x 1 pass of 256, or 1 rank x 2 passes of 256.
    update = ["train.batch_tokens=512", "train.max_tokens=256"]
    two = _train(tmp_path / "two", tiny_params, tiny_shards, torchrun, *update)
    one = _train(tmp_path / "one", tiny_params, tiny_shards, [sys.executable], *update)
    a, b = (_final(tmp_path / run) for run in ("two", "one"))
    assert a["world_size"] == 2 and len(a["rng"]) == 2 and b["world_size"] == 1
    assert a["progress"]["tokens_seen"] == b["progress"]["tokens_seen"]
    for key, value in a["model"].items():
        torch.testing.assert_close(value, b["model"][key], rtol=0, atol=1e-5, msg=key)
    # Only rank 0 logs: one line per step, not two.
    assert two.count("step 3/3 (100%)") == 1 and one.count("step 3/3 (100%)") == 1
    assert "2 rank(s) x 1 micro-batch(es)" in two and "1 rank(s) x 2 micro-batch(es)" in one
    assert _losses(two) == pytest.approx(_losses(one), rel=1e-3)
    # A branch on two ranks is the run resumed in place with the new params, bit for bit.
    shutil.copytree(tmp_path / "two", tmp_path / "in_place")
    more = [*update, "train.max_steps=5", "train.cooldown=0.5"]
    _train(tmp_path / "in_place", tiny_params, tiny_shards, torchrun, *more, "--allow-param-change")
    state = ckpt.checkpoint_path(tmp_path / "two", "state", 3)
    branch = _train(
        tmp_path / "b", tiny_params, tiny_shards, torchrun, *more, "--init-from", str(state)
    )
    assert "train.cooldown: 0.0 in checkpoint, 0.5 now" in branch and "step 5/5" in branch
    assert_same_training(_final(tmp_path / "b"), _final(tmp_path / "in_place"))


def test_a_first_batch_of_equal_lengths_does_not_cost_a_second_graph(monkeypatch):
    """With length buckets a batch's source and target lengths are often equal. Traced on
    such a batch (the first: the layers compile with symbolic sizes from it), duck shaping
    would tie the two lengths together, and the next batch would compile again (as base's
    layers did on a CPU, each compilation taking minutes). One graph per layer kind."""
    from torch._dynamo.utils import counters

    # Dynamo decides the graphs; its eager backend saves compiling them.
    monkeypatch.setattr(torch, "compile", functools.partial(torch.compile, backend="eager"))
    torch._dynamo.reset()
    counters.clear()
    cfg = ModelConfig(n_layers=1, d_model=16, d_ff=32, n_heads=2, dropout=0.0)
    model = Transformer(cfg, vocab_size=50, pad_id=0)
    # From torch's default (a config patch: monkeypatch's undo would delete the setting)
    with torch.fx.experimental._config.patch(use_duck_shape=True):
        net = distribute(model, DistEnv(0, 1, 0, torch.device("cpu")), compile=True)
        g = torch.Generator().manual_seed(0)
        for rows, src_len, tgt_len in [(3, 7, 7), (4, 9, 5), (2, 6, 11), (5, 12, 12), (3, 4, 8)]:
            src = torch.randint(4, 50, (rows, src_len), generator=g)
            tgt = torch.randint(4, 50, (rows, tgt_len), generator=g)
            net(src, tgt, project=False).sum().backward()
    assert counters["stats"]["unique_graphs"] == 2, dict(counters["stats"])


@pytest.mark.slow
def test_two_compiled_ranks_equal_one_uncompiled_rank(tiny_params, tiny_shards, tmp_path):
    """DDP around compiled layers, as `distribute` builds it, makes the updates
    of one uncompiled rank accumulating the same batches. (The tiny model's gradients fill
    one of DDP's buckets, so dynamo's split at bucket boundaries is not exercised here.)
    Inductor compiles the graphs to C++ on the CPU: a minute or two, so slow."""
    torchrun = [sys.executable, "-m", "tasks.torchrun", "--nnodes", "1", "--nproc_per_node",
                "2", "--rdzv-backend", "c10d", "--rdzv-endpoint", "127.0.0.1:0"]  # fmt: skip
    update = ["train.batch_tokens=512", "train.max_tokens=256"]
    compiled = [*update, "train.compile=true"]
    two = _train(tmp_path / "two", tiny_params, tiny_shards, torchrun, *compiled)
    _train(tmp_path / "one", tiny_params, tiny_shards, [sys.executable], *update)
    a, b = (_final(tmp_path / run) for run in ("two", "one"))
    assert a["world_size"] == 2 and a["progress"]["tokens_seen"] == b["progress"]["tokens_seen"]
    # Not bitwise: Adam divides each gradient by its own RMS, so an element whose gradient
    # nearly cancels turns the compiled kernels' rounding into a larger difference (3.6e-5
    # and 1.1e-5 on 2 of 30,880 values, measured after the loss's change at aad90d6); a wrong
    # batch or a missing all-reduce moves them by ~lr (Adam: 0.044, 0.088, 0.133 in these 3
    # updates).
    assert_same_updates(a["model"], b["model"], atol=1e-4)
    assert two.count("step 3/3 (100%)") == 1


def _final(run_dir: Path) -> dict:
    return model_file.load_typed(ckpt.list_files(run_dir, "state")[-1], ckpt.STATE_FORMAT)


def _losses(out: str) -> list[float]:
    return [
        float(line.split("| loss ")[1].split(" ")[0])
        for line in out.splitlines()
        if line.startswith("step ")
    ]


SHARED_BLEU = """\
import json
import sys
from pathlib import Path
from transformer.training.distributed import init_distributed, shutdown
from transformer.training.validate import shared_bleu

env = init_distributed()
# Rank 0 decodes its sentences perfectly, rank 1 its own badly: only the whole scores.
pairs = [(0, "a cat sits on the red mat", "a cat sits on the red mat")] if env.rank == 0 else [
    (1, "dogs", "two dogs run across a green field")]
Path(sys.argv[1], f"{env.rank}.json").write_text(json.dumps(shared_bleu(pairs, env)))
shutdown()
"""


def test_validation_bleu_is_the_same_number_on_every_rank(tmp_path):
    """Early stopping on BLEU runs on every rank: a rank that saw another score would stop
    alone and leave the others waiting in a collective (it did: rank 1 saw 0.0, stopped
    after `patience` validations, and the run died of a closed connection)."""
    script = tmp_path / "shared_bleu.py"
    script.write_text(SHARED_BLEU)
    torchrun = [sys.executable, "-m", "tasks.torchrun", "--nnodes", "1", "--nproc_per_node",
                "2", "--rdzv-backend", "c10d", "--rdzv-endpoint", "127.0.0.1:0"]  # fmt: skip
    # One file per rank: two ranks printing to one pipe can interleave their lines (CI saw
    # '{"rank": 0, ...}{"rank": 1, ...}' on one line).
    done = subprocess.run([*torchrun, str(script), str(tmp_path)], cwd=ROOT, capture_output=True,
                          env={**ENV, "PYTHONPATH": str(ROOT)}, text=True, timeout=300)  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    scores = {int(f.stem): json.loads(f.read_text()) for f in tmp_path.glob("*.json")}
    assert set(scores) == {0, 1}
    assert scores[0] == scores[1] > 0
