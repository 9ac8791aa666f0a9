"""MurmurHash3 in numba, read straight from Arrow string buffers.

The same hashes as the mmh3 library, without a Python call per value:
  murmur3_32      x86_32 of data[start:end], unsigned: mmh3.hash(value, seed, signed=False)
  murmur3_x64_64  the first 64 bits of x64_128, unsigned: mmh3.hash64(value, seed, signed=False)[0]
  hash32_all, hash64_all   the same over every value of an Arrow string layout
  string_buffers  that layout (offsets, data) of a pyarrow array, as zero-copy numpy views

Legend: n values. An Arrow string layout is `data` (bytes,) uint8, the UTF-8 bytes of all values,
and `offsets` (n+1,) int32 or int64: value i is data[offsets[i]:offsets[i+1]]. Offsets need not
start at 0 (a sliced array's do not).

Seeds (0 <= seed < 2**32, else ValueError, as in mmh3) and why all arithmetic is in uint64:
docs/gtm-index.md, "Murmur hashes".
"""

from __future__ import annotations

import numba
import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

_M32 = np.uint64(0xFFFFFFFF)

# x86_32
_C1_32 = np.uint64(0xCC9E2D51)
_C2_32 = np.uint64(0x1B873593)
_N_32 = np.uint64(0xE6546B64)
_F1_32 = np.uint64(0x85EBCA6B)
_F2_32 = np.uint64(0xC2B2AE35)

# x64_128
_C1_64 = np.uint64(0x87C37B91114253D5)
_C2_64 = np.uint64(0x4CF5AD432745937F)
_N1_64 = np.uint64(0x52DCE729)
_N2_64 = np.uint64(0x38495AB5)
_F1_64 = np.uint64(0xFF51AFD7ED558CCD)
_F2_64 = np.uint64(0xC4CEB9FE1A85EC53)

_U0 = np.uint64(0)
_U5 = np.uint64(5)
_U8 = np.uint64(8)
_U13 = np.uint64(13)
_U15 = np.uint64(15)
_U16 = np.uint64(16)
_U24 = np.uint64(24)
_U27 = np.uint64(27)
_U31 = np.uint64(31)
_U33 = np.uint64(33)
_U32 = np.uint64(32)
_U64 = np.uint64(64)

_SEED_MAX = 0xFFFFFFFF


# --- x86_32 -----------------------------------------------------------------------------------

@numba.njit(cache=True, nogil=True, inline="always")
def _rotl32(x: np.uint64, r: np.uint64) -> np.uint64:
    """x < 2**32 as uint64, r uint64 in 1..31: the 32-bit rotation, still < 2**32."""
    return ((x << r) | (x >> (_U32 - r))) & _M32


@numba.njit(cache=True, nogil=True, inline="always")
def _mix_k32(k: np.uint64) -> np.uint64:
    k = (k * _C1_32) & _M32
    k = _rotl32(k, _U15)
    return (k * _C2_32) & _M32


@numba.njit(cache=True, nogil=True, inline="always")
def _murmur3_32(data: np.ndarray, start: int, end: int, seed: int | np.integer) -> np.uint32:
    """The unchecked kernel of murmur3_32; seed already in 0..2**32-1."""
    length = end - start
    nblocks = length // 4
    h = np.uint64(seed) & _M32
    p = start
    for _ in range(nblocks):
        k = (np.uint64(data[p]) | (np.uint64(data[p + 1]) << _U8)
             | (np.uint64(data[p + 2]) << _U16) | (np.uint64(data[p + 3]) << _U24))
        h ^= _mix_k32(k)
        h = _rotl32(h, _U13)
        h = (h * _U5 + _N_32) & _M32
        p += 4
    # --- tail: the last length % 4 bytes, little-endian, one mix when there are any ---
    rem = length & 3
    if rem > 0:
        k = _U0
        for j in range(rem):
            k |= np.uint64(data[p + j]) << np.uint64(8 * j)
        h ^= _mix_k32(k)
    # --- finalise: length (its low 32 bits), then fmix32 ---
    h ^= np.uint64(length) & _M32
    h ^= h >> _U16
    h = (h * _F1_32) & _M32
    h ^= h >> _U13
    h = (h * _F2_32) & _M32
    h ^= h >> _U16
    return np.uint32(h)


@numba.njit(cache=True, nogil=True, inline="always")  # inlined where a kernel hashes each value
def murmur3_32(data: np.ndarray, start: int, end: int, seed: int | np.integer) -> np.uint32:
    """MurmurHash3 x86_32 of data[start:end] -> uint32, equal to mmh3.hash(bytes, seed, signed=False).

    data: (bytes,) uint8; start, end: int, 0 <= start <= end <= len(data); seed: 0 <= seed < 2**32
    (ValueError otherwise). Callable from other njit code.
    """
    if seed < 0 or seed > _SEED_MAX:
        raise ValueError("murmur3 seed must be in 0..2**32-1 (as mmh3 requires)")
    return _murmur3_32(data, start, end, seed)


