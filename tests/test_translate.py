"""translate end to end: a tiny random model and a tiny sentencepiece model in an exported
model file, through translate_lines and the command line."""

import dataclasses
import gzip
import io
import os
import random
import select
import subprocess
import sys
from pathlib import Path

import pytest
import sentencepiece as spm
import torch

from transformer.config import DecodeConfig, ModelConfig, load_params, to_dict
from transformer.decoding import translate as translate_module
from transformer.decoding.search import beam_search, greedy_search
from transformer.decoding.translate import batch_by_tokens, load_translator, main, translate_lines
from transformer.model_file import ModelFile, load_model_file, save_model_file
from transformer.nn.model import Transformer
from transformer.tokens import BOS, EOS, PAD, UNK

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


def train_spm(seed: int = 0) -> bytes:
    rng = random.Random(seed)
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


def write_model_file(path: Path, seed: int = 0, spm_seed: int = 0, *overrides: str) -> Path:
    fixed = ["model.dropout=0.0", "decode.max_len_b=8"]
    params = load_params(ROOT / "params/smoke.yaml", [*fixed, *overrides])
    spm_model = train_spm(spm_seed)
    sp = spm.SentencePieceProcessor(model_proto=spm_model)
    torch.manual_seed(seed)
    model = Transformer(params.model, vocab_size=sp.get_piece_size())
    save_model_file(path, ModelFile(to_dict(params), model.state_dict(), spm_model, {"step": 0}))
    return path


@pytest.fixture(scope="module")
def model_file(tmp_path_factory):
    return write_model_file(tmp_path_factory.mktemp("model") / "model.pt")


def run_cli(argv: list[str], stdin: bytes = b"") -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "transformer.translate", *argv],
        input=stdin,
        capture_output=True,
        cwd=ROOT,
        env={**os.environ, "OMP_NUM_THREADS": "1"},  # see conftest.one_thread()
        timeout=120,
    )


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


def test_a_lowercased_model_lowercases_its_input_and_others_do_not(model_file, tmp_path):
    """clean.lowercase trains on lowercased text: translate (and the MLflow model and the
    decode stage, which load models the same way) lowercase what they feed such a model."""
    lowered = write_model_file(tmp_path / "lc.pt", 0, 0, "clean.lowercase=true")
    model, sp, params = load_translator(lowered, "cpu")
    assert sp.encode("The CAT sat") == sp.encode("the cat sat")
    assert sp.encode(["The CAT"], add_eos=True) == sp.encode(["the cat"], add_eos=True)
    cased = ["The CAT sat on the Mat", "A HOUSE"]
    assert translate_lines(model, sp, cased, params.decode, "cpu") == translate_lines(
        model, sp, [line.lower() for line in cased], params.decode, "cpu"
    )
    src, hyp = tmp_path / "src.txt", tmp_path / "hyp.txt"
    src.write_text("\n".join(cased) + "\n", encoding="utf-8")
    cli = ["--model", str(lowered), "--input", str(src), "--output", str(hyp), "--device", "cpu"]
    assert main(cli) == 0
    expected = translate_lines(model, sp, [line.lower() for line in cased], params.decode, "cpu")
    assert hyp.read_text(encoding="utf-8").splitlines() == expected
    _, plain, _ = load_translator(model_file, "cpu")  # cased: what it is given
    assert plain.encode("The CAT sat") != plain.encode("the cat sat")


def test_beam_one_is_greedy_and_outputs_are_detokenized(model_file):
    model, sp, _ = load_translator(model_file, "cpu")
    cfg = DecodeConfig(beam_size=1, max_len_b=8)
    out = translate_lines(model, sp, LINES[:1], cfg, "cpu")
    src = torch.tensor([sp.encode(LINES[0], add_eos=True)])
    assert out == sp.decode(greedy_search(model, src, 1.0, 8))


def test_command_line_file_to_file(model_file, tmp_path):
    src, hyp = tmp_path / "src.txt", tmp_path / "hyp.txt"
    src.write_text("\n".join(LINES) + "\n", encoding="utf-8")
    cli = ["--model", str(model_file), "--input", str(src), "--output", str(hyp), "--device", "cpu"]
    assert main(cli) == 0  # on a CUDA host the default device decodes in bf16: not comparable
    model, sp, params = load_translator(model_file, "cpu")
    expected = translate_lines(model, sp, LINES, params.decode, "cpu")
    assert hyp.read_text(encoding="utf-8") == "".join(line + "\n" for line in expected)


