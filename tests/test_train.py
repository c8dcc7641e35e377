"""The trainer end to end on a tiny model: logs, checkpoints, exact resume after a kill,
operational changes resumed and identity changes refused, corrupt checkpoints, non-finite
updates, early stopping, signals."""

from __future__ import annotations

import functools
import math
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from conftest import alive, assert_same_training, count_arenas, ends_within, wait_for
from torch._dynamo.utils import counters
from torch.utils._python_dispatch import TorchDispatchMode

import transformer.training.trainer as train_module
from transformer import model_file
from transformer.config import load_params, to_dict
from transformer.model_file import atomic_save, load_typed
from transformer.nn import kernels
from transformer.nn import loss as loss_module
from transformer.train import main
from transformer.training import checkpoint as ckpt
from transformer.training import validate as validate_module
from transformer.training.average import main as average_main
from transformer.training.compiled import compile_stats
from transformer.training.distributed import DistEnv
from transformer.training.optim import inverse_sqrt_schedule
from transformer.training.plan import batch_plan

ROOT = Path(__file__).resolve().parents[1]
# One thread: on a shared 2-core machine, two spinning OpenMP threads per process make a
# tiny model's step 10x slower, and the results do not depend on it.
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}


class ListLogger:
    def __init__(self):
        self.records: list[tuple[int, dict[str, float]]] = []
        self.closed = False

    def log(self, metrics, step):
        self.records.append((step, dict(metrics)))

    def close(self):
        self.closed = True

    def keys(self) -> set[str]:
        return {k for _, m in self.records for k in m}


# Tiny models gain nothing from threads (see conftest.one_thread).
pytestmark = pytest.mark.usefixtures("one_thread")


def train(params: Path, shards: Path, out: Path, *extra: str, logger=None) -> int:
    return main([str(params), "--data", str(shards), "--out", str(out), *extra], logger=logger)


def cli(params: Path, shards: Path, out: Path, *extra: str) -> list[str]:
    return [
        sys.executable,
        "-m",
        "transformer.train",
        str(params),
        "--data",
        str(shards),
        "--out",
        str(out),
        *extra,
    ]


def final_state(run_dir: Path) -> dict:
    return load_typed(ckpt.list_files(run_dir, "state")[-1], ckpt.STATE_FORMAT)


def names(run_dir: Path, kind: str) -> list[str]:
    return [p.name for p in ckpt.list_files(run_dir, kind)]


# --------------------------------------------------------------------------- in-process


@pytest.fixture(scope="module")
def tiny_run(tiny_params, tiny_shards, tmp_path_factory):
    out = tmp_path_factory.mktemp("run") / "run"
    logger = ListLogger()
    with torch.random.fork_rng():
        torch.set_num_threads(1)
        rc = train(tiny_params, tiny_shards, out, "train.valid_bleu=true", logger=logger)
    return rc, out, logger


def test_trains_logs_and_keeps_the_last_checkpoints(tiny_run, tiny_shards):
    rc, out, logger = tiny_run
    assert rc == 0
    # Snapshots: the last keep_last (3); training states: the newest two.
    assert names(out, "model") == ["model-0000004.pt", "model-0000006.pt", "model-0000008.pt"]
    assert names(out, "state") == ["state-0000006.pt", "state-0000008.pt"]
    assert (out / "spm.model").read_bytes() == (tiny_shards / "spm.model").read_bytes()
    expected = {
        "train/loss",
        "train/nll_loss",
        "train/lr",
        "train/tokens_per_s",
        "train/grad_norm",
        "train/step_time",
        "train/tokens_per_update",
        "train/epoch",
        "valid/loss",
        "valid/ppl",
        "valid/bleu",
        "valid/best",
    }
    assert expected <= logger.keys()
    assert [s for s, m in logger.records if "train/loss" in m] == [2, 4, 6, 8]
    assert [s for s, m in logger.records if "valid/loss" in m] == [4, 8]
    epochs = [m["train/epoch"] for _, m in logger.records if "train/epoch" in m]
    assert 0 < epochs[0] < epochs[-1] and epochs == sorted(epochs)  # fractional, growing
    assert logger.closed
    valid = [m for _, m in logger.records if "valid/loss" in m]
    assert valid[-1]["valid/loss"] < valid[0]["valid/loss"]  # it learns


def test_checkpoint_describes_itself(tiny_run, tiny_params, tiny_shards):
    _, out, _ = tiny_run
    state = model_file.load_file(out / "checkpoints" / "state-0000008.pt")  # weights_only=True
    params = load_params(tiny_params, ["train.valid_bleu=true"])
    assert state["params"] == to_dict(params)
    assert state["step"] == state["progress"]["step"] == 8
    assert state["progress"]["tokens_seen"] > 0
    assert (
        state["data_fingerprint"]
        == __import__("json").loads((tiny_shards / "manifest.json").read_text())["fingerprint"]
    )
    assert state["world_size"] == 1 and len(state["rng"]) == 1
    assert set(state["rng"][0]) == {"torch", "cuda", "python", "numpy"}
    assert state["data"]["consumed"] == 8  # update_freq 1: a batch per step
    assert set(state) >= {"model", "optimizer", "scheduler", "early_stopping", "checkpoints"}
    assert [s["step"] for s in state["checkpoints"]["snapshots"]] == [4, 6, 8]
    snapshot = model_file.load_file(out / "checkpoints" / "model-0000008.pt")
    assert set(snapshot) == {"format", "params", "data_fingerprint", "metric",
                             "higher_is_better", "step", "score", "model"}  # fmt: skip
    assert snapshot["score"] == state["early_stopping"]["best"]  # the last is the best here


