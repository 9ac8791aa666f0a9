"""One k-means level: shrinking on small or duplicate data, and the capacity-balanced variant."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sidindex.sample import zipf_weights
from sidindex.sid import train_codebook
from sidindex.sid.kmeans import balanced_assign, nearest, train_level
from tests.conftest import small_config

LEVEL = dict(niter=10, seed=5, min_points_per_centroid=5, balanced=False, capacity=1.1, balanced_iters=5)


@settings(max_examples=30, deadline=None)
@given(n=st.integers(1, 300), k=st.integers(1, 40), capacity=st.floats(1.0, 3.0), seed=st.integers(0, 1000))
def test_balanced_assign_respects_capacity(n, k, capacity, seed):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((n, 3)).astype(np.float32)
    c = rng.standard_normal((k, 3)).astype(np.float32)
    a = balanced_assign(x, c, capacity)
    cap = math.ceil(capacity * n / k)
    assert a.shape == (n,) and a.min() >= 0 and a.max() < k
    counts = np.bincount(a, minlength=k)
    assert counts.max() <= cap
    # Greedy by distance: a point whose nearest centroid still has room at the end took it.
    d = ((x[:, None, :].astype(np.float64) - c[None]) ** 2).sum(-1)
    nearest = d.argmin(1)
    room = counts[nearest] < cap
    np.testing.assert_array_equal(a[room], nearest[room])


def skewed(n: int, dim: int, seed: int) -> np.ndarray:
    """Zipf-sized clusters of very different widths: the density plain k-means spreads unevenly."""
    rng = np.random.default_rng(seed)
    centres = rng.standard_normal((40, dim)).astype(np.float32)
    cluster = rng.choice(40, size=n, p=zipf_weights(40, 1.0))
    width = np.exp(rng.normal(-1.5, 0.5, 40)).astype(np.float32)[cluster, None]
    return centres[cluster] + width * rng.standard_normal((n, dim)).astype(np.float32)


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_balanced_raises_utilisation_of_residual_codes(seed):
    """Plain k-means leaves residual levels unevenly used; capacity balancing evens them out."""
    x = skewed(4000, 16, seed)

    def residual_perplexity(balanced: bool) -> float:
        cb = train_codebook(x, small_config(levels=(32, 32), balanced=balanced, min_points_per_centroid=20))
        r = x - cb.centroids[0][nearest(x, cb.centroids[0])]
        use = np.bincount(nearest(r, cb.centroids[1]), minlength=32)
        p = use[use > 0] / use.sum()
        return float(np.exp(-(p * np.log(p)).sum()))

    assert residual_perplexity(True) > 1.25 * residual_perplexity(False)


def test_level_shrinks_to_what_the_data_can_train():
    x = np.random.default_rng(0).standard_normal((100, 4)).astype(np.float32)
    c, notes = train_level(x, 64, **LEVEL)
    assert c.shape == (20, 4)
    assert notes[0] == "size shrunk from 64 to 20 (100 training points at 5 per centroid)"


def test_heavy_duplicates_shrink_to_distinct_points():
    rng = np.random.default_rng(0)
    points = rng.standard_normal((3, 4)).astype(np.float32)
    x = points[rng.integers(0, 3, 1000)]
    c, notes = train_level(x, 16, **LEVEL)
    assert c.shape == (3, 4) and "3 distinct points" in notes[0]
    np.testing.assert_allclose(np.sort(c, axis=0), np.sort(points, axis=0), atol=1e-6)


def test_identical_points_give_one_centroid():
    x = np.ones((50, 4), dtype=np.float32)
    c, notes = train_level(x, 8, **{**LEVEL, "balanced": True})
    np.testing.assert_array_equal(c, np.ones((1, 4), dtype=np.float32))
    assert notes
