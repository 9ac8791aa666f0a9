"""Snapshot arrays as Arrow IPC files (layout in `schemas.artifacts.ArrayFile`).

Writing: one record batch, one column, uncompressed, so the column's values are one contiguous,
aligned buffer of the file. Mapping: the file is opened as a regular file (never a link or a FIFO),
memory-mapped read-only, and the array is a numpy view of the column's values buffer: nothing is
parsed or copied, and the pages are shared by every process mapping the file. Before a view is
made the file must hold exactly one batch of the expected column type, without nulls, whose
buffers hold the length it claims (`RecordBatch.validate`) and the length the manifest says.
"""

from __future__ import annotations

import mmap
import os
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import BinaryIO

import numpy as np
import pyarrow as pa

from schemas.artifacts import ArrayFile
from sidindex.artifact import open_regular
from sidindex.errors import ArtifactError


def _arrow_type(spec: ArrayFile, width: int | None) -> pa.DataType:
    value = pa.from_numpy_dtype(np.dtype(spec.dtype))
    return value if width is None else pa.list_(value, width)


def write_array(directory: Path, spec: ArrayFile, array: np.ndarray) -> None:
    """Write `array` (1-D, or 2-D for a spec with a width) as `directory/spec.file` (the caller fsyncs)."""
    a = np.ascontiguousarray(array, dtype=spec.dtype)
    with pa.OSFile(str(directory / spec.file), "wb") as sink:
        _write_batch(sink, spec, a)


def write_array_pieces(directory: Path, spec: ArrayFile, shape: tuple[int, ...], pieces: Iterable[np.ndarray]) -> None:
    """Write the array of `shape` whose rows are `pieces`, in order, as `write_array` writes it whole,
    holding one piece at a time (a task writes an array of the catalog's length from its fragments).

    The file is written for a stand-in of the whole array: private anonymous memory that is never
    touched (no page of it is ever resident), which pyarrow hands the sink as one buffer; the sink
    writes the pieces in its place."""
    nbytes = int(np.prod(shape)) * np.dtype(spec.dtype).itemsize
    # read-only: not counted against the memory commit limit, however large (unmapped when dropped)
    stand_in = mmap.mmap(-1, max(nbytes, 1), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS, prot=mmap.PROT_READ)
    a = np.frombuffer(stand_in, dtype=spec.dtype, count=int(np.prod(shape))).reshape(shape)
    with open(directory / spec.file, "wb") as f:
        sink = _PiecesSink(f, a.ctypes.data, nbytes, spec.dtype, iter(pieces))
        with pa.PythonFile(sink, mode="w") as out:
            _write_batch(out, spec, a)
        if not sink.written:
            raise AssertionError(f"{spec.name}: pyarrow did not hand the sink the array's values as one buffer")
        if nbytes == 0 and any(np.asarray(p).size for p in sink.pieces):
            raise ValueError(f"{spec.name}: pieces of an empty array hold values")


class _PiecesSink:
    """A file-like sink writing `pieces` where pyarrow writes the buffer at `address` (`nbytes` long)."""

    def __init__(self, file: BinaryIO, address: int, nbytes: int, dtype: str, pieces: Iterator[np.ndarray]) -> None:
        self.file, self.address, self.nbytes, self.dtype, self.pieces = file, address, nbytes, dtype, pieces
        self.written = nbytes == 0  # an empty array's values are not written at all
        self.closed = False

    def write(self, data: object) -> int:
        if isinstance(data, pa.Buffer) and data.address == self.address and data.size == self.nbytes:
            n = 0
            for piece in self.pieces:
                n += self.file.write(np.ascontiguousarray(piece, dtype=self.dtype).data)
            if n != self.nbytes:
                raise ValueError(f"the pieces hold {n} bytes, the array {self.nbytes}")
            self.written = True
            return n
        return self.file.write(memoryview(data))  # type: ignore[arg-type]  # bytes or a pyarrow buffer

    def tell(self) -> int:
        return self.file.tell()

    def flush(self) -> None:
        self.file.flush()

    def close(self) -> None:
        self.closed = True

    def writable(self) -> bool:
        return True


