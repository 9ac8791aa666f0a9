"""Cover: every child entry's matcher rows hold what lies beneath it (docs/design.md §3, §4), and
every SID's value bound its ads' values (§16).

A node's matcher is the OR over its subtree's ads: no eligible prefix is rejected as long as each
entry's row holds its children's rows and a SID's row its ads' rows. Digests cannot tell a row
zeroed by a writer that resealed them; these relations can. The SID-to-ad relations gather by ad
at random, so they are checked where a snapshot is judged (`sidindex validate`, an update's base
and result), not at every open. k-way partitions are not covered. After an update, an entry is
unchanged when its base counterpart (the entry of the same SID prefix) names the same row of a
table whose base rows are kept, the same value bound and, for a SID, the same kept ads; relations
of unchanged entries hold as in the base, and only the rest are checked. In full: docs/gtm-index.md
("Matcher cover").
Legend as in `sidindex.trie.build`; `do` depth offsets, `no` node offsets, `lo` leaf ad offsets;
`same` (E,) bool the unchanged entries (empty: none known, every relation checked).
"""

from __future__ import annotations

import numba
import numpy as np

from schemas.artifacts import plane_arrays
from sidindex.exact import ExactIndex
from sidindex.parallel import sized
from sidindex.trie.build import GTMIndex


@numba.njit(cache=True, inline="always")
def _lacks(row: np.ndarray, table: np.ndarray, r: int) -> bool:
    """Whether `row` (W,) uint64 has a bit that table[r] lacks."""
    for w in range(table.shape[1]):
        if row[w] & ~table[r, w]:
            return True
    return False


@sized()
@numba.njit(parallel=True, cache=True, nogil=True)
def _children_outside(no: np.ndarray, table: np.ndarray, index: np.ndarray, inner_end: int,
                      same: np.ndarray, counter: np.ndarray, base_index: np.ndarray) -> int:
    """Child entries c of node i (1 <= i < inner_end, entry i - 1 leads to it) with a bit that
    entry i - 1's row lacks. no: (num_nodes+1,) int64; table: (R, W) uint64; index: (E,) int32.
    A child naming its parent's very row (rows are deduplicated: a chain above one ad's SID, or
    half to two thirds of the entries in the bench catalog) holds nothing more: not read. Since a
    base (`same` not empty; counter: (num_nodes,) int64 each node's base node or -1; base_index:
    (E_base,) int32 the base's index of this plane): neither is a `same` child of an entry whose
    row holds its counterpart's (which held that child's)."""
    bad = 0
    for i in numba.prange(1, inner_end):
        r = index[i - 1]
        b = counter[i] if len(same) else -1
        grown = b >= 0 and (base_index[b - 1] == r or not _lacks(table[base_index[b - 1]], table, r))
        for c in range(no[i], no[i + 1]):
            if index[c] != r and not (grown and same[c]):
                bad += _lacks(table[index[c]], table, r)
    return bad


@sized()
@numba.njit(parallel=True, cache=True, nogil=True)
def _ads_outside(lo: np.ndarray, leaf_ads: np.ndarray, table: np.ndarray, index: np.ndarray, first: int,
                 rows: np.ndarray, same: np.ndarray) -> int:
    """(SID, ad) pairs whose exact row has a bit the SID entry's row lacks; SID s's entry is
    first + s, not read when `same`. lo: (S+1,) int64; leaf_ads: (P,) int64; rows: (N, W) uint64."""
    bad = 0
    for s in numba.prange(len(lo) - 1):
        if len(same) and same[first + s]:
            continue
        r = index[first + s]
        for j in range(lo[s], lo[s + 1]):
            bad += _lacks(rows[leaf_ads[j]], table, r)
    return bad


@sized()
@numba.njit(parallel=True, cache=True, nogil=True)
def _groups_unset(lo: np.ndarray, leaf_ads: np.ndarray, table: np.ndarray, index: np.ndarray, first: int,
                  hash_offsets: np.ndarray, word_offsets: np.ndarray, same: np.ndarray) -> int:
    """(SID, ad, attribute) triples whose attribute words in the SID entry's row are not all ones
    though the ad is unrestricted there (no values: hash_offsets (A, N+1) int64 gives an empty
    run), or are all zero though it is restricted. word_offsets: (A+1,) int64."""
    bad = 0
    full = ~np.uint64(0)
    for s in numba.prange(len(lo) - 1):
        if len(same) and same[first + s]:
            continue
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


@sized()
@numba.njit(parallel=True, cache=True, nogil=True)
def _values_above(lo: np.ndarray, leaf_ads: np.ndarray, ev: np.ndarray, first: int, ad_value: np.ndarray,
                  same: np.ndarray) -> int:
    """(SID, ad) pairs whose ad's value exceeds the SID entry's bound ev[first + s]. ev: (E,)
    float32; ad_value: (N,) float64."""
    bad = 0
    for s in numba.prange(len(lo) - 1):
        if len(same) and same[first + s]:
            continue
        bound = np.float64(ev[first + s])
        for j in range(lo[s], lo[s + 1]):
            if bound < ad_value[leaf_ads[j]]:
                bad += 1
    return bad


