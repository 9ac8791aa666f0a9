"""A serving searcher: beam search replayed from CUDA graphs (DESIGN.md §12).

A host keeps one `Searcher` per (beams, mode) and calls `search(index, requests, scorer)` per
batch. On a GPU the first batch of each size is searched once to warm up, then the whole search
(every step's scorer call, mask, top-k and child lookup) is captured as a CUDA graph; later
batches of that size copy their inputs into the graph's buffers and replay it, paying neither
Python nor launch overhead. The graph's inputs are
  - the requests' queries: each plane's rows into a buffer with room for the largest batch seen
    (a batch that needs more re-captures), the ranges into a (B, G, 2) buffer;
  - the scorer's `inputs`: a dict of tensors the scorer reads each step (the codebook scorer's
    embeddings, the reference decoder's context), copied into the captured scorer's.
A scorer without `inputs` cannot be refreshed inside a graph, and the CPU has no graphs: those
searches run eagerly, and `eager_reason` says why (a warning says it once). Replayed results
are copies: the next replay does not change them.

With a `SnapshotWatcher`, each request takes `watcher.current` once and passes it here: a graph
belongs to the device arrays it was captured on, so a swapped-in snapshot is captured anew at its
first batch and the old graphs are dropped (they read the old index's tensors); an update that
changed only ad states shares the device arrays (`ServedIndex.generation`), and its graphs replay.
Searches through one Searcher are serialised (its graphs' buffers are shared), so a batch in flight finishes on
the index it was given before the next one re-captures.
"""

from __future__ import annotations

import dataclasses
import threading
import warnings
from dataclasses import dataclass

import torch

from runtime.loader import ServedIndex
from runtime.ops.gtm_mask.planes import stack_queries
from runtime.search import DEFAULT_BEAMS, Beams, Scorer, beam_search
from sidindex.modes import Mode, parse_mode
from sidindex.requests import EncodedRequests


@dataclass
class _Graph:
    """One captured search: the graph, its input buffers and its outputs."""

    graph: torch.cuda.CUDAGraph
    requests: EncodedRequests  # static: the stacked form, the planes' rows (each plane's capacity) and ranges views of it
    scorer: Scorer  # the captured scorer; its `inputs` are the graph's
    out: Beams


class Searcher:
    """Beam search for one (beams, mode, value weight), captured per batch size on a GPU (see the
    module doc)."""

    def __init__(self, beams: tuple[int, ...] | str = DEFAULT_BEAMS, mode: Mode | str = Mode.CD_GTM,
                 impl: str = "auto", value_weight: float = 0.0) -> None:
        self.beams, self.mode, self.impl, self.value_weight = beams, parse_mode(mode), impl, value_weight
        self.eager_reason: str | None = None
        self._index: ServedIndex | None = None  # the graphs' index, held: they replay its tensors
        self._graphs: dict[int, _Graph] = {}
        self._lock = threading.Lock()

    def _search(self, index: ServedIndex, requests: EncodedRequests, scorer: Scorer) -> Beams:
        """The eager search this Searcher captures and replays."""
        return beam_search(index, requests, scorer, self.beams, self.mode, self.impl, self.value_weight)

    def search(self, index: ServedIndex, requests: EncodedRequests, scorer: Scorer) -> Beams:
        """`runtime.beam_search(index, requests, scorer, beams, mode)`, replayed when it can be.
        requests: on the index's device (`runtime.to_device`)."""
        why = ("the index is on the CPU" if index.device.type != "cuda" else
               None if isinstance(getattr(scorer, "inputs", None), dict) else
               f"the scorer ({type(scorer).__name__}) has no `inputs` to refresh in a captured graph")
        if why is not None:
            if self.eager_reason != why:
                self.eager_reason = why
                if index.device.type == "cuda":
                    warnings.warn(f"searching eagerly: {why}", stacklevel=2)
            return self._search(index, requests, scorer)
        with self._lock:
            if self._index is None or index.generation is not self._index.generation:
                self._graphs = {}  # other device arrays (another snapshot, or one loaded again): new graphs
            self._index = index
            B = requests.batch
            g = self._graphs.get(B)
            if g is None or not _fits(g, requests, scorer):
                g = self._graphs[B] = self._capture(index, requests, scorer)
            else:
                _load(g, requests, scorer)
                g.graph.replay()
            return Beams(g.out.tokens.clone(), g.out.score.clone(), g.out.leaf.clone())

    def _capture(self, index: ServedIndex, requests: EncodedRequests, scorer: Scorer) -> _Graph:
        static = _static_requests(requests)
        self._search(index, static, scorer)  # checks, compiles kernels
        side = torch.cuda.Stream(index.device)
        side.wait_stream(torch.cuda.current_stream(index.device))
        with torch.cuda.stream(side):  # the allocator's warm-up, outside the capture
            self._search(index, static, scorer)
        torch.cuda.current_stream(index.device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = self._search(index, static, scorer)
        graph.replay()
        return _Graph(graph, static, scorer, out)


def _static_requests(requests: EncodedRequests) -> EncodedRequests:
    """Buffers with room for twice each plane's query rows (at least 8 per request), holding
    `requests`, each plane's rows at a fixed offset of the stack."""
    capacity = tuple(max(2 * len(p.rows), 8 * requests.batch) for p in requests.planes)
    planes, stacked = stack_queries(requests.planes, requests.stacked.words.device, capacity)
    return dataclasses.replace(requests, planes=planes, stacked=stacked)


def _fits(g: _Graph, requests: EncodedRequests, scorer: Scorer) -> bool:
    """The batch's queries fit the buffers and the scorer is of the captured one's type with inputs
    of the same shapes (a graph replays the scorer it captured, with the batch's inputs)."""
    if type(scorer) is not type(g.scorer):
        return False
    if any(len(p.rows) > len(mine.rows) for p, mine in zip(requests.planes, g.requests.planes)):
        return False
    mine, theirs = g.scorer.inputs, scorer.inputs
    return mine.keys() == theirs.keys() and all(
        mine[k].shape == theirs[k].shape and mine[k].dtype == theirs[k].dtype for k in mine)


def _load(g: _Graph, requests: EncodedRequests, scorer: Scorer) -> None:
    """Copy a batch's queries and scorer inputs into the graph's buffers."""
    for mine, theirs in zip(g.requests.planes, requests.planes):
        mine.rows[:len(theirs.rows)].copy_(theirs.rows)
    g.requests.stacked.ranges.copy_(requests.stacked.ranges)  # the planes' ranges are views of it
    if scorer is not g.scorer:
        for k, t in scorer.inputs.items():
            g.scorer.inputs[k].copy_(t)
