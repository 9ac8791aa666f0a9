"""`runtime.Retriever`, the serving object: requests in memory in, the ranked eligible ads out as
Arrow, equal to the reference path (beam search, then the post stage) batch by batch, in every
mode; any form of the same requests gives the same table; a bad request is refused naming its row
and the retriever keeps serving; a watcher's new snapshot is warmed before it is swapped in, while
the old one goes on serving; and concurrent callers get what serial ones get."""

from __future__ import annotations

import concurrent.futures
import shutil
import threading
from pathlib import Path

import numpy as np
import polars as pl
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

import runtime
import sidindex.requests
from runtime.result import requests_part, table_of
from runtime.serving.post import expand
from sidindex.errors import ConfigError, InputError
from tests.conftest import run_cli
from tests.test_post import same as same_retrieved
from tests.test_retrieve import CONFIG, build_root
from tests.test_runtime import GPU

BEAMS = (1, 8, 16, 16)


@pytest.fixture(scope="module")
def root(sample_dir, tmp_path_factory) -> Path:
    return build_root(sample_dir, tmp_path_factory.mktemp("retriever"), CONFIG)


@pytest.fixture(scope="module")
def requests_table(sample_dir) -> pa.Table:
    return pq.read_table(sample_dir / "requests.parquet").slice(0, 23)


def reference(index, table: pa.Table, mode: str, batch: int, **kw) -> pa.Table:
    """The reference path, batch by batch: validate, encode, beam search with the codebook
    scorer, the post stage; then the Arrow rows."""
    reqs = runtime.requests_from(table, index)
    parts = []
    for lo in range(0, len(reqs), batch):
        host = runtime.encode_requests(reqs.rows(lo, min(len(reqs), lo + batch)), index.spec)
        dev = runtime.to_device(host, index.device)
        scorer = runtime.codebook_scorer(index, dev)(slice(0, dev.batch))
        beams = runtime.beam_search(index, dev, scorer, BEAMS, mode, value_weight=kw.get("value_weight", 0.0))
        r = expand(index, host, beams, kw.get("top_k"), rank=kw.get("rank", "score"))
        parts.append(table_of(r, reqs.request_id[lo:lo + batch]))
    return pa.concat_tables(parts)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not GPU, reason="needs a CUDA device"))])
@pytest.mark.parametrize("mode", ["none", "cd", "cd+gtm", "cd+gtm+kway"])
def test_the_retriever_equals_search_then_post(root, requests_table, mode, device):
    """On a GPU the batches replay graphs captured at warm-up, the last one padded (23 = 8 + 8 +
    7, served as 8); the rows equal the eager search's and the post stage's."""
    index = runtime.load(root, device)
    retriever = runtime.Retriever(index, mode=mode, beams=BEAMS, batch_sizes=(4, 8))
    got = retriever.retrieve(requests_table)
    want = reference(index, requests_table, mode, 8)
    assert got.num_rows > 0 and got.equals(want)
    assert got.column_names == ["request_id", "rank", "ad_id", "sid", "score", "value"]  # the sample has values
    c = retriever.counters
    assert c.batches == 3 and c.requests == 23 and c.warmed == 1 and c.widenings == 0
    assert c.captures == c.compiles == 0  # all at warm-up: nothing on the serving thread
    assert retriever._warmed[id(index)].searcher.frozen
    assert all(c.seconds[s] > 0 for s in ("validate", "encode", "search_post", "result"))


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not GPU, reason="needs a CUDA device"))])
def test_a_requests_rows_do_not_depend_on_its_batch(root, requests_table, device):
    """Each request alone, and in batches of other sizes and company, gets the same rows bit for
    bit (scores included): the codebook scorer's products are exact to float32 whatever blocking
    the matrix library picks for a batch's shape."""
    index = runtime.load(root, device)
    retriever = runtime.Retriever(index, beams=BEAMS, batch_sizes=(1, 4, 8, 16))
    alone = pa.concat_tables([retriever.retrieve(requests_table.slice(i, 1)) for i in range(len(requests_table))])
    for n in (4, 7, 16):
        together = pa.concat_tables([retriever.retrieve(requests_table.slice(lo, n))
                                     for lo in range(0, len(requests_table), n)])
        assert together.equals(alone), n


