"""The names of the files a run writes, in one place, the atomic ways they are written, and
the lock that keeps two writers of one folder apart.

A stage folder is complete or absent: `atomic_dir` builds it beside its final name and
renames it into place; single files go through `atomic_write` (write aside, fsync, rename).
"""

from __future__ import annotations

import fcntl
import gzip
import hashlib
import os
import shutil
import stat
import uuid
import zlib
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import IO, BinaryIO

from transformer.cli import UserError

SPM_MODEL = "spm.model"  # the joint sentencepiece model (vocab stage, shards, run folder)
SPM_VOCAB = "spm.vocab"  # its piece list, for people
VOCAB_REPORT = "vocab.json"
PREPARE_REPORT = "prepare.json"
CLEAN_REPORT = "clean.json"
MANIFEST = "manifest.json"  # shards: counts, checksums, the data fingerprint
CHECKPOINTS = "checkpoints"  # run folder: training states and model snapshots
TRAIN_LOG = "train.log"
MODEL = "model.pt"  # an exported (averaged) model, everything translate needs
SCORES = "scores.json"
STAGE_RECORD = "stage.json"  # what a finished stage holds (tasks/stages.py)
PARAMS = "params.yaml"  # resolved params of a pipeline run

GZIP_DAMAGE = (EOFError, zlib.error, gzip.BadGzipFile)  # reading a cut or corrupt gzip file


def hypotheses(role: str) -> str:
    return f"{role}.hyp"


@contextmanager
def atomic_dir(out_dir: str | os.PathLike) -> Iterator[Path]:
    """Yield an empty directory beside `out_dir`; on success it becomes `out_dir`.

    The directory is renamed into place only after the body returns, so `out_dir` either
    holds a complete result or does not exist; a failure removes the half-written one.
    """
    out_dir = Path(out_dir)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = _fresh_dir(out_dir, "tmp")
    try:
        yield tmp
        _fsync_files(tmp)
        _replace_dir(tmp, out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _fresh_dir(out_dir: Path, kind: str) -> Path:
    # A hidden sibling on the same filesystem (rename is atomic only within one); made with
    # mkdir, unlike tempfile.mkdtemp, so its permissions follow the umask.
    path = out_dir.parent / f".{out_dir.name}.{uuid.uuid4().hex[:12]}.{kind}"
    path.mkdir()
    return path


def _fsync_files(folder: Path) -> None:
    # Renaming is only atomic for what reached the disk: flush the files first, so a crash
    # right after the rename cannot expose empty or truncated files under the final name.
    for path in folder.iterdir():
        if path.is_file():
            fd = os.open(path, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)


def _replace_dir(tmp: Path, out_dir: Path) -> None:
    # os.replace cannot overwrite a non-empty directory: move an old result aside first.
    if out_dir.exists():
        old = _fresh_dir(out_dir, "old")
        os.replace(out_dir, old / out_dir.name)
        os.replace(tmp, out_dir)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.replace(tmp, out_dir)


@contextmanager
def gzip_damage(name: object, error: type[Exception]) -> Iterator[None]:
    """A cut or corrupt gzip file, wherever in it the damage shows, as one `error` naming it."""
    try:
        yield
    except GZIP_DAMAGE as err:
        raise error(f"{name}: truncated or corrupt gzip file ({err})") from None


def file_sha256(path: str | os.PathLike) -> str:
    """Hex sha256 of a file's bytes, read in chunks (input files can be gigabytes)."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()


def read_bounded(path: str | os.PathLike, limit: int, what: str, error: type[Exception]) -> bytes:
    """The bytes of the regular file `path`, at most `limit` of them; anything else (no such
    file, a folder, a FIFO or device such as /dev/zero, a larger file, an unreadable one) is
    `error`, one line naming the file. Opened without blocking and checked with fstat
    before any read: a FIFO would otherwise wait for a writer, /dev/zero never end."""
    path = Path(path)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    except FileNotFoundError:
        raise error(f"{path}: no such {what}") from None
    except OSError as err:
        raise error(f"{path}: cannot read the {what}: {err.strerror}") from None
    mode = os.fstat(fd).st_mode
    if not stat.S_ISREG(mode):
        os.close(fd)
        kind = "a folder" if stat.S_ISDIR(mode) else "not a regular file"
        raise error(f"{path}: {kind}, not a {what}")
    with open(fd, "rb") as f:
        try:
            data = f.read(limit + 1)  # one byte more tells a file over the bound
        except OSError as err:
            raise error(f"{path}: cannot read the {what}: {err.strerror}") from None
    if len(data) > limit:
        raise error(f"{path}: larger than {limit:,} bytes: not a {what}")
    return data


def atomic_write(path: str | os.PathLike, data: bytes | str | Callable[[BinaryIO], object]) -> Path:
    """Write `data` (or what `data(file)` writes, torch.save say) to `path` atomically,
    making its folder if need be."""
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    with atomic_file(path) as f:
        if callable(data):
            data(f)
        else:
            f.write(data.encode("utf-8") if isinstance(data, str) else data)
    return Path(path)


@contextmanager
def atomic_file(path: str | os.PathLike, buffering: int = -1) -> Iterator[BinaryIO]:
    """A file to write, beside `path`: fsynced and renamed onto `path` when the block ends,
    removed if it raises. A kill leaves the old file or the new (and a leftover that
    remove_leftovers finds), never a truncated or half-written one."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex[:12]}.tmp")
    try:
        with open(tmp, "wb", buffering=buffering) as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


