"""Ranks from the environment, as torchrun sets them; nothing else to configure.

`python -m transformer.train ...` is one process; `torchrun --nproc_per_node N ...` (or a
multi-node rendezvous) sets RANK, WORLD_SIZE and LOCAL_RANK, and the same code then joins a
process group: NCCL on GPUs, gloo on CPUs. With one process every collective is a no-op.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from transformer.training.compiled import compile_layers


@dataclass(frozen=True)
class DistEnv:
    rank: int
    world_size: int
    local_rank: int
    device: torch.device

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.world_size > 1


# A collective waits this long for the slowest rank before the run fails (instead of
# hanging): longer than any save or validation a rank can do while the others wait.
COLLECTIVE_TIMEOUT = timedelta(minutes=30)


class DistributedError(RuntimeError):
    """The processes cannot be laid out as asked (more ranks than GPUs on a node)."""


def init_distributed() -> DistEnv:
    """Read the ranks from the environment; join the process group when WORLD_SIZE > 1."""
    rank = int(os.environ.get("RANK", "0"))
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if torch.cuda.is_available():
        if local_rank >= torch.cuda.device_count():
            raise DistributedError(
                f"local rank {local_rank} but {torch.cuda.device_count()} GPU(s) visible: "
                "start at most one process per GPU (torchrun --nproc_per_node, "
                "pipeline.nproc_per_node)"
            )
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    if world_size > 1 and not dist.is_initialized():
        if device.type == "cuda":  # device_id binds the NCCL communicator eagerly
            dist.init_process_group("nccl", device_id=device, timeout=COLLECTIVE_TIMEOUT)
        else:
            dist.init_process_group("gloo", timeout=COLLECTIVE_TIMEOUT)
    return DistEnv(rank, world_size, local_rank, device)


def shutdown() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


def all_reduce_sum(t: torch.Tensor) -> torch.Tensor:
    """Sum `t` over ranks, in place (returned for chaining)."""
    if dist.is_initialized():
        dist.all_reduce(t, op=dist.ReduceOp.SUM)
    return t


def all_gather_objects(obj: Any) -> list[Any]:
    """Every rank's `obj` (picklable), in rank order, on every rank."""
    if not dist.is_initialized():
        return [obj]
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def broadcast_object(obj: Any) -> Any:
    """Rank 0's `obj` on every rank."""
    if not dist.is_initialized():
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def distribute(model: nn.Module, env: DistEnv, compile: bool) -> nn.Module:
    """`model`'s layers compiled if asked (compiled.py), then DDP if there are several ranks
    (DDP's hooks see the compiled layers' parameters as they are: one module, one state)."""
    if compile:
        compile_layers(model)
    if not env.distributed:
        return model
    device_ids = [env.device] if env.device.type == "cuda" else None
    return DistributedDataParallel(model, device_ids=device_ids, gradient_as_bucket_view=True)
