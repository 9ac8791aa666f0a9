"""The runtime against independent references (docs/design.md §3, §8).

- The CD+GTM mask: the Triton kernel (under TRITON_INTERPRET=1 without a GPU), the torch
  reference and the numba CPU path equal each other and the CPU matcher's verdicts, on random
  small indexes, in every mode; in the compact candidate layout too, slot by slot.
- Beam search equals a brute-force constrained beam search written here, in every mode, with
  compact and dense candidate layouts.
- With beams wider than the catalog, cd+gtm (and k-way) retrieval returns exactly the eligible ads
  (invariant 1); every mode returns only eligible ads (invariant 2) and catalog SIDs (invariant 3).
- NaN / -inf logits and beams that die never let a disallowed SID through.
"""

from __future__ import annotations

import dataclasses
import math
import os
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from runtime.index.loader import load_index
from runtime.ops.gtm_mask import gtm_candidates, gtm_mask
from runtime.ops.gtm_mask.kernel import gtm_mask_triton
from runtime.ops.planes import order_by_first_use, stack_tables
from runtime.ops.slots import slots_of
from runtime.requests import to_device
from runtime.search.beam import beam_search, parse_beams
from runtime.serving.post import expand
from sidindex.errors import ConfigError
from sidindex.modes import Mode
from sidindex.snapshot.snapshot import Snapshot
from sidindex.trie.match import passing_tokens
from sidindex.trie.patch import live_entries
from sidindex.trie.shard import Shard
from tests.conftest import interpreted
from tests.test_gtm import MANIFEST, Scenario, build, eligible, scenarios

GPU = torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1"
DEVICE = "cuda" if GPU else "cpu"
MODES = (Mode.CD, Mode.CD_GTM, Mode.CD_GTM_KWAY)


class Case:
    """A scenario built into an in-memory snapshot, loaded onto the test device."""

    def __init__(self, sc: Scenario, device: str = DEVICE, ad_state: np.ndarray | None = None) -> None:
        self.sc = sc
        self.gtm, _, _, self.exact, self.req = build(sc)
        if ad_state is not None:  # as an update leaves it: some rows paused or deleted
            self.gtm = dataclasses.replace(self.gtm, entry_live=live_entries(self.gtm, ad_state))
            self.exact = dataclasses.replace(self.exact, ad_state=ad_state)
        self.snap = Snapshot(Path("."), MANIFEST, sc.spec, (Shard(0, self.gtm.level_sizes[0], self.gtm),), self.exact,
                             np.arange(len(sc.ads), dtype=np.int64), codebook=None)
        self.index = load_index(self.snap, device)
        self.dreq = to_device(self.req, device)

    def allowed(self, r: int, prefix: tuple[int, ...], mode: Mode) -> list[int]:
        """Tokens allowed after `prefix` for request r: any of the level's ("none"), or the CPU matcher's."""
        if not mode.constrained:
            return list(range(self.sc.level_sizes[len(prefix)]))
        node = self.node(prefix)
        if node is None:
            return []
        return passing_tokens(self.gtm, self.req, r, node, mode).tolist()

    def node(self, prefix: tuple[int, ...]) -> int | None:
        g, node = self.gtm, 0
        for t in prefix:
            lo, hi = g.node_offsets[node], g.node_offsets[node + 1]
            e = lo + np.searchsorted(g.csr_tokens[lo:hi], t)
            if e == hi or g.csr_tokens[e] != t:
                return None
            node = int(g.csr_child_nodes[e])
        return node


# --- the mask -------------------------------------------------------------------------------------

MASKS = st.tuples(scenarios(), st.integers(0, 2**32 - 1), st.booleans())


@settings(max_examples=25, deadline=None)
@given(MASKS)
def test_mask_reference_equals_numba_and_cpu_matcher(drawn):
    """The torch reference and the numba path, dense and compact."""
    _mask_equals_reference(*drawn, kernels=False)


@settings(max_examples=interpreted(15, gpu=10), deadline=None)  # apart: under the interpreter an example costs seconds
@given(MASKS)
def test_mask_kernel_equals_reference_and_cpu_matcher(drawn):
    """The Triton kernel, dense and compact, with and without shared rows."""
    _mask_equals_reference(*drawn, kernels=True)


