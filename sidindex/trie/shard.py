"""Shards of a GTM index (docs/design.md §18): the tries of the SIDs under disjoint, contiguous ranges
of first-level tokens, each a `GTMIndex` of its own over catalog rows. A snapshot stores, verifies,
updates and loads them one by one; the runtime searches their join, the one trie of the catalog.

Why joining is a concatenation: nodes are numbered depth by depth and, within a depth, by SID
prefix, so the whole trie's depth d is every shard's depth d, shard after shard (shards hold rising
first tokens); per-entry arrays follow in that (depth, shard) order, and a shard's matcher rows
follow the rows of the shards before it. Tables are deduplicated within a shard only, so the join's
tables may repeat a row another shard holds; every entry's row is the same, so retrieval is the
same as from the one trie `build_gtm` makes of the whole catalog (`sidindex.trie.partition.combine`
is that trie, array for array).

Legend: K shards, L SID length, E child entries, T k-way partitions, V first-level vocabulary.
"""

from __future__ import annotations

import dataclasses
import functools
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import numpy as np

from schemas.artifacts import MAX_SHARDS, plane_arrays
from sidindex.trie.build import GTMIndex, check_arguments
from sidindex.trie.kway import KWayConfig
from sidindex.trie.partition import (
    Subtrie,
    build_gtm_partitioned,
    default_workers,
    in_entry_order,
    joined_depths,
    joined_node_offsets,
    joined_partitions,
    part_rows,
    token_ranges,
)

# The default shard size. A serving host searches the shards' join, which costs a copy of the trie
# when there are several (about 1 s per 4M SIDs on 2 cores, page faults included), and each shard
# repeats the rows its ads share with other shards; a random update touches every shard anyway.
# So a catalog one GPU serves is one shard by default, and shards are for what outgrows it.
SID_ROWS_PER_SHARD = 1 << 25
JOIN_THREADS = min(8, default_workers())  # the join's arrays are made side by side


@dataclass(frozen=True)
class Shard:
    """The trie of the SIDs whose first token lies in [lo, hi).

    gtm: its `GTMIndex` (node 0 its own root); leaf_ads are catalog rows and ad_value (when the index
         has values) the whole catalog's, one array every shard shares
    """

    lo: int
    hi: int
    gtm: GTMIndex

    @property
    def sid_rows(self) -> int:
        return len(self.gtm.leaf_ads)


