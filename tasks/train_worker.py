"""What each torchrun rank runs: the library's trainer, with MLflow plugged in on rank 0.

    torchrun --nproc_per_node N -m tasks.train_worker PARAMS --data SHARDS --out RUN_DIR

The library (`python -m transformer.train`) knows nothing of MLflow; this entry point is the
only place the two meet.
"""

import os
import sys

from tasks.tracking import MlflowLogger
from transformer.train import main

if __name__ == "__main__":
    rank0 = int(os.environ.get("RANK", "0")) == 0
    sys.exit(main(sys.argv[1:], logger=MlflowLogger.from_env() if rank0 else None))
