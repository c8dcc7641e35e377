"""Translate raw sentences with an exported model file.

    python -m transformer.translate --model model.pt < newstest2014.en > hyp.de

Beam size, length penalty and maximum lengths default to the `decode` section of the params
the model was trained with (the paper's 4, 0.6 and input length + 50). Sentences are sorted
by length and batched by source tokens, and the output keeps the input's order, one line
per input line; an empty input line gives an empty output line. A model file that cannot
be read, or whose weights do not fit its own params, is one line on stderr and exit code 2.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Iterator
from pathlib import Path

import torch
from pydantic import ValidationError
from tqdm import tqdm

from transformer.checkpoint import CheckpointError, load_model_file
from transformer.config import DecodeConfig, Params, params_from_dict
from transformer.model import Transformer
from transformer.search import beam_search, greedy_search
from transformer.vocab import EOS, PAD, VocabError, load_spm


def load_translator(model_path: str | os.PathLike, device: str | torch.device):
    """(model in eval mode on `device`, sentencepiece processor, params) from a model file;
    CheckpointError, in one line, if it is unreadable or its parts do not fit together."""
    mf = load_model_file(model_path)
    try:
        params = params_from_dict(mf.params)
    except ValidationError as err:
        first = err.errors()[0]
        where = ".".join(map(str, first["loc"]))
        raise CheckpointError(f"{model_path}: invalid params: {where}: {first['msg']}") from None
    try:
        sp = load_spm(mf.spm_model)
    except VocabError as err:
        raise CheckpointError(f"{model_path}: {err}") from None
    model = Transformer(params.model, vocab_size=sp.get_piece_size(), pad_id=PAD)
    mismatch = _mismatch(model.state_dict(), mf.model)
    if mismatch:
        raise CheckpointError(f"{model_path}: weights do not fit its params: {mismatch}")
    model.load_state_dict(mf.model)
    return model.to(device).eval(), sp, params


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
    model: Transformer,
    sp,
    lines: list[str],
    decode_cfg: DecodeConfig,
    device: str | torch.device,
    progress: bool = False,
) -> list[str]:
    """Translate raw sentences; the output is in the input's order, empty lines stay empty.

    beam_size 1 is greedy search (no length penalty: one hypothesis has nothing to compare).
    """
    out = [""] * len(lines)
    todo = [i for i, line in enumerate(lines) if line.strip()]
    sources = _source_ids(model, sp.encode([lines[i] for i in todo], add_eos=True))
    with tqdm(total=len(todo), unit="sent", file=sys.stderr, disable=not progress) as bar:
        for batch in batch_by_tokens(sources, decode_cfg.max_tokens):
            src = pad_batch([sources[j] for j in batch], device)
            for j, tokens in zip(batch, _search(model, src, decode_cfg), strict=True):
                out[todo[j]] = sp.decode(tokens)
            bar.update(len(batch))
    return out


def _source_ids(model: Transformer, ids: list[list[int]]) -> list[list[int]]:
    """A learned position table has max_positions rows: longer sources are cut (EOS kept)."""
    if model.cfg.positional != "learned":
        return ids
    cap = model.cfg.max_positions
    return [x if len(x) <= cap else [*x[: cap - 1], EOS] for x in ids]


def batch_by_tokens(sources: list[list[int]], max_tokens: int) -> Iterator[list[int]]:
    """Indices into `sources`, longest first, in batches of at most max_tokens source
    tokens, padding counted (a longer sentence than that goes alone)."""
    order = sorted(range(len(sources)), key=lambda j: -len(sources[j]))
    batch: list[int] = []
    for j in order:
        width = len(sources[batch[0]]) if batch else len(sources[j])
        if batch and (len(batch) + 1) * width > max_tokens:
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


def _search(model: Transformer, src: torch.Tensor, cfg: DecodeConfig) -> list[list[int]]:
    # The target side has as many learned positions as the source side, BOS included.
    cap = model.cfg.max_positions - 1 if model.cfg.positional == "learned" else None
    if cfg.beam_size == 1:
        return greedy_search(model, src, cfg.max_len_a, cfg.max_len_b, max_len=cap)
    hyps = beam_search(
        model, src, cfg.beam_size, cfg.len_penalty, cfg.max_len_a, cfg.max_len_b, max_len=cap
    )
    return [h[0].tokens if h else [] for h in hyps]


# --------------------------------------------------------------------------- command line


def _parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m transformer.translate", description=__doc__)
    p.add_argument("--model", required=True, help="exported model file (transformer.average)")
    p.add_argument("--input", default="-", help="raw sentences, one per line (default: stdin)")
    p.add_argument("--output", default="-", help="translations (default: stdout)")
    p.add_argument("--beam", type=int, help="beam size (default: the params' decode section)")
    p.add_argument("--lenpen", type=float, help="length penalty alpha (default: the params')")
    p.add_argument("--max-tokens", type=int, help="source tokens per batch (default: params')")
    p.add_argument("--device", choices=["cpu", "cuda"], help="default: cuda if available")
    return p.parse_args(argv)


def _decode_config(params: Params, args: argparse.Namespace) -> DecodeConfig:
    given = {"beam_size": args.beam, "len_penalty": args.lenpen, "max_tokens": args.max_tokens}
    update = {k: v for k, v in given.items() if v is not None}
    return DecodeConfig.model_validate({**params.decode.model_dump(), **update})


def _read(path: str) -> list[str]:
    data = sys.stdin.buffer.read() if path == "-" else Path(path).read_bytes()
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as err:
        raise ValueError(f"{path}: not UTF-8 text ({err})") from None
    lines = text.split("\n")  # "\n" only: other Unicode line breaks belong to the sentence
    return lines[:-1] if text.endswith("\n") or not text else lines


def _write(path: str, lines: list[str]) -> None:
    data = "".join(line + "\n" for line in lines).encode("utf-8")
    if path == "-":
        sys.stdout.buffer.write(data)
        sys.stdout.buffer.flush()
    else:
        with open(path, "wb") as f:
            f.write(data)


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cuda" and not torch.cuda.is_available():
        print("error: --device cuda, but CUDA is not available", file=sys.stderr)
        return 2
    try:
        model, sp, params = load_translator(args.model, device)
        decode_cfg = _decode_config(params, args)
        lines = _read(args.input)
    except ValidationError as err:
        first = err.errors()[0]
        print(f"error: decode.{first['loc'][0]}: {first['msg']}", file=sys.stderr)
        return 2
    except (CheckpointError, OSError, ValueError) as err:
        # One line: torch's unpickling errors run to paragraphs; the first names the cause.
        print(f"error: {str(err).splitlines()[0]}", file=sys.stderr)
        return 2
    _write(args.output, translate_lines(model, sp, lines, decode_cfg, device, args.input != "-"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
