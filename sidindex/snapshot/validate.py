"""Structural validation of an index read from disk: every offset monotone and in range, every
row index inside its table, the CSR shaped as `GTMIndex` documents. A kernel or a numba loop
indexes with these values unchecked, so nothing reaches them before this passes. Vectorised:
a few passes over each array."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from sidindex.errors import ArtifactError
from sidindex.matchers.exact import ExactIndex
from sidindex.trie.build import GTMIndex


def check_structure(path: Path, gtm: GTMIndex, exact: ExactIndex, n_ads: int) -> None:
    """Raise ArtifactError naming the first array that breaks the index's invariants."""
    def need(ok: bool, name: str, what: str) -> None:
        if not ok:
            raise ArtifactError(f"{path / (name + '.bin')}: {what}; the snapshot is corrupt")

    L = gtm.sid_length
    do, no = gtm.depth_offsets, gtm.node_offsets
    num_nodes, E = len(no) - 1, len(gtm.csr_tokens)
    need(do[0] == 0 and do[1] == 1 and bool(np.all(np.diff(do) >= 1)) and do[-1] == num_nodes, "depth_offsets",
         "depth ranges must start at the root, hold at least one node each and end at the node count")
    need(no[0] == 0 and bool(np.all(np.diff(no) >= 0)) and no[-1] == E, "node_offsets",
         "child offsets must rise from 0 to the entry count")
    # children of depth-d nodes are exactly the depth-(d+1) nodes; leaves have none
    need(bool(np.all(no[do[:L + 1]] == do[1:L + 2] - 1)), "node_offsets", "children do not follow depth order")
    need(bool(np.array_equal(gtm.csr_child_nodes, np.arange(1, num_nodes, dtype=np.int32))), "csr_child_nodes",
         "child node ids must be 1..num_nodes-1 in entry order")
    depth = np.repeat(np.arange(L), np.diff(do[1:]))  # level of each entry's token
    tok = gtm.csr_tokens
    need(bool(np.all((tok >= 0) & (tok < np.asarray(gtm.level_sizes)[depth]))), "csr_tokens",
         "a token lies outside its level's vocabulary")
    parent_start = np.zeros(E, dtype=bool)
    parent_start[no[:-1][no[:-1] < E]] = True
    need(bool(np.all((tok[1:] > tok[:-1]) | parent_start[1:])), "csr_tokens", "children of a node must be sorted and distinct")
    _in_range(need, "bitmask_index", gtm.bitmask_index, len(gtm.bitmask_table))
    _in_range(need, "bloom_index", gtm.bloom_index, len(gtm.bloom_table))
    S = int(do[L + 1] - do[L])
    lo = gtm.leaf_ad_offsets
    need(len(lo) == S + 1 and lo[0] == 0 and bool(np.all(np.diff(lo) >= 1)) and lo[-1] == len(gtm.leaf_ads),
         "leaf_ad_offsets", "each SID must own at least one ad, offsets rising to the number of SID rows")
    _in_range(need, "leaf_ads", gtm.leaf_ads, n_ads)
    if gtm.part_offsets is not None:
        po = gtm.part_offsets
        T = len(gtm.part_bitmask_index)
        need(po[0] == 0 and bool(np.all(np.diff(po) >= 1)) and po[-1] == T, "part_offsets",
             "each entry must have at least one partition, offsets rising to the partition count")
        _in_range(need, "part_bitmask_index", gtm.part_bitmask_index, len(gtm.bitmask_table))
        _in_range(need, "part_bloom_index", gtm.part_bloom_index, len(gtm.bloom_table))
    ho = exact.hash_offsets
    if ho.size:
        ok = ho[0, 0] == 0 and ho[-1, -1] == len(exact.hashes) and bool(np.all(np.diff(ho, axis=1) >= 0))
        ok = ok and bool(np.all(ho[1:, 0] == ho[:-1, -1]))
        need(ok, "exact_hash_offsets", "hash offsets must rise through every attribute to the number of hashes")


def _in_range(need, name: str, values: np.ndarray, size: int) -> None:
    need(len(values) == 0 or (int(values.min()) >= 0 and int(values.max()) < size), name,
         f"a row index lies outside [0, {size})")
