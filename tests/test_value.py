"""Value bounds and value-guided retrieval (docs/design.md §16) against brute force, on random catalogs.

- Every mask implementation (Triton under the interpreter, the torch reference, numba) reports the
  same bound for each candidate (and the same value-guided key, the kernel computing it fused); it
  is >= the value of every eligible ad beneath the candidate, the subtree's largest value (rounded
  up to float32) without partitions, and that too with partitions when nothing is restricted.
- Value-guided search equals a brute-force search by the same key; with beams wider than the
  catalog it returns exactly the eligible ads; a weight of 0, or one too small to move a float32
  key, gives the plain search's beams exactly.
- The post stage ranks by value and by reciprocal-rank fusion as defined; bad values in a catalog
  are refused naming the row, through the installed command too.
"""

from __future__ import annotations

import dataclasses
import math
import re
from pathlib import Path

import numpy as np
import polars as pl
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from runtime.ops.expand import RRF_K
from runtime.ops.gtm_mask import gtm_mask
from runtime.ops.gtm_mask.reference import VALUE_FLOOR, value_key
from runtime.search.beam import beam_search
from runtime.serving.post import expand
from schemas.artifacts import MAX_AD_VALUE
from sidindex.errors import ArtifactError, ConfigError, InputError
from sidindex.explain import Explainer
from sidindex.ingest import read_catalog
from sidindex.modes import Mode
from sidindex.snapshot.manifest import Counts
from sidindex.snapshot.validate import check_cover, check_structure
from sidindex.trie.build import round_up_f32
from sidindex.trie.match import entries_pass
from sidindex.trie.shard import Shard
from tests.conftest import interpreted, run_cli
from tests.test_gtm import build, eligible, requests_of, scenario, scenarios
from tests.test_runtime import DEVICE, GPU, MODES, Case, TableScorer, searched

# values chosen to tie, to vanish and to reach float32's rounding (1e30 is the largest accepted)
VALUES = st.one_of(st.sampled_from([0.0, 1e-9, 1.0, 3.0, 0.1 + 0.2, 1e19, 1e30]), st.floats(0, 100))


@st.composite
def valued(draw, max_ads: int = 12, unrestricted: bool = False):
    sc = draw(scenarios(max_ads=max_ads))
    if unrestricted:
        sc = dataclasses.replace(sc, ads=[{a: None for a in ad} for ad in sc.ads])
    return dataclasses.replace(sc, values=draw(st.lists(VALUES, min_size=len(sc.ads), max_size=len(sc.ads))))


def prefixes(case: Case) -> list[tuple[int, ...]]:
    """The token path of every trie node (node ids rise depth by depth, so parents come first)."""
    g = case.gtm
    out = [()] * g.num_nodes
    for v in range(g.num_nodes):
        for e in range(g.node_offsets[v], g.node_offsets[v + 1]):
            out[e + 1] = out[v] + (int(g.csr_tokens[e]),)
    return out


def ads_beneath(sc, prefix: tuple[int, ...]) -> set[int]:
    return {a for s, a in zip(sc.sids, sc.sid_ads) if tuple(s[:len(prefix)]) == prefix}


def masks(case: Case, cpu: Case, d: int, seed: int, mode: Mode):
    """Every node of depth d for every request (a third dead): the bound of each implementation."""
    g, B = case.gtm, len(case.sc.requests)
    nodes = np.arange(g.depth_offsets[d], g.depth_offsets[d + 1])
    node = torch.tensor(np.tile(nodes, B), dtype=torch.int64)
    req = torch.tensor(np.repeat(np.arange(B), len(nodes)), dtype=torch.int64)
    gen = torch.Generator().manual_seed(seed)
    score = torch.randn(len(node), generator=gen)
    score[::3] = float("-inf")
    logp = torch.randn(len(node), g.vocab_size, generator=gen)
    args = (case.index, case.dreq, d, req.to(DEVICE), node.to(DEVICE), score.to(DEVICE), logp.to(DEVICE), mode)
    ref, bound = (t.cpu() for t in gtm_mask(*args, impl="torch", with_bound=True))
    key = value_key(ref, bound, 2.0)
    for impl in ("triton", "numba"):
        c = case if impl == "triton" else cpu
        moved = (c.index, c.dreq, d, *(t.to(c.index.device) for t in (req, node, score, logp)), mode)
        out = gtm_mask(*moved, impl=impl, with_bound=True)
        assert torch.equal(out[0].cpu(), ref) and torch.equal(out[1].cpu(), bound), (impl, mode)
        fused = gtm_mask(*moved, impl=impl, value_weight=2.0)[1].cpu()  # the kernel computes the key itself
        assert torch.equal(fused == float("-inf"), key == float("-inf")), (impl, mode)
        assert torch.allclose(fused[key > float("-inf")], key[key > float("-inf")], rtol=1e-6, atol=1e-6), (impl, mode)
    assert torch.equal(ref, gtm_mask(*args, impl="torch").cpu())  # the bound changes no score
    return node, req, ref, bound


