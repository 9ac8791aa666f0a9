"""Structural validation of an index read from disk (the relations of `schemas.artifacts`).

A kernel, a numba loop or a torch gather indexes with these values unchecked, so nothing reaches
them before this passes. No check does arithmetic on a value it has not bounded yet: monotonicity
compares neighbours (`a[i + 1] >= a[i]`), never `np.diff(a) >= 0`, which wraps around int64 for a
pair like (2**63 - 1, -2) and would let it through; a run of an offsets array is read only once
those offsets are checked. Every pass over a large array is a numba loop on all cores counting the
items that break its relation, without temporaries (it runs at every open and bounds a swap: numpy's
whole-array expressions took about 0.15 s per million SIDs on one core, allocating as they went),
and releases the GIL: a GPU loader copies the arrays' bytes on other threads meanwhile.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numba
import numpy as np

from schemas.artifacts import AD_DELETED, AD_LIVE, AD_PAUSED, ARRAYS_BY_NAME, MANIFEST_FILE, MAX_AD_VALUE, plane_arrays
from sidindex.errors import ArtifactError
from sidindex.exact import ExactIndex
from sidindex.parallel import sized
from sidindex.snapshot.manifest import Counts, Lineage
from sidindex.trie.build import GTMIndex
from sidindex.trie.cover import uncovered
from sidindex.trie.patch import live_entries
from sidindex.trie.shard import Shard


@sized()
@numba.njit(parallel=True, cache=True, nogil=True)
def _falls(a: np.ndarray, strict: bool) -> int:
    """Neighbours a[i] > a[i + 1] (strict: also a[i] == a[i + 1])."""
    bad = 0
    for i in numba.prange(len(a) - 1):
        if a[i + 1] < a[i] or (strict and a[i + 1] == a[i]):
            bad += 1
    return bad


@sized()
@numba.njit(parallel=True, cache=True, nogil=True)
def _outside(a: np.ndarray, size: int) -> int:
    """Values outside [0, size)."""
    bad = 0
    for i in numba.prange(len(a)):
        if a[i] < 0 or a[i] >= size:
            bad += 1
    return bad


@sized()
@numba.njit(parallel=True, cache=True, nogil=True)
def _run_falls(x: np.ndarray, offsets: np.ndarray, strict: bool) -> int:
    """Neighbours falling (strict: not rising) within a run x[offsets[r]:offsets[r + 1]] (offsets
    checked: rising from 0 to at most len(x))."""
    bad = 0
    for r in numba.prange(len(offsets) - 1):
        for i in range(offsets[r] + 1, offsets[r + 1]):
            if x[i] < x[i - 1] or (strict and x[i] == x[i - 1]):
                bad += 1
    return bad


@sized()
@numba.njit(parallel=True, cache=True, nogil=True)
def _not_next(child: np.ndarray) -> int:
    """Entries e whose child is not node e + 1."""
    bad = 0
    for e in numba.prange(len(child)):
        if child[e] != e + 1:
            bad += 1
    return bad


@sized()
@numba.njit(parallel=True, cache=True, nogil=True)
def _out_of_bounds(v: np.ndarray, hi: float) -> int:
    """Values outside [0, hi]; NaN is outside."""
    bad = 0
    for i in numba.prange(len(v)):
        if not (v[i] >= 0 and v[i] <= hi):
            bad += 1
    return bad


@sized()
@numba.njit(parallel=True, cache=True, nogil=True)
def _child_bounds_above(ev: np.ndarray, no: np.ndarray, inner_end: int) -> int:
    """Child entries whose bound exceeds their parent's: node i (1 <= i < inner_end) is entry i - 1's child."""
    bad = 0
    for i in numba.prange(1, inner_end):
        for c in range(no[i], no[i + 1]):
            if ev[c] > ev[i - 1]:
                bad += 1
    return bad


@sized()
@numba.njit(parallel=True, cache=True, nogil=True)
def _bad_partitions(pv: np.ndarray, po: np.ndarray, ev: np.ndarray) -> int:
    """Entries whose partitions do not fall in value from exactly the entry's own bound (po checked:
    strictly rising, so every entry has a first partition)."""
    bad = 0
    for e in numba.prange(len(po) - 1):
        if pv[po[e]] != ev[e]:
            bad += 1
        for j in range(po[e] + 1, po[e + 1]):
            if pv[j] > pv[j - 1]:
                bad += 1
    return bad


def _rising(a: np.ndarray, strict: bool = False) -> bool:
    return _falls(a, strict) == 0


def _offsets(a: np.ndarray, end: int, strict: bool) -> bool:
    """Offsets of a CSR: start at 0, rise (strictly: no empty run), end at `end`."""
    return len(a) >= 1 and int(a[0]) == 0 and int(a[-1]) == end and _rising(a, strict)


def _in_range(a: np.ndarray, size: int) -> bool:
    return _outside(a, size) == 0


class _Need:
    """need(ok, name, what): raise ArtifactError naming array `name`'s file unless ok."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def __call__(self, ok: bool, name: str, what: str) -> None:
        if not ok:
            raise ArtifactError(f"{self.path / ARRAYS_BY_NAME[name].file}: {what}; the snapshot is corrupt")


