"""The load benchmark (bench/bench_load.py) on a tiny catalog on the CPU: a real `sidindex serve`
under open-loop load through its three scenarios, every answer checked against a direct retrieve
on the snapshot it names; and that check telling an answer labelled with the wrong snapshot."""

from __future__ import annotations

import argparse
import http.client
import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

pytest.importorskip("starlette")
pytest.importorskip("uvicorn")
pytest.importorskip("httpx")

import numpy as np  # noqa: E402

import runtime  # noqa: E402
from bench import bench_load as bl  # noqa: E402
from bench import bench_stream as bs  # noqa: E402
from bench.load_check import Checker, difference  # noqa: E402
from bench.load_clients import parse_answers  # noqa: E402
from bench.profile_server import connections  # noqa: E402
from bench.report import PACKAGES  # noqa: E402
from sidindex.root import Root  # noqa: E402
from tests.conftest import run_cli  # noqa: E402

ADS, DIM, BEAMS = 3000, 16, "1,4,8,8"


@pytest.fixture(scope="module")
def built(tmp_path_factory) -> tuple[Path, dict]:
    """The benchmark's cache directory holding a tiny catalog and its published ROOT."""
    cache = tmp_path_factory.mktemp("bench_load")
    return cache, bs.catalog_root(ADS, DIM, cache)


def test_every_answer_is_checked_through_updates_and_a_corrupt_snapshot(built, tmp_path, capsys):
    cache, size = built
    out = tmp_path / "load.json"
    # --publish-every: one update after another (each a process of seconds on a busy CI host) would run
    # the publisher scenario long past its load; a few spaced ones still land and swap under it
    assert bl.main(["--ads", str(ADS), "--dim", str(DIM), "--beams", BEAMS, "--device", "cpu", "--rate", "30",
                    "--clients", "4", "--procs", "2", "--seconds", "5", "--publish-every", "4", "--pool", "48",
                    "--cache", str(cache), "--json", str(out)]) == 0
    printed = capsys.readouterr().out
    res = json.loads(out.read_text())
    assert res["catalog"]["cached"] and res["catalog"]["ads"] == ADS  # the fixture's ROOT, reused
    assert res["server_exit"] == 0 and res["server_tracebacks"] == 0  # drained on SIGTERM
    steady, publisher, corrupt = res["scenarios"]
    assert [s["scenario"] for s in res["scenarios"]] == list(bl.SCENARIOS)
    for s in res["scenarios"]:
        assert s["scenario"] in printed
        assert s["sent"] > 0 and s["ok"] == s["sent"] and s["failed"] == 0 and s["errors"] == {}
        assert s["checked"] == s["ok"] and s["mismatches"] == 0, s["mismatch_samples"]
        lat = s["latency"]
        assert 0 < lat["p50_ms"] <= lat["p99_ms"] <= lat["p99.9_ms"] <= lat["max_ms"]
        assert len(s["latencies_ms"]) == s["ok"] and s["throughput_rps"] > 0 and s["rows_per_answer"] > 0
    assert "MISS" not in printed and printed.count("PASS") >= 10

    assert steady["snapshots_seen"] == [res["served_first"]] and steady["swaps_seen"] == 0
    assert steady["windows"] == [] and steady["p99_during_swaps_ms"] is None

    updates = [e for e in publisher["events"] if e["kind"] == "update"]
    assert updates and all("snapshot" in e and "error" not in e and len(e["paused"]) == 4 for e in updates)
    assert publisher["swaps_seen"] >= 1 and publisher["server"]["swaps"] >= 1
    assert set(publisher["snapshots_seen"]) <= {res["served_first"]} | {e["snapshot"] for e in updates}
    assert any(w["outcome"] == "swapped" for w in publisher["windows"])

    (bad,) = [e["snapshot"] for e in corrupt["events"] if e["kind"] == "corrupt"]
    (good,) = [e["snapshot"] for e in corrupt["events"] if e["kind"] == "intact copy"]
    assert bad not in corrupt["snapshots_seen"]  # never served
    (refused,) = [w for w in corrupt["windows"] if w["snapshot"] == bad]
    assert refused["outcome"] == "refused" and bad in refused["last_error"] and "checksum" in refused["last_error"]
    assert corrupt["answered_while_refused"] > 0  # the old snapshot went on answering
    assert corrupt["snapshots_seen"][-1] == good  # then the next intact one was swapped in
    assert corrupt["snapshot_after"]["id"] == good and corrupt["snapshot_after"]["last_error"] is None

    root = Root(size["root"])  # the cached ROOT is still the full build; the working copy is gone
    assert root.history() == [root.current_id()]
    assert not list(cache.glob("bench_load_work_*"))


