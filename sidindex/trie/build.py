"""Build the GTM index: a CSR trie over SIDs with per-entry subtree-union matchers.

Layout (docs/design.md §6, names from GRACE Appendix A). Node 0 is the root; nodes are numbered depth by
depth and children of a node are contiguous and sorted by token, so each depth is a contiguous id
range and the child entries of all nodes, in entry order, are exactly the nodes 1..num_nodes-1.
Leaves (depth L) are SIDs; leaf_ad_offsets / leaf_ads map each leaf to its ads.

Legend: P SID rows (ad, path), N ads, S distinct SIDs (leaves), L SID length, E child entries,
W words per matcher row.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import numba
import numpy as np

from schemas.artifacts import MATCHER_PLANES, MAX_AD_VALUE, plane_arrays
from sidindex.arraytypes import HostOrDevice
from sidindex.trie.dedup import RowTable, insert_row
from sidindex.trie.kway import KWayConfig, partition


@dataclass(frozen=True)
class MatcherPlane:
    """One matcher kind's rows in the index (`sidindex.matchers.plane`; stored under the names of
    `schemas.artifacts.plane_arrays`).

    table:      (R, W) uint64 deduplicated rows
    index:      (E,) int32 row of each child entry's subtree union
    part_index: (T,) int32 row of each k-way partition, or None
    """

    name: str
    table: HostOrDevice
    index: HostOrDevice
    part_index: HostOrDevice | None = None

    def arrays(self) -> dict[str, HostOrDevice]:
        names = plane_arrays(self.name)
        out = {names.index: self.index, names.table: self.table}
        return out if self.part_index is None else out | {names.part_index: self.part_index}


@dataclass(frozen=True)
class GTMIndex:
    """The index the runtime masks beam search with.

    node_offsets:    (num_nodes+1,) int64; node i's child entries are [node_offsets[i], node_offsets[i+1])
    csr_child_nodes: (E,) int32 child node of each entry (E = num_nodes - 1)
    csr_tokens:      (E,) int16 token leading to it
    planes:          the matcher planes, in `schemas.artifacts.MATCHER_PLANES` order
    depth_offsets:   (L+2,) int64; nodes of depth d are [depth_offsets[d], depth_offsets[d+1])
    leaf_ad_offsets: (S+1,) int64; leaf s (node depth_offsets[L] + s) holds ads
    leaf_ads:        (P,) int64 catalog rows, ascending within each leaf
    part_offsets:    (E+1,) int64 or None; entry e's k-way partitions are [part_offsets[e], part_offsets[e+1])
    ad_value:        (N,) float64 or None; each catalog row's value (docs/design.md §16), when the catalog has them
    entry_value:     (E,) float32 or None; the largest ad_value under entry e, rounded up
    part_value:      (T,) float32 or None; the largest ad value in each partition, falling within an entry
    entry_live:      (E,) uint8 or None; 1 when a live row lies beneath entry e (an update's, docs/design.md §15;
                     None: every row is live)
    """

    level_sizes: tuple[int, ...]
    node_offsets: HostOrDevice
    csr_child_nodes: HostOrDevice
    csr_tokens: HostOrDevice
    planes: tuple[MatcherPlane, ...]
    depth_offsets: HostOrDevice
    leaf_ad_offsets: HostOrDevice
    leaf_ads: HostOrDevice
    part_offsets: HostOrDevice | None = None
    ad_value: HostOrDevice | None = None
    entry_value: HostOrDevice | None = None
    part_value: HostOrDevice | None = None
    entry_live: HostOrDevice | None = None

    _TRIE = ("node_offsets", "csr_child_nodes", "csr_tokens", "depth_offsets", "leaf_ad_offsets", "leaf_ads",
             "part_offsets", "ad_value", "entry_value", "part_value", "entry_live")

    def arrays(self) -> dict[str, HostOrDevice]:
        """Every array by its snapshot name (`schemas.artifacts`)."""
        out = {n: getattr(self, n) for n in self._TRIE if getattr(self, n) is not None}
        for p in self.planes:
            out |= p.arrays()
        return out

    @classmethod
    def from_arrays(cls, level_sizes: tuple[int, ...], arrays: dict[str, Any], plane_names: tuple[str, ...]
                    ) -> GTMIndex:
        """The inverse of `arrays` (of numpy arrays or tensors alike)."""
        names = [plane_arrays(p) for p in plane_names]
        planes = tuple(MatcherPlane(n.plane, arrays[n.table], arrays[n.index], arrays.get(n.part_index)) for n in names)
        trie: dict[str, Any] = {n: arrays.get(n) for n in cls._TRIE}  # the optional arrays None when absent
        return cls(level_sizes=tuple(level_sizes), planes=planes, **trie)

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

    def leaf_sids(self, leaves: np.ndarray | None = None) -> np.ndarray:
        """(S', L) int16 the SID of each leaf in `leaves` (S',) int64 (default: all), walking parent
        links up: entry e leads to node e + 1, and its parent is the node whose entries hold e."""
        L = self.sid_length
        node = self.depth_offsets[L] + (np.arange(self.num_leaves) if leaves is None else np.asarray(leaves, np.int64))
        out = np.empty((len(node), L), dtype=np.int16)
        for d in range(L - 1, -1, -1):
            out[:, d] = self.csr_tokens[node - 1]
            node = np.searchsorted(self.node_offsets, node - 1, side="right") - 1
        return out


def expand_runs(first: np.ndarray, count: np.ndarray) -> np.ndarray:
    """(sum(count),) int64 the positions first[i], ..., first[i] + count[i] - 1 of every run i, run
    after run: a CSR's entries for a selection of its rows (first, count: (n,) int64)."""
    return np.repeat(first - (np.cumsum(count) - count), count) + np.arange(int(count.sum()))


