"""Row deduplication for matcher tables: one pass through an open-addressing hash table.

Rows are looked up by a 64-bit hash and compared word by word with the row already in the slot,
so equal rows always merge and different rows never do; no sort is needed. The table keeps rows
in order of first occurrence, so a build is deterministic.
"""

from __future__ import annotations

import numba
import numpy as np

_M1 = np.uint64(0x9E3779B97F4A7C15)
_M2 = np.uint64(0xBF58476D1CE4E5B9)


def dedup_rows(rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Deduplicate rows (E, W) uint64.

    Returns (table (R, W) uint64 of distinct rows in first-occurrence order, index (E,) int32)
    with table[index] == rows.
    """
    rows = np.ascontiguousarray(rows)
    capacity = 1 << max(1, int(2 * len(rows)).bit_length())  # load factor <= 1/2
    first, index = _dedup(rows, capacity)
    return rows[first], index


@numba.njit(cache=True)
def _dedup(rows, capacity):
    n, w = rows.shape
    mask = np.uint64(capacity - 1)
    slot_row = np.full(capacity, -1, dtype=np.int64)  # a representative row per occupied slot
    index = np.empty(n, dtype=np.int32)
    first = np.empty(n, dtype=np.int64)
    distinct = 0
    for e in range(n):
        h = np.uint64(0)
        for j in range(w):  # splitmix-style fold of the row's words
            h = (h ^ rows[e, j]) * _M1
            h ^= h >> np.uint64(31)
        h *= _M2
        h ^= h >> np.uint64(29)
        s = h & mask
        while True:
            rep = slot_row[s]
            if rep < 0:
                slot_row[s] = e
                index[e] = distinct
                first[distinct] = e
                distinct += 1
                break
            same = True
            for j in range(w):
                if rows[rep, j] != rows[e, j]:
                    same = False
                    break
            if same:
                index[e] = index[rep]
                break
            s = (s + np.uint64(1)) & mask
    return first[:distinct], index
