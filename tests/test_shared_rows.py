"""Shared rows (`runtime.ops.planes.shared_rows`): a depth's distinct matcher rows, tested once per
request before the search's first step, must decide what testing each entry's own rows decides.

- `shared_rows` names, for every child entry of a depth and every plane, a position holding that
  entry's row; the positions a depth names are its distinct rows, each once, of that plane, and
  the depths' positions do not overlap; it declines exactly the depths whose rows are not few
  (against counts made here with numpy).
- The Triton test of the set (under TRITON_INTERPRET=1 without a GPU) equals the torch reference,
  and both equal the CPU matcher's test of each depth's entries, on random catalogs and requests,
  with few locations and with tens to hundreds (the Bloom groups then tabled); `prepared` makes the
  same test and, in the same launch, the query tables' reference. (The mask with shared rows is
  compared with the reference in `test_runtime` and `test_query_tables`.)
- Beam search (and on a GPU the captured `Searcher`) with shared rows at every depth returns the
  torch reference's beams in every mode; a catalog whose unions saturate gets shared rows at the
  default thresholds, from the loader on a GPU and per call on the CPU, and searches exactly.
- On a GPU the loader gives an index the shared rows of every depth where they are few.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from runtime.ops.gtm_mask import gtm_candidates
from runtime.ops.gtm_mask.kernel import _shared, gtm_mask_triton
from runtime.ops.gtm_mask.reference import shared_pass_reference
from runtime.ops.planes.shared_rows import FEW, MOST_ROWS, shared_rows
from runtime.ops.planes.tables import query_tables_reference
from runtime.ops.prepare import passed_for, planned, prepared, shared_pass
from runtime.ops.slots import slots_of
from runtime.search.beam import beam_search
from runtime.serving.searcher import Searcher
from sidindex.config import KWayConfig
from sidindex.modes import Mode
from sidindex.targeting import BITMASK, BLOOM, Attribute, TargetingSpec
from sidindex.trie.match import entries_pass
from tests.conftest import interpreted
from tests.test_gtm import Scenario, eligible, scenarios
from tests.test_query_tables import VOCAB, crowded
from tests.test_runtime import GPU, Case, TableScorer


def _depth_entries(g, d: int) -> tuple[int, int]:
    return int(g.node_offsets[g.depth_offsets[d]]), int(g.node_offsets[g.depth_offsets[d + 1]])


@settings(max_examples=25, deadline=None)
@given(scenarios())
def test_shared_rows_name_each_entrys_row(sc):
    case = Case(sc, "cpu")
    g = case.gtm
    every = shared_rows(case.index.gtm, few=0, most=1 << 62)
    assert len(every) == g.sid_length
    named = []
    for d, got in enumerate(every):
        lo, hi = _depth_entries(g, d)
        if hi == lo:
            assert got is None
            continue
        distinct = [np.unique(p.index[lo:hi]) for p in g.planes]
        R = sum(len(u) for u in distinct)
        assert got.lo == lo and got.count == R and got.local.shape == (len(g.planes), hi - lo)
        rows, plane = got.rows.numpy(), got.plane.numpy()
        assert got.rows is every[0].rows and got.size == len(rows) == len(plane)  # one set for every depth
        for p, pl in enumerate(g.planes):
            local = got.local[p].numpy()
            assert (plane[local] == p).all()
            assert np.array_equal(rows[local], pl.index[lo:hi])
            positions = np.unique(local)  # each distinct row once
            assert np.array_equal(np.sort(rows[positions]), distinct[p])
            named.append(positions)
        # declined exactly where the rows are not few: fewer than `few` entries per row, or too many rows
        ratio = (hi - lo) // R
        assert shared_rows(case.index.gtm, few=ratio, most=R)[d] is not None
        assert shared_rows(case.index.gtm, few=ratio + 1, most=R)[d] is None
        assert shared_rows(case.index.gtm, few=0, most=R - 1)[d] is None
        assert (shared_rows(case.index.gtm)[d] is None) == (hi - lo < FEW * R or R > MOST_ROWS)
    named = np.concatenate(named)
    assert len(np.unique(named)) == len(named) == every[0].size  # the depths' positions do not overlap


def _check_pass(case: Case) -> None:
    g = case.gtm
    every = shared_rows(case.index.gtm, few=0, most=1 << 62)
    sr = next((s for s in every if s is not None), None)
    if sr is None:
        return
    want = shared_pass_reference(case.index, case.dreq, sr).cpu()
    got = shared_pass(case.index, case.dreq, sr)
    assert got.dtype == torch.int8 and torch.equal(got.cpu() != 0, want)
    # in one launch with the query tables, as a search makes them
    ready = prepared(case.dreq, dataclasses.replace(case.index, shared_rows=every)).stacked
    assert torch.equal(passed_for(ready, sr).cpu() != 0, want)
    tables = query_tables_reference(case.dreq.stacked)
    assert (ready.tables is None) == (tables is None)
    assert tables is None or torch.equal(ready.tables.cpu(), tables)
    # made by the first step's mask launch beside its own lanes, as a compact search makes them
    index = dataclasses.replace(case.index, shared_rows=every)
    for mode in (Mode.CD_GTM, Mode.CD_GTM_KWAY):
        reqs, plan = planned(case.dreq, index)
        B, V = case.dreq.batch, case.gtm.vocab_size
        dev = case.dreq.stacked.words.device
        node, score = torch.zeros(B, 1, dtype=torch.int64, device=dev), torch.zeros(B, 1, device=dev)
        slots = slots_of(index, node, score, max(index.most_children(0, 1), 1), True)
        logp = torch.log_softmax(torch.randn(B, V, generator=torch.Generator().manual_seed(B)), -1).to(dev)
        got = gtm_mask_triton(index, reqs, 0, node.flatten(), node.flatten(), score.flatten(), logp, mode,
                              slots=slots, prepare=plan)
        assert torch.equal(got, gtm_candidates(index, case.dreq, 0, slots, node.flatten(), score.flatten(), logp,
                                               mode, "torch")), mode
        assert torch.equal(passed_for(reqs.stacked, sr).cpu() != 0, want), mode
        assert tables is None or torch.equal(reqs.stacked.tables.cpu(), tables), mode
    for d, s in enumerate(every):
        if s is None:
            continue
        # the matcher's own test of each depth entry on the host: an entry passes iff its row of
        # every plane does
        local = s.local.cpu().numpy()
        entries = np.arange(s.lo, s.lo + local.shape[1])
        for b in range(case.dreq.batch):
            ok = entries_pass(g, case.req.planes, entries, np.full(len(entries), b), False)
            assert np.array_equal(ok, want[b, local].all(0).numpy()), (d, b)


@settings(max_examples=interpreted(20), deadline=None)
@given(scenarios())
def test_shared_pass_equals_reference_and_matcher(sc):
    _check_pass(Case(sc))


@settings(max_examples=interpreted(5, gpu=3), deadline=None)
@given(crowded())
def test_shared_pass_with_many_locations(sc):
    """Requests with tens to hundreds of locations: the Bloom groups go through query tables."""
    _check_pass(Case(sc))


class Fixed(TableScorer):
    inputs: dict = {}  # nothing to refresh: the logits depend on the prefix alone


def _same_beams(index, case: Case, seed: int) -> None:
    """Beam search on `index` (the case's, with its shared rows) returns the torch reference's beams."""
    scorer = Fixed(case.gtm.vocab_size, seed)
    beams = (1,) + (6,) * (case.gtm.sid_length - 1)
    for mode in (Mode.CD_GTM, Mode.CD_GTM_KWAY):
        want = beam_search(case.index, case.dreq, scorer, beams, mode, "torch")
        found = [beam_search(index, case.dreq, scorer, beams, mode, "triton"),
                 beam_search(index, case.dreq, scorer, beams, mode, "triton", layout="dense")]
        if GPU:  # captured with the shared rows' test inside the graph, then replayed
            searcher = Searcher(beams, mode)
            found += [searcher.search(index, case.dreq, scorer), searcher.search(index, case.dreq, scorer)]
            assert searcher.eager_reason is None
        for got in found:
            assert torch.equal(got.tokens, want.tokens) and torch.equal(got.score, want.score), mode


@settings(max_examples=interpreted(6), deadline=None)
@given(scenarios(max_ads=16), st.integers(0, 2**32 - 1))
def test_searches_with_shared_rows_at_every_depth_equal_the_reference(sc, seed):
    case = Case(sc)
    forced = shared_rows(case.index.gtm, few=0, most=1 << 62)
    _same_beams(dataclasses.replace(case.index, shared_rows=forced, generation=object()), case, seed)


def test_saturated_unions_get_shared_rows_by_default():
    """Every ad has the same targeting, so every union is one row per plane: 16 and 64 entries over
    2 rows pass the default thresholds at both depths."""
    spec = TargetingSpec((Attribute("country", BITMASK, values=("US", "GB")), Attribute("loc", BLOOM, bits=128,
                                                                                        hashes=2)))
    ads = [{"country": ["US"], "loc": VOCAB[:3]} for _ in range(64)]
    requests = [{"country": "US", "loc": VOCAB[2:4]}, {"country": "GB", "loc": VOCAB[:1]},
                {"country": None, "loc": VOCAB[1:2]}, {"country": "US", "loc": VOCAB[5:9]}]
    sc = Scenario(spec, ads, [(i % 16, i // 16) for i in range(64)], list(range(64)), (16, 4), requests,
                  KWayConfig(k=(2, 2)))
    case = Case(sc)
    for d in range(2):
        got = _shared(case.index, d, None)
        assert got is not None and got.count == 2, d
        if GPU:
            assert case.index.shared_rows[d] is not None, d
    _same_beams(case.index, case, 0)
    found = beam_search(case.index, case.dreq, Fixed(16, 0), (1, 64), Mode.CD_GTM, "triton")
    want = [sum(eligible(spec, ad, r) for ad in ads) for r in requests]  # brute force
    assert 0 in want and 64 in want
    assert found.alive.sum(1).tolist() == want  # beams wider than the catalog: exactly the eligible


@pytest.mark.skipif(not GPU, reason="needs a CUDA device")
@settings(max_examples=10, deadline=None)
@given(scenarios(max_ads=40))
def test_a_gpu_index_has_the_shared_rows_of_its_depths(sc):
    case = Case(sc, "cuda")
    assert len(case.index.shared_rows) == case.gtm.sid_length
    for d, (got, want) in enumerate(zip(case.index.shared_rows, shared_rows(case.index.gtm))):
        assert (got is None) == (want is None), d
        if got is not None:
            assert got.lo == want.lo and torch.equal(got.local, want.local) and torch.equal(got.rows, want.rows)
            assert torch.equal(got.plane, want.plane)
