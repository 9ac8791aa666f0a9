"""Query tables (`runtime.ops.planes.tables`): a request's many Bloom queries folded into
lookups must decide exactly what testing query by query decides.

- The Triton table builder (under TRITON_INTERPRET=1 without a GPU) equals its torch reference,
  query by query, for random query rows (int64 extremes, -1, alternating nibbles, and more than 64
  queries per request so a table takes several mask words).
- The mask kernel with tables equals the kernel testing query by query and the torch reference,
  in every mode, on catalogs whose requests carry tens to hundreds of locations; beam search with
  them returns the reference's beams. In the compact layout (dead beams, a width short of the slots
  in use) the tabled groups tested only on the lanes that passed the others, packed, give what
  testing them on every lane and the reference give.
- A Searcher captured for a batch with few queries per group re-captures for a batch whose tables
  need more mask words (the graph's tables have room for 64 queries per mask word).
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from runtime.ops.gtm_mask import gtm_mask
from runtime.ops.gtm_mask.kernel import gtm_mask_triton, packs
from runtime.ops.planes import TABLE_FROM, stack_queries
from runtime.ops.planes.tables import query_tables_reference
from runtime.ops.prepare import prepared, query_tables
from runtime.ops.slots import compact, slots_of
from runtime.requests import to_device
from runtime.search.beam import beam_search
from runtime.serving.searcher import Searcher
from sidindex.config import KWayConfig
from sidindex.matchers.plane import PlaneQueries
from sidindex.modes import Mode
from sidindex.request_encoding import encode_requests
from sidindex.targeting import BITMASK, BLOOM, Attribute, TargetingSpec
from tests.conftest import interpreted
from tests.test_gtm import Scenario, draw_catalog, requests_of
from tests.test_runtime import DEVICE, GPU, MODES, Case, TableScorer

EDGE_WORDS = np.array([0, -1, -2**63, 2**63 - 1, 1, 0x0F0F0F0F0F0F0F0F, -0x0F0F0F0F0F0F0F10], dtype=np.int64)


@st.composite
def query_sets(draw):
    """Random planes of queries: (planes, per-plane word groups), 1-3 requests."""
    B = draw(st.integers(1, 3))
    planes = []
    for _ in range(draw(st.integers(1, 2))):
        groups = draw(st.lists(st.integers(1, 3), min_size=1, max_size=3))
        offsets = np.concatenate([[0], np.cumsum(groups)]).astype(np.int64)
        # under the interpreter up to 80 queries, two mask words (each word's 64 queries an unrolled loop there)
        counts = np.array([[draw(st.integers(1, 140 if GPU else 80)) for _ in groups] for _ in range(B)],
                          dtype=np.int64)
        n = int(counts.sum())
        seed = draw(st.integers(0, 2**32 - 1))
        rng = np.random.default_rng(seed)
        rows = rng.integers(-2**63, 2**63 - 1, size=(n, int(offsets[-1])), dtype=np.int64, endpoint=True)
        rows &= rng.integers(-2**63, 2**63 - 1, size=rows.shape, dtype=np.int64, endpoint=True)  # sparser
        edge = rng.random(rows.shape) < 0.2
        rows[edge] = rng.choice(EDGE_WORDS, size=int(edge.sum()))
        # group-major storage as the encoders lay it out: group g's queries of every request, then g+1's
        ends = np.cumsum(counts.T.reshape(-1)).reshape(len(groups), B).T
        ranges = np.stack([ends - counts, ends], axis=-1)
        planes.append(PlaneQueries(torch.from_numpy(rows), torch.from_numpy(ranges), offsets, most=int(counts.max())))
    return planes


@settings(max_examples=interpreted(20, gpu=4), deadline=None)  # on a GPU each example compiles variants: 20 s
@given(query_sets())
def test_table_kernel_equals_reference(planes):
    _, stacked = stack_queries(planes, DEVICE, table_from=1)
    got, want = query_tables(stacked), query_tables_reference(stacked)
    assert torch.equal(got.cpu(), want)
    lay = stacked.layout
    assert lay.table_words == -(-max(p.max_queries for p in planes) // 64)
    # a query passes a row iff its table bit survives every chunk of the row: check against the rows
    # themselves for a few probe rows per group (the queries' own rows must pass their group)
    for g, t in enumerate(lay.group_table):
        p, lo, n_w = lay.group_plane[g], lay.group_lo[g], lay.group_words[g]
        for b in range(stacked.ranges.shape[0]):
            start, end = (int(x) for x in stacked.ranges[b, g])
            rows = planes[p].rows[start:end, lo:lo + n_w].cpu()
            for i, row in enumerate(rows):
                nib = ((row[:, None] >> (torch.arange(16) * 4)) & 15).reshape(-1)
                acc = torch.full((want.shape[2],), -1, dtype=torch.int64)
                for c, v in enumerate(nib.tolist()):
                    acc &= want[b, t, :, c, v]
                j, bit = divmod(i, 64)
                assert (int(acc[j]) >> bit) & 1


VOCAB = [f"place{i}" for i in range(300)]


@st.composite
def crowded(draw, max_ads: int = 14, max_requests: int = 3 if GPU else 2) -> Scenario:
    """Catalogs whose requests bring many locations (0..150, past one table's 64-query mask word);
    under the interpreter two requests at most (one tabled beside one not: each request's tables
    cost seconds there)."""
    attrs = [Attribute("country", BITMASK, values=("US", "GB", "CA"))]
    attrs += [Attribute(f"l{i}", BLOOM, bits=draw(st.sampled_from([64, 128, 256])), hashes=draw(st.integers(1, 3)))
              for i in range(draw(st.integers(1, 2)))]
    spec = TargetingSpec(tuple(attrs))
    level_sizes = tuple(draw(st.lists(st.integers(1, 4), min_size=2, max_size=3)))

    ads, sids, sid_ads = draw_catalog(draw, attrs, level_sizes, max_ads, VOCAB, max_values=4, max_sids=2)

    def request_value(a: Attribute):
        if a.kind == BITMASK:
            return draw(st.one_of(st.none(), st.sampled_from(a.values)))
        # past one 64-query mask word; under the interpreter past it by less (two words, not three)
        n = draw(st.sampled_from([0, 3, TABLE_FROM, 64, 65, 150 if GPU else 100]))
        return draw(st.permutations(VOCAB))[:n]

    requests = [{a.name: request_value(a) for a in attrs} for _ in range(draw(st.integers(1, max_requests)))]
    kway = KWayConfig(mode="dynamic", k_max=draw(st.integers(1, 3)), target_fill=0.5)
    values = draw(st.lists(st.floats(0, 100, width=32), min_size=len(ads), max_size=len(ads)))
    return Scenario(spec, ads, sids, sid_ads, level_sizes, requests, kway, values)


# each example runs tens of interpreted kernels, seconds to minutes by its draw: one per run there
@settings(max_examples=2 if GPU else 1, deadline=None)  # on a GPU 55 s an example (H200)
@given(crowded(), st.integers(0, 2**32 - 1))
def test_tabled_mask_equals_query_by_query_and_reference(sc, seed):
    case = Case(sc)
    g, B = case.gtm, len(sc.requests)
    assert any(t >= 0 for t in case.dreq.stacked.layout.group_table) == any(
        len(r[a.name]) >= TABLE_FROM for r in sc.requests for a in sc.spec.bloom)
    # the tables made once, as a search makes them (a mask without them makes them per call, as
    # `test_table_kernel_equals_reference` does; under the interpreter that costs several masks)
    ready = prepared(case.dreq, case.index)
    tables = query_tables_reference(case.dreq.stacked)
    assert (tables is None) == (ready.stacked.tables is None)
    assert tables is None or torch.equal(ready.stacked.tables.cpu(), tables)
    gen = torch.Generator().manual_seed(seed)
    # cd reads no request value (catalog validity only): under the interpreter, where each mask costs
    # seconds, the modes that read the tables
    modes = MODES if GPU else tuple(m for m in MODES if m is not Mode.CD)
    for d in range(g.sid_length):
        nodes = np.arange(g.depth_offsets[d], g.depth_offsets[d + 1])
        node = torch.tensor(np.tile(nodes, B), dtype=torch.int64, device=DEVICE)
        req = torch.tensor(np.repeat(np.arange(B), len(nodes)), dtype=torch.int64, device=DEVICE)
        score = torch.randn(len(node), generator=gen).to(DEVICE)
        logp = torch.randn(len(node), g.vocab_size, generator=gen).to(DEVICE)
        for mode in modes:
            rest = (d, req, node, score, logp, mode)
            ref = gtm_mask(case.index, case.dreq, *rest, impl="torch")
            args = (case.index, ready, *rest)
            assert torch.equal(gtm_mask_triton(*args), ref), (mode, d)
            # requests without tables: the mask makes them, per call (the same tables in every mode: under
            # the interpreter in one, as each making costs seconds there)
            if d == g.sid_length - 1 and (GPU or mode is modes[-1]):
                assert torch.equal(gtm_mask_triton(case.index, case.dreq, *rest), ref), (mode, d)
            assert torch.equal(gtm_mask_triton(*args, tabled=False), ref), (mode, d)
            assert torch.equal(gtm_mask_triton(*args, leads=(3, 5)), ref), (mode, d)  # streamed, then looked up
            # the distinct union rows tested once per request (streamed, then looked up), then looked up
            assert torch.equal(gtm_mask_triton(*args, shared=True, leads=(3, 0)), ref), (mode, d)
            # value bounds: k-way's first passing partition
            want = gtm_mask(case.index, case.dreq, *rest, impl="torch", with_bound=True)
            for shared in (None, True):
                got = gtm_mask_triton(*args, with_bound=True, shared=shared)
                assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1]), (mode, d, shared)
    scorer = TableScorer(g.vocab_size, seed)
    for mode in modes:
        want = beam_search(case.index, case.dreq, scorer, (1,) + (8,) * (g.sid_length - 1), mode, "torch")
        got = beam_search(case.index, case.dreq, scorer, (1,) + (8,) * (g.sid_length - 1), mode, "triton")
        assert torch.equal(got.tokens, want.tokens) and torch.equal(got.score, want.score), mode


@settings(max_examples=interpreted(4, gpu=2), deadline=None)  # as the test above: many variants an example
@given(crowded(), st.integers(0, 2**32 - 1))
def test_packed_compact_mask_equals_reference(sc, seed):
    """The compact layout with dead beams and a width short of some requests' slots: the tabled
    groups tested only on the lanes that passed the others, packed (`kernel.packs`: the GTM mode
    without k-way), or on every lane, with value bounds and keys."""
    case = Case(sc)
    g, B, mode = case.gtm, len(sc.requests), Mode.CD_GTM
    assume(packs(mode, None, case.dreq.stacked.layout, 0, True))  # some request brings a table's worth of locations
    ready = prepared(case.dreq, case.index)  # the tables made once, as a search makes them
    gen = torch.Generator().manual_seed(seed)
    for d in range(g.sid_length):
        nodes = np.arange(g.depth_offsets[d], g.depth_offsets[d + 1])
        K = len(nodes)
        node = torch.tensor(np.tile(nodes, B), dtype=torch.int64, device=DEVICE)
        req = torch.tensor(np.repeat(np.arange(B), K), dtype=torch.int64, device=DEVICE)
        score = torch.randn(len(node), generator=gen)
        score[::3] = float("-inf")
        score = score.to(DEVICE)
        logp = torch.randn(len(node), g.vocab_size, generator=gen).to(DEVICE)
        width = max(1, case.index.most_children(d, K) - 1)
        slots = slots_of(case.index, node.reshape(B, K), score.reshape(B, K), width)
        rest = (d, req, node, score, logp, mode)
        want = (case.index, case.dreq, *rest)
        ref = compact(case.index, gtm_mask(*want, impl="torch"), slots)
        bound = compact(case.index, gtm_mask(*want, impl="torch", with_bound=True)[1], slots, 0.0)
        args = (case.index, ready, *rest)
        keys = []
        for pack in (True, False):  # (by default only steps of `kernel.PACK_FROM` lanes or more pack)
            assert torch.equal(gtm_mask_triton(*args, slots=slots, pack=pack), ref), (d, pack)
            got = gtm_mask_triton(*args, slots=slots, pack=pack, with_bound=True)
            assert torch.equal(got[0], ref) and torch.equal(got[1], bound), (d, pack)
            got = gtm_mask_triton(*args, slots=slots, pack=pack, value_weight=0.5)
            assert torch.equal(got[0], ref), (d, pack)
            keys.append(got[1])
        assert torch.equal(keys[0], keys[1]), d  # the same arithmetic (test_value: against the reference's)
        # packed chunks smaller than a program's survivors (several chunks per program)
        assert torch.equal(gtm_mask_triton(*args, slots=slots, shape=(64, 1), pack=True), ref), d


class Fixed(TableScorer):
    inputs: dict = {}  # nothing to refresh: the logits depend on the prefix alone


@pytest.mark.skipif(not GPU, reason="needs a CUDA device")
def test_a_searcher_recaptures_when_its_tables_are_too_small():
    """A batch with more queries per request than the captured graph's tables hold is captured
    anew (its query rows still fit the graph's buffers); batches with fewer replay the wider
    graph. Every result equals the torch reference's."""
    spec = TargetingSpec((Attribute("country", BITMASK, values=("US", "GB")), Attribute("loc", BLOOM, bits=256,
                                                                                        hashes=2)))
    ads = [{"country": [("US", "GB")[i % 2]], "loc": VOCAB[i * 7 % 297:i * 7 % 297 + 3]} for i in range(40)]
    sids = [(i % 4, i // 4 % 4, i // 16) for i in range(40)]
    sc = Scenario(spec, ads, sids, list(range(40)), (4, 4, 3), [], KWayConfig())
    case = Case(dataclasses.replace(sc, requests=[{"country": "US", "loc": VOCAB[:20]}] * 2))
    scorer = Fixed(case.gtm.vocab_size, 0)
    searcher, words, graphs = Searcher((1, 4, 8), Mode.CD_GTM), [], []
    # locations of the batch's two requests: 64 rows (room for 128 in the graph), tables of 1 mask
    # word; then 101 rows, 2 words (captured anew: room for 202 rows); 40 rows, 1 word (replayed);
    # 151 rows, 3 words (captured anew)
    for n in ((60, 4), (100, 1), (20, 20), (150, 1)):
        reqs = [{"country": "US", "loc": VOCAB[r:r + k]} for r, k in enumerate(n)]
        dreq = to_device(encode_requests(requests_of(dataclasses.replace(sc, requests=reqs)), spec), "cuda")
        got = searcher.search(case.index, dreq, scorer)
        want = beam_search(case.index, dreq, scorer, (1, 4, 8), Mode.CD_GTM, "torch")
        assert torch.equal(got.tokens, want.tokens) and torch.equal(got.score, want.score), n
        g = searcher._graphs[(2, None)]
        words.append(g.requests.stacked.layout.table_words)
        graphs.append(g.graph)
    assert searcher.eager_reason is None and words == [1, 2, 2, 3]
    assert graphs[1] is not graphs[0] and graphs[2] is graphs[1] and graphs[3] is not graphs[2]
