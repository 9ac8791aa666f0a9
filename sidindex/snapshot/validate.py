"""Structural validation of an index read from disk (the relations of `schemas.artifacts`).

A kernel, a numba loop or a torch gather indexes with these values unchecked, so nothing reaches
them before this passes. No check does arithmetic on a value it has not bounded yet: monotonicity
compares neighbours (`a[1:] >= a[:-1]`), never `np.diff(a) >= 0`, which wraps around int64 for a
pair like (2**63 - 1, -2) and would let it through. Vectorised: a few passes over each array.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import polars as pl

from schemas.artifacts import AD_DELETED, AD_LIVE, AD_PAUSED, ARRAYS_BY_NAME, MANIFEST_FILE, MAX_AD_VALUE
from sidindex.errors import ArtifactError
from sidindex.matchers.exact import ExactIndex
from sidindex.trie.build import GTMIndex
from sidindex.trie.patch import live_entries


def _rising(a: np.ndarray, strict: bool = False) -> bool:
    return bool(np.all(a[1:] > a[:-1])) if strict else bool(np.all(a[1:] >= a[:-1]))


def _offsets(a: np.ndarray, end: int, strict: bool) -> bool:
    """Offsets of a CSR: start at 0, rise (strictly: no empty run), end at `end`."""
    return len(a) >= 1 and int(a[0]) == 0 and int(a[-1]) == end and _rising(a, strict)


def _in_range(a: np.ndarray, size: int) -> bool:
    return len(a) == 0 or (int(a.min()) >= 0 and int(a.max()) < size)


class _Need:
    """need(ok, name, what): raise ArtifactError naming array `name`'s file unless ok."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def __call__(self, ok: bool, name: str, what: str) -> None:
        if not ok:
            raise ArtifactError(f"{self.path / ARRAYS_BY_NAME[name].file}: {what}; the snapshot is corrupt")


# The arrays an update of ad states alone (pause, resume, delete) writes: a snapshot that changes
# nothing else beside a checked base is validated by their checks alone
STATE_ARRAYS = frozenset({"ad_state", "entry_live"})


def check_structure(path: Path, gtm: GTMIndex, exact: ExactIndex, ad_id: np.ndarray, counts: dict,
                    changed: set[str] | None = None, base_state: np.ndarray | None = None) -> None:
    """Raise ArtifactError naming the first array that breaks a relation.

    Depth ranges first (every other check indexes with them); then independent groups of checks in
    parallel threads (numpy releases the GIL, and a cold snapshot's pages fault in side by side);
    the first failing group, in the order below, is reported. `changed`: the arrays not already
    validated as they are (None: all); when they are only STATE_ARRAYS, only their checks run, and
    ad ids are checked again only if a row left the deleted state of `base_state` (N,) uint8, the
    checked snapshot's (None: all live): otherwise the rows not deleted are a subset of checked ones.
    """
    need = _Need(path)
    do, num_nodes = gtm.depth_offsets, len(gtm.node_offsets) - 1
    need(int(do[0]) == 0 and int(do[1]) == 1 and int(do[-1]) == num_nodes and _rising(do, strict=True),
         "depth_offsets", "depth ranges must start at the root, hold at least one node each and end at the node count")
    full = changed is None or not changed <= STATE_ARRAYS
    if full:
        groups = (_trie, _planes, _leaves, _partitions, _exact, _state, _ads)
    else:
        revived = base_state is None or exact.ad_state is None or bool(
            np.any((base_state == AD_DELETED) & (exact.ad_state != AD_DELETED)))
        groups = (_state, _ads) if revived else (_state,)

    def run(group) -> ArtifactError | None:
        try:
            group(need, gtm, exact, ad_id)
        except ArtifactError as e:
            return e
        return None

    with ThreadPoolExecutor(len(groups)) as pool:
        faults = list(pool.map(run, groups))
    fault = next((f for f in faults if f is not None), None)
    if fault is not None:
        raise fault
    if full:
        _values(need, gtm)  # indexes with the offsets checked above
    _live(need, gtm, exact)  # likewise (unchanged offsets were checked with the base)
    found = {"ads": len(ad_id), "sid_rows": len(gtm.leaf_ads), "sids": num_nodes - int(do[gtm.sid_length]),
             "nodes": num_nodes}
    if counts != found:
        raise ArtifactError(f"{path / MANIFEST_FILE}: counts {counts} disagree with the arrays {found}")


