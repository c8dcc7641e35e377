"""`python -m transformer.config PARAMS [dotted.key=value ...]`: the resolved params as YAML,
or one line naming the file and the key, exit code 2. With `--check`, what a run of them
will do instead, or why it cannot finish (transformer/training/preflight.py): a command,
as `python -m transformer.train` is, it may import the wings."""

import sys

from transformer.config.loading import main
from transformer.training.preflight import main as check

if __name__ == "__main__":
    argv = sys.argv[1:]
    sys.exit(check(argv) if "--check" in argv and len(argv) > 1 else main(argv))