def test_rerun_of_a_finished_run_is_a_no_op(tiny_run, tiny_params, tiny_shards):
    _, out, _ = tiny_run
    files = lambda: {p.name: p.stat().st_mtime_ns for p in (out / "checkpoints").iterdir()}
    before = files()
    logger = ListLogger()
    assert train(tiny_params, tiny_shards, out, "train.valid_bleu=true", logger=logger) == 0
    assert logger.records == []
    assert files() == before


def test_missing_shards_exit_2(tiny_params, tmp_path, capsys):
    assert train(tiny_params, tmp_path / "nowhere", tmp_path / "run") == 2
    assert "nowhere" in capsys.readouterr().err


def test_extending_max_steps_continues_the_same_trajectory(tiny_params, tiny_shards, tmp_path):
    assert train(tiny_params, tiny_shards, tmp_path / "a", "train.max_steps=6") == 0
    assert train(tiny_params, tiny_shards, tmp_path / "b", "train.max_steps=3") == 0
    assert train(tiny_params, tiny_shards, tmp_path / "b", "train.max_steps=6") == 0
    assert_same_training(final_state(tmp_path / "a"), final_state(tmp_path / "b"))


def test_a_cooldown_ends_at_max_steps_and_moves_when_it_is_raised(
    tiny_params, tiny_shards, tmp_path, caplog
):
    out, cool = tmp_path / "r", ["train.cooldown=0.5", "train.log_every=1"]
    logger = ListLogger()
    assert train(tiny_params, tiny_shards, out, *cool, "train.max_steps=4", logger=logger) == 0
    lrs = [m["train/lr"] for _, m in logger.records if "train/lr" in m]
    full = [inverse_sqrt_schedule(k, 32, 4, 2.0) for k in range(1, 5)]  # tiny_params
    assert lrs == pytest.approx([full[0], full[1], full[2] * 2 / 3, full[3] / 3])
    caplog.set_level("WARNING", logger="transformer")
    logger = ListLogger()
    assert train(tiny_params, tiny_shards, out, *cool, "train.max_steps=6", logger=logger) == 0
    assert "train.max_steps 4 -> 6: the lr cooldown (train.cooldown 0.5) moves" in caplog.text
    # Updates 5 and 6 under the new schedule: the last 3 of 6 cool down (3/4, 2/4, 1/4).
    lrs = [m["train/lr"] for _, m in logger.records if "train/lr" in m]
    assert lrs == pytest.approx([inverse_sqrt_schedule(k, 32, 4, 2.0) * f for k, f in
                                 ((5, 2 / 4), (6, 1 / 4))])  # fmt: skip


def test_operational_changes_resume_and_identity_changes_are_refused(
    tiny_params, tiny_shards, tmp_path, capsys, caplog
):
    out = tmp_path / "run"
    assert train(tiny_params, tiny_shards, out, "train.max_steps=2") == 0
    capsys.readouterr()
    rc = train(tiny_params, tiny_shards, out, "model.d_model=64", "train.lr_scale=1.0")
    err = capsys.readouterr().err
    assert rc == 2
    assert "model.d_model: 32 in checkpoint, 64 now" in err
    assert "train.lr_scale: 2.0 in checkpoint, 1.0 now" in err
    assert "--allow-param-change" in err and "--reset" in err
    # Operational keys (cadences, how long, the per-pass memory bound) just resume; a
    # smaller max_tokens splits the same updates in two: the batches differ, so the data
    # position continues at the same point of the epoch.
    caplog.set_level("WARNING", logger="transformer")
    operational = ["train.max_steps=3", "train.log_every=1", "train.valid_every=3",
                   "train.save_every=3", "train.keep_last=4", "train.max_tokens=128"]  # fmt: skip
    assert train(tiny_params, tiny_shards, out, *operational) == 0
    assert final_state(out)["step"] == 3
    assert "data position" in caplog.text and "max_tokens 256 -> 128" in caplog.text
    # An identity change can be forced; a model of another shape cannot be loaded at all.
    forced = ["train.max_steps=4", "train.lr_scale=1.0", "--allow-param-change"]
    assert train(tiny_params, tiny_shards, out, *forced) == 0
    assert final_state(out)["step"] == 4
    assert "resuming despite a difference" in caplog.text
    assert (
        train(
            tiny_params,
            tiny_shards,
            out,
            "train.max_steps=5",
            "model.d_model=64",
            "--allow-param-change",
        )
        == 2
    )
    assert "does not fit this run" in capsys.readouterr().err
    assert (
        train(tiny_params, tiny_shards, out, "train.max_steps=2", "model.d_model=64", "--reset")
        == 0
    )
    assert names(out, "state") == ["state-0000002.pt"]
    assert final_state(out)["params"]["model"]["d_model"] == 64