def build_gtm(
    sids: np.ndarray,
    ad_index: np.ndarray,
    level_sizes: tuple[int, ...],
    ad_rows: dict[str, np.ndarray],
    *,
    kway: KWayConfig | None = None,
    matcher_bits: int | None = None,
    ad_value: np.ndarray | None = None,
) -> GTMIndex:
    """Build the GTM index.

    sids:         (P, L) int16 SID rows; token l in [0, level_sizes[l])
    ad_index:     (P,) int64 catalog row of each SID row's ad
    ad_rows:      per matcher plane, in plane order: (N, W_p) uint64 the ads' rows
    kway:         add k-way partitions (the union arrays are always built)
    matcher_bits: meaningful bits of all planes' rows together, for k-way fill rates (default: all words)
    ad_value:     (N,) float64 each ad's value (finite, >= 0): adds the value bounds, or None
    """
    from sidindex.sid.assign import key_tokens, run_starts, sid_keys  # building: a reader of an index needs none

    # --- 1. CHECK ARGUMENTS --- before any work, so a bad call fails fast and clearly
    check_arguments(sids, ad_index, level_sizes, ad_rows, ad_value)
    L = len(level_sizes)
    n_ads = len(next(iter(ad_rows.values())))

    # --- 2. SORT SID ROWS --- lexicographic order makes every prefix a contiguous run
    keys = sid_keys(sids, level_sizes)
    order, keys = _stable_sort(keys)
    leaf_start = run_starts(keys)  # (S,) first SID row of each distinct SID
    S = len(leaf_start)

    # --- 3. CSR, DEPTH BY DEPTH --- one pass over the distinct keys: a row opens a depth-d node
    # iff it differs from the previous row in one of its first d tokens
    leaf_keys = keys[leaf_start]
    del keys
    depth_offsets, node_offsets, tokens, first_row = _trie_layout(key_tokens(leaf_keys, level_sizes), kway is not None)
    num_nodes = int(depth_offsets[L + 1])
    del leaf_keys

    # --- 4. SID -> AD CSR --- the stable sort kept each leaf's ads in ascending (ad, path) order
    ads_sorted = ad_index[order]
    del order
    leaf_ad_offsets = np.append(leaf_start, len(sids)).astype(np.int64)
    del leaf_start

    # --- 5. SUBTREE UNIONS, DEDUPLICATED AS THEY ARE MADE --- a leaf ORs its ads' rows, a node its
    # children's unions; a leaf with one ad reuses that ad's row and a node with one child its
    # child's row, so only real unions are computed and hashed. One thread per matcher plane.
    own, capacity = _union_plan(ads_sorted, leaf_ad_offsets, node_offsets, depth_offsets, n_ads)
    tables = [RowTable(rows.shape[1], capacity) for rows in ad_rows.values()]
    with ThreadPoolExecutor(len(tables)) as pool:
        jobs = [pool.submit(_union_index, table, rows, own, ads_sorted, leaf_ad_offsets, node_offsets, depth_offsets)
                for table, rows in zip(tables, ad_rows.values())]
        index = [job.result() for job in jobs]

    # --- 6. VALUE BOUNDS (optional) --- a leaf's is its best ad's, a node's its best child's
    leaf_value = entry_value = None
    if ad_value is not None:
        leaf_value = np.maximum.reduceat(ad_value[ads_sorted], leaf_ad_offsets[:-1])
        exact_value = np.empty(num_nodes - 1, dtype=np.float64)
        exact_value[depth_offsets[L] - 1:] = leaf_value
        for d in range(L - 1, 0, -1):  # deepest first; the children of depth d are the entries of depth d+1
            lo, hi = depth_offsets[d], depth_offsets[d + 1]
            first = node_offsets[lo]
            exact_value[lo - 1:hi - 1] = np.maximum.reduceat(exact_value[first:node_offsets[hi]],
                                                             node_offsets[lo:hi] - first)
        entry_value = round_up_f32(exact_value)

    # --- 7. K-WAY PARTITIONS (optional) --- members of an internal entry are its subtree's leaves
    # (a contiguous leaf range), members of a leaf entry are its ads; a member's row is every
    # plane's words side by side, and partition rows join each plane's table. With values, each
    # partition keeps its best member's, and an entry's partitions run from the best down
    part_offsets, part_value = None, None
    part_index: list[np.ndarray | None] = [None] * len(tables)
    if kway is not None:
        widths = [rows.shape[1] for rows in ad_rows.values()]
        bits = matcher_bits or 64 * sum(widths)
        first_leaf = depth_offsets[L] - 1  # entries from here on are leaves
        depth_of_inner = np.repeat(np.arange(1, L), np.diff(depth_offsets[1:L + 1]))
        next_first = np.append(first_row[1:], S)
        next_first[depth_offsets[2:L + 1] - 2] = S  # each depth's last entry: its leaves run to the end
        k = np.array([kway.k_at(d) for d in range(L)], dtype=np.int64)
        dyn = kway.mode == "dynamic"
        leaf_rows = _side_by_side([t.rows[i[first_leaf:]] for t, i in zip(tables, index)])
        c_in, p_in, v_in = partition(leaf_rows, first_row, next_first, k[depth_of_inner - 1], dyn, kway.target_fill,
                                     bits, leaf_value)
        del leaf_rows
        ad_members = _side_by_side([rows[ads_sorted] for rows in ad_rows.values()])
        c_leaf, p_leaf, v_leaf = partition(ad_members, leaf_ad_offsets[:-1], leaf_ad_offsets[1:], np.full(S, k[L - 1]),
                                           dyn, kway.target_fill, bits,
                                           None if ad_value is None else ad_value[ads_sorted])
        del ad_members
        if ad_value is not None:
            part_value = round_up_f32(np.concatenate([v_in, v_leaf]))
        part_offsets = np.zeros(len(first_row) + S + 1, dtype=np.int64)
        np.cumsum(np.concatenate([c_in, c_leaf]), out=part_offsets[1:])
        lo = np.cumsum([0, *widths])
        part_index = [t.add(np.ascontiguousarray(np.concatenate([p_in[:, a:b], p_leaf[:, a:b]])))
                      for t, a, b in zip(tables, lo[:-1], lo[1:])]

    planes = tuple(MatcherPlane(name, t.table(), i, p)
                   for name, t, i, p in zip(ad_rows, tables, index, part_index))
    return GTMIndex(
        level_sizes=tuple(int(s) for s in level_sizes),
        node_offsets=node_offsets,
        csr_child_nodes=np.arange(1, num_nodes, dtype=np.int32),
        csr_tokens=tokens,
        planes=planes,
        depth_offsets=depth_offsets,
        leaf_ad_offsets=leaf_ad_offsets,
        leaf_ads=ads_sorted.astype(np.int64, copy=False),
        part_offsets=part_offsets,
        ad_value=None if ad_value is None else np.asarray(ad_value, dtype=np.float64),
        entry_value=entry_value,
        part_value=part_value,
    )


