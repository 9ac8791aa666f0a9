"""Row deduplication for matcher tables: an open-addressing hash table of distinct rows.

Rows are looked up by a 64-bit hash and compared word by word with the row already in the slot,
so equal rows always merge and different rows never do; no sort is needed. The table keeps rows
in order of first insertion, so a build is deterministic. Builders insert rows as they compute
them (`insert_row` from numba code), so no full-width array of duplicate rows is ever materialised.
"""

from __future__ import annotations

import numba
import numpy as np

_M1 = np.uint64(0x9E3779B97F4A7C15)
_M2 = np.uint64(0xBF58476D1CE4E5B9)


class RowTable:
    """Distinct uint64 rows of width W, with room for `capacity` of them (grown by `reserve`).

    rows:  (capacity, W) uint64; rows[:count] are the distinct rows in insertion order
    slots: (2^k,) int32 hash slots, -1 or a row number; load factor <= 1/2
    """

    def __init__(self, width: int, capacity: int) -> None:
        self._allocate(width, capacity)

    def _allocate(self, width: int, capacity: int) -> None:
        """Empty storage for `capacity` rows of `width` words."""
        capacity = max(int(capacity), 1)
        self.rows = np.empty((capacity, width), dtype=np.uint64)
        self.slots = np.full(1 << (2 * capacity).bit_length(), -1, dtype=np.int32)
        self.count = 0

    def reserve(self, extra: int) -> None:
        """Make room for `extra` more rows; row numbers already handed out stay valid."""
        if self.count + extra <= len(self.rows):
            return
        kept = self.rows[: self.count]
        self._allocate(self.rows.shape[1], self.count + extra)
        self.add(kept)  # distinct rows, re-inserted in order: each keeps its number

    def add(self, rows: np.ndarray) -> np.ndarray:
        """Insert rows (n, W) uint64; returns (n,) int32 their row numbers."""
        self.reserve(len(rows))
        index, self.count = _add_rows(np.ascontiguousarray(rows, dtype=np.uint64), self.rows, self.slots, self.count)
        return index

    def table(self) -> np.ndarray:
        """(count, W) uint64 the distinct rows (a contiguous view: the unused tail was never touched)."""
        return self.rows[: self.count]


@numba.njit(cache=True, nogil=True, inline="always")
def insert_row(src: np.ndarray, i: int, rows: np.ndarray, slots: np.ndarray, count: int) -> tuple[int, int]:
    """Row number of src[i] (src: (n, W) uint64) in the table (rows, slots, count), inserting it if new.

    Returns (row number, new count). The caller guarantees room for one more row.
    """
    h = np.uint64(0)
    w = src.shape[1]
    for j in range(w):  # splitmix-style fold of the row's words
        h = (h ^ src[i, j]) * _M1
        h ^= h >> np.uint64(31)
    h *= _M2
    h ^= h >> np.uint64(29)
    mask = np.uint64(len(slots) - 1)
    s = h & mask
    while True:
        rep = slots[s]
        if rep < 0:
            slots[s] = count
            for j in range(w):
                rows[count, j] = src[i, j]
            return count, count + 1
        same = True
        for j in range(w):
            if rows[rep, j] != src[i, j]:
                same = False
                break
        if same:
            return rep, count
        s = (s + np.uint64(1)) & mask


@numba.njit(cache=True, nogil=True)
def _add_rows(new: np.ndarray, rows: np.ndarray, slots: np.ndarray, count: int) -> tuple[np.ndarray, int]:
    index = np.empty(len(new), dtype=np.int32)
    for e in range(len(new)):
        index[e], count = insert_row(new, e, rows, slots, count)
    return index, count
