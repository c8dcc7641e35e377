"""Shape classes: at most K static padded batch shapes (B, S, T), chosen from the corpus'
lengths so that an epoch pads the fewest tokens (train.shape_classes; the sampler cuts its
batches to them, sampler.py).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import numpy as np

# Shape classes are bands of key = max(slope * src_len, DEN * tgt_len): a slope of DEN bands
# the longer side; another follows the corpus' target/source ratio (a band then holds
# sources up to about edge / slope and targets up to edge / DEN). The slopes tried: ratios
# 2^(i/16), 0.68 to 1.48 (clean.max_ratio's 1.5 and its inverse), 1 first: ties keep it.
DEN = 64
SLOPES = sorted({round(DEN * 2 ** (i / 16)) for i in range(-9, 10)}, key=lambda s: abs(s - DEN))


class ShapeClasses(NamedTuple):
    """Class c holds the examples whose key max(slope * src_len, DEN * tgt_len) lies in
    (edges[c - 1], edges[c]], every batch padded to shapes[c] = (B, S, T)."""

    slope: int
    edges: np.ndarray
    shapes: list[tuple[int, int, int]]

    def classify(self, src_lens: np.ndarray, tgt_lens: np.ndarray) -> np.ndarray:
        key = np.maximum(np.asarray(src_lens) * self.slope, np.asarray(tgt_lens) * DEN)
        return np.searchsorted(self.edges, key)


def fit_shape_classes(
    src_lens: np.ndarray,
    tgt_lens: np.ndarray,
    max_tokens: int,
    k: int,
    slopes: Sequence[int] | None = None,
) -> ShapeClasses:
    """At most `k` shape classes for these lengths, padding the fewest tokens an epoch.

    A class pads its batches to S and T, its longest source and longest target, apart, with
    B = max_tokens // max(S, T) rows; the class's last batch is filled with padding rows. For
    each slope, dynamic programming over the distinct keys (a few hundred) finds the bands
    that minimise the tokens an epoch pads to, both sides and padding rows counted (a band
    of N examples: ceil(N / B) * B * (S + T)); the slope that pads least wins. On WMT-like
    lengths this matches what a local search over any 16 (S, T) corners finds; banding the
    longer side alone (slope DEN) pads both sides to one length once the corpus is large,
    which wastes more where targets run longer than sources (tests/test_shape_classes.py).
    `slopes`: those to try, SLOPES if None.
    """
    src, tgt = np.asarray(src_lens, np.int64), np.asarray(tgt_lens, np.int64)
    if k < 1 or len(src) == 0 or min(src.min(), tgt.min()) < 1:
        raise ValueError("shape classes need k >= 1 and lengths >= 1")
    if max(src.max(), tgt.max()) > max_tokens:
        raise ValueError(f"shape classes: an example is longer than max_tokens={max_tokens}")
    # The length histogram: distinct (source, target) pairs and how many of each.
    codes, counts = np.unique(src * (tgt.max() + 1) + tgt, return_counts=True)
    pair_src, pair_tgt = codes // (tgt.max() + 1), codes % (tgt.max() + 1)
    best = None
    for slope in SLOPES if slopes is None else slopes:
        key = np.maximum(pair_src * slope, pair_tgt * DEN)
        cost, edges, shapes = _bands(key, pair_src, pair_tgt, counts, max_tokens, k)
        if best is None or cost < best[0]:
            best = cost, ShapeClasses(slope, edges, shapes)
    return best[1]


def _bands(key, src, tgt, counts, max_tokens: int, k: int):
    """(padded tokens, edges, shapes) of the best at most k bands of `key` (exact DP)."""
    values, inverse = np.unique(key, return_inverse=True)
    n = len(values)
    rows = np.bincount(inverse, weights=counts, minlength=n).astype(np.int64)
    max_src, max_tgt = np.zeros(n, np.int64), np.zeros(n, np.int64)
    np.maximum.at(max_src, inverse, src)
    np.maximum.at(max_tgt, inverse, tgt)
    cum = np.concatenate([[0], np.cumsum(rows)])
    cost = np.full((n, n), np.int64(2**62))  # cost[i, j]: band values[i..j]; i > j: none
    for i in range(n):
        s, t = np.maximum.accumulate(max_src[i:]), np.maximum.accumulate(max_tgt[i:])
        b = max_tokens // np.maximum(s, t)
        cost[i, i:] = (s + t) * b * -(-(cum[i + 1 :] - cum[i]) // b)
    # least[j]: the least cost of values[0..j] in at most m bands; starts[m - 1][j]: where
    # the last of those bands starts (0: it is the only one).
    least, starts = cost[0].copy(), [np.zeros(n, np.int64)]
    for _ in range(1, min(k, n)):
        cand = np.concatenate([cost[:1], least[:-1, None] + cost[1:]])  # row i: last band at i
        start = cand.argmin(axis=0)
        least, starts = cand[start, np.arange(n)], [*starts, start]
    bands, j = [], n - 1
    for start in reversed(starts):
        i = int(start[j])
        bands.insert(0, (i, j))
        if i == 0:
            break
        j = i - 1
    shapes = []
    for i, j in bands:
        s, t = int(max_src[i : j + 1].max()), int(max_tgt[i : j + 1].max())
        shapes.append((max_tokens // max(s, t), s, t))
    return int(least[-1]), values[[j for _, j in bands]], shapes
