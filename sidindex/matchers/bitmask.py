"""Bitmask rows for low-cardinality attributes (docs/design.md §4, GRACE eq. 5).

Per bitmask attribute, in spec order, a segment of (declared values + 1 "unknown") bits; segments
are concatenated and packed into W uint64 words. An ad sets the bits of its values, or the whole
segment when unrestricted; a request sets exactly one bit per segment (its value, or "unknown"
for a null or undeclared value). An ad passes iff (ad_row & user_row) == user_row: as a matcher
plane (`sidindex.matchers.plane`), one word group whose only query is the user row. A batch of
requests is encoded by `sidindex.request_encoding.encode_requests` (each value looked up in `lookup`).
"""

from __future__ import annotations

import reprlib
from dataclasses import dataclass
from functools import cached_property
from typing import TYPE_CHECKING

import numpy as np

from sidindex.errors import InputError
from sidindex.matchers.attribute import Attribute, MatcherKind
from sidindex.matchers.bits import (
    ListCodes,
    empty_rows,
    list_codes,
    mask_row,
    or_value_bits,
)
from sidindex.matchers.plane import PlaneQueries

if TYPE_CHECKING:
    import polars as pl


@dataclass(frozen=True)
class BitmaskLayout:
    """Segment layout. offsets: (A+1,) bit offset of each bitmask attribute's segment; the last
    bit of segment a (offsets[a+1] - 1) is its "unknown" bit."""

    names: tuple[str, ...]
    values: tuple[tuple[str, ...], ...]
    offsets: tuple[int, ...]

    @property
    def bits(self) -> int:
        return self.offsets[-1]

    @property
    def words(self) -> int:
        return max(1, -(-self.bits // 64))

    @cached_property
    def lookup(self) -> tuple[tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray], ...]:
        """Per attribute, its declared values as a table a request's value is looked up in
        without a Python loop (`sidindex.requests`): (hashes (V,) uint32 sorted, codes (V,) int64
        each hash's value index, offsets (V+1,) int64 and data (bytes,) uint8 the values' UTF-8
        bytes in hash order); murmur3_32 with seed 0 of the bytes, the bytes compared on a hit."""
        from sidindex.matchers.murmur import murmur3_32

        out = []
        for values in self.values:
            raw = [v.encode("utf-8") for v in values]
            data = np.frombuffer(b"".join(raw), dtype=np.uint8)
            offsets = np.concatenate([[0], np.cumsum([len(r) for r in raw])]).astype(np.int64)
            hashes = np.array([murmur3_32(data, offsets[i], offsets[i + 1], 0) for i in range(len(raw))],
                              dtype=np.uint32)
            order = np.argsort(hashes, kind="stable")
            raw = [raw[i] for i in order]
            sorted_offsets = np.concatenate([[0], np.cumsum([len(r) for r in raw])]).astype(np.int64)
            table = (hashes[order], order.astype(np.int64), sorted_offsets,
                     np.frombuffer(b"".join(raw), dtype=np.uint8))
            for a in table:  # read-only, as every array the lookup's kernel reads (one compiled type)
                a.flags.writeable = False
            out.append(table)
        return tuple(out)

    def segment_mask(self, a: int) -> np.ndarray:
        return mask_row(self.words, self.offsets[a], self.offsets[a + 1])


def parse_attribute(t: dict, at: str, name: str) -> Attribute:
    """The bitmask attribute `name` the spec's table `t` declares (`at` names it in errors)."""
    if "bits" in t or "hashes" in t:
        raise InputError(f"{at}: 'bits' and 'hashes' apply to bloom attributes only")
    values = t.get("values")
    if not isinstance(values, list) or not values:
        raise InputError(f"{at}: a bitmask attribute needs a non-empty 'values' list")
    seen: set[str] = set()
    for v in values:
        if not isinstance(v, str) or not v:
            raise InputError(f"{at}: every value must be a non-empty string, got {reprlib.repr(v)}")
        if v in seen:
            raise InputError(f"{at}: value {v!r} is declared twice")
        seen.add(v)
    return Attribute(name, KIND, values=tuple(values))


def settings(a: Attribute) -> dict:
    """`parse_attribute`'s inverse: the keys of a bitmask attribute."""
    return {"values": list(a.values)}


def bitmask_layout(attrs: tuple[Attribute, ...]) -> BitmaskLayout:
    """The layout of the spec's bitmask attributes `attrs`, in spec order."""
    offsets = np.concatenate([[0], np.cumsum([len(a.values) + 1 for a in attrs])]).astype(int)
    return BitmaskLayout(tuple(a.name for a in attrs), tuple(a.values for a in attrs), tuple(int(o) for o in offsets))


def encode_ad_rows(layout: BitmaskLayout, columns: pl.DataFrame,
                   codes: dict[str, ListCodes] | None = None) -> np.ndarray:
    """(N, W) uint64 ad rows from validated list<string> columns (one per bitmask attribute).

    codes: the columns already flattened against their declared values (`list_codes`)
    """
    n = columns.height
    out = empty_rows(n, layout.words)
    for a, (name, values) in enumerate(zip(layout.names, layout.values)):
        lc = codes[name] if codes else list_codes(columns.get_column(name), categories=values)
        out[lc.lengths == 0] |= layout.segment_mask(a)
        bit = (layout.offsets[a] + np.arange(len(values), dtype=np.int64)).reshape(-1, 1)
        or_value_bits(out, lc.lengths, lc.codes, bit, 0)
    return out


def attribute_passes(layout: BitmaskLayout, row: np.ndarray, queries: PlaneQueries, request: int) -> np.ndarray:
    """(A,) bool: does matcher `row` (W,) uint64 pass request `request` on each bitmask attribute.

    The whole-row test (row & user) == user is the AND of these; explanations need each one.
    """
    user = queries.rows[queries.ranges[request, 0, 0]]
    hit = row & user
    return np.array([np.array_equal(hit & layout.segment_mask(a), user & layout.segment_mask(a))
                     for a in range(len(layout.names))], dtype=bool)


# a request's value is one of the declared values (or unknown): one value per attribute
KIND = MatcherKind("bitmask", one_request_value=True, parse=parse_attribute, settings=settings, layout=bitmask_layout,
                   encode_ads=encode_ad_rows, attribute_passes=attribute_passes)
