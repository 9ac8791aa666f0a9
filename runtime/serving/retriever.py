"""The serving object: requests in memory in, ranked eligible ads out, warm from the first request
(docs/design.md §17; docs/runtime.md#retriever).

    retriever = runtime.Retriever(runtime.SnapshotWatcher(ROOT, "cuda"), mode="cd+gtm",
                                  beams=(1, 512, 1024, 1024), batch_sizes=(1, 4, 16))
    table = retriever.retrieve(record_batch)        # pyarrow.Table: request_id, rank, ad_id, sid, score

A batch is validated (`sidindex.requests.requests_from`), encoded into the calling thread's arena,
submitted to the `Searcher` (search and post stage as one graph per batch size, padded to the
nearest size, cut past the largest) and read back as an Arrow table. Warm-up searches every batch
size with the largest requests a batch can hold, then freezes the searcher: nothing compiles,
captures or widens while serving (`Counters`). Over a `SnapshotWatcher` a new snapshot is warmed on
the poller's thread and stream, beside serving, and swapped in between batches. `retrieve` may be
called from several threads; a call of several batches submits each before reading the one before.
"""

from __future__ import annotations

import collections
import contextlib
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import pyarrow as pa
import torch

from runtime.index.served import ServedIndex
from runtime.index.watcher import SnapshotWatcher
from runtime.ops.compiles import compiles
from runtime.requests import Validated, requests_from, validated_for
from runtime.result import Retrieved, concat, requests_part, table_of
from runtime.scorers.factory import ScorerFactory, as_factory
from runtime.search.beam import DEFAULT_BEAMS, Scorer, check_slack, check_value_weight, parse_beams
from runtime.serving.post import check_rank, check_top_k
from runtime.serving.searcher import SLACK, Searcher, Submitted, check_slots
from schemas import MAX_ABS_EMBEDDING
from sidindex.errors import ConfigError, InputError, SidIndexError
from sidindex.modes import Mode, parse_mode
from sidindex.request_encoding import EncodedRequests, encode_requests
from sidindex.requests import MAX_REQUEST_VALUES, Requests

STAGES = ("validate", "encode", "search_post", "result")


@dataclass
class Counters:
    """What a retriever has done since it was made (`Retriever.counters`): batches and requests
    served; while serving them, searches widened, graphs captured and Triton kernels compiled (each
    a stall of its batch: 0 once warm) and batches answered by the worst case's graph (overflows:
    a batch past the widths warm-up measured, exact and a little slower); snapshots warmed and
    swapped to; and the seconds spent per stage (`STAGES`)."""

    batches: int = 0
    requests: int = 0
    widenings: int = 0
    captures: int = 0
    compiles: int = 0
    overflows: int = 0
    warmed: int = 0
    swaps: int = 0
    rewarms: int = 0
    seconds: dict[str, float] = field(default_factory=lambda: dict.fromkeys(STAGES, 0.0))

    def to_dict(self) -> dict:
        return {"batches": self.batches, "requests": self.requests, "widenings": self.widenings,
                "captures": self.captures, "compiles": self.compiles, "overflows": self.overflows,
                "warmed": self.warmed, "swaps": self.swaps, "rewarms": self.rewarms,
                "seconds": dict(self.seconds)}