def _mask_equals_reference(sc, seed, updated, kernels: bool) -> None:
    state = np.random.default_rng(seed).choice(np.array([0, 0, 1, 2], dtype=np.uint8), len(sc.ads)) if updated \
        else None
    case = Case(sc, ad_state=state)
    cpu = Case(sc, "cpu", ad_state=state) if GPU else case  # the numba path reads CPU tensors
    g, B = case.gtm, len(sc.requests)
    gen = torch.Generator().manual_seed(seed)
    for d in range(g.sid_length):
        nodes = np.arange(g.depth_offsets[d], g.depth_offsets[d + 1])
        node = torch.tensor(np.tile(nodes, B), dtype=torch.int64)
        req = torch.tensor(np.repeat(np.arange(B), len(nodes)), dtype=torch.int64)
        score = torch.randn(len(node), generator=gen)
        score[::3] = float("-inf")  # dead beams
        logp = torch.randn(len(node), g.vocab_size, generator=gen)
        logp[logp > 1.5] = float("nan")  # NaN log-probs never pass
        K = len(nodes)
        width = case.index.most_children(d, K) + 2  # two slots past the widest case stay empty
        for mode in MODES:
            args = (case.index, case.dreq, d, req.to(DEVICE), node.to(DEVICE), score.to(DEVICE), logp.to(DEVICE), mode)
            ref = gtm_mask(*args, impl="torch").cpu()
            if kernels:
                assert torch.equal(ref, gtm_mask(*args, impl="triton").cpu()), mode
                if mode.gtm:  # the depth's distinct union rows tested once per request, then looked up
                    assert torch.equal(ref, gtm_mask_triton(*args, shared=True).cpu()), mode
            else:
                assert torch.equal(ref, gtm_mask(cpu.index, cpu.dreq, d, req, node, score, logp, mode, impl="numba")), \
                    mode
            # the compact layout: slot start[b, k] + c holds child c of beam k, then -inf
            want = torch.full((B, width), float("-inf"))
            for i in range(len(node)):
                b, k = divmod(i, K)
                lo, hi = g.node_offsets[int(node[i])], g.node_offsets[int(node[i]) + 1]
                first = sum(0 if score[b * K + j] == float("-inf") else
                            int(np.diff(g.node_offsets[int(node[b * K + j]):int(node[b * K + j]) + 2])[0])
                            for j in range(k))
                if score[i] > float("-inf"):
                    for c in range(hi - lo):
                        want[b, first + c] = ref[i, int(g.csr_tokens[lo + c])]
            for impl, cs in (("triton", case),) if kernels else (("torch", case), ("numba", cpu)):
                on = cs.index.device
                slots = slots_of(cs.index, node.reshape(B, K).to(on), score.reshape(B, K).to(on), width)
                got = gtm_candidates(cs.index, cs.dreq, d, slots, node.to(on), score.to(on), logp.to(on), mode, impl)
                assert torch.equal(got.cpu(), want), (mode, impl)
                if impl == "triton" and mode.gtm:
                    got = gtm_mask_triton(cs.index, cs.dreq, d, node.to(on), node.to(on), score.to(on), logp.to(on),
                                          mode, slots=slots, shared=True)
                    assert torch.equal(got.cpu(), want), (mode, "shared rows")
            for i in range(len(node)):
                want = set() if score[i] == float("-inf") else {
                    t for t in passing_tokens(g, case.req, int(req[i]), int(node[i]), mode).tolist()
                    if not math.isnan(logp[i, t])}
                got = set(torch.nonzero(ref[i] > float("-inf")).flatten().tolist())
                assert got == want, (mode, i)
                if state is not None and d == g.sid_length - 1:  # a SID is taken only with a live ad (brute force)
                    for t in got:
                        lo, hi = g.node_offsets[int(node[i])], g.node_offsets[int(node[i]) + 1]
                        leaf = int(g.csr_child_nodes[lo + np.searchsorted(g.csr_tokens[lo:hi], t)]) \
                            - int(g.depth_offsets[g.sid_length])
                        ads = g.leaf_ads[g.leaf_ad_offsets[leaf]:g.leaf_ad_offsets[leaf + 1]]
                        assert (state[ads] == 0).any(), (mode, i, t)
                for t in got:
                    assert ref[i, t] == score[i] + logp[i, t]