def candidates(sc, seed: int):
    """(mode, request, the candidate's SID prefix, its bound) for every candidate of every mask of
    `masks` (all implementations agreeing); no bound is reported where no candidate is."""
    case = Case(sc)
    cpu = Case(sc, "cpu") if GPU else case
    paths = prefixes(case)
    for d in range(case.gtm.sid_length):
        for mode in MODES:
            node, req, ref, bound = masks(case, cpu, d, seed, mode)
            assert not bound[ref == float("-inf")].any()  # no candidate, no bound
            for i, t in torch.nonzero(ref > float("-inf")).tolist():
                yield mode, int(req[i]), paths[int(node[i])] + (t,), float(bound[i, t])


def subtree_max(sc, prefix: tuple[int, ...]) -> float:
    """The largest value of the ads under `prefix`, rounded up to float32 as the index keeps it."""
    top = max(sc.values[a] for a in ads_beneath(sc, prefix))
    return float(round_up_f32(np.array([top]))[0])


@settings(max_examples=interpreted(6), deadline=None)
@given(valued(), st.integers(0, 2**32 - 1))
def test_every_mask_reports_one_bound_and_it_bounds_every_eligible_ad(sc, seed):
    for mode, r, child, b in candidates(sc, seed):
        ok = [a for a in ads_beneath(sc, child) if eligible(sc.spec, sc.ads[a], sc.requests[r])]
        assert b >= max((sc.values[a] for a in ok), default=0.0), (mode, child)  # an upper bound
        assert b == subtree_max(sc, child) if not mode.kway else b <= subtree_max(sc, child), (mode, child)


@settings(max_examples=interpreted(4), deadline=None)
@given(valued(unrestricted=True), st.integers(0, 2**32 - 1))
def test_with_nothing_restricted_the_bound_is_the_subtree_max_in_every_mode(sc, seed):
    for mode, _, child, b in candidates(sc, seed):
        assert b == subtree_max(sc, child), mode


def brute_force_by_value(case: Case, r: int, scorer: TableScorer, beams: tuple[int, ...], mode: Mode,
                         weight: float) -> dict:
    """{SID: score} of the live final beams, each step's candidates ranked by score + weight x
    log(max(bound, VALUE_FLOOR)), the bound from the CPU matcher (entry_value, or the passing
    partitions' part_value), one candidate at a time."""
    g, L, live = case.gtm, case.gtm.sid_length, [((), 0.0)]
    for d in range(L):
        cand = []
        for prefix, score in live:
            logp = scorer.one(prefix, case.sc.level_sizes[d])
            node = case.node(prefix)
            for t in case.allowed(r, prefix, mode):
                e = np.array([g.node_offsets[node] + np.searchsorted(g.csr_tokens[g.node_offsets[node]:
                                                                                  g.node_offsets[node + 1]], t)])
                if mode.gtm:
                    _, b = entries_pass(g, case.req.planes, e, np.array([r]), mode.kway, with_bound=True)
                else:
                    b = g.entry_value[e]
                s = score + float(logp[t])
                if not math.isnan(s) and s > float("-inf"):
                    cand.append((prefix + (t,), s, s + weight * math.log(max(float(b[0]), VALUE_FLOOR))))
        cand.sort(key=lambda c: -c[2])
        live = [(p, s) for p, s, _ in cand[:beams[d + 1] if d + 1 < L else beams[-1]]]
    return dict(live)


@settings(max_examples=6, deadline=None)
@given(valued(), st.integers(0, 2**32 - 1), st.lists(st.integers(1, 5), min_size=3, max_size=3),
       st.sampled_from([0.5, 1.0, 4.0]))
def test_value_guided_search_equals_brute_force(sc, seed, widths, weight):
    case = Case(sc)
    L = case.gtm.sid_length
    beams = (1, *widths)[:L] + (widths[-1],) * max(0, L - 4)
    scorer = TableScorer(case.gtm.vocab_size, seed)
    for mode in MODES:
        for impl in ("torch", "triton") + (() if GPU else ("numba",)):
            found = beam_search(case.index, case.dreq, scorer, beams, mode, impl, value_weight=weight)
            for r in range(len(sc.requests)):
                got, want = searched(case, found, r), brute_force_by_value(case, r, scorer, beams, mode, weight)
                assert got.keys() == want.keys(), (mode, impl, r)
                assert all(got[s] == pytest.approx(want[s], rel=1e-5, abs=1e-5) for s in got)  # log-probabilities