# --- x64_128, first 64 bits ------------------------------------------------------------------

@numba.njit(cache=True, nogil=True, inline="always")
def _rotl64(x: np.uint64, r: np.uint64) -> np.uint64:
    """x uint64, r uint64 in 1..63."""
    return (x << r) | (x >> (_U64 - r))


@numba.njit(cache=True, nogil=True, inline="always")
def _fmix64(k: np.uint64) -> np.uint64:
    k ^= k >> _U33
    k *= _F1_64
    k ^= k >> _U33
    k *= _F2_64
    k ^= k >> _U33
    return k


@numba.njit(cache=True, nogil=True, inline="always")
def _load64(data: np.ndarray, p: int) -> np.uint64:
    """The 8 bytes data[p:p+8] as a little-endian uint64 (no alignment needed)."""
    k = _U0
    for j in range(8):
        k |= np.uint64(data[p + j]) << np.uint64(8 * j)
    return k


@numba.njit(cache=True, nogil=True, inline="always")
def _murmur3_x64_64(data: np.ndarray, start: int, end: int, seed: int | np.integer) -> np.uint64:
    """The unchecked kernel of murmur3_x64_64; seed already in 0..2**32-1."""
    length = end - start
    nblocks = length // 16
    h1 = np.uint64(seed) & _M32
    h2 = h1
    p = start
    for _ in range(nblocks):
        k1 = _load64(data, p)
        k2 = _load64(data, p + 8)
        k1 *= _C1_64
        k1 = _rotl64(k1, _U31)
        k1 *= _C2_64
        h1 ^= k1
        h1 = _rotl64(h1, _U27)
        h1 += h2
        h1 = h1 * _U5 + _N1_64
        k2 *= _C2_64
        k2 = _rotl64(k2, _U33)
        k2 *= _C1_64
        h2 ^= k2
        h2 = _rotl64(h2, _U31)
        h2 += h1
        h2 = h2 * _U5 + _N2_64
        p += 16
    # --- tail: the last length % 16 bytes; bytes 8.. go to k2, bytes 0..7 to k1 ---
    rem = length & 15
    if rem > 8:
        k2 = _U0
        for j in range(8, rem):
            k2 |= np.uint64(data[p + j]) << np.uint64(8 * (j - 8))
        k2 *= _C2_64
        k2 = _rotl64(k2, _U33)
        k2 *= _C1_64
        h2 ^= k2
    if rem > 0:
        k1 = _U0
        for j in range(min(rem, 8)):
            k1 |= np.uint64(data[p + j]) << np.uint64(8 * j)
        k1 *= _C1_64
        k1 = _rotl64(k1, _U31)
        k1 *= _C2_64
        h1 ^= k1
    # --- finalise ---
    h1 ^= np.uint64(length)
    h2 ^= np.uint64(length)
    h1 += h2
    h2 += h1
    h1 = _fmix64(h1)
    h2 = _fmix64(h2)
    h1 += h2
    return h1


@numba.njit(cache=True, nogil=True, inline="always")  # inlined where a kernel hashes each value
def murmur3_x64_64(data: np.ndarray, start: int, end: int, seed: int | np.integer) -> np.uint64:
    """The first 64 bits of MurmurHash3 x64_128 of data[start:end] -> uint64, equal to
    mmh3.hash64(bytes, seed, signed=False)[0].

    data: (bytes,) uint8; start, end: int, 0 <= start <= end <= len(data); seed: 0 <= seed < 2**32
    (ValueError otherwise). Callable from other njit code.
    """
    if seed < 0 or seed > _SEED_MAX:
        raise ValueError("murmur3 seed must be in 0..2**32-1 (as mmh3 requires)")
    return _murmur3_x64_64(data, start, end, seed)


# --- every value of a layout -----------------------------------------------------------------

@numba.njit(cache=True, nogil=True)
def hash32_all(data: np.ndarray, offsets: np.ndarray, seed: int | np.integer) -> np.ndarray:
    """(n,) uint32: murmur3_32 of each value of an Arrow string layout.

    data: (bytes,) uint8; offsets: (n+1,) int32 or int64, non-decreasing, within data;
    seed: 0 <= seed < 2**32 (ValueError otherwise). Null slots hash whatever bytes they span
    (none, in arrays pyarrow builds: the empty string's hash); the caller applies validity.
    """
    if seed < 0 or seed > _SEED_MAX:
        raise ValueError("murmur3 seed must be in 0..2**32-1 (as mmh3 requires)")
    n = len(offsets) - 1
    out = np.empty(max(n, 0), dtype=np.uint32)
    for i in range(n):
        out[i] = _murmur3_32(data, offsets[i], offsets[i + 1], seed)
    return out


