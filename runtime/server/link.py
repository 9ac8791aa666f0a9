"""The link between `sidindex serve`'s HTTP front-end processes and its engine (docs/design.md §19):
ZeroMQ (pyzmq), a ROUTER socket in the engine and a DEALER in each front-end, over an ipc:// path.
ZeroMQ rather than a shared-memory ring: the ROUTER routes each out-of-order answer back to its
sender with no bookkeeping of ours, and a front-end that dies loses only its own messages.

    front-end -> engine   b"r", id: timeout (f64, NaN: none) and rows (u64), snapshot validated against,
                          requests' schema, requests' record batch
    engine -> front-end   b"r", id: b"ok", snapshot that served, result's schema, result's record batch
                          b"r", id: outcome, b"", one line
    front-end -> engine   b"s", id
    engine -> front-end   b"s", id: JSON (`Engine.status` and the target)

Each message is one frame (`pack`): its kind, its id (8 bytes), and its fields, each after its
length.
The requests (the validated batch in its portable form) and the result table cross as two Arrow
IPC messages each (`runtime.server.engine_api.batch_message`), so that the engine reads the
requests of a batch in one call. outcome: ok, bad_request, error, busy, stopping, timeout. The
messages, when the engine validates a batch again, and why ZeroMQ: docs/design.md §19 ("Processes").
"""

from __future__ import annotations

import asyncio
import functools
import heapq
import math
import struct
import sys
import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import orjson
import pyarrow as pa

from runtime.server.engine_api import (
    Refused,
    Target,
    batch_message,
    joinable,
    read_batch_messages,
    resolve,
    stopping,
)
from sidindex.errors import InputError, SidIndexError
from sidindex.requests import Requests, portable
from sidindex.targeting import spec_from_dict

if TYPE_CHECKING:  # a front-end process imports this module, and must not import torch
    from runtime.server.batcher import Pending

RUN, STATUS = b"r", b"s"  # a message's kind
PATIENCE_S = 5.0  # how long a front-end waits for the engine's status, and past a request's deadline
PATIENCE_MS = 100  # how long the link thread waits for a message at most (it sees a stop then)
RECEIVE_AT_ONCE = 256  # the most messages the link thread reads before sending the answers waiting
PURGE_AT = 1 << 16  # deadlines kept (answered requests' too) before the answered ones' are dropped
# a front-end sends the requests of fewer rows that arrive in one turn of its event loop as one
# message of at most this many rows: the engine's link, reading and answers cost per message, and
# under load they held the engine's interpreter most of a batch (docs/benchmarks.md, "The engine's
# stages, and gathering a front-end's requests")
GATHER_ROWS = 32


