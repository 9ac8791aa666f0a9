"""The post stage against an independent brute force (docs/design.md §3, §8, §16): the host numba path
and the device path (`runtime.serving.post.DevicePost`, here on CPU tensors: its Triton kernels under
TRITON_INTERPRET=1 and its torch reference) return exactly the result derived from the raw ad and
request lists.

Random small catalogs (`tests.test_gtm.scenarios`), some rows paused or deleted, ad ids that are
not the catalog rows' order, and random beams rather than searched ones: beams on catalog SIDs in
any order (the post stage must not rely on the search's), beams on SIDs outside the catalog
(leaf -1), dead beams, and scores drawn from a few values, so ads reached through several SIDs
meet equal and different scores and rankings tie on every key.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from runtime.index.loader import load_index
from runtime.ops.expand import DEFAULT_PAIRS, RRF_K, PostLayout
from runtime.requests import device_form, host_form, to_device
from runtime.result import Retrieved
from runtime.search.beam import Beams
from runtime.serving.post import RANKS, DevicePost, expand, post_tensors
from schemas.artifacts import MATCHER_PLANES
from sidindex.errors import ConfigError
from sidindex.targeting import BITMASK, BLOOM
from tests.conftest import interpreted
from tests.test_gtm import eligible, scenarios
from tests.test_runtime import DEVICE, GPU, Case
from tests.test_value import VALUES

SCORES = [0.0, -0.5, -1.0, -1.0, -2.5]  # few values: equal scores are common
IMPLS = ("torch", "triton")  # `runtime.ops.expand`'s: its reference and its kernels (the interpreter on CPU)
KIND_OF_PLANE = {"bitmask": BITMASK, "bloom": BLOOM}


@st.composite
def cases(draw, max_ads: int = 12, max_beams: int = 6, scores=SCORES, values: bool | None = None):
    """(case, beams): a scenario with values (or not, or either: None), some rows paused or deleted,
    its ad ids shuffled, and B x K random beams (K <= max_beams) scored from `scores`."""
    sc = draw(scenarios(max_ads=max_ads))
    if draw(st.booleans()) if values is None else values:
        sc = dataclasses.replace(sc, values=draw(st.lists(VALUES, min_size=len(sc.ads), max_size=len(sc.ads))))
    state = np.array(draw(st.lists(st.sampled_from([0, 0, 0, 1, 2]), min_size=len(sc.ads), max_size=len(sc.ads))),
                     dtype=np.uint8) if draw(st.booleans()) else None
    case = Case(sc, "cpu", ad_state=state)
    extremes = st.sampled_from([-2**63, -2**63 + 1, -1, 0, 2**63 - 2, 2**63 - 1])  # sort keys' edges
    ad_id = np.array(draw(st.lists(st.one_of(extremes, st.integers(-2**63, 2**63 - 1)), min_size=len(sc.ads),
                                   max_size=len(sc.ads), unique=True)), dtype=np.int64)  # not the row order
    snap = dataclasses.replace(case.snap, ad_id=ad_id)
    case.snap, case.index = snap, load_index(snap, "cpu")
    catalog = sorted(set(sc.sids))
    L, K = len(sc.level_sizes), draw(st.integers(1, max_beams))
    tokens = np.zeros((len(sc.requests), K, L), dtype=np.int64)
    score = np.full((len(sc.requests), K), -np.inf, dtype=np.float32)
    leaf = np.full((len(sc.requests), K), -1, dtype=np.int64)
    for r in range(len(sc.requests)):
        taken = draw(st.lists(st.sampled_from(catalog), max_size=min(K, len(catalog)), unique=True))
        for k in draw(st.permutations(range(K)))[:len(taken)]:
            sid = taken.pop()
            tokens[r, k], score[r, k] = sid, draw(st.sampled_from(scores))
            leaf[r, k] = case.node(sid) - case.gtm.depth_offsets[L]
        for k in range(K):
            if leaf[r, k] < 0 and draw(st.booleans()):  # a SID outside the catalog (mode none), alive
                tokens[r, k] = [L + level for level in range(L)]
                score[r, k] = draw(st.sampled_from(scores))
    return case, Beams(torch.from_numpy(tokens), torch.from_numpy(score), torch.from_numpy(leaf))


def brute_force(case: Case, beams: Beams, top_k: int | None, rank: str) -> dict:
    """From the raw lists: per request the eligible live ads under its live catalog beams, each
    with its best score and the first beam of that score, ranked by `rank` then ad_id; and the counts."""
    sc, ad_id = case.sc, case.snap.ad_id
    state = case.exact.ad_state
    ads_of = {}
    for sid, a in zip(sc.sids, sc.sid_ads):
        ads_of.setdefault(tuple(sid), []).append(a)
    out = {"rows": [], "sids": [], "reached": [], "generated": [], "eligible": [],
           "stages": {p: [] for p in MATCHER_PLANES}}
    for r, req in enumerate(sc.requests):
        best, live, reached = {}, 0, 0
        for k in range(beams.score.shape[1]):
            s = float(beams.score[r, k])
            if beams.leaf[r, k] < 0 or s == float("-inf"):
                continue
            live += 1
            reached += len(ads_of[tuple(beams.tokens[r, k].tolist())])
            for a in ads_of[tuple(beams.tokens[r, k].tolist())]:
                if (state is None or state[a] == 0) and (a not in best or s > best[a][0]):
                    best[a] = (s, k)
        out["sids"].append(live)
        out["reached"].append(reached)
        out["generated"].append(len(best))
        for p in MATCHER_PLANES:
            part = dataclasses.replace(sc.spec, attributes=tuple(x for x in sc.spec.attributes
                                                                 if x.kind == KIND_OF_PLANE[p]))
            out["stages"][p].append(sum(eligible(part, sc.ads[a], req) for a in best))
        ok = [a for a in best if eligible(sc.spec, sc.ads[a], req)]
        out["eligible"].append(len(ok))
        by_score = sorted(ok, key=lambda a: (-best[a][0], ad_id[a]))
        if rank == "score":
            ranked = by_score
        else:
            by_value = sorted(ok, key=lambda a: (-sc.values[a], -best[a][0], ad_id[a]))
            ranked = by_value
        if rank == "fused":
            rs = {a: i + 1 for i, a in enumerate(by_score)}
            rv = {a: i + 1 for i, a in enumerate(by_value)}
            ranked = sorted(ok, key=lambda a: (-(1 / (RRF_K + rs[a]) + 1 / (RRF_K + rv[a])), ad_id[a]))
        for place, a in enumerate(ranked[:top_k], 1):
            s, k = best[a]
            out["rows"].append((r, place, a, int(ad_id[a]), tuple(beams.tokens[r, k].tolist()), s,
                                None if sc.values is None else sc.values[a]))
    return out


def check(got: Retrieved, want: dict, stages: bool) -> None:
    rows = [(int(r), int(p), int(a), int(i), tuple(s.tolist()), float(sc), None if got.value is None else float(v))
            for r, p, a, i, s, sc, v in zip(got.request, got.rank, got.ad_row, got.ad_id, got.sid, got.score,
                                            got.value if got.value is not None else [None] * len(got.request))]
    assert rows == want["rows"]
    assert got.sids.tolist() == want["sids"]
    assert got.ads_generated.tolist() == want["generated"]
    assert got.ads_eligible.tolist() == want["eligible"]
    if stages:
        assert {p: c.tolist() for p, c in got.ads_per_stage.items()} == want["stages"]
    else:
        assert got.ads_per_stage is None
    for name in ("request", "rank", "ad_row", "ad_id", "sid", "sids", "ads_generated", "ads_eligible"):
        assert getattr(got, name).dtype == np.int64, name
    assert got.score.dtype == np.float32 and (got.value is None or got.value.dtype == np.float64)


def same(a: Retrieved, b: Retrieved) -> None:
    for f in dataclasses.fields(Retrieved):
        x, y = getattr(a, f.name), getattr(b, f.name)
        if isinstance(x, dict):
            assert x.keys() == y.keys() and all(np.array_equal(x[k], y[k]) for k in x), f.name
        else:
            assert (x is None and y is None) or (x.dtype == y.dtype and np.array_equal(x, y)), f.name


POSTS = st.tuples(cases(), st.sampled_from([None, 1, 2, 5]), st.booleans(), st.sampled_from([None, None, 1, 2, 4, 9]),
                  st.data())


@settings(max_examples=60, deadline=None)
@given(POSTS)
def test_host_and_device_paths_equal_the_brute_force(drawn):
    """Every path, and the device path at any capacity: a batch in which a request reached more
    pairs than the capacity is reported (None, and its reached pairs), never answered wrongly.
    Here the device path's torch reference; its kernels in the next test."""
    _paths_equal_the_brute_force(*drawn, impls=tuple(i for i in IMPLS if i != "triton"))


