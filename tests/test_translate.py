"""translate end to end: a tiny random model and a tiny sentencepiece model in an exported
model file, through translate_lines and the command line."""

import dataclasses
import io
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest
import sentencepiece as spm
import torch

from transformer.checkpoint import ModelFile, load_model_file, save_model_file
from transformer.config import DecodeConfig, ModelConfig, load_params, to_dict
from transformer.evaluate import detokenize
from transformer.model import Transformer
from transformer.search import greedy_search
from transformer.translate import load_translator, main, translate_lines
from transformer.vocab import BOS, EOS, PAD, UNK

ROOT = Path(__file__).resolve().parents[1]
WORDS = "the house is small a cat sat on mat das haus ist klein eine katze sass auf der matte"
LINES = [
    "the cat sat on the mat",
    "",
    "das haus ist klein und die katze sass auf der matte",
    "   ",
    "a house",
    "the small cat is on a small mat and the house is small",
]


# Tiny models gain nothing from threads (see conftest.one_thread).
pytestmark = pytest.mark.usefixtures("one_thread")


def train_spm() -> bytes:
    rng = random.Random(0)
    words = WORDS.split()
    corpus = [" ".join(rng.choices(words, k=rng.randint(3, 12))) for _ in range(300)]
    model = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(corpus),
        model_writer=model,
        model_type="bpe",
        vocab_size=60,
        pad_id=PAD,
        unk_id=UNK,
        bos_id=BOS,
        eos_id=EOS,
        minloglevel=2,
    )
    return model.getvalue()


@pytest.fixture(scope="module")
def model_file(tmp_path_factory):
    params = load_params(ROOT / "params/smoke.yaml", ["model.dropout=0.0", "decode.max_len_b=8"])
    spm_model = train_spm()
    sp = spm.SentencePieceProcessor(model_proto=spm_model)
    torch.manual_seed(0)
    model = Transformer(params.model, vocab_size=sp.get_piece_size())
    path = tmp_path_factory.mktemp("model") / "model.pt"
    save_model_file(path, ModelFile(to_dict(params), model.state_dict(), spm_model, {"step": 0}))
    return path


def test_translate_lines_keeps_order_and_empty_lines_and_batches_alike(model_file):
    model, sp, params = load_translator(model_file, "cpu")
    assert not model.training
    cfg = params.decode  # the paper's beam 4, alpha 0.6; max_len_b lowered for speed
    out = translate_lines(model, sp, LINES, cfg, "cpu")
    assert len(out) == len(LINES)
    assert out[1] == out[3] == ""
    assert all(out[i] for i in (0, 2, 4, 5))
    # One sentence per batch (max_tokens 1) gives the same translations, in the same order.
    alone = translate_lines(model, sp, LINES, cfg.model_copy(update={"max_tokens": 1}), "cpu")
    assert alone == out


def test_beam_one_is_greedy_and_outputs_are_detokenized(model_file):
    model, sp, _ = load_translator(model_file, "cpu")
    cfg = DecodeConfig(beam_size=1, max_len_b=8)
    out = translate_lines(model, sp, LINES[:1], cfg, "cpu")
    src = torch.tensor([sp.encode(LINES[0], add_eos=True)])
    assert out == detokenize(sp, greedy_search(model, src, 1.0, 8))


def test_command_line_file_to_file(model_file, tmp_path):
    src, hyp = tmp_path / "src.txt", tmp_path / "hyp.txt"
    src.write_text("\n".join(LINES) + "\n", encoding="utf-8")
    assert main(["--model", str(model_file), "--input", str(src), "--output", str(hyp)]) == 0
    model, sp, params = load_translator(model_file, "cpu")
    expected = translate_lines(model, sp, LINES, params.decode, "cpu")
    assert hyp.read_text(encoding="utf-8") == "".join(line + "\n" for line in expected)


def test_command_line_reads_stdin_and_writes_stdout(model_file):
    out = subprocess.run(
        [sys.executable, "-m", "transformer.translate", "--model", str(model_file), "--beam", "2"],
        input=b"a house\n\nthe cat\n",
        capture_output=True,
        cwd=ROOT,
        env={**os.environ, "OMP_NUM_THREADS": "1"},  # see conftest.one_thread()
        timeout=120,
    )
    assert out.returncode == 0, out.stderr.decode()
    lines = out.stdout.decode("utf-8").split("\n")
    assert len(lines) == 4 and lines[1] == "" and lines[3] == ""


def one_line_error(capsys, argv) -> str:
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1, err
    return err


def test_unreadable_or_mismatched_model_files_are_one_line_errors(model_file, tmp_path, capsys):
    assert "no such file" in one_line_error(capsys, ["--model", str(tmp_path / "none.pt")])
    garbage = tmp_path / "garbage.pt"
    garbage.write_bytes(b"not a model")
    assert "unreadable" in one_line_error(capsys, ["--model", str(garbage)])

    good = load_model_file(model_file)
    small = {**good.params, "model": {**good.params["model"], "d_model": 32}}
    other = tmp_path / "other.pt"
    save_model_file(other, dataclasses.replace(good, params=small))
    assert "do not fit its params" in one_line_error(capsys, ["--model", str(other)])

    fewer = {k: v for k, v in good.model.items() if not k.startswith("decoder.1.")}
    save_model_file(other, dataclasses.replace(good, model=fewer))
    assert "missing keys" in one_line_error(capsys, ["--model", str(other)])

    bad = {**good.params, "decode": {"beam_size": 0}}
    save_model_file(other, dataclasses.replace(good, params=bad))
    assert "invalid params: decode.beam_size" in one_line_error(capsys, ["--model", str(other)])

    argv = ["--model", str(model_file), "--beam", "0", "--input", str(garbage)]
    assert "decode.beam_size" in one_line_error(capsys, argv)


def test_learned_position_tables_bound_sources_and_outputs():
    sp = spm.SentencePieceProcessor(model_proto=train_spm())
    cfg = ModelConfig(n_layers=1, d_model=16, d_ff=32, n_heads=2, positional="learned",
                      max_positions=6)  # fmt: skip
    torch.manual_seed(0)
    model = Transformer(cfg, vocab_size=sp.get_piece_size()).eval()
    out = translate_lines(model, sp, LINES, DecodeConfig(), "cpu")  # sources of 6+ pieces
    assert all(len(sp.encode(line)) <= 5 for line in out)
