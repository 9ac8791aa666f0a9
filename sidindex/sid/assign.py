"""Assign SIDs to ads with a frozen codebook: multi-path residual quantisation + hash level.

Each ad takes its m nearest first-level centroids (GR4AD-X multi-path; path j is kept only if its
distance is within (1 + path_ratio) of the nearest, when a ratio is set); each path is
residual-quantised down the semantic levels on its own by nearest centroid, and all paths share
the ad's hash token as the last level.

Why it is fast: with r = x - sum_{p<l} c_p the residual at level l, the nearest centroid minimises
    ||c||^2 - 2 r.c = ||c||^2 - 2 (x.c - sum_{p<l} c_p.c).
So one GEMM x.(-2C)^T + ||C||^2 over all levels, shared by every path, plus the small tables
C_p.C_l^T (K_p, K_l) give each path's scores by table lookups instead of a residual GEMM per path.
Every sum runs in a fixed order (`_products`), so an ad's SIDs do not depend on the ads assigned
with it or on the thread count: a catalog built whole or in fragments gets the same SIDs.
Legend: N ads, P = sum of paths (SID rows), L SID length, m paths, K_l level sizes.
"""

from __future__ import annotations

from dataclasses import dataclass

import numba
import numpy as np
import pyarrow as pa

from sidindex.sid.codebook import Codebook, Progress

BLOCK = 32768  # ads per GEMM block: bounds the (block, K_l) score matrices to a few MB


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
    n = len(embedding)
    cents = codebook.centroids
    n_sem = len(cents)
    m = codebook.paths
    ratio = -1.0 if codebook.path_ratio is None else float(codebook.path_ratio)
    # Level offsets into the concatenated per-level arrays, and the cross tables C_p . C_l^T.
    offs = np.zeros(n_sem + 1, dtype=np.int64)
    np.cumsum([len(c) for c in cents], out=offs[1:])
    cat = np.concatenate(cents).astype(np.float32)
    total = len(cat)
    # cross2 = 2 C.C^T (sum K, sum K), only blocks p < l are read; norms = ||c||^2
    cross2, norms = np.empty((total, total), dtype=np.float32), np.empty(total, dtype=np.float32)
    _products(cat, np.ascontiguousarray(2.0 * cat.T, dtype=np.float32), np.zeros(total, np.float32), cross2, norms)
    minus2 = np.ascontiguousarray(-2.0 * cat.T, dtype=np.float32)  # (D, sum K)
    base = np.empty((min(BLOCK, n), total), dtype=np.float32)
    xnorm = np.empty(min(BLOCK, n), dtype=np.float32)
    tokens = np.empty((n, m, n_sem), dtype=np.int16)
    kept = np.empty((n, m), dtype=np.bool_)
    first_ratio = np.empty(n, dtype=np.float32)
    for start in range(0, n, BLOCK):
        x = np.ascontiguousarray(embedding[start:start + BLOCK], dtype=np.float32)
        b = len(x)
        _products(x, minus2, norms, base[:b], xnorm[:b])  # ||c||^2 - 2 x.c for every centroid of every level
        _chains(base[:b], xnorm[:b], cross2, offs, m, ratio,
                tokens[start:start + b], kept[start:start + b], first_ratio[start:start + b])
        if progress:
            progress("assign", min(start + BLOCK, n), n)
    ad_index, path = np.nonzero(kept)  # row-major: sorted by (ad, path)
    sids = np.empty((len(ad_index), n_sem + 1), dtype=np.int16)
    sids[:, :n_sem] = tokens[ad_index, path]
    sids[:, n_sem] = hash_token[ad_index]
    return SIDAssignment(ad_index.astype(np.int64), path.astype(np.int8), sids, first_ratio,
                         codebook.level_sizes)


@numba.njit(parallel=True, cache=True)
def _products(x: np.ndarray, w: np.ndarray, bias: np.ndarray, out: np.ndarray, sq: np.ndarray) -> None:
    """out[i] = bias + x[i] . w and sq[i] = ||x[i]||^2, for x (n, D), w (D, K), bias (K,) float32.

    A GEMM whose every element is summed in one fixed order, whatever the rows around it or the
    threads: BLAS sums differently with the block's size and its thread count, which moved a few
    near-tied ads to other SIDs between builds of one catalog in fragments and whole. As fast as
    BLAS here: the pass is bound by writing `out`.
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
    Ties go to the lowest centroid index. The per-level loops are bound by reading one row of
    `cross2` per (path, level), not by arithmetic.
    """
    b, total = base.shape
    n_sem = len(offs) - 1
    k0 = offs[1]
    top = min(max(m, 2), k0)  # the 2nd nearest is needed for first_ratio even when m == 1
    for i in numba.prange(b):
        bi = base[i]  # shared by every path
        best = np.full(top, np.inf, dtype=np.float32)
        arg = np.zeros(top, dtype=np.int64)
        worst = np.float32(np.inf)
        for k in range(k0):  # insertion into the `top` best first-level scores
            s = bi[k]
            if s < worst:
                j = top - 1
                while j > 0 and best[j - 1] > s:
                    best[j] = best[j - 1]
                    arg[j] = arg[j - 1]
                    j -= 1
                best[j] = s
                arg[j] = k
                worst = best[top - 1]
        d0 = np.sqrt(max(xnorm[i] + best[0], 0.0))
        if top > 1:
            d1 = np.sqrt(max(xnorm[i] + best[1], 0.0))
            first_ratio[i] = d1 / d0 if d0 > 0 else (1.0 if d1 == 0 else np.inf)
        else:
            first_ratio[i] = np.inf
        score = np.empty(total, dtype=np.float32)
        for j in range(m):
            dj = np.sqrt(max(xnorm[i] + best[j], 0.0)) if j < top else np.inf
            kept[i, j] = j < top and (ratio < 0 or j == 0 or dj <= (1.0 + ratio) * d0)
            if not kept[i, j]:
                continue
            tokens[i, j, 0] = arg[j]
            for lv in range(1, n_sem):
                lo, hi = offs[lv], offs[lv + 1]
                # score = base + 2 c_p.c over the centroids already on this path; all but the
                # last term in a vectorisable pass, the last one fused with the argmin.
                src = bi
                if lv > 1:
                    row = offs[0] + tokens[i, j, 0]
                    for k in range(lo, hi):
                        score[k] = bi[k] + cross2[row, k]
                    for p in range(1, lv - 1):
                        row = offs[p] + tokens[i, j, p]
                        for k in range(lo, hi):
                            score[k] += cross2[row, k]
                    src = score
                row = offs[lv - 1] + tokens[i, j, lv - 1]
                low, at = np.float32(np.inf), lo
                for k in range(lo, hi):
                    v = src[k] + cross2[row, k]
                    if v < low:
                        low, at = v, k
                tokens[i, j, lv] = at - lo


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
