"""Batches from the shards, collated and prefetched in a thread, resumable between steps.

    ds = ShardDataset(shards_dir, "train")
    sampler = TokenBatchSampler.from_dataset(ds, max_tokens=4096, seed=1, rank=r, world_size=w)
    loader = BatchLoader(ds, sampler)          # infinite, prefetched in a thread
    for batch in loader: ...                   # batch.src, batch.tgt_in, batch.tgt_out
    ckpt["data"] = loader.state_dict()         # position after the batches consumed

The examples and their padding: dataset.py; which go together: sampler.py (and its
static shapes, shape_classes.py).
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Iterator

from transformer.data.dataset import Batch, ShardDataset
from transformer.data.sampler import TokenBatchSampler
from transformer.tokens import BOS, PAD

_END = object()


class BatchLoader:
    """Collates batches in a background thread, `prefetch` ahead of the training step.

    `epoch=None`: the sampler's endless stream, from its current state. `state_dict()` is
    the sampler's state after the last batch *yielded* (not the last prefetched), so a
    checkpoint taken between steps resumes exactly. `epoch=k`: one pass over the rank's
    batches of epoch k, for validation. While iterating, the loader owns the sampler.
    """

    def __init__(
        self,
        dataset: ShardDataset,
        sampler: TokenBatchSampler,
        *,
        epoch: int | None = None,
        prefetch: int = 2,
        pin_memory: bool = False,
        pad_id: int = PAD,
        bos_id: int = BOS,
    ):
        self.dataset, self.sampler, self.epoch = dataset, sampler, epoch
        self.pin_memory, self.pad_id, self.bos_id = pin_memory, pad_id, bos_id
        self._queue: queue.Queue = queue.Queue(maxsize=prefetch)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._state = sampler.state_dict()

    def state_dict(self) -> dict:
        return dict(self._state)

    @property
    def epochs_done(self) -> float:
        """Passes over the corpus so far (fractional): a pass over this rank's batches of
        shards holding the corpus `copies` times is that many."""
        return self.dataset.copies * self._state["consumed"] / max(self.sampler.batches_per_rank, 1)

    def load_state_dict(self, state: dict) -> None:
        self.close()
        self.sampler.load_state_dict(state)
        self._state = self.sampler.state_dict()

    def __iter__(self) -> Iterator[Batch]:
        self.close()
        if self.epoch is None:  # the producer ran ahead of the consumer: rewind to it
            self.sampler.load_state_dict(self._state)
        self._stop = threading.Event()
        self._queue = queue.Queue(maxsize=self._queue.maxsize)
        self._thread = threading.Thread(target=self._produce, daemon=True, name="BatchLoader")
        self._thread.start()
        try:
            while (item := self._queue.get()) is not _END:
                if isinstance(item, BaseException):
                    raise item
                batch, state = item
                if state is not None:
                    self._state = state
                yield batch
        finally:
            self.close()

    def close(self) -> None:
        """Stop the producer thread (iterating again restarts it from the consumed state)."""
        if self._thread is not None:
            self._stop.set()
            self._thread.join()
            self._thread = None

    def _produce(self) -> None:
        try:
            finite = self.epoch is not None
            source = self.sampler.epoch_batches(self.epoch) if finite else self.sampler
            for indices in source:
                pad_to = self.sampler.padded_shape(indices)
                batch = self.dataset.batch(indices, self.pad_id, self.bos_id, pad_to)
                if self.pin_memory:
                    batch = batch.pin_memory()
                if not self._put((batch, None if finite else self.sampler.state_dict())):
                    return
            self._put(_END)
        except BaseException as err:  # handed to the consumer, raised there
            self._put(err)

    def _put(self, item) -> bool:
        while not self._stop.is_set():
            try:
                self._queue.put(item, timeout=0.05)
                return True
            except queue.Full:
                continue
        return False
