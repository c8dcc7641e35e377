"""Preflight: what a run will do and whether it can finish, from the params and the files
they name alone, before any stage starts (the flow's start, `python -m transformer.config
PARAMS --check`). A mistake that would otherwise surface after hours of training (a
reference file of another language, an average of more snapshots than training keeps) is
one line naming the keys; what the run will do (the corpus, the updates and epochs, the
learning rate's peak, the snapshots it averages) is a few lines a person reads first.

    lines = preflight(params, "params/en-cs.yaml", overrides)   # PreflightError: one line
    python -m transformer.config params/en-cs.yaml [dotted.key=value ...] --check
"""

from __future__ import annotations

import gzip
import math
import sys
from dataclasses import dataclass, field
from pathlib import Path

from transformer.cli import UserError
from transformer.config import Params, ParamsError, load_params, read_yaml
from transformer.data import ROLES, DataError
from transformer.data.sources import split_files
from transformer.decoding.evaluate import tokenized_refs
from transformer.files import GZIP_DAMAGE
from transformer.training.optim import cooldown_start, inverse_sqrt_schedule

# A peak this many times the parent params' is what shortening the warmup alone does
# (warmup_steps 1000 -> 60 quadruples it); a run that sets train.lr_scale chose its peak.
PEAK_RATIO_WARNING = 2.0
# The training text read to count a corpus (decompressed bytes a file); a larger file is
# extrapolated from this much of it by its size on disk.
SAMPLE_BYTES = 64 << 20


class PreflightError(UserError, ValueError):
    """The params cannot run to the end: every reason in one line, each naming its keys."""


@dataclass
class Findings:
    said: list[str] = field(default_factory=list)  # what the run will do
    warnings: list[str] = field(default_factory=list)  # what it may not do as meant
    errors: list[str] = field(default_factory=list)  # why it cannot finish


def preflight(params: Params, path: str | Path, overrides: list[str] | tuple[str, ...] = ()):
    """The lines saying what the run of `params` (loaded from `path` with `overrides`) will
    do, warnings last; PreflightError if it cannot finish."""
    found = Findings()
    corpus = check_files(params, found)
    check_schedule(params, reference(Path(path), list(overrides)), found)
    check_updates(params, corpus, found)
    check_snapshots(params, found)
    check_cadences(params, found)
    if found.errors:
        raise PreflightError("; ".join(found.errors))
    return [*found.said, *(f"warning: {w}" for w in found.warnings)]


