"""`runtime.Searcher`: on a GPU, searches replayed from captured CUDA graphs equal eager searches,
batch after batch (new requests and new scorer inputs replayed through one graph), in every mode;
on the CPU it searches eagerly and says why."""

from __future__ import annotations

import math

import pytest
import torch

from runtime.requests import to_device
from runtime.search.beam import beam_search
from runtime.serving.post import expand
from runtime.serving.searcher import Searcher, fitted_pairs, post_room
from runtime.studies.decoder import DecoderScorer, ReferenceDecoder, context_tokens
from sidindex.errors import ConfigError
from sidindex.modes import Mode
from sidindex.request_encoding import encode_requests
from tests.test_gtm import requests_of, scenario
from tests.test_post import same as same_retrieved
from tests.test_runtime import DEVICE, GPU, Case

SMALL = dict(context_vocab=50, context_length=6, d_model=32, layers=2, heads=2)
ADS = [{"country": None if c is None else [c], "locations": locs} for c, locs in
       [("US", []), ("CA", ["loc1"]), ("GB", ["loc2", "loc3"]), ("US", ["loc3"]), (None, []), ("CA", [])]]
SIDS = [(0, 0, 0), (2, 1, 3), (1, 1, 2), (0, 1, 1), (2, 0, 0), (1, 0, 3)]


def batches(case: Case, device: str):
    """The scenario's requests as two equal-size batches on `device`."""
    req = requests_of(case.sc)
    half = len(req) // 2
    return [to_device(encode_requests(req.rows(lo, lo + half), case.sc.spec), device) for lo in (0, half)]


def same(a, b) -> bool:
    return torch.equal(a.tokens, b.tokens) and torch.equal(a.score, b.score) and torch.equal(a.leaf, b.leaf)


@pytest.mark.skipif(not GPU, reason="needs a CUDA device")
def test_replayed_searches_equal_eager_ones():
    case = Case(scenario(ADS, SIDS, list(range(len(ADS)))), "cuda")
    model = ReferenceDecoder(case.sc.level_sizes, **SMALL).cuda().eval()
    for mode in Mode:
        searcher = Searcher((1, 3, 4), mode)
        for i, dreq in enumerate(batches(case, "cuda") * 2):
            ctx = context_tokens([[i, r] for r in range(dreq.batch)], SMALL["context_length"], SMALL["context_vocab"],
                                 "cuda")
            got = searcher.search(case.index, dreq, DecoderScorer(model, ctx))
            want = beam_search(case.index, dreq, DecoderScorer(model, ctx), (1, 3, 4), mode)
            assert same(got, want), (mode, i)
        # one batch size: its capped graph and, beside it, its worst case, each captured once
        assert searcher.eager_reason is None and searcher.captures == 2
        assert sorted(full for (_, _, full) in searcher._graphs) == [False, True]


@pytest.mark.skipif(not GPU, reason="needs a CUDA device")
def test_a_swapped_index_is_captured_anew_and_the_old_results_stand():
    """Serving from a watcher: each batch takes the current index; a swap re-captures, a result
    already returned is not touched by later replays, and going back to an index re-captures it."""
    old = Case(scenario(ADS, SIDS, list(range(len(ADS)))), "cuda")
    new = Case(scenario(ADS, SIDS[::-1], list(range(len(ADS)))), "cuda")
    model = ReferenceDecoder(old.sc.level_sizes, **SMALL).cuda().eval()
    searcher, kept = Searcher((1, 3, 4), Mode.CD_GTM), []
    for i, case in enumerate([old, old, new, new, old]):
        dreq = batches(case, "cuda")[0]
        ctx = context_tokens([[i, r] for r in range(dreq.batch)], SMALL["context_length"], SMALL["context_vocab"],
                             "cuda")
        got = searcher.search(case.index, dreq, DecoderScorer(model, ctx))
        want = beam_search(case.index, dreq, DecoderScorer(model, ctx), (1, 3, 4), Mode.CD_GTM)
        assert same(got, want), i
        kept.append((got, want))
        assert searcher._index is case.index
    assert all(same(got, want) for got, want in kept)


