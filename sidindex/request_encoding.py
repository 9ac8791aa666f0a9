"""A request batch's encoding (`EncodedRequests`), made once for everything that tests it
(docs/design.md §4): the trie matchers (CPU matcher, mask kernels) and the exact ad-level filter.

Encoding reads the Arrow buffers directly (`encode_requests`): the bitmask values of every
attribute are looked up in their declared sets by one numba pass over the columns' strings put
together, and every Bloom and exact hash is computed by one numba pass over a column's bytes
(`sidindex.matchers.murmur`), with no Python loop per value. Everything an encoding holds lives
in one int64 arena (a caller may pass a reused, pinned one): the planes' query rows back to back,
the groups' ranges, the exact filter's hashes and the embedding, so a device copy of the whole
batch is one copy (`runtime.requests.to_device`).

Legend: B requests, D embedding dims, G word groups of all planes, A a plane's attributes.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import numba
import numpy as np
import pyarrow as pa
from numpy.typing import DTypeLike

from schemas.artifacts import EXACT_FORM, EXACT_ROWS
from sidindex.arraytypes import HostOrDevice
from sidindex.exact import EXACT_SEED, ExactQueries
from sidindex.matchers.bitmask import BitmaskLayout
from sidindex.matchers.bloom import BLOOM_SEED, BloomLayout
from sidindex.matchers.kinds import KINDS
from sidindex.matchers.murmur import murmur3_32, murmur3_x64_64, string_buffers
from sidindex.matchers.plane import PlaneQueries
from sidindex.requests import Requests, null_like
from sidindex.targeting import TargetingSpec

assert [k.name for k in KINDS] == ["bitmask", "bloom"] and EXACT_FORM["bitmask"] == EXACT_ROWS \
    and EXACT_FORM["bloom"] != EXACT_ROWS, "the encoder writes these two planes"


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
    host:         on a device, the host encoding this form was moved from (the host post stage
                  reads it; valid while that is, as a reused arena is until written again);
                  None on the host
    """

    source: str
    planes: tuple[PlaneQueries, ...]
    exact: tuple[ExactQueries | None, ...]
    embedding: HostOrDevice | None
    stacked: Any = None
    arena: np.ndarray | None = None
    host: EncodedRequests | None = None

    @property
    def batch(self) -> int:
        return self.planes[0].ranges.shape[0]

    def slice(self, lo: int, hi: int) -> EncodedRequests:
        """Requests lo..hi-1 (query rows and hashes stay shared; ranges and offsets index them)."""
        return replace(self, planes=tuple(p.slice(lo, hi) for p in self.planes),
                       exact=tuple(e and e.slice(lo, hi) for e in self.exact),
                       stacked=None if self.stacked is None else self.stacked.slice(lo, hi),
                       embedding=None if self.embedding is None else self.embedding[lo:hi],
                       host=None if self.host is None else self.host.slice(lo, hi))


def _arrays(table: pa.Table, *names: tuple[str, ...]) -> list[list[pa.Array]]:
    """Each group of `names`' columns of `table` as arrays: views where the table is one record
    batch (a batch served from memory), each column's chunks combined otherwise."""
    batches = table.to_batches()
    if len(batches) == 1:
        return [[batches[0].column(name) for name in group] for group in names]
    return [[table.column(name).combine_chunks() for name in group] for group in names]


def _fixed(a: np.ndarray, dtype: DTypeLike) -> np.ndarray:
    """a as a read-only array of `dtype`: the numba kernels then see one type whatever the
    column's form (32- or 64-bit offsets, Arrow's read-only buffers or a new array), and compile
    once, at warm-up, rather than at the first batch of another form."""
    if a.dtype != dtype:
        a = a.astype(dtype)  # a new array: ours to mark
    elif a.flags.writeable:
        a = a.view()  # a's owner may write it: a read-only view
    a.flags.writeable = False
    return a


_NONE_VALID = _fixed(np.zeros(0), np.uint8)  # a validity bitmap of no bytes: every slot valid
_STRING = pa.string()


def _validity(arr: pa.Array) -> tuple[np.ndarray, int]:
    """(bitmap (bytes,) uint8, bit offset of slot 0) of arr's validity; no bytes when none is null."""
    buf = arr.buffers()[0] if arr.null_count else None
    if buf is None:
        return _NONE_VALID, 0
    return _fixed(np.frombuffer(buf, np.uint8), np.uint8), arr.offset