def test_the_check_tells_an_answer_labelled_with_another_snapshot(built, tmp_path):
    """A right answer passes; the same rows under the id of an update that paused some of them,
    a header that disagrees with the body, and rows of another request are mismatches."""
    _, size = built
    root = bl.working_root(Path(size["root"]), tmp_path)
    bodies = bl.request_pool(runtime.load(root, "cpu"), Path(size["catalog"]), 4, seed=3)
    request = json.loads(bodies[0])["requests"][0]
    old = Root(root).current_id()
    rows = runtime.Retriever(runtime.load(root, "cpu"), beams=BEAMS, batch_sizes=(1,), warm=False).retrieve([request])
    assert rows.num_rows > 0
    paused = rows.column("ad_id").to_pylist()[:2]
    pq.write_table(pa.table({"ad_id": pa.array(paused, pa.int64()), "op": ["pause"] * 2}), tmp_path / "c.parquet")
    assert run_cli("update", root, "--changes", tmp_path / "c.parquet", "--keep", "10").returncode == 0
    new = Root(root).current_id()

    def answer(snapshot: str, header: str, request_id: int = 0) -> tuple:
        body = json.dumps({"snapshot": snapshot, "rows": [r | {"request_id": request_id} for r in rows.to_pylist()]})
        return 0.0, 0.01, 200, header, body.encode()

    raw = [answer(old, old), answer(new, new), answer(old, new), answer(old, old, request_id=1)]
    sends = {"k": np.arange(4), "client": np.zeros(4, np.int64), "idx": np.zeros(4, np.int64), "t": np.zeros(4)}
    answers = parse_answers(sends, raw, 0.0)
    args = argparse.Namespace(mode="cd+gtm", beams=BEAMS, top_k=None, check_device="cpu")
    checker = Checker(root, args, bodies)
    checker.prepare([answers])
    got = checker.check(answers)
    assert got["checked"] == 4 and got["mismatches"] == 3
    why = [m.split(": ", 1)[1] for m in got["mismatch_samples"]]
    assert why[0].startswith("ads differ from the direct retrieve") and why[1:] == [
        "its X-Sidindex-Snapshot header is not its body's snapshot", "holds rows of another request_id"]


def test_a_near_tie_is_told_from_a_wrong_answer():
    ad, rank, score = np.array([7, 8, 9]), np.array([1, 2, 3]), np.array([-1.0, -2.0, -2.000004])
    assert difference(ad, rank, score, ad, rank, score) == (None, False)
    why, tie = difference(np.array([7, 9, 8]), rank, np.array([-1.0, -2.000001, -2.000003]), ad, rank, score)
    assert tie and why.startswith("near tie: ") and "from row 1: ad 9" in why and "the same ads in another order" in why
    why, tie = difference(np.array([7, 8, 5]), rank, score, ad, rank, score)  # another ad at the cut, same score
    assert tie and "2 ads in one only" in why
    why, tie = difference(np.array([7, 9, 8]), rank, np.array([-1.0, -2.0, -2.5]), ad, rank, score)
    assert not tie and why.startswith("ads differ")  # ad 8's score is another
    why, tie = difference(ad[:2], rank[:2], score[:2], ad, rank, score)
    assert not tie and "from row 2: nothing against ad 9" in why
    why, tie = difference(ad, rank, score + 1e-3, ad, rank, score)
    assert not tie and why.startswith("scores differ")


