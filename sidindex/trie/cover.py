"""Cover: every child entry's matcher rows hold what lies beneath it (docs/design.md §3, §4), and
every SID's value bound its ads' values (§16).

A node's matcher is the OR over its subtree's ads (updates only grow it), so for no false
negative each entry's row must hold every bit of its children's rows, and a SID's row every bit
of its ads' rows. Digests cannot tell a row zeroed or flipped by a writer that resealed them from
a sound one; these relations can, wherever the snapshot holds what a row must contain:

    inner entries  per plane, the row holds each child entry's row
    SID entries    a `rows` plane (bitmask): the row holds each ad's exact row; a `values` plane
                   (bloom: the ads' rows are not kept, only their value hashes): per attribute,
                   all ones where an ad is unrestricted, and some bit where it is restricted

    SID bounds     a SID entry's value bound (float32, rounded up) at least each of its ads' values;
                   a prefix's bound holding its children's is checked at every open (no gather)

k-way partitions are not covered (a partition holds some of the entry's ads, which ones is not
kept). One parallel numba pass per relation and plane over the entries, counting the breaks. The
SID-to-ad relations gather rows or values by ad at random, which costs more than the rest of an
open's checks together, so they are checked where a snapshot is judged rather than served:
`sidindex validate`, an update's base and the entries an update inserts.
Legend as in `sidindex.trie.build`; `do` depth offsets, `no` node offsets, `lo` leaf ad offsets.
"""

from __future__ import annotations

import numba
import numpy as np

from schemas.artifacts import plane_arrays
from sidindex.matchers.exact import ExactIndex
from sidindex.parallel import sized
from sidindex.trie.build import GTMIndex

_sized = sized(1 << 20)


@numba.njit(cache=True, inline="always")
def _lacks(row: np.ndarray, table: np.ndarray, r: int) -> bool:
    """Whether `row` (W,) uint64 has a bit that table[r] lacks."""
    for w in range(table.shape[1]):
        if row[w] & ~table[r, w]:
            return True
    return False


@_sized
@numba.njit(parallel=True, cache=True, nogil=True)
def _children_outside(no: np.ndarray, table: np.ndarray, index: np.ndarray, inner_end: int) -> int:
    """Child entries c of node i (1 <= i < inner_end, entry i - 1 leads to it) with a bit that
    entry i - 1's row lacks. no: (num_nodes+1,) int64; table: (R, W) uint64; index: (E,) int32.
    A child naming its parent's very row (rows are deduplicated: a chain above one ad's SID, or
    half to two thirds of the entries in the bench catalog) holds nothing more: not read."""
    bad = 0
    for i in numba.prange(1, inner_end):
        r = index[i - 1]
        for c in range(no[i], no[i + 1]):
            if index[c] != r:
                bad += _lacks(table[index[c]], table, r)
    return bad


@_sized
@numba.njit(parallel=True, cache=True, nogil=True)
def _ads_outside(lo: np.ndarray, leaf_ads: np.ndarray, table: np.ndarray, index: np.ndarray, first: int,
                 rows: np.ndarray) -> int:
    """(SID, ad) pairs whose exact row has a bit the SID entry's row lacks; SID s's entry is
    first + s. lo: (S+1,) int64; leaf_ads: (P,) int64; rows: (N, W) uint64."""
    bad = 0
    for s in numba.prange(len(lo) - 1):
        r = index[first + s]
        for j in range(lo[s], lo[s + 1]):
            bad += _lacks(rows[leaf_ads[j]], table, r)
    return bad


@_sized
@numba.njit(parallel=True, cache=True, nogil=True)
def _groups_unset(lo: np.ndarray, leaf_ads: np.ndarray, table: np.ndarray, index: np.ndarray, first: int,
                  hash_offsets: np.ndarray, word_offsets: np.ndarray) -> int:
    """(SID, ad, attribute) triples whose attribute words in the SID entry's row are not all ones
    though the ad is unrestricted there (no values: hash_offsets (A, N+1) int64 gives an empty
    run), or are all zero though it is restricted. word_offsets: (A+1,) int64."""
    bad = 0
    full = ~np.uint64(0)
    for s in numba.prange(len(lo) - 1):
        r = index[first + s]
        for j in range(lo[s], lo[s + 1]):
            a = leaf_ads[j]
            for t in range(len(word_offsets) - 1):
                unrestricted = hash_offsets[t, a + 1] == hash_offsets[t, a]
                ones, zero = True, True
                for w in range(word_offsets[t], word_offsets[t + 1]):
                    ones = ones and table[r, w] == full
                    zero = zero and table[r, w] == 0
                if (unrestricted and not ones) or zero:
                    bad += 1
    return bad


@_sized
@numba.njit(parallel=True, cache=True, nogil=True)
def _values_above(lo: np.ndarray, leaf_ads: np.ndarray, ev: np.ndarray, first: int, ad_value: np.ndarray) -> int:
    """(SID, ad) pairs whose ad's value exceeds the SID entry's bound ev[first + s]. ev: (E,)
    float32; ad_value: (N,) float64."""
    bad = 0
    for s in numba.prange(len(lo) - 1):
        bound = np.float64(ev[first + s])
        for j in range(lo[s], lo[s + 1]):
            if bound < ad_value[leaf_ads[j]]:
                bad += 1
    return bad


def uncovered(gtm: GTMIndex, exact: ExactIndex) -> list[tuple[str, str]]:
    """(array name, what breaks) for each plane whose matcher rows do not cover what lies beneath
    them, in plane order, then for the SIDs' value bounds; empty when all do. The trie's structure must be checked first
    (`sidindex.snapshot.validate.check_structure`): this indexes with its offsets unchecked."""
    L, do, no = gtm.sid_length, gtm.depth_offsets, gtm.node_offsets
    first, lo = int(do[L]) - 1, gtm.leaf_ad_offsets  # SID s is node do[L] + s, led to by entry do[L] - 1 + s
    out = []
    for p, e, layout in zip(gtm.planes, exact.planes, exact.spec.layouts):
        table, name = p.table, plane_arrays(p.name).table
        if _children_outside(no, table, p.index, int(do[L])):
            out.append((name, "a prefix's matcher row lacks a bit of one of its children's"))
        elif e.rows is not None and _ads_outside(lo, gtm.leaf_ads, table, p.index, first, e.rows):
            out.append((name, "a SID's matcher row lacks a bit of one of its ads' rows"))
        elif e.rows is None and e.hash_offsets is not None and _groups_unset(
                lo, gtm.leaf_ads, table, p.index, first, e.hash_offsets,
                np.asarray(layout.word_offsets, dtype=np.int64)):
            out.append((name, "a SID's matcher row has an attribute with no bit of one of its ads "
                                           "(all ones where the ad is unrestricted)"))
    if gtm.ad_value is not None and gtm.entry_value is not None and _values_above(
            lo, gtm.leaf_ads, gtm.entry_value, first, gtm.ad_value):
        out.append(("entry_value", "a SID's bound is below the value of one of its ads"))
    return out