def _strings(columns: list[pa.Array]) -> tuple[np.ndarray, int, np.ndarray, np.ndarray]:
    """(validity, bit offset, offsets (A*B+1,), data (bytes,) uint8) of validated string columns
    of B rows each, back to back (column a's slots are a*B..a*B+B-1): one array, so that the
    buffers are read once for every bitmask attribute."""
    arr = None
    if all(c.type == _STRING for c in columns):
        with contextlib.suppress(pa.ArrowInvalid):  # more bytes together than 32-bit offsets reach
            arr = pa.concat_arrays(columns)
    if arr is None:  # other forms (dictionaries, views, large strings, nulls only), or too many bytes
        arr = pa.concat_arrays([c.cast(pa.large_string()) for c in columns])
    valid, bit = _validity(arr)
    offsets, data = string_buffers(arr)
    return valid, bit, _fixed(offsets, np.int64), data


def _lists(arr: pa.Array, n: int) -> tuple[np.ndarray, int, np.ndarray, np.ndarray, np.ndarray]:
    """(validity, bit offset, list offsets (n+1,), the values' string offsets and data) of a
    validated list<string> column (null values inside a list were refused); a column of nulls
    only, or of lists of nulls only, is n lists without values."""
    if null_like(arr.type) or null_like(arr.type.value_type):
        return (_NONE_VALID, 0, _fixed(np.zeros(n + 1), np.int64), _fixed(np.zeros(1), np.int64),
                _fixed(np.zeros(0), np.uint8))
    if not (pa.types.is_list(arr.type) or pa.types.is_large_list(arr.type)):
        arr = arr.cast(pa.large_list(arr.type.value_type))
    valid, bit = _validity(arr)
    width = np.dtype(np.int32 if pa.types.is_list(arr.type) else np.int64)
    list_offsets = np.frombuffer(arr.buffers()[1], width, n + 1, arr.offset * width.itemsize)
    offsets, data = string_buffers(arr.values)  # the whole child: the list offsets index it
    return valid, bit, _fixed(list_offsets, np.int64), _fixed(offsets, np.int64), data


@functools.lru_cache(maxsize=16)
def _one_each(n: int) -> np.ndarray:
    """(n, 2) int64 [b, b+1]: request b's query is row b (the bitmask plane's ranges); a few
    batch sizes' worth kept."""
    one_each = np.stack([np.arange(n), np.arange(1, n + 1)], axis=1)
    one_each.flags.writeable = False  # shared by the batches of n requests
    return one_each


_DECLARED: dict[int, tuple[BitmaskLayout, tuple[np.ndarray, ...]]] = {}  # by id(layout); the layout keeps its id


def _declared(layout: BitmaskLayout) -> tuple[np.ndarray, ...]:
    """Every bitmask attribute's table of declared values (`BitmaskLayout.lookup`) back to back,
    so that one kernel call looks up a batch's values of all of them: (bit_offsets (A+1,) the
    segments, starts (A+1,) attribute a's entries starts[a]..starts[a+1]-1, hashes (V,) uint32
    sorted within an attribute, codes (V,) int64, offsets (V+1,) int64 into data (bytes,) uint8);
    read-only. Made once per layout (a spec's), by far less often than a batch comes."""
    hit = _DECLARED.get(id(layout))
    if hit is not None and hit[0] is layout:
        return hit[1]
    tables = layout.lookup
    starts = np.cumsum([0] + [len(h) for h, _, _, _ in tables])
    at = np.cumsum([0] + [len(d) for _, _, _, d in tables])  # each table's first byte
    arrays = (np.array(layout.offsets), starts, np.concatenate([h for h, _, _, _ in tables]),
              np.concatenate([c for _, c, _, _ in tables]),
              np.concatenate([o[:-1] + a for (_, _, o, _), a in zip(tables, at)] + [at[-1:]]),
              np.concatenate([d for _, _, _, d in tables]))
    joined = tuple(_fixed(j, t) for j, t in zip(arrays, (np.int64, np.int64, np.uint32, np.int64, np.int64, np.uint8)))
    if len(_DECLARED) >= 8:  # specs come and go with snapshots: keep the latest few
        _DECLARED.clear()
    _DECLARED[id(layout)] = (layout, joined)
    return joined