@settings(max_examples=6, deadline=None)
@given(valued(max_ads=15), st.integers(0, 2**32 - 1), st.sampled_from([0.5, 3.0]))
def test_wide_value_guided_beams_return_exactly_the_eligible_ads(sc, seed, weight):
    case = Case(sc)
    wide = (1,) + (10_000,) * (case.gtm.sid_length - 1)
    scorer = TableScorer(case.gtm.vocab_size, seed)
    for mode in MODES:
        found = beam_search(case.index, case.dreq, scorer, wide, mode, value_weight=weight)
        for rank in ("score", "value", "fused"):
            got = expand(case.index, case.req, found, rank=rank)
            top = expand(case.index, case.req, found, top_k=2, rank=rank)
            for r, req in enumerate(sc.requests):
                truth = {a for a, ad in enumerate(sc.ads) if eligible(sc.spec, ad, req)}
                mine = got.request == r
                assert set(got.ad_row[mine].tolist()) == truth, (mode, rank)
                check_ranking(got, mine, rank)
                assert top.ad_row[top.request == r].tolist() == got.ad_row[mine][:2].tolist()  # top-k is a prefix


def check_ranking(got, mine: np.ndarray, rank: str) -> None:
    """The rows of one request follow `rank`: score, value (then score), or the fused rank."""
    sc, val, ad_id = got.score[mine].astype(np.float64), got.value[mine], got.ad_id[mine]
    n = len(sc)
    by_score = sorted(range(n), key=lambda i: (-sc[i], ad_id[i]))
    by_value = sorted(range(n), key=lambda i: (-val[i], -sc[i], ad_id[i]))
    if rank == "fused":
        rs, rv = {i: k + 1 for k, i in enumerate(by_score)}, {i: k + 1 for k, i in enumerate(by_value)}
        want = sorted(range(n), key=lambda i: (-(1 / (RRF_K + rs[i]) + 1 / (RRF_K + rv[i])), ad_id[i]))
    else:
        want = by_score if rank == "score" else by_value
    assert list(range(n)) == want, rank
    assert got.rank[mine].tolist() == list(range(1, n + 1))


@settings(max_examples=4, deadline=None)
@given(valued(), st.integers(0, 2**32 - 1))
def test_a_zero_weight_is_the_plain_search(sc, seed):
    case = Case(sc)
    beams = (1,) + (3,) * (case.gtm.sid_length - 1)
    scorer = TableScorer(case.gtm.vocab_size, seed)
    for mode in MODES:
        plain = beam_search(case.index, case.dreq, scorer, beams, mode)
        for weight in (0.0, 1e-30):  # 1e-30 takes the value path, but moves no float32 key
            got = beam_search(case.index, case.dreq, scorer, beams, mode, value_weight=weight)
            assert torch.equal(got.tokens, plain.tokens) and torch.equal(got.score, plain.score), (mode, weight)


def test_value_options_are_checked():
    sc = scenario([{"country": ["US"], "locations": []}, {"country": None, "locations": []}], [(0, 0, 0), (1, 1, 1)],
                  [0, 1])
    plain, priced = Case(sc, "cpu"), Case(dataclasses.replace(sc, values=[1.0] * len(sc.ads)), "cpu")
    scorer = TableScorer(plain.gtm.vocab_size, 0)
    beams = (1,) + (2,) * (plain.gtm.sid_length - 1)
    for weight, index, mode, msg in [(-1.0, priced, "cd", "expected a number in"), (math.nan, priced, "cd", "in \\[0"),
                                     (1e39, priced, "cd", "in \\[0, 1e\\+06\\]"), (1.0, priced, "none", "use mode cd"),
                                     (1.0, plain, "cd", "carries no ad values")]:
        with pytest.raises(ConfigError, match=msg):
            beam_search(index.index, index.dreq, scorer, beams, mode, value_weight=weight)
    with pytest.raises(ConfigError, match="carries no ad values"):
        expand(plain.index, plain.req, beam_search(plain.index, plain.dreq, scorer, beams, "cd"), rank="value")
    with pytest.raises(ConfigError, match="expected one of score, value, fused"):
        expand(priced.index, priced.req, beam_search(priced.index, priced.dreq, scorer, beams, "cd"), rank="price")


@pytest.mark.parametrize("value,shown", [(float("nan"), "nan"), (-1.0, "-1.0"), (float("inf"), "inf"),
                                         (2e30, "2e+30"), (None, "is null")])
