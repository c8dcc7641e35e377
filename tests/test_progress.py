"""Decoding and validation say how far they are (console.Progress): done/total, the rate and
the time left, every PROGRESS_EVERY_S seconds where no terminal shows a bar, nothing for a
job done sooner, and only rank 0 in a distributed validation."""

from __future__ import annotations

import contextlib
import io
import logging
import re

import pytest
import torch

from transformer import console
from transformer.config import load_params
from transformer.data.dataset import ShardDataset
from transformer.data.vocab import load_spm
from transformer.decoding import translate
from transformer.decoding.translate import load_translator, translate_lines
from transformer.nn.model import Transformer
from transformer.tokens import PAD
from transformer.training import validate
from transformer.training.distributed import DistEnv

pytestmark = pytest.mark.usefixtures("one_thread")

LINE = re.compile(r"(?P<what>.+): (?P<done>[\d,]+)/(?P<total>[\d,]+) sentences \(\d+%\), "
                  r"[\d.,e+-]+ sentences/s, eta \d+(s|m\d\ds|h\d\dm)$")  # fmt: skip


def _lines(caplog) -> list[re.Match]:
    return [m for r in caplog.records if (m := LINE.fullmatch(r.getMessage()))]


def test_decoding_says_how_far_it_is_every_so_often(tmp_path, monkeypatch, caplog):
    from test_translate import LINES, write_model_file

    model, sp, params = load_translator(write_model_file(tmp_path / "m.pt"), "cpu")
    one = params.decode.model_copy(update={"max_tokens": 1, "beam_size": 1})  # a batch a line
    caplog.set_level(logging.INFO, logger="transformer")
    translate_lines(model, sp, LINES, one, "cpu", progress="decoding test")
    assert _lines(caplog) == []  # done in less than PROGRESS_EVERY_S: nothing to say
    monkeypatch.setattr(translate, "PROGRESS_EVERY_S", 0.0)
    translate_lines(model, sp, LINES, one, "cpu", progress="decoding test")
    said = _lines(caplog)
    # 4 non-empty lines, a batch each: a line after each but the last (the stage says that)
    assert [(m["what"], m["done"], m["total"]) for m in said] == [
        ("decoding test", str(i), "4") for i in (1, 2, 3)
    ]
    caplog.clear()
    translate_lines(model, sp, LINES, one, "cpu")  # serving: silent
    assert _lines(caplog) == []


def test_validation_says_how_far_it_is_on_rank_0_only(
    tiny_params, tiny_shards, monkeypatch, caplog
):
    params = load_params(tiny_params, ["train.valid_bleu=true", "train.max_tokens=64"])
    valid = ShardDataset(tiny_shards, "valid")
    sp = load_spm(valid.spm_model)
    model = Transformer(params.model, sp.get_piece_size(), PAD)
    monkeypatch.setattr(validate, "PROGRESS_EVERY_S", 0.0)
    caplog.set_level(logging.INFO, logger="transformer")
    env = DistEnv(rank=0, local_rank=0, world_size=1, device=torch.device("cpu"))
    metrics = validate.validate(model, valid, sp, params, env, contextlib.nullcontext())
    assert set(metrics) == {"valid/loss", "valid/ppl", "valid/bleu"}
    said = _lines(caplog)
    for what in ("validation loss", "validation decoding"):
        mine = [m for m in said if m["what"] == what]
        assert mine and all(m["total"] == "40" for m in mine)  # the valid split's 40 pairs
        assert int(mine[-1]["done"]) < 40
    caplog.clear()
    other = validate.progress("validation loss", validate.valid_batches(valid, params, env),
                              DistEnv(rank=1, local_rank=1, world_size=2,
                                      device=torch.device("cpu")))  # fmt: skip
    other.update(40)
    assert other.total == 0 and _lines(caplog) == []


def test_a_rate_and_a_time_left_in_every_line(monkeypatch, caplog):
    log = logging.getLogger("transformer.test")
    caplog.set_level(logging.INFO, logger="transformer")
    ticks = iter([0.0, 10.0, 20.0])
    monkeypatch.setattr(console.time, "monotonic", lambda: next(ticks))
    meter = console.Progress("decoding test", 3_000, "sentences", log, every_s=5.0)
    meter.update(1_000)  # at 10 s: 100 sentences/s, 2,000 to go
    meter.update(1_000)
    assert [r.getMessage() for r in caplog.records] == [
        "decoding test: 1,000/3,000 sentences (33%), 100 sentences/s, eta 20s",
        "decoding test: 2,000/3,000 sentences (66%), 100 sentences/s, eta 10s",
    ]


def test_what_a_stopped_run_did_counts_as_done_not_toward_the_rate(monkeypatch, caplog):
    """A rerun reads the parts a stopped distillation wrote in a moment: its first line
    would otherwise claim a rate of thousands of sentences a second and no time left."""
    log = logging.getLogger("transformer.test")
    caplog.set_level(logging.INFO, logger="transformer")
    ticks = iter([0.0, 10.0])
    monkeypatch.setattr(console.time, "monotonic", lambda: next(ticks))
    meter = console.Progress("distilling", 3_000, "sentences", log, every_s=5.0, done=2_000)
    meter.update(500)  # 500 decoded in 10 s
    assert [r.getMessage() for r in caplog.records] == [
        "distilling: 2,500/3,000 sentences (83%), 50 sentences/s, eta 10s",
    ]


def test_a_terminals_bar_starts_at_what_a_stopped_run_did(monkeypatch):
    """tqdm's rate is (n - initial) / elapsed: the bar's too leaves out the parts read back."""

    class Terminal(io.StringIO):
        def isatty(self) -> bool:
            return True

    monkeypatch.setattr(console.sys, "stderr", Terminal())
    meter = console.Progress("distilling", 3_000, "sentences", logging.getLogger(), done=2_000)
    meter.update(500)
    assert not meter.bar.disable and (meter.bar.initial, meter.bar.n) == (2_000, 2_500)
