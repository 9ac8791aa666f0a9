"""Insert new SID rows into a built GTM index without rebuilding it (docs/design.md §15).

The index stays in the layout `build_gtm` writes (nodes depth by depth, a node's children sorted
by token, entry e leading to node e + 1), so every reader and kernel serves it unchanged. Matchers
only grow: an entry on a new ad's path ORs the ad's rows into its union (and, with k-way, into
its first partition, which keeps the partitions falling in value), so no eligible prefix is ever
rejected; an entry whose ads were since paused, deleted or narrowed keeps their bits until the
next full build (a conservative superset). Legend as in `sidindex.trie.build`; U new ad rows,
Q new SID rows, M new nodes.
"""

from __future__ import annotations

import numba
import numpy as np

from schemas.artifacts import AD_LIVE
from sidindex.parallel import sized
from sidindex.trie.build import GTMIndex, MatcherPlane, round_up_f32
from sidindex.trie.dedup import RowTable


def insert_sids(g: GTMIndex, sids: np.ndarray, ad_index: np.ndarray, ad_rows: dict[str, np.ndarray],
                ad_value: np.ndarray | None = None) -> GTMIndex:
    """The index with SID rows added.

    sids:     (Q, L) int16 the new SID rows; ad_index: (Q,) int64 their ads' catalog rows, which
              must follow every row the index knows (rows len(g.ad_value) or more, ascending by ad)
    ad_rows:  per matcher plane, (U, W_p) uint64 the new ads' rows; new ad u is catalog row first + u,
              first = the smallest of ad_index
    ad_value: (U,) float64 the new ads' values (required when the index has values)
    Unchanged arrays are returned as the same objects, so a writer can tell them apart.
    """
    from sidindex.sid.assign import sid_keys  # an update's: a reader of an index needs none

    L = g.sid_length
    first = int(ad_index.min())
    local = ad_index - first

    # --- 1. WALK --- each new SID down the trie: the nodes it reaches, and where the first missing
    # node of its path would be inserted (before old node `ins`); below a missing node its children
    # go where the old children of node `ins` begin
    exist, ins = _walk(g.node_offsets, g.csr_tokens, sids)

    # --- 2. NEW NODES --- one per distinct missing (depth, prefix), ordered by (ins, depth, prefix),
    # which is the order of the new trie: np.insert puts them before old node `ins`
    prefix = np.stack([sid_keys(sids[:, :d + 1], g.level_sizes[:d + 1]) for d in range(L)], axis=1)  # (Q, L)
    miss_i, miss_d = np.nonzero(exist < 0)
    depth = miss_d + 1
    keys = np.stack([ins[miss_i, miss_d], depth, prefix[miss_i, miss_d]])
    uniq, which = np.unique(keys, axis=1, return_inverse=True)
    new_ins, new_depth, _ = uniq  # (M,) each, sorted by (ins, depth, prefix)
    M = len(new_ins)
    new_id = new_ins + np.arange(M)

    def old_to_new(n: np.ndarray) -> np.ndarray:  # old node id -> new
        return n + np.searchsorted(new_ins, n, side="right")

    # every SID row's path in the new numbering, and each new node's parent and token
    path = np.where(exist >= 0, old_to_new(np.maximum(exist, 0)), 0)
    path[miss_i, miss_d] = new_id[which.reshape(-1)]
    parent = np.zeros(M, dtype=np.int64)
    token = np.zeros(M, dtype=np.int16)
    parent[which.reshape(-1)] = np.where(miss_d > 0, path[miss_i, np.maximum(miss_d - 1, 0)], 0)
    token[which.reshape(-1)] = sids[miss_i, miss_d]

    # --- 3. CSR --- child counts with the new nodes (none of their own yet) plus one per new child
    counts = np.insert(np.diff(g.node_offsets), new_ins, 0)
    np.add.at(counts, parent, 1)
    node_offsets = np.zeros(len(counts) + 1, dtype=np.int64)
    np.cumsum(counts, out=node_offsets[1:])
    num_nodes = len(counts)
    depth_offsets = g.depth_offsets + np.concatenate([[0], np.cumsum(np.bincount(new_depth, minlength=L + 1))])
    e_ins = new_ins - 1  # entry e leads to node e + 1
    tokens = np.insert(g.csr_tokens, e_ins, token)

    # --- 4. SID -> AD --- new leaves hold no old ads; each new (leaf, ad) goes after the leaf's old ads
    leaf0 = int(depth_offsets[L])
    pairs = _unique_pairs(path[:, L - 1] - leaf0, ad_index)  # by leaf, then ad
    leaf_ad_offsets, leaf_ads = _merge_leaves(g.leaf_ad_offsets, g.leaf_ads, new_id[new_depth == L] - leaf0,
                                              pairs[0], pairs[1])

    # --- 5. ENTRIES ON NEW PATHS --- one (entry, new ad) pair per depth of each SID row, by entry
    ent_ad = _unique_pairs((path - 1).reshape(-1), np.repeat(local, L))
    touched, at = np.unique(ent_ad[0], return_index=True)  # (K,) entries, first pair of each
    is_new_entry = np.zeros(num_nodes - 1, dtype=bool)
    is_new_entry[new_id - 1] = True
    old_touched = ~is_new_entry[touched]
    kway = g.part_offsets is not None
    part_offsets: np.ndarray | None = None
    if g.part_offsets is not None:  # a new entry has one partition; partitions of old ones keep their order
        part_counts = np.insert(np.diff(g.part_offsets), e_ins, 1)
        part_offsets = np.zeros(len(part_counts) + 1, dtype=np.int64)
        np.cumsum(part_counts, out=part_offsets[1:])
        p_ins = g.part_offsets[e_ins]
        first_part = part_offsets[touched]

    # --- 6. MATCHERS --- OR the new ads' rows into each touched entry's union (and first partition);
    # the new rows, deduplicated among themselves, follow the plane's table (hashing the whole table
    # again would cost an update as much as the build's dedup; the next full build compacts)
    planes = []
    for plane, rows in zip(g.planes, ad_rows.values()):
        grown = np.bitwise_or.reduceat(rows[ent_ad[1]], at, axis=0)  # (K, W)
        new_rows = RowTable(plane.table.shape[1], 2 * len(touched))
        index = np.insert(plane.index, e_ins, 0)
        union = grown.copy()
        union[old_touched] |= plane.table[index[touched[old_touched]]]
        index[touched] = len(plane.table) + new_rows.add(union)
        part_index = None
        if kway:
            assert plane.part_index is not None  # a k-way index partitions every plane
            part_index = np.insert(plane.part_index, p_ins, 0)
            part = grown
            part[old_touched] |= plane.table[part_index[first_part[old_touched]]]
            part_index[first_part] = len(plane.table) + new_rows.add(part)
        planes.append(MatcherPlane(plane.name, np.concatenate([plane.table, new_rows.table()]), index, part_index))

    # --- 7. VALUES --- a touched entry's bound rises to its best new ad's
    ad_values = entry_value = part_value = None
    if g.ad_value is not None:
        assert g.entry_value is not None  # values come with their bounds
        if ad_value is None:
            raise ValueError("the index has ad values: insert_sids needs the new ads' ad_value")
        ad_values = np.concatenate([g.ad_value, ad_value])
        entry_value = np.insert(g.entry_value, e_ins, 0)
        best = round_up_f32(np.maximum.reduceat(ad_value[ent_ad[1]], at))
        entry_value[touched] = np.maximum(entry_value[touched], best)
        if kway:
            assert g.part_value is not None
            part_value = np.insert(g.part_value, p_ins, 0)
            part_value[first_part] = entry_value[touched]  # the first was the entry's best before
    if M == 0:  # the shape of the trie is the base's: keep its arrays (a writer links, a loader keeps them)
        node_offsets, tokens, depth_offsets = g.node_offsets, g.csr_tokens, g.depth_offsets
        part_offsets = g.part_offsets
    return GTMIndex(
        level_sizes=g.level_sizes, node_offsets=node_offsets,
        csr_child_nodes=g.csr_child_nodes if M == 0 else np.arange(1, num_nodes, dtype=np.int32),
        csr_tokens=tokens, planes=tuple(planes), depth_offsets=depth_offsets, leaf_ad_offsets=leaf_ad_offsets,
        leaf_ads=leaf_ads, part_offsets=part_offsets if kway else None, ad_value=ad_values,
        entry_value=entry_value, part_value=part_value)


