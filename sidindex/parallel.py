"""numba's parallel loops, sized: a parallel launch wakes every numba thread, which costs far more
than a short loop (about 4 ms per call on a 2-core VM, or under a loaded host, against 1 us on
one thread), so a kernel runs on all threads only when its input is long enough to repay it.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import ParamSpec, TypeVar

import numba
import numpy as np

P = ParamSpec("P")
R = TypeVar("R")

# a pass over fewer items runs on one thread: a few ms, about what waking every thread costs on a
# loaded host; the checks of a snapshot, an update's trie passes and the cover checks share it
PARALLEL_ITEMS = 1 << 22


def sized(min_items: int = PARALLEL_ITEMS, arg: int = 0) -> Callable[[Callable[P, R]], Callable[P, R]]:
    """Decorator for a numba `parallel=True` kernel (called from Python): all of numba's threads
    when its argument number `arg` holds `min_items` items or more (`np.size`; by default
    PARALLEL_ITEMS, the one threshold of passes over whole arrays), else one thread
    (`numba.set_num_threads` is per calling thread, so concurrent callers do not interfere)."""
    def wrap(kernel: Callable[P, R]) -> Callable[P, R]:
        def run(*args: P.args, **kwargs: P.kwargs) -> R:
            if np.asarray(args[arg]).size >= min_items:  # as np.size
                return kernel(*args, **kwargs)
            threads = numba.get_num_threads()
            numba.set_num_threads(1)
            try:
                return kernel(*args, **kwargs)
            finally:
                numba.set_num_threads(threads)
        # the kernel's name and docstring, and its Python function (`py_func`), as numba's dispatcher has it
        functools.update_wrapper(run, kernel, assigned=("__doc__", "__name__", "py_func"), updated=())
        return run
    return wrap
