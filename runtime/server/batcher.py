"""Fair dynamic batching of validated requests over a `runtime.Retriever`: the heart of
`sidindex serve`'s engine (docs/design.md §19).

Requests are queued as they arrive; a worker gathers them until it holds `max_batch` rows or the
first has waited `max_wait_us`, runs them as one batch on a thread of its own (the event loop
goes on taking requests), and answers each once all its rows ran. On a GPU two batches run at a
time, on two threads (`Retriever.in_flight`): while one is on the device the other is staged or
read (the graphs' two slots, `runtime.Searcher.submit`), and the next gathers meanwhile; on the
CPU, and with a user's scorer (one slot), one. A request of more than `max_batch`
rows runs in pieces of at most that many, one at a time, each taking its turn behind the requests
queued meanwhile, so a large request delays a small one by a batch, not by itself. All the rows
of an answer come from one snapshot: a request a swap interrupts runs again on the new one.
"""

from __future__ import annotations

import asyncio
import functools
import time
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

import numpy as np
import pyarrow as pa

from runtime.requests import Validated, requests_from, validated_for
from runtime.result import table_of
from runtime.server.engine_api import Refused, arrow_stream, read_stream
from runtime.server.metrics import EngineMetrics
from runtime.serving.retriever import Retriever
from sidindex.errors import InputError, ScorerError, SidIndexError
from sidindex.requests import Requests, from_portable


def batch_sizes(max_batch: int) -> tuple[int, ...]:
    """The batch sizes a server gathering at most `max_batch` rows warms (a graph each on a GPU): the
    powers of two below it, and it, so a batch pads to at most twice its rows."""
    return tuple(sorted({b for b in (1, 2, 4, 8, 16, 32, 64) if b < max_batch} | {max_batch}))


@dataclass(eq=False)
class Pending:
    """One request's validated rows, answered (`future`) once they all ran on one snapshot."""

    requests: Requests | None  # None until the batch thread reads `message`
    validated: Validated | None  # what it was validated against (None: validate again before it runs)
    future: asyncio.Future
    rows: int  # its rows
    # from a front-end (`runtime.server.link`): its rows as an Arrow IPC stream of their portable
    # form (`sidindex.requests.portable`), read on the batch thread, and answered as an Arrow IPC
    # stream made there: the event loop, which every request passes through, does neither
    message: pa.Buffer | None = None
    queued: float = field(default_factory=time.perf_counter)
    done: int = 0  # its first rows that ran, on `snapshot`
    parts: list[pa.Table] = field(default_factory=list)  # its pieces' result tables, in row order
    snapshot: str | None = None

    @property
    def left(self) -> int:
        return self.rows - self.done


