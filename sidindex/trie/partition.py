"""Partitioned GTM build (docs/design.md §14): the subtries under disjoint ranges of first-level tokens
share nothing, so they are built apart (threads here, workers of a cluster) and combined into the
one layout `build_gtm` gives for the whole catalog, array for array.

Why combining is exact:
  nodes    are numbered depth by depth, and within a depth by SID prefix, so the whole trie's depth
           d is every part's depth d, part after part (parts hold increasing first tokens); entry
           arrays (one value per node but the root) are concatenated in that (depth, part) order.
  tables   number their rows by first insertion, and `build_gtm` inserts in a fixed order: ads
           that are a leaf's only ad (by catalog row), leaves with several ads, nodes with several
           children (deepest depth first), k-way partitions. Within a part that order is the whole
           build's order restricted to the part, so each part row's first insertion has a global
           key; the combined table re-inserts every part's distinct rows by key, which dedups
           across parts and numbers rows as the whole build would.
Legend: Q parts, P SID rows, L SID length, E child entries, R table rows, T k-way partitions.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np

from sidindex.trie.build import GTMIndex, MatcherPlane, build_gtm, check_arguments, expand_runs
from sidindex.trie.dedup import RowTable
from sidindex.trie.kway import KWayConfig

_PHASE = 40  # a table row's insertion key: phase << _PHASE | position (positions < 2**40)


@dataclass(frozen=True)
class Subtrie:
    """The GTM index of the SID rows under a range of first-level tokens, over its own ads.

    gtm: built by `build_gtm` with ad k = catalog row ads[k] (leaf_ads index `ads`)
    ads: (n,) int64 catalog rows of the part's ads, ascending
    """

    gtm: GTMIndex
    ads: np.ndarray


def default_workers() -> int:
    """The cores this process may run on."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def token_ranges(held: np.ndarray, parts: int) -> np.ndarray:
    """(Q+1,) int64 bounds of Q <= parts ranges of first-level tokens [b[q], b[q+1]) holding about
    equal numbers of SID rows, every range non-empty; held: (K_0,) int64 SID rows per first token."""
    cum = np.cumsum(held)
    vocab = len(held)
    cuts = np.searchsorted(cum, cum[-1] * np.arange(1, parts) / parts, side="right")
    bounds = np.unique(np.concatenate([[0], cuts, [vocab]]))
    # a range holding no row is dropped: the range before it reaches over it (tokens below the
    # first range hold no rows)
    starts = bounds[:-1][np.add.reduceat(held, bounds[:-1]) > 0]
    return np.append(starts, vocab).astype(np.int64)