@settings(max_examples=interpreted(60), deadline=None)  # apart: under the interpreter an example costs seconds
@given(POSTS)
def test_the_device_kernels_equal_the_brute_force(drawn):
    _paths_equal_the_brute_force(*drawn, impls=("triton",))


def _paths_equal_the_brute_force(case_beams, top_k, stages, pairs, data, impls: tuple[str, ...]) -> None:
    case, beams = case_beams
    rank = data.draw(st.sampled_from(RANKS if case.sc.values is not None else ("score",)))
    want = brute_force(case, beams, top_k, rank)
    host = expand(case.index, case.req, beams, top_k, stages, rank)
    check(host, want, stages)
    same(host, expand(case.index, to_device(case.req, "cpu"), beams, top_k, stages, rank))  # read from its host form
    overflow = pairs is not None and max(want["reached"]) > pairs
    for impl in impls:
        post, device = device_post(case, beams, impl, top_k=top_k, rank=rank, stages=stages, pairs=pairs)
        assert post.last_reached is not None and post.last_reached.tolist() == want["reached"]
        if overflow:
            assert device is None
            continue
        assert device is not None
        check(device, want, stages)
        same(host, device)


def moved(beams: Beams, dev) -> Beams:
    return Beams(beams.tokens.to(dev), beams.score.to(dev), beams.leaf.to(dev))


