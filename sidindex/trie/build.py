"""Build the GTM index: a CSR trie over SIDs with per-entry subtree-union matchers.

Layout (DESIGN.md §6, names from GRACE Appendix A). Node 0 is the root; nodes are numbered depth by
depth and children of a node are contiguous and sorted by token, so each depth is a contiguous id
range and the child entries of all nodes, in entry order, are exactly the nodes 1..num_nodes-1.
Leaves (depth L) are SIDs; leaf_ad_offsets / leaf_ads map each leaf to its ads.

Legend: P SID rows (ad, path), N ads, S distinct SIDs (leaves), L SID length, E child entries,
W words per matcher row.
"""

from __future__ import annotations

from dataclasses import dataclass

import numba
import numpy as np

from sidindex.sid.assign import run_starts, sid_keys
from sidindex.trie.dedup import dedup_rows
from sidindex.trie.kway import KWayConfig, partition


@dataclass(frozen=True)
class GTMIndex:
    """The index the runtime masks beam search with.

    node_offsets:    (num_nodes+1,) int64; node i's child entries are [node_offsets[i], node_offsets[i+1])
    csr_child_nodes: (E,) int32 child node of each entry (E = num_nodes - 1)
    csr_tokens:      (E,) int16 token leading to it
    bitmask_index:   (E,) int32 row in bitmask_table of the child's subtree union
    bloom_index:     (E,) int32 row in bloom_table
    bitmask_table:   (R_bm, W_bm) uint64 deduplicated rows
    bloom_table:     (R_bl, W_bl) uint64 deduplicated rows
    depth_offsets:   (L+2,) int64; nodes of depth d are [depth_offsets[d], depth_offsets[d+1])
    leaf_ad_offsets: (S+1,) int64; leaf s (node depth_offsets[L] + s) holds ads
    leaf_ads:        (P,) int64 catalog rows, ascending within each leaf
    part_offsets:    (E+1,) int64 or None; entry e's k-way partitions are [part_offsets[e], part_offsets[e+1])
    part_bitmask_index, part_bloom_index: (T,) int32 rows in the tables of each partition
    """

    level_sizes: tuple[int, ...]
    node_offsets: np.ndarray
    csr_child_nodes: np.ndarray
    csr_tokens: np.ndarray
    bitmask_index: np.ndarray
    bloom_index: np.ndarray
    bitmask_table: np.ndarray
    bloom_table: np.ndarray
    depth_offsets: np.ndarray
    leaf_ad_offsets: np.ndarray
    leaf_ads: np.ndarray
    part_offsets: np.ndarray | None = None
    part_bitmask_index: np.ndarray | None = None
    part_bloom_index: np.ndarray | None = None

    @property
    def sid_length(self) -> int:
        return len(self.level_sizes)

    @property
    def vocab_size(self) -> int:
        return max(self.level_sizes)

    @property
    def num_nodes(self) -> int:
        return len(self.node_offsets) - 1

    @property
    def num_leaves(self) -> int:
        return len(self.leaf_ad_offsets) - 1

    def leaf_sids(self) -> np.ndarray:
        """(S, L) int16 the SID of each leaf, by walking parents up from the leaves."""
        parent = np.searchsorted(self.node_offsets, np.arange(self.num_nodes - 1), side="right") - 1
        L = self.sid_length
        out = np.empty((self.num_leaves, L), dtype=np.int16)
        node = np.arange(self.depth_offsets[L], self.depth_offsets[L + 1])
        for d in range(L - 1, -1, -1):
            out[:, d] = self.csr_tokens[node - 1]
            node = parent[node - 1]
        return out


