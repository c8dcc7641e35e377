"""Translate raw sentences with an exported model file, or an ensemble of several.

    python -m transformer.translate --model model.pt < newstest2014.en > hyp.de

Beam size, length penalty and maximum lengths default to the `decode` section of the params
the (first) model was trained with (the paper's 4, 0.6 and input length + 50). Sentences are
sorted by length and batched by source tokens (and sentences, with --batch-size); the output
keeps the input's order, one line per input line (--nbest K: K lines, `i ||| hypothesis |||
score`); an empty input line gives an empty output line. Lines are translated as they come:
a pipe that delivers one line at a time gets each translation back as soon as it is ready,
bulk input is read in large chunks; an --input ending in .gz is read through gzip. Every
user error (a file or option that is wrong) is one line on stderr and exit code 2.
"""

from __future__ import annotations

import argparse
import contextlib
import gzip
import logging
import os
import re
import select
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import BinaryIO

import torch
from pydantic import ValidationError
from tqdm import tqdm

from transformer.cli import ArgumentParser, existing_file
from transformer.config import DecodeConfig, Params
from transformer.console import PROGRESS_EVERY_S, Progress
from transformer.data.vocab import Lowercasing, VocabError, load_spm
from transformer.decoding.search import Hypothesis, beam_search
from transformer.files import atomic_file, check_output, gzip_damage
from transformer.model_file import CheckpointError, load_model_file, params_of
from transformer.nn.kv_cache import Arena
from transformer.nn.model import Transformer
from transformer.tokens import EOS, PAD

Models = Transformer | list[Transformer]  # one model, or an ensemble
log = logging.getLogger(__name__)


def load_translator(model_path: str | os.PathLike, device: str | torch.device):
    """(model in eval mode on `device`, sentencepiece processor, params) from a model file;
    CheckpointError, in one line, if it is unreadable or its parts do not fit together."""
    mf = load_model_file(model_path)
    params = params_of(model_path, mf.params)
    try:
        sp = load_spm(mf.spm_model)
    except VocabError as err:
        raise CheckpointError(f"{model_path}: {err}") from None
    model = Transformer(params.model, vocab_size=sp.get_piece_size(), pad_id=PAD)
    mismatch = _mismatch(model.state_dict(), mf.model)
    if mismatch:
        raise CheckpointError(f"{model_path}: weights do not fit its params: {mismatch}")
    model.load_state_dict(mf.model)
    if params.clean.lowercase:
        sp = Lowercasing(sp)
    return model.to(device).eval(), sp, params


def load_ensemble(model_paths: list[str], device: str | torch.device):
    """(models, sentencepiece processor, the first model's params) from model files that
    share one sentencepiece vocabulary (CheckpointError otherwise)."""
    models, sps, params = [], [], None
    for path in model_paths:
        model, sp, model_params = load_translator(path, device)
        if sps and sp.serialized_model_proto() != sps[0].serialized_model_proto():
            raise CheckpointError(
                f"{path}: its sentencepiece vocabulary differs from {model_paths[0]}'s; "
                "the models of an ensemble must share one"
            )
        models.append(model)
        sps.append(sp)
        params = params or model_params  # the first model's
    return models, sps[0], params


def _mismatch(expected: dict[str, torch.Tensor], found: dict[str, torch.Tensor]) -> str:
    """'' if `found` loads into a model with state `expected`, else what differs, briefly."""
    problems = []
    for label, keys in (
        ("missing", expected.keys() - found.keys()),
        ("unexpected", found.keys() - expected.keys()),
    ):
        if keys:
            problems.append(f"{len(keys)} {label} keys ({', '.join(sorted(keys)[:3])}, ...)")
    for key in sorted(expected.keys() & found.keys()):
        if expected[key].shape != found[key].shape:
            want, got = tuple(expected[key].shape), tuple(found[key].shape)
            problems.append(f"{key} has shape {got}, the params make {want}")
            break
    return "; ".join(problems)