def baseline_copy(where: Path, marker: bool = False) -> Path:
    """This checkout's packages copied to `where`, as `git archive` gives a baseline; marker: its
    /healthz answers with the header X-Bench-Tree: baseline, so a test can tell which code serves.
    Their __pycache__ folders come along: numba's caches there hold for the copy (a file's stamp
    is its size and time, which the copy keeps), and without them its processes compiled every
    kernel again, about 50 s of a test on a 2-core host."""
    import shutil

    repo = Path(bl.__file__).resolve().parents[1]
    for package in PACKAGES:
        shutil.copytree(repo / package, where / package)
    if marker:
        http = where / "runtime" / "server" / "http.py"
        text = http.read_text()
        old = 'return JSONResponse({"status": "serving", "snapshot": target.snapshot})'
        assert old in text
        http.write_text(text.replace(old, old[:-1] + ', headers={"X-Bench-Tree": "baseline"})'))
    return where


def test_the_engine_bench_runs_each_checkout_and_reports_its_link(built, tmp_path):
    """bench_engine.py: the engine process and two client processes per run, the runs alternating
    with a baseline checkout's packages, each run importing its own (the script puts this
    checkout first on sys.path: the baseline must come before it), answering every request it
    was sent and reporting the CPU its link and its process took (the link's in clock ticks: 0 in
    so short a run), and where a batch's time went."""
    from bench import bench_engine

    cache, _ = built
    out = tmp_path / "engine.json"
    repo = Path(bench_engine.__file__).resolve().parents[1]
    base = baseline_copy(tmp_path / "base")
    assert bench_engine.main(["--ads", str(ADS), "--dim", str(DIM), "--beams", BEAMS, "--cache", str(cache),
                              "--runs", "1", "--requests", "120", "--window", "16", "--clients", "2",
                              "--baseline", str(base),
                              "--json", str(out)]) == 0
    figures = json.loads(out.read_text())
    results = figures["results"]
    assert len(figures["host_speed_ms"]) == 2  # before and after the runs
    assert sorted(results) == sorted(["this checkout", str(base)])
    assert results["this checkout"][0]["code"] == str(repo) and results[str(base)][0]["code"] == str(base.resolve())
    for (run,) in results.values():
        assert run["rps"] > 0 and run["link_cpu_us"] >= 0 and run["process_cpu_us"] > 0
        assert 1 <= run["rows_per_batch"] <= 64
        assert sorted(run["stage_ms"]) == sorted(["read", "encode", "search_post", "answer"])
        assert run["stage_ms"]["search_post"] > 0 and min(run["stage_ms"].values()) >= 0
    # a stand-in batch of 5 ms on the device: the stage that holds it, per batch, and only the
    # clients' requests (the warm-up's batches before the mark are not counted)
    assert bench_engine.main(["--ads", str(ADS), "--dim", str(DIM), "--beams", BEAMS, "--cache", str(cache),
                              "--runs", "1", "--requests", "200", "--window", "8", "--clients", "2",
                              "--stand-in-ms", "5", "--json", str(out)]) == 0
    (run,) = json.loads(out.read_text())["results"]["this checkout"]
    assert 5.0 <= run["stage_ms"]["search_post"] < 50 and run["stage_ms"]["encode"] == 0
    assert 1 <= run["rows_per_batch"] <= 8


def test_a_large_bodys_answer_is_checked_request_by_request(built, tmp_path, capsys):
    """The large scenario: the body's answer is split into its requests, each checked against a
    direct retrieve of the pool request it repeats, with the single answers."""
    cache, _ = built
    out = tmp_path / "load.json"
    assert bl.main(["--ads", str(ADS), "--dim", str(DIM), "--beams", BEAMS, "--device", "cpu", "--rate", "20",
                    "--clients", "4", "--procs", "1", "--seconds", "3", "--pool", "16", "--large-rows", "40",
                    "--scenarios", "large", "--no-wrk", "--cache", str(cache), "--json", str(out)]) == 0
    (large,) = json.loads(out.read_text())["scenarios"]
    (event,) = [e for e in large["events"] if e["kind"] == "large request"]
    assert event["status"] == 200 and event["rows"] == 40
    assert large["checked"] == large["ok"] + 40 and large["mismatches"] == 0, large["mismatch_samples"]
    assert "40 of them the large body's requests" in capsys.readouterr().out


