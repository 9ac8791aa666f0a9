"""Requests for serving: validate a batch against an index (in memory or from a file), and move a
batch's encoding (`sidindex.request_encoding.EncodedRequests`) to the device the kernels run on in one
copy (docs/design.md §8)."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import numpy as np
import torch

from runtime.ops.gtm_mask.planes import most_queries, stack_queries, stacked_views
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
    base = requests.arena.__array_interface__["data"][0]

    def twin(a: np.ndarray) -> torch.Tensor:
        return _twin(a, base, flat)

    first = requests.planes[0].rows
    words_lo = _offset(first, base) // 8
    words_hi = words_lo + sum(q.rows.size for q in requests.planes)
    starts, at = [], words_lo
    for q in requests.planes:  # the encoder lays the planes' rows back to back
        assert q.rows.size == 0 or _offset(q.rows, base) // 8 == at and q.rows.flags.c_contiguous, \
            "planes' rows not back to back"
        starts.append(at - words_lo)
        at += q.rows.size
    r0 = requests.planes[0].ranges  # a view of the (B, G, 2) ranges of every group
    groups = sum(q.ranges.shape[1] for q in requests.planes)
    host_ranges = np.lib.stride_tricks.as_strided(r0, (r0.shape[0], groups, 2), r0.strides)
    ranges = torch.as_strided(flat, host_ranges.shape, [s // 8 for s in host_ranges.strides], _offset(r0, base) // 8)
    planes = tuple(dataclasses.replace(q, rows=twin(q.rows), ranges=twin(q.ranges), most=q.max_queries)
                   for q in requests.planes)
    planes, stacked = stacked_views(planes, flat[words_lo:words_hi], starts, [p.rows for p in planes], ranges,
                                    most_queries(host_ranges))
    exact = tuple(None if e is None else ExactQueries(twin(e.hash_offsets), twin(e.hashes)) for e in requests.exact)
    embedding = None if requests.embedding is None else twin(requests.embedding)
    return dataclasses.replace(requests, planes=planes, exact=exact, stacked=stacked, embedding=embedding, arena=None)


_TORCH = {np.dtype(np.int64): torch.int64, np.dtype(np.uint64): torch.int64, np.dtype(np.float32): torch.float32}


def _offset(a: np.ndarray, base: int) -> int:
    return a.__array_interface__["data"][0] - base


def _twin(a: np.ndarray, base: int, flat: torch.Tensor) -> torch.Tensor:
    """The view of `flat` (an int64 arena, or its copy) that `a` is of the host arena at address
    `base`: same dtype (uint64 as int64), shape and strides."""
    item = a.dtype.itemsize
    typed = flat if item == 8 else flat.view(_TORCH[a.dtype])
    if a.size == 0:  # an empty view may point anywhere
        return typed.new_empty(a.shape)
    return torch.as_strided(typed, a.shape, [s // item for s in a.strides], _offset(a, base) // item)


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
