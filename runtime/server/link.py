"""The link between `sidindex serve`'s HTTP front-end processes and its engine (docs/design.md §19):
ZeroMQ (pyzmq), a ROUTER socket in the engine and a DEALER in each front-end, over an ipc:// path.
ZeroMQ rather than a shared-memory ring: the ROUTER routes each out-of-order answer back to its
sender with no bookkeeping of ours, and a front-end that dies loses only its own messages.

    front-end -> engine   b"run", id, snapshot validated against, timeout (f64, NaN: none) and rows (u64), requests
    engine -> front-end   b"run", id, outcome, snapshot that served, result (outcome b"ok") or one line
    front-end -> engine   b"status", id
    engine -> front-end   b"status", id, JSON (`Engine.status` and the target)

`requests` and `result` are Arrow IPC streams (the validated batch in its portable form; the
result table). outcome: ok, bad_request, error, busy, timeout. The messages, when the engine
validates a batch again, and why ZeroMQ: docs/design.md §19 ("Processes").
"""

from __future__ import annotations

import asyncio
import functools
import math
import struct
from typing import Any

import orjson
import pyarrow as pa

from runtime.server.engine_api import Refused, Target, arrow_stream, read_stream
from sidindex.errors import InputError, SidIndexError
from sidindex.requests import Requests, portable
from sidindex.targeting import spec_from_dict

RUN, STATUS = b"run", b"status"
PATIENCE_S = 5.0  # how long a front-end waits for the engine's status, and past a request's deadline


class EngineLink:
    """Serves an `runtime.server.engine.Engine` to front-ends: binds a ROUTER socket at `address` at
    construction; `run` (a task of the engine's event loop) answers until cancelled."""

    def __init__(self, engine, address: str) -> None:
        import zmq
        import zmq.asyncio

        self.engine = engine
        self._context = zmq.asyncio.Context()
        self._socket = self._context.socket(zmq.ROUTER)
        self._socket.setsockopt(zmq.LINGER, 0)
        self._socket.bind(address)
        self._tasks: set[asyncio.Task] = set()  # status messages being answered
        self._waiting: set[asyncio.Future] = set()  # requests queued in the engine and not yet answered

    async def run(self) -> None:
        try:
            while True:
                frames = await self._socket.recv_multipart(copy=False)
                peer, kind, mid = (f.bytes for f in frames[:3])
                if kind == RUN:
                    self._run(peer, mid, frames[3:])
                    continue
                task = asyncio.create_task(self._status(peer, mid))
                self._tasks.add(task)
                task.add_done_callback(self._tasks.discard)
        finally:
            for waiting in (*self._tasks, *self._waiting):
                waiting.cancel()
            self._socket.close()
            self._context.term()

    def _run(self, peer: bytes, mid: bytes, frames) -> None:
        """Queue a request message in the engine, answered when its future is (`_answered`): no
        task of its own, and the batch thread reads the requests and writes their answer
        (`Batcher.answer_message`), as every request passes through this loop."""
        try:
            snapshot = frames[0].bytes.decode()  # the one the front-end validated against
            timeout, rows = struct.unpack("<dQ", frames[1].bytes)
            answer = self.engine.answer_message(frames[2].buffer, rows, snapshot,
                                                None if math.isnan(timeout) else timeout)
        except Exception as e:  # a full queue, a message it cannot read
            self._send([peer, RUN, mid, *_refusal(e)])
            return
        self._waiting.add(answer)
        answer.add_done_callback(functools.partial(self._answered, peer, mid))

    def _answered(self, peer: bytes, mid: bytes, answer: asyncio.Future) -> None:
        self._waiting.discard(answer)
        if answer.cancelled():  # the link is closing
            return
        error = answer.exception()
        if error is None:
            payload, served = answer.result()
            self._send([peer, RUN, mid, b"ok", served.encode(), payload])
        else:
            self._send([peer, RUN, mid, *_refusal(error)])

    def _send(self, frames: list) -> None:
        """Send without waiting: a ROUTER does not block (it drops a message to a peer gone)."""
        sent = asyncio.ensure_future(self._socket.send_multipart(frames, copy=False))
        sent.add_done_callback(lambda f: f.cancelled() or f.exception())  # a closed socket's error, seen

    async def _status(self, peer: bytes, mid: bytes) -> None:
        doc = await self.engine.status()
        target = await self.engine.target()
        doc["target"] = {"snapshot": target.snapshot, "spec": target.spec.to_dict(), "dim": target.dim}
        await self._socket.send_multipart([peer, STATUS, mid, orjson.dumps(doc)])


