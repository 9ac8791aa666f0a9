"""The device exact filter (`runtime.ops.exact_filter`): the Triton kernels (on a GPU, else under
TRITON_INTERPRET=1 on CPU tensors) equal the torch reference exactly on every slot, and both equal
the host numba filter (`sidindex.exact.stage_flags`) on every live pair.

Two sources of cases: the random catalogs of the post stage's tests (`tests.test_post.cases`:
built snapshots, requests sliced from a larger batch as `retrieve` slices them), and raw arrays
drawn here to reach what a catalog rarely does: hashes on both sides of 2^63 (sorted as unsigned,
the signed-order trap), ads and requests with no values, attributes with up to 64 request values
and more ad values, word groups of several words, one or many queries per group.
"""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from runtime.index.served import post_bounds
from runtime.ops.exact_filter import exact_filter
from runtime.requests import to_device
from runtime.serving.post import post_tensors
from schemas.artifacts import MATCHER_PLANES
from sidindex.errors import ConfigError
from sidindex.exact import ExactQueries, stage_flags
from sidindex.matchers.plane import PlaneQueries
from tests.test_post import cases
from tests.test_runtime import DEVICE

ROWS, VALUES = MATCHER_PLANES.index("bitmask"), MATCHER_PLANES.index("bloom")
TOP = 2**63
SPECIAL = [0, 1, TOP - 1, TOP, TOP + 1, 2**64 - 1]  # the edges of the signed and unsigned orders


def on(x, dev):
    """x with every tensor in it (through dicts, tuples, dataclasses and namespaces) on dev."""
    if isinstance(x, torch.Tensor):
        return x.to(dev)
    if isinstance(x, dict):
        return {k: on(v, dev) for k, v in x.items()}
    if isinstance(x, tuple):
        return tuple(on(v, dev) for v in x)
    if isinstance(x, SimpleNamespace):
        return SimpleNamespace(**on(vars(x), dev))
    if dataclasses.is_dataclass(x):
        return dataclasses.replace(x, **{f.name: on(getattr(x, f.name), dev) for f in dataclasses.fields(x)})
    return x


def both(arrays, requests, ad, steps, max_values, live=None, device_requests=None):
    """(triton on DEVICE, torch on the CPU) results, checked equal and (B, C) bool per plane.
    device_requests: requests on DEVICE (default: `on(requests, DEVICE)`)."""
    dreq = on(requests, DEVICE) if device_requests is None else device_requests
    got = [g.cpu() for g in exact_filter(on(arrays, DEVICE), dreq, ad.to(DEVICE), steps, max_values, impl="triton",
                                         live=None if live is None else live.to(DEVICE))]
    want = exact_filter(arrays, requests, ad, steps, max_values, impl="torch", live=live)
    assert len(got) == len(want) == len(MATCHER_PLANES)
    for g, w in zip(got, want):
        assert g.dtype == w.dtype == torch.bool and g.shape == w.shape == ad.shape
        assert torch.equal(g, w)
    return got


@settings(max_examples=25, deadline=None)
@given(cases(), st.integers(1, 20), st.integers(0, 2**32 - 1), st.booleans())
def test_kernel_and_reference_equal_the_host_filter(case_beams, C, seed, sliced):
    case, _ = case_beams
    B = len(case.sc.requests)
    lo = B // 2 if sliced else 0  # a slice: ranges and hash offsets are views with a row offset
    host, dev = case.req.slice(lo, B), to_device(case.req, "cpu").slice(lo, B)
    N = len(case.sc.ads)
    ad = torch.from_numpy(np.random.default_rng(seed).integers(0, N, (B - lo, C)))
    arrays = post_tensors(case.index)
    got = both(arrays, dev, ad, post_bounds(arrays, case.index.snapshot).steps, max(q.max_queries for q in dev.planes),
               device_requests=to_device(case.req, DEVICE).slice(lo, B))
    reqs, ads = np.repeat(np.arange(B - lo), C), ad.numpy().reshape(-1)
    flags = stage_flags(case.snap.exact, host, reqs, ads)
    live = case.snap.exact.live(ads)  # stage_flags passes no stage of a paused or deleted row
    for p, g in enumerate(got):
        assert np.array_equal(g.numpy().reshape(-1)[live], (flags[live] & (1 << p)) > 0), MATCHER_PLANES[p]


def _sorted_unsigned(values) -> np.ndarray:
    """(n,) int64 the uint64 bits of values, sorted as unsigned."""
    return np.array(sorted(set(values)), dtype=np.uint64).view(np.int64)