def liveness(g: GTMIndex, ad_state: np.ndarray) -> tuple[np.ndarray, int, int]:
    """Under `ad_state` (N,) uint8: (E,) uint8 1 for the child entries with a live row beneath them
    (`entry_live`: the search takes no other); the stale entries, with a row that is not live
    beneath them (their matchers still hold its bits, a superset of what a full build would keep);
    and the dead SIDs, none of whose rows is live."""
    any_live, all_live = _leaf_live(g, ad_state)
    return (_beneath(g, any_live).view(np.uint8), int(_beneath(g, ~all_live).sum()),
            int(len(any_live) - any_live.sum()))


def live_entries(g: GTMIndex, ad_state: np.ndarray) -> np.ndarray:
    """(E,) uint8: 1 for the child entries with a live row (`ad_state` (N,) uint8) beneath them."""
    return _beneath(g, _leaf_live(g, ad_state)[0]).view(np.uint8)


def _leaf_live(g: GTMIndex, ad_state: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(S,) bool per SID: some of its rows is live; all of them are. A row outside `ad_state`
    (N,) uint8 is refused (ValueError), not read."""
    any_live, all_live, outside = _leaf_states(g.leaf_ads, g.leaf_ad_offsets, ad_state)
    if outside:
        raise ValueError(f"{outside} SID rows name ads outside the {len(ad_state)} ad states")
    return any_live, all_live


@sized()
@numba.njit(parallel=True, cache=True, nogil=True)
def _leaf_states(leaf_ads: np.ndarray, offsets: np.ndarray, ad_state: np.ndarray
                 ) -> tuple[np.ndarray, np.ndarray, int]:
    """One pass over the SID rows (leaf_ads (P,) int64 by SID, offsets (S+1,) int64): (S,) bool a
    live row, (S,) bool only live rows, and the rows outside ad_state (N,) uint8 (skipped)."""
    S, N = len(offsets) - 1, len(ad_state)
    any_live, all_live = np.empty(S, dtype=np.bool_), np.empty(S, dtype=np.bool_)
    outside = 0
    for s in numba.prange(S):
        some, every = False, True
        for j in range(offsets[s], offsets[s + 1]):
            r = leaf_ads[j]
            if r < 0 or r >= N:
                outside += 1
                continue
            live = ad_state[r] == AD_LIVE
            some |= live
            every &= live
        any_live[s], all_live[s] = some, every
    return any_live, all_live, outside


def _beneath(g: GTMIndex, leaf_flag: np.ndarray) -> np.ndarray:
    """(E,) bool: the entries with a flagged leaf (leaf_flag (S,) bool) in their subtree; one pass
    per depth, deepest first (a node's children are the contiguous entries of the next depth)."""
    L, do = g.sid_length, g.depth_offsets
    out = np.empty(g.num_nodes - 1, dtype=bool)
    out[do[L] - 1:] = leaf_flag
    for d in range(L - 1, 0, -1):
        _any_child(out, g.node_offsets, int(do[d]), int(do[d + 1]))
    return out


@sized()
@numba.njit(parallel=True, cache=True, nogil=True)
def _any_child(out: np.ndarray, no: np.ndarray, lo: int, hi: int) -> None:
    """out[i - 1] = whether any child entry of node i (lo <= i < hi) is set in out (E,) bool, the
    children's depth already filled (entry i - 1 leads to node i; no (num_nodes+1,) int64)."""
    for i in numba.prange(lo, hi):
        some = False
        for c in range(no[i], no[i + 1]):
            if out[c]:
                some = True
                break
        out[i - 1] = some


def _unique_pairs(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """(2, K) int64 the distinct pairs (a[i], b[i]) of a, b (n,) int64, by a then b."""
    order = np.lexsort((b, a))
    a, b = a[order], b[order]
    keep = np.ones(len(a), dtype=bool)
    keep[1:] = (a[1:] != a[:-1]) | (b[1:] != b[:-1])
    return np.stack([a[keep], b[keep]])


@numba.njit(cache=True, nogil=True)
def _merge_leaves(offsets: np.ndarray, ads: np.ndarray, new_leaves: np.ndarray, pair_leaf: np.ndarray,
                  pair_ad: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The SID -> ad CSR with leaves and ads inserted: offsets (S+1,) int64 and ads (P,) int64 the
    old one; new_leaves (M,) int64 ascending, the new leaves' places among the S + M; pair_leaf,
    pair_ad (Q,) int64 new (leaf, ad) pairs in the new numbering, by leaf then ad, each ad after the
    leaf's old ones. Returns (S+M+1,) int64 offsets and (P+Q,) int64 ads. One pass in order."""
    S = len(offsets) - 1 + len(new_leaves)
    out_offsets = np.empty(S + 1, dtype=np.int64)
    out = np.empty(len(ads) + len(pair_ad), dtype=np.int64)
    out_offsets[0] = 0
    old = k = q = n = 0
    for s in range(S):
        if k < len(new_leaves) and new_leaves[k] == s:
            k += 1
        else:
            for j in range(offsets[old], offsets[old + 1]):
                out[n] = ads[j]
                n += 1
            old += 1
        while q < len(pair_leaf) and pair_leaf[q] == s:
            out[n] = pair_ad[q]
            n += 1
            q += 1
        out_offsets[s + 1] = n
    if k != len(new_leaves) or q != len(pair_leaf) or old != len(offsets) - 1:
        raise ValueError("new leaves and pairs must be ascending, within the merged leaves")
    return out_offsets, out


@numba.njit(cache=True)
def _walk(node_offsets: np.ndarray, tokens: np.ndarray, sids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Walk SID rows (Q, L) int16 down the trie. Returns exist (Q, L) int64, the node each reaches
    at depth d + 1 or -1 where it is missing, and ins (Q, L) int64, for a missing node, the old
    node it is inserted before (its new id is ins plus the new nodes ordered before it)."""
    Q, L = sids.shape
    exist = np.full((Q, L), -1, dtype=np.int64)
    ins = np.zeros((Q, L), dtype=np.int64)
    for i in range(Q):
        node = 0
        for d in range(L):
            lo, hi = node_offsets[node], node_offsets[node + 1]
            e = lo + np.searchsorted(tokens[lo:hi], sids[i, d])
            if e < hi and tokens[e] == sids[i, d]:
                node = e + 1
                exist[i, d] = node
                continue
            at = e + 1  # missing: inserted before the old node its entry would take
            for dd in range(d, L):
                ins[i, dd] = at
                at = node_offsets[at] + 1  # its children go where old node `at`'s begin
            break
    return exist, ins
