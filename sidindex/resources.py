"""The process's address-space limit (`ulimit -v`, RLIMIT_AS), and the libraries sized to fit it.

Under that limit memory only reserved counts as much as memory used, and libraries reserve
generously as they start: glibc a 64 MiB heap for each thread that allocates (up to 8 per core),
pyarrow's mimalloc a 1 GiB arena, OpenBLAS a 32 MiB buffer per thread in each of its copies (numpy,
scipy and faiss each load one), every thread its stack. Several cannot report a reservation that
failed: OpenBLAS retries it forever or crashes, Rust code (polars) aborts the process. So an entry
point calls `fit_to_limit` before those libraries load, which sizes their thread pools and
allocators to the limit (a setting of the user's own is kept), and `check_limit` to refuse a
command whose libraries alone would not fit, with the MemoryError any failed allocation raises.
Without a limit both do nothing. `is_out_of_memory` tells the errors that say memory ran out.
"""

from __future__ import annotations

import ctypes
import errno
import importlib.util
import os
import resource
from collections.abc import MutableMapping
from pathlib import Path

GiB = 1 << 30
# A thread of each pool for every GiB of limit: a thread's reservations, summed over the pools and
# the libraries' copies, come to about 200 MiB
THREAD_SHARE = GiB
# Each library's own thread count; OMP_NUM_THREADS also sizes pyarrow's CPU pool and torch's
THREAD_VARIABLES = ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS", "NUMBA_NUM_THREADS",
                    "POLARS_MAX_THREADS", "RAYON_NUM_THREADS", "ARROW_IO_THREADS")
_M_ARENA_MAX = -8  # glibc's mallopt parameter

# GiB of address space a command needs to load its libraries and run a small input, by the
# heaviest library it loads: the least it ran in under `ulimit -v` (2 cores, the pools sized by
# `fit_to_limit`, torch built for the CPU), plus a margin. Below it, failures crash or hang.
FLOORS = {"numpy": 0.85, "faiss": 1.25, "torch": 1.4}
# What a CUDA build of torch maps beyond a CPU build before its import ends (3.1 GiB against 0.6)
CUDA_TORCH = 2.6

# What a refused reservation or thread reads as, in whatever type a library raises: Python's thread
# start, the dynamic loader mapping a library, ENOMEM's text, torch's CPU allocator, pyarrow's
# pools, CUDA (which reports address space it could not reserve so too)
MEMORY_MESSAGES = ("can't start new thread", "failed to map segment", "cannot allocate memory",
                   "can't allocate memory", "failed to launch worker thread", "out of memory")


def address_space_limit() -> int | None:
    """The soft RLIMIT_AS in bytes, or None when there is none."""
    soft, _hard = resource.getrlimit(resource.RLIMIT_AS)
    return None if soft == resource.RLIM_INFINITY else int(soft)


def limited_threads(limit: int | None = None) -> int | None:
    """Threads per pool that fit under `limit` (default: this process's), at most one per core;
    None without a limit."""
    limit = address_space_limit() if limit is None else limit
    if limit is None:
        return None
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return max(1, min(cores, limit // THREAD_SHARE))


def fit_to_limit(environ: MutableMapping[str, str] = os.environ) -> dict[str, str]:
    """Under an address-space limit, size the libraries' threads and allocators to it: in `environ`
    (read by each library as it loads, so call this before numpy, polars, pyarrow, numba or torch
    are imported) every variable the user has not set, and glibc's number of heaps. Returns what
    was set; nothing without a limit."""
    threads = limited_threads()
    if threads is None:
        return {}
    values = dict.fromkeys(THREAD_VARIABLES, str(threads))
    values["ARROW_DEFAULT_MEMORY_POOL"] = "system"  # not mimalloc, whose first arena reserves 1 GiB
    added = {k: v for k, v in values.items() if k not in environ}
    environ.update(added)
    if "MALLOC_ARENA_MAX" not in environ:  # glibc read its own variable when the process started
        _malloc_arenas(threads)
    return added


def _malloc_arenas(count: int) -> None:
    """At most `count` glibc heaps for the threads to share (one more is the main thread's)."""
    try:
        libc = ctypes.CDLL(None)
        if hasattr(libc, "gnu_get_libc_version"):  # mallopt's parameter is glibc's; musl has none
            libc.mallopt(_M_ARENA_MAX, count)
    except OSError:  # no C library to load symbols from: nothing to size
        pass


def check_limit(library: str | None) -> None:
    """Raise MemoryError when the address-space limit is below what a command whose heaviest
    library is `library` (a key of FLOORS; None: nothing to check) needs to load its libraries."""
    limit = address_space_limit()
    if library is None or limit is None:
        return
    needs = (FLOORS[library] + (CUDA_TORCH if library == "torch" and _cuda_torch() else 0.0)) * GiB
    if limit < needs:
        raise MemoryError(f"the address-space limit (ulimit -v) is {limit / GiB:.2f} GiB, below the {needs / GiB:.2f} "
                          "GiB its libraries need to load")


def _cuda_torch() -> bool:
    """Whether the torch installed is a CUDA build, found without importing it."""
    spec = importlib.util.find_spec("torch")
    places = (spec.submodule_search_locations or []) if spec is not None else []
    return any(next(Path(p, "lib").glob("libtorch_cuda*"), None) is not None for p in places)


def is_out_of_memory(e: BaseException) -> bool:
    """Whether `e` says an allocation, a mapping or a thread was refused (a MemoryError, ENOMEM, a
    thread that could not start, a shared library that could not be mapped), or was raised while
    handling such an error (a reader of ours reports one met in reading a file as that file's)."""
    seen: set[int] = set()
    at: BaseException | None = e
    while at is not None and id(at) not in seen:
        seen.add(id(at))
        if isinstance(at, MemoryError) or (isinstance(at, OSError) and at.errno == errno.ENOMEM):
            return True
        if any(m in str(at).lower() for m in MEMORY_MESSAGES):
            return True
        at = at.__cause__ or at.__context__
    return False