def part_rows(first: np.ndarray, bounds: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(order (P,) int64, cuts (Q+1,) int64): rows order[cuts[q]:cuts[q+1]] are those whose first
    token first (P,) lies in [bounds[q], bounds[q+1]), in their original order (a stable radix
    sort on int16 part ids: each part keeps the catalog's (ad, path) order)."""
    part = (np.searchsorted(bounds, first, side="right") - 1).astype(np.int16)
    order = np.argsort(part, kind="stable")
    return order, np.searchsorted(part[order], np.arange(len(bounds)))


def ad_runs(ad_index: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(first (n,) int64, local (P,) int64) for a part's SID rows' ads ad_index (P,): the row where
    each distinct ad first appears (ascending ad) and each row's ad among them. Rows in the catalog's
    (ad, path) order make each ad a run, found without a sort."""
    if np.all(ad_index[1:] >= ad_index[:-1]):
        from sidindex.sid.assign import run_starts  # building: a reader of an index needs none

        first = run_starts(ad_index)
        return first, np.cumsum(np.concatenate([[False], ad_index[1:] != ad_index[:-1]]))
    _, first, local = np.unique(ad_index, return_index=True, return_inverse=True)
    return first, local


def build_subtrie(sids: np.ndarray, local: np.ndarray, ads: np.ndarray, ad_rows: dict[str, np.ndarray],
                  level_sizes: tuple[int, ...], *, kway: KWayConfig | None = None, matcher_bits: int | None = None,
                  ad_value: np.ndarray | None = None) -> Subtrie:
    """The subtrie of one part's SID rows.

    sids: (P_q, L) int16 and local: (P_q,) int64 the part's SID rows and their ads as indexes into
    ads: (n,) int64 the part's catalog rows, ascending (`ad_runs`); ad_rows: per plane (n, W_p)
    uint64 and ad_value (n,) float64 or None: those ads' rows and values
    """
    gtm = build_gtm(sids, local, level_sizes, ad_rows, kway=kway, matcher_bits=matcher_bits, ad_value=ad_value)
    return Subtrie(gtm, ads)


def build_gtm_partitioned(sids: np.ndarray, ad_index: np.ndarray, level_sizes: tuple[int, ...],
                          ad_rows: dict[str, np.ndarray], *, kway: KWayConfig | None = None,
                          matcher_bits: int | None = None, ad_value: np.ndarray | None = None,
                          workers: int | None = None, parts: int | None = None) -> GTMIndex:
    """`build_gtm`'s index (same arguments, same arrays) built as `parts` subtries by `workers`
    threads (default: every core; parts default 4 per worker, for balance). One worker and no
    parts asked for builds the whole trie at once: combining costs a pass over every table row."""
    check_arguments(sids, ad_index, level_sizes, ad_rows, ad_value)
    workers = workers or default_workers()
    if workers == 1 and parts is None:
        return build_gtm(sids, ad_index, level_sizes, ad_rows, kway=kway, matcher_bits=matcher_bits, ad_value=ad_value)
    bounds = token_ranges(np.bincount(sids[:, 0], minlength=level_sizes[0]), parts or 4 * workers)
    order, cuts = part_rows(sids[:, 0], bounds)

    def one(q: int) -> Subtrie:
        rows = order[cuts[q]:cuts[q + 1]]
        a = ad_index[rows]
        first, local = ad_runs(a)
        ads = a[first]
        return build_subtrie(sids[rows], local, ads, {k: v[ads] for k, v in ad_rows.items()}, level_sizes, kway=kway,
                             matcher_bits=matcher_bits, ad_value=None if ad_value is None else ad_value[ads])

    if workers == 1:
        subtries = [one(q) for q in range(len(bounds) - 1)]
    else:
        with ThreadPoolExecutor(workers) as pool:  # the build's numba passes and sorts release the GIL
            subtries = list(pool.map(one, range(len(bounds) - 1)))
    return combine(subtries, level_sizes, ad_value)


def combine(subtries: Iterable[Subtrie], level_sizes: tuple[int, ...], ad_value: np.ndarray | None = None
            ) -> GTMIndex:
    """The GTM index of the whole catalog from its parts' subtries, given in increasing token order
    (ranges disjoint); ad_value: (N,) float64 the catalog's values when the parts carry value bounds."""
    subs = list(subtries)
    L = len(level_sizes)
    g = [s.gtm for s in subs]

    # --- 1. NODE NUMBERS --- part q's depth-d nodes follow the parts before it at that depth
    counts, depth_offsets = joined_depths(g)
    num_nodes = int(depth_offsets[-1])

    def entries(get: Callable[[int, GTMIndex], np.ndarray]) -> np.ndarray:
        return in_entry_order(g, [get(q, t) for q, t in enumerate(g)])

    # --- 2. CSR --- child counts per node in the same order, the root's the sum of the parts' roots'
    node_offsets = joined_node_offsets(g, num_nodes)
    tokens = entries(lambda q, t: t.csr_tokens)

    # --- 3. SID -> AD --- leaves are the last depth: part after part
    leaf_ad_offsets = np.zeros(num_nodes - depth_offsets[L] + 1, dtype=np.int64)
    np.cumsum(np.concatenate([np.diff(t.leaf_ad_offsets) for t in g]), out=leaf_ad_offsets[1:])
    leaf_ads = np.concatenate([s.ads[s.gtm.leaf_ads] for s in subs])

    # --- 4. K-WAY PARTITIONS --- each entry's run of partitions moves with it; part_position:
    # per part, (T_q,) the whole trie's position of each of its partitions
    part_offsets = part_take = part_position = None
    if g[0].part_offsets is not None:
        part_offsets, part_take = joined_partitions(g, num_nodes)
        position = np.empty(len(part_take), dtype=np.int64)
        position[part_take] = np.arange(len(part_take))
        stacked = np.cumsum([0] + [int(_kway(t.part_offsets)[-1]) for t in g])  # partitions per part
        part_position = [position[a:b] for a, b in zip(stacked[:-1], stacked[1:])]

    # --- 5. MATCHER TABLES --- every part's distinct rows, re-inserted by their first insertion's key
    keys = _insertion_keys(subs, depth_offsets, counts, part_position)

    def plane(p: int) -> MatcherPlane:
        tables = [t.planes[p].table for t in g]
        k = np.concatenate([kq[p] for kq in keys])
        order = np.argsort(k, kind="stable")
        del k
        table = RowTable(tables[0].shape[1], len(order))
        global_row = np.empty(len(order), dtype=np.int32)
        global_row[order] = table.add(np.concatenate(tables)[order])
        row_base = np.cumsum([0] + [len(x) for x in tables])[:-1]
        index = entries(lambda q, t: global_row[row_base[q] + t.planes[p].index])
        part_index = None
        if part_take is not None:
            part_index = np.concatenate([global_row[b + _kway(t.planes[p].part_index)]
                                         for b, t in zip(row_base, g)])[part_take]
        return MatcherPlane(g[0].planes[p].name, table.table(), index, part_index)

    with ThreadPoolExecutor(len(g[0].planes)) as pool:  # one thread per plane, as `build_gtm`
        planes = list(pool.map(plane, range(len(g[0].planes))))

    # --- 6. VALUE BOUNDS ---
    entry_value = part_value = None
    if g[0].entry_value is not None:
        entry_value = entries(lambda q, t: _kway(t.entry_value))
        if part_take is not None:
            part_value = np.concatenate([_kway(t.part_value) for t in g])[part_take]
    return GTMIndex(
        level_sizes=tuple(int(s) for s in level_sizes), node_offsets=node_offsets,
        csr_child_nodes=np.arange(1, num_nodes, dtype=np.int32), csr_tokens=tokens, planes=tuple(planes),
        depth_offsets=depth_offsets, leaf_ad_offsets=leaf_ad_offsets, leaf_ads=leaf_ads, part_offsets=part_offsets,
        ad_value=None if ad_value is None else np.asarray(ad_value, dtype=np.float64), entry_value=entry_value,
        part_value=part_value)


# The layout of several tries joined into one (`combine`, and `sidindex.trie.shard.join_shards`):
# tries of increasing, disjoint ranges of first-level tokens; the join's depth d is every trie's
# depth d, trie after trie.

def joined_depths(tries: Sequence[GTMIndex]) -> tuple[np.ndarray, np.ndarray]:
    """(counts (Q, L) int64 nodes per depth of each trie, depth_offsets (L+2,) int64 of the join)."""
    counts = np.array([np.diff(t.depth_offsets)[1:] for t in tries], dtype=np.int64)
    depth_offsets = np.zeros(counts.shape[1] + 2, dtype=np.int64)
    depth_offsets[1] = 1
    depth_offsets[2:] = 1 + np.cumsum(counts.sum(axis=0))
    return counts, depth_offsets


def in_entry_order(tries: Sequence[GTMIndex], arrays: Sequence[np.ndarray]) -> np.ndarray:
    """A per-entry array of the join from each trie's arrays[q] (entry e = node e + 1)."""
    L = tries[0].sid_length
    return np.concatenate([np.asarray(a)[t.depth_offsets[d] - 1:t.depth_offsets[d + 1] - 1]
                           for d in range(1, L + 1) for a, t in zip(arrays, tries)])


def joined_node_offsets(tries: Sequence[GTMIndex], num_nodes: int) -> np.ndarray:
    """(num_nodes+1,) int64 the join's child offsets: the root's children are every trie's."""
    out = np.zeros(num_nodes + 1, dtype=np.int64)
    out[1] = sum(int(t.node_offsets[1]) for t in tries)
    out[2:] = out[1] + np.cumsum(in_entry_order(tries, [np.diff(t.node_offsets)[1:] for t in tries]))
    return out


def joined_partitions(tries: Sequence[GTMIndex], num_nodes: int) -> tuple[np.ndarray, np.ndarray]:
    """(part_offsets (num_nodes,) int64 of the join, take (T,) int64): each entry's run of k-way
    partitions moves with it, and take picks them, in the join's order, from the tries'
    partitions stacked trie after trie."""
    offsets = [_kway(t.part_offsets) for t in tries]
    stacked = np.cumsum([0] + [int(o[-1]) for o in offsets])
    counts = in_entry_order(tries, [np.diff(o) for o in offsets])
    part_offsets = np.zeros(num_nodes, dtype=np.int64)
    np.cumsum(counts, out=part_offsets[1:])
    return part_offsets, expand_runs(in_entry_order(tries, [o[:-1] + b for o, b in zip(offsets, stacked)]), counts)


def _kway(a: np.ndarray | None) -> np.ndarray:
    """An optional array of a part that has it: the parts of one build are all k-way or none is,
    and all have values or none has."""
    assert a is not None
    return a


def _insertion_keys(subs: list[Subtrie], depth_offsets: np.ndarray, counts: np.ndarray,
                    part_position: list[np.ndarray] | None) -> list[list[np.ndarray]]:
    """Per part, per plane: (R_q,) int64 the key of each table row's first insertion in the whole
    build's order (module docstring), from the entities that insert rows in `build_gtm`;
    part_position: per part, the whole trie's position of each k-way partition (None: no k-way)."""
    L = len(depth_offsets) - 2
    # global node id of each part's first node per depth
    start = depth_offsets[1:L + 1][None, :] + np.cumsum(counts, axis=0) - counts  # (Q, L)
    leaf_before = start[:, L - 1] - depth_offsets[L]
    out = []
    for q, s in enumerate(subs):
        t = s.gtm
        per_leaf = np.diff(t.leaf_ad_offsets)
        leaf_entry = np.arange(t.depth_offsets[L] - 1, t.depth_offsets[L + 1] - 1)
        single = per_leaf == 1
        # ads that are a leaf's only ad, in (local = catalog) order, each with one such leaf's entry
        entry_of_ad = np.full(len(s.ads), -1, dtype=np.int64)
        entry_of_ad[t.leaf_ads[t.leaf_ad_offsets[:-1][single]]] = leaf_entry[single]
        owned = np.flatnonzero(entry_of_ad >= 0)
        owners, positions, phases = [entry_of_ad[owned]], [s.ads[owned]], [0]
        owners.append(leaf_entry[~single])
        positions.append(leaf_before[q] + np.flatnonzero(~single))
        phases.append(1)
        several = np.flatnonzero(np.diff(t.node_offsets[:t.depth_offsets[L] + 1]) > 1)
        bounds = np.searchsorted(several, t.depth_offsets[:L + 1])
        for d in range(L - 1, 0, -1):  # nodes with several children, deepest depth first
            nodes = several[bounds[d]:bounds[d + 1]]
            owners.append(nodes - 1)
            positions.append(start[q, d - 1] + nodes - t.depth_offsets[d])
            phases.append(2 + L - 1 - d)
        entity = np.concatenate(owners)  # in key order
        key = np.concatenate([np.int64(ph) << _PHASE | pos.astype(np.int64) for ph, pos in zip(phases, positions)])
        part_key = None if part_position is None else np.int64(L + 1) << _PHASE | part_position[q]
        keys = []
        for plane in t.planes:
            k = np.full(len(plane.table), np.iinfo(np.int64).max, dtype=np.int64)
            # rows are numbered by first insertion, so a row's first use is where the running
            # maximum of the rows used grows
            rows = plane.index[entity]
            top = np.maximum.accumulate(rows)
            first = np.flatnonzero(np.diff(top, prepend=-1) > 0)
            k[rows[first]] = key[first]
            if part_key is not None:
                np.minimum.at(k, _kway(plane.part_index), part_key)
            keys.append(k)
        out.append(keys)
    return out

