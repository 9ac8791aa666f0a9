"""sidindex.matchers.murmur against the mmh3 library: every tail length, high bytes, seeds at the
32-bit edges, Arrow layouts (sliced, large, view, dictionary, nulls, empty)."""

from __future__ import annotations

import gc

import mmh3
import numba
import numpy as np
import polars as pl
import pyarrow as pa
import pyarrow.compute as pc
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sidindex.exact import EXACT_SEED
from sidindex.matchers.bloom import BLOOM_SEED
from sidindex.matchers.murmur import _views, hash32_all, hash64_all, murmur3_32, murmur3_x64_64, string_buffers

SEEDS = [0, 1, 2**31 - 1, 2**31, 2**32 - 1, EXACT_SEED] + [BLOOM_SEED + i for i in range(16)]


def ref32(values, seed):
    return np.array([mmh3.hash(v, seed, signed=False) for v in values], dtype=np.uint32)


def ref64(values, seed):
    return np.array([mmh3.hash64(v, seed, signed=False)[0] for v in values], dtype=np.uint64)


def ref_bloom_positions(values, bits, hashes):
    """(V, hashes) Bloom bit positions as docs/design.md §4 defines them, one mmh3 call per value and hash."""
    return np.array([[mmh3.hash(v, BLOOM_SEED + i, signed=False) % bits for i in range(hashes)] for v in values],
                    dtype=np.int64).reshape(len(values), hashes)


def check_array(arr: pa.Array, expected: list, seed: int) -> None:
    """Hashes of arr's valid slots equal mmh3's of `expected` (its Python values)."""
    offsets, data = string_buffers(arr)
    h32, h64 = hash32_all(data, offsets, seed), hash64_all(data, offsets, seed)
    assert h32.dtype == np.uint32 and h64.dtype == np.uint64
    assert h32.shape == h64.shape == (len(expected),)
    valid = [i for i, v in enumerate(expected) if v is not None]
    vals = [expected[i] for i in valid]
    np.testing.assert_array_equal(h32[valid], ref32(vals, seed))
    np.testing.assert_array_equal(h64[valid], ref64(vals, seed))


def _multibyte(n_chars: int) -> str:
    return "".join("aé中😀\x00"[j % 5] for j in range(n_chars))


# every length 0..40 covers every tail of both variants (x86_32: 4-byte blocks, x64: 16-byte) more than twice
ASCII = ["".join(chr(0x41 + (j * 7) % 26) for j in range(n)) for n in range(41)]
MULTIBYTE = [_multibyte(n) for n in range(41)]  # 1-, 2-, 3-, 4-byte characters and NUL, all tail offsets
HIGH = [bytes(0x80 | ((j * 37 + n) & 0x7F) for j in range(n)) for n in range(41)]  # every byte >= 0x80
FF = [b"\xff" * n for n in range(41)]
NUL = ["\x00" * n for n in range(41)] + ["a\x00b" + "\x00" * n + "c" for n in range(17)]
LONG = ["x" * 10_000, "é" * 5_000 + "a", "中" * 3_334, "😀" * 2_500 + "abc"] + ["L" * (10_240 + k) for k in range(16)]


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("name", ["ascii", "multibyte", "nul", "long"])
def test_text_every_tail(name, seed):
    values = {"ascii": ASCII, "multibyte": MULTIBYTE, "nul": NUL, "long": LONG}[name]
    check_array(pa.array(values, pa.string()), values, seed)
    check_array(pa.array(values, pa.large_string()), values, seed)


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("name", ["high", "ff"])
def test_high_bytes_every_tail(name, seed):
    """Bytes >= 0x80 in every tail position: a sign-extended tail byte changes the hash."""
    values = {"high": HIGH, "ff": FF}[name]
    check_array(pa.array(values, pa.binary()), values, seed)
    check_array(pa.array(values, pa.large_binary()), values, seed)


@pytest.mark.parametrize("seed", [0, 2**31, 2**32 - 1, BLOOM_SEED, EXACT_SEED])
def test_scalars_on_raw_bytes(seed):
    """The scalar functions on arbitrary windows of one buffer holding every byte value."""
    buf = np.arange(512, dtype=np.uint64).astype(np.uint8)[::-1].copy()
    raw = buf.tobytes()
    for start in range(0, 20):
        for end in range(start, start + 41):
            assert murmur3_32(buf, start, end, seed) == mmh3.hash(raw[start:end], seed, signed=False)
            assert murmur3_x64_64(buf, start, end, seed) == mmh3.hash64(raw[start:end], seed, signed=False)[0]


def test_scalar_return_types():
    buf = np.frombuffer(b"abcdefgh", dtype=np.uint8)
    murmur3_32(buf, 0, 5, 1)
    murmur3_x64_64(buf, 0, 5, 1)
    assert {s.return_type for s in murmur3_32.nopython_signatures} == {numba.uint32}
    assert {s.return_type for s in murmur3_x64_64.nopython_signatures} == {numba.uint64}


