"""`sidindex serve`'s HTTP front: Starlette on uvicorn with httptools and uvloop, orjson (extra
`sidindex[serve]`), over an engine (`runtime.server.engine_api.EngineApi`) that batches and searches.

Routes: POST /retrieve (JSON or an Arrow IPC stream in, the same out, naming the snapshot that
served), GET /healthz, /readyz, /snapshot and /metrics. Each HTTP request's rows are validated on
arrival against the snapshot served (400 with the validator's one line), then handed to the
engine, whose batcher runs them in fair batches with other clients' (`runtime.server.batcher`).
The engine lives in this process (`RetrievalServer.local`) or in the process that owns the GPU,
this one being one of several front-ends (`runtime.server.frontend`, `runtime.server.link`).
Limits are refused with one line each (413, 503 with Retry-After, 504), and a stop (`drain`,
SIGTERM or SIGINT) answers every request in flight within `drain_seconds`. Routes, limits and
shutdown in full: docs/design.md §19, docs/runtime.md ("HTTP server"), docs/operations.md.
"""

from __future__ import annotations

import asyncio
import contextlib
import io
import math
import threading
import time

import orjson
import pyarrow as pa

from runtime.server.engine_api import EngineApi, Refused, Target, arrow_stream, read_stream, stopping
from runtime.server.metrics import HttpMetrics, exposition
from sidindex.errors import InputError, SidIndexError
from sidindex.requests import Requests, requests_from

ARROW_STREAM = "application/vnd.apache.arrow.stream"
MAX_BODY_BYTES = 16 << 20  # the largest request body
MAX_REQUEST_ROWS = 4096  # the most requests (rows) in one body
TIMEOUT_MS = 10_000  # how long a request may wait for its answer
DRAIN_SECONDS = 30.0  # how long a stop waits for the requests in flight
KEEPALIVE_GRACE_S = 1.0  # on a stop, how long kept-alive connections may bring a last request (503)
# a body or an answer past these is parsed or written on a thread: the event loop goes on taking
# and answering the other requests meanwhile (it gets the GIL back every SWITCH_INTERVAL_S)
OFF_LOOP_BYTES, OFF_LOOP_ROWS = 1 << 18, 10_000
SMALL_ANSWER_ROWS = 32  # the most rows of an answer whose JSON orjson writes (`_json_body`)
SWITCH_INTERVAL_S = 2e-4  # how long a thread waiting for the GIL waits at most while a server runs