@numba.njit(cache=True, nogil=True, inline="always")
def _is_valid(valid: np.ndarray, bit: int, i: int) -> bool:
    return len(valid) == 0 or (valid[(bit + i) >> 3] >> ((bit + i) & 7)) & 1


@numba.njit(cache=True, nogil=True, inline="always")
def _same_bytes(a: np.ndarray, start: int, end: int, b: np.ndarray, at: int) -> bool:
    """a[start:end] == b[at:at + end - start], byte by byte (no temporary array)."""
    for k in range(end - start):
        if a[start + k] != b[at + k]:
            return False
    return True


@numba.njit(cache=True, nogil=True, inline="always")
def _sort(a: np.ndarray, lo: int, hi: int) -> None:
    """Sort a[lo:hi] in place: by insertion for a request's few values (no call, no copy), numba's
    sort for many."""
    if hi - lo > 32:
        a[lo:hi].sort()
        return
    for i in range(lo + 1, hi):
        x, j = a[i], i - 1
        while j >= lo and a[j] > x:
            a[j + 1] = a[j]
            j -= 1
        a[j + 1] = x


@numba.njit(cache=True, nogil=True)
def _query_rows(valid: np.ndarray, bit: int, list_offsets: np.ndarray) -> int:
    """The query rows of a bloom attribute's lists: one per value, one for a list without values
    (empty or null)."""
    rows = 0
    for b in range(len(list_offsets) - 1):
        values = list_offsets[b + 1] - list_offsets[b] if _is_valid(valid, bit, b) else 0
        rows += max(values, 1)
    return rows


@functools.lru_cache(maxsize=64)
def _word_offsets(offsets: tuple[int, ...]) -> np.ndarray:
    """A plane's word offsets as the read-only int64 array its queries carry, made once per layout."""
    return _fixed(np.array(offsets, dtype=np.int64), np.int64)


@numba.njit(cache=True, nogil=True)
def _bitmask_attribute(out: np.ndarray, valid: np.ndarray, bit: int, offsets: np.ndarray, data: np.ndarray,
                       bit_offsets: np.ndarray, t_starts: np.ndarray, t_hashes: np.ndarray, t_codes: np.ndarray,
                       t_offsets: np.ndarray, t_data: np.ndarray) -> None:
    """For every bitmask attribute a, set in each request's row of out (B, W) int64 the bit
    bit_offsets[a] + the index of its value among a's declared values, or the segment's last bit
    ("unknown") for a null or undeclared value. Request b's value of attribute a is string
    a * B + b of (valid, bit, offsets, data) (`_strings`); a's declared values are entries
    t_starts[a]..t_starts[a+1]-1 of the tables (`_declared`)."""
    n = out.shape[0]
    for a in range(len(bit_offsets) - 1):
        lo, hi = t_starts[a], t_starts[a + 1]
        for b in range(n):
            code = bit_offsets[a + 1] - bit_offsets[a] - 1  # unknown
            j = a * n + b
            if _is_valid(valid, bit, j):
                s, e = offsets[j], offsets[j + 1]
                h = murmur3_32(data, s, e, np.uint32(0))
                i = lo + np.searchsorted(t_hashes[lo:hi], h)
                while i < hi and t_hashes[i] == h:  # equal hashes: compare the bytes
                    vs, ve = t_offsets[i], t_offsets[i + 1]
                    if ve - vs == e - s and _same_bytes(data, s, e, t_data, vs):
                        code = t_codes[i]
                        break
                    i += 1
            k = bit_offsets[a] + code
            out[b, k >> 6] |= np.int64(1) << np.int64(k & 63)