def test_a_gzip_input_translates_as_its_text_and_a_corrupt_one_is_one_line(
    model_file, tmp_path, capsys, monkeypatch
):
    """Corpora ship gzipped (Multi30k's test sets): --input FILE.gz is read through gzip;
    a file that is not gzip is one line before the models load, one cut short one line."""
    plain, packed = tmp_path / "src.txt", tmp_path / "src.txt.gz"
    text = "".join(line + "\n" for line in LINES * 3)
    plain.write_text(text, encoding="utf-8")
    packed.write_bytes(gzip.compress(text.encode("utf-8")))
    outputs = []
    for source in (plain, packed):
        hyp = tmp_path / f"{source.name}.hyp"
        assert main(["--model", str(model_file), "--input", str(source), "--output", str(hyp),
                     "--device", "cpu"]) == 0  # fmt: skip
        outputs.append(hyp.read_bytes())
    assert outputs[0] == outputs[1] and outputs[0].count(b"\n") == len(LINES) * 3

    model = ["--model", str(model_file), "--device", "cpu"]
    (tmp_path / "plain.gz").write_bytes(text.encode("utf-8"))
    with monkeypatch.context() as patch:
        patch.setattr(translate_module, "load_ensemble", lambda *a: pytest.fail("loaded"))
        err = one_line_error(capsys, [*model, "--input", str(tmp_path / "plain.gz")])
    assert "plain.gz: truncated or corrupt gzip file" in err
    (tmp_path / "cut.gz").write_bytes(packed.read_bytes()[:-12])
    err = one_line_error(capsys, [*model, "--input", str(tmp_path / "cut.gz")])
    assert "cut.gz: truncated or corrupt gzip file" in err


def test_two_writers_of_one_output_leave_one_whole_file_and_a_device_stays_one(
    model_file, tmp_path
):
    """Each writes aside and renames: the output is one writer's, whole, never the two
    interleaved; a device (/dev/null) is written in place, not replaced by a file."""
    src, hyp = tmp_path / "src.txt", tmp_path / "hyp.txt"
    src.write_text("\n".join(LINES * 40) + "\n", encoding="utf-8")
    hyp.write_text("an earlier translation\n", encoding="utf-8")
    argv = ["--model", str(model_file), "--input", str(src), "--device", "cpu"]
    cmd = [sys.executable, "-m", "transformer.translate", *argv, "--output", str(hyp)]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    writers = [subprocess.Popen(cmd, cwd=ROOT, env=env) for _ in range(2)]
    assert [w.wait(timeout=300) for w in writers] == [0, 0]
    assert run_cli([*argv, "--output", "/dev/null"]).returncode == 0
    assert Path("/dev/null").is_char_device()
    model, sp, params = load_translator(model_file, "cpu")
    expected = translate_lines(model, sp, LINES * 40, params.decode, "cpu")
    assert hyp.read_text(encoding="utf-8") == "".join(line + "\n" for line in expected)
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no leftovers


def test_command_line_early_stop_option_sets_the_search_rule(model_file, tmp_path, monkeypatch):
    src, hyp = tmp_path / "src.txt", tmp_path / "hyp.txt"
    src.write_text("\n".join(LINES) + "\n", encoding="utf-8")
    argv = ["--model", str(model_file), "--input", str(src), "--output", str(hyp)]
    argv += ["--device", "cpu"]  # as the reference below
    # On this random model both rules may give the same outputs: see the rule reach the search.
    rules, search = [], translate_module.beam_search
    monkeypatch.setattr(
        translate_module,
        "beam_search",
        lambda *a, **kw: rules.append(kw["early_stop"]) or search(*a, **kw),
    )
    assert main([*argv, "--early-stop", "beam"]) == 0
    assert rules and set(rules) == {"beam"}
    monkeypatch.undo()
    model, sp, params = load_translator(model_file, "cpu")
    cfg = params.decode.model_copy(update={"early_stop": "beam"})
    expected = translate_lines(model, sp, LINES, cfg, "cpu")
    assert hyp.read_text(encoding="utf-8").splitlines() == expected


