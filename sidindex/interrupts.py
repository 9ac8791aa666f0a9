"""SIGINT and SIGTERM as exceptions, so an interrupted job unwinds (its `finally` blocks run, its
temporaries go, nothing is published) and an entry point exits with the code a scheduler reads:
128 + the signal's number (130 for SIGINT, 143 for SIGTERM).

Entry points (the CLI, the scheduled rebuild) run inside `interrupts_raise()`; library code never
installs handlers of its own, except `interrupts_deferred()` around a step that must not stop half
way (a publication's commit), which holds a signal until the step is done and then raises it.
Handlers can only be installed in the main thread; elsewhere both are no-ops.
"""

from __future__ import annotations

import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from types import FrameType

SIGNALS = (signal.SIGINT, signal.SIGTERM)


class Interrupted(BaseException):
    """SIGINT or SIGTERM arrived. A BaseException, like KeyboardInterrupt, so that no `except
    Exception` swallows it; not a KeyboardInterrupt, which libraries catch and turn into other
    outcomes (typer returns exit code 130 from a command, for one).

    published: the snapshot whose publication was committing when the signal came, and which
    was therefore completed first (`sidindex.root.Root.publish`); None otherwise.
    """

    def __init__(self, signum: int, published: str | None = None) -> None:
        self.signum, self.published = int(signum), published
        super().__init__(signal.Signals(signum).name)

    @property
    def exit_code(self) -> int:
        return 128 + self.signum

    def describe(self, what: str = "nothing published") -> str:
        """One line for the user: the signal and what it left ("interrupted by SIGINT; nothing published")."""
        left = f"snapshot {self.published} was published first" if self.published else what
        return f"interrupted by {signal.Signals(self.signum).name}; {left}"


def from_signal(e: BaseException) -> bool:
    """Whether `e` stands for a signal that arrived, which code turning a plug-in's failures into
    errors must let through: `Interrupted`, or a KeyboardInterrupt while Python's own SIGINT
    handler is in place (a library caller's Ctrl-C). Under `interrupts_raise` a KeyboardInterrupt
    can only have been raised by code."""
    return isinstance(e, Interrupted) or (isinstance(e, KeyboardInterrupt)
                                          and signal.getsignal(signal.SIGINT) is signal.default_int_handler)


def _raise(signum: int, _frame: FrameType | None) -> None:
    raise Interrupted(signum)


def _main_thread() -> bool:
    return threading.current_thread() is threading.main_thread()


@contextmanager
def interrupts_raise() -> Iterator[None]:
    """Within: SIGINT and SIGTERM raise `Interrupted` in the main thread. A signal the process was
    started ignoring (SIGINT in a shell's background job, `nohup`) stays ignored."""
    if not _main_thread():
        yield
        return
    # polars, when first imported, installs a SIGINT handler that chains to the one in place and
    # restarts the interrupted system call: imported inside, it would hold a SIGINT until a lock
    # wait or a blocking read ends. Imported before, its handler is replaced by ours.
    import polars  # noqa: F401
    previous = {s: signal.getsignal(s) for s in SIGNALS}
    for s, handler in previous.items():
        if handler is not signal.SIG_IGN:
            signal.signal(s, _raise)
    try:
        yield
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)


@contextmanager
def interrupts_deferred() -> Iterator[list[int]]:
    """Within: SIGINT and SIGTERM are recorded, not acted on; on a normal exit the first one
    recorded is delivered to the handler that was in place (raising `Interrupted` under
    `interrupts_raise`). Yields the list of recorded signals (a caller may look before leaving)."""
    held: list[int] = []
    if not _main_thread():
        yield held
        return
    previous = {s: signal.getsignal(s) for s in SIGNALS}
    for s, handler in previous.items():
        if handler is not signal.SIG_IGN:
            signal.signal(s, lambda signum, _frame: held.append(signum))
    try:
        yield held
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
    if held:
        handler = previous[signal.Signals(held[0])]
        if callable(handler):
            handler(held[0], None)
        elif handler == signal.SIG_DFL:
            signal.raise_signal(held[0])
