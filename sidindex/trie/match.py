"""The CPU matcher over a GTM index: an obviously-correct reference for the runtime and tests.

For one request at one trie node it returns the child tokens that pass:
  cd      the child exists (catalog validity: the SID prefix is real)
  cd+gtm  and the child's subtree-union matchers pass: bitmask (row & user) == user, word by word,
          first failing word stops; then per bloom attribute ANY query q with (row & q) == q.
  cd+gtm+kway  and ANY of the child's k-way partitions passes ALL attributes (the union test first).
Unions and partitions are conservative (false positives only), so an eligible prefix always passes.
"""

from __future__ import annotations

import numba
import numpy as np

from sidindex.errors import ConfigError
from sidindex.matchers.bitmask import row_passes
from sidindex.modes import Mode, parse_mode
from sidindex.requests import EncodedRequests
from sidindex.trie.build import GTMIndex


def passing_tokens(index: GTMIndex, requests: EncodedRequests, request: int, node: int, mode: Mode | str) -> np.ndarray:
    """(k,) int16 tokens of `node`'s children that pass `mode` (a constrained one) for request
    `request` of `requests` (host arrays), ascending."""
    mode = parse_mode(mode, kway_available=index.part_offsets is not None)
    if not mode.constrained:
        raise ConfigError(f"mode {mode.value} does not walk the trie; passing tokens exist for constrained modes only")
    lo, hi = index.node_offsets[node], index.node_offsets[node + 1]
    if not mode.gtm:
        return index.csr_tokens[lo:hi]
    empty = np.zeros(0, dtype=np.int64)
    parts = (index.part_offsets, index.part_bitmask_index, index.part_bloom_index) if mode.kway else (empty,) * 3
    ok = _pass_entries(lo, hi, index.bitmask_index, index.bloom_index, index.bitmask_table, index.bloom_table,
                       requests.word_offsets, requests.user_rows[request], requests.query_rows,
                       requests.query_ranges[request], mode.kway, *parts)
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
