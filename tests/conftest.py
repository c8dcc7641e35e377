"""Shared fixtures: a tiny parallel corpus, its sentencepiece model, its shards, and params
for a tiny model that trains in a fraction of a second per step on a CPU."""

from __future__ import annotations

import os
import random
import textwrap
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from workers import pytest_xdist_make_scheduler  # noqa: F401 (make test's two workers)

from transformer.config import ShardConfig, VocabConfig
from transformer.data.shard import encode_and_shard
from transformer.data.vocab import learn_vocab

# A word-for-word "translation": learnable by a tiny model within a few hundred steps.
LEXICON = {
    "the": "der",
    "a": "ein",
    "man": "mann",
    "woman": "frau",
    "dog": "hund",
    "cat": "katze",
    "runs": "rennt",
    "walks": "geht",
    "sleeps": "schlaeft",
    "in": "im",
    "park": "park",
    "garden": "garten",
    "red": "rot",
    "blue": "blau",
    "big": "gross",
    "small": "klein",
    "child": "kind",
    "plays": "spielt",
    "house": "haus",
    "green": "gruen",
}
SIZES = {"train": 400, "valid": 40, "test": 30}


def tiny_pairs(n: int, rng: random.Random) -> tuple[list[str], list[str]]:
    words = list(LEXICON)
    src = [" ".join(rng.choices(words, k=rng.randint(2, 10))) for _ in range(n)]
    return src, [" ".join(LEXICON[w] for w in s.split()) for s in src]


@pytest.fixture(scope="session")
def tiny_corpus(tmp_path_factory) -> Path:
    """A cleaned corpus folder: {train,valid,test}.parquet with string columns src, tgt."""
    clean = tmp_path_factory.mktemp("tiny") / "clean"
    clean.mkdir()
    rng = random.Random(0)
    for role, n in SIZES.items():
        src, tgt = tiny_pairs(n, rng)
        pq.write_table(pa.table({"src": src, "tgt": tgt}), clean / f"{role}.parquet")
    return clean


@pytest.fixture(scope="session")
def tiny_spm(tiny_corpus, tmp_path_factory) -> Path:
    """A 100-piece joint BPE model of the tiny corpus, with the project's special ids."""
    out = tmp_path_factory.mktemp("tiny_vocab") / "vocab"
    return learn_vocab(tiny_corpus / "train.parquet", VocabConfig(size=100, sample_size=800), out)


@pytest.fixture(scope="session")
def tiny_shards(tiny_corpus, tiny_spm, tmp_path_factory) -> Path:
    """The shards folder (manifest.json, spm.model, {train,valid,test}/*.arrow)."""
    out = tmp_path_factory.mktemp("tiny_shards") / "shards"
    encode_and_shard(
        tiny_corpus, tiny_spm, ShardConfig(bucket_width=4, rows_per_shard=100, workers=1), out
    )
    return out


TINY_PARAMS = """\
    data:
      source: {path: unused-by-training}
      src_lang: en
      tgt_lang: de
    vocab: {size: 100}
    model: {n_layers: 1, d_model: 32, d_ff: 64, n_heads: 2, dropout: 0.1}
    train:
      batch_tokens: 256
      max_tokens: 256
      max_steps: 8
      warmup_steps: 4
      lr_scale: 2.0
      precision: fp32
      save_every: 2
      keep_last: 3
      valid_every: 4
      log_every: 2
    average: {last_n: 2}
    decode: {max_len_b: 12}
"""


@pytest.fixture(scope="session")
def tiny_params(tmp_path_factory) -> Path:
    """A params file for a one-layer, d_model 32 model: 8 steps, a checkpoint every 2."""
    path = tmp_path_factory.mktemp("tiny_params") / "tiny.yaml"
    path.write_text(textwrap.dedent(TINY_PARAMS))
    return path


@pytest.fixture(scope="session")
def tiny_run(tiny_params, tiny_shards, tmp_path_factory) -> tuple[Path, Path]:
    """A run of tiny_params trained 4 steps (snapshots at 2 and 4) and its model file (the two
    averaged): the good files that the bad-input tests refuse others beside. Read only."""
    from transformer import train
    from transformer.config import AverageConfig
    from transformer.training import average

    root = tmp_path_factory.mktemp("tiny_run")
    run = root / "run"
    steps = ["train.max_steps=4", "train.save_every=2", "train.valid_every=4"]
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        code = train.main([str(tiny_params), *steps, "--data", str(tiny_shards), "--out", str(run)])
    finally:
        torch.set_num_threads(threads)
    assert code == 0
    return run, average.export_average(run, AverageConfig(last_n=2), root / "model.pt")


