"""Params: the shipped files validate, and every kind of bad input is one clear error."""

import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tasks.settings import RunParams, load_run_params
from transformer.config import (
    ParamsError,
    Section,
    added,
    fingerprint,
    flatten,
    identity,
    load_params,
    operational,
    operational_keys,
    params_hash,
    to_dict,
    to_yaml,
)

ROOT = Path(__file__).resolve().parents[1]
PARAMS = ROOT / "params"
PINNED_IDENTITIES = {  # base.yaml's, unchanged since c7868a0 (before train.cooldown_shape)
    "data": "84400d623a4057ac",
    "clean": "83d868cc4bf3da12",
    "vocab": "10278a5e79f5e292",
    "shard": "a258c432ecd6bfb0",
    "model": "5ad26a110a939859",
    "train": "a19dd9c217e59536",
    "average": "d051a954231c9192",
    "decode": "91501822bd2003cb",
    "score": "1f7c8a2f08d4719f",
    "export": "4a2d8490479b9d68",
}


def test_base_holds_the_papers_values():
    p = load_params(PARAMS / "base.yaml")
    m = p.model
    assert (m.n_layers, m.d_model, m.d_ff, m.n_heads, m.dropout) == (6, 512, 2048, 8, 0.1)
    assert not m.norm_first and m.positional == "sinusoidal" and m.share_embeddings
    assert p.vocab.size == 37000 and p.vocab.model_type == "bpe"
    assert p.train.adam_betas == [0.9, 0.98] and p.train.adam_eps == 1e-9
    assert p.train.warmup_steps == 4000 and p.train.max_steps == 100_000
    assert p.train.label_smoothing == 0.1
    assert p.average.last_n == 5
    d = p.decode
    assert (d.beam_size, d.len_penalty, d.max_len_a, d.max_len_b) == (4, 0.6, 1.0, 50)
    assert p.data.source.hub == "wmt/wmt14" and len(p.data.source.revision) == 40


def test_big_extends_base_and_states_only_the_difference():
    big = load_params(PARAMS / "big.yaml")
    m = big.model
    assert (m.d_model, m.d_ff, m.n_heads, m.dropout) == (1024, 4096, 16, 0.3)
    assert big.train.max_steps == 300_000 and big.average.last_n == 20
    assert big.train.warmup_steps == 4000  # inherited
    base = flatten(to_dict(load_params(PARAMS / "base.yaml")))
    stated = flatten(yaml.safe_load((PARAMS / "big.yaml").read_text()))
    stated.pop("extends")
    assert stated and all(base[k] != v for k, v in stated.items()), "restates a base value"


def test_smoke_is_tiny_and_local():
    p = load_params(PARAMS / "smoke.yaml")
    assert p.data.source.path == "data/smoke" and p.data.source.hub is None
    assert p.model.d_model <= 128 and p.train.max_steps <= 1000


def test_overrides_are_typed_and_change_the_hash():
    a = load_params(PARAMS / "base.yaml")
    b = load_params(PARAMS / "base.yaml", ["model.dropout=0.2", "train.adam_betas=[0.9,0.99]"])
    assert b.model.dropout == 0.2 and b.train.adam_betas == [0.9, 0.99]
    assert params_hash(a) != params_hash(b)
    assert params_hash(a) == params_hash(load_params(PARAMS / "base.yaml"))