def _trie(need: _Need, gtm: GTMIndex, exact: ExactIndex, ad_id: np.ndarray) -> None:
    """Node offsets, child ids and tokens. After the offsets every one lies in [0, E], so the token
    checks may index with them."""
    L, do, no = gtm.sid_length, gtm.depth_offsets, gtm.node_offsets
    num_nodes, E = len(no) - 1, len(gtm.csr_tokens)
    need(_offsets(no, E, strict=False), "node_offsets", "child offsets must rise from 0 to the entry count")
    need(bool(np.all(no[do[:L + 1]] == do[1:L + 2] - 1)), "node_offsets", "children do not follow depth order")
    need(bool(np.array_equal(gtm.csr_child_nodes, np.arange(1, num_nodes, dtype=np.int32))), "csr_child_nodes",
         "child node ids must be 1..num_nodes-1 in entry order")
    depth = np.repeat(np.arange(L), np.diff(do[1:]))  # level of each entry's token
    tok = gtm.csr_tokens
    need(bool(np.all((tok >= 0) & (tok < np.asarray(gtm.level_sizes)[depth]))), "csr_tokens",
         "a token lies outside its level's vocabulary")
    first_child = np.zeros(E, dtype=bool)
    first_child[no[:-1][no[:-1] < E]] = True
    need(bool(np.all((tok[1:] > tok[:-1]) | first_child[1:])), "csr_tokens", "children of a node must be sorted "
         "and distinct")


def _planes(need: _Need, gtm: GTMIndex, exact: ExactIndex, ad_id: np.ndarray) -> None:
    """Every entry's matcher rows, per plane, inside their tables."""
    for p in gtm.planes:
        need(_in_range(p.index, len(p.table)), f"{p.name}_index", f"a row index lies outside [0, {len(p.table)})")


def _leaves(need: _Need, gtm: GTMIndex, exact: ExactIndex, ad_id: np.ndarray) -> None:
    """SIDs -> ads: every SID owns ads, rows inside the ad table, ascending and distinct per SID."""
    N, lo = len(ad_id), gtm.leaf_ad_offsets
    S = len(gtm.node_offsets) - 1 - int(gtm.depth_offsets[gtm.sid_length])
    need(len(lo) == S + 1 and _offsets(lo, len(gtm.leaf_ads), strict=True), "leaf_ad_offsets",
         "each SID must own at least one ad, offsets rising to the number of SID rows")
    need(_in_range(gtm.leaf_ads, N), "leaf_ads", f"an ad row lies outside [0, {N})")
    leaf_start = np.zeros(len(gtm.leaf_ads), dtype=bool)
    leaf_start[lo[:-1]] = True
    need(bool(np.all((gtm.leaf_ads[1:] > gtm.leaf_ads[:-1]) | leaf_start[1:])), "leaf_ads",
         "ads must be ascending and distinct within a SID")


def _partitions(need: _Need, gtm: GTMIndex, exact: ExactIndex, ad_id: np.ndarray) -> None:
    """k-way partitions: at least one per entry, rows inside their tables."""
    if gtm.part_offsets is None:
        return
    T = len(gtm.planes[0].part_index)
    need(_offsets(gtm.part_offsets, T, strict=True), "part_offsets",
         "each entry must have at least one partition, offsets rising to the partition count")
    for p in gtm.planes:
        need(_in_range(p.part_index, len(p.table)), f"part_{p.name}_index",
             f"a row index lies outside [0, {len(p.table)})")


def _exact(need: _Need, gtm: GTMIndex, exact: ExactIndex, ad_id: np.ndarray) -> None:
    """The exact index, per `values` plane: one rising run of hash offsets through every attribute,
    hashes sorted within each (attribute, ad) run (the exact filter binary-searches them)."""
    for p in exact.planes:
        if p.hash_offsets is None:
            continue
        offsets, hashes = f"exact_{p.name}_hash_offsets", f"exact_{p.name}_hashes"
        ho, h = p.hash_offsets.reshape(-1), p.hashes
        need(len(ho) == 0 and len(h) == 0 or _offsets(ho, len(h), strict=False), offsets,
             "hash offsets must rise through every attribute from 0 to the number of hashes")
        need(len(p.hash_offsets) < 2 or bool(np.all(p.hash_offsets[1:, 0] == p.hash_offsets[:-1, -1])), offsets,
             "each attribute's hashes must start where the previous attribute's end")
        run_start = np.zeros(len(h), dtype=bool)
        run_start[ho[ho < len(h)]] = True
        need(bool(np.all((h[1:] >= h[:-1]) | run_start[1:])), hashes, "an ad's hashes must be sorted within each "
             "attribute")


