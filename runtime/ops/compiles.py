"""Triton kernels compiled (or loaded from Triton's disk cache), per thread: what a serving counter
reports, since a compile on the serving thread stalls every batch behind it (seconds cold, tens of
ms warm), while one on a thread warming a new snapshot stalls nobody. Counted through Triton's
`jit_post_compile_hook`, chained to a hook set before; nothing is counted until `count_compiles()`
installs it (a GPU serving path does), and where this Triton has no such hook `compiles()` stays 0.
"""

from __future__ import annotations

import threading

_lock = threading.Lock()
_counts: dict[int, int] = {}  # by thread ident
_installed = False


def count_compiles() -> None:
    """Count every Triton compile from now on (idempotent; imports triton)."""
    global _installed
    if _installed:  # every batch of a serving path asks: no lock once it is
        return
    with _lock:
        if _installed:
            return
        try:
            from triton import knobs
        except ImportError:  # a Triton without knobs: nothing to count with
            _installed = True
            return
        before = knobs.runtime.jit_post_compile_hook

        def hook(*args, **kwargs):
            me = threading.get_ident()
            with _lock:
                _counts[me] = _counts.get(me, 0) + 1
            return before(*args, **kwargs) if before is not None else None

        knobs.runtime.jit_post_compile_hook = hook
        _installed = True


def compiles() -> int:
    """Triton kernels this thread compiled or loaded since `count_compiles()`."""
    return _counts.get(threading.get_ident(), 0)
