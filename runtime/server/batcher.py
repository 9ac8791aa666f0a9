"""Fair dynamic batching of validated requests over a `runtime.Retriever`: the heart of
`sidindex serve`'s engine (docs/design.md §19).

Requests are queued from any thread (`put`): the HTTP front's event loop, or the link thread
that reads front-ends' messages (`runtime.server.link`). `in_flight` batch threads each gather
them until they hold `max_batch` rows or the first has waited `max_wait_us`, run them as one
batch, and answer each, through the callback it came with, once all its rows ran. No event
loop stands between a message and its batch: every request passes through here, and a loop
costs several times a plain thread per request. On a GPU two batches run at a time (the graphs'
two slots, `runtime.Searcher.submit`): while one is on the device the other gathers, is staged
or read; on the CPU, and with a user's scorer, one. A request of more than `max_batch` rows runs
in pieces of at most that many, each taking its turn behind the requests queued meanwhile, so a
large request delays a small one by a batch, not by itself. All the rows of an answer come from
one snapshot: a request a swap interrupts runs again on the new one.
"""

from __future__ import annotations

import asyncio
import functools
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import pyarrow as pa

from runtime.requests import Validated, requests_from, validated_for
from runtime.result import table_of
from runtime.server.engine_api import (
    Refused,
    batch_message,
    joinable,
    one_batch,
    read_batch_messages,
    resolve,
    stopping,
)
from runtime.server.metrics import EngineMetrics
from runtime.serving.retriever import Retriever
from sidindex.errors import InputError, ScorerError, SidIndexError
from sidindex.requests import Requests, from_portable, untyped

# where a batch's time goes (`Batcher.seconds`, /metrics' sidindex_batch_stage_seconds): its front-ends'
# messages read as requests, then the retriever's stages (`runtime.serving.retriever.STAGES`: the
# batch encoded, then searched and expanded on the device), then the answers made of its rows
BATCH_STAGES = ("read", "encode", "search_post", "answer")

# what a request is answered with: its result table (for a front-end's message, its two Arrow IPC
# messages: `runtime.server.engine_api.batch_message`) and the snapshot that served it, or its error
Outcome = tuple[pa.Table | tuple[pa.Buffer, pa.Buffer], str] | BaseException


def batch_sizes(max_batch: int) -> tuple[int, ...]:
    """The batch sizes a server gathering at most `max_batch` rows warms (a graph each on a GPU): the
    powers of two below it, and it, so a batch pads to at most twice its rows."""
    return tuple(sorted({b for b in (1, 2, 4, 8, 16, 32, 64) if b < max_batch} | {max_batch}))


@dataclass(eq=False)
class Pending:
    """One request's validated rows, answered once (`settle`, on the thread that answers it) when
    they all ran on one snapshot, failed, or passed their deadline (`Batcher.expire`)."""

    requests: Requests | None  # None until read from `message` (and then, for speed, kept as `origin`)
    validated: Validated | None  # what it was validated against (None: validate again before it runs)
    rows: int  # its rows
    settle: Callable[[Outcome], None]
    # from a front-end (`runtime.server.link`): its rows in their portable form
    # (`sidindex.requests.portable`) as Arrow IPC messages, its schema's and its record batch's
    # (`runtime.server.engine_api.batch_message`), read on a batch thread, and answered as the
    # same two messages made there
    message: tuple[bytes, pa.Buffer | memoryview] | None = None
    queued: float = field(default_factory=time.perf_counter)
    done: int = 0  # its first rows that ran, on `snapshot`
    parts: list[pa.RecordBatch] = field(default_factory=list)  # its pieces' result rows, in row order
    snapshot: str | None = None
    # a front-end's message read with others (`_read_messages`): the requests read together and
    # its first row there, so that a batch of messages read together runs as they were read,
    # without cutting and joining them again
    origin: tuple[Requests, int] | None = None
    finished: bool = False  # answered, past its deadline or dropped: no batch takes its rows

    @property
    def left(self) -> int:
        return self.rows - self.done

    def release(self) -> None:
        """Let go of its rows and results once answered (a deadline's record may outlive it)."""
        self.requests, self.message, self.parts, self.origin = None, None, [], None

    def source(self) -> tuple[Requests, int]:
        """Validated requests that hold its rows, and its first row there."""
        if self.origin is not None:
            return self.origin
        assert self.requests is not None  # read
        return self.requests, 0