class EngineLink:
    """Serves an `runtime.server.engine.Engine` to front-ends on a thread of its own: binds a ROUTER
    socket at `address` at construction; `start`, then `close`.

    The thread reads every message waiting at once and queues their requests in the batcher
    together; the batch threads hand their answers back through an outbox it sends from (a ZeroMQ
    socket is one thread's), woken by an inproc socket; it answers a request past its deadline
    504. Every request passes through it: a blocking socket on a plain thread took a third of the
    CPU an asyncio loop did per message in a harness on the VM, though not less on the H100
    (docs/design.md §19, "Processes"; docs/benchmarks.md).
    """

    def __init__(self, engine, address: str) -> None:
        import zmq

        self.engine = engine
        self._context = zmq.Context()
        self._socket = self._context.socket(zmq.ROUTER)
        self._socket.setsockopt(zmq.LINGER, 0)
        self._socket.bind(address)
        wake = f"inproc://sidindex-link-{id(self)}"
        self._wakes = self._context.socket(zmq.PULL)
        self._wakes.bind(wake)
        self._waker = self._context.socket(zmq.PUSH)  # the batch threads', one at a time (`_lock`)
        self._waker.connect(wake)
        self._lock = threading.Lock()
        self._outbox: deque[list] = deque()  # answers for the link thread to send
        self._woken = False  # a wake is on its way: the link thread sends what the outbox holds
        self._deadlines: list[tuple[float, int, Pending, float]] = []  # a heap: (when, n, request, timeout)
        self._purge_at = PURGE_AT
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        self._thread = threading.Thread(target=self._serve, name="sidindex-link", daemon=True)
        self._thread.start()

    def close(self, timeout: float = 5.0) -> None:
        """Stop the thread (within `timeout` seconds) and close the sockets: requests still queued
        are not answered (their front-ends have gone, or give up after their deadline)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout)
        with self._lock:
            self._waker.close()
        if self._thread is None or not self._thread.is_alive():
            self._socket.close()
            self._wakes.close()
            self._context.term()

    def _serve(self) -> None:
        import zmq

        poller = zmq.Poller()
        poller.register(self._socket, zmq.POLLIN)
        poller.register(self._wakes, zmq.POLLIN)
        while not self._stop.is_set():
            try:
                ready = dict(poller.poll(self._expire()))
                if ready.get(self._socket):
                    self._receive()
                if ready.get(self._wakes):
                    while self._wakes.poll(0):
                        self._wakes.recv(copy=False)
                self._woken = False  # before the outbox is emptied: an answer put after this wakes again
                while self._outbox:
                    self._socket.send_multipart(self._outbox.popleft(), copy=False)
            except Exception as e:  # a bug: the engine must go on answering
                _complain(e)

    def _receive(self) -> None:
        """Every message waiting: the requests queued in the batcher together, statuses answered."""
        import zmq

        pendings: list[tuple[Pending, float]] = []
        for _ in range(RECEIVE_AT_ONCE):  # then the answers waiting go out
            try:
                frames = self._socket.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                break
            if len(frames) != 2 or len(frames[1]) < 9:  # not a front-end's (its id, one frame): nobody to answer
                continue
            peer, body = frames[0].bytes, frames[1].buffer
            kind, mid = bytes(body[:1]), bytes(body[1:9])
            try:
                fields = unpack(body)
                if kind == STATUS:
                    self._status(peer, mid)
                else:
                    pendings.append(self._pending(peer, mid, fields))
            except Exception as e:
                if kind == STATUS:  # a bug: the front-end gets no answer, and says so (503)
                    _complain(e)
                else:  # a message it cannot read
                    self._socket.send_multipart([peer, pack(RUN, mid, _refusal(e))])
        if not pendings:
            return
        batcher = self.engine.batcher
        taken = batcher.put([p for p, _ in pendings])
        now = time.monotonic()
        for i, (p, timeout) in enumerate(pendings):
            if i >= taken:
                p.settle(batcher.refusal())
            elif not math.isnan(timeout):
                heapq.heappush(self._deadlines, (now + timeout, id(p), p, timeout))
        if len(self._deadlines) > self._purge_at:  # the answered ones' records, before their deadlines
            self._deadlines = [d for d in self._deadlines if not d[2].finished]
            heapq.heapify(self._deadlines)
            self._purge_at = max(PURGE_AT, 2 * len(self._deadlines))

    def _pending(self, peer: bytes, mid: bytes, fields: list[memoryview]) -> tuple[Pending, float]:
        """A run message's request for the batcher, and its timeout (NaN: none)."""
        if len(fields) != 4:
            raise SidIndexError(f"a front-end's message of {len(fields)} fields, not 4")
        timeout, rows = struct.unpack("<dQ", fields[0])
        snapshot = bytes(fields[1]).decode()  # the one the front-end validated against
        p = self.engine.message((bytes(fields[2]), fields[3]), rows, snapshot,
                                functools.partial(self._answer, peer, mid))
        return p, timeout if math.isfinite(timeout) else math.nan

    def _status(self, peer: bytes, mid: bytes) -> None:
        doc = self.engine.current_status()
        target = self.engine.current_target()
        doc["target"] = {"snapshot": target.snapshot, "spec": target.spec.to_dict(), "dim": target.dim}
        doc["max_batch"] = self.engine.batcher.max_batch
        self._socket.send_multipart([peer, pack(STATUS, mid, [orjson.dumps(doc)])])

    def _expire(self) -> int:
        """Answer the requests past their deadline 504: the milliseconds until the next one's (at
        most PATIENCE_MS, to see a stop)."""
        now = time.monotonic()
        deadlines = self._deadlines
        while deadlines and deadlines[0][0] <= now:
            _, _, p, timeout = heapq.heappop(deadlines)
            self.engine.batcher.expire(p, timeout)
        if self._outbox:
            return 0
        return PATIENCE_MS if not deadlines else min(PATIENCE_MS, math.ceil((deadlines[0][0] - now) * 1e3))

    def _answer(self, peer: bytes, mid: bytes, outcome) -> None:
        """A request's outcome (from a batch thread, or the link's) into the outbox."""
        if isinstance(outcome, BaseException):
            self._outbox.append([peer, pack(RUN, mid, _refusal(outcome))])
        else:
            (schema, batch), served = outcome
            self._outbox.append([peer, pack(RUN, mid, [b"ok", served.encode(), schema, batch])])
        if not self._woken and threading.current_thread() is not self._thread:
            self._woken = True
            with self._lock:
                if not self._waker.closed:
                    self._waker.send(b"", copy=False)