def test_a_branch_is_its_source_resumed_with_the_new_params(
    tiny_params, tiny_shards, tmp_path, capsys, caplog, monkeypatch
):
    """--init-from STATE: another cooldown from a saved state, in a new folder, is the source
    run resumed there with the new params (--allow-param-change), bit for bit, and keeps the
    source's snapshots for averaging; the source folder is left as it was."""
    src = tmp_path / "src"
    assert train(tiny_params, tiny_shards, src, "train.max_steps=4") == 0
    in_place = tmp_path / "in_place"
    shutil.copytree(src, in_place)
    cooldown = ["train.max_steps=6", "train.cooldown=0.5"]
    assert train(tiny_params, tiny_shards, in_place, *cooldown, "--allow-param-change") == 0
    caplog.set_level("INFO", logger="transformer")
    state = ckpt.checkpoint_path(src, "state", 4)
    branch = tmp_path / "branch"
    assert train(tiny_params, tiny_shards, branch, *cooldown, "--init-from", str(state)) == 0
    assert f"branching from {state} at step 4" in caplog.text
    assert "another value: train.cooldown: 0.0 in checkpoint, 0.5 now" in caplog.text
    assert_same_training(final_state(branch), final_state(in_place))
    assert names(branch, "model") == names(in_place, "model") == [
        "model-0000002.pt", "model-0000004.pt", "model-0000006.pt"]  # fmt: skip
    assert names(branch, "state") == ["state-0000004.pt", "state-0000006.pt"]  # its own
    assert names(src, "model") == ["model-0000002.pt", "model-0000004.pt"]
    assert names(src, "state") == ["state-0000002.pt", "state-0000004.pt"]
    # Rerun, the branch resumes its own state (here: finished), with or without the flag.
    caplog.clear()
    assert train(tiny_params, tiny_shards, branch, *cooldown, "--init-from", str(state)) == 0
    assert "--init-from ignored" in caplog.text and "nothing to do" in caplog.text
    # A relative path; copies where links fail; a snapshot the source no longer has is named.
    (src / "checkpoints" / "model-0000002.pt").unlink()
    monkeypatch.chdir(tmp_path)

    def no_links(*args):
        raise OSError("cross-device link")

    monkeypatch.setattr(os, "link", no_links)
    caplog.clear()
    relative = Path("src", "checkpoints", "state-0000004.pt")
    assert (
        train(tiny_params, tiny_shards, tmp_path / "b2", *cooldown, "--init-from", str(relative))
        == 0
    )
    assert "the snapshots of step(s) [2], kept by that state, are gone" in caplog.text
    assert names(tmp_path / "b2", "model") == ["model-0000004.pt", "model-0000006.pt"]
    assert_same_training(final_state(tmp_path / "b2"), final_state(in_place))
    # A state is all it starts from: one line, exit 2.
    snapshot = ckpt.checkpoint_path(src, "model", 4)
    capsys.readouterr()
    assert train(tiny_params, tiny_shards, tmp_path / "b3", "--init-from", str(snapshot)) == 2
    err = capsys.readouterr().err
    assert str(snapshot) in err and "not 'transformer-mt/state" in err
    assert len(err.splitlines()) == 1


def test_a_cooldown_dropout_is_a_branch_at_the_cooldown_with_that_dropout(
    tiny_params, tiny_shards, tmp_path
):
    """train.cooldown_dropout: the run is, bit for bit, the same run without it branched
    where its cooldown begins with model.dropout at that rate; and it is another run."""
    cooldown = ["train.max_steps=6", "train.cooldown=0.5"]
    lowered, plain, src, branch = (tmp_path / n for n in ("lowered", "plain", "src", "branch"))
    assert train(tiny_params, tiny_shards, lowered, *cooldown, "train.cooldown_dropout=0.02") == 0
    assert train(tiny_params, tiny_shards, plain, *cooldown) == 0
    # No cooldown to 3: the 6-update run anneals from update 4 (ceil(0.5 * 6) = 3 updates).
    assert train(tiny_params, tiny_shards, src, "train.max_steps=3") == 0
    state = str(ckpt.checkpoint_path(src, "state", 3))
    assert train(tiny_params, tiny_shards, branch, *cooldown, "model.dropout=0.02",
                 "--init-from", state) == 0  # fmt: skip
    assert_same_training(final_state(lowered), final_state(branch))
    weights = final_state(lowered)["model"], final_state(plain)["model"]
    assert not all(torch.equal(weights[0][k], weights[1][k]) for k in weights[0])
    # Resumed inside the cooldown (from update 5), the rate is set again.
    resumed = tmp_path / "resumed"
    shutil.copytree(lowered, resumed)
    ckpt.checkpoint_path(resumed, "state", 6).unlink()
    assert train(tiny_params, tiny_shards, resumed, *cooldown, "train.cooldown_dropout=0.02") == 0
    assert_same_training(final_state(resumed), final_state(lowered))
    # max_steps raised on resume moves the cooldown, and the lowered rate with it: 4 at
    # the held rate then 2 lowered is the 6-update run, whose cooldown begins at update 4.
    moved = tmp_path / "moved"
    assert train(tiny_params, tiny_shards, moved, "train.max_steps=4", "train.cooldown=0.5",
                 "train.cooldown_dropout=0.02") == 0  # fmt: skip
    ckpt.checkpoint_path(moved, "state", 4).unlink()  # back to update 2, before any lowering
    assert train(tiny_params, tiny_shards, moved, *cooldown, "train.cooldown_dropout=0.02") == 0
    assert_same_training(final_state(moved), final_state(lowered))