def test_top_k_rank_and_value_weight_reach_the_search(root, requests_table):
    index = runtime.load(root, "cpu")
    if index.gtm.ad_value is None:
        pytest.skip("the sample catalog has no values")
    kw = dict(top_k=3, rank="fused", value_weight=0.5)
    got = runtime.Retriever(index, mode="cd+gtm", beams=BEAMS, batch_sizes=(16,), **kw).retrieve(requests_table)
    assert got.equals(reference(index, requests_table, "cd+gtm", 16, **kw))
    assert "value" in got.column_names and max(got.column("rank").to_pylist()) <= 3


def test_every_form_of_the_same_requests_gives_the_same_table(root, requests_table):
    retriever = runtime.Retriever(runtime.load(root, "cpu"), beams=BEAMS, batch_sizes=(16,))
    want = retriever.retrieve(requests_table)
    for data in (requests_table.to_batches()[0], pl.from_arrow(requests_table), requests_table.to_pylist(),
                 pa.Table.from_batches(requests_table.to_batches(max_chunksize=5))):
        assert retriever.retrieve(data).equals(want)


def test_a_bad_request_is_refused_by_row_and_the_retriever_keeps_serving(root, requests_table):
    retriever = runtime.Retriever(runtime.load(root, "cpu"), beams=BEAMS, batch_sizes=(16,))
    want = retriever.retrieve(requests_table)
    rows = requests_table.to_pylist()
    rows[5]["embedding"] = [1e19] * len(rows[5]["embedding"])
    with pytest.raises(InputError, match=r"^rpc batch 7: column 'embedding', row 5: element 0 is 1e\+19"):
        retriever.retrieve(rows, source="rpc batch 7")
    rows[5]["embedding"] = rows[5]["embedding"][:3]
    with pytest.raises(InputError, match=r"column 'embedding', row 5: has 3 values, expected \d+ \(the codebook"):
        retriever.retrieve(rows)
    assert retriever.retrieve(requests_table).equals(want)


