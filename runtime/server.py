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

Dynamic batching, fair: each HTTP request's rows are validated on arrival (a bad one gets 400 with
the validator's one line), then queued; a worker gathers queued requests until it holds
`max_batch` rows or the first has waited `max_wait_us`, runs them as one batch through the
retriever on its own thread, and answers each with its rows once all of them ran. A request of
more than `max_batch` rows runs in pieces of at most that many, each taking its turn behind the
requests queued meanwhile, so a large request delays a small one by a batch, not by itself. All
the rows of an answer come from one snapshot: a request a swap interrupts runs again on the new
one. Limits, each refused with one line: a body past `max_body_bytes` (413, before it is read
whole), more than `max_request_rows` rows (413), a full queue (503 with Retry-After), a request not
answered within `timeout_ms` (504; its rows not yet run are dropped). A poller thread calls the
watcher every `poll_seconds`; a new snapshot is warmed before it is swapped in (`Retriever`),
between batches, and a broken one leaves the old one serving (`/snapshot`'s last_error, the
sidindex_snapshot_refused gauge). /readyz answers 503 once `unready_after` batches in a row failed
(a scorer, the device) and 200 again after one succeeds. `serve` stops on SIGTERM or SIGINT: no
new connections, every request in flight answered within `drain_seconds` (503 for one that cannot
be), then the warm-up of a new snapshot, if any, abandoned at its next batch and every thread of
the server joined (`close`).
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import threading
import time
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

import numpy as np
import orjson
import pyarrow as pa
import torch

from runtime.post import Retrieved
from runtime.requests import requests_from
from runtime.retriever import Retriever, concat, requests_part, table_of
from runtime.served import ServedIndex
from runtime.watcher import SnapshotWatcher
from sidindex.errors import InputError, ScorerError, SidIndexError
from sidindex.requests import Requests
from sidindex.targeting import TargetingSpec

ARROW_STREAM = "application/vnd.apache.arrow.stream"
RETRY_AFTER_S = 1
MAX_BODY_BYTES = 16 << 20  # the largest request body
MAX_REQUEST_ROWS = 4096  # the most requests (rows) in one body
TIMEOUT_MS = 10_000  # how long a request may wait for its answer
DRAIN_SECONDS = 30.0  # how long a stop waits for the requests in flight
UNREADY_AFTER = 5  # failed batches in a row after which /readyz answers 503


@dataclass(eq=False)  # held in a set, by identity
class _Pending:
    """One HTTP request's validated rows, answered once they all ran on one snapshot."""

    requests: Requests
    spec: TargetingSpec  # validated against it
    future: asyncio.Future
    queued: float = field(default_factory=time.perf_counter)
    done: int = 0  # its first rows that ran, on `snapshot`
    parts: list[tuple[int, Retrieved]] = field(default_factory=list)  # (first row, its rows' result)
    snapshot: str | None = None

    @property
    def left(self) -> int:
        return len(self.requests) - self.done