def test_rdrop_compares_two_dropout_passes_and_without_dropout_is_plain_training(
    tiny_params, tiny_shards, tmp_path
):
    """train.rdrop_alpha: the two stacked passes draw two dropout masks, so their KL is > 0
    (without label smoothing, the logged loss is the NLL plus alpha / 4 times it); without
    dropout the passes agree, the KL is 0 and the run is the plain run, to rounding (the
    stacked batch sums its gradients in another order)."""

    def losses(name: str, *overrides: str) -> list[tuple[float, float]]:
        """(train/loss, train/nll_loss) at each log of a run without label smoothing."""
        logger = ListLogger()
        assert train(tiny_params, tiny_shards, tmp_path / name, "train.label_smoothing=0",
                     *overrides, logger=logger) == 0  # fmt: skip
        return [(m["train/loss"], m["train/nll_loss"]) for _, m in logger.records
                if "train/loss" in m]  # fmt: skip

    rdrop = losses("rdrop", "train.rdrop_alpha=5")
    assert len(rdrop) == 4 and all(loss > nll + 1e-3 for loss, nll in rdrop)
    agree = losses("agree", "train.rdrop_alpha=5", "model.dropout=0")
    plain = losses("plain", "model.dropout=0")
    assert len(agree) == 4 and all(loss == pytest.approx(nll, rel=1e-6) for loss, nll in agree)
    # Losses, not weights: Adam turns the rounding noise of a gradient that is 0 in exact
    # arithmetic (the key projection's bias: softmax ignores a constant) into full steps.
    assert [loss for loss, _ in agree] == pytest.approx([loss for loss, _ in plain], rel=1e-4)


def test_the_state_where_the_cooldown_begins_is_kept_to_branch_more_cooldowns(
    tiny_params, tiny_shards, tmp_path
):
    """A run with a cooldown saves and keeps its state at the cooldown's start (update 3
    here, between checkpoints every 2): the weights of the run without a cooldown to there
    (only the lr it would set next differs).
    A branch from it with another train.seed is another cooldown: other batches."""
    run, held, branch = tmp_path / "run", tmp_path / "held", tmp_path / "branch"
    cooldown = ["train.max_steps=7", "train.cooldown=0.5"]  # ceil(3.5) = 4 annealed updates
    assert train(tiny_params, tiny_shards, run, *cooldown) == 0
    assert names(run, "state") == ["state-0000003.pt", "state-0000006.pt", "state-0000007.pt"]
    assert train(tiny_params, tiny_shards, held, "train.max_steps=3") == 0
    start = ckpt.checkpoint_path(run, "state", 3)
    kept, plain = load_typed(start, ckpt.STATE_FORMAT), final_state(held)
    assert kept["progress"] == plain["progress"] and kept["data"] == plain["data"]
    assert all(torch.equal(kept["model"][k], plain["model"][k]) for k in kept["model"])
    assert train(tiny_params, tiny_shards, branch, *cooldown, "train.seed=2",
                 "--init-from", str(start)) == 0  # fmt: skip
    a, b = final_state(run), final_state(branch)
    assert a["step"] == b["step"] == 7 and a["data"] != b["data"]
    assert not all(torch.equal(a["model"][k], b["model"][k]) for k in a["model"])


def test_a_resumed_optimizer_steps_with_this_machines_kernels(tiny_params, tiny_shards, tmp_path):
    """A state saved where the optimizer was not fused (a CPU, before the fused optimizer
    skipped non-finite updates there) resumes fused: the saved param groups' flags, which
    load_state_dict restores, give way to this run's (tests/test_gpu.py resumes a CPU's
    state on a GPU)."""
    out = tmp_path / "run"
    assert train(tiny_params, tiny_shards, out, "train.max_steps=2") == 0
    path = ckpt.list_files(out, "state")[-1]
    state = load_typed(path, ckpt.STATE_FORMAT)
    for group in state["optimizer"]["param_groups"]:
        group["fused"] = None  # as an unfused optimizer saved it
    atomic_save(state, path)
    assert train(tiny_params, tiny_shards, out, "train.max_steps=3") == 0
    groups = load_typed(ckpt.list_files(out, "state")[-1], ckpt.STATE_FORMAT)["optimizer"]
    assert [g["fused"] for g in groups["param_groups"]] == [True]


def test_the_update_is_the_same_on_any_number_of_gpus():
    assert batch_plan(32768, 32768, 1) == (1, 32768)  # one H100: one pass
    assert batch_plan(32768, 32768, 8) == (1, 4096)  # the paper's 8 GPUs x 4096
    assert batch_plan(32768, 8192, 1) == (4, 8192)  # a smaller GPU accumulates
    assert batch_plan(32768, 8192, 2) == (2, 8192)


def test_resuming_on_other_data_is_refused(tiny_params, tiny_shards, tmp_path, capsys):
    other = tmp_path / "shards"
    shutil.copytree(tiny_shards, other)
    manifest = other / "manifest.json"
    manifest.write_text(manifest.read_text().replace('"fingerprint": "', '"fingerprint": "x'))
    out = tmp_path / "run"
    assert train(tiny_params, tiny_shards, out, "train.max_steps=2") == 0
    assert train(tiny_params, other, out, "train.max_steps=4") == 2
    assert "other shards" in capsys.readouterr().err


def test_a_corrupt_latest_state_is_named_and_skipped(tiny_params, tiny_shards, tmp_path, caplog):
    out = tmp_path / "run"
    assert train(tiny_params, tiny_shards, out, "train.max_steps=6") == 0
    good = final_state(out)
    latest = ckpt.list_files(out, "state")[-1]
    latest.write_bytes(latest.read_bytes()[:1000])  # a torn file (a disk failure)
    assert train(tiny_params, tiny_shards, out, "train.max_steps=6") == 0
    assert "state-0000006.pt" in caplog.text and "step 4" in caplog.text
    assert_same_training(good, final_state(out))  # retrained from step 4, identically