def test_batched_calls_over_flight_and_http_are_counted_and_checked(built, tmp_path, capsys):
    from bench import bench_batched as bb

    cache, _ = built
    out = tmp_path / "batched.json"
    assert bb.main(["--ads", str(ADS), "--dim", str(DIM), "--beams", BEAMS, "--device", "cpu", "--rows", "16",
                    "--pool", "64", "--clients", "2", "--procs", "1", "--seconds", "2", "--max-batch", "16",
                    "--cache", str(cache), "--json", str(out)]) == 0
    printed = capsys.readouterr().out
    res = json.loads(out.read_text())
    assert res["catalog"]["cached"] and res["server_exit"] == 0
    assert res["direct"]["calls"] > 0 and res["direct"]["reference_rows"] > 0
    assert [p["path"] for p in res["paths"]] == ["flight", "http"]
    for p in res["paths"]:
        assert p["calls"] > 0 and p["failed"] == 0 and p["mismatches"] == 0 and p["requests_per_s"] > 0
        assert p["clients_exited"] == [0] and p["clients_calling"] == 2 and p["errors"] == []
        assert 0 < p["p50_ms"] <= p["p99_ms"]
        assert f"| {p['path']} |" in printed
    assert "MISS" not in printed and printed.count("PASS") == 4


def test_the_batched_check_tells_a_near_tie_from_a_wrong_answer():
    from bench.bench_batched import by_request, compare

    def table(rid, ad, score):
        rank = [sum(r == x for x in rid[:i]) + 1 for i, r in enumerate(rid)]
        return pa.table({"request_id": pa.array(rid, pa.int64()), "rank": pa.array(rank, pa.int64()),
                         "ad_id": pa.array(ad, pa.int64()), "score": pa.array(score, pa.float32())})

    want = by_request(table([0, 0, 1], [10, 11, 12], [0.5, 0.5, 0.25]))
    ids = np.array([0, 1, 2])  # request 2 has no rows in either
    assert compare(table([1, 0, 0], [12, 10, 11], [0.5 / 2, 0.5, 0.5]), want, ids) == (0, 0, None)  # any row order
    bad, near, why = compare(table([0, 0, 1], [11, 10, 12], [0.5, 0.5, 0.25]), want, ids)  # tied ads swapped
    assert (bad, near) == (1, 1) and why.startswith("request 0: near tie")
    # other ads with the same scores: near ties by bench_load's rule, and still mismatches: the run fails
    bad, near, why = compare(table([0, 0, 1], [99, 98, 97], [0.5, 0.5, 0.25]), want, ids)
    assert (bad, near) == (2, 2) and "4 ads in one only" in why
    bad, near, why = compare(table([0, 0, 1], [10, 11, 12], [0.5, 0.5, 0.0]), want, ids)  # the ads, a wrong score
    assert (bad, near) == (1, 0) and why.startswith("request 1: scores differ")
    assert compare(table([0, 0], [10, 11], [0.5, 0.5]), want, ids)[:2] == (1, 0)  # a request's rows missing
    bad, near, why = compare(table([0, 0, 1, 5], [10, 11, 12, 1], [0.5, 0.5, 0.25, 1.0]), want, ids)
    assert (bad, near) == (1, 0) and why == "rows of request 5, which the call did not send"


@pytest.mark.parametrize("path", ["flight", "http"])
def test_a_batched_client_that_cannot_reach_the_server_fails_the_run(path):
    import time

    from bench.bench_batched import client_calls, path_verdict

    port = bl.free_port()  # nothing listens there
    url = f"grpc://127.0.0.1:{port}" if path == "flight" else f"http://127.0.0.1:{port}"
    now = time.time()
    spec = {"path": path, "url": url, "first_client": 0, "clients": 1, "start": now, "end": now + 0.5, "timeout": 2.0}
    batch = pa.record_batch({"request_id": pa.array([0, 1], pa.int64())})
    out, errors = [], []
    client_calls(spec, 0, [batch], {}, out, errors)
    assert len(out) >= 1 and all(c[4] == 0 for c in out) and errors and errors[0].startswith("client 0: ")
    p = {"path": path, "calls": 0, "failed": len(out), "mismatches": 0, "near_ties": 0, "clients_calling": 0,
         "clients_exited": [0], "errors": errors}
    ok, text = path_verdict(p, 1)
    assert not ok and f"{len(out)} failed" in text


