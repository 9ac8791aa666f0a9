"""A batch of requests encoded once for everything that tests them (DESIGN.md §4): the trie
matchers (CPU matcher, mask kernels) and the exact ad-level filter.

Legend: B requests.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from sidindex.ingest import Requests
from sidindex.matchers.exact import ExactQueries, encode_exact_queries
from sidindex.matchers.kinds import KINDS
from sidindex.matchers.plane import PlaneQueries
from sidindex.targeting import TargetingSpec


@dataclass(frozen=True)
class EncodedRequests:
    """B requests, encoded against one targeting spec.

    source:       the request table they came from (named in messages)
    planes:       the batch's queries against each matcher plane, in plane order (`PlaneQueries`)
    exact:        per plane, the batch's values for the exact ad-level filter (None for a plane
                  whose exact test reads its queries); host arrays, or tensors on the device in the
                  device form
    embedding:    (B, D) float32, or None when the table has no embedding column
    stacked:      None on the host; on a device (`runtime.requests.to_device`, where the planes'
                  rows and ranges are tensors) the planes stacked as the Triton kernel reads them
    """

    source: str
    planes: tuple[PlaneQueries, ...]
    exact: tuple[ExactQueries | None, ...]
    embedding: np.ndarray | None
    stacked: Any = None

    @property
    def batch(self) -> int:
        return self.planes[0].ranges.shape[0]

    def slice(self, lo: int, hi: int) -> EncodedRequests:
        """Requests lo..hi-1 (query rows and hashes stay shared; ranges and offsets index them)."""
        return replace(self, planes=tuple(p.slice(lo, hi) for p in self.planes), exact=tuple(e and e.slice(lo, hi) for e in self.exact),
                       stacked=None if self.stacked is None else self.stacked.slice(lo, hi),
                       embedding=None if self.embedding is None else self.embedding[lo:hi])


def encode_requests(requests: Requests, spec: TargetingSpec) -> EncodedRequests:
    """Encode a validated request table (`sidindex.ingest.read_requests` against `spec`)."""
    cols = requests.columns
    planes = tuple(k.encode_requests(layout, cols) for k, layout in zip(KINDS, spec.layouts))
    return EncodedRequests(requests.path, planes, encode_exact_queries(spec, cols), requests.embedding)