def translate_lines(
    model: Models,
    sp,
    lines: list[str],
    decode_cfg: DecodeConfig,
    device: str | torch.device,
    progress: str | None = None,
    arena: Arena | None = None,
) -> list[str]:
    """Translate raw sentences with a model or an ensemble (a list of models); the output
    is in the input's order, empty lines stay empty. `progress`: what to call the job in
    progress lines (console.Progress, every PROGRESS_EVERY_S seconds); None: silent.
    `arena`: the caches' memory, for a caller that calls again (translate_batches).

    beam_size 1 is greedy search (no length penalty: one hypothesis has nothing to compare).
    """
    out, todo = [""] * len(lines), sum(1 for line in lines if line.strip())
    meter = Progress(progress or "", todo if progress else 0, "sentences", log, PROGRESS_EVERY_S)
    for rows, hyps in translate_batches(model, sp, lines, decode_cfg, device, arena=arena):
        for i, found in zip(rows, hyps, strict=True):
            out[i] = sp.decode(found[0].tokens) if found else ""
        meter.update(len(rows))
    meter.close()
    return out


def translate_batches(
    model: Models,
    sp,
    lines: list[str],
    cfg: DecodeConfig,
    device: str | torch.device,
    n_best: int = 1,
    max_sentences: int | None = None,
    first_line: int = 1,
    arena: Arena | None = None,
) -> Iterator[tuple[list[int], list[list[Hypothesis]]]]:
    """Per batch, longest sentences first: the indices of its lines, and each line's best
    `n_best` hypotheses. Empty (or blank) lines are left out: they translate to ''.
    `first_line`: the number of lines[0] in the input, for the warning about a cut line.
    `arena`: the caches' memory (kv_cache.Arena) for a caller that calls again; by default
    one for these lines' batches."""
    models = model if isinstance(model, list) else [model]
    todo = [i for i, line in enumerate(lines) if line.strip()]
    sources = sp.encode([lines[i] for i in todo], add_eos=True)
    cap = positions(models)
    for j in (j for j, ids in enumerate(sources) if len(ids) > cap):
        log.warning("line %d: %d subwords, cut to the model's %d positions (model.max_positions)",
                    first_line + todo[j], len(sources[j]), cap)  # fmt: skip
        sources[j] = [*sources[j][: cap - 1], EOS]
    arena = Arena() if arena is None else arena  # one batch's cache memory, the next's
    for batch in batch_by_tokens(sources, cfg.max_tokens, max_sentences):
        src = pad_batch([sources[j] for j in batch], device)
        yield [todo[j] for j in batch], _search(models, src, cfg, n_best, arena)


def positions(models: list[Transformer]) -> int:
    """The most positions every model takes, EOS or BOS included: model.max_positions, the
    rows of a learned table, and for sinusoids the length our exports declare (CTranslate2's
    max_input_length, Marian's max_position_embeddings). A longer source is cut to it, as
    CTranslate2 and Marian's --max-length-crop do, not refused as fairseq does: a file
    still gets one translation a line, and no sentence is that long (a line that is no
    sentence, past MAX_LINE_BYTES, is refused as it is read)."""
    return min(m.cfg.max_positions for m in models)


def batch_by_tokens(
    sources: list[list[int]], max_tokens: int, max_sentences: int | None = None
) -> Iterator[list[int]]:
    """Indices into `sources`, longest first, in batches of at most max_tokens source
    tokens, padding counted (a longer sentence than that goes alone), and of at most
    max_sentences sentences."""
    order = sorted(range(len(sources)), key=lambda j: -len(sources[j]))
    batch: list[int] = []
    for j in order:
        width = len(sources[batch[0]]) if batch else len(sources[j])
        full = max_sentences is not None and len(batch) == max_sentences
        if batch and (full or (len(batch) + 1) * width > max_tokens):
            yield batch
            batch = []
        batch.append(j)
    if batch:
        yield batch


def pad_batch(rows: list[list[int]], device: str | torch.device) -> torch.Tensor:
    """(B, S) PAD-padded source batch on `device`."""
    src = torch.full((len(rows), max(map(len, rows))), PAD, dtype=torch.long)
    for i, row in enumerate(rows):
        src[i, : len(row)] = torch.tensor(row)
    return src.to(device)