# --- since a base: the unchanged entries ------------------------------------------------------

@sized()
@numba.njit(parallel=True, cache=True, nogil=True)
def _counterparts(counter: np.ndarray, no: np.ndarray, tok: np.ndarray, bno: np.ndarray, btok: np.ndarray,
                  lo: int, hi: int) -> None:
    """For nodes lo <= i < hi of one depth, whose base node counter[i] is set (-1: none), set
    their children's: the base child of the same token. counter: (num_nodes,) int64; no, bno:
    (num_nodes+1,) int64 node offsets; tok, btok: (E,) int16 children's tokens, ascending per node
    in both (the structure checks say so)."""
    for i in numba.prange(lo, hi):
        b = counter[i]
        j, end = (bno[b], bno[b + 1]) if b >= 0 else (0, 0)
        for c in range(no[i], no[i + 1]):
            while j < end and btok[j] < tok[c]:
                j += 1
            counter[c + 1] = j + 1 if j < end and btok[j] == tok[c] else -1


@sized()
@numba.njit(parallel=True, cache=True, nogil=True)
def _same_at(same: np.ndarray, counter: np.ndarray, a: np.ndarray, b: np.ndarray) -> None:
    """same[e] &= a[e] equals b at entry e's counterpart (counter[e + 1] - 1) bit for bit; a: (E,)
    and b: (E_base,) of one dtype, viewed as integers so that a NaN bound equals itself."""
    for e in numba.prange(len(same)):
        if same[e] and a[e] != b[counter[e + 1] - 1]:
            same[e] = False


@sized()
@numba.njit(parallel=True, cache=True, nogil=True)
def _same_ads(same: np.ndarray, counter: np.ndarray, first: int, bfirst: int, lo: np.ndarray, leaf_ads: np.ndarray,
              blo: np.ndarray, bleaf_ads: np.ndarray) -> None:
    """same[first + s] &= SID s has its counterpart's very ads (first, bfirst: the entry before
    each trie's first SID; lo, blo: (S+1,) int64 leaf ad offsets; leaf_ads, bleaf_ads: (P,) int64)."""
    for s in numba.prange(len(lo) - 1):
        e = first + s
        if not same[e]:
            continue
        t = counter[e + 1] - 1 - bfirst
        if lo[s + 1] - lo[s] != blo[t + 1] - blo[t]:
            same[e] = False
            continue
        for j in range(lo[s + 1] - lo[s]):
            if leaf_ads[lo[s] + j] != bleaf_ads[blo[t] + j]:
                same[e] = False
                break


@sized()
@numba.njit(parallel=True, cache=True, nogil=True)
def _differ(a: np.ndarray, b: np.ndarray) -> bool:
    """Whether the first len(b) bytes of a (n,) uint8 differ from b (m,) uint8, m <= n."""
    bad = 0
    for i in numba.prange(len(b)):
        bad += a[i] != b[i]
    return bad > 0


def _kept(a: np.ndarray | None, b: np.ndarray | None) -> bool:
    """Whether a's first rows are base b's, bit for bit (both None: nothing to keep); a, b: (n, ...),
    (m, ...) with one row shape and dtype, m <= n."""
    if a is None or b is None:
        return a is None and b is None
    if a is b:
        return True
    if a.dtype != b.dtype or a.shape[1:] != b.shape[1:] or len(a) < len(b):
        return False
    return not _differ(np.ascontiguousarray(a[:len(b)]).reshape(-1).view(np.uint8),
                       np.ascontiguousarray(b).reshape(-1).view(np.uint8))


@sized()
@numba.njit(parallel=True, cache=True, nogil=True)
def _restrictions_differ(offsets: np.ndarray, base: np.ndarray) -> bool:
    """Whether any of base's ads (A, N_base+1) is restricted on an attribute where the same row of
    offsets (A, N+1) int64 is not, or the other way round (an ad is unrestricted on attribute t
    when its run is empty; only that is read of its hashes, so runs that moved are still kept:
    a values plane is attribute-major, and the new ads' hashes shift later attributes' offsets)."""
    bad = 0
    for a in numba.prange(base.shape[1] - 1):
        for t in range(base.shape[0]):
            bad += (offsets[t, a + 1] == offsets[t, a]) != (base[t, a + 1] == base[t, a])
    return bad > 0


