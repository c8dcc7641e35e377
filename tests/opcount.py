"""Counting what the host asks of the device: real aten ops (views excluded, as they launch
nothing) and reads of device values, under a TorchDispatchMode."""

from __future__ import annotations

from collections import Counter

from torch.utils._python_dispatch import TorchDispatchMode

# A device value read by the host: the op behind .item(), .tolist() and bool(tensor).
READS = {"aten._local_scalar_dense"}


class OpCounter(TorchDispatchMode):
    """`with OpCounter() as ops: ...`, then ops.total, ops.reads, ops.counts (by op name)."""

    def __init__(self):
        super().__init__()
        self.counts: Counter[str] = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not func.is_view:
            self.counts[str(func.overloadpacket)] += 1
        return func(*args, **(kwargs or {}))

    @property
    def total(self) -> int:
        return sum(self.counts.values())

    @property
    def reads(self) -> int:
        return sum(self.counts[name] for name in READS)