class RetrievalServer:
    """The HTTP front and its Starlette app (`app`) over `engine` (module doc); `serve` runs it.

    engine: the engine in this process (`local`) or an engine process's link; max_body_bytes,
    max_request_rows: the largest request body and the most rows in one; timeout_ms: how long a
    request may wait for its answer (None: no limit); drain_seconds: how long a stop waits for the
    requests in flight.
    """

    def __init__(self, engine: EngineApi, *, max_body_bytes: int = MAX_BODY_BYTES,
                 max_request_rows: int = MAX_REQUEST_ROWS, timeout_ms: int | None = TIMEOUT_MS,
                 drain_seconds: float = DRAIN_SECONDS) -> None:
        self.engine = engine
        self.max_body_bytes, self.max_request_rows = max_body_bytes, max_request_rows
        self.timeout = None if timeout_ms is None else timeout_ms / 1e3
        self.drain_seconds = drain_seconds
        self.metrics = HttpMetrics()
        self.draining = False
        self.started = False
        self._loop: asyncio.AbstractEventLoop | None = None
        self._waiting: set[asyncio.Future] = set()  # every request accepted and not yet answered
        self.app = self._make_app()

    @classmethod
    def local(cls, watcher, retriever, *, max_batch: int = 16, max_wait_us: int = 500, max_queue: int = 1024,
              poll_seconds: float = 1.0, unready_after: int | None = None, **http) -> RetrievalServer:
        """A server whose engine (`runtime.server.engine.Engine`: the batcher, the poller) runs in this
        process, over a SnapshotWatcher and a warmed Retriever over it; `http`: the options of
        `RetrievalServer`."""
        from runtime.server.engine import UNREADY_AFTER, Engine

        engine = Engine(watcher, retriever, max_batch=max_batch, max_wait_us=max_wait_us, max_queue=max_queue,
                        poll_seconds=poll_seconds, unready_after=unready_after or UNREADY_AFTER)
        return cls(engine, **http)

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
        from starlette.responses import Response

        t0 = time.perf_counter()
        arrow = request.headers.get("content-type", "").split(";")[0].strip() == ARROW_STREAM
        try:
            if self.draining:
                raise stopping()
            target = await self.engine.target()  # once: what the body is validated against
            body = await self._body(request)
            if len(body) > OFF_LOOP_BYTES:
                reqs = await asyncio.to_thread(self._parse, body, arrow, target)
            else:
                reqs = self._parse(body, arrow, target)
            t1 = time.perf_counter()
            table, snapshot = await self._answer(reqs, target)
            t2 = time.perf_counter()
        except ClientDisconnect:  # the client went away mid-body: nobody to answer
            self.metrics.outcomes.labels("disconnected").inc()
            return Response(status_code=400)
        except Refused as e:
            return self._error(e.status, e.outcome, str(e), e.retry_after)
        except InputError as e:  # the body, or a new snapshot's targeting spec swapped in since it arrived
            return self._error(400, "bad_request", str(e))
        except SidIndexError as e:  # a scorer that raised or gave no finite logit, a batch the index refused
            return self._error(500, "error", str(e))
        except Exception as e:  # a bug must not take the server down
            return self._error(500, "error", f"{type(e).__name__}: {e}")
        headers = {"X-Sidindex-Snapshot": snapshot}
        write = _arrow_body if arrow else _json_body
        out = await asyncio.to_thread(write, table, snapshot) if table.num_rows > OFF_LOOP_ROWS else \
            write(table, snapshot)
        t3 = time.perf_counter()
        m = self.metrics
        m.outcomes.labels("ok").inc()
        m.end_to_end.observe(t3 - t0)
        for stage, seconds in (("parse", t1 - t0), ("wait", t2 - t1), ("write", t3 - t2)):
            m.stage_seconds.labels(stage).inc(seconds)
        return Response(out, media_type=ARROW_STREAM if arrow else "application/json", headers=headers)

    async def _body(self, request) -> bytes:
        """The request's body, refused (413) as soon as it passes max_body_bytes: by its declared
        length before reading any of it, else while it arrives."""
        declared = request.headers.get("content-length")
        too_large = Refused(413, "too_large", f"request body: more than {self.max_body_bytes:,} bytes; send fewer "
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

    async def _answer(self, reqs: Requests, target: Target) -> tuple[pa.Table, str]:
        """The engine's answer; Refused 503 when a stop's drain ends first (`_drained`). Its task
        is cancelled once this returns (the engine drops the rows it did not run)."""
        assert self._loop is not None  # set by the lifespan
        answer = self._loop.create_future()
        task = asyncio.ensure_future(self.engine.answer(reqs, target, self.timeout))
        task.add_done_callback(lambda t: _settle(answer, t))
        self._waiting.add(answer)
        try:
            return await answer
        finally:
            self._waiting.discard(answer)
            task.cancel()

    def _error(self, status: int, outcome: str, message: str, retry_after: int | None = None):
        from starlette.responses import JSONResponse

        self.metrics.outcomes.labels(outcome).inc()
        headers = {} if retry_after is None else {"Retry-After": str(retry_after)}
        if outcome == "stopping":  # the client's next request goes to a new connection: another replica
            headers["Connection"] = "close"
        return JSONResponse({"error": message.splitlines()[0] if message else "error"}, status_code=status,
                            headers=headers)

    def _parse(self, body: bytes, arrow: bool, target: Target) -> Requests:
        """The body's requests, validated against the snapshot served now (InputError: 400; more
        than max_request_rows: Refused, 413)."""
        if arrow:
            data = read_stream(body, "request body")
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
            raise Refused(413, "too_large", f"request body: {len(data):,} requests; at most "
                          f"{self.max_request_rows:,} per body")
        return requests_from(data, target.spec, source="request body", dim=target.dim)

    async def healthz(self, request):
        from starlette.responses import JSONResponse

        target = await self.engine.target()
        return JSONResponse({"status": "serving", "snapshot": target.snapshot})

    async def readyz(self, request):
        from starlette.responses import JSONResponse

        try:
            status = await self.engine.status()
        except Refused as e:  # an engine process that does not answer
            status = {"ready": False, "why": str(e), "id": None}
        ok = status["ready"] and self.started and not self.draining
        why = "stopping" if self.draining else status["why"] if not status["ready"] else None
        return JSONResponse({"ready": ok, "snapshot": status["id"]} | ({"why": why} if why else {}),
                            status_code=200 if ok else 503)

    async def snapshot(self, request):
        from starlette.responses import JSONResponse

        try:
            status = await self.engine.status()
        except Refused as e:  # an engine process that does not answer
            return self._error(e.status, e.outcome, str(e), e.retry_after)
        return JSONResponse({k: v for k, v in status.items() if k not in ("ready", "why")})

    async def metrics_text(self, request):
        from prometheus_client import CONTENT_TYPE_LATEST
        from starlette.responses import Response

        with contextlib.suppress(Refused):  # the engine's gauges as last refreshed
            await self.engine.status()  # refreshes them
        registries = [self.metrics.registry]
        if hasattr(self.engine, "metrics"):  # the engine in this process
            registries.append(self.engine.metrics.registry)
        return Response(exposition(*registries), media_type=CONTENT_TYPE_LATEST)

    # -- running and stopping --------------------------------------------------------------

    @contextlib.asynccontextmanager
    async def _lifespan(self, app):
        self._loop = asyncio.get_running_loop()
        await self.engine.start()
        self.started = True
        try:
            yield
        finally:  # uvicorn let every request in flight finish first (or `_drained` answered it)
            self.engine.stop()

    def serve(self, host: str, port: int, sockets: list | None = None, arrived: list[int] | None = None) -> None:
        """Serve on host:port (or on `sockets`, listening already: a front-end process's) until
        SIGTERM or SIGINT, then drain (module doc); arrived: signals noted before this listened
        (they stop it at once)."""
        import polars  # noqa: F401 (the JSON answers' writer: imported here, not on the loop at the first answer)
        import uvicorn

        server = self

        class _Server(uvicorn.Server):
            @contextlib.contextmanager
            def capture_signals(self):
                with super().capture_signals():
                    for sig in arrived or ():  # came before these handlers were in place
                        self.handle_exit(sig, None)
                    yield

            def handle_exit(self, sig, frame) -> None:  # in the main thread, the loop's
                if server.draining or server._loop is None or not self.started:
                    # a second signal, or before the server listens (no kept-alive connection to
                    # answer): uvicorn's way, at once
                    server.drain()
                    super().handle_exit(sig, frame)
                    return
                loop = server._loop

                def begin() -> None:  # in the loop: the port closes before the first 503 goes out
                    # no new connection from now (a client connects to another replica); a client on
                    # a kept-alive one gets 503 and Connection: close for its next request before
                    # uvicorn closes the idle ones, which would lose a request sent as it closes
                    for listening in self.servers:
                        listening.close()
                    server.drain()
                    grace = min(KEEPALIVE_GRACE_S, server.drain_seconds / 4)
                    loop.call_later(grace, uvicorn.Server.handle_exit, self, sig, frame)

                loop.call_soon_threadsafe(begin)

        config = uvicorn.Config(self.app, host=host, port=port, log_level="warning", access_log=False,
                                timeout_graceful_shutdown=max(1, math.ceil(self.drain_seconds)))
        _Server(config).run(sockets=sockets)

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
        for answer in list(self._waiting):
            if not answer.done():
                answer.set_exception(Refused(503, "stopping", "the server stopped before this request could be "
                                             "answered; send it to another replica"))

    def close(self, timeout: float | None = None, flight=None) -> bool:
        """Stop the engine in this process (`runtime.server.engine.Engine.close`) and the Flight endpoint
        `flight` (if any) once its exchanges in flight end, waiting up to `timeout` seconds (else
        `drain_seconds`) in all: True when every thread ended. A thread left in native code when
        the interpreter exits can abort the process, so a caller that gets False should leave with
        os._exit."""
        end = time.monotonic() + (self.drain_seconds if timeout is None else timeout)
        stopping = None
        if flight is not None:  # its shutdown waits for every exchange, which a client may hold open
            stopping = threading.Thread(target=flight.shutdown, name="sidindex-flight-stop", daemon=True)
            stopping.start()
        close = getattr(self.engine, "close", None)
        stopped = close is None or close(max(0.0, end - time.monotonic()))
        if stopping is not None:
            stopping.join(max(0.0, end - time.monotonic()))
        return stopped and not (stopping is not None and stopping.is_alive())


def _arrow_body(table: pa.Table, snapshot: str) -> bytes:
    return arrow_stream(table.replace_schema_metadata({"snapshot": snapshot})).to_pybytes()


def _json_body(table: pa.Table, snapshot: str) -> bytes:
    """{"snapshot": ..., "rows": [{request_id, rank, ad_id, sid, score[, value]}, ...]}. A score is
    its float32's shortest decimal; -inf (no beam reached the ad) is null. An answer of at most
    SMALL_ANSWER_ROWS rows is written by orjson from the columns' values; a larger one by polars,
    without Python objects per row and without the GIL, so that one written on a thread leaves the
    event loop its turns (orjson over `to_pylist` held it about a second for 400,000 rows, 5x
    longer). Not polars for the small ones: its conversion from Arrow took 0.4-0.7 ms of a
    front-end's loop a request under load (VM, answers of 2-4 rows), against 0.05-0.1 ms alone;
    orjson takes about 30 us plus 5 us a row, polars alone about 115 us plus 1 us a row."""
    if table.num_rows <= SMALL_ANSWER_ROWS:
        names = table.column_names
        rows = [dict(zip(names, row)) for row in zip(*(_values(c) for c in table.columns))]
        return orjson.dumps({"snapshot": snapshot, "rows": rows}, option=orjson.OPT_SERIALIZE_NUMPY)
    import polars as pl

    out = io.BytesIO()
    out.write(b'{"snapshot":' + orjson.dumps(snapshot) + b',"rows":')
    frame = pl.from_arrow(table)
    assert isinstance(frame, pl.DataFrame)  # a table's, not a series
    frame.write_json(out)
    out.write(b"}")
    return out.getvalue()


def _values(column: pa.ChunkedArray) -> list:
    """A column's values for orjson, row by row: float32 as numpy's float32 (orjson writes its
    shortest decimal; -inf, NaN as null), numbers and fixed-size lists of them from numpy, anything
    else as Python values."""
    t = column.type
    if column.null_count == 0 and (pa.types.is_integer(t) or pa.types.is_floating(t)):
        values = column.to_numpy()
        return list(values) if pa.types.is_float32(t) else values.tolist()
    if column.null_count == 0 and pa.types.is_fixed_size_list(t) and pa.types.is_integer(t.value_type):
        return column.combine_chunks().flatten().to_numpy().reshape(len(column), t.list_size).tolist()
    return column.to_pylist()


def _settle(answer: asyncio.Future, task: asyncio.Future) -> None:
    """`answer` takes `task`'s outcome (unless a drain answered it first)."""
    if answer.done() or task.cancelled():
        return
    e = task.exception()
    if e is not None:
        answer.set_exception(e)
    else:
        answer.set_result(task.result())
