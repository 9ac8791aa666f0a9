"""The CPU matcher over a GTM index: an obviously-correct reference for the runtime and tests.

For one request at one trie node it returns the child tokens that pass:
  cd      the child exists (catalog validity: the SID prefix is real)
  cd+gtm  and the child's subtree-union matchers pass: bitmask (row & user) == user, word by word,
          first failing word stops; then per bloom attribute ANY query q with (row & q) == q.
  cd+gtm+kway  and ANY of the child's k-way partitions passes ALL attributes (the union test first).
Unions and partitions are conservative (false positives only), so an eligible prefix always passes.
"""

from __future__ import annotations

from dataclasses import dataclass

import numba
import numpy as np
import polars as pl

from sidindex.matchers.bitmask import bitmask_layout, encode_request_rows, row_passes
from sidindex.matchers.bloom import bloom_layout, encode_request_queries
from sidindex.targeting import TargetingSpec
from sidindex.trie.build import GTMIndex

MODES = ("cd", "cd+gtm", "cd+gtm+kway")


@dataclass(frozen=True)
class GTMRequests:
    """user_rows: (B, W_bm) uint64; query_rows: (Q, W_bl) uint64; query_ranges: (B, A, 2) int64;
    word_offsets: (A+1,) int64 first word of each bloom attribute."""

    user_rows: np.ndarray
    query_rows: np.ndarray
    query_ranges: np.ndarray
    word_offsets: np.ndarray


def encode_gtm_requests(spec: TargetingSpec, columns: pl.DataFrame) -> GTMRequests:
    """Encode validated request columns (see `sidindex.ingest.read_requests`)."""
    bl = bloom_layout(spec)
    q = encode_request_queries(bl, columns)
    return GTMRequests(encode_request_rows(bitmask_layout(spec), columns), q.rows, q.ranges,
                       np.asarray(bl.word_offsets, dtype=np.int64))


def passing_tokens(index: GTMIndex, requests: GTMRequests, request: int, node: int, mode: str) -> np.ndarray:
    """(k,) int16 tokens of `node`'s children that pass `mode` for request `request`, ascending."""
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    lo, hi = index.node_offsets[node], index.node_offsets[node + 1]
    if mode == "cd":
        return index.csr_tokens[lo:hi]
    kway = mode == "cd+gtm+kway"
    if kway and index.part_offsets is None:
        raise ValueError("this index was built without k-way partitions")
    empty = np.zeros(0, dtype=np.int64)
    ok = _pass_entries(lo, hi, index.bitmask_index, index.bloom_index, index.bitmask_table, index.bloom_table,
                       requests.word_offsets, requests.user_rows[request], requests.query_rows,
                       requests.query_ranges[request], kway,
                       index.part_offsets if kway else empty, index.part_bitmask_index if kway else empty,
                       index.part_bloom_index if kway else empty)
    return index.csr_tokens[lo:hi][ok]


@numba.njit(cache=True)
def _row_passes(bm_table, r_bm, bl_table, r_bl, woff, user, q_rows, q_ranges):
    """Bitmask row r_bm and Bloom row r_bl pass every attribute for one request."""
    if not row_passes(bm_table, r_bm, user):
        return False
    for a in range(len(woff) - 1):
        hit = False
        for q in range(q_ranges[a, 0], q_ranges[a, 1]):
            good = True
            for w in range(woff[a], woff[a + 1]):
                if bl_table[r_bl, w] & q_rows[q, w] != q_rows[q, w]:
                    good = False
                    break
            if good:
                hit = True
                break
        if not hit:
            return False
    return True


@numba.njit(cache=True)
def _pass_entries(lo, hi, bm_index, bl_index, bm_table, bl_table, woff, user, q_rows, q_ranges,
                  kway, part_offsets, part_bm, part_bl):
    out = np.zeros(hi - lo, dtype=np.bool_)
    for e in range(lo, hi):
        ok = _row_passes(bm_table, bm_index[e], bl_table, bl_index[e], woff, user, q_rows, q_ranges)
        if ok and kway:
            ok = False
            for p in range(part_offsets[e], part_offsets[e + 1]):
                if _row_passes(bm_table, part_bm[p], bl_table, part_bl[p], woff, user, q_rows, q_ranges):
                    ok = True
                    break
        out[e - lo] = ok
    return out
