"""A request batch's encoding (`EncodedRequests`), made once for everything that tests it
(docs/design.md §4): the trie matchers (CPU matcher, mask kernels) and the exact ad-level filter.

Encoding reads the Arrow buffers directly (`encode_requests`): the bitmask values are looked up
in their declared sets, and every Bloom and exact hash is computed by one numba pass over a
column's bytes (`sidindex.matchers.murmur`), with no Python loop per value. Everything an
encoding holds lives in one int64 arena (a caller may pass a reused, pinned one): the planes'
query rows back to back, the groups' ranges, the exact filter's hashes and the embedding, so a
device copy of the whole batch is one copy (`runtime.requests.to_device`).

Legend: B requests, D embedding dims, G word groups of all planes, A a plane's attributes.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import numba
import numpy as np
import pyarrow as pa
from numpy.typing import DTypeLike

from schemas.artifacts import EXACT_FORM, EXACT_ROWS
from sidindex.arraytypes import HostOrDevice
from sidindex.matchers.bloom import BLOOM_SEED
from sidindex.matchers.exact import EXACT_SEED, ExactQueries
from sidindex.matchers.kinds import KINDS
from sidindex.matchers.murmur import murmur3_32, murmur3_x64_64, string_buffers
from sidindex.matchers.plane import PlaneQueries
from sidindex.requests import Requests, null_like
from sidindex.targeting import TargetingSpec

ALL_ONES = np.int64(-1)  # a query row word with every bit set (uint64 bits held as int64)


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
    arena:        on the host, the (n,) int64 array every other array here is a view of (one copy
                  moves the batch), or None for an encoding put together otherwise
    """

    source: str
    planes: tuple[PlaneQueries, ...]
    exact: tuple[ExactQueries | None, ...]
    embedding: HostOrDevice | None
    stacked: Any = None
    arena: np.ndarray | None = None

    @property
    def batch(self) -> int:
        return self.planes[0].ranges.shape[0]

    def slice(self, lo: int, hi: int) -> EncodedRequests:
        """Requests lo..hi-1 (query rows and hashes stay shared; ranges and offsets index them)."""
        return replace(self, planes=tuple(p.slice(lo, hi) for p in self.planes),
                       exact=tuple(e and e.slice(lo, hi) for e in self.exact),
                       stacked=None if self.stacked is None else self.stacked.slice(lo, hi),
                       embedding=None if self.embedding is None else self.embedding[lo:hi])


