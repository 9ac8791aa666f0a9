"""Histograms of counts: h[k] items count k. Shards and fragments return these instead of one
count per item, so that whoever merges their figures (a Ray build's driver) holds O(largest
count), not O(items); the figures read from a histogram are exactly numpy's over the counts.

Legend: M the largest count + 1.
"""

from __future__ import annotations

import math

import numpy as np


def histogram(counts: np.ndarray) -> np.ndarray:
    """(M,) int64 histogram of counts (n,) >= 0."""
    return np.bincount(np.asarray(counts, dtype=np.int64), minlength=1).astype(np.int64)


def merged(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """The histogram of both histograms' items."""
    out = np.zeros(max(len(a), len(b)), dtype=np.int64)
    out[:len(a)] += a
    out[:len(b)] += b
    return out


def without_zero(h: np.ndarray) -> np.ndarray:
    """h without the items that count 0."""
    return np.concatenate([[0], h[1:]]).astype(np.int64)


def items(h: np.ndarray) -> int:
    return int(h.sum())


def largest(h: np.ndarray) -> int:
    """The largest count held (0 for no items)."""
    held = np.flatnonzero(h)
    return int(held[-1]) if len(held) else 0


def total(h: np.ndarray, least: int = 0) -> int:
    """The sum of the counts that are at least `least`."""
    return int(np.dot(np.arange(least, max(len(h), least), dtype=np.int64), h[least:]))


def mean(h: np.ndarray) -> float:
    """`np.mean` of the counts (exact while their sum stays below 2**53, as numpy's is)."""
    return float(total(h)) / items(h)


def percentile(h: np.ndarray, q: float) -> float:
    """`np.percentile(counts, q)` (its default, linear method) of the counts h holds; needs items."""
    n = items(h)
    virtual = (n - 1) * (np.float64(q) / 100)
    lo = min(max(math.floor(virtual), 0), n - 1)
    a, b = _sorted_at(h, lo), _sorted_at(h, min(lo + 1, n - 1))
    t = float(virtual - lo)
    # numpy's lerp: from the nearer end, so that t = 1 gives b exactly
    return float(b - (b - a) * (1 - t)) if t >= 0.5 else float(a + (b - a) * t)


def _sorted_at(h: np.ndarray, i: int) -> int:
    """The count at position i of the counts sorted."""
    return int(np.searchsorted(np.cumsum(h), i, side="right"))
