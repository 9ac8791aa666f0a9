"""Row deduplication for matcher tables."""

from __future__ import annotations

import numpy as np

_M1 = np.uint64(0x9E3779B97F4A7C15)
_M2 = np.uint64(0xBF58476D1CE4E5B9)


def _row_hash(rows: np.ndarray) -> np.ndarray:
    """(E,) uint64 hash of each row of rows (E, W) uint64 (splitmix-style fold; wraps by design)."""
    h = np.zeros(len(rows), dtype=np.uint64)
    with np.errstate(over="ignore"):
        for w in range(rows.shape[1]):
            h = (h ^ rows[:, w]) * _M1
            h ^= h >> np.uint64(31)
        h *= _M2
        h ^= h >> np.uint64(29)
    return h


def dedup_rows(rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Deduplicate rows (E, W) uint64.

    Returns (table (R, W) uint64 with unique rows, index (E,) int32) with table[index] == rows.
    Rows are grouped by a 64-bit hash, then every row is checked against its group's
    representative; on a hash collision (never seen in practice) an exact sort-based unique is used.
    """
    if len(rows) == 0:
        return rows.reshape(0, rows.shape[1]).copy(), np.zeros(0, dtype=np.int32)
    _, first, index = np.unique(_row_hash(rows), return_index=True, return_inverse=True)
    table = rows[first]
    if not np.array_equal(table[index], rows):
        view = np.ascontiguousarray(rows).view(np.dtype((np.void, rows.dtype.itemsize * rows.shape[1])))
        _, first, index = np.unique(view.ravel(), return_index=True, return_inverse=True)
        table = rows[first]
    return table, index.astype(np.int32)
