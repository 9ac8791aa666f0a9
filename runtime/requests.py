"""Requests for serving: read a request file against an index, and move a batch's encoding
(`sidindex.requests.EncodedRequests`) to the device the kernels run on (DESIGN.md §8)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import torch

from runtime.loader import ServedIndex
from runtime.ops.gtm_mask.planes import stack_queries
from sidindex.ingest import Requests
from sidindex.ingest import read_requests as read_request_table
from sidindex.matchers.exact import ExactQueries
from sidindex.requests import EncodedRequests


def read_requests(path: str | Path, index: ServedIndex) -> Requests:
    """The request table at `path`, validated against the index's targeting spec."""
    return read_request_table(path, index.spec)


def to_device(requests: EncodedRequests, device: str | torch.device) -> EncodedRequests:
    """The same requests with the planes' query rows and ranges, and the exact filter's queries
    (`ExactQueries` of a `values` plane: hash offsets and hashes), as tensors on `device` (uint64
    bits as int64), the planes stacked for the Triton kernel (the planes' tensors view the stack).
    The host encoding is left as it was (the host post stage reads it)."""
    def host(a: np.ndarray) -> torch.Tensor:
        a = a.view(np.int64) if a.dtype == np.uint64 else a
        return torch.from_numpy(np.array(a, order="C"))  # a copy: the source may be read-only

    planes = tuple(dataclasses.replace(q, rows=host(q.rows), ranges=host(q.ranges), most=q.max_queries)
                   for q in requests.planes)
    planes, stacked = stack_queries(planes, device)
    exact = tuple(None if e is None else ExactQueries(host(e.hash_offsets).to(device), host(e.hashes).to(device))
                  for e in requests.exact)
    return dataclasses.replace(requests, planes=planes, exact=exact, stacked=stacked)