class Retriever:
    """Ranked eligible ads for requests held in memory (module doc).

    index:        a ServedIndex (`runtime.load`) or a SnapshotWatcher (whose swaps it follows)
    mode, beams:  the search (`runtime.parse_mode`, `runtime.parse_beams`)
    scorer:       None (the codebook scorer, from each request's embedding), a user's factory
                  'MODULE:FACTORY' (`runtime.scorers.factory.load_factory`), a factory function
                  FACTORY(batch, device, level_sizes) -> Scorer, or a loaded `ScorerFactory`
    batch_sizes:  the batch sizes to serve (graphs captured at warm-up on a GPU)
    value_weight: λ of the value-guided search (0: by log-probability); rank: how each request's
                  ads are ranked (`runtime.serving.post.RANKS`); top_k: the most ads per request (None: all)
    warmup:       requests (anything `retrieve` takes) to warm up with, beside the synthetic ones;
                  warm: False to skip warming (the first batch of each size then pays for it)
    slack:        each step's width, in its beams' typical candidates (`runtime.Searcher`)
    slots:        graphs per batch size (`runtime.Searcher`): 2 replays a batch while the one before
                  it is read (a caller's next batch, another caller's), 1 saves their GPU memory
    """

    def __init__(self, index: ServedIndex | SnapshotWatcher, *, mode: Mode | str = Mode.CD_GTM,
                 beams: tuple[int, ...] | str = DEFAULT_BEAMS, scorer: str | ScorerFactory | None = None,
                 batch_sizes: tuple[int, ...] = (16,), value_weight: float = 0.0, rank: str = "score",
                 top_k: int | None = None, impl: str = "auto", warmup=None, warm: bool = True,
                 slack: float = SLACK, slots: int = 2) -> None:
        self.watcher = index if isinstance(index, SnapshotWatcher) else None
        self._index = None if isinstance(index, SnapshotWatcher) else index
        first = self.index
        self.mode = parse_mode(mode, kway_available=first.kway)
        self.beams = parse_beams(beams, first.sid_length)
        check_value_weight(first, self.mode, value_weight)
        check_rank(first, rank)
        check_top_k(top_k)
        sizes = tuple(sorted(set(batch_sizes)))
        if not sizes or any(not isinstance(b, int) or b < 1 for b in sizes):
            raise ConfigError(f"batch sizes {batch_sizes!r}: give one or more positive numbers of requests")
        self.batch_sizes, self.value_weight, self.rank, self.top_k, self.impl = sizes, value_weight, rank, top_k, impl
        check_slack((slack,), 1)
        self.slack, self.slots = slack, check_slots(slots)
        self.factory = as_factory(scorer)
        self.counters = Counters()
        self._lock = threading.RLock()  # the served index, warm-ups and swaps, the counters (module doc)
        self._warmed: dict[int, _Warmed] = {}  # by id of the ServedIndex: the served one and one being warmed
        self._arenas = threading.local()  # each calling thread's encoding arenas (`run`)
        self._factory_lock = threading.Lock()  # a user's scorer factory is called by one thread at a time
        self._served: int | None = None
        self._in_use: collections.Counter[int] = collections.Counter()  # calls running, by id of their index
        self._retired: set[int] = set()  # indexes served before, still warmed for a call running on them
        self._warmup = None if warmup is None else self._validated(warmup, first, "warm-up requests")
        self._warmup_for = validated_for(first)  # ... the spec and embedding width they were validated for
        self._closed = threading.Event()  # set by `close`: a warm-up in progress stops at its next batch
        # batches served lately that a warm-up replays: each one a frozen searcher could not hold,
        # and one in TRAFFIC_EVERY of the others (`_batch`)
        # (the spec and embedding width they were validated for, the batch); not the index: its arrays
        self._traffic: collections.deque[tuple[tuple, Requests]] = collections.deque(maxlen=WARM_BATCHES)
        self._traffic_lock = threading.Lock()
        self._frozen_batches = 0  # batches served by frozen searchers
        self._rewarm_after = 0  # ... before which no re-warm starts (`_start_rewarm`)
        self._rewarms: dict[int, int] = {}  # re-warms started, by id of the ServedIndex
        self._rewarm: threading.Thread | None = None  # a wider searcher warming (`_rewarm_index`)
        self._warming = threading.Lock()  # one warm-up at a time (a swap's, a re-warm's): one extra set of graphs
        self.rewarm_error: str | None = None  # why the last re-warm failed, if it did
        self.warm = warm
        if warm:
            self.prepare(first)
        if self.watcher is not None:
            self.watcher.before_swap.append(self._before_swap)

    # -- serving ---------------------------------------------------------------------------

    def retrieve(self, requests, *, source: str = "requests") -> pa.Table:
        """Ranked eligible ads of `requests` (a pyarrow Table or RecordBatch, a polars DataFrame,
        or a list of dicts, validated as a request file is; `source` names them in messages), as a
        pyarrow.Table: request_id, rank, ad_id, sid (fixed_size_list<int16>), score, and value
        when the snapshot has ad values. An InputError names a bad request's column and row; a
        ScorerError a user's scorer that failed, or gave some request no finite logit at a step
        (`runtime.search.beam.check_scored`)."""
        index = self.index
        t = time.perf_counter()
        reqs = self._validated(requests, index, source)
        t1 = time.perf_counter()
        found, _ = self.run(reqs, index)
        t2 = time.perf_counter()
        out = table_of(found, reqs.request_id)
        with self._lock:
            self.counters.seconds["validate"] += t1 - t
            self.counters.seconds["result"] += time.perf_counter() - t2
        return out

    @property
    def in_flight(self) -> int:
        """Batches worth running at a time from several threads (`runtime.server.batcher.Batcher`): on a
        GPU with the built-in scorer, the graphs' slots (one batch on the device while another
        is staged or read); elsewhere 1 (on the CPU a second batch only contends with the first
        for the interpreter: measured, it halved a server's throughput)."""
        return self.slots if self.index.device.type == "cuda" and self.factory is None else 1

    @property
    def widths(self) -> tuple[int | None, ...] | None:
        """Each search step's compact width on the index served now: the candidates its top-k
        selects among (`runtime.search.beam.capped_widths`; None: the step's worst case), as warm-up
        and re-warms settled them. None in mode none, or before the index is warmed."""
        index = self.index
        with self._lock:
            warmed = self._warmed.get(id(index))
        return None if warmed is None else warmed.searcher.widths(index)

    @property
    def index(self) -> ServedIndex:
        """The index the next batch runs on: the watcher's current one, or the one given."""
        if self.watcher is not None:
            return self.watcher.current
        assert self._index is not None  # given, without a watcher
        return self._index

    def run(self, requests: Requests, index: ServedIndex | None = None, *, stages: bool = False,
            progress: Callable | None = None) -> tuple[Retrieved, dict[str, float]]:
        """The `Retrieved` rows of validated requests (their rows numbered within `requests`), and
        the seconds per stage; stages: with each ad's stage flags (`runtime.serving.post.expand`). Each
        batch is encoded outside the serving lock, in the calling thread's arenas, and submitted
        (`runtime.Searcher.submit`) before the one before it is read: the next batch is encoded
        and staged while one is on the device, for this caller and for others."""
        index = index or self.index
        key = id(index)
        with self._lock:
            warmed = self._serving(index)
            self._in_use[key] += 1
        try:
            return self._run(warmed, requests, stages, progress)
        finally:
            with self._lock:
                self._in_use[key] -= 1
                if not self._in_use[key]:
                    del self._in_use[key]
                    if key in self._retired and key != self._served:  # its last call on an index no longer served
                        self._retired.discard(key)
                        self._warmed.pop(key, None)

    def _run(self, warmed: _Warmed, requests: Requests, stages: bool, progress: Callable | None
             ) -> tuple[Retrieved, dict[str, float]]:
        """`run` on `warmed`'s index: its batches, each submitted before the one before it is read."""
        seconds = dict.fromkeys(STAGES, 0.0)
        parts = []
        n, most = len(requests), self.batch_sizes[-1]
        # this thread's two arenas: a batch in flight keeps its encoding (a batch past its graph is
        # answered from it) while the next is encoded in the other
        arenas = self._arenas.__dict__.setdefault("arenas", (_Arena(), _Arena()))
        in_flight: list[_Flight] = []  # submitted, not yet read: at most two

        def read_first() -> None:
            done = in_flight.pop(0)
            parts.append((done.lo, self._read(done, seconds, self.counters)))
            if progress:
                progress("retrieve", done.lo + done.n, n)

        try:
            for i, lo in enumerate(range(0, n, most)):
                flight = self._encoded(warmed, arenas[i % 2], requests.rows(lo, min(n, lo + most)), lo, seconds)
                # holding a batch not yet read, never wait for a slot (another caller holding one
                # could be waiting for ours): read it first
                while not self._submit(flight, stages, seconds, self.counters, wait=not in_flight):
                    read_first()
                in_flight.append(flight)
                while len(in_flight) > (1 if lo + most < n else 0):  # the last batch: read them all
                    read_first()
        finally:
            for f in in_flight:  # a batch after them failed: their slots freed, their answers dropped
                with contextlib.suppress(Exception):
                    if f.submitted is not None:
                        f.submitted.read()
        with self._lock:
            c = self.counters
            c.batches, c.requests = c.batches + len(parts), c.requests + n
            for k, v in seconds.items():
                c.seconds[k] += v
        return concat(parts), seconds

    def _batch(self, warmed: _Warmed, arena: _Arena, reqs: Requests, stages: bool, seconds: dict[str, float]
               ) -> Retrieved:
        """One batch of a warm-up, on `warmed`'s own searcher: encoded, submitted and read."""
        flight = self._encoded(warmed, arena, reqs, 0, seconds)
        self._submit(flight, stages, seconds, None)
        return self._read(flight, seconds, None)

    def _encoded(self, warmed: _Warmed, arena: _Arena, reqs: Requests, lo: int, seconds: dict[str, float]
                 ) -> _Flight:
        """One batch of at most the largest batch size, padded on a GPU to a configured size,
        encoded into `arena`, for `warmed`'s index."""
        index = warmed.index
        t = time.perf_counter()
        padded = self._padded(reqs, index)
        host = encode_requests(padded, index.spec, arena.words)
        seconds["encode"] += time.perf_counter() - t
        return _Flight(warmed, padded, host, reqs.request_id, len(reqs), lo)

    def _submit(self, flight: _Flight, stages: bool, seconds: dict[str, float], counters: Counters | None,
                wait: bool = True) -> bool:
        """Submit an encoded batch (`runtime.Searcher.submit`); False: no slot was free and `wait`
        was False. counters: a served batch's, on the searcher serving its index now (a re-warm
        may have replaced `flight`'s); None: a warm-up's, on its own searcher."""
        index = flight.warmed.index
        began, compiled = time.perf_counter(), compiles()
        if counters is not None:
            flight.warmed = self._warmed.get(id(index), flight.warmed)
        if self.factory is not None and flight.scorer is None:  # once a batch, though it waits for a slot
            with self._factory_lock:
                # a scorer that gives some request no finite logit is refused naming its request_id
                flight.scorer = self.factory.for_batch(flight.padded.table, index.device, index.level_sizes)
        flight.submitted = flight.warmed.searcher.submit(index, flight.host, flight.scorer, top_k=self.top_k,
                                                         rank=self.rank, stages=stages, request_id=flight.request_id,
                                                         wait=wait)
        flight.compiled += compiles() - compiled
        seconds["search_post"] += time.perf_counter() - began
        return flight.submitted is not None

    def _read(self, flight: _Flight, seconds: dict[str, float], counters: Counters | None) -> Retrieved:
        """A submitted batch's rows, read; a batch past its frozen graph answered by the worst
        case's. A served batch's stalls counted (`counters`); one that overflowed kept for the
        next warm-up, which it starts."""
        submitted, searcher, began = flight.submitted, flight.warmed.searcher, time.perf_counter()
        assert submitted is not None  # submitted by `_submit`
        found = submitted.read()
        if found is None:
            compiled = compiles()
            found = submitted.worst_case()
            flight.compiled += compiles() - compiled
        seconds["search_post"] += time.perf_counter() - began  # with its submit's: not what ran between
        if counters is not None:
            widened, captured, overflowed = submitted.stalls
            with self._lock:
                c = counters
                c.widenings, c.captures = c.widenings + widened, c.captures + captured
                c.overflows, c.compiles = c.overflows + overflowed, c.compiles + flight.compiled
                if searcher.frozen:
                    self._frozen_batches += 1
                    if overflowed or self._frozen_batches % TRAFFIC_EVERY == 0:
                        with self._traffic_lock:  # what the next warm-up replays
                            self._traffic.append((validated_for(flight.warmed.index), flight.padded))
                    if overflowed and self.warm and self._frozen_batches >= self._rewarm_after:
                        self._start_rewarm(flight.warmed.index)
        return found if len(flight.padded) == flight.n else requests_part(found, 0, flight.n)  # padding dropped

    def _padded(self, reqs: Requests, index: ServedIndex) -> Requests:
        """reqs, on a GPU grown to the smallest configured batch size holding them by repeating
        the last request (a graph per size; the CPU has none, so nothing is padded)."""
        n = len(reqs)
        if index.device.type != "cuda":
            return reqs
        size = next(b for b in self.batch_sizes if b >= n)
        if size == n:
            return reqs
        return reqs.padded(size)

    def _validated(self, data, index: ServedIndex, source: str) -> Requests:
        return data if isinstance(data, Requests) else requests_from(data, index, source=source)

    # -- warm start and swaps --------------------------------------------------------------

    def _serving(self, index: ServedIndex) -> _Warmed:
        """`index`'s searcher, to serve a batch (under the lock): warmed by a swap's hook, or now at
        its first batch. The current index becomes the served one; what was warmed for indexes
        no longer served is dropped, but for a call still running on one (a call that took the
        index before a swap: a batch thread of the server's), which keeps it until it ends."""
        key = id(index)
        current = index is self.index
        if key not in self._warmed:
            if self.warm and current:
                self.prepare(index)
            else:  # a call that took an index before a swap: not warmed again (batches wait on no
                self._warmed[key] = self._new(index)  # warm-up of a retired snapshot), dropped after it
                if not current:
                    self._retired.add(key)
        if self._served != key and current:
            if self._served is not None:
                self.counters.swaps += 1
                self._retired.add(self._served)
            self._served = key
            keep = {key, *self._in_use}
            self._warmed = {k: v for k, v in self._warmed.items() if k in keep}
            self._retired = {k for k in self._retired if k in self._warmed and k != key}
        return self._warmed[key]

    def _new(self, index: ServedIndex) -> _Warmed:
        """A searcher for `index`, starting from the widths its own searcher, else the served
        snapshot's, needed."""
        searcher = Searcher(self.beams, self.mode, self.impl, self.value_weight, self.slack, self.slots)
        served = self._warmed.get(id(index)) or (None if self._served is None else self._warmed.get(self._served))
        if served is not None:
            searcher.step_slack = dict(served.searcher.step_slack)
            searcher.most_reached = served.searcher.most_reached
        return _Warmed(index, searcher)

    def prepare(self, index: ServedIndex) -> None:
        """Warm `index` (module doc): every batch size searched once with the largest requests,
        then WARM_BATCHES batches of the largest size (with a codebook) and the warm-up requests,
        so that no batch it serves compiles, captures or (mostly) widens.

        It is warmed on a new searcher, arena and CUDA stream of its own, outside the serving
        lock: batches go on being served meanwhile, however long the kernels of the new one's
        shapes take to compile, and the searcher takes its place between batches. The served
        snapshot too: its batches go on being served by the searcher they hold (warming that one
        under the serving lock would wait for a slot that a caller waiting for the lock holds)."""
        with self._lock:
            warmed = self._new(index)
        with self._warming, _side_stream(index.device):
            self._warm(warmed)
        with self._lock:
            self._warmed[id(index)] = warmed
            self.counters.warmed += 1

    def _warm(self, warmed: _Warmed) -> None:
        """Each batch size searched once, then the warm-up batches (module doc), then the searcher
        settled (its post stage fitted to the pairs the warm-up reached), the first batch of each
        size once more to capture the settled graphs, and the searcher frozen."""
        index, arena, most = warmed.index, _Arena(), self.batch_sizes[-1]
        seconds = dict.fromkeys(STAGES, 0.0)

        def run(reqs: Requests) -> None:
            if self._closed.is_set():
                raise WarmupAbandoned("warm-up abandoned: the retriever was closed")
            self._batch(warmed, arena, reqs, False, seconds)

        synthetic = self.factory is None and index.codebook is not None  # a user's scorer reads its own columns
        firsts: list[Requests] = []  # a batch of each size
        if synthetic:
            batches = WARM_BATCHES * most
            # cd's widths follow the beams alone, and traffic's beams crowd where the ads do (at 1M
            # ads, random paths left 4 of 64 batches past the widths, requests near ads none);
            # under gtm the warm-up's targeting, which no ad matches, already widens them: near
            # ads it doubled step 3's width past what traffic needed
            near = not self.mode.gtm
            dummy = self._validated(largest_requests(index, batches, near_ads=near), index, "warm-up requests")
            firsts = [dummy.head(b) for b in self.batch_sizes]
            for reqs in firsts:
                run(reqs)
            for lo in range(0, batches, most):
                run(dummy.rows(lo, lo + most))
        # the warm-up requests, validated again for a snapshot of another spec (None: it refuses them)
        warmup = None if self._warmup is None else _for_index(self._warmup, self._warmup_for, index)
        if warmup is not None:
            if not synthetic:  # a batch of each size, its rows repeated where the warm-up has fewer
                firsts = [warmup.taken(np.arange(b) % len(warmup)) for b in self.batch_sizes]
                for reqs in firsts:
                    run(reqs)
            for lo in range(0, len(warmup), most):
                run(warmup.rows(lo, min(len(warmup), lo + most)))
        with self._traffic_lock:  # not the serving lock: a warm-up holds `_warming`, which a batch may wait on
            traffic = list(self._traffic)
        for served_on, reqs in traffic:  # batches served lately (`_traffic`): the widths and pairs they needed
            again = _for_index(reqs, served_on, index)
            if again is not None and len(again) in self.batch_sizes:
                run(again)
                if not any(len(f) == len(again) for f in firsts):
                    firsts.append(again)  # a size the warm-up had none of captures its settled graphs on it
        warmed.searcher.settle()
        for reqs in firsts:
            run(reqs)
        warmed.searcher.freeze()

    def _start_rewarm(self, index: ServedIndex) -> None:
        """After a batch the frozen searcher could not hold (answered by its worst case): warm a
        searcher for `index` again on a thread of its own (`_rewarm_index`), unless one is warming,
        REWARM_GAP frozen batches have not passed since the last one started, or `index` had
        MAX_REWARMS already (an overflow widths cannot cure, a user's scorer whose inputs change
        shape, stays the worst case's)."""
        if self._closed.is_set() or (self._rewarm is not None and self._rewarm.is_alive()):
            return
        if self._rewarms.get(id(index), 0) >= MAX_REWARMS:
            return
        self._rewarms = {id(index): self._rewarms.get(id(index), 0) + 1}  # the served index's count only
        self._rewarm_after = self._frozen_batches + REWARM_GAP
        self._rewarm = threading.Thread(target=self._rewarm_index, args=(index,), name="sidindex-rewarm",
                                        daemon=True)
        self._rewarm.start()

    def _rewarm_index(self, index: ServedIndex) -> None:
        """A searcher for the served `index`, from its widths, warmed as a new snapshot is (`prepare`:
        its own arena and CUDA stream, outside the serving lock), with the batches served lately,
        those it could not hold among them, so that it widens where they needed it; then it takes
        the served one's place between batches. The old one serves meanwhile: the serving thread
        never widens, captures or compiles. A failure leaves the old one serving (`rewarm_error`)."""
        with self._lock:
            if self._served != id(index):
                return  # swapped away meanwhile
            wider = self._new(index)
        try:
            with self._warming, _side_stream(index.device):
                if self._served != id(index):
                    return  # swapped away while another warm-up ran
                self._warm(wider)
        except WarmupAbandoned:
            return
        except Exception as e:  # a device error (out of memory beside the served graphs) too: serving goes on
            self.rewarm_error = f"{type(e).__name__}: {e}"
            return
        with self._lock:
            if self._served == id(index):
                self._warmed[id(index)] = wider
                self.counters.rewarms += 1
                self.rewarm_error = None

    def join_warmups(self, timeout: float | None = None) -> bool:
        """Wait for a re-warm in progress (`_rewarm_index`) up to `timeout` seconds: True when none
        runs."""
        thread = self._rewarm
        if thread is not None:
            thread.join(timeout)
        return thread is None or not thread.is_alive()

    def _before_swap(self, indexes: tuple[ServedIndex, ...]) -> None:
        """The watcher's hook: warm its new snapshot before it is swapped in."""
        if self.warm:
            self.prepare(indexes[0])

    def close(self) -> None:
        """Stop following the watcher (its swaps no longer warm this retriever), and abandon a
        warm-up in progress at its next batch (`WarmupAbandoned`, which the watcher's poll reports
        as a refused snapshot), a re-warm's too (`join_warmups` waits for it): a process stopping
        waits for one batch, not a whole warm-up, before no thread of it runs native code."""
        self._closed.set()
        if self.watcher is not None and self._before_swap in self.watcher.before_swap:
            self.watcher.before_swap.remove(self._before_swap)


