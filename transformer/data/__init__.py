"""The data stages before the vocabulary: a source's splits to parquet, then cleaning.

`sources.prepare_source` turns a hub dataset or local files into `{train,valid,test}.parquet`
with string columns `src` and `tgt`; `clean.clean_corpus` filters the training split. Both
write their output directory atomically (`atomic_dir`), so a killed run leaves no directory
that a rerun would trust.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

ROLES = ("train", "valid", "test")


class DataError(ValueError):
    """Input data is missing or malformed; the message names the file (and line)."""


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


def file_sha256(path: str | os.PathLike) -> str:
    """Hex sha256 of a file's bytes, read in chunks (input files can be gigabytes)."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()