def test_profile_servers_stage_figures_are_per_request_and_per_batch():
    """profile_server's stages between two /metrics reads: a request's per answered request, a
    batch's per batch; none (not zeros) for a server that does not count them (an older checkout)."""
    from bench.profile_server import engine_figures

    def metrics(ok: float, batches: float, parse: float, read: float) -> dict[str, float]:
        return {'sidindex_requests_total{outcome="ok"}': ok, "sidindex_batch_requests_count": batches,
                "sidindex_batch_requests_sum": 4 * batches, "sidindex_batch_seconds_sum": 0.01 * batches,
                'sidindex_request_stage_seconds_total{stage="parse"}': parse,
                'sidindex_request_stage_seconds_total{stage="wait"}': 2 * parse,
                'sidindex_request_stage_seconds_total{stage="write"}': 3 * parse,
                **{f'sidindex_batch_stage_seconds_total{{stage="{k}"}}': read * (i + 1)
                   for i, k in enumerate(("read", "encode", "search_post", "answer"))}}

    counters = {"seconds": {"encode": 1.0, "search_post": 2.0}, "batches": 10}
    got = engine_figures(metrics(10, 5, 1.0, 0.5), metrics(110, 30, 1.2, 1.0), counters)
    assert got["request_stage_ms"] == pytest.approx({"parse": 2.0, "wait": 4.0, "write": 6.0})  # ms: 0.2 s / 100
    assert got["batch_stage_ms"] == pytest.approx({"read": 20.0, "encode": 40.0, "search_post": 60.0,
                                                   "answer": 80.0})  # 0.5 s / 25 batches, ...
    assert got["rows_per_batch"] == 4.0
    older = {k: v for k, v in metrics(110, 30, 1.2, 1.0).items() if "stage" not in k}
    got = engine_figures(metrics(10, 5, 1.0, 0.5), older, counters)
    assert got["request_stage_ms"] == {} and got["batch_stage_ms"] == {}


def test_a_server_given_another_checkouts_packages_runs_them(built, tmp_path):
    """bench_load's Server (profile_server's baseline): with another checkout's packages first on
    PYTHONPATH, the engine and its front-end processes run that code, not this checkout's that
    the working directory would put first; without, this checkout's."""
    import httpx

    _, size = built
    base = baseline_copy(tmp_path / "base", marker=True)
    ap = argparse.ArgumentParser()
    bl.server_arguments(ap)
    args = ap.parse_args(["--device", "cpu", "--beams", BEAMS])
    assert bl.resolve_server_arguments(args) is None
    for env, want in (({"PYTHONPATH": str(base)}, "baseline"), (None, None)):
        log = tmp_path / f"serve-{want}.log"
        server = bl.Server(Path(size["root"]), args, log, 2, env)  # two front-ends over the engine
        kept: list[http.client.HTTPConnection] = []
        try:
            server.wait_ready(120)
            seen = {httpx.get(server.url + "/healthz", timeout=30).headers.get("x-bench-tree") for _ in range(8)}
            for _ in range(16):  # connections kept alive: profile_server counts each front-end's
                kept.append(http.client.HTTPConnection("127.0.0.1", server.port, timeout=30))
                kept[-1].request("GET", "/healthz")
                kept[-1].getresponse().read()
            held = connections(server.proc.pid, server.port)
        finally:
            for c in kept:
                c.close()
            assert server.stop() == 0
        assert seen == {want}
        # every connection counted, each at the front-end that holds it
        assert len(held) == 2 and sum(held) == 16 and min(held) > 0, held