class WarmupAbandoned(SidIndexError):
    """A warm-up stopped half way because its Retriever was closed."""


def _for_index(reqs: Requests, served_for: Validated, index: ServedIndex) -> Requests | None:
    """A batch served as validated for `served_for` (`runtime.requests.validated_for`), for a
    warm-up of `index`: itself when that is `index`'s too, else validated again (its rows numbered
    anew: a padded batch repeats its last request), or None when `index` refuses it."""
    if served_for == validated_for(index):
        return reqs
    table = reqs.table.set_column(reqs.table.column_names.index("request_id"), "request_id",
                                  pa.array(np.arange(len(reqs), dtype=np.int64)))
    try:
        return requests_from(table, index, source="served requests")
    except InputError:
        return None


WARM_BATCHES = 8  # batches of the largest size a warm-up searches to size the widths (module doc)
TRAFFIC_EVERY = 64  # besides every batch a frozen searcher could not hold, one in this many is kept to warm with
REWARM_GAP = 64  # frozen batches between the starts of two re-warms
MAX_REWARMS = 4  # re-warms of one served snapshot (each doubles the widths its batches overflowed)


@dataclass
class _Warmed:
    """What serves one ServedIndex: its searcher (graphs, widths, its codebook scorer)."""

    index: ServedIndex
    searcher: Searcher


