"""Checkpoint averaging: the exact mean, layout checks that name the file, and the export
that `translate` loads."""

from __future__ import annotations

import shutil

import pytest
import torch

from transformer import model_file
from transformer.config import AverageConfig
from transformer.decoding.translate import load_translator
from transformer.model_file import CheckpointError, atomic_save
from transformer.train import main as train_main
from transformer.training import checkpoint as ckpt
from transformer.training.average import average_checkpoints, export_average, main


def _save(path, model: dict, step: int = 1) -> object:
    return atomic_save({"format": ckpt.SNAPSHOT_FORMAT, "step": step, "model": model}, path)


def test_the_average_is_the_exact_mean(tmp_path):
    shared = torch.tensor([[1.0, 2.0], [3.0, 4.0]])
    a = {
        "emb": shared,
        "out": shared,
        "b": torch.tensor([1.0, -1.0]),
        "h": torch.tensor([0.5], dtype=torch.bfloat16),
        "n": torch.tensor([7]),
    }
    b = {
        "emb": shared * 3,
        "out": shared * 3,
        "b": torch.tensor([2.0, 5.0]),
        "h": torch.tensor([1.5], dtype=torch.bfloat16),
        "n": torch.tensor([8]),
    }
    avg = average_checkpoints([_save(tmp_path / "a.pt", a), _save(tmp_path / "b.pt", b)])
    assert torch.equal(avg["emb"], shared * 2)
    assert torch.equal(avg["b"], torch.tensor([1.5, 2.0]))
    assert avg["h"].dtype == torch.bfloat16 and avg["h"].item() == 1.0  # fp32 sum, cast back
    assert torch.equal(avg["n"], torch.tensor([8]))  # not a float: the last file's
    assert avg["out"] is avg["emb"]  # tied weights stay tied (one copy in the file)


def test_mismatched_keys_or_shapes_name_the_file(tmp_path):
    a = _save(tmp_path / "a.pt", {"w": torch.zeros(2, 3)})
    extra = _save(tmp_path / "extra.pt", {"w": torch.zeros(2, 3), "v": torch.zeros(1)})
    with pytest.raises(CheckpointError, match=r"extra\.pt: keys differ .*unexpected \['v'\]"):
        average_checkpoints([a, extra])
    wide = _save(tmp_path / "wide.pt", {"w": torch.zeros(2, 4)})
    with pytest.raises(CheckpointError, match=r"wide\.pt: w has shape \(2, 4\), a\.pt has"):
        average_checkpoints([a, wide])
    atomic_save({"nothing": 1}, tmp_path / "empty.pt")
    with pytest.raises(CheckpointError, match="holds no model"):
        average_checkpoints([a, tmp_path / "empty.pt"])


@pytest.fixture(scope="module")
def run_dir(tiny_params, tiny_shards, tmp_path_factory):
    out = tmp_path_factory.mktemp("avg") / "run"
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        argv = [str(tiny_params), "--data", str(tiny_shards), "--out", str(out)]
        assert (
            train_main([*argv, "train.max_steps=6", "train.valid_every=6", "train.keep_last=3"])
            == 0
        )
    finally:
        torch.set_num_threads(threads)
    return out


def test_export_round_trips_into_a_translator(run_dir, tmp_path):
    out = export_average(run_dir, AverageConfig(last_n=2), tmp_path / "model.pt")
    mf = model_file.load_model_file(out)
    last_two = ckpt.list_files(run_dir, "model")[-2:]
    assert mf.meta["averaged_from"] == ["model-0000004.pt", "model-0000006.pt"]
    assert mf.meta["steps"] == [4, 6] and mf.meta["step"] == 6
    newest = model_file.load_typed(last_two[-1], ckpt.SNAPSHOT_FORMAT)
    assert mf.meta["data_fingerprint"] == newest["data_fingerprint"]
    assert mf.params == newest["params"]
    assert mf.spm_model == (run_dir / "spm.model").read_bytes()
    expected = average_checkpoints(last_two)
    assert all(torch.equal(mf.model[k], expected[k]) for k in expected)
    model, sp, params = load_translator(out, "cpu")
    assert params.model.d_model == 32 and sp.get_piece_size() == 100
    assert torch.equal(model.state_dict()["out_proj.weight"], expected["out_proj.weight"])


def test_too_few_snapshots_is_an_error_that_counts_them(run_dir, tmp_path):
    with pytest.raises(CheckpointError, match=r"3 last snapshot\(s\) .* 4 to average"):
        export_average(run_dir, AverageConfig(last_n=4), tmp_path / "model.pt")
    # Snapshots past train.max_steps (a run trained further than these params ask) are not
    # averaged.
    out = export_average(run_dir, AverageConfig(last_n=2), tmp_path / "m.pt", max_step=4)
    assert model_file.load_model_file(out).meta["steps"] == [2, 4]


def test_cli_takes_a_run_folder_or_files(run_dir, tmp_path, capsys):
    assert main([str(run_dir), "--last", "3", "--out", str(tmp_path / "a.pt")]) == 0
    assert model_file.load_model_file(tmp_path / "a.pt").meta["steps"] == [2, 4, 6]
    # Without --last: the run's own average section (last_n 2 in the tiny params).
    assert main([str(run_dir), "--out", str(tmp_path / "b.pt")]) == 0
    assert model_file.load_model_file(tmp_path / "b.pt").meta["steps"] == [4, 6]
    assert main([str(run_dir), "--best", "1", "--out", str(tmp_path / "best.pt")]) == 0
    assert len(model_file.load_model_file(tmp_path / "best.pt").meta["steps"]) == 1
    # Several run folders (a run, then its further cooldowns): the same selection in each.
    branch = shutil.copytree(run_dir, tmp_path / "branch")
    assert main([str(run_dir), str(branch), "--last", "2", "--out", str(tmp_path / "s.pt")]) == 0
    soup = model_file.load_model_file(tmp_path / "s.pt")
    assert soup.meta["averaged_from"] == [f"{d}/model-000000{s}.pt" for d in ("run", "branch")
                                          for s in (4, 6)]  # fmt: skip
    alone = model_file.load_model_file(tmp_path / "b.pt").model
    assert all(torch.allclose(soup.model[k], alone[k]) for k in alone)
    files = [str(p) for p in ckpt.list_files(run_dir, "model")[:2]]
    assert main([*files, "--out", str(tmp_path / "c.pt")]) == 0
    assert model_file.load_model_file(tmp_path / "c.pt").meta["steps"] == [2, 4]
    capsys.readouterr()
    for bad in (["--last", "9"], ["--last", "-1"], ["--last", "0"], ["--last", "x"]):
        assert main([str(run_dir), *bad, "--out", str(tmp_path / "d.pt")]) == 2, bad
        err = capsys.readouterr().err
        assert len(err.strip().splitlines()) == 1 and err.startswith("error:"), err
    assert not (tmp_path / "d.pt").exists()
