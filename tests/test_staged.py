"""A batch staged at the fixed places a captured search reads (`runtime.requests.Staged`) is searched
and filtered as its own encoding is: the staging's views (made once, with room) after a larger
batch was loaded into them, so rows and hashes of the earlier batch lie past the new one's, and
whether the batch comes as its host encoding or already on the device. `fits` refuses what the room
cannot hold. On a GPU the search is `runtime.Searcher`'s replay, which `tests/test_serving.py`
checks; here every array is a CPU tensor.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from runtime.ops.planes import TABLE_FROM
from runtime.requests import Staged, to_device
from runtime.search.beam import beam_search
from runtime.serving.post import DevicePost, post_tensors
from sidindex.modes import Mode
from sidindex.request_encoding import encode_requests
from sidindex.targeting import BLOOM
from tests.test_gtm import requests_of, scenarios
from tests.test_post import same
from tests.test_runtime import Case, TableScorer
from tests.test_serving import same as same_beams


def fewer_values(sc, draw):
    """The scenario's requests with some bloom values dropped (fewer query rows and hashes)."""
    out = []
    for r in sc.requests:
        r = dict(r)
        for a in sc.spec.attributes:
            if a.kind == BLOOM and r[a.name]:
                r[a.name] = r[a.name][:draw(st.integers(0, len(r[a.name])))]
        out.append(r)
    return dataclasses.replace(sc, requests=out)


@settings(max_examples=20, deadline=None)
@given(scenarios(max_ads=12), st.integers(0, 2**32 - 1), st.booleans(), st.sampled_from([None, TABLE_FROM, 64]),
       st.data())
def test_a_staged_batch_searches_and_filters_as_its_own_encoding(sc, seed, on_device, bound, data):
    """bound: the staging's queries per request for a group of several (None: the first batch's);
    from TABLE_FROM on, the staged layout tables those groups, which the batches' own does not."""
    case = Case(sc, "cpu")
    rows = tuple(2 * len(q.rows) + 1 for q in case.req.planes)
    hashes = tuple(None if e is None else 2 * len(e.hashes) + 1 for e in case.req.exact)
    most = None if bound is None else tuple(q.max_queries if q.single else max(bound, q.max_queries)
                                            for q in case.req.planes)
    staged = Staged(case.req, rows, hashes, torch.device("cpu"), most)
    if bound is not None and any(not q.single and q.ranges.shape[1] for q in case.req.planes):
        assert staged.layout.table_words > 0 and to_device(case.req, "cpu").stacked.layout.table_words == 0
    assert staged.fits(case.req)
    staged.put(case.req)  # a batch of more values first: its rows and hashes stay past the next one's
    later = encode_requests(requests_of(fewer_values(sc, data.draw)), sc.spec)
    assert staged.fits(later)
    staged.put(to_device(later, "cpu") if on_device else later)
    beams = (1,) + (3,) * (case.gtm.sid_length - 1)
    scorer = TableScorer(case.gtm.vocab_size, seed)
    own = to_device(later, "cpu")
    arrays = post_tensors(case.index, "cpu")
    twin = staged.another()  # a graph's second slot: the same room, its own buffers, given the staged batch
    twin.put(staged.requests)
    assert twin.fits(later) and twin.layout == staged.layout and twin.host.data_ptr() != staged.host.data_ptr()
    for mode in (Mode.CD, Mode.CD_GTM):
        got = beam_search(case.index, staged.requests, scorer, beams, mode)
        want = beam_search(case.index, own, scorer, beams, mode)
        assert same_beams(got, want)
        assert same_beams(beam_search(case.index, twin.requests, scorer, beams, mode), want)
        post = DevicePost(case.index, *want.score.shape, arrays=arrays, impl="torch", stages=True)
        found, expected = post.result(post.run(staged.requests, got)), post.result(post.run(own, want))
        assert found is not None and expected is not None
        same(found, expected)


@settings(max_examples=20, deadline=None)
@given(scenarios(max_ads=6))
def test_staging_refuses_a_batch_it_cannot_hold(sc):
    case = Case(sc, "cpu")
    exact = [i for i, e in enumerate(case.req.exact) if e is not None and len(e.hashes)]
    for p, q in enumerate(case.req.planes):  # one row short on some plane
        if len(q.rows):
            rows = tuple(len(x.rows) - (i == p) for i, x in enumerate(case.req.planes))
            hashes = tuple(None if e is None else len(e.hashes) for e in case.req.exact)
            assert not Staged(case.req, rows, hashes, torch.device("cpu")).fits(case.req)
    for p in exact:  # one hash short
        rows = tuple(len(x.rows) for x in case.req.planes)
        hashes = tuple(None if e is None else len(e.hashes) - (i == p) for i, e in enumerate(case.req.exact))
        assert not Staged(case.req, rows, hashes, torch.device("cpu")).fits(case.req)
    rows = tuple(len(x.rows) for x in case.req.planes)
    hashes = tuple(None if e is None else len(e.hashes) for e in case.req.exact)
    staged = Staged(case.req, rows, hashes, torch.device("cpu"))
    assert staged.fits(case.req)
    assert not staged.fits(case.req.slice(0, case.req.batch - 1)) or case.req.batch == 1
    twice = encode_requests(requests_of(dataclasses.replace(sc, requests=sc.requests * 2)), sc.spec)
    assert not staged.fits(twice)  # another batch size
    with_embedding = dataclasses.replace(case.req, embedding=np.zeros((case.req.batch, 3), np.float32))
    assert not staged.fits(with_embedding)
    for p, q in enumerate(case.req.planes):  # one query per request fewer than the batch's most
        if q.max_queries:
            most = tuple(x.max_queries - (i == p) for i, x in enumerate(case.req.planes))
            tight = Staged(case.req, rows, hashes, torch.device("cpu"), most)
            assert not tight.fits(case.req) and not tight.fits(to_device(case.req, "cpu"))
    assert staged.fits(to_device(case.req, "cpu"))