class Batcher:
    """The queue and the batch threads that empty it (module doc); `start`, then `put` from any
    thread (or `answer` in an event loop), `close` to stop.

    retriever: a warmed Retriever; max_batch: the most rows a batch gathers; max_wait_us: how
    long the first request of a batch waits for others; max_queue: the most requests waiting
    (one more is refused, 503); metrics: where queue waits, batch sizes and times, and failed
    batches are counted.
    """

    def __init__(self, retriever: Retriever, metrics: EngineMetrics, *, max_batch: int = 16, max_wait_us: int = 500,
                 max_queue: int = 1024) -> None:
        self.retriever, self.metrics = retriever, metrics
        self.max_batch, self.max_wait, self.max_queue = max_batch, max_wait_us / 1e6, max_queue
        self.failed_batches = 0  # in a row
        self.seconds = dict.fromkeys(BATCH_STAGES, 0.0)  # summed over the batches that ran (`BATCH_STAGES`)
        self.timed = 0  # the batches that ran, whose seconds those are
        self.in_flight = retriever.in_flight  # batches running at a time: one thread each
        self._cond = threading.Condition()
        # the requests with rows left and none running, in the order they take their next piece
        self._active: deque[Pending] = deque()
        self._threads: list[threading.Thread] = []
        self._stopping = False

    @property
    def started(self) -> bool:
        return bool(self._threads) and not self._stopping

    def start(self) -> None:
        """Start the batch threads."""
        self._threads = [threading.Thread(target=self._work, name=f"sidindex-batch-{i}", daemon=True)
                         for i in range(self.in_flight)]
        for t in self._threads:
            t.start()

    def put(self, pendings: list[Pending]) -> int:
        """Queue `pendings`, in order, from any thread: how many were taken; the rest found the
        queue full, or the batcher stopped (answer them 503)."""
        with self._cond:
            if self._stopping or not self._threads:
                return 0
            idle = not self._active
            taken = max(0, min(len(pendings), self.max_queue - len(self._active)))
            self._active.extend(pendings[:taken])
            # a batch thread to wake: one waits for a first request, or one waiting out `max_wait`
            # has its batch now (woken for less, it would only wait again)
            if taken and (idle or _holds(self._active, self.max_batch)):
                self._cond.notify()
        return taken

    def finish(self, p: Pending, outcome: Outcome) -> None:
        """Answer `p` with `outcome`, unless it was answered already (its rows not yet run are dropped)."""
        with self._cond:
            if p.finished:
                return
            p.finished = True
        p.settle(outcome)

    def expire(self, p: Pending, timeout: float) -> None:
        """A request past its deadline of `timeout` seconds: answered 504 (its rows not yet run are dropped)."""
        if not p.finished:
            self.finish(p, Refused(504, "timeout", f"no answer within {timeout * 1e3:,.0f} ms; the server is "
                                   "overloaded or the request too large"))

    def drop(self, p: Pending) -> None:
        """Nobody waits for `p` any more: its rows not yet run are dropped, and it is not answered."""
        with self._cond:
            p.finished = True

    async def answer(self, requests: Requests, validated: Validated | None, timeout: float | None) -> tuple[pa.Table,
                                                                                                          str]:
        """In an event loop: the result table of validated requests (`runtime.result.table_of`,
        the client's request ids) and the snapshot that served them; Refused when the queue is
        full (503) or no answer came within `timeout` seconds (504: its rows not yet run are
        dropped, as when the caller is cancelled); the batch's error when it failed (an
        InputError for a request a new snapshot's spec refuses, a ScorerError naming the
        request's id)."""
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        p = Pending(requests, validated, len(requests), functools.partial(_settle_in, loop, future))
        if not self.put([p]):
            raise self.refusal()
        timer = None if timeout is None else loop.call_later(timeout, self.expire, p, timeout)
        try:
            return await future
        finally:
            if timer is not None:
                timer.cancel()
            self.drop(p)

    def refusal(self) -> Refused:
        """Why `put` did not take a request: a 503 a client may retry."""
        if self._stopping:
            return stopping()
        return Refused(503, "busy", f"the queue holds {self.max_queue} requests; retry after 1 s", retry_after=1)

    def stop(self) -> None:
        """From any thread: no batch starts after those running (the requests waiting are not answered)."""
        with self._cond:
            self._stopping = True
            self._cond.notify_all()

    def close(self, timeout: float) -> bool:
        """Stop, and wait up to `timeout` seconds for the batches running: True once they ended."""
        self.stop()
        end = time.monotonic() + timeout
        for t in self._threads:
            t.join(max(0.0, end - time.monotonic()))
        return not any(t.is_alive() for t in self._threads)

    def _work(self) -> None:
        """A batch thread: gather a batch, run it, answer it, until stopped."""
        while (pieces := self._gather()) is not None:
            start = time.perf_counter()
            for p, lo, _ in pieces:
                if lo == 0:
                    self.metrics.queue_wait.observe(start - p.queued)
            self.metrics.batch_size.observe(sum(hi - lo for _, lo, hi in pieces))
            try:
                answers = self._run(pieces)
            except BaseException as e:  # a device's, a scorer's: every request of the batch gets it
                self._failed(pieces, e)
                continue
            self._ran(pieces, answers, start)

    def _gather(self) -> list[tuple[Pending, int, int]] | None:
        """The next batch (`_pieces`), once the requests waiting hold `max_batch` rows or the first
        of them has waited `max_wait`; None once stopped."""
        with self._cond:
            active = self._active
            while not self._stopping:
                while active and active[0].finished:
                    active.popleft().release()
                if not active:
                    self._cond.wait()
                    continue
                wait = active[0].queued + self.max_wait - time.perf_counter()
                if wait > 0 and not _holds(active, self.max_batch):
                    self._cond.wait(wait)
                    continue
                pieces = _pieces(active, self.max_batch)
                if active:  # left for the next batch: another thread gathers it
                    self._cond.notify()
                if pieces:
                    return pieces
            return None

    def _ran(self, pieces: list[tuple[Pending, int, int]], answers: list, start: float) -> None:
        """A batch ran: its requests answered (or each its own error); those with rows left queued
        again, behind the requests that arrived meanwhile, for their next piece."""
        ended = []  # decided under the lock: a request queued again may be taken by another batch at once
        with self._cond:
            self.failed_batches = 0
            for (p, _, _), answer in zip(pieces, answers):
                if answer is None and not p.finished:
                    self._active.append(p)
                else:
                    ended.append((p, answer))
            if len(ended) < len(pieces):
                self._cond.notify()
        self.metrics.failed.set(0)
        self.metrics.batch.observe(time.perf_counter() - start)
        for p, answer in ended:
            if answer is not None:
                self.finish(p, answer)
            p.release()

    def _failed(self, pieces: list[tuple[Pending, int, int]], error: BaseException) -> None:
        """Every request of a batch gets its error (a device's, a scorer's); the server goes on."""
        with self._cond:
            self.failed_batches += 1
            failed = self.failed_batches
        self.metrics.failed.set(failed)
        for p, _, _ in pieces:
            self.finish(p, error if isinstance(error, Exception) else RuntimeError(str(error)))
            p.release()

    def _run(self, pieces: list[tuple[Pending, int, int]]) -> list[Outcome | None]:
        """The requests' pieces (rows lo..hi-1 of each) as one batch on the snapshot served now,
        on the batch thread. Per piece: its request's outcome once all its rows ran (None while
        some are left), or its own error: the InputError of a request the snapshot's targeting
        spec refuses (a snapshot with another spec was swapped in since it arrived), the
        SidIndexError of a front-end's message the engine cannot read. A request whose earlier
        pieces ran on another snapshot starts again on this one."""
        index = self.retriever.index
        target = validated_for(index)
        answers: list = [None] * len(pieces)
        began = time.perf_counter()
        unread = [p for p, _, _ in pieces if p.requests is None and p.origin is None]
        refused = _read_messages(unread, index, target) if unread else {}
        parts: list[tuple[int, Requests, int, int]] = []  # a piece's index, and its rows' place (`Pending.source`)
        for i, (p, lo, hi) in enumerate(pieces):
            if p.snapshot not in (None, index.id):  # a swap since its last piece: all of it again, here
                p.done, p.parts, p.snapshot = 0, [], None
                lo, hi = 0, hi - lo
                pieces[i] = (p, lo, hi)
            try:
                if p in refused:
                    raise refused[p]
                if p.validated != target:
                    held, first = p.source()
                    p.requests = requests_from(untyped(held.rows(first, first + p.rows).table, index.spec), index,
                                               source="request body")
                    p.origin = None
                p.validated = target
            except SidIndexError as e:  # a request a new snapshot's spec refuses, a message not read: its own answer
                answers[i] = e
                continue
            held, first = p.source()
            parts.append((i, held, first + lo, first + hi))
        # the rows to run: pieces next to each other where they were read, one cut each
        runs: list[tuple[Requests, int, int]] = []
        for _, held, a, b in parts:
            if runs and runs[-1][0] is held and runs[-1][2] == a:
                runs[-1] = (held, runs[-1][1], b)
            else:
                runs.append((held, a, b))
        joined = _joined([held.rows(a, b) for held, a, b in runs]) if parts else None
        seconds = dict.fromkeys(BATCH_STAGES, 0.0)
        seconds["read"] = time.perf_counter() - began
        if joined is None and len(parts) > 1:  # columns of types that do not concatenate: one batch each
            found = []
            for _, held, a, b in parts:
                try:
                    one, ran = self.retriever.run(held.rows(a, b).renumbered(), index)
                except ScorerError as e:  # named by its client's request id, as below
                    if e.row is None or e.request_id is None:
                        raise
                    raise e.renamed(held.request_id[a + e.row]) from None
                found.append(one_batch(table_of(one, held.request_id[a:b])))
                seconds["encode"] += ran.get("encode", 0.0)
                seconds["search_post"] += ran.get("search_post", 0.0)
        elif parts:
            assert joined is not None  # one part always joins
            bounds = np.cumsum([0] + [b - a for _, _, a, b in parts])
            try:
                whole, ran = self.retriever.run(joined, index)
            except ScorerError as e:  # named by its client's request id, not the batch's renumbering
                if e.row is None or e.request_id is None:
                    raise
                k = int(np.searchsorted(bounds, e.row, side="right")) - 1
                _, held, a, _ = parts[k]
                raise e.renamed(held.request_id[a + e.row - bounds[k]]) from None
            # one record batch for the batch, in its clients' ids; each piece a zero-copy slice of it
            ids = np.concatenate([held.request_id[a:b] for held, a, b in runs])
            batch = one_batch(table_of(whole, ids))
            cuts = np.searchsorted(whole.request, bounds).tolist()
            found = [batch.slice(a, b - a) for a, b in zip(cuts[:-1], cuts[1:])]
            seconds["encode"], seconds["search_post"] = ran.get("encode", 0.0), ran.get("search_post", 0.0)
        schema: pa.Buffer | None = None  # the answers' schema message, made once
        for (i, _, _, _), result in zip(parts, found if parts else []):
            p, lo, hi = pieces[i]
            p.parts.append(result)
            p.done, p.snapshot = hi, index.id
            if p.left:
                continue
            if p.message is None:
                answers[i] = (pa.Table.from_batches(p.parts), index.id)
            elif len(p.parts) == 1:
                if schema is None:
                    schema = result.schema.serialize()
                answers[i] = ((schema, result.serialize()), index.id)
            else:  # the pieces of a large request, from several batches
                answers[i] = (batch_message(pa.Table.from_batches(p.parts)), index.id)
        # never below 0: a retriever whose own timers read more than the batch took must not fail it
        seconds["answer"] = max(0.0, time.perf_counter() - began - sum(seconds.values()))
        self._timed(seconds)
        return answers

    def _timed(self, seconds: dict[str, float]) -> None:
        """A batch's seconds per stage (`BATCH_STAGES`, each >= 0) added to the batcher's and to /metrics'."""
        with self._cond:
            self.timed += 1
            for k, v in seconds.items():
                self.seconds[k] += v
        for k, v in seconds.items():
            self.metrics.stage_seconds.labels(k).inc(v)


