"""`python -m transformer.export`: a model in serving formats (decoding/export.py)."""

import sys

from transformer.decoding.export import main

if __name__ == "__main__":
    sys.exit(main())
