"""What the host asks of a GPU per training update, counted on a CPU: the real aten ops
(views excluded) that the GPU's code paths issue for an update of a base-shaped model
(6 + 6 layers, 8 heads, bf16, the loss in as many chunks as WMT's vocabulary and a full
batch make). Each is a kernel launch or more, ~5-10 us of host time on a GPU machine, so
the count bounds how fast the host can feed the GPU. Shapes do not change the count; the
chunk count does, so it is set as base's: 25k target tokens x 37k logits in 512 MB
chunks, 4."""

from __future__ import annotations

import pytest
import torch
from opcount import OpCounter

from transformer.config import load_params
from transformer.nn import kernels
from transformer.nn import loss as loss_module
from transformer.training.distributed import DistEnv
from transformer.training.trainer import Trainer

BASE_CHUNKS = 4  # ceil(25,000 target tokens / (2^28 logits / 37,000))
UPDATE_BUDGET = 1000  # the issue's bound; 1,627 before (autocast, the 33-op loss chunk)


@pytest.fixture
def gpu_paths(monkeypatch):
    """This CPU run the way a GPU is run: bf16 compute weights and autocast, F.linear,
    F.dropout, SDPA, bf16 logits in the loss."""
    monkeypatch.setattr(kernels, "CPU_PATHS", False)
    monkeypatch.setattr(kernels, "CPU_BF16", "avx512_bf16")


def base_shaped(tiny_params, tiny_shards, tmp_path, *overrides) -> Trainer:
    shape = ["model.n_layers=6", "model.n_heads=8", "model.d_model=64", "model.d_ff=128",
             "train.precision=bf16", "train.label_smoothing=0.1", *overrides]  # fmt: skip
    params = load_params(tiny_params, shape)
    return Trainer(params, DistEnv(0, 1, 0, torch.device("cpu")), tiny_shards, tmp_path)


def test_an_update_of_base_issues_at_most_1000_ops(
    gpu_paths, tiny_params, tiny_shards, tmp_path, monkeypatch
):
    t = base_shaped(tiny_params, tiny_shards, tmp_path / "run", "train.clip_norm=0")
    batches = iter(t.loader)
    t.step([next(batches)])  # the first update creates Adam's state
    batch = next(batches)
    rows = -(-batch.n_tgt_tokens // BASE_CHUNKS)
    monkeypatch.setitem(loss_module.CHUNK_LOGITS, "cpu", rows * t.model.out_proj.weight.size(0))
    with OpCounter() as ops:
        t.step([batch])
    t.loader.close()
    print(f"{ops.total} ops: {ops.counts.most_common()}")
    casts = ops.counts["aten._to_copy"]
    assert ops.total <= UPDATE_BUDGET, ops.counts.most_common(20)
    assert casts <= 150, casts  # activations only: the weights are bf16 already
    assert ops.reads == 0
