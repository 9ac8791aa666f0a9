"""The serving runtime (torch; Triton on CUDA): load snapshots onto a device, constrained beam search,
SID -> ad expansion (docs/design.md §8, §17).

A serving host needs only this namespace:

    import runtime
    index = runtime.load(ROOT_OR_SNAPSHOT, "cuda")      # or runtime.SnapshotWatcher(ROOT, "cuda")
    retriever = runtime.Retriever(index, mode="cd+gtm", beams=(1, 512, 1024, 1024), batch_sizes=(1, 16))
    table = retriever.retrieve(arrow_batch)      # or a polars frame, or a list of dicts

Rooms, lowest first (each imports only rooms listed before it):
    ops/        one folder per op, its kernel beside its torch reference and numba path: the fused
                CD+GTM mask and its planes, preparation and slots; the exact filter; the post
                stage's expand; the codebook scorer's; the distribution; the order
    index/      an index on a device: served (ServedIndex), staging, loader, watcher
    result      the rows out: Retrieved, its Arrow table, its cut per request and concatenation
    requests    the batch in: validated requests, their encoding onto the device in one copy
    scorers/    the codebook scorer; users' factories named MODULE:FACTORY
    search/     beam (the search in every mode, the decoder seam), constraint, sharded, hf
    serving/    post (SIDs -> ranked eligible ads), searcher (CUDA graphs), retriever, retrieval
    server/     `sidindex serve`: http, engine, batcher, frontend, link, flight, metrics
    studies/    simulate (pass rates and recall per mode), decoder (a reference model)

Layering (docs/design.md §2): `runtime` reads artifacts only through `sidindex`'s readers and never
re-implements their formats; the `sidindex` library never imports `runtime` (only the CLI's
serving commands do, when they run). Triton is imported only when a kernel first runs on CUDA.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

# public name -> the module that holds it, imported on first use: `import runtime` stays cheap, and a
# process that needs one module (an HTTP front-end: no torch) loads only that one's imports
_HOME = {
    "load": "runtime.index.loader", "load_index": "runtime.index.loader",
    "read_requests": "runtime.requests", "requests_from": "runtime.requests", "to_device": "runtime.requests",
    "RetrievalRun": "runtime.serving.retrieval", "retrieve": "runtime.serving.retrieval",
    "codebook_scorer": "runtime.scorers.codebook", "factory_scorer": "runtime.scorers.factory",
    "Retriever": "runtime.serving.retriever",
    "CodebookScorer": "runtime.scorers.codebook",
    "Beams": "runtime.search.beam", "Scorer": "runtime.search.beam", "beam_search": "runtime.search.beam",
    "parse_beams": "runtime.search.beam",
    "ServedIndex": "runtime.index.served",
    "Searcher": "runtime.serving.searcher",
    "ShardedBeams": "runtime.search.sharded", "load_sharded": "runtime.search.sharded",
    "sharded_beam_search": "runtime.search.sharded",
    "SnapshotWatcher": "runtime.index.watcher",
    "Mode": "sidindex.modes", "parse_mode": "sidindex.modes",
    "EncodedRequests": "sidindex.request_encoding", "encode_requests": "sidindex.request_encoding",
}

if TYPE_CHECKING:
    from runtime.index.loader import load, load_index
    from runtime.index.served import ServedIndex
    from runtime.index.watcher import SnapshotWatcher
    from runtime.requests import read_requests, requests_from, to_device
    from runtime.scorers.codebook import CodebookScorer, codebook_scorer
    from runtime.scorers.factory import factory_scorer
    from runtime.search.beam import Beams, Scorer, beam_search, parse_beams
    from runtime.search.sharded import ShardedBeams, load_sharded, sharded_beam_search
    from runtime.serving.retrieval import RetrievalRun, retrieve
    from runtime.serving.retriever import Retriever
    from runtime.serving.searcher import Searcher
    from sidindex.modes import Mode, parse_mode
    from sidindex.request_encoding import EncodedRequests, encode_requests


__all__ = [
    "Beams",
    "CodebookScorer",
    "EncodedRequests",
    "Mode",
    "RetrievalRun",
    "Retriever",
    "Scorer",
    "Searcher",
    "ServedIndex",
    "ShardedBeams",
    "SnapshotWatcher",
    "beam_search",
    "codebook_scorer",
    "factory_scorer",
    "encode_requests",
    "load",
    "load_index",
    "load_sharded",
    "parse_beams",
    "parse_mode",
    "read_requests",
    "requests_from",
    "retrieve",
    "sharded_beam_search",
    "to_device",
]


def __getattr__(name: str):
    home = _HOME.get(name)
    if home is None:  # a submodule (runtime.server.http) or a name that does not exist
        raise AttributeError(f"module 'runtime' has no attribute {name!r}")
    value = getattr(importlib.import_module(home), name)
    globals()[name] = value  # once: later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