@dataclass(frozen=True)
class Changed:
    """What a snapshot opened beside a checked base (an update of it) holds anew: the global arrays
    and, per shard, the arrays that are not the base's own (checked as they are)."""

    globals: frozenset[str]
    shards: tuple[frozenset[str], ...]


def check_structure(directory: Path, shards: Sequence[tuple[Path, Shard]], exact: ExactIndex, ad_id: np.ndarray,
                    counts: Counts, changed: Changed | None = None, base_state: np.ndarray | None = None) -> None:
    """Raise ArtifactError naming the first array that breaks a relation: the global arrays, then
    each shard's trie (`check_shard`; shards: each with the directory of its files), then the
    manifest's counts. `changed`: what is new beside a checked base (None: all); an array that is
    the base's is not checked again, but every relation that reads a new one is. base_state: (N,)
    uint8 the base's row states (None: all live): ad ids are checked again when a row leaves the
    deleted state, else the rows not deleted are a subset of checked ones.
    """
    check_globals(directory, exact, ad_id, changed, base_state)
    value_changed = changed is None or "ad_value" in changed.globals
    for k, (where, shard) in enumerate(shards):
        new = None if changed is None else changed.shards[k] | ({"ad_value"} if value_changed else set())
        check_shard(where, shard, exact, len(ad_id), new)
    check_counts(directory, counts, Counts.of([s.gtm for _, s in shards], ad_id))


def check_counts(directory: Path, declared: Counts, found: Counts) -> None:
    """Refuse a manifest whose counts are not those `found` in the arrays."""
    if declared != found:
        raise ArtifactError(f"{directory / MANIFEST_FILE}: counts {declared.to_dict()} disagree with the arrays "
                            f"{found.to_dict()}")


def check_globals(directory: Path, exact: ExactIndex, ad_id: np.ndarray, changed: Changed | None = None,
                  base_state: np.ndarray | None = None) -> None:
    """`check_structure`'s checks of the global arrays (the exact index, the states, the ad ids)."""
    need = _Need(directory)
    if changed is None or changed.globals - {"ad_state"}:
        groups: tuple[Callable[[_Need, ExactIndex, np.ndarray], None], ...] = (_exact, _state, _ads)
    else:  # the states alone may be new, or gone (a snapshot without them has every row live)
        revived = base_state is None or bool(np.any((base_state == AD_DELETED)
                                                    & (exact.states(len(ad_id)) != AD_DELETED)))
        groups = (_state, _ads) if revived else (_state,)
    for group in groups:
        group(need, exact, ad_id)


def check_shard(path: Path, shard: Shard, exact: ExactIndex, n_ads: int,
                changed: set[str] | frozenset[str] | None = None) -> None:
    """Raise ArtifactError naming the first of the shard's arrays (files in `path`) that breaks a
    relation of its trie over a catalog of n_ads rows: depth ranges first (every other check
    indexes with them), then groups of checks, each pass parallel inside (a cold snapshot's pages
    fault in side by side). `changed`:
    its arrays not already validated as they are, "ad_value" among them when the catalog's values
    are new (None: all); ad_state is always read (`_live`)."""
    need, gtm = _Need(path), shard.gtm
    if changed is None or changed - {"entry_live", "ad_value"}:
        do, num_nodes = gtm.depth_offsets, len(gtm.node_offsets) - 1
        need(int(do[0]) == 0 and int(do[1]) == 1 and int(do[-1]) == num_nodes and _rising(do, strict=True),
             "depth_offsets", "depth ranges must start at the root, hold at least one node each and end at the node "
             "count")
        for group in (_trie, _planes, _leaves, _partitions):
            group(need, gtm, n_ads)
        _values(need, gtm)  # indexes with the offsets checked above
    elif "ad_value" in changed:
        _values(need, gtm)
    # its range, which a manifest may give a checked shard anew (the root's tokens rise: checked by _trie)
    root = gtm.csr_tokens[:int(gtm.node_offsets[1])]
    need(int(root[0]) >= shard.lo and int(root[-1]) < shard.hi, "csr_tokens",
         f"the shard's first-level tokens must lie in its range [{shard.lo}, {shard.hi})")
    _live(need, gtm, exact)  # likewise (unchanged offsets were checked with the base)