def _read_messages(pendings: list[Pending], index, target: Validated) -> dict[Pending, SidIndexError]:
    """Front-ends' messages as their requests (each `requests` set, validated against `target`):
    those of one schema read as one stream, and rebuilt as validated (`from_portable`) in one
    pass, where one read per message, each giving up the GIL and waiting for it back behind the
    threads beside, took most of a batch's time; a message validated against another spec or
    embedding width is validated again. Returned: each request refused, with its error: the
    validator's InputError (the client's 400), or, for a message the engine cannot read (a
    front-end of another version, a corrupt message), a SidIndexError (500) for it alone: a
    group that does not read is read again message by message."""
    groups: dict[bytes, list[Pending]] = {}
    for p in pendings:
        assert p.message is not None  # a front-end's: in process, requests come read
        groups.setdefault(bytes(p.message[0]), []).append(p)
    refused: dict[Pending, SidIndexError] = {}
    for schema, group in groups.items():
        try:
            refused |= _read_group(schema, group, index, target)
        except SidIndexError as e:
            if len(group) == 1:
                refused[group[0]] = e
                continue
            for p in group:
                try:
                    refused |= _read_group(schema, [p], index, target)
                except SidIndexError as e:
                    refused[p] = e
    return refused


def _read_group(schema: bytes, group: list[Pending], index, target: Validated) -> dict[Pending, SidIndexError]:
    """`_read_messages` of messages of one schema; SidIndexError when they do not read."""
    rows = sum(p.rows for p in group)
    try:
        table = read_batch_messages(schema, [p.message[1] for p in group if p.message is not None],
                                    "a front-end's message")
        # each message's own count (totals that agree could hide two that do not, and rows moved between them)
        counts = [len(b) for b in table.to_batches()]
        if counts != [p.rows for p in group]:
            got = f"{table.num_rows:,} requests" if len(group) == 1 else f"record batches of {counts} requests"
            raise InputError(f"{got}, where the front-end counted {rows:,}")
        table = table.combine_chunks()
        whole = from_portable(table, index.spec, "request body") if any(p.validated == target for p in group) \
            else None
    except Exception as e:  # a front-end of another version, a corrupt message
        why = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise SidIndexError(f"the engine could not read a front-end's message: {why}") from None
    refused: dict[Pending, SidIndexError] = {}
    lo = 0
    for p in group:
        if whole is not None and p.validated == target:
            p.origin = (whole, lo)
        else:
            try:
                p.requests = requests_from(untyped(table.slice(lo, p.rows), index.spec), index, source="request body")
            except InputError as e:  # one a new snapshot refuses: the client's 400
                refused[p] = e
        p.validated = target
        lo += p.rows
    return refused


