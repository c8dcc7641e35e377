"""Checkpoint files: atomic, safely loaded, pruned as the manager promises, found by step
and by score, and RNG states that round-trip through a weights-only load."""

from __future__ import annotations

import logging
import os
import random

import numpy as np
import pytest
import torch

from transformer import model_file
from transformer.model_file import CheckpointError, atomic_save
from transformer.training import checkpoint as ckpt


class Evil:
    def __reduce__(self):
        return (os.system, ("touch /tmp/should-never-exist",))


def test_load_file_names_the_file_on_every_failure(tmp_path):
    with pytest.raises(CheckpointError, match=r"missing\.pt: no such file"):
        model_file.load_file(tmp_path / "missing.pt")
    path = atomic_save({"a": torch.zeros(3)}, tmp_path / "ok.pt")
    path.write_bytes(path.read_bytes()[:-50])
    with pytest.raises(CheckpointError, match=r"ok\.pt: unreadable"):
        model_file.load_file(path)
    torch.save([1, 2], tmp_path / "list.pt")
    with pytest.raises(CheckpointError, match=r"list\.pt: not a checkpoint"):
        model_file.load_file(tmp_path / "list.pt")
    model_file.save_model_file(tmp_path / "m.pt", model_file.ModelFile({}, {}, b"x", {}))
    with pytest.raises(CheckpointError, match="not 'transformer-mt/state/1'"):
        model_file.load_typed(tmp_path / "m.pt", ckpt.STATE_FORMAT)


def test_a_pickle_that_runs_code_is_refused_without_advising_weights_only_false(tmp_path):
    torch.save({"model": Evil()}, tmp_path / "evil.pt")
    with pytest.raises(CheckpointError) as err:
        model_file.load_file(tmp_path / "evil.pt")
    assert "evil.pt" in str(err.value) and "refused" in str(err.value)
    assert "weights_only" not in str(err.value) and len(str(err.value).splitlines()) == 1
    assert not os.path.exists("/tmp/should-never-exist")


def test_atomic_save_leaves_no_temporary_file_and_follows_the_umask(tmp_path):
    atomic_save({"a": 1}, tmp_path / "sub" / "x.pt")
    assert [p.name for p in (tmp_path / "sub").iterdir()] == ["x.pt"]
    assert model_file.load_file(tmp_path / "sub" / "x.pt", mmap=True) == {"a": 1}
    mask = os.umask(0)
    os.umask(mask)
    assert (tmp_path / "sub" / "x.pt").stat().st_mode & 0o777 == 0o666 & ~mask


def _manager(tmp_path, keep_last=2, keep_best=1, higher=False):
    return ckpt.CheckpointManager(tmp_path, keep_last, keep_best, higher)


def _snap(manager, step, score):
    return manager.snapshot(step, {"params": {}, "data_fingerprint": "f"},
                            {"w": torch.full((2,), float(step))}, score)  # fmt: skip


def test_snapshots_keep_the_last_n_and_the_best(tmp_path):
    m = _manager(tmp_path)
    for step, loss in ((10, 3.0), (20, 1.0), (30, 2.0), (40, 2.5), (50, None)):
        _snap(m, step, loss)
    names = [p.name for p in ckpt.list_files(tmp_path, "model")]
    assert names == ["model-0000020.pt", "model-0000040.pt", "model-0000050.pt"]  # best 20
    assert [s["step"] for s in m.best(1)] == [20]
    higher = _manager(tmp_path / "bleu", keep_last=1, keep_best=2, higher=True)
    for step, bleu in ((1, 10.0), (2, 30.0), (3, 20.0), (4, 5.0)):
        _snap(higher, step, bleu)
    assert [p.name for p in ckpt.list_files(tmp_path / "bleu", "model")] == [
        "model-0000002.pt", "model-0000003.pt", "model-0000004.pt",
    ]  # fmt: skip