def _state(need: _Need, gtm: GTMIndex, exact: ExactIndex, ad_id: np.ndarray) -> None:
    """Row states, when an update wrote them: one known state per row."""
    if exact.ad_state is not None:
        need(bool(np.all(exact.ad_state <= AD_DELETED)), "ad_state",
             f"every row's state must be {AD_LIVE}, {AD_PAUSED} or {AD_DELETED}")


def _live(need: _Need, gtm: GTMIndex, exact: ExactIndex) -> None:
    """The entries with a live row beneath: exactly those the ad states say (the search skips the others)."""
    if gtm.entry_live is not None:
        need(bool(np.array_equal(gtm.entry_live, live_entries(gtm, exact.ad_state))), "entry_live",
             "must mark exactly the entries with a live row beneath them")


def _ads(need: _Need, gtm: GTMIndex, exact: ExactIndex, ad_id: np.ndarray) -> None:
    """Unique ad ids among rows not deleted: every output row names its ad by id."""
    ids = ad_id if exact.ad_state is None else ad_id[exact.ad_state != AD_DELETED]
    need(pl.Series(ids).n_unique() == len(ids), "ads", "ad_id values must be unique (among rows not deleted)")


def _values(need: _Need, gtm: GTMIndex) -> None:
    """Value bounds: values in [0, MAX_AD_VALUE]; a SID's bound at least its ads' values, a
    prefix's at least its children's; an entry's partitions falling from exactly the entry's bound
    (the kernel takes the first passing one, and the build makes the first the entry's best)."""
    if gtm.ad_value is None:
        return
    arrays = (("ad_value", gtm.ad_value), ("entry_value", gtm.entry_value), ("part_value", gtm.part_value))
    for name, v in arrays:
        need(v is None or bool(np.all((v >= 0) & (v <= np.float32(MAX_AD_VALUE)))), name,
             f"values must lie in [0, {MAX_AD_VALUE:g}]")
    ev, do, no, L = gtm.entry_value, gtm.depth_offsets, gtm.node_offsets, gtm.sid_length
    leaf_ad_max = np.maximum.reduceat(gtm.ad_value[gtm.leaf_ads], gtm.leaf_ad_offsets[:-1])
    need(bool(np.all(ev[do[L] - 1:].astype(np.float64) >= leaf_ad_max)), "entry_value",
         "a SID's bound is below the value of one of its ads")
    inner = np.arange(1, do[L])  # nodes with children
    if len(inner):
        parent_entry = np.repeat(inner - 1, np.diff(no[inner[0]:inner[-1] + 2]))
        need(bool(np.all(ev[parent_entry] >= ev[no[1]:])), "entry_value",
             "a prefix's bound is below one of its children's")
    if gtm.part_value is not None:
        pv, po = gtm.part_value, gtm.part_offsets
        first = np.zeros(len(pv), dtype=bool)
        first[po[:-1]] = True
        need(bool(np.all((pv[1:] <= pv[:-1]) | first[1:])) and bool(np.array_equal(pv[po[:-1]], ev)), "part_value",
             "an entry's partitions must fall in value from the entry's own bound")


def check_lineage(path: Path, lineage: dict | None, ad_state: np.ndarray | None) -> None:
    """An update's lineage counts the rows its ad states hold (what `inspect` reports)."""
    if lineage is None:
        return
    n = np.bincount(ad_state, minlength=AD_DELETED + 1)
    if (lineage["paused"], lineage["deleted"]) != (int(n[AD_PAUSED]), int(n[AD_DELETED])):
        raise ArtifactError(f"{path / MANIFEST_FILE}: lineage counts {lineage['paused']} paused and "
                            f"{lineage['deleted']} deleted rows, ad_state holds {n[AD_PAUSED]} and {n[AD_DELETED]}")