def default_shards(sid_rows: int, vocab: int) -> int:
    """The shard count of a build of `sid_rows` SID rows: one per SID_ROWS_PER_SHARD, at most one
    per first-level token."""
    return int(min(max(1, -(-sid_rows // SID_ROWS_PER_SHARD)), vocab, MAX_SHARDS))


def shard_bounds(held: np.ndarray, shards: int) -> np.ndarray:
    """(K+1,) int64 bounds of K <= shards ranges [b[k], b[k+1]) of first-level tokens that cover
    [0, V) and hold about equal numbers of SID rows, each some; held: (V,) int64 SID rows per token."""
    bounds = token_ranges(held, shards)
    bounds[0] = 0  # tokens below the first that holds rows belong to the first shard
    return bounds


def part_bounds(held: np.ndarray, bounds: np.ndarray, parts: int) -> tuple[np.ndarray, np.ndarray]:
    """(cuts (Q+1,) int64, first (K+1,) int64): about `parts` ranges of first-level tokens
    [cuts[q], cuts[q+1]) of about equal SID rows, none across a shard's bound, shard k's being
    ranges first[k]..first[k+1]-1; held: (V,) int64 SID rows per token, bounds: (K+1,) the shards'
    (`shard_bounds`). A shard built as several parts is their `combine`, the arrays one part gives."""
    total = int(held.sum())
    cuts, first = [], [0]
    for lo, hi in zip(bounds[:-1], bounds[1:]):
        mine = held[lo:hi]
        n = max(1, round(parts * int(mine.sum()) / total))
        b = token_ranges(mine, n) + lo
        cuts += [int(lo), *b[1:-1].tolist()]  # the shard's own lower bound first: its ranges cover it
        first.append(len(cuts))
    return np.array([*cuts, int(bounds[-1])], dtype=np.int64), np.array(first, dtype=np.int64)


def shard_of(sub: Subtrie, lo: int, hi: int, ad_value: np.ndarray | None) -> Shard:
    """A part's subtrie (over its own ads) as the shard [lo, hi) over catalog rows; ad_value: (N,)
    float64 the catalog's values, or None."""
    gtm = dataclasses.replace(sub.gtm, leaf_ads=np.asarray(sub.ads)[sub.gtm.leaf_ads], ad_value=ad_value)
    return Shard(lo, hi, gtm)


# What each array of the join is made of, per shard: the join reuses an earlier join's array when
# every shard's inputs to it are the earlier shards' own (an update that changed other arrays)
def _inputs(name: str, g: GTMIndex) -> tuple[object, ...]:
    for p in g.planes:
        names = plane_arrays(p.name)
        if name == names.table:
            return (p.table,)
        if name == names.index:
            return (p.index, p.table, g.depth_offsets)
        if name == names.part_index:
            return (p.part_index, p.table, g.part_offsets, g.depth_offsets)
    if name in ("node_offsets", "csr_child_nodes", "depth_offsets"):
        return (g.node_offsets, g.depth_offsets)
    if name in ("part_offsets", "part_value"):
        return (getattr(g, name), g.part_offsets, g.depth_offsets)
    return (getattr(g, name), g.depth_offsets)


def join_shards(shards: Sequence[Shard], earlier: tuple[Sequence[Shard], GTMIndex] | None = None) -> GTMIndex:
    """The whole trie of `shards` (in token order, the ranges covering [0, V)): one shard's is its
    own index; several are joined (module docstring). earlier: shards joined before, and their
    join: an array whose every input is the same object as there is taken from that join, so an
    update that changed a few arrays costs only those (and a loader keeps the rest's device copies)."""
    g = [s.gtm for s in shards]
    if len(g) == 1:
        return g[0]
    first = g[0]
    reuse: Callable[[str], object | None] = lambda name: None  # noqa: E731
    if earlier is not None and len(earlier[0]) == len(shards):
        theirs = [s.gtm for s in earlier[0]]
        joined = earlier[1].arrays()

        def reuse(name: str) -> object | None:
            same = all(a is b or a is None and b is None for x, y in zip(g, theirs)
                       for a, b in zip(_inputs(name, x), _inputs(name, y)))
            return joined.get(name) if same else None

    _, depth_offsets = joined_depths(g)
    num_nodes = int(depth_offsets[-1])
    entries = functools.partial(in_entry_order, g)
    kway = first.part_offsets is not None
    lock = threading.Lock()

    @functools.cache
    def partitions_joined() -> tuple[np.ndarray, np.ndarray]:
        return joined_partitions(g, num_nodes)

    def partitions(make: Callable[[np.ndarray], np.ndarray]) -> Callable[[], np.ndarray]:
        """`make` of the join's partition order (`joined_partitions`: (T,) the shards' partitions
        stacked shard after shard, in the join's order), made once by whichever thread needs it first."""
        def run() -> np.ndarray:
            with lock:
                _, take = partitions_joined()
            return make(take)
        return run

    # each array the join makes, by name (the arrays are independent: made by a pool of threads,
    # whose copies and first touches of new memory run side by side)
    make: dict[str, Callable[[], np.ndarray]] = {
        "node_offsets": lambda: joined_node_offsets(g, num_nodes),
        "csr_child_nodes": lambda: np.arange(1, num_nodes, dtype=np.int32),
        "csr_tokens": lambda: entries([t.csr_tokens for t in g]), "depth_offsets": lambda: depth_offsets,
        "leaf_ad_offsets": lambda: np.concatenate([[0], np.cumsum(np.concatenate(
            [np.diff(t.leaf_ad_offsets) for t in g]))]).astype(np.int64),
        "leaf_ads": lambda: np.concatenate([t.leaf_ads for t in g])}
    for name in ("entry_value", "entry_live"):
        if getattr(first, name) is not None:
            make[name] = functools.partial(lambda name: entries([getattr(t, name) for t in g]), name)
    if kway:
        make["part_offsets"] = partitions(lambda take: partitions_joined()[0])
        if first.part_value is not None:
            make["part_value"] = partitions(lambda take: np.concatenate([np.asarray(t.part_value) for t in g])[take])
    for p, plane in enumerate(first.planes):
        names = plane_arrays(plane.name)
        base = np.cumsum([0] + [len(t.planes[p].table) for t in g])[:-1]
        make[names.table] = functools.partial(lambda p: np.concatenate([t.planes[p].table for t in g]), p)
        make[names.index] = functools.partial(lambda p, base: entries(
            [np.asarray(t.planes[p].index) + np.int32(b) for t, b in zip(g, base)]).astype(np.int32), p, base)
        if kway:
            make[names.part_index] = partitions(functools.partial(lambda p, base, take: np.concatenate(
                [np.asarray(t.planes[p].part_index) + np.int32(b) for t, b in zip(g, base)])[take]
                .astype(np.int32), p, base))
    out: dict[str, Any] = {}
    todo = {}
    for name, f in make.items():
        kept = reuse(name)
        if kept is None:
            todo[name] = f
        else:
            out[name] = kept
    with ThreadPoolExecutor(max(1, min(JOIN_THREADS, len(todo)))) as pool:
        out |= dict(zip(todo, pool.map(lambda f: f(), todo.values())))
    return GTMIndex.from_arrays(first.level_sizes, out | _value(first), tuple(p.name for p in first.planes))


def _value(g: GTMIndex) -> dict[str, np.ndarray]:
    return {} if g.ad_value is None else {"ad_value": g.ad_value}


def build_shards(sids: np.ndarray, ad_index: np.ndarray, level_sizes: tuple[int, ...], ad_rows: dict[str, np.ndarray],
                 *, shards: int | None = None, kway: KWayConfig | None = None, matcher_bits: int | None = None,
                 ad_value: np.ndarray | None = None, workers: int | None = None) -> tuple[Shard, ...]:
    """The shards of `build_gtm`'s index (same arguments): `shards` of them (default
    `default_shards`) by first-token ranges of about equal SID rows, built by `workers` threads
    (default 1), a shard at a time or, with more threads than shards, each as parts combined.
    A shard's arrays depend on the catalog and the shard count alone (`build_gtm` of its rows)."""
    check_arguments(sids, ad_index, level_sizes, ad_rows, ad_value)
    workers = workers or 1
    held = np.bincount(sids[:, 0], minlength=level_sizes[0])
    bounds = shard_bounds(held, shards or default_shards(len(sids), level_sizes[0]))
    order, cuts = part_rows(sids[:, 0], bounds)
    K = len(bounds) - 1
    inner = max(1, workers // K)  # threads per shard

    def one(k: int) -> Shard:
        rows = order[cuts[k]:cuts[k + 1]]
        gtm = build_gtm_partitioned(sids[rows], ad_index[rows], level_sizes, ad_rows, kway=kway,
                                    matcher_bits=matcher_bits, ad_value=ad_value, workers=inner)
        return Shard(int(bounds[k]), int(bounds[k + 1]), gtm)

    if workers == 1 or K == 1:
        return tuple(one(k) for k in range(K))
    with ThreadPoolExecutor(min(workers, K)) as pool:  # the build's numba passes and sorts release the GIL
        return tuple(pool.map(one, range(K)))
