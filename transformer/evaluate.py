"""`python -m transformer.evaluate`: decode and score a test set (decoding/evaluate.py)."""

import sys

from transformer.decoding.evaluate import main

if __name__ == "__main__":
    sys.exit(main())