def _search(
    models: list[Transformer], src: torch.Tensor, cfg: DecodeConfig, n_best: int, arena: Arena
):
    # The target side has as many positions as the source side, BOS included.
    cap = positions(models)
    # One beam without a length penalty is exactly greedy search (search.py's rules).
    alpha = cfg.len_penalty if cfg.beam_size > 1 else 0.0
    return beam_search(
        models, src, cfg.beam_size, alpha, cfg.max_len_a, cfg.max_len_b, n_best,
        max_len=cap - 1, early_stop=cfg.early_stop, arena=arena,
    )  # fmt: skip


# --------------------------------------------------------------------------- command line

EXAMPLES = """\
examples:
  # a file, on the second GPU, beam 8
  python -m transformer.translate --model model.pt --input test.en --output test.de \\
      --device cuda:1 --beam 8
  # an ensemble: the mean of the models' probabilities (they must share the vocabulary)
  python -m transformer.translate --model run1/model.pt --model run2/model.pt < test.en
  # the 4 best translations of each line, Moses/Marian style: i ||| hypothesis ||| score
  python -m transformer.translate --model model.pt --nbest 4 < test.en > test.nbest
  # interactive: each line is translated as soon as it arrives (greedy here)
  python -m transformer.translate --model model.pt --beam 1
"""

# DecodeConfig's fields, as the options that set them
OPTIONS = {
    "beam_size": "--beam",
    "len_penalty": "--lenpen",
    "max_len_a": "--max-len-a",
    "max_len_b": "--max-len-b",
    "max_tokens": "--max-tokens",
    "early_stop": "--early-stop",
}


class _UsageError(ValueError):
    """An option or path that is wrong: one line, exit code 2."""


def _parse(argv: list[str] | None) -> argparse.Namespace:
    p = ArgumentParser(
        prog="python -m transformer.translate",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--model",
        action="append",
        required=True,
        type=existing_file("a model file"),
        metavar="FILE",
        help="exported model file (transformer.average); repeat it for an ensemble",
    )
    p.add_argument("--input", default="-", metavar="FILE", help="sentences (default: stdin)")
    p.add_argument("--output", default="-", metavar="FILE", help="translations (default: stdout)")
    p.add_argument("--beam", type=int, metavar="K", help="beam size; 1 is greedy search")
    p.add_argument("--lenpen", type=float, metavar="ALPHA", help="length penalty (GNMT's)")
    p.add_argument(
        "--nbest",
        type=int,
        metavar="K",
        help="write the K best translations of each line, `i ||| hypothesis ||| score` "
        "(score: log p / length penalty); K <= beam size",
    )
    p.add_argument("--max-len-a", type=float, metavar="A", help="most output tokens: A * ...")
    p.add_argument("--max-len-b", type=int, metavar="B", help="... source tokens + B")
    p.add_argument("--max-tokens", type=int, metavar="N", help="source tokens per batch, at most")
    p.add_argument("--batch-size", type=int, metavar="N", help="sentences per batch, at most")
    p.add_argument(
        "--early-stop",
        choices=("exact", "beam"),
        help="end a sentence once no hypothesis can still win (exact), or also once beam-size "
        "hypotheses finished (beam: fairseq's, Marian's, CTranslate2's rule)",
    )
    p.add_argument("--device", help="cpu, cuda or cuda:N (default: cuda if available)")
    p.epilog = "Unset options take the model's params (decode section).\n\n" + EXAMPLES
    return p.parse_args(argv)


def _device(name: str | None) -> torch.device:
    if name is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    match = re.fullmatch(r"cpu|cuda(:(\d+))?", name)
    if match is None:
        raise _UsageError(f"--device {name}: expected cpu, cuda or cuda:N")
    if name != "cpu" and not torch.cuda.is_available():
        raise _UsageError(f"--device {name}: CUDA is not available")
    if match.group(2) is not None and int(match.group(2)) >= torch.cuda.device_count():
        raise _UsageError(f"--device {name}: there are {torch.cuda.device_count()} GPUs")
    return torch.device(name)