def build_gtm(
    sids: np.ndarray,
    ad_index: np.ndarray,
    level_sizes: tuple[int, ...],
    bitmask_rows: np.ndarray,
    bloom_rows: np.ndarray,
    *,
    kway: KWayConfig | None = None,
    matcher_bits: int | None = None,
) -> GTMIndex:
    """Build the GTM index.

    sids:         (P, L) int16 SID rows; token l in [0, level_sizes[l])
    ad_index:     (P,) int64 catalog row of each SID row's ad
    bitmask_rows: (N, W_bm) uint64 ad bitmask rows; bloom_rows: (N, W_bl) uint64 ad Bloom rows
    kway:         add k-way partitions (the union arrays are always built)
    matcher_bits: meaningful bits of a bitmask + Bloom row, for k-way fill rates (default: all words)
    """
    # --- 1. CHECK ARGUMENTS --- before any work, so a bad call fails fast and clearly
    L = len(level_sizes)
    if sids.ndim != 2 or sids.shape[1] != L or len(sids) == 0:
        raise ValueError(f"sids must be a non-empty (P, {L}) array, got shape {sids.shape}")
    if ad_index.shape != (len(sids),):
        raise ValueError(f"ad_index must have shape ({len(sids)},), got {ad_index.shape}")
    n_ads = len(bitmask_rows)
    if len(bloom_rows) != n_ads or ad_index.min() < 0 or ad_index.max() >= n_ads:
        raise ValueError("ad_index must index rows of bitmask_rows and bloom_rows, which must have one row per ad")
    for d, size in enumerate(level_sizes):
        if sids[:, d].min() < 0 or sids[:, d].max() >= size:
            raise ValueError(f"level {d} tokens must lie in [0, {size})")

    # --- 2. SORT SID ROWS --- lexicographic order makes every prefix a contiguous run
    keys = sid_keys(sids, level_sizes)
    order, keys = _stable_sort(keys)
    leaf_start = run_starts(keys)  # (S,)
    uniq = sids[order[leaf_start]]  # (S, L) distinct SIDs, sorted
    del keys

    # --- 3. ASSIGN NODE IDS, DEPTH BY DEPTH --- row i of `uniq` opens a new depth-d node iff it
    # differs from row i-1 in one of its first d tokens, i.e. iff first_diff[i] < d
    S = len(uniq)
    first_diff = np.zeros(S, dtype=np.int8)  # row 0 opens a node at every depth
    if S > 1:
        first_diff[1:] = np.argmax(uniq[1:] != uniq[:-1], axis=1)
    depth_offsets = np.zeros(L + 2, dtype=np.int64)
    depth_offsets[1] = 1
    opens = [np.zeros(1, dtype=np.int64)]  # per depth: rows of `uniq` that open a node
    node_of_row = [np.zeros(S, dtype=np.int64)]  # per depth: node id of each row's prefix
    for d in range(1, L + 1):
        new = first_diff < d
        opens.append(np.flatnonzero(new))
        node_of_row.append(depth_offsets[d] + np.cumsum(new) - 1)
        depth_offsets[d + 1] = depth_offsets[d] + len(opens[d])
    num_nodes = int(depth_offsets[L + 1])

    # --- 4. CSR --- entry e is node e + 1; its parent is the depth-(d-1) node of its first row
    parent = np.concatenate([node_of_row[d - 1][opens[d]] for d in range(1, L + 1)])  # (E,)
    tokens = np.concatenate([uniq[opens[d], d - 1] for d in range(1, L + 1)]).astype(np.int16)
    node_offsets = np.zeros(num_nodes + 1, dtype=np.int64)
    np.cumsum(np.bincount(parent, minlength=num_nodes), out=node_offsets[1:])
    del node_of_row, uniq, parent

    # --- 5. SUBTREE UNIONS AND SID -> AD CSR --- leaves OR their ads' rows; each depth ORs its
    # children's unions (children of a node are contiguous: one parallel pass per depth). The stable
    # sort kept each leaf's ads in ascending (ad, path) order.
    ads_sorted = ad_index[order]
    leaf_ad_offsets = np.append(leaf_start, len(sids)).astype(np.int64)
    bm_union = _subtree_unions(bitmask_rows, ads_sorted, leaf_ad_offsets, node_offsets, depth_offsets, L)
    bl_union = _subtree_unions(bloom_rows, ads_sorted, leaf_ad_offsets, node_offsets, depth_offsets, L)

    # --- 6. K-WAY PARTITIONS (optional) --- members of an internal entry are its subtree's leaves
    # (a contiguous leaf range), members of a leaf entry are its ads
    part_offsets = None
    part_bm = np.zeros((0, bm_union.shape[1]), dtype=np.uint64)
    part_bl = np.zeros((0, bl_union.shape[1]), dtype=np.uint64)
    if kway is not None:
        bits = matcher_bits or 64 * (bm_union.shape[1] + bl_union.shape[1])
        first_leaf = depth_offsets[L] - 1  # entries from here on are leaves
        none = [np.zeros(0, dtype=np.int64)]  # L == 1: no internal entries
        leaf_lo = np.concatenate(none + [opens[d] for d in range(1, L)])
        leaf_hi = np.concatenate(none + [np.append(opens[d][1:], S) for d in range(1, L)])
        depth_of_entry = np.repeat(np.arange(1, L + 1), np.diff(depth_offsets[1:]))
        k = np.array([kway.k_at(d - 1) for d in range(L + 1)], dtype=np.int64)[depth_of_entry]
        dyn = kway.mode == "dynamic"
        c_in, pbm_in, pbl_in = partition(bm_union[first_leaf:], bl_union[first_leaf:], leaf_lo, leaf_hi,
                                         k[:first_leaf], dyn, kway.target_fill, bits)
        c_leaf, pbm_leaf, pbl_leaf = partition(bitmask_rows[ads_sorted], bloom_rows[ads_sorted], leaf_ad_offsets[:-1],
                                               leaf_ad_offsets[1:], k[first_leaf:], dyn, kway.target_fill, bits)
        part_offsets = np.zeros(len(k) + 1, dtype=np.int64)
        np.cumsum(np.concatenate([c_in, c_leaf]), out=part_offsets[1:])
        part_bm, part_bl = np.concatenate([pbm_in, pbm_leaf]), np.concatenate([pbl_in, pbl_leaf])

    # --- 7. DEDUP MATCHER TABLES --- many subtrees share rows (e.g. all-ones for unrestricted);
    # union and partition rows share one table per matcher kind
    E = len(bm_union)
    bitmask_table, idx = dedup_rows(np.concatenate([bm_union, part_bm]) if len(part_bm) else bm_union)
    bitmask_index, part_bitmask_index = idx[:E], idx[E:]
    del bm_union, part_bm
    bloom_table, idx = dedup_rows(np.concatenate([bl_union, part_bl]) if len(part_bl) else bl_union)
    bloom_index, part_bloom_index = idx[:E], idx[E:]
    del bl_union, part_bl

    return GTMIndex(
        level_sizes=tuple(int(s) for s in level_sizes),
        node_offsets=node_offsets,
        csr_child_nodes=np.arange(1, num_nodes, dtype=np.int32),
        csr_tokens=tokens,
        bitmask_index=bitmask_index,
        bloom_index=bloom_index,
        bitmask_table=bitmask_table,
        bloom_table=bloom_table,
        depth_offsets=depth_offsets,
        leaf_ad_offsets=leaf_ad_offsets,
        leaf_ads=ads_sorted.astype(np.int64),
        part_offsets=part_offsets,
        part_bitmask_index=part_bitmask_index if kway is not None else None,
        part_bloom_index=part_bloom_index if kway is not None else None,
    )


