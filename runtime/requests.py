"""Requests for serving: validate a batch against an index (in memory or from a file), and move a
batch's encoding (`sidindex.request_encoding.EncodedRequests`) to the device the kernels run on in one
copy (docs/design.md §8)."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import numpy as np
import torch

from runtime.ops.gtm_mask.planes import QueryStack, group_layout, most_queries, plane_ranges, stack_base, stack_queries
from runtime.served import ServedIndex
from sidindex.matchers.exact import ExactQueries
from sidindex.request_encoding import EncodedRequests
from sidindex.requests import Requests
from sidindex.requests import read_requests as read_request_file
from sidindex.requests import requests_from as validated


def requests_from(data: Any, index: ServedIndex, *, source: str = "requests") -> Requests:
    """A request batch held in memory (a pyarrow Table or RecordBatch, a polars DataFrame, or a
    list of dicts), validated against the index's targeting spec and codebook with the rules and
    messages of a request file (`sidindex.requests.requests_from`); `source` names it in them."""
    return validated(data, index.spec, source=source, dim=_dim(index))


def read_requests(path: str | Path, index: ServedIndex) -> Requests:
    """The request file at `path` (Parquet or Arrow IPC), validated as `requests_from` does."""
    return read_request_file(path, index.spec, dim=_dim(index))


def _dim(index: ServedIndex) -> int | None:
    cb = index.codebook
    return None if cb is None else cb.dim


def to_device(requests: EncodedRequests, device: str | torch.device) -> EncodedRequests:
    """The same requests with the planes' query rows and ranges, the exact filter's queries
    (`ExactQueries` of a `values` plane: hash offsets and hashes) and the embedding as tensors on
    `device` (uint64 bits as int64), the planes stacked for the Triton kernel (the planes' tensors
    view the stack). An encoding in one arena (`sidindex.request_encoding.encode_requests`) moves in one
    copy, asynchronous from pinned memory, and every tensor is a view of that copy; on the CPU the
    tensors view the arena itself. The host encoding is left as it was (the host post stage reads
    it)."""
    device = torch.device(device)
    if requests.arena is None:
        return _copied(requests, device)
    arena = torch.from_numpy(requests.arena)
    flat = arena if device.type == "cpu" else arena.to(device, non_blocking=arena.is_pinned())
    base = arena.data_ptr()

    def twin(t: torch.Tensor) -> torch.Tensor:  # views of one storage (the Triton interpreter keys on it)
        return _same_place(t, flat, base)

    # the encoder lays the planes' rows back to back: the stack's words
    rows = [_host(q.rows) for q in requests.planes]
    lo = at = (rows[0].data_ptr() - base) // 8
    starts = []
    for t in rows:
        assert t.numel() == 0 or (t.data_ptr() - base) // 8 == at and t.is_contiguous(), "planes' rows not back to back"
        starts.append(at - lo)
        at += t.numel()
    # the planes' ranges view one (B, G, 2) array of every group's: read on the host
    r0 = requests.planes[0].ranges
    shape = (r0.shape[0], sum(q.ranges.shape[1] for q in requests.planes), 2)
    offset = _host(r0).data_ptr() - base
    most = most_queries(np.ndarray(shape, np.int64, requests.arena, offset, r0.strides))
    ranges = torch.as_strided(flat, shape, [s // 8 for s in r0.strides], offset // 8)
    planes, g = [], 0
    for q, v, r in zip(requests.planes, rows, plane_ranges(ranges, requests.planes)):
        k = q.ranges.shape[1]
        planes.append(dataclasses.replace(q, rows=twin(v), ranges=r, most=max(most[g:g + k], default=0)))
        g += k
    stacked = QueryStack(flat.narrow(0, lo, at - lo), stack_base(starts, device), ranges,
                         group_layout(requests.planes, most))
    exact = tuple(None if e is None else ExactQueries(twin(_host(e.hash_offsets)), twin(_host(e.hashes)))
                  for e in requests.exact)
    embedding = None if requests.embedding is None else twin(_host(requests.embedding))
    return EncodedRequests(requests.source, tuple(planes), exact, embedding, stacked)


def _host(a: np.ndarray) -> torch.Tensor:
    """a as a tensor of its memory (uint64 bits as int64): its shape, strides and address."""
    return torch.from_numpy(a.view(np.int64) if a.dtype == np.uint64 else a)


def _same_place(t: torch.Tensor, flat: torch.Tensor, base: int) -> torch.Tensor:
    """The view of `flat` (the host arena at address `base`, or its copy) that `t` is of the
    arena: same dtype, shape and strides."""
    if not t.numel():  # an empty view may point anywhere
        return flat.new_empty(t.shape, dtype=t.dtype)
    typed = flat if t.dtype == flat.dtype else flat.view(t.dtype)
    return torch.as_strided(typed, t.shape, t.stride(), (t.data_ptr() - base) // t.element_size())


def _copied(requests: EncodedRequests, device: torch.device) -> EncodedRequests:
    """`to_device` of an encoding put together array by array: each array copied on its own."""
    def host(a: np.ndarray) -> torch.Tensor:
        a = a.view(np.int64) if a.dtype == np.uint64 else a
        return torch.from_numpy(np.array(a, order="C"))  # a copy: the source may be read-only

    planes = tuple(dataclasses.replace(q, rows=host(q.rows), ranges=host(q.ranges), most=q.max_queries)
                   for q in requests.planes)
    planes, stacked = stack_queries(planes, device)
    exact = tuple(None if e is None else ExactQueries(host(e.hash_offsets).to(device), host(e.hashes).to(device))
                  for e in requests.exact)
    embedding = None if requests.embedding is None else torch.as_tensor(requests.embedding, device=device)
    return dataclasses.replace(requests, planes=planes, exact=exact, stacked=stacked, embedding=embedding)