@pytest.fixture(scope="module")
def one_thread():
    """Tiny models gain nothing from intra-op threads, and on a busy shared machine their
    spin-waits make these tests ten times slower. Modules opt in with `usefixtures`."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="session")
def prefect_api():
    """One Prefect test server (a temporary database) for the modules that run the flow in
    this process (tests/test_flow.py, tests/test_distill.py): its start is paid once. The
    flows pick their own MLflow store (the work dir's), whatever the shell points at."""
    from prefect.testing.utilities import prefect_test_harness

    with pytest.MonkeyPatch.context() as env, prefect_test_harness(server_startup_timeout=120):
        env.delenv("MLFLOW_TRACKING_URI", raising=False)
        env.delenv("MLFLOW_EXPERIMENT_NAME", raising=False)
        yield


# The smoke flow with enough training to learn something, little enough for CI
# (tests/test_flow.py, tests/test_reliability.py).
TINY_FLOW = [
    "train.batch_tokens=1024",
    "train.max_tokens=1024",
    "train.max_steps=40",
    "train.warmup_steps=20",
    "train.save_every=10",
    "train.valid_every=20",
    "train.log_every=10",
    "train.keep_last=3",
    "average.last_n=2",
    "decode.beam_size=2",
    "decode.max_len_b=10",
]


@pytest.fixture(scope="session")
def fresh_flow(tmp_path_factory) -> Path:
    """The work dir of a finished `python -m flows.wmt14_ende params/smoke.yaml` with
    TINY_FLOW, run as a process in a dir of its own: a second fresh run for the bitwise
    check of tests/test_flow.py, and what tests/test_reliability.py tampers with. Shared:
    tests copy it and never write into it."""
    import os
    import subprocess
    import sys

    root = Path(__file__).resolve().parents[1]
    work = tmp_path_factory.mktemp("fresh") / "work"
    cmd = [sys.executable, "-m", "flows.wmt14_ende", str(root / "params" / "smoke.yaml"),
           *TINY_FLOW, "--work-dir", str(work)]  # fmt: skip
    # Its own MLflow store and Prefect server, whatever the shell running the tests points at.
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MLFLOW_", "PREFECT_"))}
    run = subprocess.run(cmd, cwd=root, env=env, capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, (run.stdout + run.stderr)[-3000:]
    return work


@pytest.fixture(scope="session")
def golden_run(tmp_path_factory) -> Path:
    """The work dir of `python -m tests.golden`: the demo's first 200 updates on the shipped
    smoke corpus (tests/golden.py), trained once in a process of its own; `curve.txt` holds
    its curve (tests/test_golden.py), `run/` its checkpoints (smoke_model)."""
    import subprocess
    import sys

    work = tmp_path_factory.mktemp("golden")
    cmd = [sys.executable, "-m", "tests.golden", "--work", str(work), "--out",
           str(work / "curve.txt")]  # fmt: skip
    root = Path(__file__).resolve().parents[1]
    run = subprocess.run(cmd, cwd=root, capture_output=True, text=True, timeout=1800)
    assert (work / "curve.txt").is_file(), (run.stdout + run.stderr)[-3000:]
    return work


@pytest.fixture(scope="session")
def smoke_model(golden_run, tmp_path_factory) -> Path:
    """An exported model trained for 200 steps on the shipped smoke corpus (golden_run's
    last two snapshots averaged): peaked enough that exact comparisons of decoders are
    meaningful."""
    from transformer.config import AverageConfig
    from transformer.training.average import export_average

    model = tmp_path_factory.mktemp("smoke_model") / "model.pt"
    return export_average(golden_run / "run", AverageConfig(last_n=2), model)


def assert_same_updates(got: dict, want: dict, atol: float) -> None:
    """Two runs' model state dicts after the same updates, made by different kernels (ranks,
    compiled code, GPU reductions), agree within `atol`, except W^K's bias (in_proj.bias[D:2D]):
    softmax ignores it, so its true gradient is 0, and Adam turns whatever rounding is left in
    it into steps of +-lr (measured: 0.03-0.15 apart after 3 updates of the tiny model, DDP
    compiled against uncompiled, everything else < 4e-5)."""
    for key, value in got.items():
        expected = want[key]
        if key.endswith("in_proj.bias"):
            d = value.numel() // 3
            value = torch.cat([value[:d], value[2 * d :]])
            expected = torch.cat([expected[:d], expected[2 * d :]])
        torch.testing.assert_close(value, expected, rtol=0, atol=atol, msg=key)


def assert_same_training(a: dict, b: dict) -> None:
    """Bitwise: model, optimizer moments, schedule, data position, step."""
    assert a["step"] == b["step"] and a["progress"] == b["progress"]
    for key in a["model"]:
        assert torch.equal(a["model"][key], b["model"][key]), key
    for pid, moments in a["optimizer"]["state"].items():
        for name, value in moments.items():
            assert torch.equal(value, b["optimizer"]["state"][pid][name]), (pid, name)
    assert a["scheduler"] == b["scheduler"]
    assert a["data"] == b["data"]


def alive(pid: int) -> bool:
    """Whether a process (not necessarily a child) runs: a zombie is dead, waiting for its
    parent."""
    try:
        os.kill(pid, 0)
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (ProcessLookupError, FileNotFoundError):  # FileNotFound: reaped in between
        return False


def ends_within(pid: int, seconds: float) -> bool:
    """Whether process `pid` (not necessarily a child) ends within `seconds`."""
    deadline = time.monotonic() + seconds
    while alive(pid):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.1)
    return True


def count_arenas(monkeypatch, *modules) -> list:
    """The cache Arenas that code looking the name up in `modules` makes from here on."""
    from transformer.nn.kv_cache import Arena

    made = []

    class Counted(Arena):
        def __init__(self):
            super().__init__()
            made.append(self)

    for module in modules:
        monkeypatch.setattr(module, "Arena", Counted)
    return made


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on (for a server a test starts)."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def answers(url: str) -> bool:
    """Whether `url` answers 200 within 2 s (a server's health endpoint)."""
    import urllib.request

    try:
        with urllib.request.urlopen(url, timeout=2) as r:
            return r.status == 200
    except OSError:
        return False


def run_dir(work: Path) -> Path:
    """The training run folder of a flow's work dir (there is one per params)."""
    return next(p for p in (work / "train").iterdir() if not p.name.startswith("."))


def wait_for(ready, seconds: float, proc, what: str) -> None:
    """Poll `ready()` until true, failing if the flow `proc` ends first or time runs out."""
    deadline = time.monotonic() + seconds
    while not ready():
        assert proc.poll() is None, f"the flow ended before {what}: {proc.stdout.read()[-3000:]}"
        assert time.monotonic() < deadline, f"no {what} after {seconds} s"
        time.sleep(0.2)