class _Carver:
    """Hands out consecutive views of one int64 arena, 8-byte aligned (`encode_requests` fills them)."""

    def __init__(self, arena: np.ndarray) -> None:
        self.arena, self.at = arena, 0

    def take(self, shape: tuple[int, ...], dtype: DTypeLike = np.int64) -> np.ndarray:
        n = int(np.prod(shape, dtype=np.int64)) * np.dtype(dtype).itemsize
        words = -(-n // 8)
        view = self.arena[self.at:self.at + words].view(np.uint8)[:n].view(dtype).reshape(shape)
        self.at += words
        return view


def _single(col: pa.ChunkedArray) -> pa.Array:
    return col.combine_chunks() if col.num_chunks != 1 else col.chunk(0)


def _fixed(a: np.ndarray, dtype: DTypeLike) -> np.ndarray:
    """a as a read-only array of `dtype`: the numba kernels then see one type whatever the
    column's form (32- or 64-bit offsets, Arrow's read-only buffers or a new array), and compile
    once, at warm-up, rather than at the first batch of another form."""
    a = np.asarray(a, dtype=dtype)
    if a.flags.writeable:
        a = a.view()
        a.flags.writeable = False
    return a


_NONE_VALID = _fixed(np.zeros(0), np.uint8)  # a validity bitmap of no bytes: every slot valid


def _validity(arr: pa.Array) -> tuple[np.ndarray, int]:
    """(bitmap (bytes,) uint8, bit offset of slot 0) of arr's validity; no bytes when none is null."""
    buf = arr.buffers()[0]
    if arr.null_count == 0 or buf is None:
        return _NONE_VALID, 0
    return _fixed(np.frombuffer(buf, dtype=np.uint8), np.uint8), arr.offset


def _strings(col: pa.ChunkedArray, n: int) -> tuple[np.ndarray, int, np.ndarray, np.ndarray]:
    """(validity, bit offset, offsets (n+1,), data (bytes,) uint8) of a validated string column;
    a column of nulls only is n null slots."""
    if null_like(col.type):
        return (_fixed(np.zeros((n + 7) // 8), np.uint8), 0, _fixed(np.zeros(n + 1), np.int64),
                _fixed(np.zeros(0), np.uint8))
    arr = _single(col)
    if pa.types.is_dictionary(arr.type):
        arr = arr.dictionary_decode()
    valid, bit = _validity(arr)
    offsets, data = string_buffers(arr)
    return valid, bit, _fixed(offsets, np.int64), _fixed(data, np.uint8)


def _lists(col: pa.ChunkedArray, n: int) -> tuple[np.ndarray, int, np.ndarray, np.ndarray, np.ndarray]:
    """(validity, bit offset, list offsets (n+1,), the values' string offsets and data) of a
    validated list<string> column (null values inside a list were refused); a column of nulls
    only, or of lists of nulls only, is n lists without values."""
    if null_like(col.type) or null_like(col.type.value_type):
        return (_NONE_VALID, 0, _fixed(np.zeros(n + 1), np.int64), _fixed(np.zeros(1), np.int64),
                _fixed(np.zeros(0), np.uint8))
    arr = _single(col)
    if not (pa.types.is_list(arr.type) or pa.types.is_large_list(arr.type)):
        arr = arr.cast(pa.large_list(arr.type.value_type))
    valid, bit = _validity(arr)
    width = np.int32 if pa.types.is_list(arr.type) else np.int64
    list_offsets = np.frombuffer(arr.buffers()[1], dtype=width)[arr.offset:arr.offset + n + 1]
    values = arr.values  # the whole child: the list offsets index it
    if pa.types.is_dictionary(values.type):
        values = values.dictionary_decode()
    offsets, data = string_buffers(values)
    return valid, bit, _fixed(list_offsets, np.int64), _fixed(offsets, np.int64), _fixed(data, np.uint8)


@numba.njit(cache=True, nogil=True, inline="always")
def _is_valid(valid: np.ndarray, bit: int, i: int) -> bool:
    return len(valid) == 0 or (valid[(bit + i) >> 3] >> ((bit + i) & 7)) & 1


@numba.njit(cache=True, nogil=True)
def _list_values(valid: np.ndarray, bit: int, list_offsets: np.ndarray) -> np.ndarray:
    """(B,) int64 the values of each list (0 for a null one)."""
    n = len(list_offsets) - 1
    out = np.zeros(n, dtype=np.int64)
    for b in range(n):
        if _is_valid(valid, bit, b):
            out[b] = list_offsets[b + 1] - list_offsets[b]
    return out


@numba.njit(cache=True, nogil=True)
def _bitmask_attribute(out: np.ndarray, bit0: int, unknown: int, valid: np.ndarray, bit: int, offsets: np.ndarray,
                       data: np.ndarray, t_hashes: np.ndarray, t_codes: np.ndarray, t_offsets: np.ndarray,
                       t_data: np.ndarray) -> None:
    """Set, in each request's row of out (B, W) int64, the bit bit0 + the index of its value among
    the attribute's declared values (table `BitmaskLayout.lookup`), or bit0 + unknown for a null
    or undeclared value."""
    for b in range(out.shape[0]):
        code = unknown
        if _is_valid(valid, bit, b):
            s, e = offsets[b], offsets[b + 1]
            h = murmur3_32(data, s, e, np.uint32(0))
            i = np.searchsorted(t_hashes, h)
            while i < len(t_hashes) and t_hashes[i] == h:  # equal hashes: compare the bytes
                vs, ve = t_offsets[i], t_offsets[i + 1]
                if ve - vs == e - s and (data[s:e] == t_data[vs:ve]).all():
                    code = t_codes[i]
                    break
                i += 1
        k = bit0 + code
        out[b, k >> 6] |= np.int64(1) << np.int64(k & 63)


@numba.njit(cache=True, nogil=True)
def _bloom_attribute(valid: np.ndarray, bit: int, list_offsets: np.ndarray, str_offsets: np.ndarray, data: np.ndarray,
                     rows: np.ndarray, row0: int, lo: int, hi: int, bits: int, hashes: int, ranges: np.ndarray,
                     group: int, exact: np.ndarray, exact0: int) -> tuple[int, int]:
    """One bloom attribute's query rows and exact hashes, for every request.

    Request b's values (list b: values list_offsets[b]..list_offsets[b+1] of the strings at
    str_offsets, unless the list is null) each get a query row, rows[row0 + ...], with `hashes`
    bits set at BLOOM_SEED + i hash positions in the attribute's words lo..hi (one all-ones row
    when it has none); ranges[b, group] their [start, end); the values' exact hashes go to
    exact[exact0 + ...], sorted per request. Returns the next free row and exact slot.
    rows: (Q, W) int64, zeroed; ranges: (B, G, 2) int64; exact: (T,) uint64.
    """
    r, e = row0, exact0
    for b in range(len(list_offsets) - 1):
        ranges[b, group, 0] = r
        first, last = list_offsets[b], list_offsets[b + 1]
        if not _is_valid(valid, bit, b):
            last = first
        if last == first:
            for w in range(lo, hi):
                rows[r, w] = -1
            r += 1
        e_lo = e
        for k in range(first, last):
            s, t = str_offsets[k], str_offsets[k + 1]
            for i in range(hashes):
                pos = np.int64(murmur3_32(data, s, t, np.uint32(BLOOM_SEED + i)) % np.uint32(bits))
                at = lo * 64 + pos
                rows[r, at >> 6] |= np.int64(1) << np.int64(at & 63)
            r += 1
            exact[e] = murmur3_x64_64(data, s, t, np.uint64(EXACT_SEED))
            e += 1
        exact[e_lo:e] = np.sort(exact[e_lo:e])
        ranges[b, group, 1] = r
    return r, e


def encode_requests(requests: Requests, spec: TargetingSpec,
                    arena: np.ndarray | Callable[[int], np.ndarray] | None = None) -> EncodedRequests:
    """Encode a validated batch (`requests_from`/`read_requests` against `spec`).

    arena: an (n,) int64 array to write into (reused and pinned by a serving host), or a function
    giving one of at least the words it is asked for; default a new array. One too short is not
    used. The encoding's arrays are views of the arena, valid until it is written again.
    """
    n = len(requests)
    bm, bl = spec.bitmask_layout, spec.bloom_layout
    assert [k.name for k in KINDS] == ["bitmask", "bloom"] and EXACT_FORM["bitmask"] == EXACT_ROWS \
        and EXACT_FORM["bloom"] != EXACT_ROWS, "the encoder writes these two planes"
    lists = [_lists(requests.columns.column(name), n) for name in bl.names]
    values = [_list_values(v, b, o) for v, b, o, _, _ in lists]
    q_bloom = sum(int(np.maximum(c, 1).sum()) for c in values)
    G = 1 + len(bl.names)
    d = 0 if requests.embedding is None else requests.embedding.shape[1]
    need = n * bm.words + q_bloom * bl.words + n * G * 2 + len(bl.names) * (n + 1) + q_bloom + -(-n * d // 2)
    arena = arena(need) if callable(arena) else arena
    if arena is None or len(arena) < need:
        arena = np.empty(need, dtype=np.int64)
    carve = _Carver(arena)
    # 1. the planes' query rows, back to back: the query stack's words
    words = carve.take((n * bm.words + q_bloom * bl.words,))
    words[:] = 0
    bm_rows = words[:n * bm.words].reshape(n, bm.words)
    bl_rows = words[n * bm.words:].reshape(q_bloom, bl.words)
    ranges = carve.take((n, G, 2))
    # 2. bitmask: each request's user row, one bit per attribute (its value's, or "unknown")
    for a, (name, table) in enumerate(zip(bm.names, bm.lookup)):
        _bitmask_attribute(bm_rows, bm.offsets[a], len(bm.values[a]), *_strings(requests.columns.column(name), n),
                           *table)
    ranges[:, 0, 0] = np.arange(n)
    ranges[:, 0, 1] = ranges[:, 0, 0] + 1
    # 3. bloom: a query row per value (attribute-major), and the exact hashes, in one pass per attribute
    offsets = carve.take((len(bl.names), n + 1))
    hashes = carve.take((q_bloom,), np.uint64)
    r = e = 0
    for a, (valid, bit, list_offsets, str_offsets, data) in enumerate(lists):
        offsets[a, 0] = e
        np.cumsum(values[a], out=offsets[a, 1:])
        offsets[a, 1:] += e
        r, e = _bloom_attribute(valid, bit, list_offsets, str_offsets, data, bl_rows, r, bl.word_offsets[a],
                                bl.word_offsets[a + 1], bl.attribute_bits[a], bl.hashes[a], ranges, 1 + a, hashes, e)
    embedding = None
    if requests.embedding is not None:
        embedding = carve.take(requests.embedding.shape, np.float32)
        embedding[:] = requests.embedding
    planes = (PlaneQueries(bm_rows.view(np.uint64), ranges[:, :1], np.array([0, bm.words], dtype=np.int64),
                           single=True),
              PlaneQueries(bl_rows.view(np.uint64), ranges[:, 1:], np.array(bl.word_offsets, dtype=np.int64)))
    exact = (None, ExactQueries(offsets, hashes[:e]))
    return EncodedRequests(requests.source, planes, exact, embedding, arena=arena)
