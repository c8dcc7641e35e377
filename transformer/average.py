"""`python -m transformer.average`: a run's checkpoints averaged (training/average.py)."""

import sys

from transformer.training.average import main

if __name__ == "__main__":
    sys.exit(main())
