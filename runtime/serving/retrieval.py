"""Retrieval over a whole request table (`runtime.Retriever` in batches); the scorers the studies
built on it score with are `runtime.scorers` (`codebook_scorer`, `factory_scorer`)."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import pyarrow as pa

from runtime.index.served import ServedIndex
from runtime.result import Retrieved, table_of
from runtime.scorers.factory import ScorerFactory
from runtime.search.beam import DEFAULT_BEAMS
from runtime.serving.retriever import Retriever
from sidindex.modes import Mode
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


def retrieve(index: ServedIndex, requests: Requests, *, mode: Mode | str = Mode.CD_GTM,
             beams: tuple[int, ...] | str = DEFAULT_BEAMS, top_k: int | None = None, batch_size: int = 16,
             scorer: str | ScorerFactory | None = None, impl: str = "auto", stages: bool = False, progress=None,
             value_weight: float = 0.0, rank: str = "score") -> RetrievalRun:
    """Ranked eligible ads for every request of a table, `batch_size` requests per search, through
    a `runtime.Retriever` made for this table (not warmed: its first batch compiles and captures).

    requests: validated against the index's spec (`runtime.read_requests`, `runtime.requests_from`).
    scorer: None (the codebook scorer), or a user's factory ('MODULE:FACTORY', a factory function or a
            `ScorerFactory`)
    value_weight: λ of the value-guided search (`runtime.search.beam`; 0: by log-probability alone)
    rank: how each request's ads are ranked (`runtime.serving.post.RANKS`: score, value or fused)
    stages: with each request's ads passing each matcher plane (`Retrieved.ads_per_stage`)
    """
    retriever = Retriever(index, mode=mode, beams=beams, scorer=scorer, batch_sizes=(batch_size,),
                          value_weight=value_weight, rank=rank, top_k=top_k, impl=impl, warm=False)
    result, seconds = retriever.run(requests, stages=stages, progress=progress)
    return RetrievalRun(result, {k: seconds[k] for k in ("encode", "search_post")})
