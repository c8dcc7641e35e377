"""What every command of the project shares: a usage error is one line on stderr and exit
code 2, like every other user error (argparse prints its usage block first)."""

from __future__ import annotations

import argparse
import sys
from typing import NoReturn


class ArgumentParser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        print(f"error: {message} (see {self.prog} --help)", file=sys.stderr)
        sys.exit(2)