def _stable_sort(keys: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(order, keys[order]) for keys (P,) int64 >= 0, ties in input order.

    When key * P + row fits in int64, one np.sort of those packed values replaces a stable argsort
    (several times faster on tens of millions of keys).
    """
    p = len(keys)
    if int(keys.max()) < (2**63 - 1) // max(p, 1) - 1:
        packed = np.sort(keys * p + np.arange(p, dtype=np.int64))
        return packed % p, packed // p
    order = np.argsort(keys, kind="stable")
    return order, keys[order]


def _subtree_unions(rows: np.ndarray, ads_sorted: np.ndarray, leaf_ad_offsets: np.ndarray,
                    node_offsets: np.ndarray, depth_offsets: np.ndarray, L: int) -> np.ndarray:
    """(E, W) uint64 union row of every non-root node (entry e = node e + 1).

    rows: (N, W) ad rows; ads_sorted: (P,) ads in SID order; leaf s owns ads_sorted[leaf_ad_offsets[s]:...].
    """
    out = np.empty((int(depth_offsets[L + 1]) - 1, rows.shape[1]), dtype=np.uint64)
    _fill_unions(rows, ads_sorted, leaf_ad_offsets, node_offsets, depth_offsets, L, out)
    return out


@numba.njit(parallel=True, cache=True)
def _fill_unions(rows, ads_sorted, leaf_ad_offsets, node_offsets, depth_offsets, L, out):
    w = rows.shape[1]
    first_leaf = depth_offsets[L]
    for s in numba.prange(len(leaf_ad_offsets) - 1):  # leaves: OR of their ads' rows
        e = first_leaf + s - 1
        for j in range(w):
            acc = np.uint64(0)
            for i in range(leaf_ad_offsets[s], leaf_ad_offsets[s + 1]):
                acc |= rows[ads_sorted[i], j]
            out[e, j] = acc
    for d in range(L - 1, 0, -1):  # inner nodes: OR of their (contiguous) children's unions
        for v in numba.prange(depth_offsets[d], depth_offsets[d + 1]):
            for j in range(w):
                acc = np.uint64(0)
                for c in range(node_offsets[v], node_offsets[v + 1]):
                    acc |= out[c, j]
                out[v - 1, j] = acc