@settings(max_examples=25, deadline=None)
@given(scenarios())
def test_rows_by_first_use_name_the_same_rows(sc):
    """The loader's renumbering on a GPU (`order_by_first_use`): every entry and partition names a
    row with the same bits as before, and the numbers go up in order of first use."""
    g = Case(sc, "cpu").index.gtm
    parts = [p.part_index for p in g.planes] if g.part_offsets is not None else None
    args = ([p.table for p in g.planes], [p.index for p in g.planes], parts, "cpu")
    was, now = stack_tables(*args), order_by_first_use(stack_tables(*args))
    for p, plane in enumerate(g.planes):
        uses = [(was.index[p], now.index[p])] + ([] if parts is None else [(was.part_index[p], now.part_index[p])])
        for old, new in uses:
            assert torch.equal(was.tables[p][old.long()], now.tables[p][new.long()])
        seen: dict[int, int] = {}
        for r in torch.cat([new for _, new in uses]).tolist():
            seen.setdefault(r, len(seen))
        assert all(r == i for r, i in seen.items())  # each row first named after every lower one
        unused = sorted(set(range(len(plane.table))) - {int(r) for old, _ in uses for r in old.tolist()})
        assert torch.equal(now.tables[p][len(seen):], plane.table[unused])  # then the rows nothing names


# --- beam search ------------------------------------------------------------------------------------

class TableScorer:
    """Logits that depend only on the prefix (a fixed random table), so a brute force can ask for
    one prefix at a time what the batched search saw."""

    def __init__(self, V: int, seed: int, nan_share: float = 0.0) -> None:
        gen = torch.Generator().manual_seed(seed)
        self.table = torch.randn(4, 257, V, generator=gen) * 3
        if nan_share:
            self.table[torch.rand(self.table.shape, generator=gen) < nan_share] = float("nan")

        self._on: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}

    def __call__(self, step: int, prefix: torch.Tensor, parent: torch.Tensor | None = None) -> torch.Tensor:
        if prefix.device not in self._on:  # copied once per device, at the first (eager) call: a graph captures no copy
            self._on[prefix.device] = (self.table.to(prefix.device),
                                       torch.tensor([31, 7, 3], dtype=torch.int64, device=prefix.device))
        table, weights = self._on[prefix.device]
        key = (prefix * weights[:prefix.shape[-1]]).sum(-1) + prefix.shape[-1]
        return table[step % 4][key % 257]

    def one(self, prefix: tuple[int, ...], size: int) -> torch.Tensor:
        """The log-probabilities after `prefix` of a level of `size` tokens: over its first `size` logits,
        of which only the finite ones count (docs/design.md §12)."""
        logits = self(len(prefix), torch.tensor([[list(prefix)]], dtype=torch.int64))[0, 0, :size]
        inf = float("-inf")
        return torch.log_softmax(logits.nan_to_num(nan=inf, posinf=inf, neginf=inf), -1)


def brute_force_search(case: Case, r: int, scorer: TableScorer, beams: tuple[int, ...], mode: Mode) -> dict:
    """{SID: score} of the live final beams: per step every allowed child of every beam, best first."""
    live = [((), 0.0)]
    L = case.gtm.sid_length
    for d in range(L):
        cand = []
        for prefix, score in live:
            logp = scorer.one(prefix, case.sc.level_sizes[d])
            for t in case.allowed(r, prefix, mode):
                s = score + float(logp[t])
                if not math.isnan(s) and s > float("-inf"):
                    cand.append((prefix + (t,), s))
        cand.sort(key=lambda c: -c[1])
        live = cand[:beams[d + 1] if d + 1 < L else beams[-1]]
    return dict(live)


def searched(case: Case, found, r: int) -> dict:
    alive = found.alive[r].cpu()
    return {tuple(found.tokens[r, k].tolist()): float(found.score[r, k])
            for k in torch.nonzero(alive).flatten().tolist()}


BEAM_SEARCHES = st.tuples(scenarios(max_ads=12), st.integers(0, 2**32 - 1),
                          st.lists(st.integers(1, 6), min_size=3, max_size=3), st.sampled_from([0.0, 0.3]))


@settings(max_examples=25, deadline=None)
@given(BEAM_SEARCHES)
def test_beam_search_equals_brute_force(drawn):
    """The torch (and on the CPU numba) masks, compact and dense."""
    _beam_search_equals_brute_force(*drawn, lambda mode: ["torch"] + ([] if GPU or not mode.constrained else ["numba"]))


@settings(max_examples=interpreted(25), deadline=None)  # apart: under the interpreter an example costs seconds
@given(BEAM_SEARCHES)
def test_triton_beam_search_equals_brute_force(drawn):
    _beam_search_equals_brute_force(*drawn, lambda mode: ["triton"] if mode.constrained else [], dense=False)