def check_arguments(sids: np.ndarray, ad_index: np.ndarray, level_sizes: tuple[int, ...],
                    ad_rows: dict[str, np.ndarray], ad_value: np.ndarray | None) -> None:
    """Refuse arguments `build_gtm` cannot build from (its docstring), with a ValueError saying why."""
    L = len(level_sizes)
    if sids.ndim != 2 or sids.shape[1] != L or len(sids) == 0:
        raise ValueError(f"sids must be a non-empty (P, {L}) array, got shape {sids.shape}")
    if ad_index.shape != (len(sids),):
        raise ValueError(f"ad_index must have shape ({len(sids)},), got {ad_index.shape}")
    if tuple(ad_rows) != MATCHER_PLANES:
        raise ValueError(f"ad_rows must hold the planes {MATCHER_PLANES} in that order, got {tuple(ad_rows)}")
    n_ads = len(next(iter(ad_rows.values())))
    if any(len(r) != n_ads for r in ad_rows.values()) or ad_index.min() < 0 or ad_index.max() >= n_ads:
        raise ValueError("ad_index must index rows of ad_rows, which must have one row per ad in every plane")
    for d, size in enumerate(level_sizes):
        if sids[:, d].min() < 0 or sids[:, d].max() >= size:
            raise ValueError(f"level {d} tokens must lie in [0, {size})")
    if ad_value is not None and (ad_value.shape != (n_ads,)
                                 or not np.all((ad_value >= 0) & (ad_value <= MAX_AD_VALUE))):
        raise ValueError(f"ad_value must hold one value in [0, {MAX_AD_VALUE:g}] per ad ({n_ads})")