def test_each_key_is_declared_identity_or_operational_once():
    keys = operational_keys()
    assert {"train.max_steps", "train.log_every", "train.valid_every", "train.save_every",
            "train.patience", "shard.workers", "train.max_tokens"} <= keys  # fmt: skip
    assert not keys & {"model.d_model", "train.batch_tokens", "train.seed", "vocab.size"}
    p = load_params(PARAMS / "base.yaml")
    q = load_params(PARAMS / "base.yaml", ["train.max_steps=5", "train.valid_every=7"])
    assert identity(p.train) == identity(q.train) and "max_steps" not in identity(p.train)
    r = load_params(PARAMS / "base.yaml", ["train.lr_scale=2.0"])
    assert identity(p.train) != identity(r.train)
    # The pipeline's own section is validated with the pipeline's schema; the library
    # leaves it alone, and it is in no run's identity.
    assert set(operational_keys(RunParams)) >= {"pipeline.nproc_per_node"}
    with pytest.raises(ParamsError, match=r"pipeline\.nproc_per_node: Input should be"):
        load_run_params(PARAMS / "base.yaml", ["pipeline.nproc_per_node=many"])
    assert params_hash(load_run_params(PARAMS / "base.yaml", ["pipeline.experiment=x"])) == (
        params_hash(p)
    )


def test_a_key_added_at_its_default_renames_no_stage():
    # A work dir made before a key existed must resume, not train again: at its default,
    # which is what every earlier run did, the key is in no identity; set otherwise, it is.
    class Before(Section):
        lr: float = 1.0
        every: int = operational(10)

    class After(Before):
        shape: str = added("linear")

    assert identity(After()) == identity(Before()) == {"lr": 1.0}
    assert identity(After(shape="1-sqrt")) == {"lr": 1.0, "shape": "1-sqrt"}

    class Later(After):
        workers: int = operational(0, added=True)

    assert identity(Later(workers=4)) == identity(Before())
    assert params_hash(Later()) == params_hash(Before()) != params_hash(Later(workers=4))
    p = load_params(PARAMS / "base.yaml")
    q = load_params(PARAMS / "base.yaml", ["train.cooldown_shape=1-sqrt"])
    assert "cooldown_shape" not in identity(p.train) and identity(q.train) != identity(p.train)
    explicit = load_params(PARAMS / "base.yaml", ["train.cooldown_shape=linear"])
    assert params_hash(explicit) == params_hash(p)
    before = to_dict(p)
    # added since c7868a0
    for key in ("cooldown_shape", "cooldown_dropout", "rdrop_alpha", "shape_classes"):
        del before["train"][key]
    del before["average"]["cooldowns"]
    del before["distill"]  # added since 4bd7796
    assert params_hash(p) == fingerprint(before) and params_hash(q) != params_hash(p)


def test_the_stage_identities_of_the_base_params_are_pinned():
    # Every work dir's stage folders are named by these: a change here makes every existing
    # work dir train again. Make it on purpose (a new key: declare it `added`), then re-pin.
    p = load_params(PARAMS / "base.yaml")
    sections = {name: getattr(p, name) for name in type(p).model_fields}
    got = {name: fingerprint(identity(s)) for name, s in sections.items() if s is not None}
    assert got == PINNED_IDENTITIES, got


def test_strict_types_and_duplicate_keys(tmp_path):
    with pytest.raises(ParamsError, match=r"train\.max_steps: Input should be a valid integer"):
        load_params(PARAMS / "base.yaml", ["train.max_steps=true"])
    with pytest.raises(ParamsError, match=r"model\.dropout: Input should be a valid number"):
        load_params(PARAMS / "base.yaml", ["model.dropout=yes"])
    path = _write(tmp_path, "data: {source: {path: x}}\nmodel:\n  d_model: 64\n  d_model: 128\n")
    with pytest.raises(ParamsError, match=r"line 4, column 3: malformed YAML: duplicate key"):
        load_params(path)


def test_resolved_yaml_round_trips(tmp_path):
    p = load_params(PARAMS / "big.yaml", ["train.seed=7"])
    out = tmp_path / "resolved.yaml"
    out.write_text(to_yaml(p))
    assert to_dict(load_params(out)) == to_dict(p)
    assert flatten(to_dict(p))["model.d_model"] == 1024


def _write(tmp_path, text, name="p.yaml"):
    path = tmp_path / name
    path.write_text(text)
    return path