@dataclass(eq=False)
class _Flight:
    """One batch from its encoding until it is read (`Retriever.run`)."""

    warmed: _Warmed  # the index and searcher it is served on
    padded: Requests  # as searched: padded to a configured batch size
    host: EncodedRequests  # its encoding, in an arena of the calling thread's
    request_id: np.ndarray  # its own requests' ids
    n: int  # its own requests (the first n rows)
    lo: int  # its first row within the requests `run` was given
    submitted: Submitted | None = None
    scorer: Scorer | None = None  # a user's factory's for it (None: the built-in one)
    compiled: int = 0  # Triton kernels the calling thread compiled for it


class _Arena:
    """A reused int64 arena for one thread's batches' encodings, grown (to twice the need) when a
    batch needs more. Reusing it is safe once the batch encoded in it was read: a searcher stages
    a batch out of it (`runtime.requests.Staged`), but answers a batch past its graph from it."""

    def __init__(self) -> None:
        self._a: np.ndarray | None = None

    def words(self, need: int) -> np.ndarray:
        if self._a is None or len(self._a) < need:
            self._a = np.empty(2 * need, dtype=np.int64)
        return self._a


def _side_stream(device: torch.device):
    """A CUDA stream of its own for a warm-up (synchronised at its end, before the graphs it
    captured replay on the serving stream), so that serving batches do not queue behind it."""
    if device.type != "cuda":
        return contextlib.nullcontext()
    stream = torch.cuda.Stream(device)
    stream.wait_stream(torch.cuda.current_stream(device))

    @contextlib.contextmanager
    def on_it():
        with torch.cuda.stream(stream):
            yield
        stream.synchronize()

    return on_it()