def round_up_f32(x: np.ndarray) -> np.ndarray:
    """float64 -> the float32 >= each value (a bound stays a bound in float32)."""
    f = x.astype(np.float32)
    return np.where(f.astype(np.float64) < x, np.nextafter(f, np.float32(np.inf)), f)


def _side_by_side(parts: list[np.ndarray]) -> np.ndarray:
    """(n, sum W_p) uint64: the planes' rows (n, W_p) side by side (one row per k-way member)."""
    return parts[0] if len(parts) == 1 else np.concatenate(parts, axis=1)


def _stable_sort(keys: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(order, keys[order]) for keys (P,) int64 >= 0, ties in input order; `keys` is consumed.

    When key * P + row fits in int64, one in-place np.sort of those packed values replaces a stable
    argsort (several times faster on tens of millions of keys, and no extra arrays).
    """
    p = len(keys)
    if int(keys.max()) < (2**63 - 1) // max(p, 1) - 1:
        keys *= p
        keys += np.arange(p, dtype=np.int64)
        keys.sort()
        order = keys % p
        keys //= p
        return order, keys
    order = np.argsort(keys, kind="stable")
    return order, keys[order]


@numba.njit(cache=True)
def _trie_layout(sids: np.ndarray, with_first_row: bool) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """CSR arrays from sorted distinct SIDs (S, L) int16.

    Returns depth_offsets (L+2,) int64, node_offsets (num_nodes+1,) int64, tokens (E,) int16 and
    first_row (E_inner,) int64: the first leaf under each non-leaf entry (empty unless asked for).
    """
    S, L = sids.shape
    first_diff = np.zeros(S, dtype=np.int8)  # first level where row i differs from row i-1
    opened = np.zeros(L + 1, dtype=np.int64)  # nodes per depth
    opened[1:] = 1  # row 0 opens a node at every depth
    for i in range(1, S):
        fd = 0
        while fd < L - 1 and sids[i, fd] == sids[i - 1, fd]:
            fd += 1
        first_diff[i] = fd
        for d in range(fd + 1, L + 1):
            opened[d] += 1
    depth_offsets = np.zeros(L + 2, dtype=np.int64)
    depth_offsets[1] = 1
    for d in range(1, L + 1):
        depth_offsets[d + 1] = depth_offsets[d] + opened[d]
    num_nodes = depth_offsets[L + 1]
    tokens = np.empty(num_nodes - 1, dtype=np.int16)
    first_row = np.empty(depth_offsets[L] - 1 if with_first_row else 0, dtype=np.int64)
    node_offsets = np.zeros(num_nodes + 1, dtype=np.int64)  # child counts (node v at v + 1), then their prefix sums
    at = depth_offsets[:L + 1].copy()  # next node id per depth
    last = np.zeros(L + 1, dtype=np.int64)  # the current node per depth (the root at depth 0)
    for i in range(S):
        for d in range(first_diff[i] + 1, L + 1):
            node = at[d]
            at[d] += 1
            tokens[node - 1] = sids[i, d - 1]
            node_offsets[last[d - 1] + 1] += 1
            last[d] = node
            if with_first_row and d < L:
                first_row[node - 1] = i
    for v in range(1, num_nodes + 1):
        node_offsets[v] += node_offsets[v - 1]
    return depth_offsets, node_offsets, tokens, first_row


@numba.njit(cache=True)
def _union_plan(ads_sorted: np.ndarray, leaf_ad_offsets: np.ndarray, node_offsets: np.ndarray,
                depth_offsets: np.ndarray, n_ads: int) -> tuple[np.ndarray, int]:
    """What the union pass will insert: own (N,) bool, the ads that are a leaf's only ad (their rows
    go in as they are, in catalog order), and the most distinct rows it can produce: those ads,
    plus one per leaf with several ads and per inner node with several children."""
    own = np.zeros(n_ads, dtype=np.bool_)
    capacity = 0
    for s in range(len(leaf_ad_offsets) - 1):
        lo, hi = leaf_ad_offsets[s], leaf_ad_offsets[s + 1]
        if hi - lo == 1:
            capacity += not own[ads_sorted[lo]]
            own[ads_sorted[lo]] = True
        else:
            capacity += 1
    for v in range(1, depth_offsets[len(depth_offsets) - 2]):
        capacity += node_offsets[v + 1] - node_offsets[v] > 1
    return own, capacity


def _union_index(table: RowTable, rows: np.ndarray, own: np.ndarray, ads_sorted: np.ndarray,
                 leaf_ad_offsets: np.ndarray, node_offsets: np.ndarray, depth_offsets: np.ndarray) -> np.ndarray:
    """Insert the subtree unions of ad rows (N, W) into `table` (sized by `_union_plan`);
    returns (E,) int32 the table row of each entry's union (entry e = node e + 1)."""
    index, table.count = _fill_union_index(rows, own, ads_sorted, leaf_ad_offsets, node_offsets, depth_offsets,
                                           table.rows, table.slots, table.count)
    return index


