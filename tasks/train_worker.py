"""What each torchrun rank runs: the library's trainer, with MLflow plugged in on rank 0.

    torchrun --nproc_per_node N -m tasks.train_worker PARAMS --data SHARDS --out RUN_DIR

The library (`python -m transformer.train`) knows nothing of MLflow; this entry point is the
only place the two meet. RANK0_LOG, if set, is where rank 0 writes its output: in a Slurm
job the rendezvous, not the launcher, decides which node holds rank 0 (tasks/slurm.py).
"""

import os
import sys

from tasks.tracking import MlflowLogger
from transformer.train import main

if __name__ == "__main__":
    rank0 = int(os.environ.get("RANK", "0")) == 0
    if rank0 and os.environ.get("RANK0_LOG"):
        log = os.open(os.environ["RANK0_LOG"], os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        os.dup2(log, sys.stdout.fileno())
        os.dup2(log, sys.stderr.fileno())
    sys.exit(main(sys.argv[1:], logger=MlflowLogger.from_env() if rank0 else None))
