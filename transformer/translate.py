"""`python -m transformer.translate`: translate with an exported model (decoding/translate.py)."""

import sys

from transformer.decoding.translate import main

if __name__ == "__main__":
    sys.exit(main())
