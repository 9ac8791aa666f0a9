"""Matcher planes: the one test every matcher kind reduces to (docs/design.md §4).

A plane is a matcher kind's rows: (n, W) uint64 per ad, per subtree union, per k-way partition. A
request brings, for each of the plane's word groups, a set of query rows; a row passes the request
iff for EVERY group some query q has (row & q) == q on that group's words:

    bitmask  one group holding every word; the request's user row is its only query
    bloom    one group per attribute (its words); a query per request value

The CPU matcher, the exact filter of a `rows` plane, explanations, the torch reference and the
Triton kernel all run this one test, over the planes in `schemas.artifacts.MATCHER_PLANES` order
(the trie build ORs rows of any plane alike); a new matcher kind supplies its rows and queries
(`sidindex.matchers.attribute.MatcherKind`), never a new test.

Legend: B requests, G word groups, Q query rows, W words per row, n pairs.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numba
import numpy as np

from sidindex.arraytypes import HostOrDevice
from sidindex.parallel import sized


@dataclass(frozen=True)
class PlaneQueries:
    """A request batch's queries against one plane.

    rows:         (Q, W) uint64 query rows, shared by the batch (`ranges` index them); a query of
                  group g only has bits in g's words
    ranges:       (B, G, 2) int64 [start, end) of request b's queries for group g; never empty
    word_offsets: (G+1,) int64 the words of group g are [word_offsets[g], word_offsets[g+1])
    single:       every request has exactly one query per group (kernels then skip the ANY loop)
    most:         `max_queries` as the host knew it when the ranges moved to a device (of the whole
                  table, so a bound for any slice of it), or None: computed from the ranges
    """

    rows: HostOrDevice
    ranges: HostOrDevice
    word_offsets: HostOrDevice
    single: bool = False
    most: int | None = None

    @property
    def max_queries(self) -> int:
        """The most queries one request has for one group (on a device: a bound, read without
        waiting on the device)."""
        if self.most is not None:
            return self.most
        n = (self.ranges[..., 1] - self.ranges[..., 0]).reshape(-1)  # numpy or torch
        return int(n.max()) if len(n) else 0

    def slice(self, lo: int, hi: int) -> PlaneQueries:
        """Requests lo..hi-1 (the query rows stay shared)."""
        return replace(self, ranges=self.ranges[lo:hi])


def group_passes(row: np.ndarray, queries: PlaneQueries, request: int) -> np.ndarray:
    """(G,) bool: does `row` (W,) uint64 pass each word group for request `request`."""
    out = np.zeros(len(queries.word_offsets) - 1, dtype=bool)
    for g, (lo, hi) in enumerate(zip(queries.word_offsets[:-1], queries.word_offsets[1:])):
        q = queries.rows[queries.ranges[request, g, 0]:queries.ranges[request, g, 1], lo:hi]
        out[g] = bool(((row[lo:hi] & q) == q).all(axis=1).any())
    return out


@numba.njit(cache=True, nogil=True)
def row_passes(table: np.ndarray, r: int, q_rows: np.ndarray, ranges: np.ndarray, woff: np.ndarray) -> bool:
    """table[r] passes one request: for every group g ANY query q in [ranges[g, 0], ranges[g, 1])
    has (row & q) == q on words woff[g]:woff[g+1]; a failing word stops that query.
    table: (R, W) uint64; q_rows: (Q, W) uint64; ranges: (G, 2) int64; woff: (G+1,) int64."""
    for g in range(len(woff) - 1):
        hit = False
        for q in range(ranges[g, 0], ranges[g, 1]):
            good = True
            for w in range(woff[g], woff[g + 1]):
                if table[r, w] & q_rows[q, w] != q_rows[q, w]:
                    good = False
                    break
            if good:
                hit = True
                break
        if not hit:
            return False
    return True


PARALLEL_PAIRS = 1 << 13  # pairs from which the exact and matcher passes use every thread (`sidindex.parallel`)


@sized(PARALLEL_PAIRS, arg=1)
@numba.njit(parallel=True, cache=True, nogil=True)
def _pairs_pass(table: np.ndarray, rows: np.ndarray, reqs: np.ndarray, q_rows: np.ndarray, ranges: np.ndarray,
                woff: np.ndarray, ok: np.ndarray) -> None:
    for i in numba.prange(len(rows)):  # pairs in parallel
        if ok[i]:
            ok[i] = row_passes(table, rows[i], q_rows, ranges[reqs[i]], woff)


def pairs_pass(table: np.ndarray, rows: np.ndarray, reqs: np.ndarray, queries: PlaneQueries,
               ok: np.ndarray | None = None) -> np.ndarray:
    """(n,) bool: row rows[i] of `table` (R, W) uint64 passes request reqs[i]; rows, reqs: (n,)
    integer. `ok` (n,) bool: only these pairs are tested (the result is written into it)."""
    ok = np.ones(len(rows), dtype=np.bool_) if ok is None else ok
    _pairs_pass(table, np.asarray(rows, dtype=np.int64), np.asarray(reqs, dtype=np.int64), queries.rows,
                queries.ranges, queries.word_offsets, ok)
    return ok