@numba.njit(cache=True, nogil=True)
def _fill_union_index(ad_rows: np.ndarray, own: np.ndarray, ads_sorted: np.ndarray, leaf_ad_offsets: np.ndarray,
                      node_offsets: np.ndarray, depth_offsets: np.ndarray, rows: np.ndarray, slots: np.ndarray,
                      count: int) -> tuple[np.ndarray, int]:
    L = len(depth_offsets) - 2
    index = np.empty(depth_offsets[L + 1] - 1, dtype=np.int32)
    ad_row = np.empty(len(ad_rows), dtype=np.int32)  # table row of each owned ad's row
    for a in range(len(ad_rows)):  # catalog order: the ad rows are read sequentially
        if own[a]:
            ad_row[a], count = insert_row(ad_rows, a, rows, slots, count)
    w = ad_rows.shape[1]
    acc = np.empty((1, w), dtype=np.uint64)  # one scratch row (word loops: numba array ops would allocate)
    first_leaf = depth_offsets[L] - 1
    for s in range(len(leaf_ad_offsets) - 1):  # leaves: OR of their ads' rows
        lo, hi = leaf_ad_offsets[s], leaf_ad_offsets[s + 1]
        if hi - lo == 1:
            index[first_leaf + s] = ad_row[ads_sorted[lo]]
        else:
            acc[:] = 0
            for i in range(lo, hi):
                for j in range(w):
                    acc[0, j] |= ad_rows[ads_sorted[i], j]
            index[first_leaf + s], count = insert_row(acc, 0, rows, slots, count)
    for d in range(L - 1, 0, -1):  # inner nodes, deepest first: OR of their (contiguous) children's unions
        for v in range(depth_offsets[d], depth_offsets[d + 1]):
            lo, hi = node_offsets[v], node_offsets[v + 1]
            if hi - lo == 1:
                index[v - 1] = index[lo]
            else:
                acc[:] = 0
                for c in range(lo, hi):
                    for j in range(w):
                        acc[0, j] |= rows[index[c], j]
                index[v - 1], count = insert_row(acc, 0, rows, slots, count)
    return index, count