def _write_batch(sink: pa.NativeFile, spec: ArrayFile, a: np.ndarray) -> None:
    """One record batch of one column holding `a`, as an Arrow IPC file into `sink`."""
    if a.ndim != (1 if spec.width is None else 2):
        raise ValueError(f"{spec.name}: expected {'1' if spec.width is None else '2'} dimensions, got {a.shape}")
    values = pa.array(a.reshape(-1))
    column = values if spec.width is None else pa.FixedSizeListArray.from_arrays(values, a.shape[1])
    batch = pa.record_batch([column], names=[spec.column_name])  # one batch even when empty (a table writes none)
    with pa.ipc.new_file(sink, batch.schema) as writer:
        writer.write_batch(batch)


def map_array(directory: Path, spec: ArrayFile, shape: tuple[int, ...]) -> np.ndarray:
    """A read-only view of the array in `directory/spec.file`, which must hold exactly `shape`."""
    path = directory / spec.file
    fd = open_regular(path)
    try:
        if os.fstat(fd).st_size == 0:
            raise ArtifactError(f"{path}: empty; not an Arrow IPC file")
        mm = mmap.mmap(fd, 0, access=mmap.ACCESS_READ)
        # only the Arrow metadata is read here (the footer at the end, the batch header at the start):
        # fault in just those pages, not the kernel's read-around window of data around each
        mm.madvise(mmap.MADV_RANDOM)
    except OSError as e:
        raise ArtifactError(f"{path}: cannot be mapped ({e.strerror})") from None
    finally:
        os.close(fd)
    width = shape[1] if len(shape) == 2 else None
    want = _arrow_type(spec, width)
    try:
        reader = pa.ipc.open_file(pa.py_buffer(mm))
        if reader.num_record_batches != 1:
            raise ArtifactError(f"{path}: holds {reader.num_record_batches} record batches, expected 1")
        batch = reader.get_batch(0)
        batch.validate()  # buffer sizes agree with the lengths they claim: nothing reads past them
        schema = batch.schema
        if len(schema) != 1 or schema[0].name != spec.column_name or schema[0].type != want:
            found = ", ".join(f"{f.name}: {f.type}" for f in schema)
            raise ArtifactError(f"{path}: holds columns ({found}), expected ({spec.column_name}: {want})")
        column = batch.column(0)
        if column.null_count or (width is not None and column.values.null_count):
            raise ArtifactError(f"{path}: column {spec.column_name!r} holds nulls")
        if len(column) != shape[0]:
            raise ArtifactError(f"{path}: {len(column)} rows, the manifest says {shape[0]}")
        values = column if width is None else column.flatten()
        out = values.to_numpy(zero_copy_only=True)
        mm.madvise(mmap.MADV_NORMAL)  # the data is read in order (validation, staging): read ahead again
        base = pa.py_buffer(mm).address
        if out.size and not base <= out.ctypes.data <= base + len(mm) - out.nbytes:
            # a compressed (or byte-swapped) file decodes onto the heap: unbounded, and not the map
            raise ArtifactError(f"{path}: its values are not stored plainly in the file (compressed?); snapshot "
                                "arrays are uncompressed Arrow IPC")
    except (pa.ArrowException, OSError, ValueError) as e:  # a corrupt file: pyarrow validates, never trusts it
        raise ArtifactError(f"{path}: not a valid Arrow IPC array file ({str(e).splitlines()[0][:200]})") from None
    return out.reshape(shape)


def same_memory(a: np.ndarray, b: np.ndarray) -> bool:
    """Whether a and b are one array: the same bytes at the same address, shape and dtype (e.g. a
    map and a view of it, or an array an update kept from its base)."""
    return (a.__array_interface__["data"][0] == b.__array_interface__["data"][0] and a.shape == b.shape
            and a.dtype == b.dtype)


def prefault_pages(array: np.ndarray) -> None:
    """Fault in every page under a mapped array (reading one byte per page maps it into this
    process; the kernel reads ahead around it)."""
    flat = array.reshape(-1).view(np.uint8)
    int(flat[::mmap.PAGESIZE].sum(dtype=np.uint64))