def test_training_states_keep_the_newest_two_and_skip_an_unreadable_one(tmp_path, caplog):
    m = _manager(tmp_path)
    assert m.load_latest() is None
    for step in (1, 2, 3):
        m.save_state(step, {"step": step})
    assert [p.name for p in ckpt.list_files(tmp_path, "state")] == [
        "state-0000002.pt", "state-0000003.pt"
    ]  # fmt: skip
    newest = m.path("state", 3)
    newest.write_bytes(newest.read_bytes()[:100])
    with caplog.at_level(logging.WARNING):
        path, state = m.load_latest()
    assert state["step"] == 2 and path.name == "state-0000002.pt"
    assert "state-0000003.pt" in caplog.text
    m.path("state", 2).write_bytes(b"garbage")
    with pytest.raises(CheckpointError, match=r"state-0000003\.pt: unreadable, as the 1"):
        m.load_latest()


def test_the_state_at_the_cooldowns_start_is_kept_for_further_cooldowns(tmp_path):
    m = ckpt.CheckpointManager(tmp_path, 2, 0, False, branch_point=2)
    for step in (1, 2, 3, 4, 5):
        m.save_state(step, {"step": step})
    assert [ckpt.file_step(p) for p in ckpt.list_files(tmp_path, "state")] == [2, 4, 5]
    moved = ckpt.CheckpointManager(tmp_path, 2, 0, False, branch_point=6)  # max_steps raised
    moved.save_state(6, {"step": 6})
    assert [ckpt.file_step(p) for p in ckpt.list_files(tmp_path, "state")] == [5, 6]


def test_a_stops_state_off_the_cadence_lasts_until_the_next_one_on_it(tmp_path):
    """A stop at step 12 (save_every 5) saves there; once the resumed run saves at 15 the
    folder holds what an uninterrupted run's does, and 5 was not pruned for 12's sake."""
    m = ckpt.CheckpointManager(tmp_path, 2, 0, False, save_every=5)
    for step in (5, 10, 12):
        m.save_state(step, {"step": step})
    assert [ckpt.file_step(p) for p in ckpt.list_files(tmp_path, "state")] == [5, 10, 12]
    m.save_state(15, {"step": 15})
    assert [ckpt.file_step(p) for p in ckpt.list_files(tmp_path, "state")] == [10, 15]


def test_resuming_removes_snapshots_written_after_the_state(tmp_path):
    m = _manager(tmp_path, keep_last=5)
    _snap(m, 10, 1.0)
    m.save_state(10, {"checkpoints": m.state_dict()})
    _snap(m, 20, 0.5)  # then killed before the state of step 20
    resumed = _manager(tmp_path, keep_last=5)
    _, state = resumed.load_latest()
    resumed.load_state_dict(state["checkpoints"])
    assert [p.name for p in ckpt.list_files(tmp_path, "model")] == ["model-0000010.pt"]
    assert resumed.index == [{"step": 10, "score": 1.0}]


def test_select_snapshots_last_best_and_bounded_by_step(tmp_path):
    m = _manager(tmp_path, keep_last=5, keep_best=0)
    for step, loss in ((1, 4.0), (2, 2.0), (3, 3.0), (4, 1.0)):
        _snap(m, step, loss)
    steps = lambda paths: [ckpt.file_step(p) for p in paths]
    assert steps(ckpt.select_snapshots(tmp_path, "last", 2)) == [3, 4]
    assert steps(ckpt.select_snapshots(tmp_path, "best", 2)) == [2, 4]  # oldest first
    assert steps(ckpt.select_snapshots(tmp_path, "last", 2, max_step=3)) == [2, 3]
    with pytest.raises(CheckpointError, match=r"4 last snapshot\(s\) .* 5 to average"):
        ckpt.select_snapshots(tmp_path, "last", 5)