@pytest.mark.parametrize("seed", [-1, 2**32, 2**32 + BLOOM_SEED, 2**63 - 1])
def test_seed_out_of_range_raises_like_mmh3(seed):
    """mmh3 refuses a seed outside 0..2**32-1 (it does not wrap); so do these."""
    with pytest.raises(ValueError):
        mmh3.hash("abc", seed, signed=False)
    with pytest.raises(ValueError):
        mmh3.hash64("abc", seed, signed=False)
    offsets, data = string_buffers(pa.array(["abc"]))
    for fn in (hash32_all, hash64_all):
        with pytest.raises(ValueError, match="seed"):
            fn(data, offsets, seed)
    for fn in (murmur3_32, murmur3_x64_64):
        with pytest.raises(ValueError, match="seed"):
            fn(data, 0, 3, seed)


def test_bloom_positions_and_exact_hashes():
    """The matchers' uses: Bloom bit positions (seeds BLOOM_SEED + i) and exact hashes (EXACT_SEED)."""
    values = ASCII + MULTIBYTE + NUL[:20]
    offsets, data = string_buffers(pa.array(values))
    bits, hashes = 4096, 7
    got = np.stack([hash32_all(data, offsets, BLOOM_SEED + i).astype(np.int64) % bits for i in range(hashes)], axis=1)
    np.testing.assert_array_equal(got, ref_bloom_positions(values, bits, hashes))
    np.testing.assert_array_equal(hash64_all(data, offsets, EXACT_SEED), ref64(values, EXACT_SEED))


@numba.njit
def _bloom_positions(data, offsets, seed0, hashes, bits):
    """(n, hashes) positions from njit code: the scalar functions compose inside other kernels."""
    n = len(offsets) - 1
    out = np.empty((n, hashes), dtype=np.int64)
    for i in range(n):
        for k in range(hashes):
            out[i, k] = np.int64(murmur3_32(data, offsets[i], offsets[i + 1], seed0 + k)) % bits
    return out


@numba.njit
def _exact_sum(data, offsets, seed):
    acc = np.uint64(0)
    for i in range(len(offsets) - 1):
        acc ^= murmur3_x64_64(data, offsets[i], offsets[i + 1], seed)
    return acc


def test_callable_from_njit():
    values = MULTIBYTE + ASCII
    offsets, data = string_buffers(pa.array(values, pa.large_string()))
    np.testing.assert_array_equal(_bloom_positions(data, offsets, BLOOM_SEED, 16, 1 << 20),
                                  ref_bloom_positions(values, 1 << 20, 16))
    expected = np.uint64(0)
    for h in ref64(values, EXACT_SEED):
        expected ^= h
    assert _exact_sum(data, offsets, EXACT_SEED) == expected


@settings(max_examples=200, deadline=None)
@given(st.lists(st.text(max_size=60), max_size=30), st.integers(0, 2**32 - 1))
def test_property_text(values, seed):
    check_array(pa.array(values, pa.string()), values, seed)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.one_of(st.none(), st.binary(max_size=60)), max_size=30), st.integers(0, 2**32 - 1),
       st.integers(0, 30), st.integers(0, 30))
def test_property_binary_sliced_with_nulls(values, seed, start, length):
    arr = pa.array(values, pa.large_binary()).slice(start, length)
    check_array(arr, values[start:start + length], seed)


# --- Arrow layouts ---------------------------------------------------------------------------

VALUES = ["alpha", "é", "", "中文字", "😀x", "b\x00c", "0123456789abcdef0", "z", "é" * 9]


@pytest.mark.parametrize("typ", [pa.string(), pa.large_string(), pa.string_view()])
def test_sliced(typ):
    arr = pa.array(VALUES, typ)
    for start, length in [(3, 5), (0, 1), (1, 0), (8, 1), (2, 7), (9, 0)]:
        check_array(arr.slice(start, length), VALUES[start:start + length], BLOOM_SEED)
    check_array(arr.slice(3, 5).slice(1, 3), VALUES[4:7], EXACT_SEED)


@pytest.mark.parametrize("typ", [pa.string(), pa.large_string(), pa.string_view(), pa.binary(), pa.large_binary()])
def test_nulls_do_not_shift_other_values(typ):
    with_nulls = [None, "alpha", None, None, "中文字", "", None, "0123456789abcdef0", None]
    values = [None if v is None else (v.encode() if typ in (pa.binary(), pa.large_binary()) else v) for v in with_nulls]
    arr = pa.array(values, typ)
    check_array(arr, values, 7)
    check_array(arr.slice(1, 6), values[1:7], 7)
    dense = [v for v in values if v is not None]
    offsets, data = string_buffers(arr)
    h = hash64_all(data, offsets, 7)
    np.testing.assert_array_equal(h[arr.is_valid().to_numpy(zero_copy_only=False)], ref64(dense, 7))