def test_a_batch_past_the_capped_widths_is_searched_again_wider():
    """A slack far too small (mode cd, whose beams all live, so a step has every child of its
    beams): the search overflows until the slack has doubled enough; each result (search, and
    search + post) is still the uncapped search's."""
    case = Case(scenario(ADS, SIDS, list(range(len(ADS)))), DEVICE)
    model = ReferenceDecoder(case.sc.level_sizes, **SMALL).to(DEVICE).eval()
    searcher = Searcher((1, 3, 4), Mode.CD, slack=0.1)
    host = encode_requests(requests_of(case.sc), case.sc.spec)
    dreq = to_device(host, DEVICE)
    ctx = context_tokens([[1, r] for r in range(dreq.batch)], SMALL["context_length"], SMALL["context_vocab"], DEVICE)
    want = beam_search(case.index, dreq, DecoderScorer(model, ctx), (1, 3, 4), Mode.CD)
    assert same(searcher.search(case.index, dreq, DecoderScorer(model, ctx)), want)
    widened = searcher.widened
    assert widened >= 1 and sum(math.log2(s / 0.1) for s in searcher.step_slack.values()) == widened
    got = searcher.retrieve(case.index, host, DecoderScorer(model, ctx))
    same_retrieved(got, expand(case.index, host, want))
    assert searcher.widened == widened  # the slack it reached is kept
    assert same(searcher.search(case.index, dreq, DecoderScorer(model, ctx)), want)
    fresh = Searcher((1, 3, 4), Mode.CD, slack=0.1)  # widened by search + post first
    same_retrieved(fresh.retrieve(case.index, host, DecoderScorer(model, ctx)), got)
    assert fresh.widened == widened and fresh.step_slack == searcher.step_slack
    for bad in (float("nan"), -1.0, float("inf")):
        with pytest.raises(ConfigError, match="slack"):
            Searcher((1, 3, 4), Mode.CD, slack=bad)


def test_once_frozen_a_batch_past_the_widths_is_answered_by_the_worst_case_and_nothing_widens():
    """A warm searcher (`frozen`) with a slack far too small: every batch overflows, and is answered
    at once by the worst case (on a GPU its graph, captured beside the capped one at the first
    batch), equal to the uncapped search and post stage; no search is widened, and after the first
    batch nothing is captured or compiled (the counters)."""
    from runtime.ops.compiles import compiles

    case = Case(scenario(ADS, SIDS, list(range(len(ADS)))), DEVICE)
    model = ReferenceDecoder(case.sc.level_sizes, **SMALL).to(DEVICE).eval()
    searcher = Searcher((1, 3, 4), Mode.CD, slack=0.1)
    searcher.freeze()
    host = encode_requests(requests_of(case.sc), case.sc.spec)
    dreq = to_device(host, DEVICE)
    for i in range(3):
        ctx = context_tokens([[i, r] for r in range(dreq.batch)], SMALL["context_length"], SMALL["context_vocab"],
                             DEVICE)
        want = beam_search(case.index, dreq, DecoderScorer(model, ctx), (1, 3, 4), Mode.CD)
        before = (searcher.captures, compiles())
        assert same(searcher.search(case.index, dreq, DecoderScorer(model, ctx)), want)
        same_retrieved(searcher.retrieve(case.index, host, DecoderScorer(model, ctx)),
                       expand(case.index, host, want))
        assert searcher.overflows == 2 * (i + 1) and searcher.widened == 0 and not searcher.step_slack
        if i:  # the first batch captured the graphs (search, search + post: each capped and worst case)
            assert (searcher.captures, compiles()) == before
    assert searcher.captures == (4 if GPU else 0)


def test_a_captured_post_stage_holds_no_more_room_than_the_beams_can_reach():
    """`post_room`: the fitted room (twice a warm-up's most, a power of 2) is cut to the bound; the
    worst case keeps its default room unless the fitted one passes it."""
    assert post_room(None, False, 5_000) is None and post_room(None, True, 5_000) is None  # DevicePost's default
    assert post_room(fitted_pairs(37_969), False, 39_074) == 39_074  # 131,072 fitted: room nothing fills
    assert post_room(fitted_pairs(700), False, 39_074) == 2_048
    assert post_room(2_048, True, 39_074) is None
    assert post_room(131_072, True, 200_000) == 131_072 and post_room(131_072, True, 39_074) == 39_074
    assert post_room(1_024, False, 0) == 1  # an index whose leaves hold no ads