class _Refused(Exception):
    """A request answered with `status` and one line (no batch ran it)."""

    def __init__(self, status: int, outcome: str, message: str) -> None:
        super().__init__(message)
        self.status, self.outcome = status, outcome


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
        self.outcomes = Counter("sidindex_requests", "HTTP requests by outcome (ok, bad_request, too_large, busy, "
                                "timeout, stopping, error, disconnected)", ["outcome"], registry=r)
        self.failed = Gauge("sidindex_failed_batches", "Batches in a row that failed (a scorer, the device); /readyz "
                            "answers 503 from unready_after", registry=r)
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
    """The server's state and its Starlette app (`app`); see the module doc. `serve` runs it.

    watcher: the ROOT's watcher; retriever: a warmed Retriever over it; max_batch: the most
    request rows a batch gathers; max_wait_us: how long the first request of a batch waits for
    others; max_queue: the most HTTP requests waiting; poll_seconds: how often ROOT is polled;
    max_body_bytes, max_request_rows: the largest request body and the most rows in one;
    timeout_ms: how long a request may wait for its answer (None: no limit); drain_seconds: how
    long a stop waits for the requests in flight; unready_after: failed batches in a row that
    make /readyz answer 503.
    """

    def __init__(self, watcher: SnapshotWatcher, retriever: Retriever, *, max_batch: int = 16,
                 max_wait_us: int = 500, max_queue: int = 1024, poll_seconds: float = 1.0,
                 max_body_bytes: int = MAX_BODY_BYTES, max_request_rows: int = MAX_REQUEST_ROWS,
                 timeout_ms: int | None = TIMEOUT_MS, drain_seconds: float = DRAIN_SECONDS,
                 unready_after: int = UNREADY_AFTER) -> None:
        self.watcher, self.retriever = watcher, retriever
        self.max_batch, self.max_wait, self.poll_seconds = max_batch, max_wait_us / 1e6, poll_seconds
        self.max_queue, self.max_body_bytes, self.max_request_rows = max_queue, max_body_bytes, max_request_rows
        self.timeout = None if timeout_ms is None else timeout_ms / 1e3
        self.drain_seconds, self.unready_after = drain_seconds, unready_after
        self.metrics = Metrics(max_batch)
        self.since = time.time()
        self.served = watcher.current.id
        self.metrics.snapshot.labels(self.served).set(1)
        self.ready = retriever.warm
        self.failed_batches = 0  # in a row
        self.draining = False
        self._queue: asyncio.Queue | None = None
        self._worker: asyncio.Task | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._waiting: set[_Pending] = set()  # every request accepted and not yet answered
        self._stop = threading.Event()
        self._poller: threading.Thread | None = None
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="sidindex-batch")  # one batch at a time
        self._running: Future | None = None  # the batch last handed to it
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
        from starlette.requests import ClientDisconnect
        from starlette.responses import JSONResponse, Response

        t0 = time.perf_counter()
        arrow = request.headers.get("content-type", "").split(";")[0].strip() == ARROW_STREAM
        index = self.retriever.index  # once: the spec and the embedding length validated against
        try:
            if self.draining:
                raise _Refused(503, "stopping", "the server is stopping; send the request to another replica")
            reqs = self._parse(await self._body(request), arrow, index)
            if self._queue is None or self._queue.qsize() >= self.max_queue:
                self.metrics.outcomes.labels("busy").inc()
                return JSONResponse({"error": f"the queue holds {self.max_queue} requests; retry after "
                                              f"{RETRY_AFTER_S} s"}, status_code=503,
                                    headers={"Retry-After": str(RETRY_AFTER_S)})
            table, snapshot = await self._answer(_Pending(reqs, index.spec, asyncio.get_running_loop().create_future()))
        except ClientDisconnect:  # the client went away mid-body: nobody to answer
            self.metrics.outcomes.labels("disconnected").inc()
            return Response(status_code=400)
        except _Refused as e:
            return self._error(e.status, e.outcome, str(e))
        except InputError as e:  # the body, or a new snapshot's targeting spec swapped in since it arrived
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

    async def _body(self, request) -> bytes:
        """The request's body, refused (413) as soon as it passes max_body_bytes: by its declared
        length before reading any of it, else while it arrives."""
        declared = request.headers.get("content-length")
        too_large = _Refused(413, "too_large", f"request body: more than {self.max_body_bytes:,} bytes; send fewer "
                             "requests per body")
        if declared is not None and declared.isdigit() and int(declared) > self.max_body_bytes:
            raise too_large
        chunks, size = [], 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > self.max_body_bytes:
                raise too_large
            chunks.append(chunk)
        return b"".join(chunks)

    async def _answer(self, pending: _Pending) -> tuple[pa.Table, str]:
        """Queue a request and wait for its answer: its table and snapshot; _Refused past its
        deadline (504) or when a stop's drain ends first (503, `_drain`)."""
        assert self._queue is not None  # checked by the caller
        self._waiting.add(pending)
        self._queue.put_nowait(pending)
        try:
            return await asyncio.wait_for(asyncio.shield(pending.future), self.timeout)
        except asyncio.TimeoutError:
            assert self.timeout is not None  # no timeout without one
            raise _Refused(504, "timeout", f"no answer within {self.timeout * 1e3:,.0f} ms; the server is "
                           "overloaded or the request too large") from None
        finally:
            self._waiting.discard(pending)
            pending.future.cancel()  # its rows not yet run are dropped (a future done stays as it is)

    def _error(self, status: int, outcome: str, message: str):
        from starlette.responses import JSONResponse

        self.metrics.outcomes.labels(outcome).inc()
        return JSONResponse({"error": message.splitlines()[0] if message else "error"}, status_code=status)

    def _parse(self, body: bytes, arrow: bool, index: ServedIndex) -> Requests:
        """The body's requests, validated against the snapshot served now (InputError: 400; more
        than max_request_rows: _Refused, 413)."""
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
        if len(data) > self.max_request_rows:
            raise _Refused(413, "too_large", f"request body: {len(data):,} requests; at most "
                           f"{self.max_request_rows:,} per body")
        return requests_from(data, index, source="request body")

    async def healthz(self, request):
        from starlette.responses import JSONResponse

        return JSONResponse({"status": "serving", "snapshot": self.watcher.current.id})

    async def readyz(self, request):
        from starlette.responses import JSONResponse

        failing = self.failed_batches >= self.unready_after
        ok = self.ready and self._worker is not None and not self.draining and not failing
        why = {"why": "stopping"} if self.draining else \
            {"why": f"the last {self.failed_batches} batches failed"} if failing else {}
        return JSONResponse({"ready": ok, "snapshot": self.watcher.current.id} | why, status_code=200 if ok else 503)

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
        self._loop = asyncio.get_running_loop()
        self._queue = asyncio.Queue()
        self._worker = asyncio.create_task(self._batches())
        self._poller = threading.Thread(target=self._poll, name="sidindex-poll", daemon=True)
        self._poller.start()
        try:
            yield
        finally:  # uvicorn let every request in flight finish first (or `_drain` answered it)
            self._worker.cancel()
            self.close()

    async def _batches(self) -> None:
        """Run the queued requests' rows in batches of at most max_batch rows, each request in
        turn (module doc): `active` holds the requests with rows left, in the order they take
        their next piece."""
        queue = self._queue
        assert queue is not None  # made by the lifespan that runs this task
        active: deque[_Pending] = deque()
        while True:
            if not active:
                active.append(await queue.get())
            while not queue.empty():  # every request that arrived takes its turn, however full the batch
                active.append(queue.get_nowait())
            deadline = active[0].queued + self.max_wait
            while sum(min(p.left, self.max_batch) for p in active) < self.max_batch:
                left = deadline - time.perf_counter()
                try:
                    active.append(queue.get_nowait() if left <= 0 else await asyncio.wait_for(queue.get(), left))
                except (asyncio.QueueEmpty, asyncio.TimeoutError):
                    break
            pieces = _pieces(active, self.max_batch)
            if not pieces:  # every request gathered was answered meanwhile (past its deadline)
                continue
            start = time.perf_counter()
            for p, lo, _ in pieces:
                if lo == 0:
                    self.metrics.queue_wait.observe(start - p.queued)
            self.metrics.batch_size.observe(sum(hi - lo for _, lo, hi in pieces))
            try:
                self._running = self._pool.submit(self._run, pieces)
                answers = await asyncio.wrap_future(self._running)
            except BaseException as e:  # every request of the batch gets the error; the server goes on
                self.failed_batches += 1
                self.metrics.failed.set(self.failed_batches)
                for p, _, _ in pieces:
                    if not p.future.done():
                        p.future.set_exception(e if isinstance(e, Exception) else RuntimeError(str(e)))
                if isinstance(e, asyncio.CancelledError):
                    raise
                continue
            self.failed_batches = 0
            self.metrics.failed.set(0)
            self.metrics.batch.observe(time.perf_counter() - start)
            for (p, _, _), answer in zip(pieces, answers):
                if p.future.done():
                    continue
                if isinstance(answer, Exception):
                    p.future.set_exception(answer)
                elif answer is not None:
                    p.future.set_result(answer)
            active.extend(p for p, _, _ in pieces if p.left and not p.future.done())

    def _run(self, pieces: list[tuple[_Pending, int, int]]) -> list[tuple[pa.Table, str] | InputError | None]:
        """The requests' pieces (rows lo..hi-1 of each) as one batch on the snapshot served now,
        on the batch thread. Per piece: its request's table and snapshot once all its rows ran
        (None while some are left), or the InputError of a request the snapshot's targeting spec
        refuses (a snapshot with another spec was swapped in since it arrived). A request whose
        earlier pieces ran on another snapshot starts again on this one."""
        index = self.retriever.index
        answers: list = [None] * len(pieces)
        parts: list[tuple[int, Requests]] = []
        for i, (p, lo, hi) in enumerate(pieces):
            if p.snapshot not in (None, index.id):  # a swap since its last piece: all of it again, here
                p.done, p.parts, p.snapshot = 0, [], None
                lo, hi = 0, hi - lo
                pieces[i] = (p, lo, hi)
            if p.spec != index.spec:
                try:
                    p.requests, p.spec = requests_from(p.requests.table, index, source="request body"), index.spec
                except InputError as e:
                    answers[i] = e
                    continue
            parts.append((i, p.requests.rows(lo, hi)))
        joined = _joined([r for _, r in parts]) if parts else None
        if joined is None and len(parts) > 1:  # columns of types that do not concatenate: one batch each
            found = [self.retriever.run(_renumbered(reqs), index)[0] for _, reqs in parts]
        elif parts:
            assert joined is not None  # one part always joins
            bounds = np.cumsum([0] + [len(r) for _, r in parts]).tolist()
            try:
                whole, _ = self.retriever.run(joined, index)
            except ScorerError as e:  # named by its client's request id, not the batch's renumbering
                if e.row is None or e.request_id is None:
                    raise
                k = int(np.searchsorted(bounds, e.row, side="right")) - 1
                raise e.renamed(parts[k][1].request_id[e.row - bounds[k]]) from None
            found = [requests_part(whole, lo, hi) for lo, hi in zip(bounds[:-1], bounds[1:])]
        for (i, _), result in zip(parts, found if parts else []):
            p, lo, hi = pieces[i]
            p.parts.append((lo, result))
            p.done, p.snapshot = hi, index.id
            if not p.left:
                answers[i] = (table_of(concat(p.parts), p.requests.request_id), index.id)
        return answers

    # -- running and stopping --------------------------------------------------------------

    def serve(self, host: str, port: int) -> None:
        """Serve on host:port until SIGTERM or SIGINT, then drain (module doc) and `close`."""
        import uvicorn

        server = self

        class _Server(uvicorn.Server):
            def handle_exit(self, sig, frame) -> None:  # in the loop's thread, between its callbacks
                server.drain()
                super().handle_exit(sig, frame)

        config = uvicorn.Config(self.app, host=host, port=port, log_level="warning", access_log=False,
                                timeout_graceful_shutdown=max(1, math.ceil(self.drain_seconds)))
        _Server(config).run()

    def drain(self) -> None:
        """Stop taking requests (503, /readyz too) and answer, before the drain ends, the ones in
        flight that are still waiting then (503)."""
        if self.draining:
            return
        self.draining = True
        if self._loop is not None:
            margin = min(1.0, self.drain_seconds / 10)  # the answers must go out before uvicorn gives up
            # from a signal handler: only the thread-safe call may touch the loop
            self._loop.call_soon_threadsafe(self._loop.call_later, max(0.0, self.drain_seconds - margin), self._drained)

    def _drained(self) -> None:
        for p in list(self._waiting):
            if not p.future.done():
                p.future.set_exception(_Refused(503, "stopping", "the server stopped before this request could be "
                                                "answered; send it to another replica"))

    def close(self, timeout: float | None = None, flight=None) -> bool:
        """Stop the poller, abandon a warm-up in progress at its next batch, stop the Flight
        endpoint `flight` (if any) once its exchanges in flight end, and wait (up to `timeout`
        seconds, else `drain_seconds`, in all) for those and the batch and poll threads: True
        when all ended. A thread left in native code when the interpreter exits can abort the
        process, so a caller that gets False should leave with os._exit."""
        self._stop.set()
        self.retriever.close()
        self._pool.shutdown(wait=False, cancel_futures=True)  # its thread ends once its batch has
        end = time.monotonic() + (self.drain_seconds if timeout is None else timeout)
        left = lambda: max(0.0, end - time.monotonic())  # noqa: E731
        stopping = None
        if flight is not None:  # its shutdown waits for every exchange, which a client may hold open
            stopping = threading.Thread(target=flight.shutdown, name="sidindex-flight-stop", daemon=True)
            stopping.start()
        if self._running is not None:
            with contextlib.suppress(Exception):  # its outcome went to its requests
                self._running.exception(timeout=left())
        for t in (self._poller, stopping):
            if t is not None:
                t.join(left())
        return (self._running is None or self._running.done()) and \
            not any(t is not None and t.is_alive() for t in (self._poller, stopping))

    def _poll(self) -> None:
        while not self._stop.wait(self.poll_seconds):
            t = time.perf_counter()
            if self.watcher.poll():
                self.metrics.swap_seconds.observe(time.perf_counter() - t)
                self.metrics.swaps.inc()
                self.metrics.snapshot.labels(self.served).set(0)
                self.served, self.since = self.watcher.current.id, time.time()
                self.metrics.snapshot.labels(self.served).set(1)


def _pieces(active: deque[_Pending], most: int) -> list[tuple[_Pending, int, int]]:
    """The next batch from `active` (taken out of it): each request in turn gives rows, up to
    `most` in all; one of more than `most` rows gives a piece of what room is left, one of fewer
    only all of them (else it waits, first, for the next batch). Requests answered meanwhile (past
    their deadline) leave `active`."""
    pieces, rows, waiting = [], 0, []
    while active:
        p = active.popleft()
        if p.future.done():
            continue
        n = min(p.left, most - rows)
        if n == 0 or (n < p.left <= most):
            waiting.append(p)
            continue
        pieces.append((p, p.done, p.done + n))
        rows += n
    active.extend(waiting)
    return pieces


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

