"""The serving runtime (torch; Triton on CUDA): load snapshots onto a device, constrained beam search,
SID -> ad expansion (docs/design.md §8, §12).

A serving host needs only this namespace:

    import runtime
    index = runtime.load(ROOT_OR_SNAPSHOT, "cuda")      # or runtime.SnapshotWatcher(ROOT, "cuda")
    retriever = runtime.Retriever(index, mode="cd+gtm", beams=(1, 512, 1024, 1024), batch_sizes=(1, 16))
    table = retriever.retrieve(arrow_batch)      # or a polars frame, or a list of dicts

Modules:
    served      ServedIndex: a snapshot's arrays on one device, and the post stage's bounds
    staging     pinned host staging of a snapshot's arrays on their way to a device
    loader      snapshot -> ServedIndex on a device, built complete in one go
    watcher     SnapshotWatcher: swaps to newly published snapshots, warmed first
    requests    requests in memory or from a file, validated; a batch's encoding onto the device in one copy
    retriever   Retriever: the serving object (validate, encode, search and post in one graph, Arrow out)
    ops/        the kernels beside their references: the fused CD+GTM mask, the exact filter, the post
                stage (expand); impl, the one choice of implementation
    constraint  Constraint: one batch's trie walk and mask per step, for the search and the HF processor
    search      beam search in every Mode (`sidindex.modes`); the Scorer protocol
    serving     Searcher: the search captured as CUDA graphs per batch size, replayed
    sharded     one catalog over several devices: shards in groups, the search merged per step
    scorer      the built-in codebook scorer; users' scorers named MODULE:FACTORY
    decoder     a reference transformer decoder with a KV cache: the worked example of a model
    hf          SidLogitsProcessor: the same mask inside Hugging Face `generate` (extra `sidindex[hf]`)
    post        SIDs -> ads, best score per ad, exact filter, ranking
    result      Retrieved, the ranked rows; their Arrow table, cut per request and concatenation
    retrieval   retrieve(): a whole request table through a Retriever; the scorers of the studies
    simulate    pass rates and recall per mode (`sidindex simulate`)
    server      `sidindex serve`'s HTTP front: limits, answers, health, a clean stop (extra `sidindex[serve]`)
    engine      the server's engine: the Retriever, its fair batcher (batcher), the poller, metrics
    engine_api  the engine as the HTTP front sees it; link: front-end processes <-> engine (ZeroMQ)
    frontend    `serve --workers N`: N front-end processes over one engine process
    flight      an Arrow Flight endpoint (do_exchange) over a Retriever, for callers that batch

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
    "load": "runtime.loader", "load_index": "runtime.loader",
    "read_requests": "runtime.requests", "requests_from": "runtime.requests", "to_device": "runtime.requests",
    "RetrievalRun": "runtime.retrieval", "codebook_scorer": "runtime.retrieval", "factory_scorer": "runtime.retrieval",
    "retrieve": "runtime.retrieval",
    "Retriever": "runtime.retriever",
    "CodebookScorer": "runtime.scorer",
    "Beams": "runtime.search", "Scorer": "runtime.search", "beam_search": "runtime.search",
    "parse_beams": "runtime.search",
    "ServedIndex": "runtime.served",
    "Searcher": "runtime.serving",
    "ShardedBeams": "runtime.sharded", "load_sharded": "runtime.sharded", "sharded_beam_search": "runtime.sharded",
    "SnapshotWatcher": "runtime.watcher",
    "Mode": "sidindex.modes", "parse_mode": "sidindex.modes",
    "EncodedRequests": "sidindex.request_encoding", "encode_requests": "sidindex.request_encoding",
}

if TYPE_CHECKING:
    from runtime.loader import load, load_index
    from runtime.requests import read_requests, requests_from, to_device
    from runtime.retrieval import RetrievalRun, codebook_scorer, factory_scorer, retrieve
    from runtime.retriever import Retriever
    from runtime.scorer import CodebookScorer
    from runtime.search import Beams, Scorer, beam_search, parse_beams
    from runtime.served import ServedIndex
    from runtime.serving import Searcher
    from runtime.sharded import ShardedBeams, load_sharded, sharded_beam_search
    from runtime.watcher import SnapshotWatcher
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
    if home is None:  # a submodule (runtime.server) or a name that does not exist
        raise AttributeError(f"module 'runtime' has no attribute {name!r}")
    value = getattr(importlib.import_module(home), name)
    globals()[name] = value  # once: later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
