"""The engine of `sidindex serve`: the process that owns the device (docs/design.md §19).

It holds a warmed `runtime.Retriever` over a `SnapshotWatcher`, the fair batcher that feeds it
(`runtime.server.batcher`), a poller thread that follows ROOT, and the engine's metrics. The HTTP front
(`runtime.server.http`) calls it in its own process, or from front-end processes over ZeroMQ
(`runtime.server.link`); both see the interface `runtime.server.engine_api.EngineApi`.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import pyarrow as pa
import torch

from runtime.index.watcher import SnapshotWatcher
from runtime.requests import embedding_dim, validated_for
from runtime.server.batcher import Batcher, Outcome, Pending
from runtime.server.engine_api import Target
from runtime.server.metrics import EngineMetrics
from runtime.serving.retriever import Retriever
from sidindex.errors import SidIndexError
from sidindex.requests import Requests

UNREADY_AFTER = 5  # failed batches in a row after which /readyz answers 503


class Engine:
    """The retriever, its batcher and its poller (module doc); `start`, then `answer` in an event
    loop or `message` from any thread, `close` to stop.

    watcher: the ROOT's watcher; retriever: a warmed Retriever over it; max_batch, max_wait_us,
    max_queue: the batcher's (`runtime.server.batcher.Batcher`); poll_seconds: how often ROOT is
    polled; unready_after: failed batches in a row after which the engine reports itself not
    ready (and ready again after one succeeds).
    """

    def __init__(self, watcher: SnapshotWatcher, retriever: Retriever, *, max_batch: int = 16,
                 max_wait_us: int = 500, max_queue: int = 1024, poll_seconds: float = 1.0,
                 unready_after: int = UNREADY_AFTER) -> None:
        self.watcher, self.retriever = watcher, retriever
        self.poll_seconds, self.unready_after = poll_seconds, unready_after
        self.metrics = EngineMetrics(max_batch)
        self.batcher = Batcher(retriever, self.metrics, max_batch=max_batch, max_wait_us=max_wait_us,
                               max_queue=max_queue)
        self.since = time.time()
        self.served = watcher.current.id
        self.metrics.snapshot.labels(self.served).set(1)
        self._stop = threading.Event()
        self._poller: threading.Thread | None = None

    async def start(self) -> None:
        """Start the batcher's threads and the poller's."""
        self.batcher.start()
        self._poller = threading.Thread(target=self._poll, name="sidindex-poll", daemon=True)
        self._poller.start()

    async def target(self) -> Target:
        return self.current_target()

    def current_target(self) -> Target:
        """What the next request is validated against (from any thread)."""
        index = self.retriever.index
        return Target(index.id, index.spec, embedding_dim(index))

    async def answer(self, requests: Requests, target: Target, timeout: float | None) -> tuple[pa.Table, str]:
        """`runtime.server.batcher.Batcher.answer` of requests validated against `target`."""
        return await self.batcher.answer(requests, (target.spec, target.dim), timeout)

    def message(self, message: tuple[bytes, pa.Buffer | memoryview], rows: int, snapshot: str,
                settle: Callable[[Outcome], None]) -> Pending:
        """A front-end's `rows` requests (their portable form, `sidindex.requests.portable`, as
        its schema's and its record batch's Arrow IPC messages) validated against `snapshot`, as
        the batcher's request (`Batcher.put` it): read and answered on a batch thread (`settle`
        gets the answer's two messages and the snapshot that served it), validated again before
        they run unless `snapshot` is the one served."""
        if rows < 1:  # a front-end sends none: validation refuses an empty body
            raise SidIndexError(f"a front-end's message counts {rows} requests")
        index = self.retriever.index
        return Pending(None, validated_for(index) if snapshot == index.id else None, rows, settle, message)

    async def status(self) -> dict:
        return self.current_status()

    def current_status(self) -> dict:
        """From any thread: ready (warm, batching, and fewer than unready_after failed batches in
        a row), why not, and the snapshot served: id, format, counts, since when, why the last
        new one was refused, the retriever's counters. Refreshes the metrics read from the retriever."""
        failing = self.batcher.failed_batches >= self.unready_after
        snap = self.watcher.current.snapshot
        m = snap.manifest
        self._refresh()
        return {"ready": self.retriever.warm and self.batcher.started and not failing,
                "why": f"the last {self.batcher.failed_batches} batches failed" if failing else None,
                "id": snap.id, "format": m.version, "counts": m.counts.to_dict(),
                "since": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(self.since)),
                "age_seconds": round(time.time() - self.since, 3), "last_error": self.watcher.last_error,
                "counters": self.retriever.counters.to_dict()}

    def _refresh(self) -> None:
        m, c = self.metrics, self.retriever.counters
        m.widenings.set(c.widenings)
        m.stalls.labels("capture").set(c.captures)
        m.stalls.labels("compile").set(c.compiles)
        m.overflows.set(c.overflows)
        m.rewarms.set(c.rewarms)
        m.age.set(time.time() - self.since)
        m.refused.set(0 if self.watcher.last_error is None else 1)
        device = self.watcher.current.device
        m.gpu_memory.set(torch.cuda.memory_allocated(device) if device.type == "cuda" else 0)

    def stop(self) -> None:
        """Stop polling and taking batches, and abandon a warm-up in progress at its next batch
        (`close` waits for them)."""
        self._stop.set()
        self.retriever.close()
        self.batcher.stop()

    def close(self, timeout: float) -> bool:
        """Stop the poller, abandon a warm-up in progress at its next batch, stop the batcher, and
        wait up to `timeout` seconds in all for the batch, poll and re-warm threads: True when all ended.
        A thread left in native code when the interpreter exits can abort the process, so a
        caller that gets False should leave with os._exit."""
        self._stop.set()
        self.retriever.close()
        end = time.monotonic() + timeout
        stopped = self.batcher.close(timeout)
        if self._poller is not None:
            self._poller.join(max(0.0, end - time.monotonic()))
        rewarmed = self.retriever.join_warmups(max(0.0, end - time.monotonic()))
        return stopped and rewarmed and not (self._poller is not None and self._poller.is_alive())

    def _poll(self) -> None:
        while not self._stop.wait(self.poll_seconds):
            t = time.perf_counter()
            if self.watcher.poll():
                self.metrics.swap_seconds.observe(time.perf_counter() - t)
                self.metrics.swaps.inc()
                self.metrics.snapshot.labels(self.served).set(0)
                self.served, self.since = self.watcher.current.id, time.time()
                self.metrics.snapshot.labels(self.served).set(1)
