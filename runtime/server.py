"""`sidindex serve`: a retrieval server over a `runtime.Retriever` (extra `sidindex[serve]`:
Starlette on uvicorn with httptools and uvloop, orjson, prometheus-client).

    POST /retrieve   JSON {"requests": [{"request_id": 1, "embedding": [...], "country": "US", ...}]}
                     -> {"snapshot": id, "rows": [{"request_id", "rank", "ad_id", "sid", "score"[, "value"]}]};
                     or an Arrow IPC stream (content type application/vnd.apache.arrow.stream) -> the
                     result table as an Arrow IPC stream, the snapshot in its schema metadata and in
                     the X-Sidindex-Snapshot header
    GET  /healthz    live and serving a snapshot          GET /readyz    warm (every batch size captured)
    GET  /snapshot   id, format, counts, since when, why the last new one was refused
    GET  /metrics    Prometheus text

Dynamic batching: each HTTP request's rows are validated on arrival (a bad one gets 400 with the
validator's one line), then queued; a worker gathers queued requests until it holds `max_batch`
rows or the first has waited `max_wait_us`, runs them as one batch through the retriever on its
own thread, and answers each with its rows and the snapshot that served the whole batch. The
queue is bounded: a request finding it full gets 503 with Retry-After, never an unbounded wait.
A poller thread calls the watcher every `poll_seconds`; a new snapshot is warmed before it is
swapped in (`Retriever`), between batches, and a broken one leaves the old one serving
(`/snapshot`'s last_error, the sidindex_snapshot_refused gauge). SIGTERM: uvicorn stops taking
connections and lets every request in flight finish, then the worker stops; the process exits 0.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import numpy as np
import orjson
import pyarrow as pa
import torch

from runtime.requests import requests_from
from runtime.retriever import Retriever, requests_part, table_of
from runtime.served import ServedIndex
from runtime.watcher import SnapshotWatcher
from sidindex.errors import InputError, ScorerError, SidIndexError
from sidindex.requests import Requests
from sidindex.targeting import TargetingSpec

ARROW_STREAM = "application/vnd.apache.arrow.stream"
RETRY_AFTER_S = 1


@dataclass
class _Pending:
    """One HTTP request's validated rows, waiting for its batch."""

    requests: Requests
    spec: TargetingSpec  # validated against it
    future: asyncio.Future
    queued: float = field(default_factory=time.perf_counter)


class Metrics:
    """The server's Prometheus metrics, in a registry of their own."""

    def __init__(self, max_batch: int) -> None:
        from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

        r = self.registry = CollectorRegistry()
        ms = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0)
        self.queue_wait = Histogram("sidindex_queue_wait_seconds", "Time a request waited for its batch", buckets=ms,
                                    registry=r)
        self.batch = Histogram("sidindex_batch_seconds", "Time a batch took in the retriever", buckets=ms, registry=r)
        self.end_to_end = Histogram("sidindex_request_seconds", "Time from a request's arrival to its answer",
                                    buckets=ms, registry=r)
        sizes = sorted({1, 2, 4, 8, 16, 32, 64, max_batch})
        self.batch_size = Histogram("sidindex_batch_requests", "Requests per batch", buckets=sizes, registry=r)
        self.outcomes = Counter("sidindex_requests", "HTTP requests by outcome", ["outcome"], registry=r)
        self.swaps = Counter("sidindex_swaps", "Snapshots swapped in", registry=r)
        self.swap_seconds = Histogram("sidindex_swap_seconds", "Time to load and warm a new snapshot",
                                      buckets=(0.1, 0.2, 0.5, 1, 2, 5, 10, 30, 60), registry=r)
        self.widenings = Gauge("sidindex_widenings", "Searches widened since start (0 in a steady state)", registry=r)
        self.stalls = Gauge("sidindex_stalls", "Graphs captured and Triton kernels compiled while serving batches "
                            "(0 once warm)", ["kind"], registry=r)
        self.overflows = Gauge("sidindex_overflows", "Batches answered by the worst case's graph (past the widths "
                               "warm-up measured)", registry=r)
        self.snapshot = Gauge("sidindex_snapshot_info", "The snapshot served", ["snapshot"], registry=r)
        self.age = Gauge("sidindex_snapshot_age_seconds", "Seconds since the snapshot served was swapped in",
                         registry=r)
        self.refused = Gauge("sidindex_snapshot_refused", "1 while the newest published snapshot was refused",
                             registry=r)
        self.gpu_memory = Gauge("sidindex_gpu_memory_bytes", "GPU memory allocated by torch", registry=r)