def test_command_line_keeps_one_arena_for_every_chunk(model_file, tmp_path, monkeypatch):
    """The caches' memory (kv_cache.Arena) outlives a chunk of input: a pipe's lines may
    come one chunk each, and a new arena per chunk would write fresh pages every line."""
    src, hyp = tmp_path / "src.txt", tmp_path / "hyp.txt"
    src.write_text("\n".join(LINES) + "\n", encoding="utf-8")

    class SmallReads:  # 40 bytes a read, and a chunk a read: a chunk or so a line
        def __getattr__(self, name):
            return getattr(os, name)

        @staticmethod
        def read(fd: int, n: int) -> bytes:
            return os.read(fd, min(n, 40))

    monkeypatch.setattr(translate_module, "os", SmallReads())
    monkeypatch.setattr(translate_module, "CHUNK_BYTES", 16)
    chunks, split = [], translate_module._chunks
    monkeypatch.setattr(
        translate_module, "_chunks", lambda *a: (chunks.append(c) or c for c in split(*a))
    )
    arenas, search = [], translate_module.beam_search
    monkeypatch.setattr(
        translate_module,
        "beam_search",
        lambda *a, **kw: arenas.append(kw["arena"]) or search(*a, **kw),
    )
    argv = ["--model", str(model_file), "--input", str(src), "--output", str(hyp)]
    assert main([*argv, "--device", "cpu", "--batch-size", "1"]) == 0
    assert len(chunks) > 2 and len(arenas) == sum(1 for line in LINES if line.strip())
    assert len({id(a) for a in arenas}) == 1
    model, sp, params = load_translator(model_file, "cpu")
    expected = translate_lines(model, sp, LINES, params.decode, "cpu")
    assert hyp.read_text(encoding="utf-8").splitlines() == expected


def test_command_line_reads_stdin_and_writes_stdout(model_file):
    out = run_cli(["--model", str(model_file), "--beam", "2"], b"a house\n\nthe cat")
    assert out.returncode == 0, out.stderr.decode()
    lines = out.stdout.decode("utf-8").split("\n")  # the last line needs no "\n"
    assert len(lines) == 4 and lines[1] == "" and lines[3] == ""


def test_command_line_translates_each_line_of_a_pipe_as_it_comes(model_file):
    """Interactive use: the answer to a line comes before the next line is written."""
    argv = [sys.executable, "-m", "transformer.translate", "--model", str(model_file)]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    with subprocess.Popen(
        argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, cwd=ROOT, env=env
    ) as p:
        for line in LINES[:3]:
            p.stdin.write(line.encode() + b"\n")
            p.stdin.flush()
            assert select.select([p.stdout], [], [], 120)[0], "no answer to a line"
            assert p.stdout.readline().endswith(b"\n")
        p.stdin.close()
        assert p.stdout.read() == b"" and p.wait(timeout=60) == 0


def test_nbest_lists_the_beams_best_hypotheses_in_moses_format(model_file, tmp_path):
    src, hyp = tmp_path / "src.txt", tmp_path / "nbest.txt"
    src.write_text("\n".join(LINES[:3]) + "\n", encoding="utf-8")
    argv = ["--model", str(model_file), "--input", str(src), "--output", str(hyp)]
    argv += ["--device", "cpu"]  # scores compared with a CPU fp32 search below
    assert main([*argv, "--nbest", "3", "--beam", "4"]) == 0
    entries = [line.split(" ||| ") for line in hyp.read_text(encoding="utf-8").splitlines()]
    assert [e[0] for e in entries] == ["0"] * 3 + ["1"] + ["2"] * 3  # line 1 is empty
    assert entries[3][1:] == ["", "0.000000"]
    model, sp, params = load_translator(model_file, "cpu")
    src_ids = torch.tensor([sp.encode(LINES[2], add_eos=True)])
    (found,) = beam_search(model, src_ids, 4, params.decode.len_penalty, 1.0, 8, n_best=3)
    assert [e[1] for e in entries[4:]] == [sp.decode(h.tokens) for h in found]
    assert [float(e[2]) for e in entries[4:]] == pytest.approx([h.score for h in found], abs=1e-5)
    # The first of each n-best list is the translation; --nbest 1 gives it with its score.
    assert main([*argv, "--beam", "4"]) == 0
    assert hyp.read_text(encoding="utf-8").splitlines() == [entries[0][1], "", entries[4][1]]
    assert main([*argv, "--beam", "4", "--nbest", "1"]) == 0
    firsts = [" ||| ".join(e) for e in (entries[0], entries[3], entries[4])]
    assert hyp.read_text(encoding="utf-8").splitlines() == firsts


def test_options_override_the_params_and_batches_do_not_change_outputs(model_file, tmp_path):
    src, hyp = tmp_path / "src.txt", tmp_path / "hyp.txt"
    src.write_text("\n".join(LINES) + "\n", encoding="utf-8")
    argv = ["--model", str(model_file), "--input", str(src), "--output", str(hyp)]
    assert main([*argv, "--device", "cpu"]) == 0
    default = hyp.read_text(encoding="utf-8")
    assert main([*argv, "--device", "cpu", "--batch-size", "1", "--max-tokens", "100"]) == 0
    assert hyp.read_text(encoding="utf-8") == default
    assert main([*argv, "--max-len-a", "0", "--max-len-b", "2", "--lenpen", "1.0"]) == 0
    _, sp, _ = load_translator(model_file, "cpu")
    assert all(len(sp.encode(line)) <= 2 for line in hyp.read_text(encoding="utf-8").splitlines())