def test_non_finite_updates_are_skipped_then_stop_the_run(
    tiny_params, tiny_shards, tmp_path, monkeypatch, caplog
):
    out = tmp_path / "run"
    real = train_module.label_smoothed_loss
    calls = []

    def nan_on_third_call(*args, **kwargs):
        calls.append(1)
        loss, nll = real(*args, **kwargs)
        return (loss * float("nan") if len(calls) == 3 else loss), nll

    monkeypatch.setattr(train_module, "label_smoothed_loss", nan_on_third_call)
    logger = ListLogger()
    assert train(tiny_params, tiny_shards, out, "train.max_steps=4", logger=logger) == 0
    assert final_state(out)["progress"]["bad_steps_total"] == 1
    assert final_state(out)["data"]["consumed"] == 4  # the skipped update took its step
    assert [m["train/bad_steps"] for _, m in logger.records if "train/bad_steps" in m] == [1]
    weights = final_state(out)["model"]

    def always_nan(*args, **kwargs):
        loss, nll = real(*args, **kwargs)
        return loss * float("nan"), nll

    monkeypatch.setattr(train_module, "label_smoothed_loss", always_nan)
    rc = train(tiny_params, tiny_shards, out, "train.max_steps=8", "train.max_bad_steps=3")
    assert rc == 1  # seen at step 8's read (step 6's saw two in a row, and saved)
    assert "3 non-finite updates in a row" in caplog.text
    assert "the last saved state: step 6" in caplog.text
    after = {p.name for p in (out / "checkpoints").iterdir()}
    assert "state-0000006.pt" in after and not any("0000008" in name for name in after)
    # The skipped updates changed no weight.
    for key, value in final_state(out)["model"].items():
        assert torch.equal(value, weights[key]), key


def test_early_stopping_keeps_its_count_and_best_across_a_resume(
    tiny_params, tiny_shards, tmp_path, monkeypatch, caplog
):
    """Patience 2 on valid/loss, validating every step. A validation that never improves
    after step 3 (faked) stops the run at step 5; killed after step 4 instead, the resumed
    run still stops at 5, with the same best."""
    scores = {1: 5.0, 2: 4.0, 3: 3.0, 4: 3.5, 5: 3.2, 6: 3.1}
    step = {"n": 0}

    def fake_validate(*args, **kwargs):
        step["n"] += 1
        return {"valid/loss": scores[step["n"]], "valid/ppl": 1.0}

    monkeypatch.setattr(train_module, "validate", fake_validate)
    common = ["train.valid_every=1", "train.save_every=1", "train.patience=2",
              "train.keep_last=1", "train.keep_best=2", "average.last_n=1"]  # fmt: skip
    caplog.set_level("INFO", logger="transformer")
    straight = tmp_path / "straight"
    assert train(tiny_params, tiny_shards, straight, *common, "train.max_steps=8") == 0
    assert final_state(straight)["step"] == 5
    assert (
        "early stop: no better valid/loss in 2 validations; the best, 3, at step 3" in caplog.text
    )
    # The best two (3.0 at step 3, 3.2 at 5) and the last (5) are kept.
    assert names(straight, "model") == ["model-0000003.pt", "model-0000005.pt"]

    step["n"] = 0
    resumed = tmp_path / "resumed"
    assert train(tiny_params, tiny_shards, resumed, *common, "train.max_steps=4") == 0
    state = final_state(resumed)["early_stopping"]
    assert (state["best"], state["best_step"], state["bad"]) == (3.0, 3, 1)
    assert train(tiny_params, tiny_shards, resumed, *common, "train.max_steps=8") == 0
    assert final_state(resumed)["step"] == 5
    assert final_state(resumed)["early_stopping"] == final_state(straight)["early_stopping"]
    # Stopped: a rerun has nothing to do; a larger patience trains on.
    assert train(tiny_params, tiny_shards, resumed, *common, "train.max_steps=8") == 0
    assert "stopped early" in caplog.text
    assert train(tiny_params, tiny_shards, resumed, *common[:2], "train.patience=3",
                 *common[3:], "train.max_steps=8") == 0  # fmt: skip
    assert final_state(resumed)["step"] == 6


def test_every_validation_decodes_into_the_runs_one_cache_memory(
    tiny_params, tiny_shards, tmp_path, monkeypatch
):
    """An arena a validation, freed after it, left the process ~150 MB larger at each
    validation of a Multi30k model on a CPU (glibc keeps the freed heap): the run keeps one."""
    made = count_arenas(monkeypatch, train_module, validate_module)
    overrides = ["train.valid_bleu=true", "train.valid_every=1", "train.max_steps=3"]
    assert train(tiny_params, tiny_shards, tmp_path / "run", *overrides) == 0
    assert len(made) == 1


def test_params_errors_are_one_line_and_exit_2(tiny_shards, tmp_path, capsys):
    assert train(tmp_path / "missing.yaml", tiny_shards, tmp_path / "run") == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1 and "missing.yaml" in err