def _trie(need: _Need, gtm: GTMIndex, n_ads: int) -> None:
    """Node offsets, child ids and tokens. After the offsets every one lies in [0, E], so the token
    checks may index with them."""
    L, do, no = gtm.sid_length, gtm.depth_offsets, gtm.node_offsets
    num_nodes, E = len(no) - 1, len(gtm.csr_tokens)
    need(_offsets(no, E, strict=False), "node_offsets", "child offsets must rise from 0 to the entry count")
    need(bool(np.all(no[do[:L + 1]] == do[1:L + 2] - 1)), "node_offsets", "children do not follow depth order")
    need(len(gtm.csr_child_nodes) == num_nodes - 1 and _not_next(gtm.csr_child_nodes) == 0, "csr_child_nodes",
         "child node ids must be 1..num_nodes-1 in entry order")
    tok = gtm.csr_tokens  # entry e leads to node e + 1: the entries of depth d's children are one slice
    need(all(_in_range(tok[do[d + 1] - 1:do[d + 2] - 1], size) for d, size in enumerate(gtm.level_sizes)),
         "csr_tokens", "a token lies outside its level's vocabulary")
    need(_run_falls(tok, no, True) == 0, "csr_tokens", "children of a node must be sorted and distinct")


def _planes(need: _Need, gtm: GTMIndex, n_ads: int) -> None:
    """Every entry's matcher rows, per plane, inside their tables."""
    for p in gtm.planes:
        need(_in_range(p.index, len(p.table)), plane_arrays(p.name).index,
             f"a row index lies outside [0, {len(p.table)})")


def _leaves(need: _Need, gtm: GTMIndex, n_ads: int) -> None:
    """SIDs -> ads: every SID owns ads, rows inside the ad table, ascending and distinct per SID."""
    N, lo = n_ads, gtm.leaf_ad_offsets
    S = len(gtm.node_offsets) - 1 - int(gtm.depth_offsets[gtm.sid_length])
    need(len(lo) == S + 1 and _offsets(lo, len(gtm.leaf_ads), strict=True), "leaf_ad_offsets",
         "each SID must own at least one ad, offsets rising to the number of SID rows")
    need(_in_range(gtm.leaf_ads, N), "leaf_ads", f"an ad row lies outside [0, {N})")
    need(_run_falls(gtm.leaf_ads, lo, True) == 0, "leaf_ads", "ads must be ascending and distinct within a SID")


def _partitions(need: _Need, gtm: GTMIndex, n_ads: int) -> None:
    """k-way partitions: at least one per entry, rows inside their tables."""
    if gtm.part_offsets is None:
        return
    first = gtm.planes[0].part_index
    assert first is not None  # read with part_offsets (the kway group), as every plane's
    T = len(first)
    need(_offsets(gtm.part_offsets, T, strict=True), "part_offsets",
         "each entry must have at least one partition, offsets rising to the partition count")
    for p in gtm.planes:
        assert p.part_index is not None
        need(_in_range(p.part_index, len(p.table)), plane_arrays(p.name).part_index,
             f"a row index lies outside [0, {len(p.table)})")


def _exact(need: _Need, exact: ExactIndex, ad_id: np.ndarray) -> None:
    """The exact index, per `values` plane: one rising run of hash offsets through every attribute,
    hashes sorted within each (attribute, ad) run (the exact filter binary-searches them)."""
    for p in exact.planes:
        if p.hash_offsets is None:
            continue
        names = plane_arrays(p.name)
        offsets, hashes = names.exact_hash_offsets, names.exact_hashes
        ho, h = p.hash_offsets.reshape(-1), p.hashes
        assert h is not None  # hashes come with their offsets
        need(len(ho) == 0 and len(h) == 0 or _offsets(ho, len(h), strict=False), offsets,
             "hash offsets must rise through every attribute from 0 to the number of hashes")
        need(len(p.hash_offsets) < 2 or bool(np.all(p.hash_offsets[1:, 0] == p.hash_offsets[:-1, -1])), offsets,
             "each attribute's hashes must start where the previous attribute's end")
        need(_run_falls(h, ho, False) == 0, hashes, "an ad's hashes must be sorted within each attribute")


