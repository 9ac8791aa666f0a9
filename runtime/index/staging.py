"""Pinned staging: a snapshot's memory maps copied into pinned host memory by several threads, for
DMA to one GPU or several (`runtime.index.loader` copies from here), and the memory maps themselves as
CPU tensors, which the CPU serves.

Arrays keep their dtypes, but uint64 (the matcher rows' bits) becomes int64: torch kernels handle
bits as int64.
"""

from __future__ import annotations

import threading
import warnings
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch

from sidindex.artifact import THREADS
from sidindex.timing import StageClock

# Staging copies a memory map into pinned memory in chunks of this many bytes on THREADS threads
# (numpy's copy releases the GIL): one thread copies about 1 GB/s out of a cold map, faulting its
# pages in one by one. The bench sets 1 to measure the single-threaded copy as a reference.
STAGE_CHUNK = 1 << 24
STAGE_THREADS = THREADS
_ALIGN = 64  # bytes: every staged array starts on a cache line


def _host(a: np.ndarray) -> np.ndarray:
    return a.view(np.int64) if a.dtype == np.uint64 else a  # torch kernels handle bits as int64


class Arena:
    """One pinned host buffer that every load of the process stages through, kept between loads:
    pinning memory costs about 0.6 s per GB on the H200 host (3.6 s of a 5.7 GB snapshot's load,
    against 0.13 s to copy into it), so a swap reuses the memory the previous load pinned. It grows
    (by a quarter more than asked, for a catalog that grows) when a snapshot needs more; `lock` is
    held from staging until every device's copy is done. `free_staging` gives it back."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.buffer: torch.Tensor | None = None

    def take(self, nbytes: int) -> torch.Tensor:
        """(nbytes,) uint8 pinned host memory (the caller holds `lock`)."""
        if self.buffer is None or len(self.buffer) < nbytes:
            self.buffer = None  # the old one first: the host keeps one
            self.buffer = torch.empty(nbytes + nbytes // 4, dtype=torch.uint8, pin_memory=True)
        return self.buffer[:nbytes]


ARENA = Arena()  # the process's one staging arena


def free_staging() -> None:
    """Give back the pinned staging memory loads keep between swaps (the next load pins anew)."""
    with ARENA.lock:
        ARENA.buffer = None


def stage_arrays(arrays: dict[str, np.ndarray], clock: StageClock, *, pinned: bool = True) -> dict[str, torch.Tensor]:
    """Host tensors holding `arrays` (read-only memory maps), for DMA to GPUs: views of the pinned
    staging arena (`ARENA`; the caller holds its lock until the copies are done), or fresh
    unpinned tensors when `pinned` is False (needs no CUDA: the bench's host-copy figure), lap
    "pin", then filled by STAGE_THREADS threads copying STAGE_CHUNK-byte pieces, lap "stage"."""
    arrays = {n: _host(a) for n, a in arrays.items()}
    if pinned:
        starts = np.cumsum([0] + [-(-a.nbytes // _ALIGN) * _ALIGN for a in arrays.values()]).tolist()
        arena = ARENA.take(starts[-1])
        out = {n: arena[lo:lo + a.nbytes].view(getattr(torch, str(a.dtype))).view(a.shape)
               for (n, a), lo in zip(arrays.items(), starts)}
        clock.lap("pin")
    else:
        out = {n: torch.empty(a.shape, dtype=getattr(torch, str(a.dtype))) for n, a in arrays.items()}
    pieces = []
    for n, a in arrays.items():
        src, dst = a.reshape(-1).view(np.uint8), out[n].numpy().reshape(-1).view(np.uint8)
        pieces += [(dst[lo:lo + STAGE_CHUNK], src[lo:lo + STAGE_CHUNK]) for lo in range(0, len(src), STAGE_CHUNK)]
    with ThreadPoolExecutor(STAGE_THREADS) as pool:
        for _ in pool.map(lambda piece: np.copyto(*piece), pieces):
            pass
    clock.lap("stage")
    return out


def mapped(a: np.ndarray) -> torch.Tensor:
    """The memory map itself as a CPU tensor (no copy; nothing writes to it)."""
    with warnings.catch_warnings():  # torch warns that the buffer is read-only; we never write
        warnings.simplefilter("ignore", UserWarning)
        return torch.from_numpy(_host(a))
