"""Build statistics of a GTM index (GRACE Tables 1 and 2): per transition position, entries, parent
nodes, and per matcher plane its bytes before and after dedup and the mean fill rate of its rows;
SID stats. `to_dict` names a plane's figures after it (`bitmask_fill`, `bloom_bytes_after`, ...):
the `stats` of a snapshot's manifest, which `from_dict` reads back."""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from schemas.artifacts import MATCHER_PLANES
from sidindex import histogram
from sidindex.matchers.bits import fill_rate
from sidindex.trie.build import GTMIndex


@dataclass(frozen=True)
class PlaneStats:
    """One matcher plane at one position."""

    bytes_before: int            # one row per entry
    bytes_after: int             # distinct rows referenced by this position's entries
    fill: float                  # mean share of set bits over entries
    part_fill: float = 0.0       # mean share of set bits over k-way partitions


def _plane_keys(plane: str) -> dict[str, str]:
    """PlaneStats' fields -> their keys in a position's dict, for `plane`."""
    return {"bytes_before": f"{plane}_bytes_before", "bytes_after": f"{plane}_bytes_after", "fill": f"{plane}_fill",
            "part_fill": f"part_{plane}_fill"}


@dataclass(frozen=True)
class PositionStats:
    position: int                # transition from depth `position` to `position + 1`
    parents: int                 # nodes at depth `position`
    entries: int                 # child entries (= nodes at depth `position + 1`)
    planes: dict[str, PlaneStats]
    partitions: int = 0          # k-way partitions of this position's entries (0: built without k-way)
    part_bytes: int = 0          # jagged layer: one row index per plane and partition

    def to_dict(self) -> dict:
        out = {"position": self.position, "parents": self.parents, "entries": self.entries,
               "partitions": self.partitions, "part_bytes": self.part_bytes}
        for name, p in self.planes.items():
            out |= {key: getattr(p, f) for f, key in _plane_keys(name).items()}
        return out

    @classmethod
    def from_dict(cls, doc: dict) -> PositionStats:
        """`to_dict`'s inverse, for the planes of MATCHER_PLANES (ValueError when `doc` is not one)."""
        planes = {}
        for p in MATCHER_PLANES:
            key = _plane_keys(p)
            planes[p] = PlaneStats(bytes_before=_count(doc, key["bytes_before"]),
                                   bytes_after=_count(doc, key["bytes_after"]), fill=_share(doc, key["fill"]),
                                   part_fill=_share(doc, key["part_fill"]))
        return cls(position=_count(doc, "position"), parents=_count(doc, "parents"), entries=_count(doc, "entries"),
                   planes=planes, partitions=_count(doc, "partitions"), part_bytes=_count(doc, "part_bytes"))


@dataclass(frozen=True)
class GTMStats:
    positions: tuple[PositionStats, ...]
    num_nodes: int
    sids: int
    table_bytes: dict[str, int]  # per plane: the deduplicated table as stored (shared by all positions)
    ads_per_sid_p50: float
    ads_per_sid_p99: float
    ads_per_sid_max: int
    sids_per_ad_mean: float
    sids_per_ad_max: int

    @property
    def matcher_bytes(self) -> int:
        return sum(self.table_bytes.values())

    def to_dict(self) -> dict:
        return {"positions": [p.to_dict() for p in self.positions], "num_nodes": self.num_nodes, "sids": self.sids,
                **{_table_bytes_key(n): b for n, b in self.table_bytes.items()},
                "ads_per_sid_p50": self.ads_per_sid_p50, "ads_per_sid_p99": self.ads_per_sid_p99,
                "ads_per_sid_max": self.ads_per_sid_max, "sids_per_ad_mean": self.sids_per_ad_mean,
                "sids_per_ad_max": self.sids_per_ad_max}

    @classmethod
    def from_dict(cls, doc: dict) -> GTMStats:
        """`to_dict`'s inverse (ValueError when `doc` is not one). Keys it does not know are left
        out: the figures of a newer sidindex are no reason to refuse its snapshot. Numbers are kept as
        written, so `to_dict` gives back the same JSON."""
        positions = doc.get("positions")
        if not isinstance(positions, list) or not all(isinstance(p, dict) for p in positions):
            raise ValueError("stats: 'positions' must be a list of objects")
        return cls(positions=tuple(PositionStats.from_dict(p) for p in positions), num_nodes=_count(doc, "num_nodes"),
                   sids=_count(doc, "sids"), table_bytes={p: _count(doc, _table_bytes_key(p)) for p in MATCHER_PLANES},
                   ads_per_sid_p50=_share(doc, "ads_per_sid_p50"), ads_per_sid_p99=_share(doc, "ads_per_sid_p99"),
                   ads_per_sid_max=_count(doc, "ads_per_sid_max"), sids_per_ad_mean=_share(doc, "sids_per_ad_mean"),
                   sids_per_ad_max=_count(doc, "sids_per_ad_max"))


def _table_bytes_key(plane: str) -> str:
    return f"{plane}_table_bytes"


def _count(doc: dict, key: str) -> int:
    """doc[key], an integer (ValueError naming the key otherwise)."""
    v = doc.get(key)
    if isinstance(v, bool) or not isinstance(v, int):
        raise ValueError(f"stats: {key!r} must be an integer, not {type(v).__name__}")
    return v


def _share(doc: dict, key: str) -> float:
    """doc[key], a number, kept as written (ValueError naming the key otherwise)."""
    v = doc.get(key)
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise ValueError(f"stats: {key!r} must be a number, not {type(v).__name__}")
    return v


