"""torchrun whose stores listen on the address it is given (`--local-addr`) only.

    python -m tasks.torchrun --nnodes 1 --nproc_per_node N --rdzv-backend c10d \
        --rdzv-endpoint 127.0.0.1:0 --local-addr 127.0.0.1 -m tasks.train_worker ...

torchrun's key-value stores (its rendezvous and its workers') listen on every interface
whatever address they are given: anyone who reaches the machine could join or disturb the
run. Here each store's server socket is bound to `--local-addr` first and handed over
(`master_listen_fd`): the loopback interface for one machine (tasks/launch.py), the node's
address in its cluster for a Slurm job (tasks/slurm.py). It tells its ranks its pid (a rank
whose launcher died before it asked must know; transformer/processes.py). Everything else is
torchrun itself.
"""

import argparse
import os
import socket
import sys

import torch.distributed as dist

from transformer.processes import LAUNCHER_PID


class BoundTCPStore(dist.TCPStore):
    address = "127.0.0.1"  # --local-addr (default: the loopback), set before torchrun starts

    def __init__(self, host_name, port, world_size=None, is_master=False, *args, **kwargs):
        if is_master and kwargs.get("master_listen_fd") is None:
            server = socket.create_server((self.address, port))
            port = server.getsockname()[1]
            kwargs["master_listen_fd"] = server.detach()
        super().__init__(host_name, port, world_size, is_master, *args, **kwargs)


if __name__ == "__main__":
    os.environ[LAUNCHER_PID] = str(os.getpid())  # the ranks' parent, until it dies
    wanted = argparse.ArgumentParser(add_help=False)
    wanted.add_argument("--local-addr", "--local_addr", default=BoundTCPStore.address)
    BoundTCPStore.address = wanted.parse_known_args()[0].local_addr
    dist.TCPStore = BoundTCPStore  # before torchrun's modules import it
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.run import main

    try:
        sys.exit(main())
    except SignalException as err:  # forwarded to the workers, which saved: no traceback
        sys.exit(128 + err.sigval)
