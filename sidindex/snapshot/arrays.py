"""Raw array files: a 64-byte header, then the array's bytes (C order, little-endian).

    offset  size  field
    0       8     magic b"SIDXARR\\0"
    8       4     format version (uint32 LE)
    12      8     dtype, numpy str padded with NUL (e.g. "<u8")
    20      4     ndim (uint32 LE, 1..4)
    24      32    shape, 4 x uint64 LE (unused dims 0)
    56      8     reserved, zero

Reading memory-maps the file read-only (pages are shared by every process that opens it, and
nothing is parsed or copied); the header is checked against the manifest's dtype and shape and
the file's size before any array is made from it.
"""

from __future__ import annotations

import math
import mmap
import struct
from pathlib import Path

import numpy as np

from sidindex.errors import ArtifactError

MAGIC = b"SIDXARR\0"
VERSION = 1
HEADER = 64
DTYPES = ("<i2", "<i4", "<i8", "<u8", "<f4", "|u1")  # what snapshots hold; nothing else is mapped
_FMT = "<8sI8sI4Q8x"


def write_array(path: Path, array: np.ndarray) -> None:
    """Write `array` to a new file at `path` (the caller fsyncs)."""
    a = np.ascontiguousarray(array)
    dt = a.dtype.newbyteorder("<") if a.dtype.byteorder == ">" else a.dtype
    if dt.str not in DTYPES or not 1 <= a.ndim <= 4:
        raise ValueError(f"cannot store {a.dtype}{a.shape} in a snapshot")
    shape = list(a.shape) + [0] * (4 - a.ndim)
    with path.open("xb") as f:
        f.write(struct.pack(_FMT, MAGIC, VERSION, dt.str.encode(), a.ndim, *shape))
        f.write(memoryview(a.astype(dt, copy=False).reshape(-1)).cast("B"))


def map_array(path: Path, dtype: str, shape: tuple[int, ...]) -> np.ndarray:
    """A read-only view of the array in `path`, which must hold exactly dtype and shape."""
    try:
        with path.open("rb") as f:
            size = f.seek(0, 2)
            if size < HEADER:
                raise ArtifactError(f"{path}: {size} bytes, shorter than the {HEADER}-byte header (truncated?)")
            f.seek(0)
            magic, version, dt, ndim, *dims = struct.unpack(_FMT, f.read(HEADER))
            if magic != MAGIC:
                raise ArtifactError(f"{path}: not a sidindex array file (bad magic number)")
            if version != VERSION:
                newer = " (written by a newer sidindex: upgrade sidindex)" if version > VERSION else ""
                raise ArtifactError(f"{path}: array format version {version}; this sidindex reads {VERSION}{newer}")
            found = (dt.rstrip(b"\0").decode("ascii", "replace"), tuple(dims[:ndim]) if 1 <= ndim <= 4 else None)
            if found != (dtype, tuple(shape)):
                raise ArtifactError(f"{path}: header says {found[0]}{found[1]}, the manifest {dtype}{tuple(shape)}")
            want = HEADER + math.prod(shape) * np.dtype(dtype).itemsize  # Python ints: no overflow
            if size != want:
                raise ArtifactError(f"{path}: {size} bytes, expected {want} for {dtype}{tuple(shape)} (truncated?)")
            if size == HEADER:  # an empty array: nothing to map
                empty = np.zeros(shape, dtype=dtype)
                empty.flags.writeable = False
                return empty
            mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    except OSError as e:
        raise ArtifactError(f"{path}: cannot read ({e.strerror or e})") from None
    return np.frombuffer(mm, dtype=dtype, offset=HEADER).reshape(shape)


def prefault_pages(array: np.ndarray) -> None:
    """Fault in every page under a mapped array: ask the kernel to read ahead, then read one byte
    per page (reading is what maps a page into this process; readahead alone does not)."""
    base = array
    while base is not None and not isinstance(base, mmap.mmap):
        base = getattr(base, "base", None) if isinstance(base, np.ndarray) else getattr(base, "obj", None)
    if isinstance(base, mmap.mmap) and hasattr(mmap, "MADV_WILLNEED"):
        base.madvise(mmap.MADV_WILLNEED)
    flat = array.reshape(-1).view(np.uint8)
    int(flat[::mmap.PAGESIZE].sum(dtype=np.uint64))