def device_post(case, beams: Beams, impl: str, **kw) -> tuple[DevicePost, Retrieved | None]:
    """`DevicePost` with `impl` and its result: torch on CPU tensors, the Triton kernels on a GPU
    (in the interpreter, on CPU tensors, without one)."""
    dev = DEVICE if impl == "triton" else "cpu"
    post = DevicePost(case.index, *beams.score.shape, arrays=post_tensors(case.index, dev), impl=impl, **kw)
    return post, post.result(post.run(to_device(case.req, dev), moved(beams, dev)))


def device_result(case, beams: Beams, impl: str, **kw) -> Retrieved:
    """`device_post`'s result, which must not have overflowed."""
    got = device_post(case, beams, impl, **kw)[1]
    assert got is not None
    return got


@pytest.mark.parametrize("rank", RANKS)
@settings(max_examples=3, deadline=None)
@given(cases(max_ads=150, max_beams=80, scores=SCORES + [-0.0, -1e-45, -3.4e38, float("inf")], values=True),
       st.sampled_from([None, 3]))
def test_crowded_leaves_equal_the_brute_force(rank, case_beams, top_k):
    """Many ads per SID and up to 80 beams (hundreds of slots per request: hash chains, several
    counting rounds per place), scores at float32's edges (-0.0 is 0.0, a subnormal, -3.4e38, inf),
    every ranking."""
    case, beams = case_beams
    want = brute_force(case, beams, top_k, rank)
    for impl in IMPLS:
        check(device_result(case, beams, impl, top_k=top_k, rank=rank, stages=True), want, True)