def test_resume_differences_name_identity_keys_and_ignore_operational_ones():
    saved = {"model": {"d_model": 64, "n_heads": 4}, "train": {"max_steps": 10, "seed": 1},
             "decode": {"beam_size": 4}}  # fmt: skip
    now = {"model": {"d_model": 128, "n_heads": 4}, "train": {"max_steps": 20, "seed": 1},
           "decode": {"beam_size": 5}}  # fmt: skip
    assert ckpt.resume_differences(saved, now) == ["model.d_model: 64 in checkpoint, 128 now"]


def test_a_key_the_checkpoint_predates_counts_at_its_default():
    # A checkpoint written before train.cooldown_shape existed ran the linear cooldown.
    saved = {"model": {"d_model": 64}, "train": {"cooldown": 0.2}}
    now = {"model": {"d_model": 64}, "train": {"cooldown": 0.2, "cooldown_shape": "linear"}}
    assert ckpt.resume_differences(saved, now) == []
    now["train"]["cooldown_shape"] = "1-sqrt"
    assert ckpt.resume_differences(saved, now) == [
        "train.cooldown_shape: 'linear' in checkpoint, '1-sqrt' now"
    ]


def _draws() -> tuple:
    return (torch.rand(3).tolist(), random.random(), random.gauss(0, 1), np.random.rand(2).tolist())


def test_rng_state_round_trips_through_a_weights_only_file(tmp_path):
    random.gauss(0, 1)  # leaves a cached gaussian in Python's state
    state = ckpt.rng_state()
    expected = _draws()
    atomic_save({"rng": state}, tmp_path / "rng.pt")
    loaded = model_file.load_file(tmp_path / "rng.pt")["rng"]
    _draws()
    ckpt.set_rng_state(loaded)
    assert _draws() == expected


def test_a_second_sigint_waits_for_the_save_under_way(tmp_path):
    """An impatient second Ctrl-C stops the trainer at once, but not in the middle of a
    save: the file the first signal asked for is written whole, then the stop comes."""
    import signal

    from transformer.training.lifecycle import StopSignal, whole_save

    manager = ckpt.CheckpointManager(tmp_path, keep_last=2, keep_best=0, higher_is_better=False)
    stop = StopSignal()
    stop.install()
    saved = None
    try:
        os.kill(os.getpid(), signal.SIGINT)  # the first: stop after this update, and save
        assert stop.requested
        with pytest.raises(KeyboardInterrupt), whole_save():
            os.kill(os.getpid(), signal.SIGINT)  # the second, as the save begins
            saved = manager.save_state(7, {"step": 7, "weights": torch.randn(1000)})
    finally:
        stop.restore()
    assert saved is not None and model_file.load_typed(saved, ckpt.STATE_FORMAT)["step"] == 7
    assert not list(saved.parent.glob(".*.tmp"))  # no leftover of a write cut short


def test_a_file_of_tensors_names_itself_when_its_content_changed(tmp_path):
    """Every file of tensors carries the sha256 of its content: one changed byte of a
    tensor is an error naming the file, whether the file is read or mapped."""
    import zipfile

    path = atomic_save({"format": "x", "model": {"w": torch.randn(64, 64)}, "step": 3},
                       tmp_path / "m.pt")  # fmt: skip
    assert model_file.load_file(path)["step"] == 3 and "sha256" not in model_file.load_file(path)
    with zipfile.ZipFile(path) as archive:
        entry = next(e for e in archive.infolist() if "/data/" in e.filename)
    data = bytearray(path.read_bytes())
    header = entry.header_offset
    start = header + 30 + int.from_bytes(data[header + 26 : header + 28], "little")
    start += int.from_bytes(data[header + 28 : header + 30], "little")
    data[start + entry.file_size // 2] ^= 0x01
    path.write_bytes(bytes(data))
    for mmap in (False, True):
        with pytest.raises(CheckpointError, match=r"m\.pt: content differs from its sha256"):
            model_file.load_file(path, mmap=mmap)
