"""Figures read from summed histograms are numpy's over the counts themselves, to the last bit: a
Ray build's statistics and SID report, merged from per-shard and per-fragment histograms, must equal
the local engine's (tests/test_scaleout.py compares the manifests)."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from sidindex import histogram

COUNTS = st.one_of(
    st.lists(st.integers(0, 5), min_size=1, max_size=300),
    st.lists(st.integers(0, 10**5), min_size=1, max_size=50),  # a histogram is as long as the largest count
    st.lists(st.sampled_from([1, 2, 2**16, 2**17 - 1]), min_size=1, max_size=40),
)
QS = st.one_of(st.sampled_from([0.0, 50.0, 99.0, 100.0, 1e-12, 99.99999]), st.floats(0, 100))


@settings(max_examples=400, deadline=None)
@given(counts=COUNTS, q=QS, cut=st.integers(0, 300))
def test_figures_of_merged_histograms_are_numpys(counts, q, cut):
    c = np.array(counts, dtype=np.int64)
    h = histogram.merged(histogram.histogram(c[:cut]), histogram.histogram(c[cut:]))  # two shards' sums
    assert histogram.percentile(h, q) == float(np.percentile(c, q))
    assert histogram.mean(h) == float(c.mean())
    assert histogram.largest(h) == int(c.max()) and histogram.items(h) == len(c)
    nonzero = c[c > 0]
    if len(nonzero):
        assert histogram.mean(histogram.without_zero(h)) == float(nonzero.mean())
