"""`python -m transformer.config PARAMS [dotted.key=value ...]`: the resolved params as YAML,
or one line naming the file and the key, exit code 2."""

import sys

from transformer.config.loading import main

if __name__ == "__main__":
    sys.exit(main())