class Batcher:
    """The queue and the worker that batches it (module doc); `start` in the event loop that
    calls `answer`, `close` to stop.

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
        self._queue: asyncio.Queue | None = None
        self._worker: asyncio.Task | None = None
        self.in_flight = retriever.in_flight  # batches running at a time
        self._pool = ThreadPoolExecutor(self.in_flight, thread_name_prefix="sidindex-batch")
        self._running: set[Future] = set()  # the batches handed to it and not yet done
        self._slots: asyncio.Semaphore | None = None  # in_flight batches at a time

    @property
    def started(self) -> bool:
        return self._worker is not None and not self._worker.done()

    def start(self) -> None:
        """Start the worker, in the running event loop."""
        self._queue = asyncio.Queue()
        self._slots = asyncio.Semaphore(self.in_flight)
        self._worker = asyncio.create_task(self._batches())

    async def answer(self, requests: Requests, validated: Validated | None, timeout: float | None) -> tuple[pa.Table,
                                                                                                          str]:
        """The result table of validated requests (`runtime.result.table_of`, the client's
        request ids) and the snapshot that served them; Refused when the queue is full (503) or
        no answer came within `timeout` seconds (504: its rows not yet run are dropped); the
        batch's error when it failed (an InputError for a request a new snapshot's spec refuses,
        a ScorerError naming the request's id)."""
        answer = self._queued(Pending(requests, validated, self._future(), len(requests)), timeout)
        try:
            return await answer
        finally:
            if answer.done() and not answer.cancelled():
                answer.exception()  # seen, though its caller was cancelled before it could be
            answer.cancel()  # its rows not yet run are dropped (a future done stays as it is)

    def answer_message(self, message: pa.Buffer, rows: int, validated: Validated | None,
                       timeout: float | None) -> asyncio.Future:
        """`answer` of a front-end's `rows` requests, as an Arrow IPC stream of their portable
        form (`sidindex.requests.portable`) validated against `validated` (None: another snapshot),
        in the event loop: a future of the result table as an Arrow IPC stream and the snapshot
        that served it (cancel it to drop its rows not yet run). Refused (503) when the queue is full."""
        if rows < 1:  # a front-end sends none: validation refuses an empty body
            raise SidIndexError(f"a front-end's message counts {rows} requests")
        return self._queued(Pending(None, validated, self._future(), rows, message), timeout)

    def _future(self) -> asyncio.Future:
        if self._queue is None or self._queue.qsize() >= self.max_queue:
            raise Refused(503, "busy", f"the queue holds {self.max_queue} requests; retry after 1 s", retry_after=1)
        return asyncio.get_running_loop().create_future()

    def _queued(self, pending: Pending, timeout: float | None) -> asyncio.Future:
        """Queue a request: its future, answered 504 once `timeout` seconds passed without an answer."""
        assert self._queue is not None  # `_future` refused it otherwise
        self._queue.put_nowait(pending)
        if timeout is not None:
            timer = asyncio.get_running_loop().call_later(timeout, _expire, pending.future, timeout)
            pending.future.add_done_callback(lambda _: timer.cancel())
        return pending.future

    def stop(self) -> None:
        """Stop the worker (in its event loop): no batch starts after the one running."""
        if self._worker is not None:
            self._worker.cancel()

    def close(self, timeout: float) -> bool:
        """Take no more batches and wait up to `timeout` seconds for those running: True once they
        ended."""
        self._pool.shutdown(wait=False, cancel_futures=True)  # its threads end once their batches have
        end = time.monotonic() + timeout
        for running in list(self._running):
            try:
                running.exception(timeout=max(0.0, end - time.monotonic()))
            except BaseException:  # its outcome went to its requests; a batch still running says so below
                pass
        return all(r.done() for r in list(self._running))

    async def _batches(self) -> None:
        """Run the queued requests' rows in batches of at most max_batch rows, each request in
        turn (module doc): `active` holds the requests with rows left, in the order they take
        their next piece; a request with a piece running comes back through the queue once it ran
        (`_ran`)."""
        queue, slots = self._queue, self._slots
        assert queue is not None and slots is not None  # made by `start`
        active: deque[Pending] = deque()
        while True:
            await slots.acquire()  # released by `_ran`: requests gather while the batches run
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
                slots.release()
                continue
            start = time.perf_counter()
            for p, lo, _ in pieces:
                if lo == 0:
                    self.metrics.queue_wait.observe(start - p.queued)
            self.metrics.batch_size.observe(sum(hi - lo for _, lo, hi in pieces))
            try:
                running = self._pool.submit(self._run, pieces)
            except RuntimeError as e:  # the pool was shut down (`close`): no batch starts
                slots.release()
                self._failed(pieces, e)
                return
            self._running.add(running)
            asyncio.wrap_future(running).add_done_callback(functools.partial(self._ran, pieces, start, running))

    def _ran(self, pieces: list[tuple[Pending, int, int]], start: float, running: Future,
             done: asyncio.Future) -> None:
        """A batch ended (in the event loop): its requests answered, or failed with its error
        (the server goes on); those with rows left queued again for their next piece."""
        assert self._slots is not None and self._queue is not None  # made by `start`
        self._slots.release()
        self._running.discard(running)
        error = done.exception() if not done.cancelled() else RuntimeError("the batch was cancelled: the server "
                                                                            "is stopping")
        if error is not None:
            self._failed(pieces, error)
            return
        self.failed_batches = 0
        self.metrics.failed.set(0)
        self.metrics.batch.observe(time.perf_counter() - start)
        for (p, _, _), answer in zip(pieces, done.result()):
            if p.future.done():
                continue
            if isinstance(answer, Exception):
                p.future.set_exception(answer)
            elif answer is not None:
                p.future.set_result(answer)
        if not self.started:  # stopped: no batch takes them (the server's drain answers them)
            return
        for p, _, _ in pieces:
            if p.left and not p.future.done():
                self._queue.put_nowait(p)

    def _failed(self, pieces: list[tuple[Pending, int, int]], error: BaseException) -> None:
        """Every request of a batch gets its error (a device's, a scorer's); the server goes on."""
        self.failed_batches += 1
        self.metrics.failed.set(self.failed_batches)
        for p, _, _ in pieces:
            if not p.future.done():
                p.future.set_exception(error if isinstance(error, Exception) else RuntimeError(str(error)))

    def _run(self, pieces: list[tuple[Pending, int, int]]) -> list[tuple[pa.Table, str] | SidIndexError | None]:
        """The requests' pieces (rows lo..hi-1 of each) as one batch on the snapshot served now,
        on the batch thread. Per piece: its request's table and snapshot once all its rows ran
        (None while some are left), or its own error: the InputError of a request the snapshot's
        targeting spec refuses (a snapshot with another spec was swapped in since it arrived), the
        SidIndexError of a front-end's message the engine cannot read. A request whose earlier
        pieces ran on another snapshot starts again on this one."""
        index = self.retriever.index
        target = validated_for(index)
        answers: list = [None] * len(pieces)
        parts: list[tuple[int, Requests]] = []
        for i, (p, lo, hi) in enumerate(pieces):
            if p.snapshot not in (None, index.id):  # a swap since its last piece: all of it again, here
                p.done, p.parts, p.snapshot = 0, [], None
                lo, hi = 0, hi - lo
                pieces[i] = (p, lo, hi)
            try:
                if p.requests is None:  # a front-end's message, read here
                    p.requests = _read_message(p, index, target)
                elif p.validated != target:
                    p.requests = requests_from(p.requests.table, index, source="request body")
                p.validated = target
            except SidIndexError as e:  # a request a new snapshot's spec refuses, a message not read: its own answer
                answers[i] = e
                continue
            parts.append((i, p.requests.rows(lo, hi)))
        joined = _joined([r for _, r in parts]) if parts else None
        if joined is None and len(parts) > 1:  # columns of types that do not concatenate: one batch each
            found = [table_of(self.retriever.run(reqs.renumbered(), index)[0], reqs.request_id) for _, reqs in parts]
        elif parts:
            assert joined is not None  # one part always joins
            bounds = np.cumsum([0] + [len(r) for _, r in parts])
            try:
                whole, _ = self.retriever.run(joined, index)
            except ScorerError as e:  # named by its client's request id, not the batch's renumbering
                if e.row is None or e.request_id is None:
                    raise
                k = int(np.searchsorted(bounds, e.row, side="right")) - 1
                raise e.renamed(parts[k][1].request_id[e.row - bounds[k]]) from None
            # one table for the batch, in its clients' ids; each piece a zero-copy slice of it
            ids = np.concatenate([r.request_id for _, r in parts]) if len(parts) > 1 else parts[0][1].request_id
            table = table_of(whole, ids)
            cuts = np.searchsorted(whole.request, bounds).tolist()
            found = [table.slice(a, b - a) for a, b in zip(cuts[:-1], cuts[1:])]
        for (i, _), result in zip(parts, found if parts else []):
            p, lo, hi = pieces[i]
            p.parts.append(result)
            p.done, p.snapshot = hi, index.id
            if not p.left:
                table = p.parts[0] if len(p.parts) == 1 else pa.concat_tables(p.parts)
                answers[i] = (table if p.message is None else arrow_stream(table), index.id)
        return answers


