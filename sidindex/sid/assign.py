"""Assign SIDs to ads with a frozen codebook: multi-path residual quantisation + hash level.

Each ad takes its m nearest first-level centroids (GR4AD-X multi-path; with a path ratio, only those
within (1 + path_ratio) of the nearest's distance). Each path is residual-quantised down the
semantic levels on its own, by nearest centroid; all paths share the ad's hash token as last level.

Fast: one GEMM x.(-2C)^T + ||C||^2 over all levels, shared by every path, and the small tables
C_p.C_l^T give each path's residual scores by lookups instead of a GEMM per path. Independent of
how the catalog is cut: the SIDs are those of every sum run in one fixed order (`_products`). The
GEMM runs on BLAS; an ad keeps its BLAS choices when each wins by more than five times Higham's
error bound (`_certify`), and the near ties left are assigned again in the fixed order
(`_fixed_block`). Derivation, margins and measured figures: docs/sids.md, "Assignment".
Legend: N ads, P = sum of paths (SID rows), L SID length, m paths, K_l level sizes, b block rows.
"""

from __future__ import annotations

import collections
import contextlib
import queue
import threading
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import numba
import numpy as np
import pyarrow as pa
from threadpoolctl import threadpool_limits

from sidindex.sid.codebook import Codebook, Progress

BLOCK = 1024  # ads per task (measured: 4,096 and 16,384 are slower, their products leave the caches)
FIXED_BLOCK = 16384  # near-tied ads per fixed-order pass: (block, sum K) float32 products, 100 MB at 3 x 512
UNIT = 2.0 ** -24  # float32's unit roundoff
TINY = 2.0 ** -126  # float32's smallest normal


@dataclass(frozen=True)
class SIDAssignment:
    """SID rows, sorted by (ad_index, path).

    ad_index:    (P,) int64 row of the ad in the catalog
    path:        (P,) int8 0 = nearest first-level centroid, 1 = second nearest, ...
    sids:        (P, L) int16 tokens, token l in [0, level_sizes[l])
    first_ratio: (N,) float32 distance to the 2nd nearest / distance to the nearest first-level
                 centroid (inf when the first level has one centroid), for the multi-path report
    """

    ad_index: np.ndarray
    path: np.ndarray
    sids: np.ndarray
    first_ratio: np.ndarray
    level_sizes: tuple[int, ...]

    @property
    def n_ads(self) -> int:
        return len(self.first_ratio)


def assign_sids(codebook: Codebook, embedding: np.ndarray, hash_token: np.ndarray,
                progress: Progress | None = None) -> SIDAssignment:
    """SIDs for every ad.

    embedding:  (N, D) float32, D = codebook.dim
    hash_token: (N,) int16 final-level tokens (`hash_tokens`)
    """
    tokens, kept, first_ratio = _assign(_Tables.of(codebook), embedding, progress)
    ad_index, path = np.nonzero(kept)  # row-major: sorted by (ad, path)
    n_sem = tokens.shape[2]
    sids = np.empty((len(ad_index), n_sem + 1), dtype=np.int16)
    sids[:, :n_sem] = tokens[ad_index, path]
    sids[:, n_sem] = hash_token[ad_index]
    return SIDAssignment(ad_index.astype(np.int64), path.astype(np.int8), sids, first_ratio,
                         codebook.level_sizes)


