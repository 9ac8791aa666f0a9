"""Retrieval end to end: requests -> constrained beam search -> eligible ads, in batches."""

from __future__ import annotations

import time
from dataclasses import dataclass, field, fields

import numpy as np
import pyarrow as pa
import torch

from runtime.loader import ServedIndex
from runtime.post import Retrieved, check_rank, check_top_k, expand
from runtime.requests import to_device
from runtime.scorer import CodebookScorer, ScorerFactory, load_factory
from runtime.search import DEFAULT_BEAMS, Scorer, check_value_weight, parse_beams
from runtime.serving import Searcher
from sidindex.errors import ArtifactError, InputError
from sidindex.ingest import Requests
from sidindex.modes import Mode, parse_mode
from sidindex.requests import EncodedRequests, encode_requests


@dataclass
class RetrievalRun:
    """The result rows (`Retrieved`, request rows of the whole table) and where the time went."""

    result: Retrieved
    seconds: dict[str, float] = field(default_factory=dict)

    def table(self, request_id: np.ndarray) -> pa.Table:
        """request_id, rank, ad_id, sid (list<int16> of L tokens), score, and value when the
        snapshot has ad values."""
        r = self.result
        L = r.sid.shape[1] if r.sid.ndim == 2 else 0
        sid = pa.FixedSizeListArray.from_arrays(pa.array(r.sid.reshape(-1).astype(np.int16)), L)
        value = {} if r.value is None else {"value": pa.array(r.value)}
        return pa.table({"request_id": pa.array(request_id[r.request]), "rank": pa.array(r.rank),
                         "ad_id": pa.array(r.ad_id), "sid": sid, "score": pa.array(r.score)} | value)


def codebook_scorer(index: ServedIndex, requests: EncodedRequests, temperature: float = 1.0):
    """rows -> the codebook scorer for requests[rows], from the codebook the index loaded with the
    snapshot (nothing is read from disk). requests: the encoding whose `embedding` to score, best
    on the index's device (`runtime.requests.to_device`)."""
    cb = index.codebook
    if cb is None:
        raise ArtifactError(f"{index.snapshot.path}: carries no codebook; the codebook scorer needs one "
                            "(serve a snapshot built with a codebook, or bring your own scorer)")
    if requests.embedding is None:
        raise InputError(f"{requests.source}: the codebook scorer needs an `embedding` column in the requests")
    if requests.embedding.shape[1] != cb.dim:
        raise InputError(f"{requests.source}: embedding has {requests.embedding.shape[1]} dimensions, the codebook "
                         f"{cb.dim}")
    emb = torch.as_tensor(requests.embedding, dtype=torch.float32, device=index.device)
    shared = CodebookScorer(cb, emb[:0], temperature)  # the centroids on the device, once

    def for_rows(rows: slice) -> Scorer:
        return shared.for_embedding(emb[rows])

    return for_rows


def factory_scorer(factory: str | ScorerFactory, index: ServedIndex, requests: Requests):
    """rows -> the scorer that the user's factory 'MODULE:FACTORY' (`runtime.scorer.load_factory`)
    makes for requests[rows], given those rows with every column of the request file as a
    pyarrow.Table, the index's device and level sizes. Errors name the factory (ScorerError)."""
    named = load_factory(factory) if isinstance(factory, str) else factory
    if requests.table is None:
        raise InputError(f"{requests.path}: a scorer factory needs the request file's rows (read them with "
                         "runtime.read_requests)")

    def for_rows(rows: slice) -> Scorer:
        batch = requests.table.slice(rows.start, rows.stop - rows.start).to_arrow()
        return named.for_batch(batch, index.device, index.level_sizes)

    return for_rows


def retrieve(index: ServedIndex, requests: Requests, *, mode: Mode | str = Mode.CD_GTM,
             beams: tuple[int, ...] | str = DEFAULT_BEAMS, top_k: int | None = None, batch_size: int = 16,
             scorer=None, impl: str = "auto", stages: bool = False, progress=None, value_weight: float = 0.0,
             rank: str = "score") -> RetrievalRun:
    """Ranked eligible ads for every request, `batch_size` requests per search.

    requests: validated against the index's spec (`runtime.read_requests`).
    scorer: rows (a slice of the request table) -> Scorer for those rows; default the codebook scorer
            (`factory_scorer` makes one from a user's 'MODULE:FACTORY')
    value_weight: λ of the value-guided search (`runtime.search`; 0: by log-probability alone)
    rank: how each request's ads are ranked (`runtime.post.RANKS`: score, value or fused)
    The searches run through one `runtime.Searcher`, whose capped widths grow as batches overflow
    them: the ads are the same whatever the widths, except where SIDs tie at a step's cut (equal
    logits), whose kept ones may depend on the widths a batch met.
    """
    mode = parse_mode(mode, kway_available=index.kway)
    beams = parse_beams(beams, index.sid_length)
    check_value_weight(index, mode, value_weight)
    check_rank(index, rank)
    check_top_k(top_k)  # before any search runs
    host = encode_requests(requests, index.spec)
    dev = to_device(host, index.device)
    scorer = scorer or codebook_scorer(index, dev)
    searcher = Searcher(beams, mode, impl, value_weight)  # CUDA graphs per batch size on a GPU
    parts, seconds = [], {"search": 0.0, "post": 0.0}
    n = len(requests)
    for lo in range(0, n, batch_size):
        hi = min(n, lo + batch_size)
        t = time.perf_counter()
        found = searcher.search(index, dev.slice(lo, hi), scorer(slice(lo, hi)))
        if index.device.type == "cuda":
            torch.cuda.synchronize(index.device)
        seconds["search"] += time.perf_counter() - t
        t = time.perf_counter()  # the device post stage ends with its copy to the host: no sync needed
        batch = (dev if index.post is not None else host).slice(lo, hi)  # the form its post stage reads
        parts.append((lo, expand(index, batch, found, top_k, stages, rank)))
        seconds["post"] += time.perf_counter() - t
        if progress:
            progress("retrieve", hi, n)
    return RetrievalRun(_concat(parts), seconds)


def _concat(parts: list[tuple[int, Retrieved]]) -> Retrieved:
    """Batches -> one result; request rows shifted to the whole table's."""
    out = {}
    for f in fields(Retrieved):
        vals = [getattr(p, f.name) for _, p in parts]
        if f.name == "request":
            vals = [v + lo for v, (lo, _) in zip(vals, parts)]
        if vals[0] is None:
            out[f.name] = None
        elif isinstance(vals[0], dict):  # per stage
            out[f.name] = {k: np.concatenate([v[k] for v in vals]) for k in vals[0]}
        else:
            out[f.name] = np.concatenate(vals)
    return Retrieved(**out)
