"""What every command of the project shares: a user error is one line on stderr and exit
code 2 (argparse prints its usage block first); anything else is a bug, with its traceback."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path
from typing import NoReturn


class UserError(Exception):
    """Bad params, data, files or checkpoints: the message names the culprit, so one line
    says it all. The library's errors of that kind derive from it (ParamsError, DataError,
    VocabError, CheckpointError)."""


# What a command, or the pipeline around it, reports in one line: the library's user errors
# and the operating system's (a missing file, a full disk, a permission), which name the path.
USER_ERRORS = (UserError, OSError)


def one_line(message: str) -> str:
    """`message` as one line: a character that would break it or hide in it (a newline in a
    path, a NUL, U+2028) written as its escape, so the line names the culprit whole."""
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in message)


class ArgumentParser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        print(f"error: {message} (see {self.prog} --help)", file=sys.stderr)
        sys.exit(2)


def existing_file(what: str) -> Callable[[str], Path]:
    """An argparse type: the path of a regular file that is to be `what` ("a model file");
    a folder, a device or FIFO (which a reader could wait on, or read forever), or no file
    is refused in one line naming it, before anything is read. Its content is the reader's
    to check, and no error quotes it."""

    def check(text: str) -> Path:
        path = Path(text)
        if path.is_dir():
            raise argparse.ArgumentTypeError(f"{text}: a folder, not {what}")
        if not path.exists():
            raise argparse.ArgumentTypeError(f"{text}: no such file")
        if not path.is_file():
            raise argparse.ArgumentTypeError(f"{text}: not a regular file, not {what}")
        return path

    return check