class RetrievalServer:
    """The server's state and its Starlette app (`app`); see the module doc.

    watcher: the ROOT's watcher; retriever: a warmed Retriever over it; max_batch: the most
    request rows a batch gathers; max_wait_us: how long the first request of a batch waits for
    others; max_queue: the most HTTP requests waiting; poll_seconds: how often ROOT is polled.
    """

    def __init__(self, watcher: SnapshotWatcher, retriever: Retriever, *, max_batch: int = 16,
                 max_wait_us: int = 500, max_queue: int = 1024, poll_seconds: float = 1.0) -> None:
        self.watcher, self.retriever = watcher, retriever
        self.max_batch, self.max_wait, self.poll_seconds = max_batch, max_wait_us / 1e6, poll_seconds
        self.max_queue = max_queue
        self.metrics = Metrics(max_batch)
        self.since = time.time()
        self.served = watcher.current.id
        self.metrics.snapshot.labels(self.served).set(1)
        self.ready = retriever.warm
        self._queue: asyncio.Queue | None = None
        self._worker: asyncio.Task | None = None
        self._stop = threading.Event()
        self._poller: threading.Thread | None = None
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="sidindex-batch")  # one batch at a time
        self.app = self._make_app()

    # -- HTTP ------------------------------------------------------------------------------

    def _make_app(self):
        from starlette.applications import Starlette
        from starlette.routing import Route

        return Starlette(routes=[Route("/retrieve", self.retrieve, methods=["POST"]),
                                 Route("/healthz", self.healthz), Route("/readyz", self.readyz),
                                 Route("/snapshot", self.snapshot), Route("/metrics", self.metrics_text)],
                         lifespan=self._lifespan)

    async def retrieve(self, request):
        from starlette.responses import JSONResponse, Response

        t0 = time.perf_counter()
        arrow = request.headers.get("content-type", "").split(";")[0].strip() == ARROW_STREAM
        index = self.retriever.index  # once: the spec and the embedding length validated against
        try:
            reqs = self._parse(await request.body(), arrow, index)
        except InputError as e:
            return self._error(400, "bad_request", str(e))
        if self._queue is None or self._queue.qsize() >= self.max_queue:
            self.metrics.outcomes.labels("busy").inc()
            return JSONResponse({"error": f"the queue holds {self.max_queue} requests; retry after "
                                          f"{RETRY_AFTER_S} s"}, status_code=503,
                                headers={"Retry-After": str(RETRY_AFTER_S)})
        pending = _Pending(reqs, index.spec, asyncio.get_running_loop().create_future())
        self._queue.put_nowait(pending)
        try:
            table, snapshot = await pending.future
        except InputError as e:  # refused by a new snapshot's targeting spec, swapped in since it arrived
            return self._error(400, "bad_request", str(e))
        except SidIndexError as e:  # a scorer that raised or gave no finite logit, a batch the index refused
            return self._error(500, "error", str(e))
        except Exception as e:  # a bug must not take the server down
            return self._error(500, "error", f"{type(e).__name__}: {e}")
        self.metrics.outcomes.labels("ok").inc()
        self.metrics.end_to_end.observe(time.perf_counter() - t0)
        if arrow:
            sink = pa.BufferOutputStream()
            table = table.replace_schema_metadata({"snapshot": snapshot})
            with pa.ipc.new_stream(sink, table.schema) as w:
                w.write_table(table)
            return Response(sink.getvalue().to_pybytes(), media_type=ARROW_STREAM,
                            headers={"X-Sidindex-Snapshot": snapshot})
        # orjson writes the scores of ads no beam reached (-inf) as null
        return Response(orjson.dumps({"snapshot": snapshot, "rows": table.to_pylist()}), media_type="application/json",
                        headers={"X-Sidindex-Snapshot": snapshot})

    def _error(self, status: int, outcome: str, message: str):
        from starlette.responses import JSONResponse

        self.metrics.outcomes.labels(outcome).inc()
        return JSONResponse({"error": message.splitlines()[0] if message else "error"}, status_code=status)

    def _parse(self, body: bytes, arrow: bool, index: ServedIndex) -> Requests:
        """The body's requests, validated against the snapshot served now (InputError: 400)."""
        if arrow:
            try:
                data = pa.ipc.open_stream(pa.py_buffer(body)).read_all()
            except (pa.ArrowInvalid, OSError) as e:
                raise InputError(f"request body: not an Arrow IPC stream: {e}") from None
        else:
            try:
                doc = orjson.loads(body)
            except orjson.JSONDecodeError as e:
                raise InputError(f"request body: not JSON: {e}") from None
            data = doc.get("requests") if isinstance(doc, dict) else None
            data = [data] if isinstance(data, dict) else data
            if not isinstance(data, list) or not data or not all(isinstance(r, dict) for r in data):
                raise InputError('request body: expected {"requests": [{"request_id": ..., ...}, ...]} with at least '
                                 "one request")
        return requests_from(data, index, source="request body")

    async def healthz(self, request):
        from starlette.responses import JSONResponse

        return JSONResponse({"status": "serving", "snapshot": self.watcher.current.id})

    async def readyz(self, request):
        from starlette.responses import JSONResponse

        ok = self.ready and self._worker is not None
        return JSONResponse({"ready": ok, "snapshot": self.watcher.current.id}, status_code=200 if ok else 503)

    async def snapshot(self, request):
        from starlette.responses import JSONResponse

        snap = self.watcher.current.snapshot
        m = snap.manifest
        return JSONResponse({"id": snap.id, "format": m.version, "counts": m.counts.to_dict(),
                             "since": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(self.since)),
                             "age_seconds": round(time.time() - self.since, 3),
                             "last_error": self.watcher.last_error, "counters": self.retriever.counters.to_dict()})

    async def metrics_text(self, request):
        from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
        from starlette.responses import Response

        m = self.metrics
        c = self.retriever.counters
        m.widenings.set(c.widenings)
        m.stalls.labels("capture").set(c.captures)
        m.stalls.labels("compile").set(c.compiles)
        m.overflows.set(c.overflows)
        m.age.set(time.time() - self.since)
        m.refused.set(0 if self.watcher.last_error is None else 1)
        device = self.watcher.current.device
        m.gpu_memory.set(torch.cuda.memory_allocated(device) if device.type == "cuda" else 0)
        return Response(generate_latest(m.registry), media_type=CONTENT_TYPE_LATEST)

    # -- batching and polling --------------------------------------------------------------

    @contextlib.asynccontextmanager
    async def _lifespan(self, app):
        self._queue = asyncio.Queue()
        self._worker = asyncio.create_task(self._batches())
        self._poller = threading.Thread(target=self._poll, name="sidindex-poll", daemon=True)
        self._poller.start()
        try:
            yield
        finally:  # uvicorn let every request in flight finish first
            self._stop.set()
            self._worker.cancel()
            self._pool.shutdown(wait=True)

    async def _batches(self) -> None:
        """Gather queued requests into batches of at most max_batch rows and run each."""
        loop = asyncio.get_running_loop()
        queue = self._queue
        assert queue is not None  # made by the lifespan that runs this task
        carried: _Pending | None = None  # a request that did not fit the last batch starts the next
        while True:
            first, carried = carried or await queue.get(), None
            batch, rows = [first], len(first.requests)
            deadline = first.queued + self.max_wait
            while rows < self.max_batch:
                left = deadline - time.perf_counter()
                try:
                    nxt = queue.get_nowait() if left <= 0 else await asyncio.wait_for(queue.get(), left)
                except (asyncio.QueueEmpty, asyncio.TimeoutError):
                    break
                if rows + len(nxt.requests) > self.max_batch:
                    carried = nxt
                    break
                batch.append(nxt)
                rows += len(nxt.requests)
            start = time.perf_counter()
            for p in batch:
                self.metrics.queue_wait.observe(start - p.queued)
            self.metrics.batch_size.observe(rows)
            try:
                answers = await loop.run_in_executor(self._pool, self._run, batch)
            except BaseException as e:  # every request of the batch gets the error; the server goes on
                for p in batch:
                    if not p.future.done():
                        p.future.set_exception(e if isinstance(e, Exception) else RuntimeError(str(e)))
                if isinstance(e, asyncio.CancelledError):
                    raise
                continue
            self.metrics.batch.observe(time.perf_counter() - start)
            for p, answer in zip(batch, answers):
                if p.future.done():
                    continue
                if isinstance(answer, Exception):
                    p.future.set_exception(answer)
                else:
                    p.future.set_result(answer)

    def _run(self, batch: list[_Pending]) -> list[tuple[pa.Table, str] | InputError]:
        """The HTTP requests' rows as one batch on the snapshot served now: each one's table and
        that snapshot, or the InputError of one the snapshot's targeting spec refuses (a snapshot
        with another spec was swapped in since it arrived)."""
        index = self.retriever.index
        answers: list = [None] * len(batch)
        parts: list[tuple[int, Requests]] = []
        for i, p in enumerate(batch):
            try:
                reqs = p.requests if p.spec == index.spec else \
                    requests_from(p.requests.table, index, source="request body")
            except InputError as e:
                answers[i] = e
                continue
            parts.append((i, reqs))
        joined = _joined([r for _, r in parts]) if parts else None
        if joined is None and len(parts) > 1:  # columns of types that do not concatenate: one batch each
            for i, reqs in parts:
                answers[i] = self._one(index, reqs)
        elif parts:
            assert joined is not None  # one part always joins
            bounds = np.cumsum([0] + [len(r) for _, r in parts]).tolist()
            try:
                found, _ = self.retriever.run(joined, index)
            except ScorerError as e:  # named by its client's request id, not the batch's renumbering
                if e.row is None or e.request_id is None:
                    raise
                k = int(np.searchsorted(bounds, e.row, side="right")) - 1
                raise e.renamed(parts[k][1].request_id[e.row - bounds[k]]) from None
            for (i, reqs), lo, hi in zip(parts, bounds[:-1], bounds[1:]):
                answers[i] = (table_of(requests_part(found, lo, hi), reqs.request_id), index.id)
        return answers

    def _one(self, index, reqs: Requests) -> tuple[pa.Table, str]:
        found, _ = self.retriever.run(_renumbered(reqs), index)
        return table_of(found, reqs.request_id), index.id

    def _poll(self) -> None:
        while not self._stop.wait(self.poll_seconds):
            t = time.perf_counter()
            if self.watcher.poll():
                self.metrics.swap_seconds.observe(time.perf_counter() - t)
                self.metrics.swaps.inc()
                self.metrics.snapshot.labels(self.served).set(0)
                self.served, self.since = self.watcher.current.id, time.time()
                self.metrics.snapshot.labels(self.served).set(1)


def _renumbered(p: Requests) -> Requests:
    """One part's rows as a batch, request ids renumbered 0..n-1 (as `_joined`'s)."""
    return Requests(p.source, np.arange(len(p), dtype=np.int64), p.embedding, p.columns, p.table)


def _joined(parts: list[Requests]) -> Requests | None:
    """The parts' rows as one validated batch, request ids renumbered (two clients may send the
    same id); None when their columns' types do not concatenate."""
    if len(parts) == 1:
        return _renumbered(parts[0])
    try:
        columns = pa.concat_tables([p.columns for p in parts], promote_options="permissive")
        table = pa.concat_tables([p.table for p in parts], promote_options="permissive")
    except (pa.ArrowInvalid, pa.ArrowTypeError, pa.ArrowNotImplementedError):
        return None
    embedding = None
    if all(p.embedding is not None for p in parts):
        embedding = np.concatenate([p.embedding for p in parts])
    elif any(p.embedding is not None for p in parts):
        return None
    n = sum(len(p) for p in parts)
    return Requests("request body", np.arange(n, dtype=np.int64), embedding, columns, table)

