"""Retrieval over a whole request table (`runtime.Retriever` in batches), and the scorers the
studies built on it score with."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import pyarrow as pa
import torch

from runtime.result import Retrieved, table_of
from runtime.retriever import Retriever
from runtime.scorer import CodebookScorer, ScorerFactory, as_factory, embedding_of
from runtime.search import DEFAULT_BEAMS, Scorer
from runtime.served import ServedIndex, codebook_of
from sidindex.errors import InputError
from sidindex.modes import Mode
from sidindex.request_encoding import EncodedRequests
from sidindex.requests import Requests


@dataclass
class RetrievalRun:
    """The result rows (`Retrieved`, request rows of the whole table) and where the time went:
    seconds per stage of `runtime.Retriever` (encode, search_post)."""

    result: Retrieved
    seconds: dict[str, float] = field(default_factory=dict)

    def table(self, request_id: np.ndarray) -> pa.Table:
        """`runtime.result.table_of` the result, for the requests' ids (B,) int64."""
        return table_of(self.result, request_id)


def codebook_scorer(index: ServedIndex, requests: EncodedRequests, temperature: float = 1.0):
    """rows -> the codebook scorer for requests[rows], from the codebook the index loaded with the
    snapshot (nothing is read from disk). requests: the encoding whose `embedding` to score, best
    on the index's device (`runtime.requests.to_device`)."""
    cb = codebook_of(index)
    given = embedding_of(requests)
    if given.shape[1] != cb.dim:
        raise InputError(f"{requests.source}: embedding has {given.shape[1]} dimensions, the codebook {cb.dim}")
    emb = torch.as_tensor(given, dtype=torch.float32, device=index.device)
    shared = CodebookScorer(cb, emb[:0], temperature)  # the centroids on the device, once

    def for_rows(rows: slice) -> Scorer:
        return shared.for_embedding(emb[rows])

    return for_rows


def factory_scorer(factory: str | ScorerFactory, index: ServedIndex, requests: Requests):
    """rows -> the scorer that the user's factory 'MODULE:FACTORY' (`runtime.scorer.load_factory`)
    makes for requests[rows], given those rows with every column of the request file as a
    pyarrow.Table, the index's device and level sizes. Errors name the factory (ScorerError)."""
    named = as_factory(factory)
    assert named is not None  # a factory given (None is the codebook scorer's)

    def for_rows(rows: slice) -> Scorer:
        batch = requests.table.slice(rows.start, rows.stop - rows.start)
        return named.for_batch(batch, index.device, index.level_sizes)

    return for_rows


def retrieve(index: ServedIndex, requests: Requests, *, mode: Mode | str = Mode.CD_GTM,
             beams: tuple[int, ...] | str = DEFAULT_BEAMS, top_k: int | None = None, batch_size: int = 16,
             scorer: str | ScorerFactory | None = None, impl: str = "auto", stages: bool = False, progress=None,
             value_weight: float = 0.0, rank: str = "score") -> RetrievalRun:
    """Ranked eligible ads for every request of a table, `batch_size` requests per search, through
    a `runtime.Retriever` made for this table (not warmed: its first batch compiles and captures).

    requests: validated against the index's spec (`runtime.read_requests`, `runtime.requests_from`).
    scorer: None (the codebook scorer), or a user's factory ('MODULE:FACTORY', a factory function or a
            `ScorerFactory`)
    value_weight: λ of the value-guided search (`runtime.search`; 0: by log-probability alone)
    rank: how each request's ads are ranked (`runtime.post.RANKS`: score, value or fused)
    stages: with each request's ads passing each matcher plane (`Retrieved.ads_per_stage`)
    """
    retriever = Retriever(index, mode=mode, beams=beams, scorer=scorer, batch_sizes=(batch_size,),
                          value_weight=value_weight, rank=rank, top_k=top_k, impl=impl, warm=False)
    result, seconds = retriever.run(requests, stages=stages, progress=progress)
    return RetrievalRun(result, {k: seconds[k] for k in ("encode", "search_post")})