def test_batches_respect_both_bounds():
    sources = [[7] * n for n in (5, 1, 9, 3, 3, 7, 2, 8)]
    batches = list(batch_by_tokens(sources, max_tokens=16, max_sentences=2))
    assert sorted(j for b in batches for j in b) == list(range(8))
    for b in batches:
        assert len(b) <= 2 and len(b) * max(len(sources[j]) for j in b) <= 16
    assert [len(b) for b in batch_by_tokens(sources, max_tokens=100)] == [8]


def test_an_ensemble_of_a_model_with_itself_translates_as_the_model(model_file, tmp_path):
    src, hyp = tmp_path / "src.txt", tmp_path / "hyp.txt"
    src.write_text("\n".join(LINES) + "\n", encoding="utf-8")
    argv = ["--input", str(src), "--output", str(hyp), "--model", str(model_file)]
    assert main(argv) == 0
    alone = hyp.read_text(encoding="utf-8")
    assert main([*argv, "--model", str(model_file)]) == 0
    assert hyp.read_text(encoding="utf-8") == alone
    other = write_model_file(tmp_path / "other.pt", seed=1)
    assert main([*argv, "--model", str(other)]) == 0  # a real ensemble: it runs


def one_line_error(capsys, argv) -> str:
    try:
        code = main(argv)
    except SystemExit as exit:  # argparse's errors (transformer.cli.ArgumentParser)
        code = exit.code
    assert code == 2
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
    assert "--beam" in one_line_error(capsys, argv)


def test_user_errors_are_one_line_before_any_decoding(model_file, tmp_path, capsys, monkeypatch):
    src = tmp_path / "src.txt"
    src.write_text("a house\n", encoding="utf-8")
    model = ["--model", str(model_file)]
    # Paths are checked before the model is loaded (or anything decoded).
    missing = str(tmp_path / "missing" / "dir" / "out")
    err = one_line_error(capsys, [*model, "--input", str(src), "--output", missing])
    assert "--output" in err and "missing/dir/out" in err
    assert "--input" in one_line_error(capsys, [*model, "--input", str(tmp_path / "none")])
    assert "holds the input" in one_line_error(
        capsys, [*model, "--input", str(src), "--output", str(src)]
    )
    assert src.read_text(encoding="utf-8") == "a house\n"
    argv = [*model, "--input", str(src)]
    for option, value in [("--nbest", "5"), ("--batch-size", "0"), ("--max-len-b", "-1")]:
        assert option in one_line_error(capsys, [*argv, option, value])
    assert "--device" in one_line_error(capsys, [*argv, "--device", "gpu"])
    if not torch.cuda.is_available():
        assert "CUDA" in one_line_error(capsys, [*argv, "--device", "cuda:0"])
    assert "--beam" in one_line_error(capsys, [*argv, "--beam", "four"])
    assert "--model" in one_line_error(capsys, ["--input", str(src)])
    src.write_bytes(b"a house\n\xff\n")
    assert "line 2: not UTF-8" in one_line_error(capsys, argv)


def test_models_with_different_vocabularies_are_no_ensemble(model_file, tmp_path, capsys):
    other = write_model_file(tmp_path / "other.pt", spm_seed=1)
    err = one_line_error(capsys, ["--model", str(model_file), "--model", str(other)])
    assert str(other) in err and str(model_file) in err and "vocabulary" in err


def test_help_explains_every_option_with_examples(capsys):
    with pytest.raises(SystemExit) as exit:
        main(["--help"])
    assert exit.value.code == 0
    text = capsys.readouterr().out
    assert "examples:" in text and "|||" in text
    for option in ["--model", "--nbest", "--beam", "--lenpen", "--max-len-a", "--max-len-b",
                   "--batch-size", "--max-tokens", "--device", "--input", "--output"]:  # fmt: skip
        assert option in text


def test_learned_position_tables_bound_sources_and_outputs():
    sp = spm.SentencePieceProcessor(model_proto=train_spm())
    cfg = ModelConfig(n_layers=1, d_model=16, d_ff=32, n_heads=2, positional="learned",
                      max_positions=6)  # fmt: skip
    torch.manual_seed(0)
    model = Transformer(cfg, vocab_size=sp.get_piece_size()).eval()
    out = translate_lines(model, sp, LINES, DecodeConfig(), "cpu")  # sources of 6+ pieces
    assert all(len(sp.encode(line)) <= 5 for line in out)