@pytest.mark.skipif(not GPU, reason="needs a CUDA device")
def test_a_settled_searcher_captures_its_post_stage_at_most_at_the_bound():
    """On a catalog whose 4 beams reach at most 4 pairs, the fitted room (at least 1,024) is cut to
    4: the graph of the warm-up's batch size keeps its room, another batch size is captured at it,
    and the answers stay those of the host post stage."""
    case = Case(scenario(ADS, SIDS, list(range(len(ADS)))), "cuda")
    model = ReferenceDecoder(case.sc.level_sizes, **SMALL).cuda().eval()
    req = requests_of(case.sc)
    assert len(req) >= 2
    searcher = Searcher((1, 3, 4), Mode.CD_GTM)

    def check(host) -> None:
        ctx = context_tokens([[0, r] for r in range(host.batch)], SMALL["context_length"], SMALL["context_vocab"],
                             "cuda")
        got = searcher.retrieve(case.index, host, DecoderScorer(model, ctx))
        want = beam_search(case.index, to_device(host, "cuda"), DecoderScorer(model, ctx), (1, 3, 4), Mode.CD_GTM)
        same_retrieved(got, expand(case.index, host, want))

    check(encode_requests(req, case.sc.spec))  # warming: reaches a few pairs
    searcher.settle()
    assert searcher.pairs == fitted_pairs(searcher.most_reached) >= 1024
    captures = searcher.captures
    check(encode_requests(req, case.sc.spec))  # its graph kept: its room is the bound either way
    assert searcher.captures == captures
    check(encode_requests(req.rows(0, len(req) // 2), case.sc.spec))  # captured after settle
    assert searcher.captures > captures
    rooms = {g.post.layout.pairs for (_, post, _), g in searcher._graphs.items() if post is not None}
    assert rooms == {case.index.post_bounds.most_pairs(4)} == {4}


def test_a_graphs_two_slots_are_held_until_read_and_a_waiting_caller_takes_the_first_freed():
    """The slots `Searcher.submit` replays on (on a GPU), on stand-in graphs: two batches take
    both; a third is refused without waiting (wait False), or told to read one when this thread
    holds both; another thread's waits, and takes the first slot read."""
    import threading
    from types import SimpleNamespace

    from runtime.serving.searcher import _Busy, _Graph

    searcher = Searcher((1, 3, 4), Mode.CD_GTM)
    staged = SimpleNamespace(requests=SimpleNamespace(batch=4))
    g = _Graph(None, staged, None, True, None, None, None, done=None)
    g.twin = _Graph(None, staged, None, True, None, None, None, done=None)
    with searcher._lock:
        first, second = searcher._slot(g), searcher._slot(g)
        assert {id(first), id(second)} == {id(g), id(g.twin)}
        with pytest.raises(_Busy):
            searcher._slot(g, wait=False)
        with pytest.raises(ConfigError, match="read one"):
            searcher._slot(g)
    got = []

    def take() -> None:
        with searcher._lock:
            got.append(searcher._slot(g))

    waiting = threading.Thread(target=take, daemon=True)
    waiting.start()
    waiting.join(0.2)
    assert waiting.is_alive() and not got  # both slots held
    with searcher._reading(second):  # read: its slot freed
        pass
    waiting.join(10)
    assert not waiting.is_alive() and got == [second] and second.holder == waiting.ident
    assert first.holder == threading.get_ident()
    # an overflow another thread counts while this one waits is not this thread's batch's
    other = threading.Thread(target=searcher._stall, args=("overflows",))
    other.start()
    other.join()
    assert searcher.overflows == 1 and searcher._stalls() == (0, 0, 0)


def test_on_the_cpu_it_searches_eagerly_and_says_why():
    case = Case(scenario(ADS, SIDS, list(range(len(ADS)))), "cpu")
    model = ReferenceDecoder(case.sc.level_sizes, **SMALL).eval()
    searcher = Searcher((1, 3, 4), Mode.CD_GTM)
    for dreq in batches(case, "cpu"):
        ctx = context_tokens([[1, 2]] * dreq.batch, SMALL["context_length"], SMALL["context_vocab"], "cpu")
        got = searcher.search(case.index, dreq, DecoderScorer(model, ctx))
        assert same(got, beam_search(case.index, dreq, DecoderScorer(model, ctx), (1, 3, 4), Mode.CD_GTM))
    assert searcher.eager_reason == "the index is on the CPU"