def main(argv: list[str]) -> int:
    """`python -m transformer.config PARAMS [dotted.key=value ...] --check`: the lines, or
    one line and exit code 2."""
    path, *overrides = [arg for arg in argv if arg != "--check"]
    try:
        lines = preflight(load_params(path, overrides), path, overrides)
    except (ParamsError, PreflightError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print("\n".join(lines))
    return 0


# --------------------------------------------------------------------------- files


@dataclass
class Corpus:
    pairs: int  # training pairs before cleaning
    tokens: int  # a lower bound on the tokens of the longer sides (words + EOS)
    exact: bool  # counted whole, not extrapolated from a sample


def check_files(params: Params, found: Findings) -> Corpus | None:
    """Every file the params name: each split's source files, the tokenized references of
    data.tgt_lang. The training split of a local text source is counted."""
    data, source = params.data, params.data.source
    if source.hub is not None:
        found.said.append(
            f"corpus    {source.hub} ({source.config}, revision "
            f"{source.revision[:12]}): its size is unknown until prepare"
        )
        corpus = None
    else:
        corpus = _check_local(params, found)
    for role in ("valid", "test"):
        try:
            tokenized_refs(params.score, data, role)
        except DataError:
            found.errors.append(_missing_reference(params, role))
    if params.score.compound_split and data.tgt_lang != "de":
        found.warnings.append(
            f"score.compound_split: splits German compounds; data.tgt_lang "
            f"is {data.tgt_lang!r}: set it false"
        )
    return corpus


def _check_local(params: Params, found: Findings) -> Corpus | None:
    data = params.data
    where = Path(data.source.path).expanduser().resolve()
    sides = ", data.src_lang/tgt_lang" if data.source.format == "text" else ""
    files = {}
    for role in ROLES:
        split = getattr(data.splits, role)
        try:
            files[role] = split_files(data, split)
        except DataError as err:
            if not where.is_dir():  # the message names data.source.path
                found.errors.append(str(err))
                return None
            found.errors.append(f"data.splits.{role} ({split!r}){sides}: {err}")
    if len(files) < len(ROLES):
        return None
    corpus = count_corpus(files["train"]) if data.source.format == "text" else None
    if corpus is None:
        size = "its size is unknown until prepare"
    else:
        size = f"train {'' if corpus.exact else '~'}{corpus.pairs:,} pairs"
    found.said.append(
        f"corpus    {where} ({data.source.format}, {data.src_lang}-"
        f"{data.tgt_lang}): {size}; valid, test found"
    )
    return corpus


def _missing_reference(params: Params, role: str) -> str:
    """What score.tokenized_refs lacks, and which languages its folder does hold."""
    folder = Path(params.score.tokenized_refs).expanduser().resolve()
    split, lang = getattr(params.data.splits, role), params.data.tgt_lang
    held = sorted(
        {
            p.name.removesuffix(".gz").rsplit(".", 1)[-1]
            for p in folder.glob(f"{split}.lc.norm.tok.*")
        }
    )
    holds = f" (it holds {', '.join(held)})" if held else ""
    return (
        f"score.tokenized_refs, data.tgt_lang: {folder} has no {split}.lc.norm.tok.{lang} "
        f"(nor .gz){holds}: name a folder of {lang!r} references, or null"
    )


def count_corpus(paths: list[Path]) -> Corpus | None:
    """Pairs of a text split and a lower bound on the tokens of the longer side of each
    pair (a word is at least one subword, plus EOS), from the first SAMPLE_BYTES of each
    side; None if a file cannot be read (the prepare stage names the fault)."""
    try:
        counts = [_count_words(path) for path in paths]
    except (OSError, *GZIP_DAMAGE):
        return None
    pairs = max(lines for lines, _, _ in counts)
    tokens = max(words + lines for lines, words, _ in counts)
    return Corpus(pairs, tokens, all(exact for _, _, exact in counts))


def _count_words(path: Path) -> tuple[int, int, bool]:
    """(lines, words, exact) of a text file (gzip allowed), read in blocks (a file without
    line breaks is never held whole), extrapolated from its first SAMPLE_BYTES by the
    share of the file on disk they came from."""
    lines = words = read = 0
    last = b"\n"  # the last byte read
    with open(path, "rb") as raw:
        f = gzip.GzipFile(fileobj=raw) if path.suffix == ".gz" else raw
        while read < SAMPLE_BYTES and (block := f.read(min(1 << 20, SAMPLE_BYTES))):
            split_word = not last.isspace() and not block[:1].isspace()  # counted twice
            lines, words = lines + block.count(b"\n"), words + len(block.split()) - split_word
            read, last = read + len(block), block[-1:]
        if not f.read(1):
            return lines + (last != b"\n"), words, True  # a last line without its "\n"
        share = raw.tell() / max(path.stat().st_size, 1)
    return round(lines / share), round(words / share), False


# --------------------------------------------------------------------------- learning rate


def reference(path: Path, overrides: list[str]) -> tuple[str, Params] | None:
    """What the run departs from: the params file as written when overrides change it, else
    the file it extends; None for a file that extends none (or a parent that is no whole
    params tree)."""
    try:
        if overrides:
            return path.name, load_params(path)
        parent = (read_yaml(path, "params file", ParamsError) or {}).get("extends")
        if not isinstance(parent, str):
            return None
        return Path(parent).name, load_params(path.parent / parent)
    except (ParamsError, AttributeError):
        return None


def peak_lr(params: Params) -> float:
    """The schedule's highest learning rate, at the end of the warmup."""
    t = params.train
    return inverse_sqrt_schedule(t.warmup_steps, params.model.d_model, t.warmup_steps, t.lr_scale)


def check_schedule(params: Params, ref: tuple[str, Params] | None, found: Findings) -> None:
    t, d_model = params.train, params.model.d_model
    peak = peak_lr(params)
    after = "held" if t.decay == "constant" else "then 1/sqrt(step)"
    start = cooldown_start(t.max_steps, t.cooldown)
    cooldown = "" if start is None else f", to ~0 over updates {start + 1:,}-{t.max_steps:,}"
    found.said.append(
        f"lr        peak {peak:.1e} at update {t.warmup_steps:,} = d_model^-0.5 "
        f"x warmup_steps^-0.5 x lr_scale = {d_model}^-0.5 x {t.warmup_steps}"
        f"^-0.5 x {t.lr_scale:g}; {after}{cooldown}"
    )
    if ref is None:
        return
    name, parent = ref
    was = peak_lr(parent)
    if peak < PEAK_RATIO_WARNING * was or t.lr_scale != parent.train.lr_scale:
        return
    changed = [
        f"{key} {new}"
        for key, new, old in (
            ("train.warmup_steps", t.warmup_steps, parent.train.warmup_steps),
            ("model.d_model", d_model, parent.model.d_model),
        )
        if new != old
    ]
    keep = t.lr_scale * was / peak
    found.warnings.append(
        f"{', '.join(changed)}: the learning rate's peak is {peak:.1e}, "
        f"{peak / was:.1f}x {name}'s {was:.1e} (lr_scale unchanged); "
        f"train.lr_scale={keep:.3g} keeps {name}'s peak"
    )


# --------------------------------------------------------------------------- updates


def check_updates(params: Params, corpus: Corpus | None, found: Findings) -> None:
    t = params.train
    line = f"updates   {t.max_steps:,} of {t.batch_tokens:,} tokens (train.max_steps, batch_tokens)"
    if corpus is None:
        found.said.append(f"{line}; epochs unknown until prepare")
        return
    epochs = t.max_steps * t.batch_tokens / max(corpus.tokens, 1)
    about = f"{epochs:,.0f}" if epochs >= 10 else f"{epochs:.1f}"
    found.said.append(
        f"{line}: at most ~{about} epochs of the corpus (a word counted "
        "as one token; subwords and padding make an epoch longer)"
    )


def cadence(every: int, last: int) -> int:
    """How many of updates 1..last are a multiple of `every` or the last."""
    return last // every + (last % every != 0)


def check_snapshots(params: Params, found: Findings) -> None:
    """The snapshots training is sure to keep against those average.last_n needs.

    The trainer writes a snapshot every train.save_every updates and at the last; with
    train.keep_best, also at a validation that sets a new best, which may not happen. A
    snapshot carries a validation score where it was written at a validation
    (train.valid_every, and the last update): only those count for average.select: best.
    The first validation is always a new best."""
    t, a = params.train, params.average
    keys = "average.last_n, train.save_every, train.max_steps"
    if a.select == "last":
        sure = cadence(t.save_every, t.max_steps)
        kept = f"{sure} snapshots (train.save_every {t.save_every:,}, and the last update)"
    else:
        meet = t.save_every * t.valid_every // math.gcd(t.save_every, t.valid_every)
        first_valid = min(t.valid_every, t.max_steps)
        first_off = first_valid % t.save_every != 0 and first_valid != t.max_steps
        sure = cadence(meet, t.max_steps) + (t.keep_best > 0 and first_off)
        keys += ", train.valid_every"
        kept = (
            f"{sure} scored snapshots (scored where train.valid_every {t.valid_every:,} "
            f"meets save_every {t.save_every:,}, and at the last update)"
        )
    which = "last" if a.select == "last" else "best"
    if sure < a.last_n:
        found.errors.append(
            f"{keys}: {a.last_n} {which} snapshots to average, but training is sure to keep "
            f"{kept}: average fewer, or save more often"
        )
        return
    found.said.append(f"average   the {which} {a.last_n} of {kept}{_in_cooldown(params)}")


def _in_cooldown(params: Params) -> str:
    """Where the snapshots averaged come from: each cooldown's (average.cooldowns), and for
    the last ones, how many lie in the cooldown (the others were written at a higher lr)."""
    t, a = params.train, params.average
    soup = f", from each of {a.cooldowns} cooldowns" if a.cooldowns > 1 else ""
    start = cooldown_start(t.max_steps, t.cooldown)
    if start is None or a.select != "last":
        return soup
    s = t.save_every
    cooled = t.max_steps // s - start // s + (t.max_steps % s != 0)
    return f"{soup}; {min(cooled, a.last_n)} of the {a.last_n} in the cooldown"


def check_cadences(params: Params, found: Findings) -> None:
    """Cadences longer than the run: what they leave out."""
    t = params.train
    if t.save_every > t.max_steps:
        found.warnings.append(
            f"train.save_every {t.save_every:,} > train.max_steps "
            f"{t.max_steps:,}: nothing is saved before the last update (a "
            "stop before it loses the run)"
        )
    if t.valid_every > t.max_steps:
        found.warnings.append(
            f"train.valid_every {t.valid_every:,} > train.max_steps "
            f"{t.max_steps:,}: one validation, at the end"
        )
    if t.log_every > t.max_steps:
        found.warnings.append(
            f"train.log_every {t.log_every:,} > train.max_steps "
            f"{t.max_steps:,}: no training line before the end"
        )
    validations = cadence(t.valid_every, t.max_steps)
    if 0 < validations <= t.patience:
        found.warnings.append(
            f"train.patience {t.patience}: training validates {validations} "
            "time(s) (train.valid_every, max_steps): it never stops early"
        )