@settings(max_examples=10, deadline=None)
@given(cases())
def test_the_device_path_serves_a_slice_of_the_requests(case_beams):
    """A batch sliced from the device form of a larger encoding (as `retrieve` batches)."""
    case, beams = case_beams
    B = beams.score.shape[0]
    lo = B // 2
    part = Beams(beams.tokens[lo:], beams.score[lo:], beams.leaf[lo:])
    for impl, dev in (("torch", "cpu"), ("triton", DEVICE)):
        post = DevicePost(case.index, B - lo, beams.score.shape[1], arrays=post_tensors(case.index, dev), impl=impl)
        got = post.result(post.run(to_device(case.req, dev).slice(lo, B), moved(part, dev)))
        assert got is not None
        same(got, expand(case.index, case.req.slice(lo, B), part))
    # a device form keeps the encoding it was moved from, and so does its slice: the host path reads it
    for dev in dict.fromkeys(("cpu", DEVICE)):
        moved_form = to_device(case.req, dev)
        assert host_form(moved_form) is case.req and device_form(moved_form, dev) is moved_form
        sliced = host_form(moved_form.slice(lo, B))
        assert sliced is not None and np.array_equal(sliced.planes[1].ranges, case.req.slice(lo, B).planes[1].ranges)
        same(expand(case.index, moved_form.slice(lo, B), part), expand(case.index, case.req.slice(lo, B), part))


def test_one_level_sids_keep_their_shape():
    """SIDs of one token: both paths give (n, 1) SIDs, the same rows."""
    from tests.test_gtm import scenario

    ads = [{"country": None, "locations": []}, {"country": ["US"], "locations": []}, {"country": None, "locations": []}]
    case = Case(scenario(ads, [(0,), (1,), (1,)], [0, 1, 2], level_sizes=(4,)), "cpu")
    B = len(case.sc.requests)
    beams = Beams(torch.tensor([[[1], [0]]] * B), torch.tensor([[-0.5, -1.0]] * B), torch.tensor([[1, 0]] * B))
    host = expand(case.index, case.req, beams)
    assert host.sid.shape == (len(host.ad_id), 1) and len(host.ad_id) > 0
    for impl in IMPLS:
        same(host, device_result(case, beams, impl))


