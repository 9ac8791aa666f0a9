"""SIGINT and SIGTERM as exceptions, so an interrupted job unwinds (its `finally` blocks run, its
temporaries go, nothing is published) and an entry point exits with the code a scheduler reads:
128 + the signal's number (130 for SIGINT, 143 for SIGTERM).

Entry points (the CLI, the scheduled rebuild) run inside `interrupts_raise()`; library code never
installs handlers of its own, except `interrupts_deferred()` around a step that must not stop half
way (a publication's commit), which holds a signal until the step is done and then raises it.
Handlers can only be installed in the main thread; elsewhere both are no-ops.

Once a job has committed its result (`committed`: a snapshot is CURRENT), a signal can no longer
stop anything that matters, and turning a success into a failure would make a scheduler retry a
job that succeeded: under `interrupts_raise` such a signal is noted (`noted`), not raised, until
the next job begins (`job_starts`, which raises it then, before that job changes anything) or the
entry point ends; with `keep`, until the process exits. The entry point then reports the success
and the signal.
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

    published: the snapshot an earlier job of the process published before the signal stopped
    this one (`job_starts`); None otherwise.
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


_committed: list[str] = []  # snapshots published since the current job began (under `interrupts_raise`)
_noted: list[int] = []  # signals that came after that


def committed(snapshot_id: str) -> None:
    """Called once a job's result is committed (snapshot `snapshot_id` is CURRENT): from now on a
    signal is noted, not raised (see the module docstring)."""
    _committed.append(snapshot_id)


def job_starts() -> None:
    """Called as a job begins changing things: a signal noted after an earlier job's commit is
    raised now (saying what that job published), and signals raise again."""
    published = _committed[-1] if _committed else None
    _committed.clear()
    if _noted:
        signum = _noted.pop(0)
        _noted.clear()
        raise Interrupted(signum, published)


def noted() -> tuple[list[int], str | None]:
    """The signals noted since a job committed, and the snapshot it published (None: none)."""
    return list(_noted), (_committed[-1] if _committed else None)


def _raise(signum: int, _frame: FrameType | None) -> None:
    if _committed:
        _noted.append(signum)
        return
    raise Interrupted(signum)


def _main_thread() -> bool:
    return threading.current_thread() is threading.main_thread()


@contextmanager
def interrupts_raise(keep: bool = False) -> Iterator[None]:
    """Within: SIGINT and SIGTERM raise `Interrupted` in the main thread, or are noted once a job
    committed (`committed`). A signal the process was started ignoring (SIGINT in a shell's
    background job, `nohup`) stays ignored. keep: an entry point whose process ends with the
    block: after a commit the handlers stay, noting signals until the process has exited (its exit
    code is the success's)."""
    if not _main_thread():
        yield
        return
    _committed.clear()
    _noted.clear()
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
        if not (keep and _committed):
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
