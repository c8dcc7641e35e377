"""Checkpoint files: atomic, safely loaded, found by step, pruned, and RNG states that
round-trip through a weights-only load."""

from __future__ import annotations

import logging
import random

import numpy as np
import pytest
import torch

from transformer import checkpoint as ckpt


def _state(step: int) -> dict:
    return {"step": step, "model": {"w": torch.full((2,), float(step))}}


def test_load_file_names_the_file_on_every_failure(tmp_path):
    with pytest.raises(ckpt.CheckpointError, match=r"missing\.pt: no such file"):
        ckpt.load_file(tmp_path / "missing.pt")
    path = ckpt.atomic_save({"a": torch.zeros(3)}, tmp_path / "ok.pt")
    path.write_bytes(path.read_bytes()[:-50])
    with pytest.raises(ckpt.CheckpointError, match=r"ok\.pt: unreadable"):
        ckpt.load_file(path)
    torch.save([1, 2], tmp_path / "list.pt")
    with pytest.raises(ckpt.CheckpointError, match=r"list\.pt: not a checkpoint"):
        ckpt.load_file(tmp_path / "list.pt")
    ckpt.save_model_file(tmp_path / "m.pt", ckpt.ModelFile({}, {}, b"x", {}))
    with pytest.raises(ckpt.CheckpointError, match="not a training checkpoint"):
        ckpt.load_checkpoint(tmp_path / "m.pt")


def test_atomic_save_leaves_no_temporary_file(tmp_path):
    ckpt.atomic_save({"a": 1}, tmp_path / "sub" / "x.pt")
    assert [p.name for p in (tmp_path / "sub").iterdir()] == ["x.pt"]
    assert ckpt.load_file(tmp_path / "sub" / "x.pt", mmap=True) == {"a": 1}


def test_checkpoints_sort_by_step_and_prune_to_keep_last(tmp_path):
    for step in (9, 10, 100, 1000):
        ckpt.save_checkpoint(tmp_path, _state(step), keep_last=3)
    (tmp_path / "checkpoints" / "step-notanumber.pt").write_bytes(b"")
    names = [p.name for p in ckpt.list_checkpoints(tmp_path)]
    assert names == ["step-0000010.pt", "step-0000100.pt", "step-0001000.pt"]
    assert ckpt.checkpoint_step(tmp_path / "checkpoints" / names[0]) == 10


def test_best_link_survives_pruning(tmp_path):
    saved = ckpt.save_checkpoint(tmp_path, _state(1), keep_last=1)
    ckpt.link_best(tmp_path, saved)
    ckpt.save_checkpoint(tmp_path, _state(2), keep_last=1)
    assert not saved.exists()
    assert ckpt.load_checkpoint(ckpt.best_path(tmp_path))["step"] == 1
    ckpt.save_best(tmp_path, _state(3))  # a best step that is no save step: its own file
    assert ckpt.load_checkpoint(ckpt.best_path(tmp_path))["step"] == 3
    assert [p.name for p in ckpt.list_checkpoints(tmp_path)] == ["step-0000002.pt"]


def test_load_latest_skips_an_unreadable_file_with_a_warning(tmp_path, caplog):
    assert ckpt.load_latest(tmp_path) is None
    for step in (1, 2):
        ckpt.save_checkpoint(tmp_path, _state(step), keep_last=5)
    newest = ckpt.step_path(tmp_path, 2)
    newest.write_bytes(newest.read_bytes()[:100])
    with caplog.at_level(logging.WARNING):
        path, state = ckpt.load_latest(tmp_path)
    assert state["step"] == 1 and path.name == "step-0000001.pt"
    assert "step-0000002.pt" in caplog.text
    ckpt.step_path(tmp_path, 1).write_bytes(b"garbage")
    with pytest.raises(ckpt.CheckpointError, match="none of the 2 checkpoints is readable"):
        ckpt.load_latest(tmp_path)


def test_remove_partial_writes(tmp_path):
    ckpt.save_checkpoint(tmp_path, _state(1), keep_last=5)
    tmp = tmp_path / "checkpoints" / ".step-0000002.pt.abc.tmp"
    tmp.write_bytes(b"half")
    ckpt.remove_partial_writes(tmp_path)
    assert not tmp.exists() and ckpt.step_path(tmp_path, 1).exists()


def test_param_differences_name_each_key():
    saved = {"model": {"d_model": 64, "n_heads": 4}, "train": {"max_steps": 10, "seed": 1}}
    now = {"model": {"d_model": 128, "n_heads": 4}, "train": {"max_steps": 20, "seed": 1}}
    assert ckpt.param_differences(saved, now, frozenset({"train.max_steps"})) == [
        "model.d_model: 64 in checkpoint, 128 now"
    ]


def test_resume_differences_cover_params_data_and_world_size():
    state = {
        "params": {"model": {"d_model": 64}, "train": {"max_steps": 5}, "decode": {"beam": 4}},
        "data_fingerprint": "abc",
        "world_size": 2,
    }
    now = {"model": {"d_model": 64}, "train": {"max_steps": 9}, "decode": {"beam": 5}}
    assert ckpt.resume_differences(state, now, "abc", 2, frozenset({"train.max_steps"})) == []
    assert ckpt.resume_differences(state, now, "abd", 1, frozenset({"train.max_steps"})) == [
        "data fingerprint differs (abc in checkpoint, abd now): other shards",
        "world size: 2 in checkpoint, 1 now (each update would see other batches)",
    ]


def _draws() -> tuple:
    return (torch.rand(3).tolist(), random.random(), random.gauss(0, 1), np.random.rand(2).tolist())


def test_rng_state_round_trips_through_a_weights_only_file(tmp_path):
    random.gauss(0, 1)  # leaves a cached gaussian in Python's state
    state = ckpt.rng_state()
    expected = _draws()
    ckpt.atomic_save({"rng": state}, tmp_path / "rng.pt")
    loaded = ckpt.load_file(tmp_path / "rng.pt")["rng"]
    _draws()
    ckpt.set_rng_state(loaded)
    assert _draws() == expected