class OutputError(UserError, ValueError):
    """An output that would replace what the command reads, or what it did not make."""


def check_output(
    out: str | os.PathLike,
    inputs: Iterable[str | os.PathLike],
    option: str = "--out",
    marker: str | None = None,
    force: bool = False,
) -> None:
    """Refuse `out` if it is one of `inputs` or a folder holding one; with `marker`, `out`
    is a folder, and an existing one must be empty or hold that file (a result of this
    command, replaced whole) unless `force`. Checked before any work, so nothing is lost."""
    out = Path(out).resolve()
    for given in inputs:
        source = Path(given).resolve()
        if source == out or out in source.parents:
            raise OutputError(f"{option} {out}: holds the input {given}: choose another path")
    if marker is None or not out.exists():
        return
    if not out.is_dir():
        raise OutputError(f"{option} {out}: a file, not a folder")
    if not force and any(out.iterdir()) and not (out / marker).exists():
        raise OutputError(
            f"{option} {out}: a non-empty folder this command did not make (no {marker}): "
            "choose another, or pass --force to replace it"
        )


@contextmanager
def locked(
    path: str | os.PathLike, waiting: Callable[[], object], shared: bool = False
) -> Iterator[None]:
    """An exclusive lock on the file `path` (made if absent) for the block, across
    processes (`shared`: one that other shared holders may hold too); if another process
    holds it, `waiting()` says so, then this one waits. The lock goes with the open file: a
    process that dies, killed or not, releases it."""
    with lock_file(path, waiting, shared):
        yield


def lock_file(path: str | os.PathLike, waiting: Callable[[], object], shared: bool = False) -> IO:
    """`locked`'s lock, held until the returned file is closed: for a lock that outlives
    the block that takes it."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    kind = fcntl.LOCK_SH if shared else fcntl.LOCK_EX
    # The open file is the lock: it is returned open. "a": never truncated under its holders.
    f = open(path, "a")  # noqa: SIM115
    try:
        try:
            fcntl.flock(f, kind | fcntl.LOCK_NB)
        except BlockingIOError:
            waiting()
            fcntl.flock(f, kind)
    except BaseException:
        f.close()
        raise
    return f


def remove_leftovers(out_dir: str | os.PathLike) -> list[Path]:
    """The hidden siblings that killed atomic writes of `out_dir` left behind (call it only
    while no writer can be at work on `out_dir`: the stage holds its lock)."""
    out_dir = Path(out_dir)
    found = [p for p in out_dir.parent.glob(f".{out_dir.name}.*") if p.suffix in (".tmp", ".old")]
    for path in found:
        shutil.rmtree(path, ignore_errors=True) if path.is_dir() else path.unlink(missing_ok=True)
    return found
