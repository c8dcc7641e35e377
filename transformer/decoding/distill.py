"""Sequence-level knowledge distillation (Kim & Rush, 2016): the distill stage's library
function. The training split of a cleaned corpus, translated by an ensemble of teachers with
beam search, becomes a corpus in the clean stage's schema (`{train,valid,test}.parquet`,
string columns src and tgt) on which a student trains as on any other: its training
targets are the teachers' translations (or, translating the targets back, its sources),
its valid and test splits the cleaned ones, untouched, so the student is scored against
the real references.

The training split is translated in parts of `distill.part_pairs` pairs, each written whole under
`parts/`: a stopped stage resumes at the first part it lacks, and since a part's batches
depend on its own lines only, the corpus a resumed run writes is, byte for byte, the one an
unbroken run writes. The parts a run lacks are dealt out to its devices, a process each
(the stage's own on the first): at WMT scale, millions of beam searches by an ensemble, one
GPU of eight would take the whole stage.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import logging
import shutil
from collections.abc import Iterator
from pathlib import Path

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import torch

from transformer.config import DataConfig, DistillConfig, ScoreConfig
from transformer.console import Progress
from transformer.data import ROLES, DataError
from transformer.data.sources import SCHEMA
from transformer.decoding.evaluate import translate_and_score
from transformer.decoding.helpers import Read, helped
from transformer.decoding.translate import load_ensemble, translate_lines
from transformer.files import atomic_file, atomic_write
from transformer.nn.kv_cache import Arena

log = logging.getLogger(__name__)

PARTS = "parts"


def distill_corpus(
    cleaned: Path,
    teachers: list[Path],
    cfg: DistillConfig,
    data: DataConfig,
    score_cfg: ScoreConfig,
    out: Path,
    devices: list[str],
) -> dict:
    """Write the distilled corpus into `out` (train, valid and test parquet files, the
    ensemble's hypotheses and scores on valid and test); return the report: the pairs
    written and where they came from, and the ensemble's scores by split. `devices`: where
    the training split is translated, a process each (GPUs, or CPU processes that share
    this one's threads); the first also decodes valid and test."""
    cleaned, out, device = Path(cleaned), Path(out), devices[0]
    paths = [str(t) for t in teachers]
    models, sp, teacher_params = load_ensemble(paths, device)
    _check_direction(teachers[0], teacher_params.data, data, cfg.replace)
    side = "src" if cfg.replace == "target" else "tgt"  # what the teachers translate
    source = cleaned / "train.parquet"
    read = functools.partial(_read_rows, source, side)
    total = pq.read_metadata(source).num_rows
    made = _translate_parts(models, sp, read, total, cfg, out / PARTS, devices, paths)
    train = pq.read_table(source)
    report = {"teachers": paths, "replace": cfg.replace}
    report |= _write_train(train, made, cfg, out / "train.parquet")
    for role in ROLES[1:]:  # valid, test: the cleaned splits, scored against their references
        _copy(cleaned / f"{role}.parquet", out / f"{role}.parquet")
    report["scores"], _ = translate_and_score(models, sp, cleaned, data, cfg.decode, score_cfg,
                                              out, device)  # fmt: skip
    log.info("distilled %d pairs; the ensemble of %d: valid BLEU %.2f, test BLEU %.2f",
             report["pairs"], len(teachers), report["scores"]["valid"]["bleu"],
             report["scores"]["test"]["bleu"])  # fmt: skip
    return report


def _check_direction(teacher: Path, theirs: DataConfig, ours: DataConfig, replace: str) -> None:
    """Teachers translate the side they replace: source to target for `target`, target to
    source (back-translation) for `source`."""
    want = (ours.src_lang, ours.tgt_lang) if replace == "target" else (ours.tgt_lang, ours.src_lang)
    if (theirs.src_lang, theirs.tgt_lang) != want:
        raise DataError(
            f"{teacher}: translates {theirs.src_lang}->{theirs.tgt_lang}; distill.replace "
            f"{replace} needs teachers of {want[0]}->{want[1]}"
        )


def _read_rows(path: Path, column: str, wanted: list[slice]) -> Iterator[list[str]]:
    """The lines of each range of rows in `wanted` (ascending), one range at a time, read
    through the file a batch at a time as they are asked for: a process holds the part it
    translates, never the column."""
    if any(a.stop > b.start for a, b in itertools.pairwise(wanted)):
        raise ValueError(f"row ranges out of order: {wanted}")
    ranges, got, at = iter(wanted), [], 0
    rows = next(ranges, None)
    batches = pq.ParquetFile(path).iter_batches(columns=[column]) if rows is not None else ()
    for batch in batches:
        end = at + batch.num_rows
        while rows is not None and rows.start < end:
            start, stop = max(rows.start, at), min(rows.stop, end)
            got += batch.column(0).slice(start - at, stop - start).to_pylist()
            if rows.stop > end:  # goes on in the next batch
                break
            yield got
            got, rows = [], next(ranges, None)
        if rows is None:
            return
        at = end
    if rows is not None:
        raise DataError(f"{path}: {at:,} rows, where rows up to {rows.stop:,} were to be read")


def _translate_parts(
    models, sp, read: Read, total: int, cfg: DistillConfig, parts: Path, devices: list[str],
    teachers: list[str],
) -> list[str]:  # fmt: skip
    """The teachers' translation of the `total` lines `read` reads, part by part; parts
    already written (by a run that was stopped) are read back, not translated again. The
    missing parts are dealt out in turn to the devices: this process translates the
    first's share with `models`, a helper process each of the others' (helpers.py); each
    reads its share's lines itself."""
    parts.mkdir(parents=True, exist_ok=True)
    for leftover in parts.glob(".*.tmp"):  # a part a stopped run was writing
        leftover.unlink()
    size = cfg.part_pairs
    chunks = {parts / f"{i // size:05d}.parquet": slice(i, min(i + size, total))
              for i in range(0, total, size)}  # fmt: skip
    todo = {path for path in chunks if not path.is_file()}
    if len(todo) < len(chunks):
        log.info("distilling: %d/%d parts written by a stopped run, read back",
                 len(chunks) - len(todo), len(chunks))  # fmt: skip
    n = max(1, min(len(devices), len(todo)))  # the processes that translate
    missing = [path for path in chunks if path in todo]  # in order, dealt out in turn
    shares = [missing[k::n] for k in range(n)]
    done = sum(_rows(chunk) for path, chunk in chunks.items() if path not in todo)
    progress = Progress("distilling", total, "sentences", log, done=done)
    written = _Written(todo, chunks, progress)
    threads = max(1, torch.get_num_threads() // n)  # on a CPU, the cores' threads shared
    others = [(device, {path: chunks[path] for path in share})
              for device, share in zip(devices[1:n], shares[1:], strict=True)]  # fmt: skip
    with (
        helped(others, read, teachers, cfg.decode, threads, _write_part) as helpers,
        _threads(threads),
    ):
        # One cache memory for every part: an arena a part, freed after it, left glibc's
        # heap a GB larger a part of 2,000 sentences (three teachers on a CPU).
        arena = Arena()
        mine = read([chunks[path] for path in shares[0]])
        for path, lines in zip(shares[0], mine, strict=True):
            _write_part(path, translate_lines(models, sp, lines, cfg.decode, devices[0],
                                              arena=arena))  # fmt: skip
            helpers.check()  # a helper that failed ends the stage now, not hours later
            written.count()
        helpers.wait(written.count)
    progress.close()
    return [hyp for path, chunk in chunks.items() for hyp in _read_part(path, _rows(chunk))]


def _rows(chunk: slice) -> int:
    return chunk.stop - chunk.start


class _Written:
    """The progress of every process's parts, from the parts on disk."""

    def __init__(self, todo: set[Path], chunks: dict[Path, slice], progress: Progress):
        self.todo, self.chunks, self.progress = set(todo), chunks, progress

    def count(self) -> None:
        new = {path for path in self.todo if path.is_file()}
        self.todo -= new
        self.progress.update(sum(_rows(self.chunks[path]) for path in new))


@contextlib.contextmanager
def _threads(n: int) -> Iterator[None]:
    """This process's CPU threads for the block: its share of them beside its helpers."""
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def _write_part(path: Path, hyps: list[str]) -> None:
    table = pa.table({"hyp": pa.array(hyps, pa.string())})
    atomic_write(path, lambda f: pq.write_table(table, f))


def _read_part(path: Path, rows: int) -> list[str]:
    try:
        hyps = pq.read_table(path)["hyp"].to_pylist()
    except (pa.ArrowException, OSError, KeyError) as err:
        raise DataError(f"{path}: not a part this stage wrote ({err}): delete it") from None
    if len(hyps) != rows:
        raise DataError(f"{path}: {len(hyps)} translations for {rows} lines: delete it")
    return hyps


def _write_train(train: pa.Table, made: list[str], cfg: DistillConfig, dest: Path) -> dict:
    """The distilled training pairs (those whose translation is not empty), after the
    original pairs if the params keep them; a distilled pair equal to its original is
    written once."""
    hyps = pa.array(made, pa.string())
    src, tgt = (train["src"], hyps) if cfg.replace == "target" else (hyps, train["tgt"])
    distilled = pa.table({"src": src, "tgt": tgt}, schema=SCHEMA)
    keep = pc.not_equal(pc.utf8_length(hyps), 0)
    empty = len(made) - pc.sum(keep).as_py()
    same = 0
    if cfg.keep_originals:
        changed = pc.invert(pc.equal(hyps, train["tgt" if cfg.replace == "target" else "src"]))
        same = pc.sum(pc.and_(keep, pc.invert(changed))).as_py()
        keep = pc.and_(keep, changed)
    distilled = distilled.filter(keep)
    originals = [train.select(["src", "tgt"]).cast(SCHEMA)] if cfg.keep_originals else []
    corpus = pa.concat_tables([*originals, distilled])
    if corpus.num_rows == 0:
        raise DataError(f"{dest}: the teachers translated every training line to nothing")
    with atomic_file(dest) as f:
        pq.write_table(corpus, f)
    return {
        "pairs": corpus.num_rows,
        "distilled": distilled.num_rows,
        "originals": train.num_rows if cfg.keep_originals else 0,
        "dropped_empty": empty,
        "same_as_original": same,
    }


def _copy(source: Path, dest: Path) -> None:
    with open(source, "rb") as src, atomic_file(dest) as f:
        shutil.copyfileobj(src, f)
