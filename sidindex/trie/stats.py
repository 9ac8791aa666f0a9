"""Build statistics of a GTM index (GRACE Tables 1 and 2): per transition position, entries, parent
nodes, matcher bytes before and after dedup, mean fill rate of bitmask and Bloom rows; SID stats."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np

from sidindex.matchers.bits import fill_rate
from sidindex.trie.build import GTMIndex


@dataclass(frozen=True)
class PositionStats:
    position: int                # transition from depth `position` to `position + 1`
    parents: int                 # nodes at depth `position`
    entries: int                 # child entries (= nodes at depth `position + 1`)
    bitmask_bytes_before: int    # one row per entry
    bitmask_bytes_after: int     # distinct rows referenced by this position's entries
    bloom_bytes_before: int
    bloom_bytes_after: int
    bitmask_fill: float          # mean share of set bits over entries
    bloom_fill: float
    partitions: int = 0          # k-way partitions of this position's entries (0: built without k-way)
    part_bytes: int = 0          # jagged layer: one (bitmask, Bloom) row-index pair per partition
    part_bitmask_fill: float = 0.0  # mean share of set bits over partitions
    part_bloom_fill: float = 0.0


@dataclass(frozen=True)
class GTMStats:
    positions: tuple[PositionStats, ...]
    num_nodes: int
    sids: int
    bitmask_table_bytes: int     # the deduplicated tables as stored (shared by all positions)
    bloom_table_bytes: int
    ads_per_sid_p50: float
    ads_per_sid_p99: float
    ads_per_sid_max: int
    sids_per_ad_mean: float
    sids_per_ad_max: int

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def gtm_stats(index: GTMIndex, bitmask_bits: int, bloom_bits: int) -> GTMStats:
    """bitmask_bits / bloom_bits: meaningful bits per row (fill rates ignore word padding)."""
    bm_fill = fill_rate(index.bitmask_table, max(bitmask_bits, 1))
    bl_fill = fill_rate(index.bloom_table, max(bloom_bits, 1))
    bm_row = index.bitmask_table.shape[1] * 8
    bl_row = index.bloom_table.shape[1] * 8
    positions = []
    for d in range(index.sid_length):
        lo, hi = index.depth_offsets[d + 1] - 1, index.depth_offsets[d + 2] - 1  # entries of depth d+1 nodes
        bmi, bli = index.bitmask_index[lo:hi], index.bloom_index[lo:hi]
        kway = {}
        if index.part_offsets is not None:
            plo, phi = index.part_offsets[lo], index.part_offsets[hi]
            kway = dict(partitions=int(phi - plo), part_bytes=int(phi - plo) * 8,
                        part_bitmask_fill=float(bm_fill[index.part_bitmask_index[plo:phi]].mean()),
                        part_bloom_fill=float(bl_fill[index.part_bloom_index[plo:phi]].mean()))
        positions.append(PositionStats(
            position=d, parents=int(index.depth_offsets[d + 1] - index.depth_offsets[d]), entries=int(hi - lo),
            bitmask_bytes_before=int(hi - lo) * bm_row, bitmask_bytes_after=_distinct(bmi, len(bm_fill)) * bm_row,
            bloom_bytes_before=int(hi - lo) * bl_row, bloom_bytes_after=_distinct(bli, len(bl_fill)) * bl_row,
            bitmask_fill=float(bm_fill[bmi].mean()), bloom_fill=float(bl_fill[bli].mean()), **kway))
    per_sid = np.diff(index.leaf_ad_offsets)
    per_ad = np.bincount(index.leaf_ads)
    per_ad = per_ad[per_ad > 0]
    return GTMStats(
        positions=tuple(positions), num_nodes=index.num_nodes, sids=index.num_leaves,
        bitmask_table_bytes=int(index.bitmask_table.nbytes), bloom_table_bytes=int(index.bloom_table.nbytes),
        ads_per_sid_p50=float(np.percentile(per_sid, 50)), ads_per_sid_p99=float(np.percentile(per_sid, 99)),
        ads_per_sid_max=int(per_sid.max()), sids_per_ad_mean=float(per_ad.mean()), sids_per_ad_max=int(per_ad.max()))


def _distinct(index: np.ndarray, rows: int) -> int:
    """Number of distinct table rows referenced by `index` (O(n), no sort)."""
    return int(np.count_nonzero(np.bincount(index, minlength=rows)))