def _refusal(e: BaseException) -> list[bytes]:
    """A request's outcome that is not ok, and its one line (the `run` answer's last frames)."""
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

    def __init__(self, address: str) -> None:
        self.address = address
        self._socket: Any = None  # a zmq.asyncio socket, made in the loop that uses it
        self._receiver: asyncio.Task | None = None
        self._replies: dict[bytes, asyncio.Future] = {}
        self._sent = 0
        self._target: Target | None = None

    async def start(self) -> None:
        import zmq
        import zmq.asyncio

        self._socket = zmq.asyncio.Context.instance().socket(zmq.DEALER)
        self._socket.setsockopt(zmq.LINGER, 0)
        self._socket.connect(self.address)
        self._receiver = asyncio.create_task(self._receive())
        await self.status()

    def stop(self) -> None:
        if self._receiver is not None:
            self._receiver.cancel()
        if self._socket is not None:
            self._socket.close()

    async def target(self) -> Target:
        assert self._target is not None  # `start` fetched it
        return self._target

    async def answer(self, requests: Requests, target: Target, timeout: float | None) -> tuple[pa.Table, str]:
        """As `Engine.answer`; the engine's refusals and errors raised here as there."""
        frames = await self._call([RUN, target.snapshot.encode(),
                                   struct.pack("<dQ", math.nan if timeout is None else timeout, len(requests)),
                                   arrow_stream(portable(requests))],
                                  None if timeout is None else timeout + PATIENCE_S)
        outcome, snapshot, payload = frames[1].bytes, frames[2].bytes.decode(), frames[3]
        if outcome == b"ok":
            if snapshot != target.snapshot:  # a swap: validate the next requests against the new one
                await self.status()
            try:
                return read_stream(payload.buffer, "the engine's answer"), snapshot
            except InputError as e:  # the server's fault, not the client's
                raise SidIndexError(str(e)) from None
        message = payload.bytes.decode()
        if outcome == b"bad_request":
            raise InputError(message)
        if outcome == b"busy":
            raise Refused(503, "busy", message, retry_after=1)
        if outcome == b"timeout":
            raise Refused(504, "timeout", message)
        raise SidIndexError(message)

    async def status(self) -> dict:
        """`Engine.status`, and the target it reports becomes this front-end's."""
        frames = await self._call([STATUS], PATIENCE_S)
        doc = orjson.loads(frames[1].bytes)
        t = doc.pop("target")
        self._target = Target(t["snapshot"], spec_from_dict(t["spec"], "the engine's targeting spec"), t["dim"])
        return doc

    async def _call(self, frames: list, timeout: float | None) -> list:
        """Send a message and wait for its answer (its frames after the id)."""
        assert self._socket is not None  # `start` made it
        mid = struct.pack("<Q", self._sent)
        self._sent += 1
        reply = self._replies[mid] = asyncio.get_running_loop().create_future()
        try:
            await self._socket.send_multipart([frames[0], mid, *frames[1:]], copy=False)
            return await asyncio.wait_for(reply, timeout)
        except asyncio.TimeoutError:
            raise Refused(503, "error", f"the engine did not answer within {timeout:,.1f} s; retry later",
                          retry_after=1) from None
        finally:
            self._replies.pop(mid, None)

    async def _receive(self) -> None:
        assert self._socket is not None
        while True:
            frames = await self._socket.recv_multipart(copy=False)
            reply = self._replies.get(frames[1].bytes)
            if reply is not None and not reply.done():
                reply.set_result([frames[0], *frames[2:]])