def test_string_view_with_long_and_short_values():
    """string_view keeps values up to 12 bytes inline and longer ones in data buffers."""
    values = ["short", "x" * 12, "y" * 13, None, "中" * 40, ""]
    check_array(pa.array(values, pa.string_view()), values, BLOOM_SEED + 3)


def test_dictionary_is_decoded():
    values = ["b", "a", None, "b", "中", "a"]
    for typ in (pa.string(), pa.large_string()):
        arr = pa.array(values, typ).dictionary_encode()
        check_array(arr, values, EXACT_SEED)
        check_array(arr.slice(2, 3), values[2:5], EXACT_SEED)


@pytest.mark.parametrize("typ", [pa.string(), pa.large_string(), pa.string_view(), pa.binary()])
def test_empty_arrays(typ):
    for arr in (pa.array([], typ), pa.array(["abc", "de"], typ).slice(1, 0), pa.array(["abc"], typ).slice(1)):
        offsets, data = string_buffers(arr)
        assert len(offsets) == 1
        assert hash32_all(data, offsets, 0).shape == (0,) and hash32_all(data, offsets, 0).dtype == np.uint32
        assert hash64_all(data, offsets, 0).shape == (0,) and hash64_all(data, offsets, 0).dtype == np.uint64


def test_all_empty_or_null_from_polars():
    """polars exports an all-empty column with a zero-size data buffer at a dangling address."""
    for values in (["", None, ""], [None, None], []):
        check_array(pl.Series(values, dtype=pl.String).to_arrow(), values, BLOOM_SEED)


@pytest.mark.parametrize("off_dtype", [np.int32, np.int64])
def test_no_data_buffer(off_dtype):
    """A data buffer of None (the C data interface allows it when there are no value bytes; pyarrow
    itself substitutes a zero-size buffer, so this is the buffer step on its own)."""
    off_buf = pa.py_buffer(np.zeros(4, off_dtype).tobytes())
    offsets, data = _views(3, 0, off_buf, None, np.dtype(off_dtype))
    assert data.dtype == np.uint8 and len(data) == 0 and offsets.dtype == off_dtype and len(offsets) == 4
    np.testing.assert_array_equal(hash32_all(data, offsets, BLOOM_SEED), ref32([""] * 3, BLOOM_SEED))
    np.testing.assert_array_equal(hash64_all(data, offsets, EXACT_SEED), ref64([""] * 3, EXACT_SEED))
    offsets, data = _views(0, 0, None, None, np.dtype(off_dtype))
    assert offsets.tolist() == [0] and hash64_all(data, offsets, 0).shape == (0,)


@pytest.mark.parametrize("typ,off_dtype", [(pa.string(), np.int32), (pa.large_string(), np.int64),
                                           (pa.binary(), np.int32), (pa.large_binary(), np.int64)])
def test_buffers_are_zero_copy_views(typ, off_dtype):
    arr = pa.array(["ab", None, "cde", "fgh", "i"], typ).slice(2, 2)
    offsets, data = string_buffers(arr)
    _, off_buf, data_buf = arr.buffers()
    assert offsets.dtype == off_dtype and data.dtype == np.uint8
    assert offsets.ctypes.data == off_buf.address + arr.offset * np.dtype(off_dtype).itemsize
    assert data.ctypes.data == data_buf.address
    assert offsets.tolist() == [2, 5, 8]
    assert not offsets.flags.writeable and not data.flags.writeable


def test_converted_buffers_outlive_the_conversion():
    """A string_view or dictionary array is converted; the views keep the converted buffers alive."""
    offsets, data = string_buffers(pa.array(["q" * 20, "r" * 30], pa.string_view()))
    gc.collect()
    assert bytes(data[offsets[0]:offsets[2]]) == b"q" * 20 + b"r" * 30


def test_refuses_other_inputs():
    with pytest.raises(TypeError, match="ChunkedArray"):
        string_buffers(pa.chunked_array([["a"], ["b"]]))
    with pytest.raises(TypeError, match="int64"):
        string_buffers(pa.array([1, 2]))
    with pytest.raises(TypeError, match="list"):
        string_buffers(["a", "b"])


def test_string_view_cast_matches_direct():
    values = VALUES + [None]
    a = string_buffers(pa.array(values, pa.string_view()))
    b = string_buffers(pc.cast(pa.array(values, pa.string()), pa.large_string()))
    np.testing.assert_array_equal(hash32_all(a[1], a[0], 1), hash32_all(b[1], b[0], 1))