def _assign(tables: _Tables, embedding: np.ndarray, progress: Progress | None = None
            ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """tokens (N, m, levels) int16 (valid where kept), kept (N, m) bool and first_ratio (N,)
    float32 of ads embedding (N, D): `_fixed_block`'s, with BLAS doing the GEMM."""
    n = len(embedding)
    m = tables.paths
    tokens = np.empty((n, m, len(tables.offs) - 1), dtype=np.int16)
    kept = np.empty((n, m), dtype=np.bool_)
    first_ratio = np.empty(n, dtype=np.float32)
    sure = np.zeros(n, dtype=np.bool_)
    workers = max(1, min(numba.get_num_threads(), -(-n // BLOCK)))  # numba's thread count, a block each
    scratch: queue.SimpleQueue[_Scratch] = queue.SimpleQueue()
    for _ in range(workers):
        scratch.put(_Scratch.of(tables, min(BLOCK, n)))

    def certify(start: int) -> None:
        own = scratch.get()
        try:
            end = min(start + BLOCK, n)
            x = np.ascontiguousarray(embedding[start:end], dtype=np.float32)
            xw = own.products[:end - start]
            np.matmul(x, tables.minus2, out=xw)  # x.(-2c) in whatever order BLAS sums
            _certify(xw, x, tables.rows, tables.norms, tables.cross2, tables.offs, tables.bounds, m, tables.ratio,
                     own.score, own.lanes, own.best, own.arg, own.margins,
                     tokens[start:end], kept[start:end], first_ratio[start:end], sure[start:end])
        finally:
            scratch.put(own)

    # Blocks on a pool of our own, BLAS on one thread each: BLAS's threads would spin beside them.
    # At most 4 blocks per worker are queued, so a billion ads do not make a million futures.
    with _one_blas_thread():
        pool = ThreadPoolExecutor(workers)
        queued: collections.deque[Future] = collections.deque()
        try:
            for start in range(0, n, BLOCK):
                queued.append(pool.submit(certify, start))
                while queued and (len(queued) >= 4 * workers or start + BLOCK >= n):
                    queued.popleft().result()
                    if progress:
                        progress("assign", min(start + BLOCK - len(queued) * BLOCK, n), n)
        finally:  # an interrupt (or a progress callback's error) waits for the running blocks only
            pool.shutdown(cancel_futures=True)
    # Near ties: assigned again with every sum in the fixed order, on numba's threads.
    unsure = np.flatnonzero(~sure)
    for start in range(0, len(unsure), FIXED_BLOCK):
        at = unsure[start:start + FIXED_BLOCK]
        tok, kep, rat = tokens[at], kept[at], first_ratio[at]
        _fixed_block(tables, np.ascontiguousarray(embedding[at], dtype=np.float32), tok, kep, rat)
        tokens[at], kept[at], first_ratio[at] = tok, kep, rat
        if progress:
            progress("near ties", min(start + FIXED_BLOCK, len(unsure)), len(unsure))
    return tokens, kept, first_ratio


class _OneBlasThread:
    """BLAS on one thread while any assignment runs in this process. The limit is the process's
    (BLAS has no other): the first assignment to start sets it and the last to end restores it,
    so overlapping assignments never leave it set."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._users = 0
        self._limits: threadpool_limits | None = None

    @contextlib.contextmanager
    def held(self) -> Iterator[None]:
        with self._lock:
            if self._users == 0:
                self._limits = threadpool_limits(1, user_api="blas")
            self._users += 1
        try:
            yield
        finally:
            with self._lock:
                self._users -= 1
                if self._users == 0 and self._limits is not None:
                    self._limits.restore_original_limits()
                    self._limits = None


_one_blas_thread = _OneBlasThread().held


@dataclass(frozen=True)
class _Tables:
    """The codebook as the kernels read it: every level's centroids concatenated (sum K).

    offs:   (levels + 1,) int64 level offsets into the concatenation
    minus2: (D, sum K) float32 -2 c^T; rows: (sum K, D) float32 -2 c, the same values by centroid
    norms:  (sum K,) float32 ||c||^2, summed by `_products`
    cross2: (sum K, sum K) float32 2 c.c' (only blocks of levels p < l are read)
    bounds: (levels, 3) float64 per level l: max |norms|, max ||-2 c|| over its centroids, max
            |cross2| from a centroid of a level above to one of l (0 for the first level), for
            the margins of `_certify`
    """

    offs: np.ndarray
    minus2: np.ndarray
    rows: np.ndarray
    norms: np.ndarray
    cross2: np.ndarray
    bounds: np.ndarray
    paths: int
    ratio: float  # path_ratio, -1 when unset

    @property
    def total(self) -> int:
        return len(self.norms)

    @classmethod
    def of(cls, codebook: Codebook) -> _Tables:
        cents = codebook.centroids
        offs = np.zeros(len(cents) + 1, dtype=np.int64)
        np.cumsum([len(c) for c in cents], out=offs[1:])
        cat = np.concatenate(cents).astype(np.float32)
        total = len(cat)
        cross2, norms = np.empty((total, total), dtype=np.float32), np.empty(total, dtype=np.float32)
        _products(cat, np.ascontiguousarray(2.0 * cat.T, dtype=np.float32), np.zeros(total, np.float32), cross2, norms)
        minus2 = np.ascontiguousarray(-2.0 * cat.T, dtype=np.float32)
        lengths = np.sqrt((minus2.astype(np.float64) ** 2).sum(0))
        bounds = np.array([[np.abs(norms[lo:hi]).max(initial=0.0), lengths[lo:hi].max(initial=0.0),
                            np.abs(cross2[:lo, lo:hi]).max(initial=0.0)] for lo, hi in zip(offs[:-1], offs[1:])],
                          dtype=np.float64)
        return cls(offs, minus2, np.ascontiguousarray(minus2.T), norms, cross2, bounds, codebook.paths,
                   -1.0 if codebook.path_ratio is None else float(codebook.path_ratio))


@dataclass(frozen=True)
class _Scratch:
    """One worker's buffers: products (b, sum K) float32, score (sum K,) float32, lanes (8,)
    float32, best (m + 2,) float32, arg (m + 2,) int64 and margins (levels,) float64."""

    products: np.ndarray
    score: np.ndarray
    lanes: np.ndarray
    best: np.ndarray
    arg: np.ndarray
    margins: np.ndarray

    @classmethod
    def of(cls, t: _Tables, rows: int) -> _Scratch:
        return cls(np.empty((rows, t.total), dtype=np.float32), np.empty(t.total, dtype=np.float32),
                   np.empty(8, dtype=np.float32), np.empty(t.paths + 2, dtype=np.float32),
                   np.empty(t.paths + 2, dtype=np.int64), np.empty(len(t.offs) - 1, dtype=np.float64))


def _fixed_block(t: _Tables, x: np.ndarray, tokens: np.ndarray, kept: np.ndarray, first_ratio: np.ndarray) -> None:
    """The reference assignment of ads x (b, D) float32, every sum in the fixed order; writes
    tokens (b, m, levels) int16, kept (b, m) bool, first_ratio (b,) float32."""
    products, xnorm = np.empty((len(x), t.total), dtype=np.float32), np.empty(len(x), dtype=np.float32)
    _products(x, t.minus2, t.norms, products, xnorm)  # ||c||^2 - 2 x.c for every centroid of every level
    _chains(products, xnorm, t.cross2, t.offs, t.paths, t.ratio, tokens, kept, first_ratio)


@numba.njit(parallel=True, cache=True)
def _products(x: np.ndarray, w: np.ndarray, bias: np.ndarray, out: np.ndarray, sq: np.ndarray) -> None:
    """out[i] = bias + x[i] . w and sq[i] = ||x[i]||^2, for x (n, D), w (D, K), bias (K,) float32.

    A GEMM whose every element is summed in one fixed order, whatever the rows around it or the
    threads: BLAS sums differently with the block's size and its thread count, which moved a few
    near-tied ads to other SIDs between builds of one catalog in fragments and whole. It defines
    the SIDs; at 64 dims it is about 2.5x slower than BLAS, so it runs only on the near ties
    `_certify` leaves, and on the codebook's own tables.
    """
    n, d = x.shape
    for i in numba.prange(n):
        row = out[i]
        row[:] = bias
        q = np.float32(0.0)
        for k in range(d):
            xk = x[i, k]
            q += xk * xk
            for j in range(w.shape[1]):
                row[j] += xk * w[k, j]
        sq[i] = q


@numba.njit(parallel=True, cache=True)
def _chains(base: np.ndarray, xnorm: np.ndarray, cross2: np.ndarray, offs: np.ndarray, m: int, ratio: float,
            tokens: np.ndarray, kept: np.ndarray, first_ratio: np.ndarray) -> None:
    """Per ad: top-m first-level centroids, then a nearest-centroid chain below each.

    base: (b, sum K) float32 ||c||^2 - 2 x.c; xnorm: (b,) ||x||^2; cross2: (sum K, sum K) 2 c.c'
    Writes tokens (b, m, levels) int16, kept (b, m) bool, first_ratio (b,) float32.
    """
    top = min(max(m, 2), offs[1])  # the 2nd nearest is needed for first_ratio even when m == 1
    no_margins = np.zeros(len(offs) - 1)  # read only: shared by every ad
    for i in numba.prange(base.shape[0]):
        best, arg = np.empty(top, dtype=np.float32), np.empty(top, dtype=np.int64)
        score, lanes = np.empty(base.shape[1], dtype=np.float32), np.empty(8, dtype=np.float32)
        _nearest(base[i, :offs[1]], top, best, arg, lanes)
        first_ratio[i], _ = _descend(base[i], xnorm[i], cross2, offs, m, ratio, best, arg, top, no_margins, score,
                                     lanes, tokens[i], kept[i])


@numba.njit(nogil=True, cache=True)
def _certify(xw: np.ndarray, x: np.ndarray, rows: np.ndarray, norms: np.ndarray, cross2: np.ndarray,
             offs: np.ndarray, bounds: np.ndarray, m: int, ratio: float, score: np.ndarray, lanes: np.ndarray,
             best: np.ndarray, arg: np.ndarray, margins: np.ndarray, tokens: np.ndarray, kept: np.ndarray,
             first_ratio: np.ndarray, sure: np.ndarray) -> None:
    """`_chains` on BLAS products, for the ads whose every choice is certain.

    xw: (b, sum K) float32 x.(-2c) summed in any order (made ||c||^2 - 2 x.c in place); x: (b, D)
    float32; rows, norms, cross2, offs, bounds: `_Tables`'s; score, lanes, best, arg, margins:
    `_Scratch`'s.
    sure: (b,) bool, set where the order of the top first-level centroids and the one after, and
    each level's nearest centroid, win by more than their level's margin: there tokens, kept and
    first_ratio are `_chains`'s bits (||x||^2 and the top first-level scores are summed again in
    `_products`'s order, the rest is the same code). Elsewhere they are left for `_fixed_block`.
    """
    b, d = x.shape
    k0 = offs[1]
    top = min(max(m, 2), k0)
    ranked = min(top + 1, k0)  # and the first one not taken
    levels = len(offs) - 1
    gamma = (d + 1) * UNIT / (1.0 - (d + 1) * UNIT)
    for i in range(b):
        xi, row = x[i], xw[i]
        for k in range(len(row)):
            row[k] += norms[k]
        q, q64 = np.float32(0.0), 0.0
        for k in range(d):
            q += xi[k] * xi[k]
            q64 += np.float64(xi[k]) * np.float64(xi[k])
        # A score sums d + 1 terms whose magnitudes add up to at most |c|^2 + ||x|| ||2c|| (Cauchy-
        # Schwarz): in any order the sum is within gamma_(d+1) times that of the exact one
        # (Higham, Accuracy and Stability of Numerical Algorithms, 3.1), and a chain's cross
        # terms add one rounding each; a BLAS that reads subnormal inputs as zero loses at most
        # d products under (||x|| + ||2c||) 2^-126. Both BLAS's and the fixed order's scores are
        # within `err` of the exact ones, so a gap over 4 err on BLAS's is a gap over 0 on the
        # fixed order's; 5 absorbs this bound's own rounding.
        length = np.sqrt(q64)
        for lv in range(levels):  # a level's own centroids bound its scores: lower levels' are smaller
            scale = bounds[lv, 0] + length * bounds[lv, 1]
            err = gamma * scale + lv * UNIT * (scale + lv * bounds[lv, 2]) + d * (length + bounds[lv, 1]) * TINY
            margins[lv] = 5.0 * err
        _nearest(row[:k0], ranked, best, arg, lanes)
        certain = True
        for r in range(1, ranked):
            certain &= np.float64(best[r]) - np.float64(best[r - 1]) > margins[0]
        if not certain:
            continue
        for j in range(top):  # the fixed order's bits for the scores kept and compared
            s, c = norms[arg[j]], rows[arg[j]]
            for k in range(d):
                s += xi[k] * c[k]
            best[j] = s
        first_ratio[i], sure[i] = _descend(row, q, cross2, offs, m, ratio, best, arg, top, margins, score, lanes,
                                           tokens[i], kept[i])


# Hot loops run from 0 over 1-D slices: numba vectorises those, not loops from an offset read at
# run time (it guards each such index against being negative).

@numba.njit(cache=True)
def _nearest(scores: np.ndarray, count: int, best: np.ndarray, arg: np.ndarray, lanes: np.ndarray) -> None:
    """best[:count] float32 and arg[:count] int64: the `count` lowest of scores (K,) float32
    (finite) and their positions, ascending; ties go to the lowest position. lanes: (8,) float32
    scratch.

    Eight running minima are eight of the scores, so the count-th lowest of them bounds the count
    lowest of all: only scores under that bound are inserted (in order, as a plain scan would),
    which spares the scan most of its mispredicted branches.
    """
    best[:count] = np.inf
    arg[:count] = 0
    limit = np.float32(np.inf)
    if count <= 8 and len(scores) >= 8:
        _minima(scores, lanes)
        for j in range(1, 8):  # insertion sort of the eight
            v, t = lanes[j], j
            while t > 0 and lanes[t - 1] > v:
                lanes[t] = lanes[t - 1]
                t -= 1
            lanes[t] = v
        limit = lanes[count - 1]
    worst = np.float32(np.inf)
    for k in range(len(scores)):
        s = scores[k]
        if s <= limit and s < worst:  # rarely true past the first few: the branch predicts well
            j = count - 1
            while j > 0 and best[j - 1] > s:
                best[j] = best[j - 1]
                arg[j] = arg[j - 1]
                j -= 1
            best[j] = s
            arg[j] = k
            worst = best[count - 1]


@numba.njit(cache=True)
def _minima(v: np.ndarray, lanes: np.ndarray) -> None:
    """lanes (8,) float32: for each j < 8 the lowest of v[8 t + j] (v (K,) float32) over whole
    groups of eight (the last K % 8 are left out). The select form runs eight independent chains
    where a running minimum waits on the one before."""
    a0 = a1 = a2 = a3 = a4 = a5 = a6 = a7 = np.float32(np.inf)
    for k in range(0, len(v) - len(v) % 8, 8):
        a0 = v[k] if v[k] < a0 else a0
        a1 = v[k + 1] if v[k + 1] < a1 else a1
        a2 = v[k + 2] if v[k + 2] < a2 else a2
        a3 = v[k + 3] if v[k + 3] < a3 else a3
        a4 = v[k + 4] if v[k + 4] < a4 else a4
        a5 = v[k + 5] if v[k + 5] < a5 else a5
        a6 = v[k + 6] if v[k + 6] < a6 else a6
        a7 = v[k + 7] if v[k + 7] < a7 else a7
    lanes[0], lanes[1], lanes[2], lanes[3] = a0, a1, a2, a3
    lanes[4], lanes[5], lanes[6], lanes[7] = a4, a5, a6, a7


@numba.njit(cache=True)
def _lowest(v: np.ndarray, margin: float, lanes: np.ndarray) -> tuple[int, bool]:
    """The position of the lowest of v (K,) float32 (finite; ties: the first), and whether every
    other value exceeds it by more than margin (>= 0). lanes: (8,) float32 scratch.

    A minimum, then a count and the last position under a threshold, in passes the compiler
    vectorises, where one pass keeping the lowest and the second branches on every value.
    """
    _minima(v, lanes)
    low = np.float32(np.inf)
    for j in range(8):
        low = lanes[j] if lanes[j] < low else low
    for k in range(len(v) - len(v) % 8, len(v)):
        low = v[k] if v[k] < low else low
    # float32 compares vectorise twice as wide; rounding the limit up only counts more as near
    limit = np.nextafter(np.float32(np.float64(low) + margin), np.float32(np.inf))
    near, last = 0, 0
    for k in range(len(v)):
        hit = v[k] <= limit
        near += hit
        last = max(last, k if hit else 0)
    if near == 1:
        return last, True
    for k in range(len(v)):  # several within the margin: the first lowest
        if v[k] == low:
            return k, False
    return 0, False


@numba.njit(cache=True)
def _descend(base: np.ndarray, xnorm: np.float32, cross2: np.ndarray, offs: np.ndarray, m: int, ratio: float,
             best: np.ndarray, arg: np.ndarray, top: int, margins: np.ndarray, score: np.ndarray, lanes: np.ndarray,
             tokens: np.ndarray, kept: np.ndarray) -> tuple[np.float32, bool]:
    """One ad's paths from its `top` nearest first-level centroids (best, arg: `_nearest`).

    base: (sum K,) float32 ||c||^2 - 2 x.c; score (sum K,) and lanes (8,) float32: scratch;
    writes tokens (m, levels) int16 and kept (m,) bool. Returns the first-level ratio and
    whether every level's nearest centroid won by more than margins[level] ((levels,) float64).
    Ties go to the lowest centroid index.
    """
    n_sem = len(offs) - 1
    d0 = np.sqrt(max(xnorm + best[0], 0.0))
    if top > 1:
        d1 = np.sqrt(max(xnorm + best[1], 0.0))
        first_ratio = d1 / d0 if d0 > 0 else (1.0 if d1 == 0 else np.inf)
    else:
        first_ratio = np.inf
    certain = True
    for j in range(m):
        dj = np.sqrt(max(xnorm + best[j], 0.0)) if j < top else np.inf
        kept[j] = j < top and (ratio < 0 or j == 0 or dj <= (1.0 + ratio) * d0)
        if not kept[j]:
            continue
        tokens[j, 0] = arg[j]
        for lv in range(1, n_sem):
            lo, hi = offs[lv], offs[lv + 1]
            # base + 2 c_p.c over the centroids already on this path, summed in path order
            here, below, cross = score[lo:hi], base[lo:hi], cross2[offs[0] + tokens[j, 0], lo:hi]
            for k in range(len(here)):
                here[k] = below[k] + cross[k]
            for p in range(1, lv):
                cross = cross2[offs[p] + tokens[j, p], lo:hi]
                for k in range(len(here)):
                    here[k] += cross[k]
            at, alone = _lowest(here, margins[lv], lanes)
            certain &= alone
            tokens[j, lv] = at
    return np.float32(first_ratio), certain


def sid_table(assignment: SIDAssignment, ad_id: np.ndarray) -> pa.Table:
    """The assignment as a table following `schemas.SID_TABLE` (ad_id, path, sid)."""
    sids = assignment.sids
    return pa.table({
        "ad_id": pa.array(ad_id[assignment.ad_index].astype(np.int64)),
        "path": pa.array(assignment.path),
        "sid": pa.FixedSizeListArray.from_arrays(pa.array(sids.reshape(-1)), sids.shape[1]),
    })


def sid_keys(sids: np.ndarray, level_sizes: tuple[int, ...]) -> np.ndarray:
    """(P,) int64 mixed-radix keys that order SIDs (P, L) lexicographically; one key per SID."""
    key = sids[:, 0].astype(np.int64)
    for level in range(1, len(level_sizes)):  # in place: one (P,) array, however long the SID
        key *= level_sizes[level]
        key += sids[:, level]
    return key


def key_tokens(keys: np.ndarray, level_sizes: tuple[int, ...]) -> np.ndarray:
    """(S, L) int16 tokens of SID keys (S,) int64 (the inverse of `sid_keys`); `keys` is consumed.
    numpy divides by a scalar without a hardware division per element."""
    out = np.empty((len(keys), len(level_sizes)), dtype=np.int16)
    for level in range(len(level_sizes) - 1, -1, -1):
        out[:, level] = keys % level_sizes[level]
        keys //= level_sizes[level]
    return out


def run_starts(sorted_keys: np.ndarray) -> np.ndarray:
    """(S,) int64 positions where each run of equal values starts in sorted_keys (P,)."""
    if not len(sorted_keys):
        return np.zeros(0, dtype=np.int64)
    return np.flatnonzero(np.concatenate([[True], sorted_keys[1:] != sorted_keys[:-1]]))


def key_counts(keys: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(distinct keys ascending (S,), counts (S,) int64) of keys (P,).

    Sort + run starts: numpy 2.4's np.unique takes a hash path that is ~20x slower on 10M+ keys.
    """
    ordered = np.sort(keys)
    starts = run_starts(ordered)
    return ordered[starts], np.diff(np.append(starts, len(ordered)))
