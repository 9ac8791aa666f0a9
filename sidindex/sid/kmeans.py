"""One k-means level: faiss Lloyd iterations, optionally refined into capacity-balanced clusters.

faiss k-means is not balanced (its min/max points per centroid only govern sampling), so the
balanced variant is built here on top of faiss search: each refinement pass assigns points greedily,
closest (point, centroid) pairs first, to centroids with capacity left, then moves every centroid to
the mean of its points. Legend: n training points, K centroids, D dims, r candidates per point.
"""

from __future__ import annotations

import math

import faiss
import numba
import numpy as np

BALANCE_CANDIDATES = 16  # r: nearest centroids a point may be balanced onto before a full scan


def train_level(
    x: np.ndarray,
    k: int,
    *,
    niter: int,
    seed: int,
    min_points_per_centroid: int,
    balanced: bool,
    capacity: float,
    balanced_iters: int,
) -> tuple[np.ndarray, list[str]]:
    """Train one level's centroids.

    x: (n, D) float32 training points (residuals below the first level)
    Returns (centroids (K', D) float32, notes), where K' <= k shrinks to what the data can train:
    at most n // min_points_per_centroid centroids, and no more than the distinct points.
    """
    n, d = x.shape
    notes: list[str] = []
    distinct = _distinct_rows(x)
    k_eff = max(1, min(k, n // min_points_per_centroid, len(distinct)))
    if k_eff < k:
        why = (f"{len(distinct)} distinct points" if len(distinct) < min(k, n // min_points_per_centroid)
               else f"{n} training points at {min_points_per_centroid} per centroid")
        notes.append(f"size shrunk from {k} to {k_eff} ({why})")
    if k_eff == 1:
        return x.mean(axis=0, keepdims=True, dtype=np.float64).astype(np.float32), notes
    if k_eff == len(distinct):  # as many centroids as distinct points: those points are the optimum
        return distinct, notes
    km = faiss.Kmeans(d, k_eff, niter=niter, seed=seed, verbose=False,
                      min_points_per_centroid=1, max_points_per_centroid=n)  # we sample, not faiss
    km.train(x)
    centroids = np.ascontiguousarray(km.centroids, dtype=np.float32)
    if balanced:
        centroids = balanced_refine(x, centroids, capacity=capacity, iters=balanced_iters)
    empty = k_eff - len(np.unique(nearest(x, centroids)))
    if empty:
        notes.append(f"{empty} of {k_eff} centroids have no training point nearest to them")
    return centroids, notes


def nearest(x: np.ndarray, centroids: np.ndarray) -> np.ndarray:
    """(n,) int64 index of the nearest centroid (squared L2) for each row of x (n, D)."""
    _, idx = faiss.knn(x, centroids, 1)
    return idx[:, 0]


def balanced_refine(x: np.ndarray, centroids: np.ndarray, *, capacity: float, iters: int) -> np.ndarray:
    """Refine centroids (K, D) so each holds at most ceil(capacity * n / K) training points.

    Each pass: a capacity-constrained assignment (`balanced_assign`), then centroid = mean of its
    points; a centroid left without points keeps its position.
    """
    centroids = centroids.copy()
    for _ in range(iters):
        assign = balanced_assign(x, centroids, capacity)
        sums, counts = _cluster_sums(x, assign, len(centroids))
        filled = counts > 0
        centroids[filled] = (sums[filled] / counts[filled, None]).astype(np.float32)
    return centroids


def balanced_assign(x: np.ndarray, centroids: np.ndarray, capacity: float) -> np.ndarray:
    """(n,) int64 assignment in which no centroid takes more than ceil(capacity * n / K) points.

    Pairs (point, one of its r nearest centroids) are visited in order of distance; a point takes
    the first centroid that still has room. Points whose r candidates all filled up take the
    nearest centroid with room, found by a full scan. Deterministic (stable sort, fixed order).
    """
    n, k = len(x), len(centroids)
    cap = math.ceil(capacity * n / k)
    r = min(k, BALANCE_CANDIDATES)
    dist, cand = faiss.knn(x, centroids, r)
    order = np.argsort(dist.ravel(), kind="stable")
    return _greedy_capacity(order, cand, x, centroids, cap)


@numba.njit(cache=True)
def _greedy_capacity(order: np.ndarray, cand: np.ndarray, x: np.ndarray, centroids: np.ndarray, cap: int
                     ) -> np.ndarray:
    n, r = cand.shape
    k, d = centroids.shape
    assign = np.full(n, -1, dtype=np.int64)
    counts = np.zeros(k, dtype=np.int64)
    for idx in order:
        p = idx // r
        if assign[p] >= 0:
            continue
        c = cand[p, idx % r]
        if counts[c] < cap:
            assign[p] = c
            counts[c] += 1
    for p in range(n):  # leftovers: the nearest centroid with room (total room >= n)
        if assign[p] >= 0:
            continue
        best, best_d = -1, np.inf
        for c in range(k):
            if counts[c] >= cap:
                continue
            dd = 0.0
            for j in range(d):
                t = x[p, j] - centroids[c, j]
                dd += t * t
            if dd < best_d:
                best, best_d = c, dd
        assign[p] = best
        counts[best] += 1
    return assign


@numba.njit(cache=True)
def _cluster_sums(x: np.ndarray, assign: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    n, d = x.shape
    sums = np.zeros((k, d), dtype=np.float64)
    counts = np.zeros(k, dtype=np.int64)
    for i in range(n):
        c = assign[i]
        counts[c] += 1
        for j in range(d):
            sums[c, j] += x[i, j]
    return sums, counts


def _distinct_rows(x: np.ndarray) -> np.ndarray:
    """(u, D) the distinct rows of x (n, D), in a deterministic (byte) order."""
    rows = np.ascontiguousarray(x).view(np.dtype((np.void, x.dtype.itemsize * x.shape[1])))
    return np.unique(rows).view(x.dtype).reshape(-1, x.shape[1])