def test_fused_ties_of_mirrored_ranks_fall_to_ad_id():
    """Ads whose value order is their score order reversed: the ads at score ranks r and n + 1 - r
    tie exactly on the fused score (1/(k + r) + 1/(k + n + 1 - r) either way round), so ad_id orders
    them (ad ids shuffled against the rows here: against the score order on some ties, against the
    value order on others); a rank off by one on either side breaks the ties the other way."""
    from tests.test_gtm import scenario

    n = 9
    sids = [(i % 3, i // 3 % 2, i % 4) for i in range(n)]  # one SID per ad
    sc = scenario([{"country": None, "locations": []}] * n, sids, list(range(n)))
    sc = dataclasses.replace(sc, values=[float(i) for i in range(n)])  # value rank: score rank reversed
    case = Case(sc, "cpu")
    case.snap = dataclasses.replace(case.snap, ad_id=np.array([5, 3, 8, 1, 7, 0, 2, 6, 4], dtype=np.int64) * 7 - 20)
    case.index = load_index(case.snap, "cpu")
    B = len(sc.requests)
    tokens = torch.tensor([sids] * B)
    score = torch.tensor([[-0.25 * i for i in range(n)]] * B)
    leaf = torch.tensor([[case.node(s) - case.gtm.depth_offsets[3] for s in sids]] * B)
    beams = Beams(tokens, score, leaf)
    want = brute_force(case, beams, None, "fused")
    for got in [expand(case.index, case.req, beams, rank="fused")] + [device_result(case, beams, impl, rank="fused")
                                                                        for impl in IMPLS]:
        check(got, want, False)
        first = got.request == 0
        assert len(set(got.score[first].tolist())) == n  # every ad its own score rank


@settings(max_examples=60, deadline=None)
@given(st.integers(0, 2**32 - 1), st.integers(1, 3), st.integers(1, 40), st.integers(1, 600), st.booleans())
def test_distinct_pairs_keep_each_ads_best_beam_through_collisions(seed, B, K, C, with_state):
    """The kernels' passes 1-3 (`distinct_pairs`) on raw arrays, request 0's ads all from a pool
    hashing to the last two cells of its table and the first (chains of collisions that wrap around
    its end, claimed across programs when it reaches more than a tile of slots): per request its
    reached pairs, and when they fit C each live ad once with the first beam of its best score
    (in any order), against a walk over the slots; none when they do not fit."""
    from runtime.ops.expand.kernel import distinct_pairs
    from runtime.ops.expand.layout import GENERATED, REACHED, SIDS
    from schemas.artifacts import AD_LIVE

    rng = np.random.default_rng(seed)
    S = int(rng.integers(1, 9))
    sizes = rng.integers(0, 13, S)
    leaf = rng.integers(-1, S, (B, K))
    score = rng.choice(np.float32([0.0, -0.0, -0.5, -1.0, -np.inf]), (B, K))
    alive = [[k for k in range(K) if leaf[b, k] >= 0 and score[b, k] > -np.inf] for b in range(B)]
    reached = [int(sum(sizes[leaf[b, k]] for k in alive[b])) for b in range(B)]
    n = 2 * max(reached[0], 1)  # request 0's cells (when it fits C)
    rows = np.arange(1 << 16)
    pool = rows[np.isin((((rows * 2654435761) & 0xFFFFFFFF) * n) >> 32, [n - 2, n - 1, 0])]
    lists = [rng.choice(pool[:60], int(m), replace=False) for m in sizes]
    offsets = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)
    leaf_ads = np.concatenate(lists).astype(np.int32)
    state = rng.choice(np.uint8([AD_LIVE, AD_LIVE, 1, 2]), 1 << 16) if with_state else None
    t = torch.from_numpy
    buf = torch.full((4 * B,), -7, dtype=torch.int64, device=DEVICE)
    pairs = distinct_pairs(t(leaf).to(DEVICE), t(score).to(DEVICE), t(offsets).to(DEVICE), t(leaf_ads).to(DEVICE),
                           None if state is None else t(state).to(DEVICE), C, buf, 4)
    buf = buf.cpu().numpy().reshape(4, B)
    ad, cell, best = (x.cpu().numpy() for x in pairs)
    assert buf[SIDS].tolist() == [len(a) for a in alive] and buf[REACHED].tolist() == reached
    for b in range(B):
        if reached[b] > C:  # an overflow holds nothing
            assert buf[GENERATED, b] == 0
            continue
        want = {}  # ad -> its best beam (the first of its best score)
        for k in alive[b]:
            for a in lists[leaf[b, k]]:
                if (state is None or state[a] == AD_LIVE) and (a not in want or score[b, k] > score[b, want[a]]):
                    want[a] = k
        G = buf[GENERATED, b]
        assert G == len(want)
        assert dict(zip(ad[b, :G].tolist(), (best[b, cell[b, :G]] % K).tolist())) == want


def test_auto_runs_the_kernels_on_every_cuda_tensor(monkeypatch):
    """"auto" picks the Triton kernels for CUDA tensors at any capacity (nothing has to fit one
    program's block), the torch reference for CPU tensors."""
    from types import SimpleNamespace

    import runtime.ops.expand as op
    import runtime.ops.expand.kernel as kernel

    monkeypatch.setattr(kernel, "expand_triton", lambda *args: "triton")
    monkeypatch.setattr(op, "expand_reference", lambda *args: "torch")
    layout = PostLayout(16, 1024, 1 << 20, 100, 4, "score", False, False)
    for dev, want in (("cuda", "triton"), ("cpu", "torch")):
        beams = SimpleNamespace(score=SimpleNamespace(device=torch.device(dev)))
        assert op.expand_beams(layout, {}, None, {}, None, beams, 0) == want


def test_the_capacity_is_the_callers_and_defaults_to_the_bound(monkeypatch):
    """`pairs` is the caller's; without it the bound (the ads of the K largest SIDs together), at
    most DEFAULT_PAIRS; T is at most the capacity; a capacity below 1 is refused."""
    import runtime.serving.post
    from tests.test_gtm import scenario

    sizes = (5, 3, 2)  # ads per SID
    sids = [(i, 0, 0) for i, m in enumerate(sizes) for _ in range(m)]
    case = Case(scenario([{"country": None, "locations": []}] * len(sids), sids, list(range(len(sids)))), "cpu")
    arrays = post_tensors(case.index)
    assert DevicePost(case.index, 2, 2, arrays=arrays).layout.pairs == 8
    assert DevicePost(case.index, 2, 5, arrays=arrays).layout.pairs == 10
    assert DevicePost(case.index, 2, 5, arrays=arrays, pairs=4, top_k=9).layout.kept == 4
    assert DevicePost(case.index, 2, 5, arrays=arrays, pairs=40, top_k=9).layout.kept == 9
    assert DEFAULT_PAIRS == 1 << 16
    monkeypatch.setattr(runtime.serving.post, "DEFAULT_PAIRS", 6)
    assert DevicePost(case.index, 2, 5, arrays=arrays).layout.pairs == 6
    for bad in (0, -3):
        with pytest.raises(ConfigError, match="a capacity of 1 to"):
            DevicePost(case.index, 2, 5, arrays=arrays, pairs=bad)


def test_the_kernels_refuse_beams_of_another_shape():
    """Beams that do not match the stage's (B, K), or strided along K, are refused before any
    launch (the kernels would read past them)."""
    from tests.test_gtm import scenario

    case = Case(scenario([{"country": None, "locations": []}], [(0, 0, 0)], [0]), "cpu")
    B = len(case.sc.requests)
    post = DevicePost(case.index, B, 2, arrays=post_tensors(case.index), impl="triton")
    wide = Beams(torch.zeros(B, 3, 3, dtype=torch.int64), torch.zeros(B, 3), torch.zeros(B, 3, dtype=torch.int64))
    strided = Beams(torch.zeros(B, 2, 3, dtype=torch.int64), torch.zeros(B, 4)[:, ::2],
                    torch.zeros(B, 2, dtype=torch.int64))
    for beams in (wide, strided):
        with pytest.raises(ValueError, match="beams: expected"):
            post.run(to_device(case.req, "cpu"), beams)


def test_the_device_path_needs_its_arrays():
    from tests.test_gtm import scenario

    sc = scenario([{"country": ["US"], "locations": []}], [(0, 0, 0)], [0])
    case = Case(sc, "cpu")
    with pytest.raises(ConfigError, match="needs an index loaded onto a GPU"):
        DevicePost(case.index, 1, 1)
    for bad in (0, -1):  # refused alike by both paths
        with pytest.raises(ConfigError, match="positive number"):
            DevicePost(case.index, 1, 1, top_k=bad, arrays=post_tensors(case.index))
        beams = Beams(torch.zeros(1, 1, 3, dtype=torch.int64), torch.zeros(1, 1), torch.zeros(1, 1, dtype=torch.int64))
        with pytest.raises(ConfigError, match="positive number"):
            expand(case.index, case.req, beams, top_k=bad)
    with pytest.raises(ConfigError, match="carries no ad values"):
        DevicePost(case.index, 1, 1, rank="value", arrays=post_tensors(case.index))
    valued = Case(dataclasses.replace(sc, values=[1.0]), "cpu")
    arrays = post_tensors(valued.index)
    del arrays["ad_value"]
    with pytest.raises(ConfigError, match="carry no ad values"):  # the kernels would read past the scores
        DevicePost(valued.index, 1, 1, rank="fused", arrays=arrays)
    with pytest.raises(ValueError, match="value or fused only with the ads' values"):
        PostLayout(1, 1, 1, 1, 3, "value", False, False)


# --- SIDs holding thousands of ads --------------------------------------------------------------

def skewed(sizes: tuple[int, ...], requests: int, seed: int, device: str = "cpu") -> tuple[Case, Beams]:
    """(case, beams): a catalog whose SID s holds sizes[s] ads (and every 7th ad also the next
    SID: ads reached twice), targeting from a few values (some ads eligible, some not), values
    from a few (ties), ad ids that are not the rows' order, some rows paused; `requests` requests
    (at most 2) whose beams are every SID in a random order with scores from SCORES (ads tie by
    the thousands), a SID outside the catalog and a dead beam."""
    from tests.test_gtm import scenario

    rng = np.random.default_rng(seed)
    n, S = sum(sizes), len(sizes)
    countries, places = [None, ["US"], ["GB"], ["US", "CA"]], [[], ["loc1"], ["loc3", "loc5"], None]
    ads = [{"country": countries[c], "locations": places[p]} for c, p in rng.integers(0, 4, (n, 2))]
    sid = [(s % 3, s // 3 % 2, s // 6) for s in range(S + 1)]  # the last one: outside the catalog
    owner = np.repeat(np.arange(S), sizes)
    sids = [sid[s] for s in owner] + [sid[(owner[a] + 1) % S] for a in range(0, n, 7)]
    sid_ads = list(range(n)) + list(range(0, n, 7))
    asked = [{"country": "US", "locations": ["loc1"]}, {"country": "GB", "locations": ["loc3", "nowhere"]}]
    sc = dataclasses.replace(scenario(ads, sids, sid_ads, requests=asked[:requests]),
                             values=rng.choice([0.5, 1.0, 1.0, 4.0], n).tolist())
    case = Case(sc, device, ad_state=rng.choice(np.uint8([0, 0, 0, 0, 1, 2]), n))
    case.snap = dataclasses.replace(case.snap, ad_id=rng.permutation(n).astype(np.int64) * 3 - n)
    case.index = load_index(case.snap, device)
    K = S + 2
    tokens = np.zeros((requests, K, 3), dtype=np.int64)
    score = rng.choice(np.float32(SCORES), (requests, K))
    leaf = np.full((requests, K), -1, dtype=np.int64)
    for r in range(requests):
        for k, s in enumerate(rng.permutation(S + 1)):
            tokens[r, k] = sid[s]
            leaf[r, k] = -1 if s == S else case.node(sid[s]) - case.gtm.depth_offsets[3]
        score[r, K - 1] = -np.inf  # dead
    return case, Beams(torch.from_numpy(tokens), torch.from_numpy(score), torch.from_numpy(leaf))


def test_the_reference_takes_a_sid_of_20000_ads():
    """The torch reference against the host path, bit for bit, with a SID of 20,000 ads (one tie
    group) and others of 3,000 and 500: each ranking, top_k 1, 100 and all; a capacity below the
    pairs reached reports the overflow."""
    case, beams = skewed((20_000, 3_000, 500, 7), 2, seed=5)
    reached = 23_507 + len(range(0, 23_507, 7))  # every catalog SID, each ad once, every 7th twice
    for rank, top_k in (("score", 1), ("value", 100), ("fused", None)):
        host = expand(case.index, case.req, beams, top_k, True, rank)
        post, got = device_post(case, beams, "torch", top_k=top_k, rank=rank, stages=True, max_values=4)
        assert got is not None and post.last_reached.tolist() == [reached] * 2
        same(host, got)
        assert host.ads_eligible.min() > 5_000  # ties by the thousand, ranked by ad_id
    post, got = device_post(case, beams, "torch", pairs=reached - 1, max_values=4)
    assert got is None and post.last_reached.tolist() == [reached] * 2


def test_the_kernels_take_sids_of_thousands_of_ads():
    """The Triton kernels (under the interpreter without a GPU) against the host path, bit for bit,
    with SIDs of 3,000 and 1,000 ads: a request's slots over many programs; top_k 1, 100 and all."""
    case, beams = skewed((3_000, 1_000, 40), 1, seed=11)
    for rank, top_k in (("score", 1), ("value", 100), ("fused", None)):
        host = expand(case.index, case.req, beams, top_k, True, rank)
        same(host, device_result(case, beams, "triton", top_k=top_k, rank=rank, stages=True))
    post, got = device_post(case, beams, "triton", pairs=4_000)
    assert got is None and post.last_reached.tolist() == [4_040 + len(range(0, 4_040, 7))]  # as above


@pytest.mark.skipif(not GPU, reason="the real kernels need a GPU")
@pytest.mark.parametrize("sizes", [(20_000, 3_000, 500, 7), (100_000, 2_000, 30)])
def test_the_kernels_on_a_gpu_take_a_sid_of_100000_ads(sizes):
    """On a GPU: `expand` (the kernels, at the default capacity, then sized to the pairs reached
    when they overflow it) and `DevicePost` at a capacity that holds them, against the host path,
    bit for bit; a capacity below them reports the overflow."""
    case, beams = skewed(sizes, 2, seed=7, device=DEVICE)
    cuda = moved(beams, DEVICE)
    for rank in RANKS:
        for top_k in (1, 100, None):
            host = expand(case.index, case.req, beams, top_k, True, rank)
            same(host, expand(case.index, case.dreq, cuda, top_k, True, rank))
            post = DevicePost(case.index, *beams.score.shape, top_k=top_k, rank=rank, stages=True, pairs=150_000)
            got = post.result(post.run(case.dreq, cuda))
            assert got is not None
            same(host, got)
    post = DevicePost(case.index, *beams.score.shape, pairs=sizes[0])
    assert post.result(post.run(case.dreq, cuda)) is None and post.last_reached.min() > sizes[0]


@settings(max_examples=15, deadline=None)
@given(scenarios(max_ads=12), st.integers(0, 2**32 - 1), st.sampled_from([None, 2]), st.sampled_from(RANKS))
def test_searcher_retrieve_is_search_then_post(sc, seed, top_k, rank):
    """`runtime.Searcher.retrieve` (on a GPU: search and device post stage captured in one graph,
    replayed for a second batch) returns what the search followed by `expand` returns."""
    from runtime.serving.searcher import Searcher
    from tests.test_runtime import TableScorer

    if rank != "score":
        sc = dataclasses.replace(sc, values=[float(v) for v in range(len(sc.ads))])
    case = Case(sc, DEVICE)
    beams = (1,) + (4,) * (case.gtm.sid_length - 1)
    scorer = TableScorer(case.gtm.vocab_size, seed)
    scorer.inputs = {}  # reads nothing per batch: capturable
    searcher = Searcher(beams, "cd+gtm")
    for _ in range(2):  # capture, then replay
        got = searcher.retrieve(case.index, case.req, scorer, top_k=top_k, rank=rank)
        same(got, expand(case.index, case.req, searcher.search(case.index, case.dreq, scorer), top_k, rank=rank))


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(0, 70), min_size=1, max_size=5), st.sampled_from(["random", "ranked", "reversed", "ties"]),
       st.integers(0, 2**32 - 1))
def test_segment_order_ranks_each_segment_as_a_sort_does(sizes, shape, seed):
    """The host ranking's sort (`runtime.ops.expand.host._segment_order`) against numpy's lexsort, per
    segment: keys ranked already (as the beams mostly deliver them, where merges only copy),
    reversed, random, or a few values tied throughout (ad_id decides)."""
    from runtime.ops.expand.host import _segment_order

    gen = np.random.default_rng(seed)
    n = sum(sizes)
    starts = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)
    if shape == "ties":
        first, second = gen.integers(0, 3, n).astype(np.float64), gen.integers(0, 2, n).astype(np.float64)
    else:
        first, second = gen.normal(size=n), np.zeros(n)
    ad_id = np.concatenate([gen.permutation(s) for s in sizes]).astype(np.int64)  # distinct per segment

    def ranked() -> np.ndarray:
        return np.concatenate([lo + np.lexsort((ad_id[lo:hi], -second[lo:hi], -first[lo:hi]))
                               for lo, hi in zip(starts[:-1], starts[1:])]).astype(np.int64)

    want = ranked()
    if shape in ("ranked", "reversed"):  # lay the rows out in (or against) their ranked order
        segments = zip(starts[:-1], starts[1:])
        perm = want if shape == "ranked" else np.concatenate([want[lo:hi][::-1] for lo, hi in segments])
        first, second, ad_id = first[perm], second[perm], ad_id[perm]
        want = ranked()
    np.testing.assert_array_equal(_segment_order(starts, first, second, ad_id), want)