@numba.njit(cache=True, nogil=True)
def hash64_all(data: np.ndarray, offsets: np.ndarray, seed: int | np.integer) -> np.ndarray:
    """(n,) uint64: murmur3_x64_64 of each value of an Arrow string layout.

    data: (bytes,) uint8; offsets: (n+1,) int32 or int64, non-decreasing, within data;
    seed: 0 <= seed < 2**32 (ValueError otherwise). Null slots as in hash32_all.
    """
    if seed < 0 or seed > _SEED_MAX:
        raise ValueError("murmur3 seed must be in 0..2**32-1 (as mmh3 requires)")
    n = len(offsets) - 1
    out = np.empty(max(n, 0), dtype=np.uint64)
    for i in range(n):
        out[i] = _murmur3_x64_64(data, offsets[i], offsets[i + 1], seed)
    return out


# --- Arrow buffers ---------------------------------------------------------------------------

def _is_view(t: pa.DataType) -> bool:
    is_sv = getattr(pa.types, "is_string_view", None)
    is_bv = getattr(pa.types, "is_binary_view", None)
    return bool((is_sv and is_sv(t)) or (is_bv and is_bv(t)))


# the offsets' dtype of each type read as it is, by type id (one look-up for a request batch's columns)
_OFFSETS: dict[int, np.dtype] = {pa.string().id: np.dtype(np.int32), pa.binary().id: np.dtype(np.int32),
            pa.large_string().id: np.dtype(np.int64), pa.large_binary().id: np.dtype(np.int64)}


def string_buffers(arr: pa.Array) -> tuple[np.ndarray, np.ndarray]:
    """(offsets, data) of a pyarrow string array, for hash32_all / hash64_all.

    offsets: (n+1,) int32 (string, binary) or int64 (large_string, large_binary), a read-only
    zero-copy view that honours arr.offset (a slice's offsets index the parent's data, so they
    need not start at 0); data: (bytes,) uint8, a read-only zero-copy view of the whole data
    buffer (empty when the array has none: all values empty or null).

    Accepts string, large_string, binary and large_binary as they are; string_view and
    binary_view are first cast to large_string / large_binary, and dictionary arrays of any of
    these are decoded (both copies, which the returned views keep alive). Null slots are left
    to the caller (arr.is_valid()); in arrays pyarrow builds they span zero bytes.
    """
    if isinstance(arr, pa.ChunkedArray):
        raise TypeError("string_buffers takes one pyarrow.Array, got a ChunkedArray: "
                        "pass each of its .chunks, or .combine_chunks()")
    if not isinstance(arr, pa.Array):
        raise TypeError(f"string_buffers takes a pyarrow.Array, got {type(arr).__name__}")
    off_dtype = _OFFSETS.get(arr.type.id)
    if off_dtype is None:
        t = arr.type
        if pa.types.is_dictionary(t):
            arr = arr.dictionary_decode()
            t = arr.type
        if _is_view(t):
            arr = pc.cast(arr, pa.large_string() if pa.types.is_string_view(t) else pa.large_binary())
            t = arr.type
        off_dtype = _OFFSETS.get(t.id)
        if off_dtype is None:
            raise TypeError(f"string_buffers takes a string, large_string, string_view, binary, large_binary, "
                            f"binary_view array or a dictionary of one, got {t}; cast it first "
                            f"(pyarrow.compute.cast(arr, pyarrow.large_string()))")
    _, off_buf, data_buf = arr.buffers()[:3]
    return _views(len(arr), arr.offset, off_buf, data_buf, off_dtype)


def _views(n: int, offset: int, off_buf: pa.Buffer | None, data_buf: pa.Buffer | None,
           off_dtype: np.dtype) -> tuple[np.ndarray, np.ndarray]:
    """Read-only (n+1,) offsets from element `offset` of off_buf, and all of data_buf as uint8.

    A buffer may be None where the C data interface allows it (no values, or no value bytes);
    pyarrow itself fills in zero-size buffers, but arrays from other producers need not.
    """
    if n == 0 or off_buf is None:
        offsets = np.zeros(1, dtype=off_dtype)
    else:
        offsets = np.frombuffer(off_buf, off_dtype, n + 1, offset * off_dtype.itemsize)
    data = np.empty(0, dtype=np.uint8) if data_buf is None else np.frombuffer(data_buf, np.uint8)
    offsets.flags.writeable = False  # views of Arrow memory: never written through
    data.flags.writeable = False
    return offsets, data