def _settle_in(loop: asyncio.AbstractEventLoop, future: asyncio.Future, outcome: Outcome) -> None:
    """`future` (of `loop`) takes `outcome`, from any thread."""
    try:
        loop.call_soon_threadsafe(resolve, future, outcome)
    except RuntimeError:  # the loop closed: nobody waits for it
        pass


def _holds(active: deque[Pending], most: int) -> bool:
    """Whether the requests waiting hold a batch of `most` rows (each gives at most `most`)."""
    rows = 0
    for p in active:
        if not p.finished:
            rows += min(p.left, most)
            if rows >= most:
                return True
    return False


def _pieces(active: deque[Pending], most: int) -> list[tuple[Pending, int, int]]:
    """The next batch from `active` (taken out of it): each request in turn gives rows, up to
    `most` in all; one of more than `most` rows gives a piece of what room is left, one of fewer
    only all of them (else it waits, first, for the next batch). Requests answered meanwhile (past
    their deadline) leave `active`."""
    pieces, rows, waiting = [], 0, []
    while active:
        p = active.popleft()
        if p.finished:  # queued, so no batch holds it
            p.release()
            continue
        n = min(p.left, most - rows)
        if n == 0 or (n < p.left <= most):
            waiting.append(p)
            continue
        pieces.append((p, p.done, p.done + n))
        rows += n
    active.extend(waiting)
    return pieces


def _joined(parts: list[Requests]) -> Requests | None:
    """The parts' rows as one validated batch, request ids renumbered (two clients may send the
    same id); None when their columns do not join unchanged (`engine_api.joinable`)."""
    if len(parts) == 1:
        return parts[0].renumbered()
    if not joinable([p.table.schema for p in parts]):
        return None
    try:
        # one chunk per column: the retriever slices, pads and encodes it, each a pass over the
        # chunks; a column one part left null takes the others' type
        table = pa.concat_tables([p.table for p in parts], promote_options="permissive").combine_chunks()
    except (pa.ArrowInvalid, pa.ArrowTypeError, pa.ArrowNotImplementedError):
        return None
    columns = table.select(parts[0].columns.column_names)  # the attributes: columns of the table as given
    embedding = None
    if all(p.embedding is not None for p in parts):
        embedding = np.concatenate([p.embedding for p in parts])
    elif any(p.embedding is not None for p in parts):
        return None
    n = sum(len(p) for p in parts)
    return Requests("request body", np.arange(n, dtype=np.int64), embedding, columns, table)