@dataclass(frozen=True, eq=False)
class _Gathered:
    """A request waiting in a front-end for the end of its loop's turn (`EngineClient.answer`)."""

    requests: Requests
    target: Target
    timeout: float | None
    future: asyncio.Future


def pack(kind: bytes, mid: bytes, fields: list) -> bytes:
    """A message as one ZeroMQ frame: its kind (1 byte), its id (8) and its fields (bytes-like),
    each after its length (u32). One frame, not one per field: pyzmq gives up the GIL around each
    frame it sends or receives, and the engine's link takes it back behind the batch threads."""
    out = [kind, mid]
    for f in fields:
        out += [struct.pack("<I", len(f)), f]
    return b"".join(out)


def unpack(body: memoryview) -> list[memoryview]:
    """A message's fields (`pack`), views of `body`; SidIndexError when they do not add up to it."""
    fields, at = [], 9
    while at < len(body):
        if at + 4 > len(body):
            raise SidIndexError("a message cut short")
        (n,) = struct.unpack_from("<I", body, at)
        if at + 4 + n > len(body):
            raise SidIndexError("a message cut short")
        fields.append(body[at + 4:at + 4 + n])
        at += 4 + n
    return fields


def _complain(e: BaseException) -> None:
    """One line on stderr for a bug in the link thread, which goes on."""
    print(f"sidindex serve: the engine's link: {type(e).__name__}: {e}".splitlines()[0], file=sys.stderr, flush=True)


def _refusal(e: BaseException) -> list[bytes]:
    """A request's outcome that is not ok, and its one line (a run answer's fields)."""
    if isinstance(e, Refused):
        outcome = e.outcome
    elif isinstance(e, InputError):
        outcome = "bad_request"
    else:  # a scorer that failed or gave no finite logit, a batch the index refused, a bug
        outcome = "error"
    message = str(e) if isinstance(e, SidIndexError | Refused) else f"{type(e).__name__}: {e}"
    return [outcome.encode(), b"", message.encode()]