@pytest.mark.skipif(torch.cuda.is_available(), reason="trains on a CPU")
@pytest.mark.parametrize("cpu_bf16", [None, "avx512_bf16"])  # the CPU's bf16 instructions
@pytest.mark.parametrize("rdrop_alpha", ["0", "5"])  # 5: R-Drop's stacked passes, its fused KL
def test_cpu_precision_follows_the_cpu(
    tiny_params, tiny_shards, tmp_path, caplog, monkeypatch, cpu_bf16, rdrop_alpha
):
    """train.precision=bf16 on a CPU: bf16 autocast where the CPU multiplies in bf16 (close
    to fp32's losses, not equal), fp32 where it would emulate it (equal); the log says which.
    Without the instructions bf16 still runs (emulated), so both cases run on any CPU."""
    monkeypatch.setattr(kernels, "CPU_BF16", cpu_bf16)
    caplog.set_level("INFO", logger="transformer")
    losses = {}
    for precision in ("fp32", "bf16"):
        records = ListLogger()
        extra = ("model.dropout=0.0", "train.max_steps=3", "train.log_every=1",
                 f"train.precision={precision}", f"train.rdrop_alpha={rdrop_alpha}")  # fmt: skip
        assert train(tiny_params, tiny_shards, tmp_path / precision, *extra, logger=records) == 0
        losses[precision] = [m["train/loss"] for _, m in records.records if "train/loss" in m]
    assert len(losses["bf16"]) == 3 and all(map(math.isfinite, losses["bf16"]))
    if cpu_bf16:
        assert "bf16 autocast on this CPU's AVX512_BF16" in caplog.text
        assert losses["bf16"] != losses["fp32"]
        assert losses["bf16"] == pytest.approx(losses["fp32"], rel=2e-2)
    else:
        assert "no bf16 instructions (AVX512_BF16, AMX): training in fp32" in caplog.text
        assert losses["bf16"] == losses["fp32"]


def _trainer(tiny_params, tiny_shards, run_dir, *overrides) -> train_module.Trainer:
    params = load_params(tiny_params, list(overrides))
    return train_module.Trainer(params, DistEnv(0, 1, 0, torch.device("cpu")), tiny_shards, run_dir)


