"""k-way partitioned matchers: a jagged layer over the union entries (DESIGN.md §6).

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

import numba
import numpy as np

from sidindex.config import KWayConfig

__all__ = ["KWayConfig", "partition"]


def partition(items_bm: np.ndarray, items_bl: np.ndarray, lo: np.ndarray, hi: np.ndarray, k: np.ndarray,
              dynamic: bool, target_fill: float, bits: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Partition each entry's members.

    items_bm: (I, W_bm), items_bl: (I, W_bl) uint64 member rows; entry j owns members [lo[j], hi[j])
    k: (J,) int64 partitions allowed per entry; bits: matcher bits per member (bitmask + Bloom)
    Returns (counts (J,) int64, part_bm (T, W_bm), part_bl (T, W_bl)) with entry j's partitions at
    [offsets[j], offsets[j] + counts[j]), offsets = exclusive cumsum of counts.
    """
    cap = np.minimum(k, hi - lo)
    start = np.zeros(len(cap) + 1, dtype=np.int64)
    np.cumsum(cap, out=start[1:])
    part_bm = np.zeros((start[-1], items_bm.shape[1]), dtype=np.uint64)
    part_bl = np.zeros((start[-1], items_bl.shape[1]), dtype=np.uint64)
    counts = _greedy(items_bm, items_bl, lo, hi, cap, start, dynamic, target_fill, bits, part_bm, part_bl)
    keep = np.repeat(start[:-1], counts) + (np.arange(counts.sum()) - np.repeat(np.cumsum(counts) - counts, counts))
    return counts, part_bm[keep], part_bl[keep]


@numba.njit(inline="always")
def _popcount(x):
    x = x - ((x >> np.uint64(1)) & np.uint64(0x5555555555555555))
    x = (x & np.uint64(0x3333333333333333)) + ((x >> np.uint64(2)) & np.uint64(0x3333333333333333))
    x = (x + (x >> np.uint64(4))) & np.uint64(0x0F0F0F0F0F0F0F0F)
    return (x * np.uint64(0x0101010101010101)) >> np.uint64(56)


@numba.njit(parallel=True, cache=True)
def _greedy(items_bm, items_bl, lo, hi, cap, start, dynamic, target_fill, bits, part_bm, part_bl):
    counts = np.zeros(len(lo), dtype=np.int64)
    wbm, wbl = items_bm.shape[1], items_bl.shape[1]
    for j in numba.prange(len(lo)):
        base = start[j]
        used = 0
        fill = np.zeros(max(cap[j], 1), dtype=np.int64)  # set bits of each partition
        for i in range(lo[j], hi[j]):
            best, best_growth = -1, np.int64(1) << 62
            for p in range(used):
                g = np.int64(0)
                for w in range(wbm):
                    g += _popcount(items_bm[i, w] & ~part_bm[base + p, w])
                for w in range(wbl):
                    g += _popcount(items_bl[i, w] & ~part_bl[base + p, w])
                if g < best_growth:
                    best, best_growth = p, g
            if best < 0:
                open_new = True
            elif dynamic:
                open_new = used < cap[j] and (fill[best] + best_growth) > target_fill * bits
            else:
                open_new = used < cap[j] and best_growth > 0
            if open_new:
                best, best_growth = used, np.int64(0)
                for w in range(wbm):
                    best_growth += _popcount(items_bm[i, w])
                for w in range(wbl):
                    best_growth += _popcount(items_bl[i, w])
                used += 1
            for w in range(wbm):
                part_bm[base + best, w] |= items_bm[i, w]
            for w in range(wbl):
                part_bl[base + best, w] |= items_bl[i, w]
            fill[best] += best_growth
        counts[j] = used
    return counts