def test_a_padded_batch_keeps_its_own_requests_rows(root, requests_table):
    """On a GPU a batch is padded to a configured size with copies of its last request: the cut of
    the padded result is the result of the batch alone (each request's rows are its own)."""
    index = runtime.load(root, "cpu")
    reqs = runtime.requests_from(requests_table, index)

    def post(n: int):
        host = runtime.encode_requests(reqs.head(n), index.spec)
        dev = runtime.to_device(host, "cpu")
        beams = runtime.beam_search(index, dev, runtime.codebook_scorer(index, dev)(slice(0, n)), BEAMS, "cd+gtm")
        return expand(index, host, beams, stages=True)

    same_retrieved(requests_part(post(11), 0, 5), post(5))


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not GPU, reason="needs a CUDA device"))])
def test_concurrent_callers_get_what_serial_callers_get(root, requests_table, device):
    """Three callers, each request of two batches (the second padded): on a GPU each caller
    submits its second batch before reading its first, and the callers share a graph's two slots."""
    retriever = runtime.Retriever(runtime.load(root, device), beams=BEAMS, batch_sizes=(4,))
    parts = [requests_table.slice(lo, 6) for lo in range(0, 18, 6)]
    want = [retriever.retrieve(p) for p in parts]
    got: dict[int, list] = {}

    def call(i: int) -> None:
        got[i] = [retriever.retrieve(parts[j % len(parts)]) for j in range(i, i + 2 * len(parts))]

    threads = [threading.Thread(target=call, args=(i,), daemon=True) for i in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    assert not any(t.is_alive() for t in threads)  # no caller waits for a slot another waiting caller holds
    assert all(g.equals(want[j % len(parts)]) for i in range(3) for g, j in zip(got[i], range(i, i + 2 * len(parts))))
    assert retriever.counters.overflows == retriever.counters.captures == 0


@pytest.mark.skipif(not GPU, reason="needs a CUDA device")
def test_a_frozen_searcher_replays_a_batch_while_the_one_before_it_is_unread(root, requests_table, monkeypatch):
    """Frozen, a capped graph of the built-in scorer has two slots: two batches submitted back to
    back run on both, are read in either order, and each equals its batch searched eagerly (the
    rows past what comes back with the counts fetched behind that batch's own event); a third
    batch from a thread that read neither is refused, and both slots serve again once read."""
    from runtime.serving.searcher import Searcher

    monkeypatch.setattr(runtime.serving.post, "SENT_WORDS", 8)  # every batch's rows pass it
    index = runtime.load(root, "cuda")
    reqs = runtime.requests_from(requests_table, index)
    hosts = [runtime.encode_requests(reqs.rows(lo, lo + 8), index.spec) for lo in (0, 8, 15)]

    def eager(host):
        dev = runtime.to_device(host, index.device)
        scorer = runtime.codebook_scorer(index, dev)(slice(0, dev.batch))
        return expand(index, host, runtime.beam_search(index, dev, scorer, BEAMS, "cd+gtm"))

    want = [eager(h) for h in hosts]
    searcher = Searcher(BEAMS, "cd+gtm")
    for h, w in zip(hosts, want):  # warming: widened and captured here
        same_retrieved(searcher.retrieve(index, h), w)
    captures = searcher.captures
    searcher.freeze()
    assert searcher.captures == captures + 1  # the capped graph's twin (one batch size)
    for order in ((0, 1), (1, 2), (2, 0)):
        first, second = (searcher.submit(index, hosts[i]) for i in order)
        assert first.graph is not None and second.graph is not None and first.graph is not second.graph
        assert searcher.submit(index, hosts[0], wait=False) is None  # no slot free: nothing done
        with pytest.raises(ConfigError, match="read one"):
            searcher.submit(index, hosts[0])
        same_retrieved(second.read(), want[order[1]])
        same_retrieved(first.read(), want[order[0]])
    assert searcher.overflows == 0 and searcher.captures == captures + 1
    one = Searcher(BEAMS, "cd+gtm", slots=1)
    for h, w in zip(hosts, want):
        same_retrieved(one.retrieve(index, h), w)
    one.freeze()
    first = one.submit(index, hosts[1])
    assert first is not None and one.submit(index, hosts[2], wait=False) is None
    same_retrieved(first.read(), want[1])
    same_retrieved(one.retrieve(index, hosts[2]), want[2])


def test_slots_are_one_or_two(root):
    index = runtime.load(root, "cpu")
    for bad in (0, 3, True, 1.5, 2.0):
        with pytest.raises(ConfigError, match="slots"):
            runtime.Retriever(index, beams=BEAMS, slots=bad, warm=False)


def paused_update(root: Path, requests_table: pa.Table, tmp_path: Path):
    """A copy of `root` followed by a warm Retriever, and an update published to it that pauses
    the first ad the requests get: (work root, watcher, retriever, the rows before, the paused ad)."""
    work = Path(shutil.copytree(root, tmp_path / "root"))
    watcher = runtime.SnapshotWatcher(work, "cpu")
    retriever = runtime.Retriever(watcher, beams=BEAMS, batch_sizes=(8,))
    before = retriever.retrieve(requests_table)
    paused = int(before.column("ad_id")[0].as_py())
    pq.write_table(pa.table({"ad_id": pa.array([paused], pa.int64()), "op": ["pause"]}), tmp_path / "changes.parquet")
    r = run_cli("update", work, "--changes", tmp_path / "changes.parquet", "--json", timeout=600)
    assert r.returncode == 0, r.stderr
    return work, watcher, retriever, before, paused


def test_a_watchers_new_snapshot_is_warmed_before_it_serves(root, requests_table, tmp_path):
    work, watcher, retriever, before, paused = paused_update(root, requests_table, tmp_path)
    assert watcher.poll()
    assert retriever.counters.warmed == 2  # warmed by the hook, before the swap
    after = retriever.retrieve(requests_table)
    assert paused not in after.column("ad_id").to_pylist()
    assert retriever.counters.swaps == 1 and retriever.index is watcher.current
    assert after.equals(reference(watcher.current, requests_table, "cd+gtm", 8))

    def broken(_indexes):
        raise RuntimeError("warm-up failed")

    watcher.before_swap.append(broken)  # a hook that fails keeps the old snapshot serving
    other = int(after.column("ad_id")[0].as_py())
    pq.write_table(pa.table({"ad_id": pa.array([other], pa.int64()), "op": ["pause"]}), tmp_path / "more.parquet")
    r = run_cli("update", work, "--changes", tmp_path / "more.parquet", "--json", timeout=600)
    assert r.returncode == 0, r.stderr
    served = watcher.current
    assert not watcher.poll() and watcher.current is served and "warm-up failed" in watcher.last_error
    assert retriever.retrieve(requests_table).equals(after)
    retriever.close()
    assert retriever._before_swap not in watcher.before_swap


def test_warming_the_served_snapshot_again_holds_no_lock_its_batches_take(root, requests_table, monkeypatch):
    """`prepare` of the snapshot being served warms a new searcher beside serving: a caller's
    batch is answered while the warm-up runs (here the warm-up waits for that answer, so holding
    the serving lock through it would stall both), and the new searcher, from the served one's
    widths, then serves the next batch with the same rows."""
    index = runtime.load(root, "cpu")
    retriever = runtime.Retriever(index, mode="cd+gtm", beams=BEAMS, batch_sizes=(4, 8))
    want = retriever.retrieve(requests_table)
    old = retriever._warmed[id(index)].searcher
    answered, warm = threading.Event(), retriever._warm

    def waits_for_a_batch(warmed):
        assert answered.wait(120), "no batch was answered while the served snapshot warmed again"
        warm(warmed)

    monkeypatch.setattr(retriever, "_warm", waits_for_a_batch)
    warming = threading.Thread(target=retriever.prepare, args=(index,))
    warming.start()
    got = retriever.retrieve(requests_table)
    answered.set()
    warming.join(300)
    assert not warming.is_alive() and got.equals(want)
    new = retriever._warmed[id(index)].searcher
    assert new is not old and new.frozen and new.step_slack == old.step_slack
    assert retriever.counters.warmed == 2 and retriever.retrieve(requests_table).equals(want)


def test_a_call_on_a_snapshot_swapped_out_is_answered_on_it_without_warming_it_again(root, requests_table,
                                                                                      tmp_path):
    """A call that took the index before a swap (a batch thread of the server's) runs on it after
    the new one served: answered as that snapshot answers, with no warm-up of it on the serving
    path, and what served it dropped once the call ends; a call running on it when the swap came
    keeps its searcher until then."""
    work, watcher, retriever, before, paused = paused_update(root, requests_table, tmp_path)
    old = retriever.index
    reqs = runtime.requests_from(requests_table, old)
    assert watcher.poll() and retriever.counters.warmed == 2
    assert retriever.retrieve(requests_table).column("ad_id").to_pylist() != before.column("ad_id").to_pylist()
    assert id(old) not in retriever._warmed  # dropped at the swap: no call was running on it
    found, _ = retriever.run(reqs, old)
    assert table_of(found, reqs.request_id).equals(before)
    assert retriever.counters.warmed == 2 and retriever.counters.swaps == 1 and retriever.index is watcher.current
    assert set(retriever._warmed) == {id(watcher.current)}
    # a call running on the served snapshot when the next swap comes keeps its searcher until it ends
    served = retriever.index
    searcher = retriever._warmed[id(served)].searcher
    with retriever._lock:
        retriever._in_use[id(served)] += 1  # as `run` holds it for a call
    other = int(retriever.retrieve(requests_table).column("ad_id")[0].as_py())
    pq.write_table(pa.table({"ad_id": pa.array([other], pa.int64()), "op": ["pause"]}), tmp_path / "more.parquet")
    assert run_cli("update", work, "--changes", tmp_path / "more.parquet", "--json", timeout=600).returncode == 0
    assert watcher.poll()
    retriever.retrieve(requests_table)  # the newest serves: the one before stays for its call
    assert retriever._warmed[id(served)].searcher is searcher
    found, _ = retriever.run(reqs, served)
    assert retriever._warmed[id(served)].searcher is searcher and retriever.counters.warmed == 3
    with retriever._lock:
        retriever._in_use[id(served)] -= 1
    retriever.run(reqs, served)  # its last call: dropped after it
    assert id(served) not in retriever._warmed and retriever.counters.warmed == 3


def test_batches_are_served_while_a_new_snapshot_warms(root, requests_table, tmp_path, monkeypatch):
    """A new snapshot's warm-up (which on a GPU may compile kernels for seconds) holds no lock that
    serving batches take: a batch on the current snapshot is answered while the warm-up waits for
    it, and the new snapshot serves once warmed."""
    work, watcher, retriever, before, paused = paused_update(root, requests_table, tmp_path)

    warming, served = threading.Event(), threading.Event()
    warm = retriever._warm

    def slow_warm(warmed):
        warming.set()
        assert served.wait(60), "the batch waited for the warm-up"
        warm(warmed)

    monkeypatch.setattr(retriever, "_warm", slow_warm)
    poller = concurrent.futures.ThreadPoolExecutor(1).submit(watcher.poll)
    assert warming.wait(60)
    during = retriever.retrieve(requests_table)  # deadlocks if the warm-up held the serving lock
    served.set()
    assert poller.result(timeout=120) is True
    assert during.equals(before)  # the old snapshot served it
    after = retriever.retrieve(requests_table)
    assert paused not in after.column("ad_id").to_pylist()
    assert retriever.counters.warmed == 2 and retriever.counters.swaps == 1
    assert after.equals(reference(watcher.current, requests_table, "cd+gtm", 8))


def _embedding(t: pa.Table) -> np.ndarray:
    return t.column("embedding").combine_chunks().flatten().to_numpy().reshape(t.num_rows, -1)


def test_warm_up_requests_near_ads_are_their_sids_codebook_paths(root):
    """The warm-up's requests near ads (cd's): each embedding is the sum of the codebook centroids
    of some catalog SID's path; random paths otherwise. The same seed, the same requests."""
    from runtime.serving.retriever import largest_requests

    index = runtime.load(root, "cpu")
    g, cb = index.snapshot.gtm, index.codebook
    paths = g.leaf_sids().astype(np.int64)
    rebuilt = np.asarray(sum(c[paths[:, d]] for d, c in enumerate(cb.centroids))).astype(np.float32)
    near = _embedding(largest_requests(index, 400, seed=3, near_ads=True))
    assert np.array_equal(near, _embedding(largest_requests(index, 400, seed=3, near_ads=True)))
    assert (near[:, None, :] == rebuilt[None, :, :]).all(axis=2).any(axis=1).all()
    wide = _embedding(largest_requests(index, 400, seed=3))
    assert not (wide[:, None, :] == rebuilt[None, :, :]).all(axis=2).any(axis=1).all()


def test_warm_up_requests_near_ads_are_drawn_as_the_ads_are(root):
    """A SID's share of the warm-up's requests near ads is its share of the ads, not of the SIDs:
    on a trie whose first SID holds 900 of 1,000 ads (the other 100 one each), about 90% of the
    requests are that SID's path (drawn by SID, about 1%)."""
    from types import SimpleNamespace

    from runtime.serving.retriever import largest_requests

    index = runtime.load(root, "cpu")
    cb = index.codebook
    sizes = [len(c) for c in cb.centroids]
    leaves = 101

    def leaf_sids(which: np.ndarray) -> np.ndarray:  # leaf i's path: i in mixed radix, distinct per leaf
        digits, i = [], np.asarray(which, np.int64)
        for k in sizes:
            digits.append(i % k)
            i = i // k
        return np.stack(digits + [np.zeros_like(i)], axis=1).astype(np.int16)

    assert np.prod(sizes) >= leaves
    gtm = SimpleNamespace(leaf_ad_offsets=np.concatenate([[0], 900 + np.arange(leaves)]), leaf_sids=leaf_sids)
    lopsided = SimpleNamespace(snapshot=SimpleNamespace(gtm=gtm), codebook=cb, spec=index.spec)
    got = _embedding(largest_requests(lopsided, 2000, seed=5, near_ads=True))
    first = np.asarray(sum(c[t] for c, t in zip(cb.centroids, leaf_sids(np.zeros(1, np.int64))[0].astype(np.int64))),
                       np.float32)
    share = (got == first).all(axis=1).mean()
    assert 0.85 < share < 0.95, share


def test_after_batches_past_its_widths_a_wider_searcher_warms_beside_serving(root, requests_table):
    """A frozen searcher whose widths fall short of the traffic (shrunk here after its warm-up)
    answers each batch exactly through the worst case, counted as an overflow, and nothing widens on
    the serving thread; a searcher warmed again beside serving, with those batches among its
    warm-up, then takes over (`rewarms`), and the same batches fit it."""
    index = runtime.load(root, "cpu")
    retriever = runtime.Retriever(index, mode="cd", beams=BEAMS, batch_sizes=(8,))
    served = retriever._warmed[id(index)].searcher
    served.step_slack = dict.fromkeys(range(index.sid_length), 0.01)  # far below any batch's candidates
    shrunk = retriever.widths
    assert shrunk is not None and len(shrunk) == index.sid_length and shrunk == served.widths(index)
    want = reference(index, requests_table, "cd", 8)
    assert retriever.retrieve(requests_table).equals(want)
    c = retriever.counters
    assert c.overflows == 3 and c.widenings == 0 and served.widened == 0
    assert retriever.join_warmups(120) and retriever.rewarm_error is None and c.rewarms == 1
    wider = retriever._warmed[id(index)].searcher
    assert wider is not served and wider.frozen and all(s > 0.01 for s in wider.step_slack.values())
    # what the served searcher uses now: no step narrower, some wider (None: the step's worst case)
    now = retriever.widths
    assert now is not None and now != shrunk
    assert all(b is None or (a is not None and a <= b) for a, b in zip(shrunk, now))
    assert retriever.retrieve(requests_table).equals(want)
    assert c.overflows == 3 and c.widenings == 0 and c.rewarms == 1  # they fit now: no second re-warm
    retriever.close()
    assert retriever.join_warmups(0)


def test_a_warm_up_takes_served_batches_validated_for_its_own_snapshot(root, requests_table):
    """The batches a re-warm or a swap's warm-up replays: as they are under the same spec and
    embedding width; validated again under others, a padded batch (its last request repeated, ids
    included) too; refused ones left out."""
    from runtime.requests import validated_for
    from runtime.serving.retriever import _for_index

    index = runtime.load(root, "cpu")
    reqs = runtime.requests_from(requests_table.slice(0, 3), index)
    padded = reqs.taken(np.array([0, 1, 2, 2]))
    assert _for_index(padded, validated_for(index), index) is padded
    again = _for_index(padded, ("another spec", None), index)
    assert again is not None and len(again) == 4 and again.request_id.tolist() == [0, 1, 2, 3]
    assert again.table.drop_columns(["request_id"]).equals(padded.table.drop_columns(["request_id"]))
    table = requests_table.slice(0, 3)
    wider = pa.FixedSizeListArray.from_arrays(pa.array(np.zeros(3 * (index.codebook.dim + 1), np.float32)),
                                              index.codebook.dim + 1)
    table = table.set_column(table.column_names.index("embedding"), "embedding", wider)
    other = sidindex.requests.requests_from(table, index.spec)  # valid for a codebook one dimension wider
    assert _for_index(other, (index.spec, index.codebook.dim + 1), index) is None
