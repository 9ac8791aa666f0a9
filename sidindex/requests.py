"""A batch of requests encoded once for everything that tests them (DESIGN.md §4): the trie
matchers (CPU matcher, mask kernels) and the exact ad-level filter.

Legend: B requests, W_bm bitmask words, W_bl Bloom words, A bloom attributes, Q query rows, T hashes.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import ClassVar

import numpy as np

from sidindex.ingest import Requests
from sidindex.matchers.bitmask import encode_request_rows
from sidindex.matchers.bloom import encode_request_queries
from sidindex.matchers.exact import hash_lists
from sidindex.targeting import TargetingSpec


@dataclass(frozen=True)
class EncodedRequests:
    """B requests, encoded against one targeting spec.

    source:       the request table they came from (named in messages)
    user_rows:    (B, W_bm) uint64 bitmask user rows, one bit per bitmask attribute (§4)
    query_rows:   (Q, W_bl) uint64 Bloom query rows, shared by the batch (query_ranges index them)
    query_ranges: (B, A, 2) int64 [start, end) of request b's queries for bloom attribute a; never
                  empty (a request without values has one all-ones query)
    word_offsets: (A+1,) int32 first word of each bloom attribute in a Bloom row
    max_queries:  the most queries any request has for one attribute
    hash_offsets: (A, B+1) int64 into hashes; hashes: (T,) uint64 each request's exact value
                  hashes per bloom attribute, sorted (the exact filter's)
    embedding:    (B, D) float32, or None when the table has no embedding column

    On a device (`runtime.requests.to_device`) the arrays kernels read are torch tensors (uint64
    bits as int64); the `host_only` fields stay numpy arrays on the host.
    """

    source: str
    user_rows: np.ndarray
    query_rows: np.ndarray
    query_ranges: np.ndarray
    word_offsets: np.ndarray
    max_queries: int
    hash_offsets: np.ndarray
    hashes: np.ndarray
    embedding: np.ndarray | None

    host_only: ClassVar[tuple[str, ...]] = ("hash_offsets", "hashes")  # read by the exact filter on the host

    @property
    def batch(self) -> int:
        return self.user_rows.shape[0]

    def slice(self, lo: int, hi: int) -> EncodedRequests:
        """Requests lo..hi-1 (query rows and hashes stay shared; ranges and offsets index them)."""
        return replace(self, user_rows=self.user_rows[lo:hi], query_ranges=self.query_ranges[lo:hi],
                       hash_offsets=self.hash_offsets[:, lo:hi + 1],
                       embedding=None if self.embedding is None else self.embedding[lo:hi])


def encode_requests(requests: Requests, spec: TargetingSpec) -> EncodedRequests:
    """Encode a validated request table (`sidindex.ingest.read_requests` against `spec`)."""
    cols = requests.columns
    q = encode_request_queries(spec.bloom_layout, cols)
    n_q = q.ranges[..., 1] - q.ranges[..., 0]
    offsets, hashes = hash_lists(cols, spec.bloom_layout.names)
    return EncodedRequests(requests.path, encode_request_rows(spec.bitmask_layout, cols), q.rows,
                           q.ranges.astype(np.int64, copy=False),
                           np.asarray(spec.bloom_layout.word_offsets, dtype=np.int32),
                           int(n_q.max()) if n_q.size else 0, offsets, hashes, requests.embedding)