def _decode_config(params: Params, args: argparse.Namespace) -> DecodeConfig:
    given = {
        "beam_size": args.beam,
        "len_penalty": args.lenpen,
        "max_len_a": args.max_len_a,
        "max_len_b": args.max_len_b,
        "max_tokens": args.max_tokens,
        "early_stop": args.early_stop,
    }
    update = {k: v for k, v in given.items() if v is not None}
    try:
        cfg = DecodeConfig.model_validate({**params.decode.model_dump(), **update})
    except ValidationError as err:  # the params' own values were validated on loading
        first = err.errors()[0]
        raise _UsageError(f"{OPTIONS[first['loc'][0]]}: {first['msg']}") from None
    if args.nbest is not None and not 1 <= args.nbest <= cfg.beam_size:
        raise _UsageError(f"--nbest {args.nbest}: must lie in [1, beam size ({cfg.beam_size})]")
    if args.batch_size is not None and args.batch_size < 1:
        raise _UsageError(f"--batch-size {args.batch_size}: must be at least 1")
    return cfg


def _open(args: argparse.Namespace, files: contextlib.ExitStack) -> tuple[BinaryIO, BinaryIO]:
    """The input and output streams, opened before any decoding, so that a wrong path
    costs nothing; `files` closes those it opens. A file output is written aside and
    renamed into place at the end: a failure, or a second writer, leaves no mixed file."""
    source = sys.stdin.buffer if args.input == "-" else _opened(files, args.input, "--input")
    if args.output == "-":
        return source, sys.stdout.buffer
    read = [*args.model, *([args.input] if args.input != "-" else [])]
    check_output(args.output, read, "--output")
    path = Path(args.output)
    # A regular file is written aside and renamed onto; a device, a pipe or a link
    # (/dev/stdout) is written in place: a rename would replace the node, not feed it.
    aside = not path.is_symlink() and (path.is_file() or not path.exists())
    try:  # unbuffered: each batch is written whole anyway, and a buffer flushed at close
        # would raise a full disk's error after ours, naming no file
        opened = atomic_file(path, buffering=0) if aside else open(path, "wb", buffering=0)  # noqa: SIM115
        return source, files.enter_context(opened)
    except OSError as err:
        raise _UsageError(f"--output {args.output}: {err.strerror}") from None


def _opened(files: contextlib.ExitStack, path: str, option: str) -> BinaryIO:
    try:
        stream = files.enter_context(open(path, "rb"))  # noqa: SIM115 (closed by `files`)
    except OSError as err:
        raise _UsageError(f"{option} {path}: {err.strerror}") from None
    if not path.endswith(".gz"):
        return stream
    packed = files.enter_context(gzip.GzipFile(fileobj=stream))
    _read(lambda: packed.peek(1), path)  # not gzip: said now, before the models load
    return packed


CHUNK_BYTES = 1 << 22  # the most input read at once (then sorted by length and batched)
# A line is a sentence: a few hundred bytes, and past model.max_positions subwords it is cut
# (positions()). One of more than a MiB is no sentence (a file without line breaks, a
# binary file): it is refused, naming the line, before it is held whole or tokenized.
MAX_LINE_BYTES = 1 << 20
WAIT = 0.01  # seconds to wait for more input once some has come (a pipe refilling)


def _chunks(stream: BinaryIO, name: str) -> Iterator[list[str]]:
    """The input's lines, as many at a time as can be read without waiting for more (up to
    CHUNK_BYTES): a line typed or piped alone comes alone, a file comes in large chunks.
    Lines end at "\\n" only: other Unicode line breaks belong to the sentence."""
    read, ready = _reader(stream)
    tail, eof, number = b"", False, 0
    while not eof:
        data = [_read(read, name)]  # waits for the first bytes
        while data[-1] and sum(map(len, data)) < CHUNK_BYTES and ready():
            data.append(_read(read, name))
        eof = not data[-1]
        *lines, tail = (tail + b"".join(data)).split(b"\n")
        if eof and tail:  # a last line without its "\n"
            lines.append(tail)
        for i, line in enumerate([*lines, tail]):  # the tail: a line not yet ended
            if len(line) > MAX_LINE_BYTES:
                raise ValueError(f"{name}: line {number + i + 1}: longer than "
                                 f"{MAX_LINE_BYTES:,} bytes: not a sentence")  # fmt: skip
        if lines:
            yield [_text(line, name, number + i) for i, line in enumerate(lines)]
            number += len(lines)


