"""Bloom rows for high-cardinality attributes (docs/design.md §4).

A value sets `hashes` bit positions: mmh3_x86_32(UTF-8 value, seed=BLOOM_SEED + i, unsigned) % bits
for i in 0..hashes-1. An ad row is the OR of its values' rows, all ones when unrestricted. Every
bloom attribute gets bits/64 words; the attributes' words are concatenated in spec order into one
row of W_bl words. A request has one query row per value (an all-ones row when it has none); an
ad passes an attribute iff ANY query q of it has (row & q) == q on that attribute's words: as a
matcher plane (`sidindex.matchers.plane`), one word group per attribute. A batch of requests is
encoded by `sidindex.request_encoding.encode_requests`, in one numba pass over each column's bytes.
"""

from __future__ import annotations

import reprlib
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from sidindex.errors import InputError
from sidindex.matchers.attribute import Attribute, MatcherKind
from sidindex.matchers.bits import ListCodes, empty_rows, list_codes, or_value_bits
from sidindex.matchers.plane import PlaneQueries, group_passes

if TYPE_CHECKING:
    import polars as pl

BLOOM_SEED = 0xB1005EED
DEFAULT_BLOOM_BITS = 256
DEFAULT_BLOOM_HASHES = 2
MAX_BLOOM_HASHES = 16


@dataclass(frozen=True)
class BloomLayout:
    """attribute_bits, hashes: per attribute; word_offsets: (A+1,) first word of each bloom
    attribute in the concatenated row."""

    names: tuple[str, ...]
    attribute_bits: tuple[int, ...]
    hashes: tuple[int, ...]
    word_offsets: tuple[int, ...]

    @property
    def words(self) -> int:
        return max(1, self.word_offsets[-1])

    @property
    def bits(self) -> int:
        return sum(self.attribute_bits)


def parse_attribute(t: dict, at: str, name: str) -> Attribute:
    """The bloom attribute `name` the spec's table `t` declares (`at` names it in errors)."""
    if "values" in t:
        raise InputError(f"{at}: bloom attributes take free strings; 'values' applies to bitmask only")
    bits = t.get("bits", DEFAULT_BLOOM_BITS)
    hashes = t.get("hashes", DEFAULT_BLOOM_HASHES)
    if isinstance(bits, bool) or not isinstance(bits, int) or bits <= 0 or bits % 64:
        raise InputError(f"{at}: 'bits' must be a positive multiple of 64, got {reprlib.repr(bits)}")
    if isinstance(hashes, bool) or not isinstance(hashes, int) or not 1 <= hashes <= MAX_BLOOM_HASHES:
        raise InputError(f"{at}: 'hashes' must be an integer in 1..{MAX_BLOOM_HASHES}, got {reprlib.repr(hashes)}")
    return Attribute(name, KIND, bits=bits, hashes=hashes)


def settings(a: Attribute) -> dict:
    """`parse_attribute`'s inverse: the keys of a bloom attribute."""
    return {"bits": a.bits, "hashes": a.hashes}


def bloom_layout(attrs: tuple[Attribute, ...]) -> BloomLayout:
    """The layout of the spec's bloom attributes `attrs`, in spec order."""
    offs = np.concatenate([[0], np.cumsum([a.bits // 64 for a in attrs])]).astype(int)
    return BloomLayout(tuple(a.name for a in attrs), tuple(a.bits for a in attrs),
                       tuple(a.hashes for a in attrs), tuple(int(o) for o in offs))


def value_positions(values: list[str], bits: int, hashes: int) -> np.ndarray:
    """(V, hashes) int64 bit positions of each value within its attribute's `bits`."""
    import mmh3  # building: a reader of an index hashes nothing

    out = np.empty((len(values), hashes), dtype=np.int64)
    for i in range(hashes):
        out[:, i] = [mmh3.hash(v, BLOOM_SEED + i, signed=False) % bits for v in values]
    return out


def encode_ad_rows(layout: BloomLayout, columns: pl.DataFrame, codes: dict[str, ListCodes] | None = None) -> np.ndarray:
    """(N, W_bl) uint64 ad rows from validated list<string> columns (one per bloom attribute).

    codes: the columns already flattened (`list_codes`), to share that work with the exact index
    """
    n = columns.height
    out = empty_rows(n, layout.words)
    for a, name in enumerate(layout.names):
        lo, hi = layout.word_offsets[a], layout.word_offsets[a + 1]
        lc = codes[name] if codes else list_codes(columns.get_column(name))
        out[lc.lengths == 0, lo:hi] = np.uint64(0xFFFFFFFFFFFFFFFF)
        positions = value_positions(lc.distinct, layout.attribute_bits[a], layout.hashes[a])
        or_value_bits(out, lc.lengths, lc.codes, positions, lo)
    return out


def attribute_passes(layout: BloomLayout, row: np.ndarray, queries: PlaneQueries, request: int) -> np.ndarray:
    """(A,) bool: does matcher `row` (W_bl,) uint64 pass each bloom attribute (a word group) for
    request `request`."""
    return group_passes(row, queries, request)


# free strings: a request brings a list of values, any of which may match
KIND = MatcherKind("bloom", one_request_value=False, parse=parse_attribute, settings=settings, layout=bloom_layout,
                   encode_ads=encode_ad_rows, attribute_passes=attribute_passes)
