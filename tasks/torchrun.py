"""torchrun for one machine, listening on the loopback interface only.

    python -m tasks.torchrun --nnodes 1 --nproc_per_node N --rdzv-backend c10d \
        --rdzv-endpoint 127.0.0.1:0 -m tasks.train_worker ...

torchrun's key-value stores (its rendezvous and its workers') listen on every interface
whatever address they are given: anyone who reaches the machine could join or disturb the
run. Here each store's server socket is bound to 127.0.0.1 first and handed over
(`master_listen_fd`); everything else is torchrun itself. Runs over several machines use
plain torchrun with the rendezvous their users name.
"""

import socket
import sys

import torch.distributed as dist


class LoopbackTCPStore(dist.TCPStore):
    def __init__(self, host_name, port, world_size=None, is_master=False, *args, **kwargs):
        if is_master and kwargs.get("master_listen_fd") is None:
            server = socket.create_server(("127.0.0.1", port))
            port = server.getsockname()[1]
            kwargs["master_listen_fd"] = server.detach()
        super().__init__(host_name, port, world_size, is_master, *args, **kwargs)


if __name__ == "__main__":
    dist.TCPStore = LoopbackTCPStore  # before torchrun's modules import it
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.run import main

    try:
        sys.exit(main())
    except SignalException as err:  # forwarded to the workers, which saved: no traceback
        sys.exit(128 + err.sigval)