def _reader(stream: BinaryIO) -> tuple[Callable[[], bytes], Callable[[], bool]]:
    """(read the next block, whether more can be read at once). A pipe's or a terminal's
    descriptor is read as bytes arrive; a gzip file's decompressed text is always ready."""
    if isinstance(stream, gzip.GzipFile):
        return lambda: stream.read1(1 << 16), lambda: True  # read1: what one read gives
    fd = stream.fileno()
    return lambda: os.read(fd, 1 << 16), lambda: _readable(fd)


def _read(read: Callable[[], bytes], name: str) -> bytes:
    with gzip_damage(name, ValueError):
        return read()


def _readable(fd: int) -> bool:
    return bool(select.select([fd], [], [], WAIT)[0])


def _text(line: bytes, name: str, index: int) -> str:
    try:
        return line.decode("utf-8")
    except UnicodeDecodeError as err:
        raise ValueError(f"{name}: line {index + 1}: not UTF-8 text ({err})") from None


def _format(index: int, hyps: list[Hypothesis], sp, nbest: bool) -> bytes:
    """A line's output: its translation, or its n-best list (i ||| hypothesis ||| score);
    an empty line has one hypothesis, empty, of score 0."""
    if not nbest:
        return ((sp.decode(hyps[0].tokens) if hyps else "") + "\n").encode("utf-8")
    hyps = hyps or [Hypothesis(tokens=[], score=0.0, logprob=0.0)]
    text = "".join(f"{index} ||| {sp.decode(h.tokens)} ||| {h.score:.6f}\n" for h in hyps)
    return text.encode("utf-8")


def _translate(models, sp, cfg, args, device, source: BinaryIO, out: BinaryIO) -> None:
    """Translate chunk by chunk; after each batch, write (and flush) every line whose
    earlier lines are all written."""
    name = "stdin" if args.input == "-" else args.input
    nbest, first = args.nbest is not None, 0  # first: the index of the chunk's first line
    progress = args.input != "-" and sys.stderr.isatty()  # not for a pipe, nor into a log
    arena = Arena()  # for every chunk: a pipe's lines may come one at a time
    with tqdm(unit="sent", file=sys.stderr, disable=not progress) as bar:
        for lines in _chunks(source, name):
            blocks: list[bytes | None] = [
                None if line.strip() else _format(first + i, [], sp, nbest)
                for i, line in enumerate(lines)
            ]
            written = _write_ready(out, blocks, 0, args.output)  # leading empty lines
            k = args.nbest or 1
            batches = translate_batches(
                models, sp, lines, cfg, device, k, args.batch_size, first + 1, arena
            )
            for rows, hyps in batches:
                for i, found in zip(rows, hyps, strict=True):
                    blocks[i] = _format(first + i, found, sp, nbest)
                written = _write_ready(out, blocks, written, args.output)
                bar.update(len(rows))
            first += len(lines)


def _write_ready(out: BinaryIO, blocks: list[bytes | None], written: int, name: str) -> int:
    """Write blocks[written:] up to the first one not ready; return how many are written."""
    ready = written
    while ready < len(blocks) and blocks[ready] is not None:
        ready += 1
    data = memoryview(b"".join(blocks[written:ready]))
    try:
        while data:  # an unbuffered file may take a write in parts
            data = data[out.write(data) :]
        out.flush()
    except BrokenPipeError:
        raise
    except OSError as err:  # a full disk names no file by itself
        raise _UsageError(f"--output {name}: {err.strerror or err}") from None
    return ready


def main(argv: list[str] | None = None) -> int:
    try:
        args = _parse(argv)
        device = _device(args.device)
        with contextlib.ExitStack() as files:
            source, out = _open(args, files)
            models, sp, params = load_ensemble(args.model, device)
            cfg = _decode_config(params, args)
            _translate(models, sp, cfg, args, device, source, out)
    except BrokenPipeError:  # the reader went away (`| head`): nothing more to say
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1
    except KeyboardInterrupt:  # Ctrl-C ends an interactive session
        return 130
    except (CheckpointError, OSError, ValueError) as err:
        # One line: torch's unpickling errors run to paragraphs; the first names the cause.
        print(f"error: {str(err).splitlines()[0]}", file=sys.stderr)
        return 2
    return 0