def largest_requests(index: ServedIndex, n: int, seed: int = 0, near_ads: bool = False) -> pa.Table:
    """n requests as large as a batch can hold: every bloom attribute at MAX_REQUEST_VALUES
    distinct values, bitmask attributes unknown; with a codebook, embeddings rebuilt from paths
    of it (a centroid per level, summed), which lead the beams where the catalog's ads are, as
    real requests' do: random paths, or with `near_ads` the paths of the SIDs of ads drawn at
    random ((leaf, ad) rows, each as likely), which crowd where the catalog's ads crowd."""
    cols: dict[str, pa.Array] = {"request_id": pa.array(np.arange(n, dtype=np.int64))}
    for a in index.spec.attributes:
        if a.one_request_value:  # one value, unknown here
            cols[a.name] = pa.nulls(n, pa.string())
        else:
            cols[a.name] = pa.array([[f"\0warm-up {i}" for i in range(MAX_REQUEST_VALUES)]] * n,
                                    type=pa.list_(pa.string()))
    cb = index.codebook
    if cb is not None:
        rng = np.random.default_rng(seed)
        g = index.snapshot.gtm
        if near_ads and g.leaf_ad_offsets[-1] > 0:
            leaves = np.searchsorted(g.leaf_ad_offsets, rng.integers(0, g.leaf_ad_offsets[-1], n), side="right") - 1
            paths = g.leaf_sids(leaves).astype(np.int64).T  # (L, n): the codebook's levels first
        else:
            paths = np.stack([rng.integers(0, len(c), n) for c in cb.centroids])
        emb = np.asarray(sum(c[p] for c, p in zip(cb.centroids, paths))).astype(np.float32)
        emb = np.clip(emb, -MAX_ABS_EMBEDDING, MAX_ABS_EMBEDDING)
        cols["embedding"] = pa.FixedSizeListArray.from_arrays(pa.array(emb.reshape(-1)), cb.dim)
    return pa.table(cols)