def _restrictions_kept(offsets: np.ndarray | None, base: np.ndarray | None) -> bool:
    """Whether the ads of base's hash offsets (A, N_base+1) are restricted where they were in
    offsets (A, N+1), N >= N_base (both None: no values plane)."""
    if offsets is None or base is None:
        return offsets is None and base is None
    return offsets.shape[0] == base.shape[0] and offsets.shape[1] >= base.shape[1] and not _restrictions_differ(
        offsets, base)


def unchanged_entries(gtm: GTMIndex, exact: ExactIndex, base: GTMIndex, base_exact: ExactIndex
                      ) -> tuple[np.ndarray, np.ndarray] | None:
    """(same (E,) bool, counter (num_nodes,) int64): the entries of `gtm` that are unchanged from
    base (module docstring), and each node's base node (-1: none); or None when base's rows, ads'
    rows or values are not kept (nothing is known: check everything). Both tries must have passed
    the structure checks, and `base` the cover."""
    L = gtm.sid_length
    if base.sid_length != L or len(gtm.planes) != len(base.planes) or len(exact.planes) != len(base_exact.planes):
        return None
    if not (_kept(gtm.ad_value, base.ad_value) and all(
            p.name == q.name and _kept(p.table, q.table) for p, q in zip(gtm.planes, base.planes)) and all(
            _kept(e.rows, f.rows) and _restrictions_kept(e.hash_offsets, f.hash_offsets)
            for e, f in zip(exact.planes, base_exact.planes))):
        return None
    # --- 1. COUNTERPARTS --- depth by depth from the roots, each node's children merged by token
    counter = np.empty(gtm.num_nodes, dtype=np.int64)
    counter[0] = 0
    for d in range(L):
        _counterparts(counter, gtm.node_offsets, gtm.csr_tokens, base.node_offsets, base.csr_tokens,
                      int(gtm.depth_offsets[d]), int(gtm.depth_offsets[d + 1]))
    same = counter[1:] >= 0
    # --- 2. THE SAME ROWS, BOUNDS AND ADS --- (an index names a base row: tables keep their rows)
    for p, q in zip(gtm.planes, base.planes):
        _same_at(same, counter, p.index, q.index)
    if gtm.entry_value is not None and base.entry_value is not None:
        _same_at(same, counter, gtm.entry_value.view(np.int32), base.entry_value.view(np.int32))
    elif gtm.entry_value is not None or base.entry_value is not None:
        return None
    _same_ads(same, counter, int(gtm.depth_offsets[L]) - 1, int(base.depth_offsets[L]) - 1, gtm.leaf_ad_offsets,
              gtm.leaf_ads, base.leaf_ad_offsets, base.leaf_ads)
    return same, counter


def uncovered(gtm: GTMIndex, exact: ExactIndex, since: tuple[GTMIndex, ExactIndex] | None = None
              ) -> list[tuple[str, str]]:
    """(array name, what breaks) for each plane whose matcher rows do not cover what lies beneath
    them, in plane order, then for the SIDs' value bounds; empty when all do. The trie's structure
    must be checked first (`sidindex.snapshot.validate.check_structure`): this indexes with its
    offsets unchecked. since: a base (trie, exact index) whose structure and cover passed, which
    `gtm` may have been made from: only the relations not kept from it are checked
    (`unchanged_entries`), the verdict the same."""
    L, do, no = gtm.sid_length, gtm.depth_offsets, gtm.node_offsets
    kept = None if since is None else unchanged_entries(gtm, exact, *since)
    same, counter = kept if kept is not None else (np.zeros(0, dtype=np.bool_), np.zeros(0, dtype=np.int64))
    base_planes = since[0].planes if kept is not None and since is not None else gtm.planes
    first, lo = int(do[L]) - 1, gtm.leaf_ad_offsets  # SID s is node do[L] + s, led to by entry do[L] - 1 + s
    out = []
    for p, q, e, layout in zip(gtm.planes, base_planes, exact.planes, exact.spec.layouts):
        table, name = p.table, plane_arrays(p.name).table
        if _children_outside(no, table, p.index, int(do[L]), same, counter, q.index):
            out.append((name, "a prefix's matcher row lacks a bit of one of its children's"))
        elif e.rows is not None and _ads_outside(lo, gtm.leaf_ads, table, p.index, first, e.rows, same):
            out.append((name, "a SID's matcher row lacks a bit of one of its ads' rows"))
        elif e.rows is None and e.hash_offsets is not None and _groups_unset(
                lo, gtm.leaf_ads, table, p.index, first, e.hash_offsets,
                np.asarray(layout.word_offsets, dtype=np.int64), same):
            out.append((name, "a SID's matcher row has an attribute with no bit of one of its ads "
                                           "(all ones where the ad is unrestricted)"))
    if gtm.ad_value is not None and gtm.entry_value is not None and _values_above(
            lo, gtm.leaf_ads, gtm.entry_value, first, gtm.ad_value, same):
        out.append(("entry_value", "a SID's bound is below the value of one of its ads"))
    return out
