"""The exact per-ad targeting index and the ad-level filter (DESIGN.md §3, §4).

Bloom rows may pass an ad whose locations do not match (false positives); the exact filter stops
them at the ad level. Per ad: its bitmask row (bitmask attributes are exact), and per bloom
attribute the sorted 64-bit hashes of its values: mmh3 x64_128 (seed EXACT_SEED), first 64 bits,
unsigned (exact up to 64-bit hash collisions). A request batch brings its bitmask queries and its
`ExactQueries` in `sidindex.requests.EncodedRequests` (host arrays). Stage flags have one bit per
matcher plane, in plane order. Legend: N ads, B requests, A bloom attributes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import mmh3
import numba
import numpy as np
import polars as pl

from sidindex.matchers.bits import ListCodes, list_codes
from sidindex.matchers.bitmask import BitmaskLayout, attribute_passes, encode_ad_rows
from sidindex.matchers.plane import row_passes
from sidindex.targeting import TargetingSpec

if TYPE_CHECKING:
    from sidindex.requests import EncodedRequests

EXACT_SEED = 0x5EED0E1
STAGE_BITMASK, STAGE_BLOOM = 1, 2  # bits of `stage_flags`: 1 << plane
ALL_STAGES = STAGE_BITMASK | STAGE_BLOOM


def value_hashes(values: list[str]) -> np.ndarray:
    """(V,) uint64 exact hashes of values."""
    return np.array([mmh3.hash64(v, EXACT_SEED, signed=False)[0] for v in values], dtype=np.uint64).reshape(-1)


def _hash_lists(lc: ListCodes) -> tuple[np.ndarray, np.ndarray]:
    """(offsets (n+1,) int64, hashes (T,) uint64 sorted within each row) of a flattened column;
    each distinct value is hashed once."""
    hashes = value_hashes(lc.distinct)[lc.codes]
    offsets = np.zeros(len(lc.lengths) + 1, dtype=np.int64)
    np.cumsum(lc.lengths, out=offsets[1:])
    _sort_segments(hashes, offsets)
    return offsets, hashes


@numba.njit(cache=True)
def _sort_segments(values, offsets):
    """Sort values[offsets[i]:offsets[i+1]] in place for every i (each ad's list is short)."""
    for i in range(len(offsets) - 1):
        values[offsets[i]:offsets[i + 1]] = np.sort(values[offsets[i]:offsets[i + 1]])


def hash_lists(columns: pl.DataFrame, names: tuple[str, ...], codes: dict[str, ListCodes] | None = None,
               ) -> tuple[np.ndarray, np.ndarray]:
    """The exact hashes of list<string> columns `names` (ads' or requests'): offsets (A, n+1) int64
    into one concatenated hashes (T,) uint64, sorted within each row and attribute."""
    offsets = np.zeros((len(names), columns.height + 1), dtype=np.int64)
    parts, base = [], 0
    for a, name in enumerate(names):
        off, h = _hash_lists(codes[name] if codes else list_codes(columns.get_column(name)))
        offsets[a] = off + base
        parts.append(h)
        base += len(h)
    return offsets, np.concatenate(parts) if parts else np.zeros(0, dtype=np.uint64)


@dataclass(frozen=True)
class ExactQueries:
    """A request batch's exact values: hash_offsets (A, B+1) int64 into hashes (T,) uint64, each
    request's value hashes per bloom attribute, sorted."""

    hash_offsets: np.ndarray
    hashes: np.ndarray

    def slice(self, lo: int, hi: int) -> ExactQueries:
        return ExactQueries(self.hash_offsets[:, lo:hi + 1], self.hashes)


def encode_exact_queries(spec: TargetingSpec, columns: pl.DataFrame) -> ExactQueries:
    """The exact values of validated request columns."""
    return ExactQueries(*hash_lists(columns, spec.bloom_layout.names))


@dataclass(frozen=True)
class ExactIndex:
    """bitmask_rows: (N, W_bm) uint64; hash_offsets: (A, N+1) int64 into hashes (T,) uint64, an
    ad's hashes sorted; an ad with no values for attribute a is unrestricted on a."""

    layout: BitmaskLayout
    bloom_names: tuple[str, ...]
    bitmask_rows: np.ndarray
    hash_offsets: np.ndarray
    hashes: np.ndarray


def build_exact_index(spec: TargetingSpec, columns: pl.DataFrame, ad_rows: dict[str, np.ndarray] | None = None,
                      codes: dict[str, ListCodes] | None = None) -> ExactIndex:
    """The exact index of validated catalog columns; pass the matcher planes' `ad_rows` and the
    columns' `codes` when already computed."""
    layout = spec.bitmask_layout
    bitmask_rows = ad_rows["bitmask"] if ad_rows else encode_ad_rows(layout, columns)
    names = spec.bloom_layout.names
    offsets, hashes = hash_lists(columns, names, codes)
    return ExactIndex(layout, names, bitmask_rows, offsets, hashes)


def eligible_mask(index: ExactIndex, requests: EncodedRequests, request: int, ads: np.ndarray) -> np.ndarray:
    """(k,) bool: which of `ads` (k,) int64 are eligible for request `request` (DESIGN.md §3)."""
    ads = np.asarray(ads, dtype=np.int64)
    return eligible_pairs(index, requests, np.full(len(ads), request, dtype=np.int64), ads)


def eligible_pairs(index: ExactIndex, requests: EncodedRequests, reqs: np.ndarray, ads: np.ndarray) -> np.ndarray:
    """(n,) bool: is ad `ads[i]` eligible for request `reqs[i]`; reqs, ads: (n,) int64."""
    return _flags(index, requests, reqs, ads, False) == ALL_STAGES


def attribute_eligibility(index: ExactIndex, requests: EncodedRequests, request: int, ad: int) -> np.ndarray:
    """(A_bm + A_bl,) bool: does catalog row `ad` pass each attribute (bitmask ones, then bloom ones,
    in spec order) for request `request`. Eligible iff all pass; explanations need each one."""
    ex = requests.exact
    bloom = np.zeros(len(index.bloom_names), dtype=bool)
    for a in range(len(index.bloom_names)):
        own = index.hashes[index.hash_offsets[a, ad]:index.hash_offsets[a, ad + 1]]
        asked = ex.hashes[ex.hash_offsets[a, request]:ex.hash_offsets[a, request + 1]]
        bloom[a] = len(own) == 0 or bool(np.isin(asked, own).any())
    return np.concatenate([attribute_passes(index.layout, index.bitmask_rows[ad], requests.planes[0], request), bloom])


def stage_flags(index: ExactIndex, requests: EncodedRequests, reqs: np.ndarray, ads: np.ndarray) -> np.ndarray:
    """(n,) uint8 per (request, ad) pair: STAGE_BITMASK set when the ad passes every bitmask
    attribute, STAGE_BLOOM when it passes every bloom attribute (each tested on its own, for pass
    rates per stage); eligible iff all are set (ALL_STAGES)."""
    return _flags(index, requests, reqs, ads, True)


def _flags(index: ExactIndex, requests: EncodedRequests, reqs: np.ndarray, ads: np.ndarray, every_stage: bool):
    bm, ex = requests.planes[0], requests.exact
    return _stage_flags(index.bitmask_rows, index.hash_offsets, index.hashes, bm.rows, bm.ranges, bm.word_offsets,
                        ex.hash_offsets, ex.hashes, np.asarray(reqs, dtype=np.int64), np.asarray(ads, dtype=np.int64),
                        every_stage)


@numba.njit(cache=True)
def _bloom_ok(ad_off, ad_hashes, ad, req_off, req_hashes, r):
    """Every bloom attribute: the ad is unrestricted, or ANY request value is in its list."""
    for a in range(ad_off.shape[0]):
        lo, hi = ad_off[a, ad], ad_off[a, ad + 1]
        if hi == lo:
            continue
        hit = False
        for j in range(req_off[a, r], req_off[a, r + 1]):
            k = np.searchsorted(ad_hashes[lo:hi], req_hashes[j])
            if k < hi - lo and ad_hashes[lo + k] == req_hashes[j]:
                hit = True
                break
        if not hit:
            return False
    return True


@numba.njit(cache=True)
def _stage_flags(rows, ad_off, ad_hashes, q_rows, q_ranges, woff, req_off, req_hashes, reqs, ads, every_stage):
    """STAGE_* bits per pair; without every_stage, an ad failing its bitmask skips the bloom test.
    The bitmask test is the matcher planes' test on the ads' own (exact) rows."""
    out = np.zeros(len(ads), dtype=np.uint8)
    for i in range(len(ads)):
        ad, r = ads[i], reqs[i]
        f = STAGE_BITMASK if row_passes(rows, ad, q_rows, q_ranges[r], woff) else 0
        if (f or every_stage) and _bloom_ok(ad_off, ad_hashes, ad, req_off, req_hashes, r):
            f |= STAGE_BLOOM
        out[i] = f
    return out