def test_bad_values_are_refused_naming_the_row(tmp_path, sample_dir, value, shown):
    cat = pl.read_parquet(sample_dir / "catalog.parquet").head(50)
    bad = cat.with_columns(pl.Series("value", [1.0] * 7 + [value] + [1.0] * 42, dtype=pl.Float64))
    bad.write_parquet(tmp_path / "catalog.parquet")
    with pytest.raises(InputError, match=rf"column 'value', row 7 \(ad_id {cat['ad_id'][7]}\).*{re.escape(shown)}"):
        read_catalog(tmp_path / "catalog.parquet")
    if value is None:  # the installed command: one line, exit 2, nothing published
        r = run_cli("build", "--catalog", tmp_path / "catalog.parquet", "--targeting", sample_dir / "targeting.toml",
                    "--out", tmp_path / "root")
        assert r.returncode == 2 and r.stderr.strip().count("\n") == 0 and "row 7" in r.stderr, r.stderr
        assert not (tmp_path / "root" / "CURRENT").exists()


@settings(max_examples=5, deadline=None)
@given(valued(), st.integers(0, 2**16))
def test_validation_refuses_bounds_that_do_not_bound(sc, seed):
    """Each relation of the value arrays, broken once: a value out of range, a SID's bound below one
    of its ads, a prefix's below a child's, partitions not starting from the entry's bound. A SID's
    bound below its ads is found by the cover check (validate, updates), the rest at every open."""
    g, _, _, exact, _ = build(sc)
    ad_id = np.arange(len(sc.ads))

    def check(cover: bool = True, **arrays):
        shard = Shard(0, g.level_sizes[0], dataclasses.replace(g, **arrays))
        check_structure(Path("."), [(Path("."), shard)], exact, ad_id, Counts.of([g], ad_id))
        if cover:
            check_cover(Path("."), shard.gtm, exact)

    check()  # as built: accepted
    rng = np.random.default_rng(seed)
    ev, no, first_leaf = g.entry_value, g.node_offsets, int(g.depth_offsets[g.sid_length]) - 1
    leaf = int(rng.integers(first_leaf, len(ev)))
    ad = int(g.leaf_ads[g.leaf_ad_offsets[leaf - first_leaf]])
    # (array, position, value, the array the error names: a SID below its ads names the bound)
    cases = [("ad_value", ad, np.inf, "ad_value"), ("entry_value", leaf, -1.0, "entry_value"),
             ("ad_value", ad, 2 * float(ev[leaf]) + 1, "entry_value" if 2 * float(ev[leaf]) + 1 <= MAX_AD_VALUE
              else "ad_value"),  # above its SID's bound, or out of range
             ("part_value", int(g.part_offsets[leaf]), np.nextafter(ev[leaf], np.float32(0)) if ev[leaf] else 1.0,
              "part_value")]
    inner = [e for e in range(first_leaf) if ev[no[e + 1]:no[e + 2]].max() > 0]
    if inner:  # a prefix just below its best child
        e = inner[int(rng.integers(len(inner)))]
        cases.append(("entry_value", e, np.nextafter(ev[no[e + 1]:no[e + 2]].max(), np.float32(0)), "entry_value"))
    for name, at, value, named in cases:
        a = getattr(g, name).copy()
        a[at] = value
        if name == "ad_value" and named == "entry_value":  # a SID's bound below its ad's value
            check(cover=False, **{name: a})  # an open serves it: no read depends on it
        with pytest.raises(ArtifactError, match=named):
            check(**{name: a})


@settings(max_examples=3, deadline=None)
@given(valued())
def test_explain_shows_the_bounds_the_search_weighs(sc):
    """Each step of `sidindex explain`: the union's bound, and with k-way the passing partitions'
    bound the mask reports (none when no partition passes); each ad its value."""
    case = Case(sc, "cpu")
    g, reqs = case.gtm, requests_of(sc)
    for r in range(len(sc.requests)):
        ex = Explainer(case.snap, reqs, r)
        for sid in g.leaf_sids():
            got = ex.sid(tuple(int(t) for t in sid))
            node = 0
            for step in got.steps:
                e = np.array([g.node_offsets[node] + np.searchsorted(
                    g.csr_tokens[g.node_offsets[node]:g.node_offsets[node + 1]], step.token)])
                ok, b = entries_pass(g, case.req.planes, e, np.array([r]), True, with_bound=True)
                assert step.bound == float(g.entry_value[e[0]])
                assert step.kway_bound == (float(b[0]) if ok[0] else None)
                node = int(g.csr_child_nodes[e[0]])
            assert [a.value for a in got.ads] == [sc.values[int(a.ad_id)] for a in got.ads]
