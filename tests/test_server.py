"""`sidindex serve`: the HTTP server answers as the Retriever does, in JSON and Arrow, batches
concurrent requests (request ids may repeat across clients), refuses bad requests by field, is
busy rather than unbounded, keeps serving past a failing scorer and a corrupt snapshot, swaps to
a new snapshot between batches, reports on itself, and drains on SIGTERM (the console script)."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

pytest.importorskip("starlette")
pytest.importorskip("httpx")

from starlette.testclient import TestClient  # noqa: E402

import runtime  # noqa: E402
from runtime.scorers.factory import ScorerFactory  # noqa: E402
from runtime.server.engine import Engine  # noqa: E402
from runtime.server.http import ARROW_STREAM, RetrievalServer  # noqa: E402
from tests.conftest import run_cli  # noqa: E402
from tests.test_retrieve import CONFIG, build_root  # noqa: E402

BEAMS = (1, 8, 16, 16)


@pytest.fixture(scope="module")
def built(sample_dir, tmp_path_factory) -> Path:
    return build_root(sample_dir, tmp_path_factory.mktemp("server"), CONFIG)


@pytest.fixture
def root(built, tmp_path) -> Path:
    return Path(shutil.copytree(built, tmp_path / "root"))


@pytest.fixture(scope="module")
def rows(sample_dir) -> list[dict]:
    return pq.read_table(sample_dir / "requests.parquet").slice(0, 12).to_pylist()


HTTP_OPTIONS = ("max_body_bytes", "max_request_rows", "timeout_ms", "drain_seconds")


class EngineThread:
    """An engine process stood in for by this one: the Engine and its link (`runtime.server.link`)
    on threads of their own, as `runtime.server.frontend.serve_processes` runs them."""

    def __init__(self, engine: Engine) -> None:
        import asyncio
        import tempfile

        from runtime.server.link import EngineLink

        self.engine, self.place = engine, tempfile.mkdtemp(prefix="sx-")  # short: a socket path's limit
        self.address = f"ipc://{self.place}/engine"
        self.link = EngineLink(engine, self.address)
        asyncio.run(engine.start())
        self.link.start()

    def stop(self) -> None:
        self.link.close()
        self.engine.stop()
        shutil.rmtree(self.place, ignore_errors=True)


@pytest.fixture(params=[False, True], ids=["one-process", "front-end-and-engine"])
def split(request) -> bool:
    """The HTTP front over an engine in its own process, or over the link to an engine process."""
    return request.param


@pytest.fixture
def serving():
    """make(root, scorer=None, split=False, **options) -> (server, engine): a RetrievalServer over
    an Engine on the CPU (options: both's), in this process or (split) over the engine's link,
    the engine on a thread of its own."""
    threads: list[EngineThread] = []

    def make(root: Path, scorer=None, split: bool = False, **kw) -> tuple[RetrievalServer, Engine]:
        from runtime.server.link import EngineClient

        watcher = runtime.SnapshotWatcher(root, "cpu")
        retriever = runtime.Retriever(watcher, beams=BEAMS, batch_sizes=(1, 4, 8), scorer=scorer)
        http = {k: kw.pop(k) for k in HTTP_OPTIONS if k in kw}
        engine = Engine(watcher, retriever, **{"max_batch": 8, "poll_seconds": 60.0} | kw)
        if not split:
            return RetrievalServer(engine, **http), engine
        threads.append(EngineThread(engine))
        return RetrievalServer(EngineClient(threads[-1].address), **http), engine

    yield make
    for t in threads:
        t.stop()


def same_rows(got: list[dict], want: list[dict]) -> bool:
    """The same rows; scores to float32 rounding (a request's logits may differ in their last bit
    with the batch it shares a matrix product with)."""
    key = ("request_id", "rank", "ad_id", "sid")
    return [tuple(g[k] for k in key) for g in got] == [tuple(w[k] for k in key) for w in want] and \
        np.allclose([g["score"] for g in got], [w["score"] for w in want], rtol=1e-5)


def metrics_of(client, engine: Engine, split: bool) -> str:
    """/metrics; split: and the engine's, which an engine process shares with the front-ends
    through prometheus-client's files (the thread standing in for it here does not)."""
    from prometheus_client import generate_latest

    return client.get("/metrics").text + (generate_latest(engine.metrics.registry).decode() if split else "")


def direct(index, rows: list[dict]) -> list[dict]:
    return runtime.Retriever(index, beams=BEAMS, batch_sizes=(8,), warm=False).retrieve(rows).to_pylist()


def in_threads(call, n: int, stagger: float = 0.0) -> None:
    """call(0) .. call(n-1), each on a thread of its own, started `stagger` seconds apart; returns
    when every one has."""
    threads = [threading.Thread(target=call, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
        time.sleep(stagger)
    for t in threads:
        t.join()


def test_json_and_arrow_answer_as_the_retriever_does(root, rows, serving, split):
    server, engine = serving(root, split=split)
    want = direct(engine.retriever.index, rows[:5])
    with TestClient(server.app) as client:
        r = client.post("/retrieve", json={"requests": rows[:5]})
        assert r.status_code == 200 and r.headers["X-Sidindex-Snapshot"] == engine.retriever.index.id
        body = r.json()
        assert body["snapshot"] == engine.retriever.index.id
        got = body["rows"]
        assert same_rows(got, want)
        one = client.post("/retrieve", json={"requests": rows[0]})  # one request as an object
        alone = [g for g in got if g["request_id"] == rows[0]["request_id"]]
        assert one.status_code == 200 and same_rows(one.json()["rows"], alone)
        sink = pa.BufferOutputStream()
        table = pa.Table.from_pylist(rows[:5])
        with pa.ipc.new_stream(sink, table.schema) as w:
            w.write_table(table)
        r = client.post("/retrieve", content=sink.getvalue().to_pybytes(), headers={"content-type": ARROW_STREAM})
        assert r.status_code == 200 and r.headers["content-type"] == ARROW_STREAM
        result = pa.ipc.open_stream(r.content).read_all()
        assert result.schema.metadata[b"snapshot"] == engine.retriever.index.id.encode()
        assert same_rows(result.to_pylist(), want)


def test_concurrent_requests_are_batched_and_keep_their_own_rows(root, rows, serving, split):
    """Eight clients at once, each request_id 1: the batch renumbers them inside and each answer
    holds only its own request's rows."""
    server, engine = serving(root, split=split, max_wait_us=300_000)
    want = {i: direct(engine.retriever.index, [rows[i]]) for i in range(8)}
    got: dict[int, dict] = {}
    with TestClient(server.app) as client:
        def call(i: int) -> None:
            got[i] = client.post("/retrieve", json={"requests": [rows[i] | {"request_id": 1}]}).json()

        in_threads(call, 8)
        metrics = metrics_of(client, engine, split)
    for i in range(8):
        assert same_rows(got[i]["rows"], [w | {"request_id": 1} for w in want[i]])
    batches = float(next(line.split()[1] for line in metrics.splitlines()
                         if line.startswith("sidindex_batch_requests_count")))
    assert batches < 8  # some requests shared a batch
    def summed(prefix: str) -> dict[str, float]:
        return {line.split('"')[1]: float(line.split()[-1]) for line in metrics.splitlines()
                if line.startswith(prefix + "{")}

    def value(name: str) -> float:
        return float(next(line.split()[1] for line in metrics.splitlines() if line.startswith(name + " ")))

    # where the batches' time went: every stage, none counted twice (a batch's stages lie within its time)
    stage = summed("sidindex_batch_stage_seconds_total")
    assert sorted(stage) == sorted(["read", "encode", "search_post", "answer"])
    assert all(v >= 0 for v in stage.values()) and stage["search_post"] > 0
    assert 0.5 * value("sidindex_batch_seconds_sum") <= sum(stage.values()) <= value("sidindex_batch_seconds_sum")
    # and the requests' in their front-end: the three stages are each request's whole time
    request = summed("sidindex_request_stage_seconds_total")
    assert sorted(request) == sorted(["parse", "wait", "write"]) and min(request.values()) > 0
    assert sum(request.values()) == pytest.approx(value("sidindex_request_seconds_sum"), abs=1e-6)


def test_two_batches_run_at_a_time_and_keep_their_own_rows(root, rows, serving, monkeypatch):
    """Eight clients of 4 rows with batches of 4: with a retriever whose graphs have two slots (on a
    GPU) the engine runs two batches at a time (one on the device while the other is staged or
    read), never more, and each answer is its own; on the CPU, one."""
    _, cpu = serving(root, max_batch=4)
    assert cpu.retriever.in_flight == cpu.batcher.in_flight == 1
    monkeypatch.setattr(runtime.Retriever, "in_flight", property(lambda self: 2))
    server, engine = serving(root, max_batch=4)
    want = {i: direct(engine.retriever.index, [r | {"request_id": j} for j, r in enumerate(rows[i:i + 4])])
            for i in range(8)}
    run, lock, running, most = engine.retriever.run, threading.Lock(), [0], [0]

    def counted(*args, **kw):
        with lock:
            running[0] += 1
            most[0] = max(most[0], running[0])
        try:
            time.sleep(0.05)
            return run(*args, **kw)
        finally:
            with lock:
                running[0] -= 1

    monkeypatch.setattr(engine.retriever, "run", counted)
    got: dict[int, list] = {}
    with TestClient(server.app) as client:
        def call(i: int) -> None:
            body = [r | {"request_id": j} for j, r in enumerate(rows[i:i + 4])]
            got[i] = client.post("/retrieve", json={"requests": body}).json()["rows"]

        in_threads(call, 8)
    assert most[0] == 2
    assert all(same_rows(got[i], want[i]) for i in range(8))


def test_a_bad_request_gets_400_naming_the_field_and_serving_goes_on(root, rows, serving, split):
    server, _ = serving(root, split=split)
    with TestClient(server.app) as client:
        bad = [dict(r) for r in rows[:3]]
        bad[2]["embedding"] = [float("nan")] + bad[2]["embedding"][1:]
        r = client.post("/retrieve", content=json.dumps({"requests": bad}).replace("NaN", "1e19"),
                        headers={"content-type": "application/json"})
        assert r.status_code == 400
        assert r.json() == {"error": "request body: column 'embedding', row 2: element 0 is 1e+19, beyond the allowed "
                                     "range [-1e+06, 1e+06] (MAX_ABS_EMBEDDING: larger values overflow float32 "
                                     "distance arithmetic). Normalise or rescale the embeddings, or correct the row."}
        for body, words in [(b"{", "not JSON"), (b'{"requests": []}', "at least one request"),
                            (json.dumps({"requests": [{"embedding": rows[0]["embedding"]}]}).encode(),
                             "missing column 'request_id'")]:
            r = client.post("/retrieve", content=body, headers={"content-type": "application/json"})
            assert r.status_code == 400 and words in r.json()["error"], (body, r.text)
        r = client.post("/retrieve", content=b"not arrow", headers={"content-type": ARROW_STREAM})
        assert r.status_code == 400 and "not an Arrow IPC stream" in r.json()["error"]
        assert client.post("/retrieve", json={"requests": rows[:3]}).status_code == 200
        assert 'sidindex_requests_total{outcome="bad_request"} 5.0' in client.get("/metrics").text


class Boom:
    """A user's factory whose scorer fails for a batch holding a request with `boom` set."""

    def __init__(self, level_sizes):
        self.V = max(level_sizes)

    def __call__(self, batch, device, level_sizes):
        import torch

        fail = "boom" in batch.column_names and any(batch.column("boom").to_pylist())

        def scorer(step, tokens, parent):
            if fail:
                raise RuntimeError("out of cheese")
            return torch.zeros(*tokens.shape[:2], self.V)

        return scorer


def test_a_failing_scorer_gets_500_and_the_server_keeps_serving(root, rows, serving, split):
    index = runtime.load(root, "cpu")
    server, _ = serving(root, split=split, scorer=ScorerFactory(Boom(index.level_sizes), "tests:boom"))
    with TestClient(server.app) as client:
        r = client.post("/retrieve", json={"requests": [rows[0] | {"boom": True}]})
        assert r.status_code == 500 and "out of cheese" in r.json()["error"] and "\n" not in r.json()["error"]
        assert client.post("/retrieve", json={"requests": [rows[1] | {"boom": False}]}).status_code == 200


class Slow:
    """A factory whose scorer sleeps, so that requests queue behind a batch."""

    def __init__(self, level_sizes, seconds):
        self.V, self.seconds = max(level_sizes), seconds

    def __call__(self, batch, device, level_sizes):
        import torch

        def scorer(step, tokens, parent):
            if step == 0:
                time.sleep(self.seconds)
            return torch.zeros(*tokens.shape[:2], self.V)

        return scorer


def test_a_full_queue_answers_503_with_retry_after(root, rows, serving, split):
    index = runtime.load(root, "cpu")
    server, engine = serving(root, split=split, scorer=ScorerFactory(Slow(index.level_sizes, 0.0), "tests:slow"),
                             max_queue=1, max_batch=1)
    engine.retriever.factory.factory.seconds = 0.5  # after the warm-up
    status: list[int] = []
    with TestClient(server.app) as client:
        def call(i: int) -> None:
            status.append(client.post("/retrieve", json={"requests": [rows[i]]}).status_code)

        in_threads(call, 4, stagger=0.1)  # the first runs, the second waits, the rest find the queue full
        busy = client.post("/retrieve", json={"requests": [rows[0]]})  # served again once drained
    assert status.count(503) >= 1 and status.count(200) >= 2 and busy.status_code == 200


def test_swaps_follow_root_between_batches_and_a_corrupt_snapshot_is_refused(root, rows, tmp_path, serving, split):
    server, engine = serving(root, split=split, poll_seconds=0.05)
    with TestClient(server.app) as client:
        first = client.post("/retrieve", json={"requests": rows[:4]}).json()
        old = first["snapshot"]
        paused = first["rows"][0]["ad_id"]
        pq.write_table(pa.table({"ad_id": pa.array([paused], pa.int64()), "op": ["pause"]}), tmp_path / "c.parquet")
        assert run_cli("update", root, "--changes", tmp_path / "c.parquet", timeout=600).returncode == 0
        deadline = time.time() + 60
        while client.get("/snapshot").json()["id"] == old and time.time() < deadline:
            time.sleep(0.05)
        snap = client.get("/snapshot").json()
        assert snap["id"] != old and snap["last_error"] is None and snap["counters"]["warmed"] == 2
        second = client.post("/retrieve", json={"requests": rows[:4]}).json()
        assert second["snapshot"] == snap["id"] and paused not in [r["ad_id"] for r in second["rows"]]
        metrics = metrics_of(client, engine, split)
        assert "sidindex_swaps_total 1.0" in metrics
        assert f'sidindex_snapshot_info{{snapshot="{snap["id"]}"}} 1.0' in metrics

        engine.poll_seconds = 3600.0  # corrupt the next snapshot before anything polls it
        time.sleep(0.2)
        other = second["rows"][0]["ad_id"]
        pq.write_table(pa.table({"ad_id": pa.array([other], pa.int64()), "op": ["pause"]}), tmp_path / "d.parquet")
        assert run_cli("update", root, "--changes", tmp_path / "d.parquet", timeout=600).returncode == 0
        newest = (root / "CURRENT").read_text().strip()
        # a file of its own (the update hard-links the files it did not change to the served snapshot's)
        victim = next(p for p in sorted((root / "snapshots" / newest).iterdir())
                      if p.is_file() and p.stat().st_nlink == 1 and p.name != "manifest.json")
        data = bytearray(victim.read_bytes())
        data[len(data) // 2] ^= 0xFF
        victim.write_bytes(bytes(data))
        assert not engine.watcher.poll()
        snap = client.get("/snapshot").json()
        assert snap["id"] == second["snapshot"] and newest in snap["last_error"]
        third = client.post("/retrieve", json={"requests": rows[:4]})
        assert third.status_code == 200 and third.json()["snapshot"] == second["snapshot"]
        assert same_rows(third.json()["rows"], second["rows"])
        assert "sidindex_snapshot_refused 1.0" in metrics_of(client, engine, split)
        assert client.get("/healthz").json()["snapshot"] == second["snapshot"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_ready(port: int, timeout: float = 120) -> None:
    """Until the server on `port` answers /readyz with 200 (or `timeout` seconds pass)."""
    import httpx

    deadline = time.time() + timeout
    while time.time() < deadline:
        try:
            if httpx.get(f"http://127.0.0.1:{port}/readyz").status_code == 200:
                return
        except httpx.TransportError:
            time.sleep(0.2)


def test_the_console_script_serves_and_drains_on_sigterm(built, rows, tmp_path):
    import httpx

    port = _free_port()
    sidindex = Path(sys.executable).parent / "sidindex"
    root = Path(shutil.copytree(built, tmp_path / "root"))
    flight_port = _free_port()
    warmup = tmp_path / "warmup.parquet"  # real requests to warm up with
    pq.write_table(pa.Table.from_pylist(rows), warmup)
    p = subprocess.Popen([str(sidindex), "serve", str(root), "--port", str(port), "--beams", "1,8,16,16",
                          "--poll-seconds", "0.1", "--flight-port", str(flight_port), "--warmup", str(warmup)],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=os.environ | {"COLUMNS": "200"})
    try:
        _wait_ready(port)
        r = httpx.post(f"http://127.0.0.1:{port}/retrieve", json={"requests": rows[:2]}, timeout=60)
        assert r.status_code == 200 and r.json()["rows"]
        from pyarrow import flight

        from runtime.server.flight import RETRIEVE

        client = flight.connect(f"grpc://127.0.0.1:{flight_port}")  # the same answer over Arrow Flight
        writer, reader = client.do_exchange(flight.FlightDescriptor.for_command(RETRIEVE))
        table = pa.Table.from_pylist(rows[:2])
        writer.begin(table.schema)
        writer.write_table(table)
        writer.done_writing()
        assert same_rows(reader.read_all().to_pylist(), r.json()["rows"])
        client.close()
        with socket.create_connection(("127.0.0.1", port)) as s:  # a client gone half way through its body
            s.sendall(b"POST /retrieve HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                      b"Content-Length: 1000\r\n\r\n{\"requests\": [")
        time.sleep(0.5)
        metrics = httpx.get(f"http://127.0.0.1:{port}/metrics").text
        assert 'sidindex_requests_total{outcome="disconnected"} 1.0' in metrics
        # a stop while a new snapshot warms (a rolling deploy's SIGTERM during a swap)
        update = run_cli("update", root, "--changes", _pause_one(root), "--json")
        assert update.returncode == 0, update.stderr
        time.sleep(0.3)  # the poll (every 0.1 s) has started warming it
    finally:
        p.send_signal(signal.SIGTERM)
        out, err = p.communicate(timeout=60)
    assert p.returncode == 0, err
    assert "Traceback" not in err and "terminate" not in err and "stopped: every request in flight was answered" in err
    assert f"with {len(rows)} requests from {warmup}" in err
    bad = run_cli("serve", tmp_path / "nowhere", "--port", str(port), timeout=120)
    assert bad.returncode == 2 and len(bad.stderr.strip().splitlines()) == 1 and "Traceback" not in bad.stderr


def test_a_warm_up_file_it_cannot_read_stops_the_server_before_it_serves(built, rows, tmp_path):
    """--warmup: a file that is missing, or holds a bad request, is one line naming it (the
    column and row too), exit 2, before anything is served."""
    table = pa.Table.from_pylist(rows)
    short = pa.FixedSizeListArray.from_arrays(pa.array(np.zeros(3 * len(rows), np.float32)), 3)
    bad = tmp_path / "bad.parquet"
    pq.write_table(table.set_column(table.column_names.index("embedding"), "embedding", short), bad)
    for path, says in ((tmp_path / "missing.parquet", "missing.parquet"), (bad, "column 'embedding', row 0")):
        r = run_cli("serve", built, "--port", str(_free_port()), "--warmup", path, timeout=120)
        assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
        line = r.stderr.strip().splitlines()[-1]
        assert says in line and str(path.name) in line and "serving" not in r.stderr, r.stderr


@pytest.mark.parametrize("delay", [0.4, 1.5], ids=["while-its-modules-load", "while-it-warms"])
def test_sigterm_while_the_server_starts_exits_0(built, delay):
    """A rolling deploy may stop a replica it just started: before it serves, SIGTERM is a clean
    stop (exit 0, one line), whether it comes while the command's modules load or the snapshot
    loads and warms."""
    sidindex = Path(sys.executable).parent / "sidindex"
    p = subprocess.Popen([str(sidindex), "serve", str(built), "--port", str(_free_port()), "--beams", "1,8,16,16"],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    time.sleep(delay)
    p.send_signal(signal.SIGTERM)
    _, err = p.communicate(timeout=120)
    assert p.returncode == 0, err
    assert "Traceback" not in err and ("before serving; no request was taken" in err or
                                       "stopped: every request in flight was answered" in err), err


def _children(pid: int) -> list[int]:
    """The processes whose parent is `pid` (Linux /proc)."""
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:  # gone meanwhile
            continue
        if int(fields[1]) == pid:
            found.append(int(stat.parent.name))
    return found


@pytest.mark.skipif(not Path("/proc").is_dir(), reason="reads the process tree from /proc")
def test_front_end_processes_answer_as_one_does_and_stop_on_sigterm(built, rows, tmp_path):
    """`serve --workers 2`: two front-end processes over the engine process answer as the
    Retriever does (JSON, Arrow, concurrent clients), report every process's metrics, replace one
    that dies, and on SIGTERM under load answer or refuse (503) every request and exit 0."""
    import httpx

    pytest.importorskip("zmq")
    port = _free_port()
    sidindex = Path(sys.executable).parent / "sidindex"
    p = subprocess.Popen([str(sidindex), "serve", str(built), "--port", str(port), "--beams", "1,8,16,16",
                          "--workers", "2", "--max-batch", "8", "--drain-seconds", "10"],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=os.environ | {"COLUMNS": "200"})
    url = f"http://127.0.0.1:{port}"
    statuses: list[int] = []
    clients: list[threading.Thread] = []
    try:
        _wait_ready(port)
        fronts = _children(p.pid)
        assert len(fronts) == 2
        if sys.platform.startswith("linux"):  # each listens on a socket of its own (SO_REUSEPORT)
            from bench.profile_server import held, port_sockets

            mine = [held(f, port_sockets(port, "0A")) for f in fronts]
            assert all(mine) and not mine[0] & mine[1], mine
        want = direct(runtime.load(built, "cpu"), rows[:4])
        assert same_rows(httpx.post(f"{url}/retrieve", json={"requests": rows[:4]}, timeout=60).json()["rows"], want)
        table = pa.Table.from_pylist(rows[:4])
        sink = pa.BufferOutputStream()
        with pa.ipc.new_stream(sink, table.schema) as w:
            w.write_table(table)
        r = httpx.post(f"{url}/retrieve", content=sink.getvalue().to_pybytes(),
                       headers={"content-type": ARROW_STREAM}, timeout=60)
        assert same_rows(pa.ipc.open_stream(r.content).read_all().to_pylist(), want)
        got: dict[int, list] = {}

        def call(i: int) -> None:  # request id 1 from every client: each answer holds its own rows
            got[i] = httpx.post(f"{url}/retrieve", json={"requests": [rows[i] | {"request_id": 1}]},
                                timeout=60).json()["rows"]

        in_threads(call, 8)
        for i in range(8):
            assert same_rows(got[i], [w | {"request_id": 1} for w in direct(runtime.load(built, "cpu"), [rows[i]])])
        bad = httpx.post(f"{url}/retrieve", json={"requests": [{"embedding": [0.0]}]}, timeout=60)
        assert bad.status_code == 400 and "missing column 'request_id'" in bad.json()["error"]
        metrics = httpx.get(f"{url}/metrics").text  # one front-end's answer: every process's values
        assert 'sidindex_requests_total{outcome="ok"} 10.0' in metrics
        assert 'sidindex_requests_total{outcome="bad_request"} 1.0' in metrics
        assert float(next(line.split()[1] for line in metrics.splitlines()
                          if line.startswith("sidindex_batch_requests_count"))) >= 3
        os.kill(fronts[0], signal.SIGKILL)  # a front-end dies: another takes its place
        deadline = time.time() + 60
        while (fronts[0] in _children(p.pid) or len(_children(p.pid)) < 2) and time.time() < deadline:
            time.sleep(0.2)
        assert len(_children(p.pid)) == 2 and fronts[0] not in _children(p.pid)
        for _ in range(16):  # the replacement listens where the dead one did: new connections, on
            with httpx.Client(timeout=30) as fresh:  # whichever socket the kernel puts them, are answered
                assert fresh.post(f"{url}/retrieve", json={"requests": rows[:1]}).status_code == 200

        def load(i: int) -> None:
            for _ in range(20):
                try:
                    r = httpx.post(f"{url}/retrieve", json={"requests": [rows[i]]}, timeout=60)
                except httpx.TransportError:  # the front-ends stopped listening: nothing was accepted
                    return
                statuses.append(r.status_code)

        clients += [threading.Thread(target=load, args=(i,)) for i in range(4)]
        for t in clients:
            t.start()
        kept = httpx.Client(timeout=60)  # a kept-alive connection, idle when the stop comes
        assert kept.post(f"{url}/retrieve", json={"requests": rows[:1]}).status_code == 200
        time.sleep(0.5)
    finally:
        p.send_signal(signal.SIGTERM)
    # its next requests: answered (200) until the stop reaches its front-end, then one 503 saying
    # Connection: close; the one after finds the port closed, or closing: a connection the kernel
    # queued for a front-end that stopped listening before accepting it is reset (no request of it
    # was read)
    seen = []
    for _ in range(200):
        try:
            r = kept.post(f"{url}/retrieve", json={"requests": rows[:1]})
        except httpx.TransportError as e:
            seen.append(type(e).__name__)
            break
        seen.append((r.status_code, r.headers.get("connection")))
        time.sleep(0.01)
    out, err = p.communicate(timeout=60)
    assert (503, "close") in seen and seen[-1] in ("ConnectError", "ReadError", "RemoteProtocolError"), seen
    for t in clients:
        t.join(60)
    assert p.returncode == 0, err
    assert "Traceback" not in err and "stopped: every request in flight was answered" in err
    assert statuses and set(statuses) <= {200, 503}, statuses
    assert not _children(p.pid)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the kernel spreads connections over sockets "
                    "sharing a port (SO_REUSEPORT) on Linux; elsewhere the front-ends share one socket")
def test_front_ends_listen_on_sockets_of_their_own_that_share_the_connections():
    """Each front-end gets a socket of its own on the one port, and the kernel spreads connections
    over them: on one shared socket the busiest front-end took 30-49 of 64 connections over 4 and
    set every client's latency. The port stays one server's: a second finds it taken."""
    from runtime.server.frontend import listen

    sockets = listen("127.0.0.1", 0, 4)
    clients = []
    try:
        port = sockets[0].getsockname()[1]
        assert len({s.fileno() for s in sockets}) == 4 and {s.getsockname()[1] for s in sockets} == {port}
        assert all(s.get_inheritable() for s in sockets)
        with pytest.raises(OSError):  # another `sidindex serve` on the port, with or without front-ends
            listen("127.0.0.1", port, 4)
        with pytest.raises(OSError):
            listen("127.0.0.1", port, 1)
        clients = [socket.create_connection(("127.0.0.1", port)) for _ in range(64)]
        accepted = []
        for s in sockets:
            s.setblocking(False)
            n = 0
            while True:
                try:
                    conn, _ = s.accept()
                except BlockingIOError:
                    break
                conn.close()
                n += 1
            accepted.append(n)
        # a hash of each connection's addresses picks its socket: none of 4 left empty by 64 but
        # with odds of 4 * (3/4)^64, about 1e-8
        assert sum(accepted) == 64 and min(accepted) > 0, accepted
    finally:
        for c in clients + sockets:
            c.close()
    one = listen("127.0.0.1", 0, 1)  # one front-end: one socket
    assert len(one) == 1
    one[0].close()


def test_the_engine_answers_a_front_ends_messages_and_refuses_bad_ones(root, rows, serving):
    """Over the link, as a front-end sends them: requests validated against the snapshot served
    are answered as a direct retrieve does; ones validated against another snapshot are validated
    again. A message the engine cannot read (rows other than it counts, none, not Arrow, not the
    portable form) is the server's fault: outcome error with one line, for that request alone; a
    good request beside it in its batch is answered and no batch counts as failed."""
    import math
    import struct

    import zmq

    from runtime.requests import requests_from
    from runtime.server.engine_api import batch_message, read_batch_messages
    from runtime.server.link import RUN, pack, unpack
    from sidindex.requests import portable

    server, engine = serving(root, split=True, max_wait_us=200_000)  # what arrives together, batched together
    index = engine.retriever.index
    socket = zmq.Context.instance().socket(zmq.DEALER)
    socket.setsockopt(zmq.LINGER, 0)
    socket.setsockopt(zmq.RCVTIMEO, 30_000)
    socket.connect(server.engine.address)  # the front-end's link's
    reqs = requests_from(rows[:3], index, source="t")
    message = batch_message(portable(reqs))
    not_portable = batch_message(pa.table({"x": [1, 2, 3]}))

    def send(mid: int, count: int, body, snapshot: str | None = None) -> None:
        socket.send(pack(RUN, struct.pack("<Q", mid), [struct.pack("<dQ", math.nan, count),
                                                       (snapshot or index.id).encode(), *body]))

    def answers(n: int) -> dict[int, list[bytes]]:
        got = [memoryview(socket.recv()) for _ in range(n)]
        return {struct.unpack("<Q", f[1:9])[0]: [bytes(x) for x in unpack(f)] for f in got}

    try:
        send(0, 3, message)
        send(1, 3, message, "an-earlier-snapshot")  # validated again, here
        for mid, (outcome, served, schema, batch) in answers(2).items():
            assert (mid, outcome, served.decode()) == (mid, b"ok", index.id)
            assert same_rows(read_batch_messages(schema, [batch], "answer").to_pylist(), direct(index, rows[:3]))
        send(2, 4, message)
        send(3, 1, (message[0], b"not arrow"))  # its schema's, beside good messages of that schema
        send(4, 3, not_portable)
        send(5, 0, message)
        send(6, 3, message)
        send(7, 3, message[:1])
        send(8, 3, message)
        two = batch_message(portable(requests_from(rows[3:5], index, source="t")))
        send(9, 2, message)  # counts that are each wrong and add up: no request gets another's rows
        send(10, 3, two)
        got = answers(9)
        assert got[6][0] == got[8][0] == b"ok"
        assert same_rows(read_batch_messages(*got[8][2:3], [got[8][3]], "answer").to_pylist(), direct(index, rows[:3]))
        bad = (2, 3, 4, 5, 7, 9, 10)
        assert {mid: got[mid][0] for mid in bad} == dict.fromkeys(bad, b"error")
        assert got[9][2].endswith(b"3 requests, where the front-end counted 2")
        assert got[2][2].decode() == ("the engine could not read a front-end's message: 3 requests, where the "
                                      "front-end counted 4")
        assert got[3][2].decode().startswith("the engine could not read a front-end's message: a front-end's "
                                             "message: not an Arrow IPC stream")
        assert got[5][2].decode() == "a front-end's message counts 0 requests"
        assert got[7][2].decode() == "a front-end's message of 3 fields, not 4"
        assert all(b"\n" not in got[mid][2] for mid in bad)
        assert engine.batcher.failed_batches == 0
    finally:
        socket.close()


def test_a_request_that_overflows_a_batch_starts_the_next(root, rows, serving):
    """Requests of 3 rows with batches of at most 4: each batch takes one, the next waits for the
    following batch; every answer is its own."""
    server, engine = serving(root, max_batch=4, max_wait_us=200_000)
    parts = [rows[i:i + 3] for i in range(0, 12, 3)]
    want = [direct(engine.retriever.index, p) for p in parts]
    got: dict[int, list] = {}
    with TestClient(server.app) as client:
        def call(i: int) -> None:
            got[i] = client.post("/retrieve", json={"requests": parts[i]}).json()["rows"]

        in_threads(call, 4)
        metrics = metrics_of(client, engine, split)
    assert all(same_rows(got[i], want[i]) for i in range(4))
    assert 'sidindex_batch_requests_bucket{le="2.0"} 0.0' in metrics  # never a batch of fewer than 3 rows
    assert "sidindex_batch_requests_count 4.0" in metrics


def test_limits_answer_413_with_one_line_before_any_batch(root, rows, serving, split):
    server, engine = serving(root, split=split, max_body_bytes=4096, max_request_rows=3)
    with TestClient(server.app) as client:
        big = client.post("/retrieve", json={"requests": rows[:1] * 40})  # past 4096 bytes
        assert big.status_code == 413 and "4,096 bytes" in big.json()["error"] and "\n" not in big.json()["error"]
        many = client.post("/retrieve", json={"requests": [{"request_id": i} for i in range(4)]})  # small, 4 rows
        assert many.status_code == 413 and "4 requests; at most 3" in many.json()["error"]
        assert same_rows(client.post("/retrieve", json={"requests": rows[:3]}).json()["rows"],
                         direct(engine.retriever.index, rows[:3]))
        metrics = metrics_of(client, engine, split)
    assert 'sidindex_requests_total{outcome="too_large"} 2.0' in metrics
    assert "sidindex_batch_requests_count 1.0" in metrics  # the refused ones never reached a batch


def test_a_large_request_runs_in_pieces_that_small_ones_pass(root, rows, serving):
    """40 rows with batches of 4 run as 10 pieces; a 1-row request sent while they run is answered
    long before them, and each answer equals the retriever's."""
    index = runtime.load(root, "cpu")
    server, engine = serving(root, scorer=ScorerFactory(Slow(index.level_sizes, 0.0), "tests:slow"), max_batch=4)
    engine.retriever.factory.factory.seconds = 0.05  # after the warm-up: 10 pieces take 0.5 s or more
    large = [r | {"request_id": 100 + i} for i, r in enumerate(rows * 4)][:40]
    answered: dict[str, float] = {}
    got: dict[str, list] = {}
    with TestClient(server.app) as client:
        def call(i: int) -> None:
            name, body = [("large", large), ("small", rows[:1])][i]
            got[name] = client.post("/retrieve", json={"requests": body}).json()["rows"]
            answered[name] = time.perf_counter()

        in_threads(call, 2, stagger=0.1)
        metrics = client.get("/metrics").text
    assert answered["small"] < answered["large"]
    engine.retriever.factory.factory.seconds = 0.0
    assert same_rows(got["large"], direct_with(engine.retriever, large))
    assert same_rows(got["small"], direct_with(engine.retriever, rows[:1]))
    # 10 pieces of 4 and the small request: 11 batches, none of more than 4 rows
    assert 'sidindex_batch_requests_bucket{le="4.0"} 11.0' in metrics
    assert "sidindex_batch_requests_count 11.0" in metrics


def direct_with(retriever: runtime.Retriever, rows: list[dict]) -> list[dict]:
    """The rows `retriever` gives the requests on its own (its scorer, batches of its sizes)."""
    return retriever.retrieve(rows).to_pylist()


def test_a_request_past_its_deadline_gets_504_and_its_rows_are_dropped(root, rows, serving, split):
    index = runtime.load(root, "cpu")
    server, engine = serving(root, split=split, scorer=ScorerFactory(Slow(index.level_sizes, 0.0), "tests:slow"),
                             max_batch=1, timeout_ms=300)
    engine.retriever.factory.factory.seconds = 0.2
    with TestClient(server.app) as client:
        late = client.post("/retrieve", json={"requests": rows[:6]})  # 6 pieces of 0.2 s: past 300 ms
        assert late.status_code == 504 and "300 ms" in late.json()["error"]
        time.sleep(0.5)  # the piece running at the deadline ends; the rest never run
        ran = engine.retriever.counters.batches
        time.sleep(0.5)
        assert engine.retriever.counters.batches == ran
        assert client.post("/retrieve", json={"requests": rows[:1]}).status_code == 200


def test_readyz_fails_after_failed_batches_in_a_row_and_recovers(root, rows, serving, split):
    index = runtime.load(root, "cpu")
    server, _ = serving(root, split=split, scorer=ScorerFactory(Boom(index.level_sizes), "tests:boom"), unready_after=2)
    with TestClient(server.app) as client:
        assert client.get("/readyz").status_code == 200
        for i in range(2):
            assert client.post("/retrieve", json={"requests": [rows[i] | {"boom": True}]}).status_code == 500
        r = client.get("/readyz")
        assert r.status_code == 503 and r.json()["why"] == "the last 2 batches failed"
        assert client.post("/retrieve", json={"requests": [rows[0] | {"boom": False}]}).status_code == 200
        assert client.get("/readyz").status_code == 200


def test_close_abandons_a_warm_up_at_its_next_batch(root, rows, monkeypatch, serving):
    """A stop while a new snapshot warms: `close` returns once the batch in progress ends, the
    warm-up never finishes, and the snapshot served stays (the poll reports why)."""
    server, engine = serving(root)
    first = engine.retriever.index.id
    r = run_cli("update", root, "--changes", _pause_one(root), "--json")
    assert r.returncode == 0, r.stderr
    started = threading.Event()
    batch = runtime.Retriever._batch

    def slow(self, *a, **kw):
        started.set()
        time.sleep(0.3)
        return batch(self, *a, **kw)

    monkeypatch.setattr(runtime.Retriever, "_batch", slow)
    poll = threading.Thread(target=engine.watcher.poll)
    poll.start()
    assert started.wait(30)
    t = time.perf_counter()
    assert server.close(timeout=10)
    poll.join(10)
    assert time.perf_counter() - t < 2 and not poll.is_alive()
    assert engine.watcher.current.id == first and "warm-up abandoned" in engine.watcher.last_error


def _pause_one(root: Path) -> Path:
    """A change file pausing the served snapshot's first ad, beside ROOT."""
    ad = int(runtime.load(root, "cpu").snapshot.ad_id[0])
    path = root.parent / "pause.parquet"
    pq.write_table(pa.table({"ad_id": pa.array([ad], pa.int64()), "op": ["pause"]}), path)
    return path


def test_large_bodies_and_answers_are_handled_off_the_event_loop_alike(root, rows, serving, monkeypatch):
    """A body or an answer past the server's thresholds is parsed or written on a thread: the same
    answers, JSON and Arrow."""
    import runtime.server.http as server_module

    monkeypatch.setattr(server_module, "OFF_LOOP_BYTES", 0)
    monkeypatch.setattr(server_module, "OFF_LOOP_ROWS", 0)
    server, engine = serving(root)
    want = direct(engine.retriever.index, rows[:5])
    with TestClient(server.app) as client:
        assert same_rows(client.post("/retrieve", json={"requests": rows[:5]}).json()["rows"], want)
        table = pa.Table.from_pylist(rows[:5])
        sink = pa.BufferOutputStream()
        with pa.ipc.new_stream(sink, table.schema) as w:
            w.write_table(table)
        r = client.post("/retrieve", content=sink.getvalue().to_pybytes(), headers={"content-type": ARROW_STREAM})
        assert same_rows(pa.ipc.open_stream(r.content).read_all().to_pylist(), want)
        bad = client.post("/retrieve", json={"requests": [{"embedding": [0.0]}]})
        assert bad.status_code == 400 and "missing column 'request_id'" in bad.json()["error"]


def test_an_embedding_past_float32_gets_400_and_no_warning(root, rows, serving):
    import warnings

    server, _ = serving(root)
    bad = rows[0] | {"embedding": [1e39] + list(rows[0]["embedding"][1:])}
    with TestClient(server.app) as client, warnings.catch_warnings():
        warnings.simplefilter("error")  # numpy's overflow warning would be an error here
        r = client.post("/retrieve", json={"requests": [bad]})
    assert r.status_code == 400 and "column 'embedding', row 0: element 0 is 1e+39" in r.json()["error"]


def test_retrieve_takes_post_alone_and_the_other_routes_stay(root, rows, serving):
    """POST /retrieve bypasses the router: another method gets 405 naming POST, and the probes and
    an unknown path answer as Starlette's router does."""
    server, _ = serving(root)
    with TestClient(server.app) as client:
        r = client.get("/retrieve")
        assert r.status_code == 405 and r.headers["allow"] == "POST"
        assert client.get("/healthz").status_code == 200
        assert client.get("/nowhere").status_code == 404
        r = client.post("/retrieve", json={"requests": rows[:1]})
        assert r.status_code == 200 and r.headers["content-type"] == "application/json"
        assert r.headers["content-length"] == str(len(r.content)) and r.headers["x-sidindex-snapshot"]


@pytest.mark.parametrize("writer", ["spliced", "polars"])
def test_a_json_answer_holds_every_row_exactly_and_no_beam_as_null(writer, monkeypatch):
    """The JSON answer, written on the loop (spliced from orjson's columns) or on a thread
    (polars): int64 ids at their extremes exact, SIDs as lists, each score its float32's shortest
    decimal, parsing back to it, -inf (an ad no beam reached) as null, the value column when there
    is one; an empty answer is an empty list. Both writers write the same bytes."""
    import orjson

    from runtime.server import http
    from runtime.server.http import _json_body

    monkeypatch.setattr(http, "OFF_LOOP_ROWS", 10**9 if writer == "spliced" else -1)
    rng = np.random.default_rng(0)
    n = 2000
    score = rng.standard_normal(n).astype(np.float32) * np.float32(1e30)
    score[::7] = -np.inf
    extremes = [np.iinfo(np.int64).min, np.iinfo(np.int64).max, -1, 0]
    ids = np.concatenate([extremes, rng.integers(-2**63, 2**63 - 1, n - 4)])
    sid = pa.FixedSizeListArray.from_arrays(pa.array(rng.integers(-2**15, 2**15, n * 4).astype(np.int16)), 4)
    table = pa.table({"request_id": ids, "rank": np.arange(1, n + 1), "ad_id": ids[::-1].copy(), "sid": sid,
                      "score": score, "value": rng.random(n) * 1e300})
    doc = orjson.loads(_json_body(table, 'a "snapshot"'))
    assert doc["snapshot"] == 'a "snapshot"'
    rows = doc["rows"]
    want = table.to_pylist()
    assert [(r["request_id"], r["rank"], r["ad_id"], r["sid"], r["value"]) for r in rows] == \
        [(w["request_id"], w["rank"], w["ad_id"], w["sid"], w["value"]) for w in want]
    got = np.array([np.nan if r["score"] is None else r["score"] for r in rows], dtype=np.float64).astype(np.float32)
    assert np.array_equal(np.isnan(got), np.isinf(score))
    assert np.array_equal(got[~np.isnan(got)], score[np.isfinite(score)])
    assert orjson.loads(_json_body(table.slice(0, 0), "s"))["rows"] == []
    written = _json_body(table.slice(5, 300), "s")  # a slice: offsets into its columns' buffers
    assert orjson.loads(written)["rows"] == rows[5:305]
    monkeypatch.setattr(http, "OFF_LOOP_ROWS", -1 if writer == "spliced" else 10**9)  # the other writer
    assert _json_body(table.slice(5, 300), "s") == written


def test_floats_with_nulls_are_written_as_polars_writes_them(monkeypatch):
    """A float column with nulls (a user's scorer's value, say) keeps float32's shortest decimal
    in the spliced answer, byte for byte as polars writes it, a null as null."""
    from runtime.server import http
    from runtime.server.http import _json_body

    table = pa.table({"score": pa.array([0.1, None, -np.inf, 3e38, np.nan], pa.float32()),
                      "value": pa.array([None, 0.1, 1e300, -0.0, 5.0])})
    monkeypatch.setattr(http, "OFF_LOOP_ROWS", -1)
    by_polars = _json_body(table, "s")
    monkeypatch.setattr(http, "OFF_LOOP_ROWS", 10**9)
    assert _json_body(table, "s") == by_polars and b'"score":0.1,' in by_polars


@pytest.mark.parametrize("writer", ["spliced", "polars"])
def test_a_json_answer_of_any_columns_parses_back_to_its_table(writer, monkeypatch):
    """Columns a user's scorer or a request may bring: strings that hold JSON's and the row
    template's own characters (quotes, commas, brackets, %), nulls among numbers and inside and
    instead of fixed-size lists, booleans, lists, unsigned 64-bit ids, a name with a quote and a
    %, several chunks: every writer's answer parses back to the table's rows."""
    import orjson

    from runtime.server import http
    from runtime.server.http import _json_body

    monkeypatch.setattr(http, "OFF_LOOP_ROWS", 10**9 if writer == "spliced" else -1)
    n = 7
    strings = ['a"b', "c,d", "],[", "%b", "%%s", "é\\", ""]
    lists = pa.FixedSizeListArray.from_arrays(pa.array([1, None, 3, 4, 5, 6] + list(range(8))), 2)
    nulled = pa.array([[1, 2], None, [3, 4], [5, 6], [7, 8], [9, 10], [11, 12]], pa.list_(pa.int16(), 2))
    chunked = pa.chunked_array([pa.array([1, 2, 3], pa.uint64()), pa.array([2**64 - 1, 0, 5, 6], pa.uint64())])
    table = pa.table({"request_id": strings, 'we"ird%b': pa.array([1.5, None, -2.0, 0.0, 3.0, None, 1e-300]),
                      "ok": pa.array([True, False, None, True, True, False, True]),
                      "tags": [["x"], [], None] * 2 + [["%"]],
                      "sid": lists, "nulled": nulled, "id": chunked,
                      "empty": pa.array([[]] * n, pa.list_(pa.int64(), 0))})
    if writer == "polars":  # its conversion refuses a fixed-size list of size 0
        table = table.drop_columns(["empty"])
    rows = orjson.loads(_json_body(table, "s"))["rows"]
    assert rows == table.to_pylist()


def test_requests_validated_for_another_embedding_width_are_validated_again(built, rows):
    """A swap between a request's arrival and its batch to a snapshot of the same targeting spec
    whose codebook takes another embedding width: the request is validated again, and refused
    alone with the validator's line (400), in process and from a front-end's message; it never
    reaches the retriever."""
    import asyncio
    import functools
    from types import SimpleNamespace

    from runtime.requests import validated_for
    from runtime.server.batcher import Batcher, Pending
    from runtime.server.engine_api import batch_message
    from runtime.server.metrics import EngineMetrics
    from sidindex.errors import InputError
    from sidindex.requests import portable

    served = runtime.load(built, "cpu")
    wider = SimpleNamespace(spec=served.spec, id="a-wider-codebook",
                            codebook=SimpleNamespace(dim=served.codebook.dim + 1))

    class Swapped:  # the retriever once the wider snapshot is served; it must not run the request
        index, in_flight = wider, 1

        def run(self, *args, **kwargs):
            raise AssertionError("a request validated for another embedding width ran")

    reqs = runtime.requests_from(rows[:2], served)

    async def answers():
        batcher = Batcher(Swapped(), EngineMetrics(8), max_batch=8)  # type: ignore[arg-type]
        batcher.start()
        try:
            with pytest.raises(InputError, match="embedding"):
                await batcher.answer(reqs, validated_for(served), 10.0)
            loop = asyncio.get_running_loop()
            message = loop.create_future()
            settle = functools.partial(loop.call_soon_threadsafe, message.set_result)
            assert batcher.put([Pending(None, validated_for(served), 2, settle, batch_message(portable(reqs)))]) == 1
            with pytest.raises(InputError, match="embedding"):
                raise await message
        finally:
            batcher.stop()
            batcher.close(10.0)

    asyncio.run(answers())


def test_link_messages_of_one_schema_read_as_one_table():
    """What crosses the link (`batch_message`): a table as its schema's and one record batch's
    messages, dictionary columns decoded, chunks combined, no rows allowed; messages of one schema
    read together (`read_batch_messages`) as the tables one after another; bytes that are not a
    record batch message refused with the name given."""
    from runtime.server.engine_api import batch_message, read_batch_messages
    from sidindex.errors import InputError

    country = pa.array(["US", None, "FR"]).dictionary_encode()
    first = pa.table({"request_id": pa.array([1, 2, 3], pa.int64()), "country": country})
    second = pa.concat_tables([first.slice(0, 1), first.slice(2, 1)])  # two chunks
    plain = pa.schema([("request_id", pa.int64()), ("country", pa.string())])
    messages = [batch_message(t) for t in (first, second, first.slice(0, 0))]
    assert len({m[0].to_pybytes() for m in messages}) == 1  # one schema: read together
    got = read_batch_messages(messages[0][0], [m[1] for m in messages], "m")
    assert got.schema == plain
    assert got.to_pylist() == first.to_pylist() + second.to_pylist()
    with pytest.raises(InputError, match="^m: not an Arrow IPC stream"):
        read_batch_messages(messages[0][0], [b"not a record batch"], "m")


def test_requests_that_leave_out_different_attributes_cross_the_link_in_one_schema(built, rows):
    """A front-end's requests in their portable form (`sidindex.requests.portable`, with the spec
    they were validated against) share one schema whichever attributes they leave unknown (a null,
    an empty list): the engine reads a batch of them as one stream, where each schema was a read
    and a join of its own. Each still answers as the request it came from, alone and joined."""
    from runtime.requests import validated_for
    from runtime.server.batcher import Pending, _read_messages
    from runtime.server.engine_api import batch_message
    from sidindex.requests import from_portable, portable

    index = runtime.load(built, "cpu")
    scalar = next(a.name for a in index.spec.attributes if a.one_request_value)
    listed = next(a.name for a in index.spec.attributes if not a.one_request_value)
    sent = [dict(rows[0], request_id=10), dict(rows[1], request_id=11, **{scalar: None}),
            dict(rows[2], request_id=12, **{listed: []}), dict(rows[3], request_id=13, **{listed: None, scalar: None})]
    alone = [runtime.requests_from(pa.Table.from_pylist([r]), index, source="t") for r in sent]
    assert len({str(r.table.schema) for r in alone}) == 4  # as validated from Arrow: four schemas
    # dicts (a JSON body's) are typed as they are validated
    assert len({str(runtime.requests_from([r], index, source="t").table.schema) for r in sent}) == 1
    tables = [portable(r, index.spec) for r in alone]
    assert len({t.schema for t in tables}) == 1
    for r, t in zip(sent, tables):  # each answers alone as it did before the link
        assert same_rows(direct(index, [r]), direct(index, [from_portable(t, index.spec, "t").table.to_pylist()[0]]))
    messages = [tuple(b.to_pybytes() for b in batch_message(t)) for t in tables]
    assert len({m[0] for m in messages}) == 1
    target = validated_for(index)
    pendings = [Pending(None, target, 1, lambda outcome: None, m) for m in messages]
    assert _read_messages(pendings, index, target) == {}
    assert len({id(p.origin[0]) for p in pendings}) == 1  # one stream: read once, as one batch
    joined = pendings[0].origin[0]
    assert same_rows(direct(index, joined.table.to_pylist()), direct(index, sent))


def test_a_portable_request_validates_again_under_a_spec_that_changed_an_attributes_kind(built, rows):
    """What `portable` types for one spec passes another as the request did: an attribute a request
    left null, typed string while it was one value a request, is validated again (`untyped`, as
    the engine does after a swap) where it became a list of values, and the other way round; a
    list view of nothing stays as given (its cast is not sound)."""
    from sidindex.errors import InputError
    from sidindex.requests import portable, requests_from, untyped
    from sidindex.targeting import spec_from_dict

    index = runtime.load(built, "cpu")
    one = next(a.name for a in index.spec.attributes if a.one_request_value)
    many = next(a.name for a in index.spec.attributes if not a.one_request_value)
    doc = index.spec.to_dict()
    for a in doc["attribute"]:  # the swapped-in spec: each a kind of the other's
        if a["name"] == one:
            a.clear()
            a.update(name=one, kind="bloom", bits=64, hashes=2)
        elif a["name"] == many:
            a.clear()
            a.update(name=many, kind="bitmask", values=["x", "y"])
    swapped = spec_from_dict(doc)
    sent = [dict(rows[0], request_id=1, **{one: None, many: None}),
            dict(rows[1], request_id=2, **{one: None, many: []})]
    for r in sent:
        table = portable(requests_from([r], index.spec, dim=index.codebook.dim), index.spec)
        assert table.schema.field(one).type == pa.string()
        with pytest.raises(InputError):  # as typed for the first spec
            requests_from(table, swapped)
        again = requests_from(untyped(table, swapped), swapped)
        assert again.table.column(one).null_count == 1 and pa.types.is_null(again.table.schema.field(many).type)
    base = pa.Table.from_pylist([dict(rows[0], request_id=1, **{many: None})])
    view = base.set_column(base.schema.get_field_index(many), many, pa.array([[]], pa.list_view(pa.null())))
    kept = portable(requests_from(view, index.spec, dim=index.codebook.dim), index.spec)
    assert kept.schema.field(many).type == pa.list_view(pa.null())
    retriever = runtime.Retriever(index, beams=BEAMS, batch_sizes=(8,), warm=False)
    assert same_rows(retriever.retrieve(kept).to_pylist(), direct(index, [dict(rows[0], request_id=1, **{many: None})]))


def test_the_link_survives_what_it_cannot_answer(tmp_path):
    """The engine's link thread goes on after a status that raises (a bug: one line on stderr, no
    answer), a message too short to name its id or of two frames (no answer), a run message of the
    wrong fields or cut short (error), and a timeout that is not finite (no deadline)."""
    import math
    import struct
    import tempfile
    from types import SimpleNamespace

    import zmq

    from runtime.server.link import RUN, STATUS, EngineLink, pack, unpack

    class Broken:  # an engine whose status fails once, and whose batcher refuses every request
        fail = True
        batcher = SimpleNamespace(put=lambda pendings: 0, refusal=lambda: RuntimeError("refused"), max_batch=16)

        def current_status(self):
            if self.fail:
                self.fail = False
                raise RuntimeError("the device is gone")
            return {"ready": True}

        def current_target(self):
            return SimpleNamespace(snapshot="s", spec=SimpleNamespace(to_dict=dict), dim=None)

        def message(self, message, rows, snapshot, settle):
            return SimpleNamespace(settle=settle, finished=False)

    engine = Broken()
    place = tempfile.mkdtemp(prefix="sl-")
    link = EngineLink(engine, f"ipc://{place}/e")
    link.start()
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.RCVTIMEO, 10_000)
    sock.connect(f"ipc://{place}/e")
    try:
        def mid(n: int) -> bytes:
            return struct.pack("<Q", n)

        sock.send(pack(STATUS, mid(0), []))  # raises in the engine: no answer
        sock.send(b"x")  # no id: nobody to answer
        sock.send_multipart([pack(RUN, mid(9), []), b"a second frame"])  # not a front-end's: no answer
        sock.send(pack(RUN, mid(1), [b"s"]))
        sock.send(pack(RUN, mid(2), [struct.pack("<dQ", math.inf, 1), b"s", b"", b""]))
        sock.send(pack(RUN, mid(3), [b"s"])[:-1])  # cut short
        sock.send(pack(STATUS, mid(4), []))
        got = {struct.unpack("<Q", f[1:9])[0]: [bytes(x) for x in unpack(f)]
               for f in (memoryview(sock.recv()) for _ in range(4))}
        assert sorted(got) == [1, 2, 3, 4]
        assert got[1] == [b"error", b"", b"a front-end's message of 1 fields, not 4"]
        assert got[2] == [b"error", b"", b"RuntimeError: refused"]
        assert got[3] == [b"error", b"", b"a message cut short"]
        assert json.loads(got[4][0])["ready"] is True
        assert link._thread is not None and link._thread.is_alive()
    finally:
        sock.close()
        link.close()
        shutil.rmtree(place, ignore_errors=True)


def test_a_request_queued_again_is_not_released_under_another_batch(built, rows):
    """A large request's deadline passes just after its piece ran and it was queued for the next:
    the other batch thread, which took it at once, must still find its rows. It is answered 504,
    and the request batched beside it is answered, not failed with it."""
    import functools
    from types import SimpleNamespace

    from runtime.requests import validated_for
    from runtime.server.batcher import Batcher, Pending
    from runtime.server.engine_api import batch_message
    from runtime.server.metrics import EngineMetrics
    from sidindex.requests import portable

    served = runtime.load(built, "cpu")
    retriever = runtime.Retriever(served, beams=BEAMS, batch_sizes=(1, 4, 8))
    two = SimpleNamespace(index=served, in_flight=2, run=retriever.run)  # two batch threads, as on a GPU
    batcher = Batcher(two, EngineMetrics(8), max_batch=8, max_wait_us=300_000)  # type: ignore[arg-type]
    target = validated_for(served)
    got: dict[str, object] = {}
    done = threading.Event()

    def settle(name, outcome):
        got[name] = outcome
        if len(got) == 2:
            done.set()

    def pending(requests, name):
        return Pending(None, target, len(requests), functools.partial(settle, name),
                       tuple(b.to_pybytes() for b in batch_message(portable(requests))))

    large = pending(runtime.requests_from(rows[:12], served), "large")
    small = pending(runtime.requests_from(rows[:2], served), "small")
    taken = threading.Event()
    run = batcher._run

    def running(pieces):  # the second piece of the large request waits for its deadline to pass
        if any(p is large and lo > 0 for p, lo, _ in pieces):
            taken.set()
            time.sleep(0.2)
        return run(pieces)

    observe = batcher.metrics.batch.observe

    def ran(seconds):  # after the large request was queued again: its deadline, from the link thread
        if taken.wait(5):
            batcher.expire(large, 0.001)
        observe(seconds)

    batcher._run = running  # type: ignore[method-assign]
    batcher.metrics.batch.observe = ran  # type: ignore[method-assign]
    batcher.start()
    try:
        assert batcher.put([large, small]) == 2
        assert done.wait(30)
    finally:
        batcher.close(10)
    assert isinstance(got["large"], Exception) and "no answer within 1 ms" in str(got["large"])
    assert not isinstance(got["small"], BaseException)


def test_a_scorer_error_in_a_batch_of_parts_that_do_not_join_names_its_clients_id(built, rows):
    """Two requests whose columns do not concatenate run as a batch each; a scorer error blaming
    a row of the second names that request's own id, not the row's number within its part."""
    import functools
    from types import SimpleNamespace

    from runtime.requests import validated_for
    from runtime.server.batcher import Batcher, Pending
    from runtime.server.metrics import EngineMetrics
    from sidindex.errors import ScorerError

    served = runtime.load(built, "cpu")
    retriever = runtime.Retriever(served, beams=BEAMS, batch_sizes=(1, 4, 8))

    def run(requests, index=None, **kw):  # the part holding the extra column's list is blamed, row 1
        if "extra" in requests.table.column_names and pa.types.is_list(requests.table.schema.field("extra").type):
            e = ScorerError(f"scorer returned no finite logit for request {requests.request_id[1]} at step 0")
            e.row, e.request_id = 1, requests.request_id[1]
            raise e
        return retriever.run(requests, index, **kw)

    stub = SimpleNamespace(index=served, in_flight=1, run=run)
    batcher = Batcher(stub, EngineMetrics(8), max_batch=8)  # type: ignore[arg-type]
    got: dict[str, object] = {}
    a = runtime.requests_from([r | {"request_id": 100 + i, "extra": "x"} for i, r in enumerate(rows[:2])], served)
    b = runtime.requests_from([r | {"request_id": 200 + i, "extra": [1]} for i, r in enumerate(rows[2:4])], served)
    target = validated_for(served)
    pieces = [(Pending(reqs, target, 2, functools.partial(got.__setitem__, name)), 0, 2)
              for name, reqs in (("a", a), ("b", b))]
    with pytest.raises(ScorerError, match="for request 201 at step 0") as caught:
        batcher._run(pieces)
    assert caught.value.request_id == 201


def test_requests_join_only_where_a_permissive_concatenation_keeps_every_known_type():
    """`engine_api.joinable`: a null column, or a list of nulls (JSON's null and []), takes the
    others' type; any other difference keeps requests apart, also where the concatenation would
    raise (a map, a list view) or change a type (a fixed-size list becoming a list)."""
    from runtime.server.engine_api import joinable

    def two(a: pa.DataType, b: pa.DataType) -> bool:
        return joinable([pa.schema([("request_id", pa.int64()), ("x", a)]),
                         pa.schema([("request_id", pa.int64()), ("x", b)])])

    for a, b in ((pa.string(), pa.null()), (pa.null(), pa.int64()), (pa.list_(pa.string()), pa.list_(pa.null())),
                 (pa.large_list(pa.string()), pa.list_(pa.null())), (pa.string(), pa.string())):
        assert two(a, b) and two(b, a), (a, b)
        pa.concat_tables([pa.table({"request_id": pa.array([1]), "x": pa.nulls(1, t)}) for t in (a, b)],
                         promote_options="permissive")  # and it joins
    nothing = pa.list_(pa.null())
    for a, b in ((pa.string(), pa.binary()), (pa.int64(), pa.float64()), (nothing, pa.map_(pa.string(), pa.int64())),
                 (nothing, pa.list_view(pa.string())), (nothing, pa.list_(pa.int64(), 2)),
                 (pa.list_(pa.int64()), pa.list_(pa.string()))):
        assert not two(a, b) and not two(b, a), (a, b)
    assert not joinable([pa.schema([("a", pa.int64())]), pa.schema([("b", pa.int64())])])


def test_a_batch_joins_requests_only_where_their_columns_keep_their_types(built, rows):
    """The engine's batch joins requests by the rule a front-end's message does
    (`engine_api.joinable`): a column one of them left null or empty takes the others' type, but an int
    beside a double, or a string beside bytes, runs as a batch each, so a user's scorer sees each
    request's values as sent (2^53 + 1 stays itself, not the double next to it)."""
    import functools
    from types import SimpleNamespace

    from runtime.requests import validated_for
    from runtime.server.batcher import Batcher, Pending
    from runtime.server.metrics import EngineMetrics

    served = runtime.load(built, "cpu")
    retriever = runtime.Retriever(served, beams=BEAMS, batch_sizes=(1, 4, 8))
    seen: list[tuple[pa.DataType, list]] = []

    def run(requests, index=None, **kw):  # what a scorer would see of the extra column
        column = requests.table.column("extra")
        seen.append((column.type, column.to_pylist()))
        return retriever.run(requests, index, **kw)

    stub = SimpleNamespace(index=served, in_flight=1, run=run)
    batcher = Batcher(stub, EngineMetrics(8), max_batch=8)  # type: ignore[arg-type]
    target = validated_for(served)
    big = 2**53 + 1

    def batch(*extras) -> list[tuple[pa.DataType, list]]:
        seen.clear()
        got: dict[int, object] = {}
        pieces = []
        for i, extra in enumerate(extras):
            reqs = runtime.requests_from([rows[i] | {"request_id": i, "extra": extra}], served)
            pieces.append((Pending(reqs, target, 1, functools.partial(got.__setitem__, i)), 0, 1))
        answers = batcher._run(pieces)
        assert all(isinstance(a, tuple) for a in answers), answers
        return sorted(seen, key=str)

    assert batch(big, 0.5) == [(pa.float64(), [0.5]), (pa.int64(), [big])]
    assert batch("x", b"y") == [(pa.binary(), [b"y"]), (pa.string(), ["x"])]
    assert batch(big, None, 3) == [(pa.int64(), [big, None, 3])]  # one batch: the null takes int64
    assert batch(["a"], []) == [(pa.list_(pa.string()), [["a"], []])]  # and the empty list list<string>


def test_a_front_end_sends_the_requests_of_one_turn_as_one_message(root, rows, serving, monkeypatch):
    """Small requests that reach a front-end in one turn of its event loop cross the link as one
    message, renumbered by row, with the smallest of their timeouts: each gets exactly its own rows
    under its own ids (int64, as alone), also where they share ids, differ in which columns are
    null, or repeat one request. Requests whose columns differ otherwise go alone. A message holds
    at most the engine's batch. A message the engine refuses as a whole is sent again request by
    request; a refusal (503) is every request's."""
    import asyncio

    from runtime.server.engine_api import Refused
    from runtime.server.link import GATHER_ROWS, EngineClient, EngineLink
    from sidindex.errors import InputError

    server, engine = serving(root, split=True, max_wait_us=1_000, max_batch=GATHER_ROWS)
    index = engine.retriever.index
    bodies = [rows[i:i + 1 + i % 3] for i in range(8)]  # 1-3 rows each
    bodies.append([{k: (None if k == "country" else v) for k, v in rows[0].items()}])  # a null column's type
    bodies += [[rows[1] | {"request_id": 7}], [rows[2] | {"request_id": 7}]]  # two requests, one id
    want = [direct(index, b) for b in bodies]
    messages: list[int] = []
    timeouts: list[float] = []
    schemas: list[bytes] = []
    refuse: dict = {"as": None}
    pending = EngineLink._pending

    def counted(self, peer, mid, fields):  # the link thread's: what crosses it, and a refusal on demand
        p, timeout = pending(self, peer, mid, fields)
        messages.append(p.rows)
        timeouts.append(timeout)
        schemas.append(bytes(fields[2]))
        if refuse["as"] is not None and p.rows > 1:
            raise refuse["as"]
        return p, timeout

    monkeypatch.setattr(EngineLink, "_pending", counted)

    async def all_at_once(bodies: list[list[dict]], address: str = server.engine.address) -> list:
        client = EngineClient(address)
        await client.start()
        target = await client.target()
        try:
            return await asyncio.gather(*(client.answer(runtime.requests_from(b, index, source="t"), target,
                                                        60.0 - i) for i, b in enumerate(bodies)),
                                        return_exceptions=True)
        finally:
            client.stop()

    got = asyncio.run(all_at_once(bodies))
    for (table, snapshot), w in zip(got, want):
        assert snapshot == index.id and same_rows(table.to_pylist(), w)
        assert table.schema.field("request_id").type == pa.int64()
    total = sum(len(b) for b in bodies)
    assert messages == [total] and total <= GATHER_ROWS  # one message of every row
    assert timeouts == [60.0 - (len(bodies) - 1)]  # the smallest of theirs
    messages.clear()
    schemas.clear()
    refuse["as"] = InputError("a spec swapped in refuses one of them")  # each again alone: its own answer
    got = asyncio.run(all_at_once(bodies))
    assert messages[0] == total and sorted(messages[1:]) == sorted(len(b) for b in bodies)
    assert len(set(schemas)) == 1  # alone too, the request without a country: one schema (`portable`)
    refused = [i for i, b in enumerate(bodies) if len(b) > 1]  # alone, these are still refused (n > 1)
    for i, (g, w) in enumerate(zip(got, want)):
        if i in refused:
            assert isinstance(g, InputError) and str(g) == "a spec swapped in refuses one of them"
        else:
            assert same_rows(g[0].to_pylist(), w)
    messages.clear()
    refuse["as"] = Refused(503, "busy", "the queue is full", retry_after=1)
    got = asyncio.run(all_at_once(bodies))
    assert len(messages) == 1  # not sent again: a refusal is every request's
    assert all(isinstance(g, Refused) and (g.status, str(g)) == (503, "the queue is full") for g in got)
    refuse["as"] = None
    messages.clear()
    odd = [[rows[0] | {"extra": "x"}], [rows[1] | {"extra": [1]}]]  # a column of two types: each alone
    got = asyncio.run(all_at_once(odd))
    assert sorted(messages) == [1, 1]
    for (table, _), b in zip(got, odd):
        assert same_rows(table.to_pylist(), direct(index, b))
    small, _ = serving(root, split=True, max_wait_us=1_000, max_batch=4)  # a message holds at most its batch
    messages.clear()
    got = asyncio.run(all_at_once(bodies, small.engine.address))
    assert sum(messages) == total and max(messages) <= 4 and len(messages) < len(bodies)
    for (table, _), w in zip(got, want):
        assert same_rows(table.to_pylist(), w)