class EngineClient:
    """The engine as a front-end sees it, with the interface of `runtime.server.engine.Engine`: `start`
    in the front-end's event loop (it waits for the engine's first status), then `target`,
    `answer` and `status` over the link."""

    def __init__(self, address: str, gather_rows: int = GATHER_ROWS) -> None:
        self.address = address
        self._most_rows = gather_rows  # the most rows a gathered message holds (1: each request alone)
        self._socket: Any = None  # a zmq.asyncio socket, made in the loop that uses it
        self._receiver: asyncio.Task | None = None
        self._replies: dict[bytes, asyncio.Future] = {}
        self._sent = 0
        self._target: Target | None = None
        self._gathered: list[_Gathered] = []  # requests waiting for the end of this turn of the loop
        self._tasks: set[asyncio.Task] = set()  # the gathered messages' (a task is held until it ends)
        self._gather_rows = gather_rows  # and at most the engine's batch (its status says)

    async def start(self) -> None:
        import zmq
        import zmq.asyncio

        self._socket = zmq.asyncio.Context.instance().socket(zmq.DEALER)
        self._socket.setsockopt(zmq.LINGER, 0)
        self._socket.connect(self.address)
        self._receiver = asyncio.create_task(self._receive())
        await self.status()

    def stop(self) -> None:
        """Stop: the requests still waiting for the engine are answered 503 (stopping)."""
        for task in list(self._tasks):  # each answers its gathered requests as it is cancelled
            task.cancel()
        for reply in self._replies.values():
            if not reply.done():
                reply.set_exception(stopping())
        if self._receiver is not None:
            self._receiver.cancel()
        if self._socket is not None:
            self._socket.close()

    async def target(self) -> Target:
        assert self._target is not None  # `start` fetched it
        return self._target

    async def answer(self, requests: Requests, target: Target, timeout: float | None) -> tuple[pa.Table, str]:
        """As `Engine.answer`; the engine's refusals and errors raised here as there. A request of
        fewer rows than a message gathers (GATHER_ROWS, at most the engine's batch) waits for the
        end of this turn of the event loop, and goes with the others that arrived in it as one
        message (`_send_gathered`)."""
        if len(requests) >= self._gather_rows:
            return await self._run(portable(requests, target.spec), target, timeout)
        future = asyncio.get_running_loop().create_future()
        if not self._gathered:
            asyncio.get_running_loop().call_soon(self._send_gathered)
        self._gathered.append(_Gathered(requests, target, timeout, future))
        return await future

    def _send_gathered(self) -> None:
        """The requests gathered in one turn of the loop, sent in messages of at most
        `_gather_rows` rows each (one per snapshot validated against); a request whose caller left
        is not sent."""
        gathered, self._gathered = [g for g in self._gathered if not g.future.done()], []
        groups: list[list[_Gathered]] = []
        rows: dict[str, int] = {}
        open_: dict[str, list[_Gathered]] = {}
        for g in gathered:
            key = g.target.snapshot
            if key not in open_ or rows[key] + len(g.requests) > self._gather_rows:
                open_[key], rows[key] = [], 0
                groups.append(open_[key])
            open_[key].append(g)
            rows[key] += len(g.requests)
        for group in groups:
            task = asyncio.ensure_future(self._run_gathered(group))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    async def _run_gathered(self, group: list[_Gathered]) -> None:
        """One message of gathered requests, renumbered by row; each gets its own rows of the
        answer with its own ids. A refusal (503, 504) is every request's; another error (a request
        a new snapshot refuses, a scorer's error naming a row) sends each again alone, for its own.
        Whatever happens, every request is answered."""
        loop = asyncio.get_running_loop()
        timeouts = [g.timeout for g in group if g.timeout is not None]
        timeout = min(timeouts) if timeouts else None  # the message's
        deadline = None if timeout is None else loop.time() + timeout  # what is left of it, for each alone

        async def alone(g: _Gathered) -> None:
            if g.future.done():
                return
            left = None if deadline is None else max(1e-3, deadline - loop.time())
            try:
                resolve(g.future, await self._run(portable(g.requests, g.target.spec), g.target, left))
            except Exception as e:
                resolve(g.future, e)

        try:
            if len(group) == 1:  # most under load: no task of its own
                await alone(group[0])
            elif not await self._run_together(group, timeout):
                await asyncio.gather(*(alone(g) for g in group))
        except Exception as e:  # a fault of the link's own: each request's 500, nobody left waiting
            for g in group:
                resolve(g.future, e)
        except BaseException:  # the front-end stopping
            for g in group:
                resolve(g.future, stopping())
            raise

    async def _run_together(self, group: list[_Gathered], timeout: float | None) -> bool:
        """`_run_gathered` as one message: False when the requests must go alone (their columns
        differ by more than a type a request left unknown, or the engine refused the message for an
        error one of them may own)."""
        tables = [portable(g.requests, g.target.spec) for g in group]
        if not joinable([t.schema for t in tables]):
            return False
        try:  # a null column takes the others' type
            table = pa.concat_tables(tables, promote_options="permissive")
        except (pa.ArrowInvalid, pa.ArrowTypeError, pa.ArrowNotImplementedError):
            return False
        n = table.num_rows
        table = table.set_column(table.schema.get_field_index("request_id"), "request_id",
                                 pa.array(np.arange(n, dtype=np.int64)))
        try:
            answer, snapshot = await self._run(table, group[0].target, timeout)
        except Refused as e:
            for g in group:
                resolve(g.future, Refused(e.status, e.outcome, str(e), e.retry_after))
            return True
        except SidIndexError:
            return False
        bounds = np.cumsum([0] + [len(g.requests) for g in group])
        at = answer.column("request_id").to_numpy()  # the row each answer row is for, ascending
        cuts = np.searchsorted(at, bounds)
        for g, lo, a, b in zip(group, bounds[:-1].tolist(), cuts[:-1].tolist(), cuts[1:].tolist()):
            part = answer.slice(a, b - a)
            ids = pa.array(g.requests.request_id[at[a:b] - lo])
            resolve(g.future, (part.set_column(part.schema.get_field_index("request_id"), "request_id", ids),
                               snapshot))
        return True

    async def _run(self, table: pa.Table, target: Target, timeout: float | None) -> tuple[pa.Table, str]:
        """The engine's answer to one message of requests (their portable table)."""
        fields = await self._call(RUN, [struct.pack("<dQ", math.nan if timeout is None else timeout, table.num_rows),
                                        target.snapshot.encode(), *batch_message(table)],
                                  None if timeout is None else timeout + PATIENCE_S)
        outcome, snapshot = bytes(fields[0]), bytes(fields[1]).decode()
        if outcome == b"ok":
            if snapshot != target.snapshot:  # a swap: validate the next requests against the new one
                await self.status()
            try:
                return read_batch_messages(fields[2], [fields[3]], "the engine's answer"), snapshot
            except (InputError, IndexError) as e:  # the server's fault, not the client's
                raise SidIndexError(f"the engine's answer: {e}") from None
        message = bytes(fields[2]).decode()
        if outcome == b"bad_request":
            raise InputError(message)
        if outcome == b"busy":
            raise Refused(503, "busy", message, retry_after=1)
        if outcome == b"stopping":
            raise Refused(503, "stopping", message)
        if outcome == b"timeout":
            raise Refused(504, "timeout", message)
        raise SidIndexError(message)

    async def status(self) -> dict:
        """`Engine.status`, and the target it reports becomes this front-end's."""
        fields = await self._call(STATUS, [], PATIENCE_S)
        doc = orjson.loads(bytes(fields[0]))
        t = doc.pop("target")
        self._target = Target(t["snapshot"], spec_from_dict(t["spec"], "the engine's targeting spec"), t["dim"])
        # a gathered message no larger than the engine's batch: a larger one would wait for two
        self._gather_rows = max(1, min(self._most_rows, int(doc.pop("max_batch", self._most_rows))))
        return doc

    async def _call(self, kind: bytes, fields: list, timeout: float | None) -> list[memoryview]:
        """Send a message and wait for its answer's fields."""
        assert self._socket is not None  # `start` made it
        mid = struct.pack("<Q", self._sent)
        self._sent += 1
        reply = self._replies[mid] = asyncio.get_running_loop().create_future()
        try:
            await self._socket.send(pack(kind, mid, fields), copy=False)
            return await asyncio.wait_for(reply, timeout)
        except asyncio.TimeoutError:
            raise Refused(503, "error", f"the engine did not answer within {timeout:,.1f} s; retry later",
                          retry_after=1) from None
        finally:
            self._replies.pop(mid, None)

    async def _receive(self) -> None:
        assert self._socket is not None
        while True:
            frame = await self._socket.recv(copy=False)
            body = frame.buffer
            reply = self._replies.get(bytes(body[1:9]))
            if reply is not None and not reply.done():
                try:
                    reply.set_result(unpack(body))
                except SidIndexError as e:  # the server's fault: this request's 500
                    reply.set_exception(SidIndexError(f"the engine's answer: {e}"))