def _read_message(p: Pending, index, target: Validated) -> Requests:
    """A front-end's message as its requests: as they were validated, or validated again
    against `index` when it was for another spec or embedding width (InputError: one it refuses, the
    client's 400). A message the engine cannot read is the server's fault, not the client's: a
    SidIndexError (500) for this request alone."""
    assert p.message is not None
    try:
        table = read_stream(p.message, "a front-end's message")
        if table.num_rows != p.rows:
            raise InputError(f"{table.num_rows:,} requests, where the front-end counted {p.rows:,}")
        if p.validated == target:  # `validated_for(index)`
            return from_portable(table, index.spec, "request body")
    except Exception as e:  # a front-end of another version, a corrupt message
        why = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise SidIndexError(f"the engine could not read a front-end's message: {why}") from None
    return requests_from(table, index, source="request body")


def _expire(future: asyncio.Future, timeout: float) -> None:
    """A request past its deadline: answered 504 (its rows not yet run are dropped)."""
    if not future.done():
        future.set_exception(Refused(504, "timeout", f"no answer within {timeout * 1e3:,.0f} ms; the server is "
                                     "overloaded or the request too large"))


def _pieces(active: deque[Pending], most: int) -> list[tuple[Pending, int, int]]:
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


def _joined(parts: list[Requests]) -> Requests | None:
    """The parts' rows as one validated batch, request ids renumbered (two clients may send the
    same id); None when their columns' types do not concatenate."""
    if len(parts) == 1:
        return parts[0].renumbered()
    try:
        # one chunk per column: the retriever slices, pads and encodes it, each a pass over the chunks
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
