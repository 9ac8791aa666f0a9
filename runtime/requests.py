"""A batch of requests encoded onto the device for the matchers (DESIGN.md §4, §8)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from sidindex.ingest import Requests
from sidindex.targeting import TargetingSpec
from sidindex.trie.match import encode_gtm_requests


@dataclass(frozen=True)
class DeviceRequests:
    """user_rows: (B, W_bm) int64 (the uint64 bits); query_rows: (Q, W_bl) int64 Bloom query rows;
    query_ranges: (B, A_bl, 2) int64 [start, end) of request b's queries for bloom attribute a
    (never empty: a request without values has one all-ones query); embedding: (B, D) float32 or None."""

    user_rows: torch.Tensor
    query_rows: torch.Tensor
    query_ranges: torch.Tensor
    embedding: torch.Tensor | None
    max_queries: int  # the most queries any request has for one attribute (known on the host)

    @property
    def batch(self) -> int:
        return self.user_rows.shape[0]

    def slice(self, lo: int, hi: int) -> DeviceRequests:
        """Requests lo..hi-1 (query rows stay shared; ranges index into them)."""
        return DeviceRequests(self.user_rows[lo:hi], self.query_rows, self.query_ranges[lo:hi],
                              None if self.embedding is None else self.embedding[lo:hi], self.max_queries)


def encode_requests(spec: TargetingSpec, requests: Requests, device: str | torch.device = "cpu") -> DeviceRequests:
    """Encode a validated request table (`sidindex.ingest.read_requests`) onto `device`."""
    enc = encode_gtm_requests(spec, requests.columns)

    def put(a: np.ndarray) -> torch.Tensor:
        a = a.view(np.int64) if a.dtype == np.uint64 else a
        return torch.from_numpy(np.array(a, order="C")).to(device)  # a copy: the source may be read-only

    emb = None if requests.embedding is None else put(np.asarray(requests.embedding, dtype=np.float32))
    n_q = enc.query_ranges[..., 1] - enc.query_ranges[..., 0]
    return DeviceRequests(put(enc.user_rows), put(enc.query_rows), put(enc.query_ranges.astype(np.int64)), emb,
                          int(n_q.max()) if n_q.size else 0)
