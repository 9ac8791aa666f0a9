"""Requests for serving: validate a batch against an index (in memory or from a file), move a
batch's encoding (`sidindex.request_encoding.EncodedRequests`) to the device the kernels run on in one
copy, or stage it at the fixed places a captured search reads (`Staged`) (docs/design.md §8)."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import numpy as np
import torch

from runtime.index.loader import resolved_device
from runtime.index.served import ServedIndex
from runtime.ops.planes import (
    QueryStack,
    group_layout,
    most_queries,
    plane_ranges,
    stack_base,
    stack_queries,
)
from sidindex.exact import ExactQueries
from sidindex.request_encoding import EncodedRequests
from sidindex.requests import MAX_REQUEST_VALUES, Requests
from sidindex.requests import read_requests as read_request_file
from sidindex.requests import requests_from as validated
from sidindex.targeting import TargetingSpec


def requests_from(data: Any, index: ServedIndex, *, source: str = "requests") -> Requests:
    """A request batch held in memory (a pyarrow Table or RecordBatch, a polars DataFrame, or a
    list of dicts), validated against the index's targeting spec and codebook with the rules and
    messages of a request file (`sidindex.requests.requests_from`); `source` names it in them."""
    return validated(data, index.spec, source=source, dim=embedding_dim(index))


def read_requests(path: str | Path, index: ServedIndex) -> Requests:
    """The request file at `path` (Parquet or Arrow IPC), validated as `requests_from` does."""
    return read_request_file(path, index.spec, dim=embedding_dim(index))


def embedding_dim(index: ServedIndex) -> int | None:
    """The embedding width requests for `index` must have (its codebook's), or None without one."""
    cb = index.codebook
    return None if cb is None else cb.dim


Validated = tuple[TargetingSpec, int | None]  # what a batch is validated for: a spec and an embedding width


def validated_for(index: ServedIndex) -> Validated:
    """What requests validated for `index` were checked against: its targeting spec and its
    codebook's embedding width (None: no codebook). A batch validated for another is validated
    again before it runs on `index` (a swap between its arrival and its batch)."""
    return index.spec, embedding_dim(index)


def to_device(requests: EncodedRequests, device: str | torch.device) -> EncodedRequests:
    """The same requests with the planes' query rows and ranges, the exact filter's queries
    (`ExactQueries` of a `values` plane: hash offsets and hashes) and the embedding as tensors on
    `device` (uint64 bits as int64), the planes stacked for the Triton kernel (the planes' tensors
    view the stack). An encoding in one arena (`sidindex.request_encoding.encode_requests`) moves in one
    copy, asynchronous from pinned memory, and every tensor is a view of that copy; on the CPU the
    tensors view the arena itself. The host encoding is left as it was, and the device form keeps
    it (`host_form`: the host post stage reads it): encoded into a reused arena, it holds another
    batch once the arena is written again, so a device form is used before that, as the arena's
    own views are."""
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
    return EncodedRequests(requests.source, tuple(planes), exact, embedding, stacked, host=requests)


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
    return dataclasses.replace(requests, planes=planes, exact=exact, stacked=stacked, embedding=embedding,
                               host=requests)


def device_form(requests: EncodedRequests, device: str | torch.device) -> EncodedRequests:
    """requests on `device` as the kernels read them: itself when it is already there, else
    `to_device` of its host form (a device form on another device moves from the encoding it was
    moved from; one without it is returned as it is). The one place a batch moves."""
    if requests.stacked is not None:
        if requests.host is None or requests.stacked.words.device == resolved_device(torch.device(device)):
            return requests
        requests = requests.host
    return to_device(requests, device)


def host_form(requests: EncodedRequests) -> EncodedRequests | None:
    """requests as the host post stage reads them: itself on the host, the encoding a device form
    was moved from, or None for a device form made otherwise (a staging's fixed views)."""
    return requests if requests.stacked is None else requests.host


def _words(a) -> int:
    """int64 words an array (numpy or torch) of 4- or 8-byte items takes, rounded up."""
    return -(-a.numel() * a.element_size() // 8) if isinstance(a, torch.Tensor) else -(-a.nbytes // 8)


class Staged:
    """A batch's inputs at fixed places with room, as a captured search reads them: one int64
    buffer in pinned host memory and its twin on the device, and the device views of the twin (an
    `EncodedRequests`), made once. A batch goes in by `put`: its host arrays copied into the pinned
    buffer on the host, one asynchronous copy of the buffer to its twin queued before the search
    that reads it (then, for a batch that came on the device, its tensors copied into their places
    there): the views a search reads are not made again, and nothing waits.

    Laid out like `sidindex.request_encoding.encode_requests`' arena, each part with room: the planes'
    query rows back to back (the stack's words; plane p with room for rows[p] rows), the groups'
    ranges (B, G, 2), per `values` plane its exact hash offsets (A, B+1) and hashes (room for
    hashes[p]), the embedding (B, D) float32. Row numbers and hash offsets count from their part, so
    a batch's values go in as they are.

    like:   a batch (host or device form) giving the shapes
    rows:   per plane, the query rows it holds; hashes: per plane, the exact hashes (None for a plane
            without exact queries)
    most:   per plane, the most queries a request may have for one of its groups (default like's,
            `PlaneQueries.max_queries`): the staged requests' bound, and their query layout (which
            groups are tabled, `group_layout`) is the one of requests that many queries long, which
            serves any batch within it (a batch that would not table a group searches as well with
            its table); batches must not pass it (`fits`)
    """

    def __init__(self, like: EncodedRequests, rows: tuple[int, ...], hashes: tuple[int | None, ...],
                 device: torch.device, most: tuple[int, ...] | None = None) -> None:
        B = like.batch
        parts: list[tuple[str, int]] = []  # (name, words), in buffer order
        widths = [int(q.rows.shape[1]) for q in like.planes]
        parts += [(f"rows{p}", r * w) for p, (r, w) in enumerate(zip(rows, widths))]
        G = sum(q.ranges.shape[1] for q in like.planes)
        parts.append(("ranges", B * G * 2))
        for p, (e, h) in enumerate(zip(like.exact, hashes)):
            if e is not None:
                parts += [(f"offsets{p}", _words(e.hash_offsets)), (f"hashes{p}", h or 0)]
        D = 0 if like.embedding is None else int(like.embedding.shape[1])
        parts.append(("embedding", -(-B * D // 2)))
        at, self._at = 0, {}
        for name, n in parts:
            self._at[name] = (at, at + n)
            at += n
        self.host = torch.zeros(max(at, 1), dtype=torch.int64, pin_memory=device.type == "cuda")
        self.device = self.host if device.type == "cpu" else torch.zeros_like(self.host, device=device)
        self.most = tuple(q.max_queries for q in like.planes) if most is None else most
        self.layout = group_layout(like.planes, [m for q, m in zip(like.planes, self.most)
                                                 for _ in range(q.ranges.shape[1])])
        self._rows, self._hashes, self._shapes = rows, hashes, _shapes(like)

        def part(buf: torch.Tensor, name: str) -> torch.Tensor:
            lo, hi = self._at[name]
            return buf[lo:hi]

        def views(buf: torch.Tensor):
            ranges = part(buf, "ranges").view(B, G, 2)
            planes = tuple(dataclasses.replace(q, rows=part(buf, f"rows{p}").view(rows[p], widths[p]), ranges=r,
                                               most=m)
                           for p, (q, r, m) in enumerate(zip(like.planes, plane_ranges(ranges, like.planes),
                                                             self.most)))
            exact = tuple(None if e is None else
                          ExactQueries(part(buf, f"offsets{p}").view(e.hash_offsets.shape), part(buf, f"hashes{p}"))
                          for p, e in enumerate(like.exact))
            embedding = None if like.embedding is None else \
                part(buf, "embedding").view(torch.float32)[:B * D].view(B, D)
            return ranges, planes, exact, embedding

        ranges, planes, exact, embedding = views(self.device)
        # where `put` puts a batch's parts (`_parts`' order): in the pinned buffer, as a tensor and
        # as a numpy array, and in the device twin
        staging = _parts(EncodedRequests(like.source, *views(self.host)[1:]))
        self._rooms = [(t, t.numpy(), d) for t, d in zip(staging, _parts(EncodedRequests(like.source, planes, exact,
                                                                                         embedding)))]
        starts = [self._at[f"rows{p}"][0] for p in range(len(planes))]
        stacked = QueryStack(self.device[:self._at[f"rows{len(planes) - 1}"][1]], stack_base(starts, device), ranges,
                             self.layout)
        # what the captured search reads: views of the device twin, with room
        self.requests = EncodedRequests(like.source, planes, exact, embedding, stacked)

    @classmethod
    def room_for(cls, requests: EncodedRequests, device: torch.device) -> Staged:
        """Staging for batches like `requests`, with room for twice its query rows per plane (at
        least 8 per request) and twice its exact hashes (at least 64), and for as many values per
        attribute as a request may have (`sidindex.requests.MAX_REQUEST_VALUES`, or more where
        `requests` has more)."""
        rows = tuple(max(2 * len(q.rows), 8 * requests.batch) for q in requests.planes)
        hashes = tuple(None if e is None else max(2 * len(e.hashes), 64) for e in requests.exact)
        most = tuple(q.max_queries if q.single else max(q.max_queries, MAX_REQUEST_VALUES) for q in requests.planes)
        return cls(requests, rows, hashes, torch.device(device), most)

    def another(self) -> Staged:
        """A staging with the same room and bounds, on the same device, of its own buffers."""
        return Staged(self.requests, self._rows, self._hashes, self.device.device, self.most)

    def fits(self, requests: EncodedRequests) -> bool:
        """The batch goes in: the same batch size, groups, embedding width and exact attributes, and
        no more query rows, hashes or queries per request for a group than the room and `most`
        (its query layout is then within the staged one)."""
        if _shapes(requests) != self._shapes:
            return False
        if any(len(q.rows) > r for q, r in zip(requests.planes, self._rows)) or any(
                e is not None and len(e.hashes) > (h or 0) for e, h in zip(requests.exact, self._hashes)):
            return False
        if requests.stacked is not None:  # on a device: the bounds the host kept
            return all(q.max_queries <= m for q, m in zip(requests.planes, self.most))
        # on the host: the most queries a request has for one group, read from the ranges
        return all(max(most_queries(q.ranges), default=0) <= m for q, m in zip(requests.planes, self.most))

    def put(self, requests: EncodedRequests) -> None:
        """Put a batch that `fits` in, queued on the current stream before the search that reads it:
        its host arrays (and CPU tensors, and views of the twin itself) into the pinned buffer, the
        buffer's one copy to the twin, then its tensors on the twin's device into their places there
        (after that copy: theirs stand). Nothing waits."""
        base = self.device.untyped_storage().data_ptr()
        on_device = []
        for (room, host, twin), part in zip(self._rooms, _parts(requests)):
            if isinstance(part, np.ndarray):
                host = host[:len(part)]
                np.copyto(host, part.view(host.dtype) if part.dtype != host.dtype else part, casting="no")
            elif part.device == self.device.device and part.untyped_storage().data_ptr() != base:
                on_device.append((twin, part))
            else:  # on the host, or the staged requests given back: the buffer's copy would overwrite them
                room[:len(part)].copy_(part)
        if self.device is not self.host:
            self.device.copy_(self.host, non_blocking=True)
        for twin, part in on_device:
            twin[:len(part)].copy_(part)


def _shapes(requests: EncodedRequests) -> tuple:
    """What a staging fixes of a batch: its planes' ranges shapes and row widths, its exact
    attributes, its embedding's shape."""
    return (tuple((tuple(q.ranges.shape), q.rows.shape[1]) for q in requests.planes),
            tuple(None if e is None else tuple(e.hash_offsets.shape) for e in requests.exact),
            None if requests.embedding is None else tuple(requests.embedding.shape))


def _parts(requests: EncodedRequests) -> list:
    """A batch's arrays `Staged.put` copies, in one order: each plane's rows and ranges, each
    exact plane's offsets and hashes, the embedding."""
    out = [a for q in requests.planes for a in (q.rows, q.ranges)]
    out += [a for e in requests.exact if e is not None for a in (e.hash_offsets, e.hashes)]
    return out + ([] if requests.embedding is None else [requests.embedding])
