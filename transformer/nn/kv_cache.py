"""The decoder's key/value caches for step-by-step decoding (transformer.decoding.search): each
`decode()` computes only its new positions, and beam search reorders hypotheses by moving
small masks, not keys and values.

On a CPU, where cpu_decoding's attention kernel reads them, keys are kept in tiles of 16
keys transposed, the layout its score loop reads: KVCache's self-attention keys
(SelfAttentionKV) and every cache's encoder-decoder keys (`stored_keys`). StaticKVCache's
self-attention keys stay rows (the kernel transposes them as it reads).

- `KVCache` grows and shrinks: when sentences leave the batch (`Shrink`), the rows of those
  that stay move only where a sentence that left makes room, and it drops the slots no
  hypothesis sees any more now and then.
- `Arena` keeps the keys' and values' memory from one batch's search to the next.
- `StaticKVCache` never changes shape: every buffer is allocated for the whole batch and its
  longest output before the first step, finished sentences stay, and each step runs the
  same operations on the same shapes (a CUDA graph replays it; torch.compile compiles it
  once). The step number is a 0-dim device tensor, never a Python int.

Shapes: B target rows (hypotheses), B' source rows (sentences), g = B / B' rows per
sentence, h heads, S source length, d_k = D / h.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor

from transformer.nn import cpu_decoding, kernels
from transformer.nn.cpu_decoding import TILE


def stored_keys(k: Tensor) -> Tensor:
    """Keys (B', h, S, d_k) as a decoding cache keeps them: in tiles where cpu_decoding's
    attention kernel reads them (its fastest layout: cpu_decoding.tile_keys), else as they
    are."""
    return cpu_decoding.tile_keys(k) if kernels.reads_tiles(k) else k


class Shrink:
    """Sentences leave the batch: the source rows that stay, `kept` (B',), in their new
    order. That order is the first B' rows, except that each row of a sentence that left
    (`holes`) takes a row from beyond B' (`fill`): `apply` then moves only those rows, in
    place, and cuts the rest off, instead of copying every row that stays (with the keys
    and values of each layer, the largest copy of a decoding step on a CPU). Built on the
    host from which rows are done, which the search knows anyway."""

    def __init__(self, done: list[bool], device: torch.device | str):
        n = done.count(False)
        holes = [i for i in range(n) if done[i]]
        fill = [i for i in range(n, len(done)) if not done[i]]  # as many as there are holes
        kept = list(range(n))
        for hole, row in zip(holes, fill, strict=True):
            kept[hole] = row
        gone = [i for i, d in enumerate(done) if d]
        parts = (kept, holes, fill, gone)  # one copy to the device for the four
        index = torch.tensor([i for part in parts for i in part], dtype=torch.long, device=device)
        self.kept, self.holes, self.fill, self.gone = index.split([len(p) for p in parts])

    def apply(self, t: Tensor, dim: int = 0) -> Tensor:
        """t's rows `kept` along `dim`: the holes of `t` filled in place, the tail cut off
        (a view of `t`)."""
        if self.holes.numel():
            at = (slice(None),) * dim
            t[(*at, self.holes)] = t[(*at, self.fill)]
        return t.narrow(dim, 0, self.kept.numel())


class Arena:
    """Memory that the KV caches of successive searches reuse, for a caller that decodes
    batch after batch (translation, validation, the benchmarks): each search `rewind`s it,
    and its caches `take` their keys' and values' buffers from it in turn, the i-th buffer
    of a search in the block that kept the i-th of the one before (grown where too small).

    Why: on a CPU a cache's buffers are tens of MB a layer, more than glibc keeps for reuse
    when freed (it returns blocks over 32 MB to the system), so every batch would write to
    fresh pages, and the first write to each 4 KB page is a page fault
    (benchmarks/results/2026-11-28-zen4-decode/NOTES.md). Each block keeps the largest size
    it was asked for until the arena is dropped. One search at a time: a second one at
    once would write into the first one's keys."""

    def __init__(self):
        self._blocks: list[Tensor] = []
        self._next = 0

    def rewind(self) -> None:
        """A new search: the buffers handed out so far are free again."""
        self._next = 0

    def take(self, shape: tuple[int, ...], like: Tensor) -> Tensor:
        """An uninitialised tensor of `shape`, with `like`'s dtype and device."""
        size = math.prod(shape)
        if self._next == len(self._blocks):
            self._blocks.append(like.new_empty(size))
        block = self._blocks[self._next]
        if block.numel() < size or block.dtype != like.dtype or block.device != like.device:
            block = self._blocks[self._next] = like.new_empty(size)
        self._next += 1
        return block[:size].view(shape)


class KVCache:
    """Keys and values of every decoder layer, so that each `decode()` computes only its new
    positions. The g target rows that share a source row (beam search's hypotheses of one
    sentence) share a row of the cache:
    - encoder-decoder attention: (B', h, S, d_k) per layer, from the memory on the first
      `decode()`;
    - self-attention: (2, B', h, slots, d_k) per layer (`SelfAttentionKV`), preallocated
      for `max_len` positions. Each decode() appends its T positions' slots, position by
      position, g per position (row j's at j), and they stay there. A row attends to the
      slots of its own past, which `visible` (B, slots) marks, so reordering the rows moves
      only these marks; keys and values move only when sentences leave the batch (those of
      the sentences that take their places: `Shrink`), and when the slots that no row sees
      any more are dropped (each time the slots have doubled).
    The self-attention buffers come from `arena` where given (see Arena), else are new.
    """

    def __init__(self, n_layers: int, max_len: int, arena: Arena | None = None):
        self.max_len, self.length, self.group, self.arena = max_len, 0, 1, arena
        self.filled = self.compacted = 0  # slots in use; in use after the last compaction
        self.self_attn = [SelfAttentionKV(self) for _ in range(n_layers)]
        self.cross_attn: list[dict[str, Tensor]] = [{} for _ in range(n_layers)]
        self.visible: Tensor | None = None  # (B, slots), True = in the row's past
        self.mask: Tensor | None = None  # this decode()'s (B', 1, g * T, slots), 0 or -inf
        self._src_mask: Tensor | None = None  # (B', 1, 1, S), 0 or -inf
        self._place: tuple[tuple[int, int], Tensor] | None = None  # see _places

    def src_mask(self, padding: Tensor) -> Tensor:
        """The source key mask of every step, additive (kernels.attention adds it faster than
        it masks): built on the first step, cut with the rows when sentences leave."""
        if self._src_mask is None:
            self._src_mask = torch.where(padding[:, None, None, :], float("-inf"), 0.0)
        return self._src_mask

    def layers(self, tgt_in: Tensor, memory: Tensor) -> list[tuple[SelfAttentionKV, dict]]:
        """Give the T new positions of tgt_in (B, T) their slots, in their rows' past, and
        set this decode()'s self-attention mask."""
        (b, t), g, dev = tgt_in.shape, tgt_in.size(0) // memory.size(0), tgt_in.device
        start, self.group = self.filled, g
        self.length, self.filled = self.length + t, self.filled + t * g
        self._reserve(b, self.filled + max(self.max_len - self.length, 0) * g, dev)
        seen = self.visible[:, None, : self.filled]  # (B, 1, slots)
        if t == 1:  # a search's step: row j's new slot is start + j % g
            self.visible.scatter_(1, self._places(b, g) + start, True)
        else:
            new = start + torch.arange(0, t * g, g, device=dev)  # (T,) the group's first row's
            self.visible.scatter_(1, new + self._places(b, g), True)
            later = torch.arange(self.filled, device=dev) >= new[:, None] + g  # (T, slots)
            seen = seen & ~later  # (B, T, slots): a new position sees no later one
        # No mask when each row is alone in its group: it sees all the group's slots. Else
        # an additive one, made once for all layers (kernels.attention adds it faster than
        # it masks).
        self.mask = None
        if not g == t == 1:
            self.mask = torch.where(seen.reshape(b // g, 1, g * t, -1), 0.0, float("-inf"))
        return list(zip(self.self_attn, self.cross_attn, strict=True))

    def _places(self, b: int, g: int) -> Tensor:
        """(B, 1): each row's place in its group, j % g; made again only when B or g
        change (when sentences leave, or the beams start)."""
        if self._place is None or self._place[0] != (b, g):
            self._place = (b, g), torch.arange(b, device=self.visible.device)[:, None] % g
        return self._place[1]

    def _reserve(self, b: int, slots: int, device: torch.device) -> None:
        """Room in `visible` (and so in the keys and values) for `slots` slots: those up to
        max_len, or, past it, twice as many as before."""
        if self.visible is None:
            self.visible = torch.zeros(b, slots, dtype=torch.bool, device=device)
        elif slots > self.visible.size(1):
            room = max(slots, 2 * self.visible.size(1))
            self.visible = F.pad(self.visible, (0, room - self.visible.size(1)))

    def reorder(self, rows: Tensor, shrink: Shrink | None = None) -> None:
        """Keep target rows `rows` (B,), in that order: beam search expands, reorders and
        drops hypotheses with it. A row may only take the place of a row of its own group
        (rows[i] // g == shrink.kept[i // g]). When sentences leave the batch (`shrink`),
        the keys and values keep only those of the sentences that stay."""
        self.visible = self.visible[rows]
        if shrink is not None:
            for kv in self.self_attn:
                kv.keep(shrink)
            for entry in self.cross_attn:
                for name, t in entry.items():
                    entry[name] = shrink.apply(t)
            if self._src_mask is not None:
                self._src_mask = shrink.apply(self._src_mask)
        # Compaction costs a host sync and a copy: once 16 positions are in, then each time
        # the slots have doubled since.
        if self.group > 1 and self.filled >= max(2 * self.compacted, 16 * self.group):
            self._compact()

    def _compact(self) -> None:
        """Drop the slots that no row sees (hypotheses that beam search dropped). A sentence
        keeps its used slots in their order, and as many as the one that uses most."""
        g = self.group
        used = self.visible[:, : self.filled].unflatten(0, (-1, g)).any(1)  # (B', slots)
        n = int(used.sum(1).max())  # the one host sync, once in a while
        keep = used.char().argsort(dim=1, descending=True, stable=True)[:, :n]  # (B', n)
        visible = self.visible.gather(1, keep.repeat_interleave(g, 0))
        self.visible = F.pad(visible, (0, self.visible.size(1) - n))
        for kv in self.self_attn:
            kv.compact(keep)
        self.filled = self.compacted = n


class SelfAttentionKV:
    """One layer's self-attention keys and values, (2, B', h, slots, d_k), in the slots that
    its KVCache assigns. Keys first, then values: the filled slots of each are then a view
    whose (B', h) dimensions merge into one batch dimension, which the attention's batched
    products take as it is (with keys and values interleaved per row they copied every
    filled slot at every step). Where cpu_decoding's attention kernel reads them (`tiled`:
    kernels.reads_tiles), the keys' half holds them in its tiles instead, (B', h,
    slots / 16, d_k, 16), the layout that kernel's score loop reads, slots come in whole
    tiles, and cpu_decoding's C writes new keys and values and compacts both in place
    (torch's copies of a step's few slots per row cost several times as much). Dropping rows
    moves only the rows that fill a hole (`Shrink`); dropping slots moves the slots kept to
    the front of their rows."""

    def __init__(self, cache: KVCache):
        self.cache = cache
        self.kv: Tensor | None = None
        self.tiled = False

    @property
    def mask(self) -> Tensor:
        return self.cache.mask

    def extend(self, kv: Tensor) -> tuple[Tensor, Tensor]:
        """Store the new positions' keys and values kv (2, B, h, T, d_k); return those of all
        filled slots: keys (B', h, slots, d_k), or in tiles (B', h, tiles, d_k, 16), and
        values (B', h, slots, d_k)."""
        c, (_, b, h, t, d_k) = self.cache, kv.shape
        if self.kv is None:
            self.tiled = kernels.reads_tiles(kv)
        if self.kv is None or self.kv.size(3) < c.visible.size(1):
            room = -(-c.visible.size(1) // TILE) * TILE if self.tiled else c.visible.size(1)
            shape = (2, b // c.group, h, room, d_k)
            fresh = kv.new_empty(shape) if c.arena is None else c.arena.take(shape, kv)
            self._grow(fresh, c.filled - t * c.group)
        start = c.filled - t * c.group
        new = kv.unflatten(1, (-1, c.group)).permute(0, 1, 3, 4, 2, 5)  # (2, B', h, T, g, d_k)
        if not self.tiled:
            self.kv[:, :, :, start : c.filled].unflatten(3, (t, c.group)).copy_(new)
            return self.kv[0, :, :, : c.filled], self.kv[1, :, :, : c.filled]
        keys, values = self.keys(), self.kv[1]  # (B', h, tiles, d_k, 16), (B', h, slots, d_k)
        new = new.flatten(3, 4)  # (2, B', h, T * g, d_k)
        cpu_decoding.put_slots(keys, new[0], start)
        cpu_decoding.put_slots(values, new[1], start)
        return keys[:, :, : -(-c.filled // TILE)], values[:, :, : c.filled]

    def keys(self) -> Tensor:
        """The keys' half as tiles (B', h, slots / 16, d_k, 16) (`tiled` only)."""
        b, h, room, d_k = self.kv.shape[1:]
        return self.kv[0].view(b, h, room // TILE, d_k, TILE)

    def _written(self, filled: int) -> int:
        """The slots to move with the first `filled`: whole tiles where tiled."""
        return -(-filled // TILE) * TILE if self.tiled else filled

    def _grow(self, kv: Tensor, filled: int) -> None:
        """Move to the larger `kv` with the `filled` slots in use, not the whole old buffer
        (at beam search's second step: the first step's one slot, not its reservation)."""
        if self.kv is not None:
            n = self._written(filled)
            kv[:, :, :, :n] = self.kv[:, :, :, :n]
        self.kv = kv

    def keep(self, shrink: Shrink) -> None:
        """Keep the source rows `shrink.kept`: only their filled slots move, and only theirs
        that fill a hole."""
        shrink.apply(self.kv[:, :, :, : self._written(self.cache.filled)], dim=1)
        self.kv = self.kv.narrow(1, 0, shrink.kept.numel())

    def compact(self, slots: Tensor) -> None:
        """Keep slots `slots` (B', n) of each row, in that order, as its first n."""
        if self.tiled:
            # In place: a row's used slots keep their order, so each moves to an earlier slot
            # or stays (`_compact` puts the unused ones, which no row sees, after them).
            cpu_decoding.keep_slots(self.keys(), slots)
            cpu_decoding.keep_slots(self.kv[1], slots)
            return
        # An index_select of (row, head, slot) vectors: faster than a gather along the
        # slots, whose index repeats each slot d_k times (15b6030,
        # benchmarks/results/2026-11-25-cpu-2cores/decode.md). Keys and values apart: once rows
        # have left (`keep`), the two are not one contiguous block, and index_select would
        # first copy the whole buffer to make them one.
        (_, b, h, room, d_k), n = self.kv.shape, slots.size(1)
        heads = torch.arange(b * h, device=slots.device).view(b, h, 1) * room
        vectors = (heads + slots[:, None, :]).flatten()  # (B' * h * n,)
        for half in self.kv:  # (B', h, room, d_k), contiguous
            half[:, :, :n] = half.flatten(0, 2).index_select(0, vectors).view(b, h, n, d_k)


# The memory-efficient attention kernel (CUDA) pads, at every call, a mask whose strides but
# the last are not multiples of 8 elements (torch's sdpa preprocess_mask): the static cache's
# masks are allocated so.
ALIGN = 8


class StaticKVCache:
    """Keys and values of every decoder layer for a whole batch in buffers of fixed shape, with
    KVCache's protocol (`length`, `layers()`, `src_mask()`, `reorder()`; per layer `extend()`
    and `mask`, and the encoder-decoder keys and values filled by the first `decode()`).

    B' sentences of g hypotheses, up to `positions` positions each (BOS included). The slots
    are laid out as KVCache's before any compaction: BOS in slot 0 (the first step has one
    row per sentence), then position p >= 1 of row j of its sentence in slot 1 + (p - 1) g + j.
    Every step attends over all slots (or the first `in_use`), and the additive mask
    `visible` (B, slots) keeps each row to its own past: 0 there, -inf elsewhere, including
    the slots not written yet (zeros, so that a hidden slot adds 0, not 0 * garbage). Beam
    search's reorders gather the mask's rows in place; finished sentences stay.

    `length` is the search's step counter, a 0-dim long tensor that it advances (shared by
    an ensemble's caches): decode() reads it as the position of the new token, and
    `layers()` as the row of the slot table. `in_use`: the slots written so far, where the
    host counts them (eager steps on a CPU, which then attend over those only); None in a
    CUDA graph or a compiled step, whose shapes must not change.
    """

    def __init__(
        self, n_layers: int, sentences: int, group: int, positions: int, length: Tensor, dtype
    ):
        dev = length.device
        self.sentences, self.length, self.in_use = sentences, length, None
        slots = -(-(1 + (positions - 1) * group) // ALIGN) * ALIGN
        p, j = torch.arange(positions, device=dev)[:, None], torch.arange(group, device=dev)
        self.table = ((p - 1) * group + 1 + j).clamp(min=0)  # (positions, g); BOS: slot 0
        self.visible = torch.full((sentences, slots), float("-inf"), dtype=dtype, device=dev)
        self.new: Tensor | None = None  # this step's slots (g,)
        self.mask: Tensor | None = None  # this step's (B', 1, g, slots)
        self.self_attn = [StaticSelfAttentionKV(self) for _ in range(n_layers)]
        self.cross_attn: list[dict[str, Tensor]] = [{} for _ in range(n_layers)]
        self._src_mask: Tensor | None = None

    @property
    def slots(self) -> int:
        return self.visible.size(1) if self.in_use is None else self.in_use

    def src_mask(self, padding: Tensor) -> Tensor:
        """The additive source key mask (B', 1, 1, S), built once, with aligned strides."""
        if self._src_mask is None:
            b, s = padding.shape
            room = -(-s // ALIGN) * ALIGN
            mask = self.visible.new_zeros(b, 1, 1, room)[..., :s]
            self._src_mask = mask.masked_fill_(padding[:, None, None, :], float("-inf"))
        return self._src_mask

    def layers(self, tgt_in: Tensor, memory: Tensor) -> list[tuple[StaticSelfAttentionKV, dict]]:
        """The new position's g slots (one per row of a sentence) enter their rows' past;
        this decode()'s mask is the rows' past."""
        if tgt_in.size(1) != 1:
            raise ValueError("a static cache decodes one position per decode()")
        g = tgt_in.size(0) // memory.size(0)
        self.new = self.table.index_select(0, self.length.view(1))[0, :g]  # (g,)
        rows = self.visible.view(self.sentences, g, -1)  # (B', g, slots)
        rows.scatter_(2, self.new.view(1, g, 1).expand(self.sentences, g, 1), 0.0)
        self.mask = rows.unsqueeze(1)[..., : self.slots]  # (B', 1, g, slots)
        return list(zip(self.self_attn, self.cross_attn, strict=True))

    def reorder(self, parents: Tensor, shrink: Shrink | None = None) -> None:
        """Each new row continues one of its sentence's rows: parents (B', g), its index
        among them. The rows' masks move, in place once there are g rows per sentence."""
        if shrink is not None:
            raise ValueError("a static cache keeps every sentence")
        slots = self.visible.size(1)
        rows = self.visible.view(parents.size(0), -1, slots)  # (B', g before, slots)
        moved = rows.gather(1, parents[..., None].expand(-1, -1, slots)).view(-1, slots)
        if moved.shape == self.visible.shape:
            self.visible.copy_(moved)
        else:  # after the first step: one row per sentence becomes g
            self.visible = moved


class StaticSelfAttentionKV(SelfAttentionKV):
    """One layer's self-attention keys and values (2, B', h, slots, d_k), keys first (as
    SelfAttentionKV), allocated by the first `extend()` for all the slots of its cache."""

    def extend(self, kv: Tensor) -> tuple[Tensor, Tensor]:
        """Store the new position's keys and values kv (2, B, h, 1, d_k) in its slots, in
        one copy; return those of all slots, 2 x (B', h, slots, d_k)."""
        c, (_, b, h, _, d_k) = self.cache, kv.shape
        if self.kv is None:
            self.kv = kv.new_zeros(2, c.sentences, h, c.visible.size(1), d_k)
        g = b // c.sentences
        new = kv.unflatten(1, (-1, g)).permute(0, 1, 3, 2, 4, 5).flatten(3, 4)  # (2, B', h, g, d_k)
        self.kv.index_copy_(3, c.new, new)
        return self.kv[0, :, :, : c.slots], self.kv[1, :, :, : c.slots]
