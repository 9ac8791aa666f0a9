"""numba's parallel loops, sized: a parallel launch wakes every numba thread, which costs far more
than a short loop (about 4 ms per call on a 2-core VM, or under a loaded host, against 1 us on
one thread), so a kernel runs on all threads only when its input is long enough to repay it.
"""

from __future__ import annotations

from collections.abc import Callable

import numba
import numpy as np


def sized(min_items: int, arg: int = 0) -> Callable:
    """Decorator for a numba `parallel=True` kernel (called from Python): all of numba's threads
    when its argument number `arg` holds `min_items` items or more (`np.size`), else one thread
    (`numba.set_num_threads` is per calling thread, so concurrent callers do not interfere)."""
    def wrap(kernel):
        def run(*args):
            if np.size(args[arg]) >= min_items:
                return kernel(*args)
            threads = numba.get_num_threads()
            numba.set_num_threads(1)
            try:
                return kernel(*args)
            finally:
                numba.set_num_threads(threads)
        run.__doc__, run.__name__, run.py_func = kernel.__doc__, kernel.__name__, kernel.py_func
        return run
    return wrap
