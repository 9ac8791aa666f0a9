"""A serving searcher: beam search and post stage replayed from CUDA graphs (docs/design.md §17;
docs/runtime.md#searcher).

A host keeps one `Searcher` per (beams, mode) and calls `search` (beams) or `retrieve` (ranked
eligible ads; `submit` then `Submitted.read`, its two halves) per batch. On a GPU each batch size is
searched once to warm up, then captured whole as a CUDA graph, whose inputs are the batch's staged
encoding (`runtime.requests.Staged`: one pinned buffer, one copy to the device) and the scorer's
`inputs`; later batches are copied into those inputs and replay it. A frozen searcher gives each
capped graph two slots, so one batch is staged and replayed while the one before it is on the
device or being read. Each step's width is capped (`slack`); a batch past a frozen graph's widths
is answered by the worst case's graph captured beside it, so nothing compiles, captures or widens
on the serving thread and no candidate is ever cut. A scorer without `inputs`, and the CPU, search
eagerly (`eager_reason`). A graph belongs to the device arrays it was captured on: a swapped-in
snapshot is captured anew, one that changed only ad states replays.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import threading
import warnings
from dataclasses import dataclass
from typing import Protocol, TypeGuard

import numpy as np
import torch

from runtime.index.served import ServedIndex
from runtime.ops.compiles import count_compiles
from runtime.ops.expand import DEFAULT_PAIRS, MAX_PAIRS
from runtime.ops.expand.layout import pow2
from runtime.ops.impl import Impl
from runtime.requests import Staged, device_form
from runtime.result import Retrieved
from runtime.scorers.codebook import CodebookScorer, codebook_of, embedding_of
from runtime.search.beam import (
    DEFAULT_BEAMS,
    Beams,
    Scorer,
    beam_search,
    capped_widths,
    check_scored,
    check_slack,
    scorer_name,
)
from runtime.serving.post import DevicePost, check_rank, check_top_k, expand, on_device
from sidindex.errors import ConfigError
from sidindex.modes import Mode, parse_mode
from sidindex.request_encoding import EncodedRequests


class _Capturable(Scorer, Protocol):
    """A scorer a graph can capture: `inputs`, the tensors it reads, refreshed in place per batch."""

    inputs: dict[str, torch.Tensor]


def _capturable(scorer: Scorer) -> TypeGuard[_Capturable]:
    return isinstance(getattr(scorer, "inputs", None), dict)


@dataclass
class _Graph:
    """One captured search: the graph, its inputs (the staged batch, the scorer's) and its outputs."""

    graph: torch.cuda.CUDAGraph
    staged: Staged  # the batch's queries and embedding, at the places the graph reads
    scorer: _Capturable  # the captured scorer; its `inputs` are the graph's
    bound: bool  # the scorer is the built-in one reading the staged embedding (`scorer` None)
    out: Beams
    flags: torch.Tensor | None  # the search's overflow and unscored flags, one bool tensor (or None)
    flags_host: torch.Tensor | None  # ... their pinned host copy, queued after each replay
    post: DevicePost | None = None  # with `retrieve`: the captured post stage, and its output buffer
    buffer: torch.Tensor | None = None
    # recorded behind each replay's copies to the host: its reader waits for that batch alone, not
    # for one replayed after it on another slot
    done: torch.cuda.Event = dataclasses.field(default_factory=torch.cuda.Event)
    twin: _Graph | None = None  # once frozen: a second slot for the same batches (`Searcher.submit`)
    holder: int | None = None  # the thread that replayed it and has not read it yet (None: free)


SLACK = 2.0  # a step's compact layout: twice its beams' typical candidates (`search.beam.capped_widths`)
PAIR_SLACK = 2.0  # the post stage's pairs per request: twice the most a warm-up request reached
MIN_PAIRS = 1024  # ... and at least this many


class Searcher:
    """Beam search for one (beams, mode, value weight), captured per batch size on a GPU (see the
    module doc).

    slack: each step's top-k selects among `slack` x the candidates its beams' nodes typically
    have (`runtime.search.beam.capped_widths`) rather than its worst case, which can be twelve times as
    many. While warming, a batch with more candidates than that at some step is searched again
    with twice that step's slack (`step_slack`; `widened` counts those searches), and `settle`
    then fits the post stage (`pairs`) to the most (request, ad) pairs a warm-up request reached,
    never past the most its beams can reach (`post_room`). Once `frozen` (`runtime.Retriever`
    freezes it after warm-up), nothing widens: a batch that does not
    fit is answered at once by the worst case's graph, captured beside the capped one (every step's
    full width, the post stage's default room or the fitted one past it, and past that a post stage
    sized to the batch: `runtime.serving.post.expand`), and counted in `overflows` (a batch past the pairs
    while warming too). Either way no candidate is cut (module doc). 0: every step's worst case, never a
    second search. `captures` counts the graphs captured.

    slots: the graphs of a batch size the built-in scorer's `retrieve` replays once frozen (`submit`):
    2 (the default) lets a batch be staged and replayed while the one before it is read, for the
    GPU memory of a second capped graph; 1 serves one batch at a time.
    """

    def __init__(self, beams: tuple[int, ...] | str = DEFAULT_BEAMS, mode: Mode | str = Mode.CD_GTM,
                 impl: Impl | str = Impl.AUTO, value_weight: float = 0.0, slack: float = SLACK, slots: int = 2) -> None:
        self.beams, self.mode, self.impl, self.value_weight = beams, parse_mode(mode), impl, value_weight
        check_slack((slack,), 1)
        self.slack, self.widened, self.overflows, self.captures = slack, 0, 0, 0
        self.slots = check_slots(slots)
        self.step_slack: dict[int, float] = {}  # steps widened past `slack`
        self.pairs: int | None = None  # the fitted pairs per request (`settle`; None: DevicePost's default)
        self.most_reached = 0  # the most pairs a request reached, while warming
        self.frozen = False
        self.eager_reason: str | None = None
        self._index: ServedIndex | None = None  # the graphs' index, held: they replay its tensors
        self._graphs: dict[tuple[int, tuple | None, bool], _Graph] = {}  # by (batch size, post stage, worst case)
        self._codebook_scorer: tuple | None = None  # (codebook, its scorer on the device): `_codebook`
        self._lock = threading.RLock()  # a batch's staging and replay; while warming, until it is read
        self._free = threading.Condition(self._lock)  # a slot was read (`_slot` waits for one)
        self._mine = threading.local()  # each thread's stalls (`_stall`)

    def _search(self, index: ServedIndex, requests: EncodedRequests, scorer: Scorer, full: bool = False) -> Beams:
        """The eager search this Searcher captures and replays; `full`: every step's worst case."""
        return beam_search(index, requests, scorer, self.beams, self.mode, self.impl, self.value_weight,
                           widths=None if full else self.widths(index))

    def widths(self, index: ServedIndex) -> tuple[int | None, ...] | None:
        """The compact layout's width per step (None: the step's worst case) this Searcher's
        searches of `index` use now (`runtime.search.beam.capped_widths`)."""
        if not self.mode.constrained:
            return None
        return capped_widths(index, self.beams, tuple(self.step_slack.get(d, self.slack)
                                                       for d in range(index.sid_length)))

    def _codebook(self, index: ServedIndex) -> CodebookScorer:
        """The built-in scorer of `index`'s codebook (its centroids on the device, once per codebook),
        for no requests yet: `reading` or `for_embedding` gives a batch's."""
        cb = codebook_of(index)
        if self._codebook_scorer is None or self._codebook_scorer[0] is not cb:
            self._codebook_scorer = (cb, CodebookScorer(cb, torch.zeros(0, cb.dim, device=index.device)))
        return self._codebook_scorer[1]

    def _eager(self, index: ServedIndex, requests: EncodedRequests, scorer: Scorer | None, request_id,
               counted: bool = False) -> Beams:
        """The search without graphs (requests in either form, scorer None: the built-in one of their
        embedding); `counted`: the batch is already an overflow (off its graph)."""
        requests = device_form(requests, index.device)
        if scorer is None:
            scorer = self._codebook(index).for_embedding(embedding_of(requests))
        with self._lock:  # one search at a time, as with graphs: a batch that overflows widens once
            beams = self._search(index, requests, scorer)
            while (step := self._overflowed(beams, scorer, request_id)) is not None:
                if self.frozen:
                    if not counted:
                        self._stall("overflows")
                    beams = self._search(index, requests, scorer, full=True)
                    self._overflowed(beams, scorer, request_id)  # never overflows; a broken model is refused
                    break
                self._widen(step)
                beams = self._search(index, requests, scorer)
            return dataclasses.replace(beams, overflow=None, unscored=None)  # as a replay's: its flags were read

    def _overflowed(self, beams: Beams, scorer: Scorer | None, request_id,
                    host: np.ndarray | None = None) -> int | None:
        """The first step at which a search overflowed a capped width (`Beams.overflow`), else
        None, after refusing a search whose scorer gave some request no finite logit at a step
        (`check_scored`, a ScorerError), on the search that stands: widths change no beam it keeps.
        Both flags come to the host in one copy, or are there already (`host`: a replay's, `_flags`)."""
        if host is None:
            flags = _flags(beams)
            if flags is None:
                return None
            host = flags.cpu().numpy()
        L = beams.tokens.shape[2]
        if beams.overflow is not None and host[:L].any():
            return int(host[:L].argmax())
        if beams.unscored is not None:
            check_scored(host[-beams.unscored.numel():].reshape(beams.unscored.shape),
                         scorer_name(CodebookScorer if scorer is None else scorer), request_id)
        return None

    def _widen(self, step: int) -> None:
        """Twice the slack at `step`; the capped graphs captured before are dropped (warming only)."""
        self.step_slack[step] = 2 * self.step_slack.get(step, self.slack)
        self._stall("widened")
        self._graphs = {k: g for k, g in self._graphs.items() if k[2]}

    def _searched(self, g: _Graph, index: ServedIndex, scorer: Scorer | None, request_id) -> tuple[int | None, Beams]:
        """A replay of the search alone, read after its one wait: the step it overflowed at
        (`_overflowed`: a ScorerError for a broken model) and its beams, copied out of the graph's
        outputs (the copies recorded before the slot is freed)."""
        found = Beams(g.out.tokens.clone(), g.out.score.clone(), g.out.leaf.clone())
        g.done.record(torch.cuda.current_stream(index.device))
        return self._overflowed(g.out, scorer, request_id, _wait(g)), found

    def _outcome(self, g: _Graph, scorer: Scorer | None, request_id) -> tuple[int | None, Retrieved | None]:
        """A replay of search and post stage, read after its one wait: the step it overflowed at
        (`_overflowed`: a ScorerError for a broken model) and the post stage's result (None: past
        its pairs)."""
        assert g.post is not None and g.buffer is not None  # captured with the post stage
        return self._overflowed(g.out, scorer, request_id, _wait(g)), g.post.result(g.buffer, g.done)

    def _note_reached(self, post: DevicePost) -> None:
        """While warming: the most pairs a request of the batch just answered reached."""
        if not self.frozen and post.last_reached is not None and len(post.last_reached):
            self.most_reached = max(self.most_reached, int(post.last_reached.max()))

    def settle(self) -> None:
        """At the end of a warm-up: the post stage fitted to the most pairs a warm-up request reached
        (`post_room`; a graph whose post stage would now get another room is dropped, and the next
        batch of its size captures it again)."""
        with self._lock:
            pairs = fitted_pairs(self.most_reached) if self.most_reached else None
            if pairs != self.pairs:
                self.pairs = pairs
                self._graphs = {k: g for k, g in self._graphs.items() if g.post is None
                                or g.post.layout.pairs == _room_now(g.post, pairs, k[2])}

    def _why_eager(self, index: ServedIndex, scorer: Scorer | None) -> str | None:
        why = ("the index is on the CPU" if index.device.type != "cuda" else
               None if scorer is None or _capturable(scorer) else
               f"the scorer ({type(scorer).__name__}) has no `inputs` to refresh in a captured graph")
        if why is not None and self.eager_reason != why:
            self.eager_reason = why
            if index.device.type == "cuda":
                warnings.warn(f"searching eagerly: {why}", stacklevel=3)
        if why is None:
            count_compiles()
        return why

    def search(self, index: ServedIndex, requests: EncodedRequests, scorer: Scorer | None = None, *,
               request_id: np.ndarray | None = None) -> Beams:
        """`runtime.beam_search(index, requests, scorer, beams, mode)`, replayed when it can be.
        requests: the batch's encoding, on the host (`sidindex.request_encoding.encode_requests`,
        best: a replay copies it as it is) or on the index's device (`runtime.to_device`); scorer:
        None for the built-in codebook scorer of the requests' embedding. A search in which the
        scorer gave some request no finite logit at a step is a ScorerError
        (`runtime.search.beam.check_scored`), naming the request by its `request_id` (the batch's first
        len(request_id) rows; rows beyond, a padded batch's copies, are not checked) or by its row."""
        if self._why_eager(index, scorer) is not None:
            return self._eager(index, requests, scorer, request_id)
        with self._lock:  # the next replay overwrites the outputs
            while True:
                g = self._replay(index, requests, scorer, None)
                if g is None:  # a batch the frozen graphs cannot hold
                    self._stall("overflows")
                    return self._eager(index, requests, scorer, request_id, counted=True)
                with self._reading(g):
                    step, found = self._searched(g, index, scorer, request_id)
                if step is None:
                    return found
                if not self.frozen:
                    self._widen(step)
                    continue
                self._stall("overflows")
                g = self._replay(index, requests, scorer, None, full=True)
                if g is None:  # captured for smaller batches (a user's scorer that warmed on fewer values)
                    return self._eager(index, requests, scorer, request_id, counted=True)
                with self._reading(g):
                    return self._searched(g, index, scorer, request_id)[1]  # never overflows; a broken model is refused

    def retrieve(self, index: ServedIndex, requests: EncodedRequests, scorer: Scorer | None = None, *,
                 top_k: int | None = None, rank: str = "score", stages: bool = False,
                 request_id: np.ndarray | None = None) -> Retrieved:
        """The ranked eligible ads of one batch (`runtime.serving.post.expand` of `search`): on a GPU
        holding the index's post arrays (`runtime.serving.post.on_device`), search and post stage replayed
        as one graph, its flags, counts and first rows brought to the host behind it, one wait.
        requests, scorer, request_id: as `search`'s (the host post stage, on the CPU or past every
        device stage, reads the host encoding, or the one a device form was moved from). `submit`,
        then `Submitted.read`."""
        submitted = self.submit(index, requests, scorer, top_k=top_k, rank=rank, stages=stages,
                                request_id=request_id)
        assert submitted is not None  # it waits for a slot
        found = submitted.read()
        return found if found is not None else submitted.worst_case()

    def submit(self, index: ServedIndex, requests: EncodedRequests, scorer: Scorer | None = None, *,
               top_k: int | None = None, rank: str = "score", stages: bool = False,
               request_id: np.ndarray | None = None, wait: bool = True) -> Submitted | None:
        """`retrieve` in two halves: here the batch is staged and its graph replayed, with no wait;
        `Submitted.read` then waits for that batch alone and reads it. Once frozen, a capped graph
        of the built-in scorer has two slots (`freeze`), each with its own staging and outputs: a
        batch is replayed on a free one while the batch before it is on the device or being read,
        so a caller that submits its next batch before reading this one (`runtime.Retriever` does),
        or two callers, keep the GPU busy. A batch holds its slot until it is read, and a batch
        finding none free waits for one; wait False: None instead (nothing done). A caller holding
        a batch it has not read must not wait: it could wait for another caller doing the same (a
        ConfigError when this thread holds every slot). While warming, eagerly and on the CPU, the
        batch is answered here, and `read` returns it. `Submitted.stalls` counts what it cost."""
        check_rank(index, rank)
        check_top_k(top_k)
        post = (top_k, rank, stages)
        with self._lock:
            before = self._stalls()
            try:
                submitted = self._submitted(index, requests, scorer, post, request_id, wait)
            except _Busy:
                return None
            submitted.stalls = tuple(a - b for a, b in zip(self._stalls(), before))
            return submitted

    def _submitted(self, index: ServedIndex, requests: EncodedRequests, scorer: Scorer | None, post: tuple,
                   request_id, wait: bool) -> Submitted:
        if self._why_eager(index, scorer) is not None or not on_device(index):
            return Submitted(self, found=self._eager_retrieved(index, requests, scorer, post, request_id))
        if not self.frozen:
            return Submitted(self, found=self._warming(index, requests, scorer, post, request_id))
        g = self._replay(index, requests, scorer, post, wait=wait)
        if g is None:  # a batch the frozen graphs cannot hold
            self._stall("overflows")
            return Submitted(self, found=self._eager_retrieved(index, requests, scorer, post, request_id, True))
        return Submitted(self, index, requests, scorer, post, request_id, g)

    def _eager_retrieved(self, index: ServedIndex, requests: EncodedRequests, scorer: Scorer | None, post: tuple,
                         request_id, counted: bool = False) -> Retrieved:
        """`_eager`'s search and the post stage, on the batch's device form, made once for both."""
        top_k, rank, stages = post
        requests = device_form(requests, index.device)
        beams = self._eager(index, requests, scorer, request_id, counted)
        return expand(index, requests, beams, top_k, stages, rank)

    def _stall(self, what: str) -> None:
        """Count a widening, capture or overflow: in the searcher's total and in this thread's,
        whose differences are a batch's `Submitted.stalls` (a batch waiting for a slot lets
        others count meanwhile)."""
        setattr(self, what, getattr(self, what) + 1)
        mine = self._mine.__dict__
        mine[what] = mine.get(what, 0) + 1

    def _stalls(self) -> tuple[int, int, int]:
        """This thread's widenings, captures and overflows so far."""
        mine = self._mine.__dict__
        return mine.get("widened", 0), mine.get("captures", 0), mine.get("overflows", 0)

    def _warming(self, index: ServedIndex, requests: EncodedRequests, scorer: Scorer | None, post: tuple,
                 request_id) -> Retrieved:
        """A batch retrieved while warming (under the lock): searched again wider past a capped
        width, the pairs its requests reached noted for `settle`; past the pairs, the worst case's."""
        while True:
            g = self._replay(index, requests, scorer, post)
            assert g is not None and g.post is not None  # captured while warming, with the post stage
            with self._reading(g):
                step, found = self._outcome(g, scorer, request_id)  # found None: too many pairs
                self._note_reached(g.post)
            if step is None and found is not None:
                return found
            if step is not None:
                self._widen(step)
                continue
            self._stall("overflows")  # past the pairs (`settle` fits them)
            return self._worst_case(index, requests, scorer, post, request_id)

    def _worst_case(self, index: ServedIndex, requests: EncodedRequests, scorer: Scorer | None, post: tuple,
                    request_id) -> Retrieved:
        """A batch past the capped graph, answered by the worst case's graph (module doc); where its
        requests reach more pairs than even that one's post stage holds, by `expand` (a stage sized
        to them, or the host's); and without a graph that holds its queries, eagerly."""
        top_k, rank, stages = post
        g = self._replay(index, requests, scorer, post, full=True)
        if g is None:  # captured for smaller batches (a user's scorer that warmed on fewer values)
            return self._eager_retrieved(index, requests, scorer, post, request_id, True)
        with self._reading(g):
            _, found = self._outcome(g, scorer, request_id)  # never overflows; a broken model is refused
            return found if found is not None else expand(index, requests, g.out, top_k, stages, rank)

    def freeze(self) -> None:
        """The end of a warm-up (`runtime.Retriever` freezes its searchers): from now on nothing
        widens, captures or compiles (class doc), and each capped graph of the built-in scorer's
        `retrieve` gets a second slot (`submit`), captured now."""
        with self._lock:
            if self._index is not None:
                for key, g in list(self._graphs.items()):
                    self._twin(self._index, key, g)
            self.frozen = True

    def _replay(self, index: ServedIndex, requests: EncodedRequests, scorer: Scorer | None, post: tuple | None,
                full: bool = False, wait: bool = True) -> _Graph | None:
        """The graph of this batch size (post stage, worst case), captured if it is not yet, or a
        free slot of it (`_slot`), replayed with the batch's inputs, its outputs' copies to the host
        queued and its event recorded behind them (`_wait` waits for it), held by this thread until
        read (`_reading`); a batch a graph cannot hold is captured anew while warming, and is None
        once frozen (no capture on the serving thread). wait False: `_Busy` when no slot is free."""
        with self._lock:
            if self._index is None or index.generation is not self._index.generation:
                self._graphs = {}  # other device arrays (another snapshot, or one loaded again): new graphs
            self._index = index
            key = (requests.batch, post, full)
            g = self._graphs.get(key)
            stale = g is not None and _stale(g, index)
            if g is None or stale or not _fits(g, requests, scorer):
                if self.frozen and g is not None and not stale:
                    return None
                g = self._graphs[key] = self._capture(index, requests, scorer, post, full)
                if self.frozen:  # new post arrays (an update of ad states): both slots again
                    self._twin(index, key, g)
                worst = (requests.batch, post, True)
                w = self._graphs.get(worst)
                # captured while warming, beside the capped graph, for when frozen: holding what it holds
                if not full and (w is None or _stale(w, index) or not _fits(w, requests, scorer)):
                    self._graphs[worst] = self._capture(index, requests, scorer, post, True)
                g.holder, replay = threading.get_ident(), False  # replayed by its capture
            else:
                if g.post is not None:
                    g.post.check(requests)
                g, replay = self._slot(g, wait), True
            try:  # the slot is this thread's until read: freed here if anything fails before
                if replay:
                    _load(g, requests, scorer)
                    g.graph.replay()
                if g.flags is not None and g.flags_host is not None:
                    g.flags_host.copy_(g.flags, non_blocking=True)
                if g.post is not None and g.buffer is not None:
                    g.post.send(g.buffer)
                g.done.record(torch.cuda.current_stream(index.device))
            except BaseException:
                self._give(g)
                raise
            return g

    def _slot(self, g: _Graph, wait: bool = True) -> _Graph:
        """A free one of g and its twin, now held by this thread (under the lock: waits for one;
        wait False: `_Busy` instead)."""
        me = threading.get_ident()
        slots = (g,) if g.twin is None else (g, g.twin)
        while True:
            free = next((s for s in slots if s.holder is None), None)
            if free is not None:
                free.holder = me
                return free
            if not wait:
                raise _Busy
            if all(s.holder == me for s in slots):
                raise ConfigError(f"this thread submitted {len(slots)} batches of {g.staged.requests.batch} "
                                  "requests and read none: read one (`Submitted.read`) before submitting another")
            self._free.wait()

    def _give(self, g: _Graph) -> None:
        with self._lock:
            g.holder = None
            self._free.notify_all()

    @contextlib.contextmanager
    def _reading(self, g: _Graph):
        """Read a replay's outputs, then free its slot for the next batch."""
        try:
            yield
        finally:
            self._give(g)

    def _twin(self, index: ServedIndex, key: tuple[int, tuple | None, bool], g: _Graph) -> None:
        """A second slot for a capped graph of the built-in scorer's `retrieve` (`submit`): the same
        search and post stage captured on a staging like g's. Where the device has no memory for
        it, g serves alone (a warning says so)."""
        _, post, full = key
        if self.slots < 2 or post is None or full or not g.bound or g.twin is not None or _stale(g, index):
            return
        try:
            g.twin = self._capture(index, g.staged.requests, None, post, False, g.staged.another())
        except torch.cuda.OutOfMemoryError:
            warnings.warn(f"no device memory for a second graph of batches of {key[0]}: they are served one at a "
                          "time", stacklevel=2)

    def _capture(self, index: ServedIndex, requests: EncodedRequests, scorer: Scorer | None, post: tuple | None,
                 full: bool, staged: Staged | None = None) -> _Graph:
        """The graph of one batch's search (and post stage), with room for batches a little larger
        (`runtime.requests.Staged.room_for`, or `staged`), replayed once on it."""
        staged = Staged.room_for(requests, index.device) if staged is None else staged
        staged.put(requests)
        static = staged.requests
        captured = self._codebook(index).reading(embedding_of(static)) if scorer is None else scorer
        assert _capturable(captured)  # as _why_eager found
        stage: list[DevicePost] = []  # made once the first search shows the beams' shape

        def run():
            beams = self._search(index, static, captured, full)
            flags = _flags(beams)
            if post is None:
                return beams, flags, None
            if not stage:
                top_k, rank, stages = post
                K = beams.score.shape[1]
                assert index.post_bounds is not None  # the loader makes them with the post arrays DevicePost needs
                stage.append(DevicePost(index, requests.batch, K, top_k=top_k, rank=rank, stages=stages,
                                        pinned=True,  # read every replay
                                        pairs=post_room(self.pairs, full, index.post_bounds.most_pairs(K))))
            return beams, flags, stage[0].run(static, beams)

        run()  # checks, compiles kernels
        side = torch.cuda.Stream(index.device)
        side.wait_stream(torch.cuda.current_stream(index.device))
        with torch.cuda.stream(side):  # the allocator's warm-up, outside the capture
            run()
        torch.cuda.current_stream(index.device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        # thread_local: a snapshot warmed on the poller's thread captures while batches are served
        # on another (`Retriever.prepare`); the global mode would fail the serving thread's calls
        with torch.cuda.graph(graph, capture_error_mode="thread_local"):
            out, flags, buffer = run()
        graph.replay()
        if stage and not full:  # its pinned memory made now, not at the first batch served (the worst
            stage[0].send(buffer)  # case's, larger and rarely read, at its first)
        self._stall("captures")
        flags_host = None if flags is None else torch.empty(flags.shape, dtype=flags.dtype, pin_memory=True)
        return _Graph(graph, staged, captured, scorer is None, out, flags, flags_host, stage[0] if stage else None,
                      buffer)


@dataclass(eq=False)
class Submitted:
    """A batch given to `Searcher.submit`: answered there already (`found`), or replayed on a slot
    of its graph (`graph`), not yet read."""

    searcher: Searcher
    index: ServedIndex | None = None
    requests: EncodedRequests | None = None
    scorer: Scorer | None = None
    post: tuple | None = None  # (top_k, rank, stages)
    request_id: np.ndarray | None = None
    graph: _Graph | None = None
    found: Retrieved | None = None
    stalls: tuple[int, ...] = (0, 0, 0)  # the searcher's widenings, captures and overflows this batch made

    def read(self) -> Retrieved | None:
        """The batch's ranked eligible ads: waits for its replay alone, reads its flags, counts and
        rows, and frees its slot. None: the batch passed the frozen graph's widths or pairs, and
        `worst_case` answers it. A ScorerError as `Searcher.search`'s."""
        g, self.graph = self.graph, None
        if g is not None:
            s = self.searcher
            with s._reading(g):
                step, found = s._outcome(g, self.scorer, self.request_id)
            self.found = found if step is None else None
        return self.found

    def worst_case(self) -> Retrieved:
        """A batch `read` found past the frozen graph, answered by the worst case's graph
        (`Searcher.overflows` counts it)."""
        s = self.searcher
        assert self.found is None and self.graph is None and self.index is not None and self.requests is not None
        assert self.post is not None  # a replayed batch's
        with s._lock:
            before = s._stalls()
            s._stall("overflows")
            self.found = s._worst_case(self.index, self.requests, self.scorer, self.post, self.request_id)
            self.stalls = tuple(a + b - c for a, b, c in zip(self.stalls, s._stalls(), before))
        return self.found


class _Busy(Exception):
    """No slot of a graph is free, and the caller would not wait (`Searcher.submit`)."""


def check_slots(slots: int) -> int:
    if not isinstance(slots, int) or isinstance(slots, bool) or slots not in (1, 2):
        raise ConfigError(f"slots {slots!r}: expected 1 (one batch at a time) or 2 (a batch replayed while the one "
                          "before it is read)")
    return slots


def fitted_pairs(most: int) -> int:
    """The capped post stage's pairs per request for requests that reached at most `most`:
    PAIR_SLACK x most, at least MIN_PAIRS, rounded up to a power of 2 (a few sizes of the stage's
    buffers, which the graphs' memory pools hold), at most MAX_PAIRS."""
    return min(MAX_PAIRS, pow2(max(MIN_PAIRS, math.ceil(PAIR_SLACK * most))))


def post_room(fitted: int | None, full: bool, bound: int) -> int | None:
    """A captured post stage's pairs per request: the capped graph's `fitted` room (None before
    `Searcher.settle`: DevicePost's default), the worst case's default room or the fitted one past
    it; never more than `bound`, the most pairs the beams can reach (`PostBounds.most_pairs`):
    room past it holds nothing, and costs the stage's time and memory (B x C)."""
    room = fitted if not full or (fitted is not None and fitted > DEFAULT_PAIRS) else None
    return None if room is None else max(1, min(room, bound))


def _room_now(post: DevicePost, fitted: int | None, full: bool) -> int:
    """The pairs per request a graph's post stage `post` would be captured with for `fitted`."""
    room = post_room(fitted, full, post.bounds.most_pairs(post.layout.beams))
    return post.bounds_pairs if room is None else room


def _flags(beams: Beams) -> torch.Tensor | None:
    """The search's overflow (L,) and unscored (B, L) flags in one bool tensor (None: neither)."""
    flags = [f.reshape(-1) for f in (beams.overflow, beams.unscored) if f is not None]
    return None if not flags else torch.cat(flags) if len(flags) > 1 else flags[0]


def _wait(g: _Graph) -> np.ndarray | None:
    """Wait for a replay and the copies `_replay` queued behind it (not for a replay queued after
    them on another slot); the flags' host copy."""
    g.done.synchronize()
    return None if g.flags_host is None else g.flags_host.numpy()


def _stale(g: _Graph, index: ServedIndex) -> bool:
    """An update of ad states shares the trie (the generation) but may bring new post arrays."""
    return g.post is not None and not _same_tensors(g.post.arrays, index.post)


def _same_tensors(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor] | None) -> bool:
    """The same tensor objects by name (what a graph captured on `a` reads is `b`'s)."""
    return b is not None and a.keys() == b.keys() and all(a[n] is b[n] for n in a)


def _fits(g: _Graph, requests: EncodedRequests, scorer: Scorer | None) -> bool:
    """The batch fits the graph's staging (`Staged.fits`) and its scorer is the captured one's
    kind: the built-in one (None), or one of the captured one's type with inputs of the same
    shapes (a graph replays the scorer it captured, with the batch's inputs)."""
    if not g.staged.fits(requests):
        return False
    if scorer is None or g.bound:
        return scorer is None and g.bound
    if type(scorer) is not type(g.scorer) or not _capturable(scorer):
        return False
    mine, theirs = g.scorer.inputs, scorer.inputs
    return mine.keys() == theirs.keys() and all(
        mine[k].shape == theirs[k].shape and mine[k].dtype == theirs[k].dtype for k in mine)


def _load(g: _Graph, requests: EncodedRequests, scorer: Scorer | None) -> None:
    """A batch into the graph's inputs: its encoding staged and sent (one copy to the device), and
    a scorer's inputs copied into the captured scorer's (the built-in one reads the staged embedding)."""
    g.staged.put(requests)
    if scorer is not None and scorer is not g.scorer:
        assert _capturable(scorer)  # as `_fits` found
        for k, t in scorer.inputs.items():
            g.scorer.inputs[k].copy_(t)