def test_twenty_updates_read_the_device_only_at_their_log_points(
    tiny_params, tiny_shards, tmp_path, monkeypatch
):
    """No host sync inside an update: on a GPU each one stalls the queue of kernels (the
    host waits for the GPU, then the GPU for the host). Counted on the CPU as the syncs a
    GPU would make: reads of a tensor's value (.item(), bool(), float(), .tolist()), and
    tensors made of host values (`t[i] = x`, torch.tensor(x): a copy from pageable host
    memory, which waits for the device's queue). 20 updates with clipping, two micro-batches
    each and one non-finite among them, logged every 10: two reads, both at a log point."""
    t = _trainer(tiny_params, tiny_shards, tmp_path / "run", "train.batch_tokens=512",
                 "train.clip_norm=1.0", "train.log_every=10")  # two micro-batches  # fmt: skip
    batches = iter(t.loader)
    real_tolist = torch.Tensor.tolist
    syncs = (torch.ops.aten._local_scalar_dense.default, torch.ops.aten.lift_fresh.default)
    reads = []

    class CountReads(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func in syncs:
                reads.append((t.progress.step, str(func)))
            return func(*args, **(kwargs or {}))

    monkeypatch.setattr(
        torch.Tensor,
        "tolist",
        lambda x: reads.append((t.progress.step, "tolist")) or real_tolist(x),
    )
    real_forward = t.forward_loss

    def nan_at_step_4(batch):
        return [x * (float("nan") if t.progress.step == 4 else 1) for x in real_forward(batch)]

    monkeypatch.setattr(t, "forward_loss", nan_at_step_4)
    with CountReads():
        for _ in range(20):
            t.step([next(batches) for _ in range(t.update_freq)])
            t.progress.step += 1
            if t.progress.step % 10 == 0:
                assert not t.count_bad_steps()
    t.loader.close()
    assert t.update_freq == 2
    assert reads == [(10, "tolist"), (20, "tolist")], reads
    assert t.progress.bad_steps_total == 1 and t.progress.bad_steps == 0


def test_compiled_training_compiles_each_layer_kind_at_most_a_few_times(
    tiny_params, tiny_shards, tmp_path, monkeypatch
):
    """train.compile: each encoder and decoder layer compiled whole (fullgraph, no break),
    and the loss's chunk; over two epochs of bucketed batches of many shapes, three graphs
    (symbolic sizes) and a few more (a batch of one row specialises; validation runs without
    gradients), at most 8 recompilations, not one per shape. Layers of one kind share their
    graphs (three layers, not three compilations)."""
    shapes = set()
    forward_loss = train_module.Trainer.forward_loss

    def record(self, batch):
        shapes.add((tuple(batch.src.shape), tuple(batch.tgt_in.shape)))
        return forward_loss(self, batch)

    monkeypatch.setattr(train_module.Trainer, "forward_loss", record)
    # Dynamo decides the graphs; its eager backend saves compiling them to C++ here.
    monkeypatch.setattr(torch, "compile", functools.partial(torch.compile, backend="eager"))
    loss_module._compiled_chunk.cache_clear()
    torch._dynamo.reset()
    counters.clear()
    epoch = _trainer(tiny_params, tiny_shards, tmp_path / "probe").loader.sampler.batches_per_rank
    assert train(tiny_params, tiny_shards, tmp_path / "run", "train.compile=true",
                 "model.n_layers=3", f"train.max_steps={2 * epoch}",
                 "train.valid_every=1000") == 0  # fmt: skip
    loss_module._compiled_chunk.cache_clear()
    stats = compile_stats()
    assert len(shapes) >= 10, shapes
    assert stats["graph_breaks"] == 0, dict(counters["graph_break"])
    assert stats["recompiles"] <= 8, (stats, len(shapes))


def test_shape_classes_feed_the_trainer_a_few_static_shapes(
    tiny_params, tiny_shards, tmp_path, monkeypatch
):
    """train.shape_classes=4: every batch of two epochs is one of at most 4 (B, S, T)
    shapes; the loss and the token counts see the real targets only (padding rows count
    nothing): the same tokens an epoch as with the length buckets."""
    shapes, tokens = set(), {}
    forward_loss = train_module.Trainer.forward_loss

    def record(self, batch):
        shapes.add((tuple(batch.src.shape), tuple(batch.tgt_in.shape)))
        return forward_loss(self, batch)

    monkeypatch.setattr(train_module.Trainer, "forward_loss", record)
    for k in (0, 4):
        probe = _trainer(
            tiny_params, tiny_shards, tmp_path / f"probe{k}", f"train.shape_classes={k}"
        )
        epoch = probe.loader.sampler.batches_per_rank
        shapes.clear()
        run = tmp_path / f"run{k}"
        assert train(tiny_params, tiny_shards, run, f"train.shape_classes={k}",
                     f"train.max_steps={epoch}", "train.valid_every=1000") == 0  # fmt: skip
        tokens[k] = final_state(run)["progress"]["tokens_seen"]
    assert len({(src[0], src[1], tgt[1]) for src, tgt in shapes}) <= 4, shapes
    assert tokens[4] == tokens[0]


# --------------------------------------------------------------------------- processes

KILL_PARAMS = [
    "train.max_steps=40",
    "train.batch_tokens=512",  # two micro-batches of 256 an update
    "train.save_every=5",
    "train.valid_every=20",
    "train.log_every=10",
]


@pytest.fixture(scope="module")
def straight(tiny_params, tiny_shards, tmp_path_factory) -> dict:
    """The uninterrupted run that killed and stopped runs must reproduce bit for bit."""
    out = tmp_path_factory.mktemp("straight") / "run"
    done = subprocess.run(
        cli(tiny_params, tiny_shards, out, *KILL_PARAMS),
        env=ENV,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    return final_state(out)


def _start_and_wait(cmd: list[str], first_checkpoint: Path) -> subprocess.Popen:
    proc = subprocess.Popen(
        cmd, env=ENV, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    deadline = time.monotonic() + 120
    while not first_checkpoint.exists():
        assert proc.poll() is None, proc.stdout.read()
        assert time.monotonic() < deadline
        time.sleep(0.01)
    return proc


def test_resume_after_sigkill_is_bitwise_exact(straight, tiny_params, tiny_shards, tmp_path):
    out = tmp_path / "run"
    cmd = cli(tiny_params, tiny_shards, out, *KILL_PARAMS)
    proc = _start_and_wait(cmd, out / "checkpoints" / "state-0000010.pt")
    proc.kill()  # SIGKILL: no chance to save
    proc.wait()
    killed_at = final_state(out)["step"]
    assert 10 <= killed_at < 40, "the run finished before it could be killed"
    done = subprocess.run(cmd, env=ENV, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert f"at step {killed_at}" in done.stdout
    assert_same_training(straight, final_state(out))


def test_sigterm_finishes_the_update_saves_and_exits_143(
    straight, tiny_params, tiny_shards, tmp_path
):
    out = tmp_path / "run"
    cmd = cli(tiny_params, tiny_shards, out, *KILL_PARAMS)
    proc = _start_and_wait(cmd, out / "checkpoints" / "state-0000005.pt")
    proc.send_signal(signal.SIGTERM)
    output, _ = proc.communicate(timeout=60)
    assert proc.returncode == 128 + signal.SIGTERM, output
    stopped = final_state(out)["step"]
    assert f"stopped by SIGTERM at step {stopped}, checkpoint saved" in output
    assert stopped < 40
    done = subprocess.run(cmd, env=ENV, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert_same_training(straight, final_state(out))


class StopAtStep10(ListLogger):
    """SIGTERM to this process as step 10 logs: the stop lands at step 11, off the cadence."""

    def log(self, metrics, step):
        super().log(metrics, step)
        if step == 10:
            os.kill(os.getpid(), signal.SIGTERM)


def test_a_stop_between_saves_leaves_no_trace_in_the_result(tiny_params, tiny_shards, tmp_path):
    """The stop saves a training state, no model snapshot (one would enter the average in
    place of a snapshot on the cadence), and the resumed run ends with the uninterrupted
    run's files, average and logged training loss."""
    runs = {"stopped": ListLogger(), "straight": ListLogger()}
    stopped, straight = (tmp_path / name for name in runs)
    assert train(tiny_params, tiny_shards, stopped, *KILL_PARAMS, logger=StopAtStep10()) == 143
    assert final_state(stopped)["step"] == 11
    assert names(stopped, "model")[-1] == "model-0000010.pt"
    for name, logger in runs.items():
        assert train(tiny_params, tiny_shards, tmp_path / name, *KILL_PARAMS, logger=logger) == 0
    assert_same_training(final_state(straight), final_state(stopped))
    for kind in ("model", "state"):
        assert names(stopped, kind) == names(straight, kind)
    for run in (stopped, straight):
        assert average_main([str(run), "--last", "2", "--out", str(run / "avg.pt")]) == 0
    a, b = (model_file.load_model_file(run / "avg.pt").model for run in (stopped, straight))
    assert all(torch.equal(a[k], b[k]) for k in a)
    loss = {name: {s: m["train/loss"] for s, m in r.records if "train/loss" in m}
            for name, r in runs.items()}  # fmt: skip
    assert loss["stopped"][20] == pytest.approx(loss["straight"][20], rel=1e-6)


SLOW_RENDEZVOUS = """\
import sys, time
from pathlib import Path
import transformer.train as train

rendezvous = train.init_distributed

def slow_rendezvous():  # the other ranks, or nodes, come late
    Path(sys.argv[1] + ".waiting").touch()
    while not Path(sys.argv[1]).exists():
        time.sleep(0.05)
    return rendezvous()

train.init_distributed = slow_rendezvous
sys.exit(train.main(sys.argv[2:]))
"""
LAUNCHER = (  # torchrun's part: start the rank (telling it this pid, or not), say its pid
    # (the rank's output elsewhere: a pipe closed under it would end it), wait
    "import os, subprocess, sys; from transformer.processes import LAUNCHER_PID; "
    "os.environ.update({LAUNCHER_PID: str(os.getpid())} if sys.argv[1] == 'says' else {}); "
    "p = subprocess.Popen(sys.argv[2:], stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT); "
    "print(p.pid, flush=True); p.wait()"
)


@pytest.mark.parametrize("launcher", ["says", "silent"])
def test_a_rank_whose_launcher_dies_during_the_rendezvous_ends(
    launcher, tiny_params, tiny_shards, tmp_path
):
    """A torchrun killed while its ranks wait for the others: the death signal is set only
    after the rendezvous, too late to fire; a rank that finds its parent gone by then ends
    before it touches the run folder, not training on beside a rerun. A launcher that says
    its pid (tasks/torchrun.py) may die even before the rank asks; torchrun itself, once
    the rank has asked its parent."""
    (tmp_path / "slow.py").write_text(SLOW_RENDEZVOUS)
    out, go = tmp_path / "run", tmp_path / "go"
    rank = [sys.executable, str(tmp_path / "slow.py"), str(go),
            *cli(tiny_params, tiny_shards, out, *KILL_PARAMS)[3:], "train.max_steps=100000",
            "--die-with-parent"]  # fmt: skip
    env = {**ENV, "PYTHONPATH": str(ROOT)}  # slow.py runs from tmp_path
    proc = subprocess.Popen([sys.executable, "-c", LAUNCHER, launcher, *rank], env=env,
                            cwd=ROOT, stdout=subprocess.PIPE, text=True)  # fmt: skip
    with proc.stdout:
        pid = int(proc.stdout.readline())
    try:
        if launcher == "silent":
            wait_for(Path(f"{go}.waiting").exists, 120, proc, "the rank's rendezvous")
        proc.kill()
        proc.wait()
        go.touch()
        assert ends_within(pid, 120), "the orphaned rank went on for 120 s"
    except BaseException:
        if alive(pid):
            os.kill(pid, signal.SIGKILL)
        raise
    assert not (out / "checkpoints").exists()


def test_tasks_torchrun_tells_its_ranks_its_pid(tmp_path):
    """...and the rank takes it out of its environment: a process the rank started that
    read it would find its own parent elsewhere and end itself."""
    script = tmp_path / "rank.py"
    script.write_text(
        "import os, sys; from transformer.processes import LAUNCHER_PID, started_by\n"
        "said, asked, out = os.environ[LAUNCHER_PID], started_by(), open(sys.argv[1], 'w')\n"
        "print(said, os.getppid(), asked, LAUNCHER_PID in os.environ, file=out)\n"
    )
    cmd = [sys.executable, "-m", "tasks.torchrun", "--nnodes", "1", "--nproc_per_node", "1",
           "--rdzv-backend", "c10d", "--rdzv-endpoint", "127.0.0.1:0", "--local-addr",
           "127.0.0.1", str(script), str(tmp_path / "said")]  # fmt: skip
    env = {**ENV, "PYTHONPATH": str(ROOT)}
    done = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    said, parent, asked, left = (tmp_path / "said").read_text().split()
    assert said == parent == asked  # the rank's parent: torchrun's agent
    assert left == "False"  # not passed on to what the rank starts


def test_a_rank_orphaned_by_a_killed_torchrun_saves_and_exits(tiny_params, tiny_shards, tmp_path):
    """torchrun puts each rank in a session of its own: SIGKILL torchrun alone, and the rank
    must not train on beside a rerun; it gets SIGTERM, saves, and releases the run folder."""
    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node",
           "1", "-m", "transformer.train", *cli(tiny_params, tiny_shards, out, *KILL_PARAMS)[3:],
           "train.max_steps=100000"]  # fmt: skip
    proc = _start_and_wait(cmd, out / "checkpoints" / "state-0000005.pt")
    proc.kill()  # torchrun only: the rank is in another session
    proc.wait()
    rerun = subprocess.run(  # takes the lock only once the orphan has saved and exited
        cli(tiny_params, tiny_shards, out, *KILL_PARAMS[1:], "train.max_steps=1"),
        env=ENV, cwd=ROOT, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert rerun.returncode == 0, rerun.stderr
    assert 5 <= final_state(out)["step"] < 100000  # the orphan stopped, and saved
    assert "nothing to do" in rerun.stderr + rerun.stdout
