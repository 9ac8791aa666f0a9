"""The server's Prometheus metrics (prometheus-client): the HTTP front's (`HttpMetrics`) and the
engine's (`EngineMetrics`), each in a registry of its own. When the front-ends and the engine are
processes of their own, every process writes its values to one directory
(`share_between_processes`, prometheus-client's multiprocess mode) and any front-end's /metrics
reads them all: counters and histograms summed, gauges the largest value of a live process.
"""

from __future__ import annotations

import os
import sys
import tempfile

MULTIPROC_DIR = "PROMETHEUS_MULTIPROC_DIR"  # prometheus-client's own variable
SECONDS = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0)


def share_between_processes() -> str | None:
    """Make this process and the processes it starts write their metrics to one directory: the
    environment's PROMETHEUS_MULTIPROC_DIR, else a new one, returned for the caller to remove
    when they have all ended (None: the environment's). Call it before any metric is made."""
    if "prometheus_client" in sys.modules and MULTIPROC_DIR not in os.environ:
        raise RuntimeError("share_between_processes: prometheus_client was imported first; call it before")
    if os.environ.get(MULTIPROC_DIR):
        return None
    os.environ[MULTIPROC_DIR] = made = tempfile.mkdtemp(prefix="sidindex-metrics-")
    return made


def shared() -> bool:
    return MULTIPROC_DIR in os.environ


class HttpMetrics:
    """Requests by outcome, and their time from arrival to answer."""

    def __init__(self) -> None:
        from prometheus_client import CollectorRegistry, Counter, Histogram

        r = self.registry = CollectorRegistry()
        self.outcomes = Counter("sidindex_requests", "HTTP requests by outcome (ok, bad_request, too_large, busy, "
                                "timeout, stopping, error, disconnected)", ["outcome"], registry=r)
        self.end_to_end = Histogram("sidindex_request_seconds", "Time from a request's arrival to its answer",
                                    buckets=SECONDS, registry=r)
        self.stage_seconds = Counter("sidindex_request_stage_seconds", "Seconds the answered requests spent per "
                                     "stage: parse (the body read and validated), wait (from the hand-off to the "
                                     "engine to its answer: the link, the engine's queue and batch, the event "
                                     "loop's turn), write (the answer's body)", ["stage"], registry=r)
        # the labelled series each answered request adds to, looked up once
        self.ok = self.outcomes.labels("ok")
        self.parse, self.wait, self.write = (self.stage_seconds.labels(s) for s in ("parse", "wait", "write"))


class EngineMetrics:
    """Batches, swaps and the retriever's counters."""

    def __init__(self, max_batch: int) -> None:
        from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

        def gauge(name: str, doc: str, labels: tuple[str, ...] = ()) -> Gauge:
            # one process (the engine) sets each: the largest value over live processes is its
            return Gauge(name, doc, labels, registry=r, multiprocess_mode="livemax")

        r = self.registry = CollectorRegistry()
        self.queue_wait = Histogram("sidindex_queue_wait_seconds", "Time a request waited for its batch",
                                    buckets=SECONDS, registry=r)
        self.batch = Histogram("sidindex_batch_seconds", "Time a batch took in the retriever", buckets=SECONDS,
                               registry=r)
        self.stage_seconds = Counter("sidindex_batch_stage_seconds", "Seconds the batches spent per stage: read "
                                     "(front-ends' messages as requests), encode, search_post (on the device), "
                                     "answer (the rows as each request's answer)", ["stage"], registry=r)
        sizes = sorted({1, 2, 4, 8, 16, 32, 64, max_batch})
        self.batch_size = Histogram("sidindex_batch_requests", "Requests per batch", buckets=sizes, registry=r)
        self.failed = gauge("sidindex_failed_batches", "Batches in a row that failed (a scorer, the device); /readyz "
                            "answers 503 from unready_after")
        self.swaps = Counter("sidindex_swaps", "Snapshots swapped in", registry=r)
        self.swap_seconds = Histogram("sidindex_swap_seconds", "Time to load and warm a new snapshot",
                                      buckets=(0.1, 0.2, 0.5, 1, 2, 5, 10, 30, 60), registry=r)
        self.widenings = gauge("sidindex_widenings", "Searches widened since start (0 in a steady state)")
        self.stalls = gauge("sidindex_stalls", "Graphs captured and Triton kernels compiled while serving batches "
                            "(0 once warm)", ("kind",))
        self.overflows = gauge("sidindex_overflows", "Batches answered by the worst case's graph (past the widths "
                               "warm-up measured)")
        self.rewarms = gauge("sidindex_rewarms", "Searchers warmed again, wider, beside serving after batches they "
                             "could not hold")
        self.snapshot = gauge("sidindex_snapshot_info", "The snapshot served", ("snapshot",))
        self.age = gauge("sidindex_snapshot_age_seconds", "Seconds since the snapshot served was swapped in")
        self.refused = gauge("sidindex_snapshot_refused", "1 while the newest published snapshot was refused")
        self.gpu_memory = gauge("sidindex_gpu_memory_bytes", "GPU memory allocated by torch")


def exposition(*registries) -> bytes:
    """The Prometheus text of `registries`, or of every process's values when they are shared."""
    from prometheus_client import CollectorRegistry, generate_latest

    if not shared():
        return b"".join(generate_latest(r) for r in registries)
    from prometheus_client import multiprocess

    everything = CollectorRegistry()
    multiprocess.MultiProcessCollector(everything)
    return generate_latest(everything)


def process_gone(pid: int) -> None:
    """Drop a process's gauges from the shared values (it ended)."""
    if shared():
        from prometheus_client import multiprocess

        multiprocess.mark_process_dead(pid)