def _beam_search_equals_brute_force(sc, seed, widths, nan_share, impls_of, dense: bool = True) -> None:
    case = Case(sc)
    L = case.gtm.sid_length
    beams = (1, *widths)[:L] + (widths[-1],) * max(0, L - 4)
    scorer = TableScorer(case.gtm.vocab_size, seed, nan_share)
    for mode in Mode:
        for impl, layout in [(i, "compact") for i in impls_of(mode)] + ([("torch", "dense")] if dense else []):
            found = beam_search(case.index, case.dreq, scorer, beams, mode, impl, layout=layout)
            for r in range(len(sc.requests)):
                got, want = searched(case, found, r), brute_force_search(case, r, scorer, beams, mode)
                assert got.keys() == want.keys(), (mode, impl, layout, r)
                for sid in got:
                    assert got[sid] == pytest.approx(want[sid], rel=1e-5, abs=1e-5)
                if mode.constrained:  # invariant 3: every live SID is in the catalog
                    assert all(case.node(sid) is not None for sid in got)


CAPPED = st.tuples(scenarios(max_ads=12), st.integers(0, 2**32 - 1),
                   st.lists(st.one_of(st.none(), st.integers(-2, 2)), min_size=4, max_size=4))


@settings(max_examples=12, deadline=None)
@given(CAPPED)
def test_capped_widths_overflow_exactly_when_a_step_needs_more(drawn):
    """A search with capped widths is flagged at the first step where the uncapped search had a
    request with more child entries than the capped step's slots, and equals it when not flagged.
    Caps: the uncapped search's most child entries per request at each step, give or take two.
    The torch mask here, the Triton one in the next test."""
    _capped_widths(*drawn, "torch")


@settings(max_examples=interpreted(12), deadline=None)  # apart: under the interpreter an example costs seconds
@given(CAPPED)
def test_capped_kernel_widths_overflow_exactly_when_a_step_needs_more(drawn):
    _capped_widths(*drawn, "triton")


def _capped_widths(sc, seed, offsets, impl: str) -> None:
    case = Case(sc)
    L = case.gtm.sid_length
    beams = (1, 3, 5, 5)[:L]
    scorer = TableScorer(case.gtm.vocab_size, seed)
    seen = {}
    exact = _laid_out(seen, "exact", lambda: beam_search(case.index, case.dreq, scorer, beams, Mode.CD_GTM, impl))
    widths = tuple(None if o is None else max(1, int(e.total.max()) + o) for o, e in zip(offsets, seen["exact"]))
    capped = _laid_out(seen, "capped", lambda: beam_search(case.index, case.dreq, scorer, beams, Mode.CD_GTM, impl,
                                                           widths=widths))
    needs = [int(e.total.max()) > c.width for e, c in zip(seen["exact"], seen["capped"])]
    shrunk = any(c.width < e.width for e, c in zip(seen["exact"], seen["capped"]))
    assert (capped.overflow is not None) == shrunk, impl
    flags = [False] * L if capped.overflow is None else capped.overflow.tolist()
    assert any(flags) == any(needs), impl
    if any(needs):  # the first step that overflowed (the later ones searched from inexact beams)
        assert flags.index(True) == needs.index(True), impl
    else:
        assert all(torch.equal(getattr(capped, f), getattr(exact, f)) for f in ("tokens", "score", "leaf")), impl
    with pytest.raises(ConfigError, match="one per step"):
        beam_search(case.index, case.dreq, scorer, beams, Mode.CD_GTM, widths=(0,) * L)


def _laid_out(seen: dict, name: str, search):
    """search(), recording under seen[name] the compact layout (`slots.Slots`) of each step."""
    import runtime.search.constraint as constraint

    real, seen[name] = constraint.slots_of, []

    def record(*args):
        seen[name].append(real(*args))
        return seen[name][-1]

    constraint.slots_of = record
    try:
        return search()
    finally:
        constraint.slots_of = real


@settings(max_examples=30, deadline=None)
@given(scenarios(max_ads=15), st.integers(0, 2**32 - 1))
def test_wide_beams_return_exactly_the_eligible_ads(sc, seed):
    case = Case(sc)
    wide = (1,) + (10_000,) * (case.gtm.sid_length - 1)
    scorer = TableScorer(case.gtm.vocab_size, seed)
    for mode in Mode:
        got = expand(case.index, case.req, beam_search(case.index, case.dreq, scorer, wide, mode))
        for r, req in enumerate(sc.requests):
            truth = {a for a, ad in enumerate(sc.ads) if eligible(sc.spec, ad, req)}
            ads = set(got.ad_row[got.request == r].tolist())
            assert ads <= truth, mode  # invariant 2, every mode
            if mode.constrained:  # invariant 1: nothing eligible is lost
                assert ads == truth, mode
        ranks = [got.rank[got.request == r].tolist() for r in range(len(sc.requests))]
        assert all(rk == list(range(1, len(rk) + 1)) for rk in ranks)
        for r in range(len(sc.requests)):
            assert np.all(np.diff(got.score[got.request == r]) <= 0)


