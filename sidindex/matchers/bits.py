"""Bit-row helpers shared by the bitmask and Bloom encoders. Rows are (n, W) uint64, bit b of a
row lives in word b // 64 at position b % 64."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numba
import numpy as np

if TYPE_CHECKING:
    import polars as pl


def empty_rows(n: int, words: int) -> np.ndarray:
    return np.zeros((n, words), dtype=np.uint64)


def mask_row(words: int, lo: int, hi: int) -> np.ndarray:
    """(words,) uint64 with bits [lo, hi) set."""
    row = np.zeros(words, dtype=np.uint64)
    bits = np.arange(lo, hi)
    np.bitwise_or.at(row, bits >> 6, np.left_shift(np.uint64(1), (bits & 63).astype(np.uint64)))
    return row


@numba.njit(cache=True)
def or_value_bits(out: np.ndarray, lengths: np.ndarray, codes: np.ndarray, value_bits: np.ndarray,
                  word_offset: int) -> None:
    """Row r ORs in the bits of its values: out[r] |= value_bits[codes[k]] for its run of codes.

    out: (n, W) uint64; lengths: (n,) int64 values per row; codes: (T,) integer, in row order;
    value_bits: (V, h) int64 bit positions of each distinct value (relative to word_offset * 64).
    Avoids materialising a (T * h,) row-index array.
    """
    k = 0
    base = word_offset * 64
    for r in range(len(lengths)):
        for _ in range(lengths[r]):
            for b in value_bits[codes[k]]:
                bit = base + b
                out[r, bit >> 6] |= np.uint64(1) << np.uint64(bit & 63)
            k += 1


def fill_rate(rows: np.ndarray, bits: int) -> np.ndarray:
    """(n,) float64 share of set bits in each row of `rows` (n, W) over its first `bits` bits."""
    return np.bitwise_count(rows).sum(axis=1, dtype=np.int64) / bits


@dataclass(frozen=True)
class ListCodes:
    """A list<string> column flattened for hashing each distinct value once.

    lengths: (n,) int64 values per row (null = 0); distinct: the distinct values;
    codes: (T,) int32 index into `distinct` of every value, in row order.
    """

    lengths: np.ndarray
    distinct: list[str]
    codes: np.ndarray


def list_codes(s: pl.Series, categories: tuple[str, ...] | None = None) -> ListCodes:
    """Flatten a list<string> polars Series (see `ListCodes`) with Arrow compute kernels.

    categories: the values the column may hold (a bitmask attribute's declared values, already
    validated); `distinct` is then `categories` and codes index into it.
    """
    import polars as pl
    import pyarrow as pa
    import pyarrow.compute as pc

    try:  # polars' string views as they are: converting to Arrow strings copies every string
        lengths, encoded = _encode(s.to_arrow(compat_level=pl.CompatLevel.newest()))
    except pa.ArrowNotImplementedError:  # a pyarrow without string-view kernels
        lengths, encoded = _encode(s.to_arrow())
    values = encoded.dictionary.cast(pa.string())  # the distinct values: few
    indices = encoded.indices.to_numpy(zero_copy_only=False)
    if categories is None:
        return ListCodes(lengths, values.to_pylist(), np.asarray(indices, dtype=np.int32))
    found = pc.index_in(values, value_set=pa.array(list(categories), type=pa.string()))
    if found.null_count:  # ingestion rejects these; never turn them into garbage bits
        raise ValueError(f"column {s.name!r} holds values outside its declared values")
    codes = found.to_numpy(zero_copy_only=False).astype(np.int32)[indices]
    return ListCodes(lengths, list(categories), codes)


def _encode(arr: Any) -> tuple[np.ndarray, Any]:
    """(lengths (n,) int64, dictionary-encoded flat values) of a list<string> Arrow array."""
    import pyarrow as pa
    import pyarrow.compute as pc

    if isinstance(arr, pa.ChunkedArray):
        arr = arr.combine_chunks()
    lengths = pc.fill_null(pc.list_value_length(arr), 0).to_numpy().astype(np.int64)
    return lengths, pc.dictionary_encode(pc.list_flatten(arr))  # flatten skips null lists