@st.composite
def raw(draw):
    """(arrays, requests, ad, steps, max_values, want): a rows plane and a values plane drawn as
    arrays, and per plane the (B, C) bool a brute force gives."""
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    N, B, C = draw(st.integers(1, 6)), draw(st.integers(1, 3)), draw(st.integers(1, 150))
    # rows plane: W words cut into groups; few bits per word, so rows pass often
    sizes = draw(st.lists(st.integers(1, 3), max_size=3))
    woff = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)
    W = int(woff[-1])
    rows = rng.integers(0, 8, (N, W)) | (rng.integers(0, 2, (N, W)) << 63)  # the sign bit is a bit like any other
    single = draw(st.booleans())
    q_rows, ranges = [], np.zeros((B, len(sizes), 2), dtype=np.int64)
    for b in range(B):
        for g in range(len(sizes)):
            ranges[b, g, 0] = len(q_rows)
            for _ in range(1 if single else draw(st.integers(1, 6))):
                q = np.zeros(W, dtype=np.int64)
                q[woff[g]:woff[g + 1]] = rng.integers(0, 8, sizes[g]) & rng.integers(0, 8, sizes[g])
                q_rows.append(q)
            ranges[b, g, 1] = len(q_rows)
    q_rows = np.array(q_rows, dtype=np.int64).reshape(len(q_rows), W)
    # values plane: A attributes, hashes from a pool holding both sides of 2^63
    A = draw(st.integers(1, 3))
    pool = SPECIAL + [int(x) for x in rng.integers(0, 2**64, 90, dtype=np.uint64)]
    picks = st.lists(st.sampled_from(pool), max_size=draw(st.sampled_from([3, 80])))
    ad_vals = [[draw(picks) if draw(st.booleans()) else [] for _ in range(N)] for _ in range(A)]
    req_vals = [[draw(st.lists(st.sampled_from(pool), max_size=64)) for _ in range(B)] for _ in range(A)]

    def csr(lists):
        parts = [_sorted_unsigned(v) for v in lists]
        return np.concatenate([[0], np.cumsum([len(p) for p in parts])]), parts

    ad_off, hashes = np.zeros((A, N + 1), dtype=np.int64), []
    req_off, req_hashes = np.zeros((A, B + 1), dtype=np.int64), []
    for a in range(A):
        off, parts = csr(ad_vals[a])
        ad_off[a] = off + sum(len(h) for h in hashes)
        hashes += parts
        off, parts = csr(req_vals[a])
        req_off[a] = off + sum(len(h) for h in req_hashes)
        req_hashes += parts
    hashes, req_hashes = np.concatenate(hashes), np.concatenate(req_hashes)
    steps = tuple(int(np.diff(o).max(initial=0)).bit_length() for o in ad_off)
    ad = rng.integers(0, N, (B, C))
    want = np.ones((len(MATCHER_PLANES), B, C), dtype=bool)
    for b in range(B):
        for c in range(C):
            r = rows[ad[b, c]]
            want[ROWS, b, c] = all(any(((r & q) == q).all() for q in q_rows[ranges[b, g, 0]:ranges[b, g, 1]])
                                   for g in range(len(sizes)))
            want[VALUES, b, c] = all(not ad_vals[a][ad[b, c]] or bool(set(ad_vals[a][ad[b, c]]) & set(req_vals[a][b]))
                                     for a in range(A))
    t = torch.from_numpy
    planes = [None] * len(MATCHER_PLANES)
    planes[ROWS] = PlaneQueries(t(q_rows), t(ranges), woff, single=single)
    planes[VALUES] = PlaneQueries(t(np.zeros((1, 1), dtype=np.int64)), t(np.zeros((B, 1, 2), dtype=np.int64)),
                                  np.array([0, 1]))  # the values plane's exact test reads no queries
    exact = [None] * len(MATCHER_PLANES)
    exact[VALUES] = ExactQueries(t(req_off), t(req_hashes))
    arrays = {"exact_bitmask_rows": t(rows), "exact_bloom_hash_offsets": t(ad_off.reshape(-1)),
              "exact_bloom_hashes": t(hashes)}
    max_values = max(1, int((ranges[..., 1] - ranges[..., 0]).max(initial=0)), int(np.diff(req_off).max()))
    return arrays, SimpleNamespace(planes=tuple(planes), exact=tuple(exact)), t(ad), {"bloom": steps}, max_values, want


@settings(max_examples=40, deadline=None)
@given(raw(), st.data())
def test_kernel_and_reference_equal_a_brute_force_on_raw_arrays(drawn, data):
    """With `live` counts (the post kernels' compacted pairs), every slot past a request's count is
    False; the others are the brute force's."""
    arrays, requests, ad, steps, max_values, want = drawn
    B, C = ad.shape
    live = data.draw(st.none() | st.lists(st.integers(0, C + 2), min_size=B, max_size=B))
    if live is not None:
        want = want & (np.arange(C) < np.array(live)[:, None])
        live = torch.tensor(live, dtype=torch.int64)
    got = both(arrays, requests, ad, steps, max_values, live)
    for p, g in enumerate(got):
        assert np.array_equal(g.numpy(), want[p]), MATCHER_PLANES[p]


def test_an_unknown_impl_is_refused():
    with pytest.raises(ConfigError, match="expected one of auto, triton, torch"):
        exact_filter({}, None, torch.zeros((1, 1), dtype=torch.int64), {}, 1, impl="numba")