@dataclass(frozen=True)
class StatsSums:
    """What the statistics need from a trie, summed shard by shard (`merge` adds the next shard's),
    so that a Ray build's driver merges per-shard sums instead of holding the shards.

    positions: (L, 4) int64 per position: parents, entries, partitions, partition bytes
    planes:    per plane (L, 4) float64: bytes before, after dedup, summed fill of the entries' rows,
               of the partitions' rows
    table_bytes: per plane, the tables as stored; nodes: below the root
    per_sid:   (M,) int64 histogram of the SIDs' ad counts (`sidindex.histogram`)
    """

    positions: np.ndarray
    planes: dict[str, np.ndarray]
    table_bytes: dict[str, int]
    nodes: int
    per_sid: np.ndarray
    kway: bool

    @classmethod
    def of(cls, index: GTMIndex, plane_bits: tuple[int, ...]) -> StatsSums:
        """The sums of one shard's trie; plane_bits: meaningful bits per row of each plane (fill
        rates ignore word padding)."""
        L = index.sid_length
        sums = np.zeros((L, 4), dtype=np.int64)
        plane_sums = {p.name: np.zeros((L, 4)) for p in index.planes}
        fills = [fill_rate(p.table, max(bits, 1)) for p, bits in zip(index.planes, plane_bits)]
        for d in range(L):
            lo, hi = index.depth_offsets[d + 1] - 1, index.depth_offsets[d + 2] - 1  # entries of depth d+1 nodes
            plo = phi = 0
            if index.part_offsets is not None:
                plo, phi = index.part_offsets[lo], index.part_offsets[hi]
            sums[d] += (index.depth_offsets[d + 1] - index.depth_offsets[d] if d else 0, hi - lo, phi - plo,
                        (phi - plo) * 4 * len(index.planes))
            for p, fill in zip(index.planes, fills):
                row = p.table.shape[1] * 8
                idx = p.index[lo:hi]
                part = float(fill[p.part_index[plo:phi]].sum()) if p.part_index is not None else 0.0
                plane_sums[p.name][d] += ((hi - lo) * row, _distinct(idx, len(fill)) * row, float(fill[idx].sum()),
                                          part)
        return cls(sums, plane_sums, {p.name: int(p.table.nbytes) for p in index.planes}, index.num_nodes - 1,
                   histogram.histogram(np.diff(index.leaf_ad_offsets)), index.part_offsets is not None)

    def merge(self, other: StatsSums) -> StatsSums:
        return StatsSums(self.positions + other.positions, {n: x + other.planes[n] for n, x in self.planes.items()},
                         {n: b + other.table_bytes[n] for n, b in self.table_bytes.items()}, self.nodes + other.nodes,
                         histogram.merged(self.per_sid, other.per_sid), self.kway)

    def stats(self, per_ad: np.ndarray) -> GTMStats:
        """The statistics; per_ad: (M,) int64 histogram of the ads' SID rows (ads without any are
        left out)."""
        sums, kway = self.positions.copy(), self.kway
        sums[0, 0] = 1  # the root, whichever shards share it
        per_ad = histogram.without_zero(per_ad)
        positions = tuple(PositionStats(
            position=d, parents=int(sums[d, 0]), entries=int(sums[d, 1]),
            planes={n: PlaneStats(int(x[d, 0]), int(x[d, 1]), float(x[d, 2] / max(sums[d, 1], 1)),
                                  float(x[d, 3] / max(sums[d, 2], 1)) if kway else 0.0)
                    for n, x in self.planes.items()},
            **(dict(partitions=int(sums[d, 2]), part_bytes=int(sums[d, 3])) if kway else {}))
            for d in range(len(sums)))
        return GTMStats(
            positions=positions, num_nodes=1 + self.nodes, sids=histogram.items(self.per_sid),
            table_bytes=dict(self.table_bytes), ads_per_sid_p50=histogram.percentile(self.per_sid, 50),
            ads_per_sid_p99=histogram.percentile(self.per_sid, 99), ads_per_sid_max=histogram.largest(self.per_sid),
            sids_per_ad_mean=histogram.mean(per_ad), sids_per_ad_max=histogram.largest(per_ad))


def gtm_stats(shards: Sequence[GTMIndex], plane_bits: tuple[int, ...]) -> GTMStats:
    """The statistics of the index whose shards' tries are `shards` (one: a whole trie), summed
    shard by shard (a shard's table rows are its own: bytes after dedup are the bytes stored).
    plane_bits: meaningful bits per row of each plane (fill rates ignore word padding)."""
    return functools.reduce(StatsSums.merge, (StatsSums.of(index, plane_bits) for index in shards)).stats(
        histogram.histogram(_sid_rows_per_ad(shards)))


def _sid_rows_per_ad(shards: Sequence[GTMIndex]) -> np.ndarray:
    """(N',) int64 the SID rows of each catalog row up to the last one the shards hold."""
    rows = max((int(np.max(index.leaf_ads)) + 1 for index in shards if len(index.leaf_ads)), default=0)
    per_ad = np.zeros(rows, dtype=np.int64)
    for index in shards:
        per_ad += np.bincount(index.leaf_ads, minlength=rows)
    return per_ad


def _distinct(index: np.ndarray, rows: int) -> int:
    """Number of distinct table rows referenced by `index` (O(n), no sort)."""
    return int(np.count_nonzero(np.bincount(index, minlength=rows)))
