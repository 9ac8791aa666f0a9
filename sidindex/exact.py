"""The exact per-ad targeting index and the ad-level filter (docs/design.md §3, §4).

Matcher rows may pass an ad that does not match (Bloom false positives); the exact filter stops
them at the ad level, plane by plane, in one of two forms (`schemas.artifacts.EXACT_FORM`):
  rows    the ads' own rows of the plane, tested with the planes' test (bitmask rows are exact)
  values  per attribute, the sorted 64-bit hashes of each ad's values: mmh3 x64_128 (seed
          EXACT_SEED), first 64 bits, unsigned (exact up to 64-bit hash collisions); an ad passes an
          attribute when it has no values or ANY request value is among them (bloom)
A request batch brings its plane queries and, for `values` planes, its `ExactQueries`
(`BatchQueries`, as `sidindex.request_encoding.EncodedRequests` holds them: host arrays; tensors in its
device form). Stage flags have one bit per plane, in plane order. Legend: N ads, B requests, A a
plane's attributes, T hashes.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import numba
import numpy as np
import pyarrow as pa

from schemas.artifacts import AD_DELETED, AD_LIVE, AD_PAUSED, EXACT_FORM, EXACT_ROWS, MATCHER_PLANES, plane_arrays
from sidindex.arraytypes import HostOrDevice
from sidindex.matchers.bits import ListCodes, list_codes
from sidindex.matchers.kinds import KINDS
from sidindex.matchers.plane import PARALLEL_PAIRS, PlaneQueries, pairs_pass
from sidindex.parallel import sized
from sidindex.targeting import TargetingSpec

if TYPE_CHECKING:
    import polars as pl

EXACT_SEED = 0x5EED0E1
ALL_STAGES = (1 << len(MATCHER_PLANES)) - 1  # `stage_flags` of an eligible pair: bit p for plane p
assert len(MATCHER_PLANES) <= 8, "stage flags are uint8: one bit per plane"


def value_hashes(values: list[str]) -> np.ndarray:
    """(V,) uint64 exact hashes of values."""
    import mmh3  # building: a reader of an index hashes nothing

    return np.array([mmh3.hash64(v, EXACT_SEED, signed=False)[0] for v in values], dtype=np.uint64).reshape(-1)


def _hash_lists(lc: ListCodes) -> tuple[np.ndarray, np.ndarray]:
    """(offsets (n+1,) int64, hashes (T,) uint64 sorted within each row) of a flattened column;
    each distinct value is hashed once."""
    hashes = value_hashes(lc.distinct)[lc.codes]
    offsets = np.zeros(len(lc.lengths) + 1, dtype=np.int64)
    np.cumsum(lc.lengths, out=offsets[1:])
    _sort_segments(hashes, offsets)
    return offsets, hashes


@numba.njit(cache=True)
def _sort_segments(values: np.ndarray, offsets: np.ndarray) -> None:
    """Sort values[offsets[i]:offsets[i+1]] in place for every i (each ad's list is short)."""
    for i in range(len(offsets) - 1):
        values[offsets[i]:offsets[i + 1]] = np.sort(values[offsets[i]:offsets[i + 1]])


def hash_lists(columns: pl.DataFrame, names: tuple[str, ...], codes: dict[str, ListCodes] | None = None,
               ) -> tuple[np.ndarray, np.ndarray]:
    """The exact hashes of list<string> columns `names` (ads' or requests'): offsets (A, n+1) int64
    into one concatenated hashes (T,) uint64, sorted within each row and attribute."""
    offsets = np.zeros((len(names), columns.height + 1), dtype=np.int64)
    parts, base = [], 0
    for a, name in enumerate(names):
        off, h = _hash_lists(codes[name] if codes else list_codes(columns.get_column(name)))
        offsets[a] = off + base
        parts.append(h)
        base += len(h)
    return offsets, np.concatenate(parts) if parts else np.zeros(0, dtype=np.uint64)


@dataclass(frozen=True)
class ExactQueries:
    """A request batch's values for one `values` plane: hash_offsets (A, B+1) int64 into hashes
    (T,) uint64, each request's value hashes per attribute, sorted (on a device, by
    `runtime.requests.to_device`: int64 tensors holding the same bits; `slice` serves both)."""

    hash_offsets: HostOrDevice
    hashes: HostOrDevice

    def slice(self, lo: int, hi: int) -> ExactQueries:
        return ExactQueries(self.hash_offsets[:, lo:hi + 1], self.hashes)


class BatchQueries(Protocol):
    """What the filter reads of a request batch: per plane its queries, and per `values` plane its
    `ExactQueries` (None for a `rows` plane). `sidindex.request_encoding.EncodedRequests` is one; the
    requests module encodes with the matchers, so they name only what they read of it."""

    @property
    def planes(self) -> tuple[PlaneQueries, ...]: ...

    @property
    def exact(self) -> tuple[ExactQueries | None, ...]: ...


@dataclass(frozen=True)
class ExactPlane:
    """One plane's exact data: `rows` (N, W) uint64 for a `rows` plane; for a `values` plane
    hash_offsets (A, N+1) int64 into hashes (T,) uint64, an ad's hashes sorted (an ad with no values
    for attribute a is unrestricted on a)."""

    name: str
    rows: np.ndarray | None = None
    hash_offsets: np.ndarray | None = None
    hashes: np.ndarray | None = None

    def arrays(self) -> dict[str, np.ndarray]:
        """The plane's arrays by their snapshot names (`schemas.artifacts`)."""
        names = plane_arrays(self.name)
        if self.rows is not None:
            return {names.exact_rows: self.rows}
        assert self.hash_offsets is not None and self.hashes is not None  # a values plane
        return {names.exact_hash_offsets: self.hash_offsets.reshape(-1), names.exact_hashes: self.hashes}


@dataclass(frozen=True)
class ExactIndex:
    """The exact data of every plane, in plane order, and the spec they encode.

    ad_state: (N,) uint8 each row's state (`schemas.artifacts.AD_LIVE`, ...) when an update wrote
    the snapshot, else None (every row live). Only live rows are eligible.
    """

    spec: TargetingSpec
    planes: tuple[ExactPlane, ...]
    ad_state: np.ndarray | None = None

    def arrays(self) -> dict[str, np.ndarray]:
        out = {n: a for p in self.planes for n, a in p.arrays().items()}
        return out if self.ad_state is None else out | {"ad_state": self.ad_state}

    def states(self, n: int) -> np.ndarray:
        """(n,) uint8 each of the n catalog rows' state (`schemas.artifacts.AD_LIVE`, ...; all live
        when no update or carried pause wrote states)."""
        return np.zeros(n, dtype=np.uint8) if self.ad_state is None else self.ad_state

    def paused_and_deleted(self) -> tuple[int, int]:
        """The rows paused and deleted (what an update's lineage counts); one compare per state,
        not `np.bincount`, whose cast of the states to intp costs ten times more."""
        if self.ad_state is None:
            return 0, 0
        return int(np.count_nonzero(self.ad_state == AD_PAUSED)), int(np.count_nonzero(self.ad_state == AD_DELETED))

    def live(self, ads: np.ndarray) -> np.ndarray:
        """(n,) bool: which catalog rows `ads` (n,) int64 are live (neither paused nor deleted)."""
        if self.ad_state is None:
            return np.ones(len(ads), dtype=np.bool_)
        return self.ad_state[ads] == AD_LIVE

    @classmethod
    def from_arrays(cls, spec: TargetingSpec, arrays: dict[str, np.ndarray], n_ads: int) -> ExactIndex:
        """The inverse of `arrays` (shapes already checked against the spec)."""
        planes = []
        for p, layout in zip(MATCHER_PLANES, spec.layouts):
            names = plane_arrays(p)
            if EXACT_FORM[p] == EXACT_ROWS:
                planes.append(ExactPlane(p, rows=arrays[names.exact_rows]))
            else:
                offsets = arrays[names.exact_hash_offsets].reshape(len(layout.names), n_ads + 1)
                planes.append(ExactPlane(p, hash_offsets=offsets, hashes=arrays[names.exact_hashes]))
        return cls(spec, tuple(planes), arrays.get("ad_state"))


def build_exact_index(spec: TargetingSpec, columns: pl.DataFrame, ad_rows: dict[str, np.ndarray] | None = None,
                      codes: dict[str, ListCodes] | None = None) -> ExactIndex:
    """The exact index of validated catalog columns; pass the matcher planes' `ad_rows` and the
    columns' `codes` when already computed."""
    planes = []
    for kind, layout in zip(KINDS, spec.layouts):
        if EXACT_FORM[kind.name] == EXACT_ROWS:
            rows = ad_rows[kind.name] if ad_rows else kind.encode_ads(layout, columns, codes)
            planes.append(ExactPlane(kind.name, rows=rows))
        else:
            offsets, hashes = hash_lists(columns, layout.names, codes)
            planes.append(ExactPlane(kind.name, hash_offsets=offsets, hashes=hashes))
    return ExactIndex(spec, tuple(planes))


def concat_exact(parts: list[ExactIndex]) -> ExactIndex:
    """The exact index of the parts' rows one after another (a `values` plane stays
    attribute-major: per attribute, each part's hashes in turn); states are not carried."""
    planes = []
    for ps in zip(*(x.planes for x in parts)):
        if ps[0].rows is not None:
            planes.append(ExactPlane(ps[0].name, rows=np.concatenate([p.rows for p in ps])))
            continue
        offs = [np.asarray(p.hash_offsets) for p in ps]  # (A, n_i + 1) each
        rows, pieces, base = [], [], 0
        for a in range(len(offs[0])):
            row = [np.array([base], dtype=np.int64)]
            for o, p in zip(offs, ps):
                row.append(o[a, 1:] - o[a, 0] + base)
                pieces.append(p.hashes[o[a, 0]:o[a, -1]])
                base += int(o[a, -1] - o[a, 0])
            rows.append(np.concatenate(row))
        planes.append(ExactPlane(ps[0].name, hash_offsets=np.stack(rows),
                                 hashes=np.concatenate(pieces or [np.zeros(0, dtype=np.uint64)])))
    return ExactIndex(parts[0].spec, tuple(planes))


def exact_columns(index: ExactIndex) -> dict[str, pa.Array]:
    """The exact index as Arrow columns, one row per ad: `exact_plane_<plane>` fixed_size_list<uint64>[W]
    (a `rows` plane's rows) or, per attribute of a `values` plane, `exact_attr_<attribute>`
    large_list<uint64> (the ad's sorted hashes)."""
    out = {}
    for plane, layout in zip(index.planes, index.spec.layouts):
        if plane.rows is not None:
            out[f"exact_plane_{plane.name}"] = pa.FixedSizeListArray.from_arrays(pa.array(plane.rows.reshape(-1)),
                                                                           plane.rows.shape[1])
            continue
        assert plane.hash_offsets is not None and plane.hashes is not None  # a values plane
        for name, off in zip(layout.names, plane.hash_offsets):
            out[f"exact_attr_{name}"] = pa.LargeListArray.from_arrays(pa.array(off - off[0], pa.int64()),
                                                                 pa.array(plane.hashes[off[0]:off[-1]]))
    return out


@dataclass(frozen=True)
class ArrayPieces:
    """An array of `shape`, as the pieces `pieces()` yields in order (rows, or elements of a flat
    array): what a task writes without holding the array (`sidindex.snapshot.arrays.write_array_pieces`)."""

    shape: tuple[int, ...]
    pieces: Callable[[], Iterator[np.ndarray]]


def exact_pieces(spec: TargetingSpec, tables: Sequence[pa.Table]) -> dict[str, ArrayPieces]:
    """The inverse of `exact_columns` over tables of consecutive catalog rows (a catalog's fragments,
    in order): the exact index's arrays by snapshot name (`ExactIndex.arrays`), each in pieces of
    one table's rows (a `values` plane's: one attribute of one table)."""
    n = sum(t.num_rows for t in tables)

    def column(t: pa.Table, name: str) -> pa.Array:
        return t.column(name).combine_chunks()

    out = {}
    for kind, layout in zip(KINDS, spec.layouts):
        names = plane_arrays(kind.name)
        if EXACT_FORM[kind.name] == EXACT_ROWS:
            def rows(name: str = f"exact_plane_{kind.name}") -> Iterator[np.ndarray]:
                for t in tables:
                    col = column(t, name)
                    yield col.flatten().to_numpy().reshape(len(col), col.type.list_size)
            out[names.exact_rows] = ArrayPieces((n, layout.words), rows)
            continue
        attrs = [f"exact_attr_{a}" for a in layout.names]

        def offsets(attrs: list[str] = attrs) -> Iterator[np.ndarray]:
            # attribute-major: each attribute's offsets over every ad, one run rising through them all
            held = 0
            for name in attrs:
                for t in tables:
                    off = column(t, name).offsets.to_numpy().astype(np.int64)
                    yield off[:-1] - off[0] + held
                    held += int(off[-1] - off[0])
                yield np.array([held], dtype=np.int64)

        def hashes(attrs: list[str] = attrs) -> Iterator[np.ndarray]:
            for name in attrs:
                for t in tables:
                    col = column(t, name)
                    off = col.offsets.to_numpy()
                    yield col.values.to_numpy()[off[0]:off[-1]]

        total = sum(int(len(column(t, name).flatten())) for name in attrs for t in tables)
        out[names.exact_hash_offsets] = ArrayPieces((len(attrs) * (n + 1),), offsets)
        out[names.exact_hashes] = ArrayPieces((total,), hashes)
    return out


def eligible_mask(index: ExactIndex, requests: BatchQueries, request: int, ads: np.ndarray) -> np.ndarray:
    """(k,) bool: which of `ads` (k,) int64 are eligible for request `request` (docs/design.md §3)."""
    ads = np.asarray(ads, dtype=np.int64)
    return eligible_pairs(index, requests, np.full(len(ads), request, dtype=np.int64), ads)


def eligible_pairs(index: ExactIndex, requests: BatchQueries, reqs: np.ndarray, ads: np.ndarray) -> np.ndarray:
    """(n,) bool: is ad `ads[i]` eligible for request `reqs[i]`; reqs, ads: (n,) int64."""
    return _flags(index, requests, reqs, ads, every_stage=False) == ALL_STAGES


def stage_flags(index: ExactIndex, requests: BatchQueries, reqs: np.ndarray, ads: np.ndarray) -> np.ndarray:
    """(n,) uint8 per (request, ad) pair: bit p set when the ad passes every attribute of plane p
    (each plane tested on its own, for pass rates per stage); eligible iff all are (ALL_STAGES)."""
    return _flags(index, requests, reqs, ads, every_stage=True)


def attribute_eligibility(index: ExactIndex, requests: BatchQueries, request: int, ad: int) -> np.ndarray:
    """(A_all,) bool: does catalog row `ad` pass each attribute (plane by plane, in each plane's
    layout order) for request `request`. Eligible iff all pass and the row is live; explanations
    need each one."""
    out: list[np.ndarray | list[bool]] = []
    for kind, layout, plane, q, ex in zip(KINDS, index.spec.layouts, index.planes, requests.planes, requests.exact):
        if plane.rows is not None:
            out.append(kind.attribute_passes(layout, plane.rows[ad], q, request))
            continue
        assert plane.hash_offsets is not None and plane.hashes is not None and ex is not None  # a values plane
        for a in range(len(layout.names)):
            own = plane.hashes[plane.hash_offsets[a, ad]:plane.hash_offsets[a, ad + 1]]
            asked = ex.hashes[ex.hash_offsets[a, request]:ex.hash_offsets[a, request + 1]]
            out.append([len(own) == 0 or bool(np.isin(asked, own).any())])
    return np.concatenate(out).astype(bool)


def _flags(index: ExactIndex, requests: BatchQueries, reqs: np.ndarray, ads: np.ndarray,
           every_stage: bool) -> np.ndarray:
    """Stage bits per pair; without `every_stage`, a pair failing a plane skips the later ones. A
    row that is not live passes no stage."""
    reqs, ads = np.asarray(reqs, dtype=np.int64), np.asarray(ads, dtype=np.int64)
    flags = np.zeros(len(ads), dtype=np.uint8)
    live = index.live(ads)
    alive = live.copy()
    for p, (plane, q, ex) in enumerate(zip(index.planes, requests.planes, requests.exact)):
        ok = live.copy() if every_stage else alive.copy()
        if plane.rows is not None:
            pairs_pass(plane.rows, ads, reqs, q, ok)
        else:
            assert ex is not None and plane.hash_offsets is not None and plane.hashes is not None  # a values plane
            _values_pass(plane.hash_offsets, plane.hashes, ads, ex.hash_offsets, ex.hashes, reqs, ok)
        flags |= ok.astype(np.uint8) << p
        alive &= ok
    return flags


@sized(PARALLEL_PAIRS, arg=2)
@numba.njit(parallel=True, cache=True)
def _values_pass(ad_off: np.ndarray, ad_hashes: np.ndarray, ads: np.ndarray, req_off: np.ndarray,
                 req_hashes: np.ndarray, reqs: np.ndarray, ok: np.ndarray) -> None:
    """ok[i] &= for every attribute, ad ads[i] is unrestricted or ANY value of request reqs[i] is
    among its hashes; pairs already not ok are skipped. Each request's values of an attribute go
    into a small hash set on first use (open addressing on the low bits: the values are uniform
    64-bit hashes already), so each value of the ad costs one probe, not a search. Pairs in parallel."""
    A = ad_off.shape[0]
    row = np.full(req_off.shape[1] - 1, -1, dtype=np.int64)  # request r's sets: sets[row[r]]
    asked = np.empty(len(reqs), dtype=np.int64)  # the requests of `reqs` (only they get sets), in row order
    n_rows, most = 0, 0
    for i in range(len(reqs)):
        r = reqs[i]
        if ok[i] and row[r] < 0:
            row[r], asked[n_rows] = n_rows, r
            n_rows += 1
            for a in range(A):
                most = max(most, req_off[a, r + 1] - req_off[a, r])
    size = 1
    while size < 8 * most:  # at most an eighth full: a missing value takes one probe, mostly
        size *= 2
    mask = np.uint64(size - 1)
    sets = np.zeros((n_rows, A, size), dtype=np.uint64)
    filled = np.zeros((n_rows, A, size), dtype=np.bool_)
    for r in asked[:n_rows]:
        for a in range(A):
            for j in range(req_off[a, r], req_off[a, r + 1]):
                h = np.uint64(req_hashes[j])
                s = h & mask
                while filled[row[r], a, s] and sets[row[r], a, s] != h:
                    s = (s + np.uint64(1)) & mask
                sets[row[r], a, s], filled[row[r], a, s] = h, True
    lo, hi = np.empty(len(ads), dtype=np.int64), np.empty(len(ads), dtype=np.int64)
    first = np.zeros(len(ads), dtype=np.uint64)
    for a in range(A):  # attribute by attribute: the pairs failing one are skipped in the next
        # gather each ad's range and first value in passes of independent loads (the CPU overlaps
        # their cache misses), then test from cache
        for i in numba.prange(len(ads)):
            lo[i], hi[i] = ad_off[a, ads[i]], ad_off[a, ads[i] + 1]
        for i in numba.prange(len(ads)):
            if hi[i] > lo[i]:
                first[i] = ad_hashes[lo[i]]
        for i in numba.prange(len(ads)):
            if not ok[i] or hi[i] == lo[i]:
                continue
            x, hit = row[reqs[i]], False
            for j in range(lo[i], hi[i]):
                v = first[i] if j == lo[i] else np.uint64(ad_hashes[j])
                s = v & mask
                while filled[x, a, s]:
                    if sets[x, a, s] == v:
                        hit = True
                        break
                    s = (s + np.uint64(1)) & mask
                if hit:
                    break
            ok[i] = hit
