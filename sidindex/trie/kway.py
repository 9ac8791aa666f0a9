"""k-way partitioned matchers: a jagged layer over the union entries (docs/design.md §6).

A subtree union saturates when the subtree holds many ads with different targeting; splitting the
subtree's members into k groups and keeping one union per group lets a request reject the entry
when no group matches it. Members are the leaf SIDs of the entry's subtree, or, for an entry that
is itself a leaf, the ads under that SID. A candidate passes iff ANY partition passes ALL
attributes; every member lies in one partition, so this never rejects what an exact check passes,
and each partition is a subset of the union, so it never passes what the union rejects.

Greedy, members in SID order. "Fill" is the share of set bits over all matcher bits.
  static   k per position: a member that adds any new bit opens a new partition while fewer than k
           exist; otherwise it joins the partition whose fill grows least.
  dynamic  per entry up to k_max: a member opens a new partition only when joining the best one
           would push that partition's fill above target_fill.
"""

from __future__ import annotations

import threading

import numba
import numpy as np

from sidindex.config import KWayConfig

__all__ = ["KWayConfig", "partition"]

_ONE_AT_A_TIME = threading.Lock()


def partition(items: np.ndarray, lo: np.ndarray, hi: np.ndarray, k: np.ndarray, dynamic: bool,
              target_fill: float, bits: int, item_value: np.ndarray | None = None
              ) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    """Partition each entry's members.

    items: (I, W) uint64 member rows (every matcher plane's words side by side); entry j owns
    members [lo[j], hi[j]); k: (J,) int64 partitions allowed per entry; bits: matcher bits per member;
    item_value: (I,) float64 each member's value, or None
    Returns (counts (J,) int64, parts (T, W) uint64, values (T,) float64 or None) with entry j's
    partitions at [offsets[j], offsets[j] + counts[j]), offsets = exclusive cumsum of counts. With
    values, each partition's is its largest member's, and an entry's partitions are ordered by it,
    largest first (stable).
    """
    cap = np.minimum(k, hi - lo)
    start = np.zeros(len(cap) + 1, dtype=np.int64)
    np.cumsum(cap, out=start[1:])
    parts = np.zeros((start[-1], items.shape[1]), dtype=np.uint64)
    value = np.zeros(start[-1] if item_value is not None else 0, dtype=np.float64)
    with _ONE_AT_A_TIME:  # parallel inside; a partitioned build calls it from several threads
        counts = _greedy(items, lo, hi, cap, start, dynamic, target_fill, bits, parts,
                         item_value if item_value is not None else value, value)
    keep = np.repeat(start[:-1], counts) + (np.arange(counts.sum()) - np.repeat(np.cumsum(counts) - counts, counts))
    if item_value is None:
        return counts, parts[keep], None
    value = value[keep]
    order = np.lexsort((-value, np.repeat(np.arange(len(counts)), counts)))  # by entry, then value falling
    return counts, parts[keep[order]], value[order]


@numba.njit(inline="always")
def _popcount(x: np.uint64) -> np.uint64:
    x = x - ((x >> np.uint64(1)) & np.uint64(0x5555555555555555))
    x = (x & np.uint64(0x3333333333333333)) + ((x >> np.uint64(2)) & np.uint64(0x3333333333333333))
    x = (x + (x >> np.uint64(4))) & np.uint64(0x0F0F0F0F0F0F0F0F)
    return (x * np.uint64(0x0101010101010101)) >> np.uint64(56)


@numba.njit(parallel=True, cache=True)
def _greedy(items: np.ndarray, lo: np.ndarray, hi: np.ndarray, cap: np.ndarray, start: np.ndarray, dynamic: bool,
            target_fill: float, bits: int, parts: np.ndarray, item_value: np.ndarray, value: np.ndarray) -> np.ndarray:
    """Fills parts (and, when value is not empty, each partition's largest item_value); returns the
    partitions each entry used."""
    counts = np.zeros(len(lo), dtype=np.int64)
    W = items.shape[1]
    for j in numba.prange(len(lo)):
        base = start[j]
        used = 0
        fill = np.zeros(max(cap[j], 1), dtype=np.int64)  # set bits of each partition
        for i in range(lo[j], hi[j]):
            best, best_growth = -1, np.int64(1) << 62
            for p in range(used):
                g = np.int64(0)
                for w in range(W):
                    g += _popcount(items[i, w] & ~parts[base + p, w])
                if g < best_growth:
                    best, best_growth = p, g
            open_new: bool | np.bool_
            if best < 0:
                open_new = True
            elif dynamic:
                open_new = used < cap[j] and (fill[best] + best_growth) > target_fill * bits
            else:
                open_new = used < cap[j] and best_growth > 0
            if open_new:
                best, best_growth = used, np.int64(0)
                for w in range(W):
                    best_growth += _popcount(items[i, w])
                used += 1
            for w in range(W):
                parts[base + best, w] |= items[i, w]
            fill[best] += best_growth
            if len(value) and item_value[i] > value[base + best]:
                value[base + best] = item_value[i]
        counts[j] = used
    return counts