@numba.njit(cache=True, nogil=True)
def _bloom_attribute(valid: np.ndarray, bit: int, list_offsets: np.ndarray, str_offsets: np.ndarray, data: np.ndarray,
                     rows: np.ndarray, row0: int, lo: int, hi: int, bits: int, hashes: int, ranges: np.ndarray,
                     group: int, exact: np.ndarray, exact_offsets: np.ndarray, exact0: int) -> tuple[int, int]:
    """One bloom attribute's query rows and exact hashes, for every request.

    Request b's values (list b: values list_offsets[b]..list_offsets[b+1] of the strings at
    str_offsets, unless the list is null) each get a query row, rows[row0 + ...], with `hashes`
    bits set at BLOOM_SEED + i hash positions in the attribute's words lo..hi (one all-ones row
    when it has none); ranges[b, group] their [start, end); the values' exact hashes go to
    exact[exact0 + ...], sorted per request, exact_offsets[b], [b+1] their start and end. Returns
    the next free row and exact slot.
    rows: (Q, W) int64, zeroed; ranges: (B, G, 2) int64; exact: (T,) uint64; exact_offsets: (B+1,) int64.
    """
    r, e = row0, exact0
    exact_offsets[0] = e
    for b in range(len(list_offsets) - 1):
        ranges[b, group, 0] = r
        first, last = list_offsets[b], list_offsets[b + 1]
        if not _is_valid(valid, bit, b):
            last = first
        if last == first:
            for w in range(lo, hi):
                rows[r, w] = -1
            r += 1
        for k in range(first, last):
            s, t = str_offsets[k], str_offsets[k + 1]
            for i in range(hashes):
                pos = np.int64(murmur3_32(data, s, t, np.uint32(BLOOM_SEED + i)) % np.uint32(bits))
                at = lo * 64 + pos
                rows[r, at >> 6] |= np.int64(1) << np.int64(at & 63)
            r += 1
            exact[e] = murmur3_x64_64(data, s, t, np.uint64(EXACT_SEED))
            e += 1
        _sort(exact, exact_offsets[b], e)
        exact_offsets[b + 1] = e
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
    bm: BitmaskLayout
    bl: BloomLayout
    bm, bl = spec.layouts  # bitmask, bloom (asserted at import): read once, not per plane
    bm_words, bl_words = bm.words, bl.words
    A, G = len(bl.names), 1 + len(bl.names)
    bm_columns, bl_columns = _arrays(requests.columns, bm.names, bl.names)
    lists = [_lists(arr, n) for arr in bl_columns]
    q_bloom = sum(_query_rows(v, b, o) for v, b, o, _, _ in lists)
    d = 0 if requests.embedding is None else requests.embedding.shape[1]
    # the arena's words: the planes' query rows back to back (the query stack's words), the
    # groups' ranges, the exact hashes' offsets, the hashes, the embedding
    rows_end = n * bm_words + q_bloom * bl_words
    ranges_end = rows_end + n * G * 2
    offsets_end = ranges_end + A * (n + 1)
    hashes_end = offsets_end + q_bloom
    need = hashes_end + -(-n * d // 2)
    arena = arena(need) if callable(arena) else arena
    if arena is None or len(arena) < need:
        arena = np.empty(need, dtype=np.int64)
    words = arena[:rows_end]
    words[:] = 0
    bm_rows = words[:n * bm_words].reshape(n, bm_words)
    bl_rows = words[n * bm_words:].reshape(q_bloom, bl_words)
    ranges = arena[rows_end:ranges_end].reshape(n, G, 2)
    offsets = arena[ranges_end:offsets_end].reshape(A, n + 1)
    hashes = arena[offsets_end:hashes_end].view(np.uint64)
    # 1. bitmask: each request's user row, one bit per attribute (its value's, or "unknown")
    if bm.names:
        _bitmask_attribute(bm_rows, *_strings(bm_columns), *_declared(bm))
    ranges[:, 0] = _one_each(n)
    # 2. bloom: a query row per value (attribute-major), and the exact hashes, in one pass per attribute
    r = e = 0
    for a, (valid, bit, list_offsets, str_offsets, data) in enumerate(lists):
        r, e = _bloom_attribute(valid, bit, list_offsets, str_offsets, data, bl_rows, r, bl.word_offsets[a],
                                bl.word_offsets[a + 1], bl.attribute_bits[a], bl.hashes[a], ranges, 1 + a, hashes,
                                offsets[a], e)
    embedding = None
    if requests.embedding is not None:
        embedding = arena[hashes_end:need].view(np.float32)[:n * d].reshape(n, d)
        embedding[:] = requests.embedding
    planes = (PlaneQueries(bm_rows.view(np.uint64), ranges[:, :1], _word_offsets((0, bm_words)), single=True),
              PlaneQueries(bl_rows.view(np.uint64), ranges[:, 1:], _word_offsets(tuple(bl.word_offsets))))
    exact = (None, ExactQueries(offsets, hashes[:e]))
    return EncodedRequests(requests.source, planes, exact, embedding, arena=arena)