def _state(need: _Need, exact: ExactIndex, ad_id: np.ndarray) -> None:
    """Row states, when an update wrote them: one known state per row."""
    if exact.ad_state is not None:
        need(bool(np.all(exact.ad_state <= AD_DELETED)), "ad_state",
             f"every row's state must be {AD_LIVE}, {AD_PAUSED} or {AD_DELETED}")


def _live(need: _Need, gtm: GTMIndex, exact: ExactIndex) -> None:
    """The entries with a live row beneath: exactly those the ad states say (the search skips the others)."""
    if gtm.entry_live is not None:
        assert exact.ad_state is not None  # both an update's (the updated group)
        need(bool(np.array_equal(gtm.entry_live, live_entries(gtm, exact.ad_state))), "entry_live",
             "must mark exactly the entries with a live row beneath them")


def _ads(need: _Need, exact: ExactIndex, ad_id: np.ndarray) -> None:
    """Unique ad ids among rows not deleted: every output row names its ad by id."""
    import polars as pl  # its hash-based count outruns a sort; a structure check is rare on a serving host

    ids = ad_id if exact.ad_state is None else ad_id[exact.ad_state != AD_DELETED]
    need(pl.Series(ids).n_unique() == len(ids), "ads", "ad_id values must be unique (among rows not deleted)")


def _values(need: _Need, gtm: GTMIndex) -> None:
    """Value bounds: values in [0, MAX_AD_VALUE]; a prefix's bound at least its children's; an
    entry's partitions falling from exactly the entry's bound (the kernel takes the first passing
    one, and the build makes the first the entry's best). That a SID's bound holds its ads' values
    is part of the cover (`check_cover`): a gather over the catalog's values that bounded a swap,
    and nothing indexes memory by it."""
    if gtm.ad_value is None:
        return
    arrays = (("ad_value", gtm.ad_value), ("entry_value", gtm.entry_value), ("part_value", gtm.part_value))
    for name, v in arrays:  # the float32 bound, as the index keeps it
        need(v is None or _out_of_bounds(v, float(np.float32(MAX_AD_VALUE))) == 0, name,
             f"values must lie in [0, {MAX_AD_VALUE:g}]")
    ev, do, no, L = gtm.entry_value, gtm.depth_offsets, gtm.node_offsets, gtm.sid_length
    assert ev is not None  # read with ad_value (the value group)
    need(_child_bounds_above(ev, no, int(do[L])) == 0, "entry_value",  # nodes 1 .. do[L]-1 have children
         "a prefix's bound is below one of its children's")
    if gtm.part_value is not None:
        assert gtm.part_offsets is not None  # (the kway+value group)
        need(_bad_partitions(gtm.part_value, gtm.part_offsets, ev) == 0, "part_value",
             "an entry's partitions must fall in value from the entry's own bound")


def check_cover(path: Path, gtm: GTMIndex, exact: ExactIndex, since: tuple[GTMIndex, ExactIndex] | None = None
                ) -> None:
    """Raise ArtifactError naming the first matcher table whose rows do not cover what lies beneath
    them, or the value bounds when a SID's is below one of its ads' values (`sidindex.trie.cover`);
    the structure must have passed `check_structure`. since: a base whose cover passed, whose kept
    relations are not checked again (`sidindex.trie.cover.uncovered`)."""
    need = _Need(path)
    for name, what in uncovered(gtm, exact, since):
        need(False, name, f"{what} (its digests may have been written over the damage)")


def check_lineage(path: Path, lineage: Lineage | None, exact: ExactIndex) -> None:
    """An update's lineage counts the rows its ad states hold (what `inspect` reports)."""
    if lineage is None:
        return
    assert exact.ad_state is not None  # the manifest's reader refuses a lineage without ad_state
    paused, deleted = exact.paused_and_deleted()
    if (lineage.paused, lineage.deleted) != (paused, deleted):
        raise ArtifactError(f"{path / MANIFEST_FILE}: lineage counts {lineage.paused} paused and "
                            f"{lineage.deleted} deleted rows, ad_state holds {paused} and {deleted}")