@pytest.mark.parametrize(
    ("overrides", "key", "fragment"),
    [
        (["model.d_modl=3"], "model.d_modl", "unknown key"),
        (["model.d_model=500"], "model.d_model", "not divisible by n_heads"),
        (["train.warmup_steps=0"], "train.warmup_steps", "greater than 0"),
        (["train.max_steps=many"], "train.max_steps", "integer"),
        (["model.positional=rotary"], "model.positional", "sinusoidal"),
        (["average.last_n=9"], "average.last_n", "keep_last"),
        (["data.source.revision=null"], "data.source", "revision"),
        (["clean.min_len=300"], "clean.min_len", "max_len"),
        (["train.best_metric=bleu"], "train.best_metric", "valid_bleu"),
        (["train.cooldown_dropout=0.1"], "train.cooldown_dropout", "train.cooldown > 0"),
        (["train.cooldown=0.2", "train.cooldown_dropout=0.1"], "train.cooldown_dropout", "alre"),
        (["average.cooldowns=2"], "average.cooldowns", "train.cooldown > 0"),
        (["export.quantization=int4"], "export.quantization", "int8"),
        (["export.formats=[onnx]"], "export.formats", "ctranslate2"),
        (["train.adam_betas=[0.9,1.5]"], "train.adam_betas", "[0, 1)"),
        (["shard.copies=3"], "shard.copies", "tgt_bpe_dropout > 0"),
        (["shard.tgt_bpe_dropout=0.1", "vocab.model_type=unigram"], "shard.tgt_bpe_dropout", "bpe"),
    ],
)
def test_bad_values_name_the_file_and_key(overrides, key, fragment):
    with pytest.raises(ParamsError) as err:
        load_params(PARAMS / "base.yaml", overrides)
    msg = str(err.value)
    assert "base.yaml" in msg and key in msg and fragment in msg, msg


def test_missing_data_source(tmp_path):
    path = _write(tmp_path, "model: {d_model: 64, n_heads: 4}\n")
    with pytest.raises(ParamsError, match=r"p\.yaml: data: required key is missing"):
        load_params(path)
    both = _write(tmp_path, "data: {source: {path: x, hub: y}}\n", "both.yaml")
    with pytest.raises(ParamsError, match=r"data\.source: give exactly one"):
        load_params(both)


def test_malformed_yaml_names_the_line(tmp_path):
    path = _write(tmp_path, "data:\n  source: {path: x}\nmodel:\n  d_model: [1\n")
    with pytest.raises(ParamsError, match=r"p\.yaml: line \d+, column \d+: malformed YAML"):
        load_params(path)


def test_extends_cycle_and_missing_parent(tmp_path):
    _write(tmp_path, "extends: b.yaml\n", "a.yaml")
    _write(tmp_path, "extends: a.yaml\n", "b.yaml")
    with pytest.raises(ParamsError, match="cycle"):
        load_params(tmp_path / "a.yaml")
    _write(tmp_path, "extends: nowhere.yaml\n", "c.yaml")
    with pytest.raises(ParamsError, match=r"nowhere\.yaml: no such params file"):
        load_params(tmp_path / "c.yaml")


def test_bad_override_syntax():
    with pytest.raises(ParamsError, match="not of the form"):
        load_params(PARAMS / "smoke.yaml", ["model.d_model"])
    with pytest.raises(ParamsError, match=r"model\.d_model is not a section"):
        load_params(PARAMS / "smoke.yaml", ["model.d_model.x=1"])


def test_cli_prints_yaml_or_fails_with_exit_2():
    ok = subprocess.run(
        [sys.executable, "-m", "transformer.config", str(PARAMS / "big.yaml"), "train.seed=3"],
        capture_output=True,
        text=True,
    )
    assert ok.returncode == 0 and "d_model: 1024" in ok.stdout and "seed: 3" in ok.stdout
    bad = subprocess.run(
        [sys.executable, "-m", "transformer.config", str(PARAMS / "base.yaml"), "model.x=1"],
        capture_output=True,
        text=True,
    )
    assert bad.returncode == 2
    assert "model.x: unknown key" in bad.stderr and "Traceback" not in bad.stderr