@pytest.mark.skipif(not GPU, reason="needs a CUDA device")
@settings(max_examples=25, deadline=None)
@given(scenarios(max_ads=15), st.integers(0, 2**32 - 1))
def test_gpu_and_cpu_paths_give_the_same_beams(sc, seed):
    gpu, cpu = Case(sc, "cuda"), Case(sc, "cpu")
    scorer = TableScorer(gpu.gtm.vocab_size, seed)  # the same logits on both devices
    for mode in Mode:
        a = beam_search(gpu.index, gpu.dreq, scorer, (1, 3, 5, 5)[:gpu.gtm.sid_length], mode)
        b = beam_search(cpu.index, cpu.dreq, scorer, (1, 3, 5, 5)[:gpu.gtm.sid_length], mode)
        for r in range(len(sc.requests)):
            got, want = searched(gpu, a, r), searched(cpu, b, r)
            assert got.keys() == want.keys(), mode
            for sid in got:
                assert got[sid] == pytest.approx(want[sid], rel=1e-5, abs=1e-5)


def test_dead_logits_never_let_a_disallowed_sid_through():
    from tests.test_gtm import scenario

    ads = [{"country": ["US"], "locations": []}, {"country": ["CA"], "locations": ["loc1"]}]
    case = Case(scenario(ads, [(0, 0, 0), (2, 1, 3)], [0, 1], requests=[{"country": "GB", "locations": []},
                                                                         {"country": "US", "locations": []}]))
    V, wide = case.gtm.vocab_size, (1, 8, 8)

    def constant(value):
        return lambda step, prefix, parent: torch.full(prefix.shape[:2] + (V,), value, device=prefix.device)

    # request 0 (GB) has no eligible ad: cd+gtm returns nothing, never an unconstrained SID
    found = beam_search(case.index, case.dreq, constant(0.0), wide, Mode.CD_GTM)
    assert not found.alive[0].any() and searched(case, found, 1) .keys() == {(0, 0, 0)}
    # NaN everywhere: nothing passes in any mode
    for mode in MODES:
        assert not beam_search(case.index, case.dreq, constant(float("nan")), wide, mode).alive.any()

    # -inf on every allowed token, finite elsewhere: the beams die instead of taking disallowed tokens
    def against(step, prefix, parent):
        out = torch.zeros(prefix.shape[:2] + (V,), device=prefix.device)
        allowed = {0: [0, 2], 1: [0, 1], 2: [0, 3]}[step]
        out[..., allowed] = float("-inf")
        return out

    assert not beam_search(case.index, case.dreq, against, wide, Mode.CD).alive.any()


def test_parse_beams():
    assert parse_beams("1,512,1024,1024", 4) == (1, 512, 1024, 1024)
    for bad, message in [("1,2", "give 4"), ("2,4,4,4", "beams\\[0\\] must be 1"), ("1,x,2,2", "integers"),
                         ("1,0,2,2", "positive")]:
        with pytest.raises(ConfigError, match=message):
            parse_beams(bad, 4)


def test_codebook_scorer_is_the_residual_distance():
    from runtime.scorers.codebook import CodebookScorer
    from sidindex.config import SIDConfig
    from sidindex.sid.codebook import Codebook

    rng = np.random.default_rng(0)
    cents = (rng.standard_normal((5, 3)).astype(np.float32), rng.standard_normal((4, 3)).astype(np.float32))
    cb = Codebook(cents, 7, ("advertiser_id",), 1, None, SIDConfig())
    x = torch.from_numpy(rng.standard_normal((2, 3)).astype(np.float32))
    scorer = CodebookScorer(cb, x, temperature=2.0)
    prefix = torch.tensor([[[1, 3], [4, 0]], [[0, 0], [2, 2]]])
    for step in range(3):
        got = torch.log_softmax(scorer(step, prefix[..., :step]), -1)
        for b in range(2):
            for k in range(2):
                if step == 2:  # the hash level: uniform over its 7 tokens
                    want = torch.full((7,), -math.log(7))
                else:
                    r = x[b] - sum(torch.from_numpy(cents[p][prefix[b, k, p]]) for p in range(step))
                    want = torch.log_softmax(-((r - torch.from_numpy(cents[step])) ** 2).sum(1) / 2.0, 0)
                torch.testing.assert_close(got[b, k, :len(want)], want, rtol=1e-4, atol=1e-4)
                assert torch.all(got[b, k, len(want):] == float("-inf"))
