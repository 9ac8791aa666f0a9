"""Bit-row helpers shared by the bitmask and Bloom encoders. Rows are (n, W) uint64, bit b of a
row lives in word b // 64 at position b % 64."""

from __future__ import annotations

import numba
import numpy as np


def empty_rows(n: int, words: int) -> np.ndarray:
    return np.zeros((n, words), dtype=np.uint64)


def mask_row(words: int, lo: int, hi: int) -> np.ndarray:
    """(words,) uint64 with bits [lo, hi) set."""
    row = np.zeros(words, dtype=np.uint64)
    bits = np.arange(lo, hi)
    np.bitwise_or.at(row, bits >> 6, np.left_shift(np.uint64(1), (bits & 63).astype(np.uint64)))
    return row


@numba.njit(cache=True)
def set_bits(out, rows, bits):
    """out[rows[i]] |= bit bits[i], for every i. out: (n, W) uint64; rows, bits: (T,) int64."""
    for i in range(len(rows)):
        b = bits[i]
        out[rows[i], b >> 6] |= np.uint64(1) << np.uint64(b & 63)


def fill_rate(rows: np.ndarray, bits: int) -> np.ndarray:
    """(n,) float64 share of set bits in each row of `rows` (n, W) over its first `bits` bits."""
    return np.bitwise_count(rows).sum(axis=1, dtype=np.int64) / bits


def list_codes(s) -> tuple[np.ndarray, list[str], np.ndarray]:
    """Flatten a list<string> polars Series for hashing each distinct value once.

    Returns (lengths (n,) int64 with null = 0, distinct values, codes (T,) int64 into `distinct`
    for the values in row order).
    """
    import polars as pl

    lengths = s.list.len().fill_null(0).cast(pl.Int64).to_numpy()
    flat = s.explode().drop_nulls()
    distinct = flat.unique(maintain_order=True)
    codes = flat.replace_strict(distinct, pl.int_range(len(distinct), eager=True, dtype=pl.Int64),
                                return_dtype=pl.Int64).to_numpy().astype(np.int64, copy=False)
    return lengths, distinct.to_list(), codes
