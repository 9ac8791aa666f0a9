"""Users' scorers named MODULE:FACTORY (docs/design.md §12): loaded, called under a timeout, and
checked, every failure a ScorerError of one line that names the scorer."""

from __future__ import annotations

import importlib
import os
import signal
import sys
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING

import torch

from sidindex.errors import ScorerError
from sidindex.interrupts import from_signal

if TYPE_CHECKING:
    from runtime.index.served import ServedIndex
    from sidindex.requests import Requests


def load_factory(spec: str, timeout: float | None = None) -> ScorerFactory:
    """The scorer factory named by 'MODULE:FACTORY' (MODULE importable from the working directory
    or PYTHONPATH): FACTORY(batch: pyarrow.Table, device: torch.device, level_sizes) -> Scorer.
    timeout: seconds any one call into the user's code (the import, the factory, a scorer step)
    may take before it is a ScorerError; None: no limit. It interrupts Python code; a call stuck in
    native code is interrupted when it returns to Python (main thread only)."""
    module, sep, name = spec.partition(":")
    if not sep or not module or not name.isidentifier():
        raise ScorerError(f"scorer {spec!r}: expected MODULE:FACTORY, e.g. my_model:make_scorer")
    if "" not in sys.path and os.getcwd() not in sys.path:  # the working directory, as `python -m` would
        sys.path.insert(0, os.getcwd())
    mod = users(spec, f"cannot import {module!r}", importlib.import_module, module, timeout=timeout)
    factory = users(spec, f"reading {name!r} of {module!r}", getattr, mod, name, None, timeout=timeout)
    if not callable(factory):
        raise ScorerError(f"scorer {spec!r}: module {module!r} ({mod.__file__}) has no callable {name!r}")
    return ScorerFactory(factory, spec, timeout)


def as_factory(scorer) -> ScorerFactory | None:
    """A scorer argument as a ScorerFactory: None (the codebook scorer) stays None, 'MODULE:FACTORY'
    is loaded (`load_factory`), a ScorerFactory is itself, and a plain function
    FACTORY(batch, device, level_sizes) -> Scorer is wrapped under its name."""
    if scorer is None or isinstance(scorer, ScorerFactory):
        return scorer
    if isinstance(scorer, str):
        return load_factory(scorer)
    if callable(scorer):
        return ScorerFactory(scorer, getattr(scorer, "__qualname__", type(scorer).__name__))
    raise ScorerError(f"scorer: expected 'MODULE:FACTORY', a factory function or a ScorerFactory, got "
                      f"{type(scorer).__name__}")


class _TimedOut(BaseException):
    """A call into the user's code outlived its timeout (raised by the alarm)."""


def users(spec: str, what: str, fn, *args, timeout: float | None = None):
    """fn(*args), code of the user's scorer module: whatever it raises, SystemExit and other
    BaseExceptions included, is a ScorerError naming the scorer and `what` failed; only a signal
    that arrived (`sidindex.interrupts.from_signal`) passes through. With `timeout` (seconds), a
    call still running then is a ScorerError too."""
    try:
        with _deadline(timeout):
            return fn(*args)
    except _TimedOut:
        raise ScorerError(f"scorer {spec!r}: {what}: no result within {timeout:g} s (the scorer timeout)") from None
    except BaseException as e:
        if from_signal(e):
            raise
        raise ScorerError(f"scorer {spec!r}: {what}: {_described(e)}") from None


@contextmanager
def _deadline(seconds: float | None) -> Iterator[None]:
    """Within: `_TimedOut` once `seconds` have passed (SIGALRM; the main thread only)."""
    if not seconds or threading.current_thread() is not threading.main_thread():
        yield
        return

    def expire(_signum, _frame):
        raise _TimedOut

    previous = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def _described(e: BaseException) -> str:
    """'ValueError: bad shape'; 'it called sys.exit(3)' for a SystemExit."""
    if isinstance(e, SystemExit):
        return f"it called sys.exit({'' if e.code is None else repr(e.code)})"
    try:
        text = str(e)
    except Exception:  # the user's __str__
        text = ""
    return f"{type(e).__name__}: {text}" if text else type(e).__name__


class ScorerFactory:
    """A user's factory and the scorers it makes, failing with one line that names them."""

    def __init__(self, factory, spec: str, timeout: float | None = None) -> None:
        self.factory, self.spec, self.timeout = factory, spec, timeout

    def for_batch(self, batch, device: torch.device, level_sizes: tuple[int, ...]):
        scorer = users(self.spec, "the factory failed", self.factory, batch, device, level_sizes,
                       timeout=self.timeout)
        if not callable(scorer):
            raise ScorerError(f"scorer {self.spec!r}: the factory returned {type(scorer).__name__}, not a scorer "
                              "(a callable scorer(step, tokens, parent) -> logits)")
        return _Checked(scorer, self.spec, max(level_sizes), self.timeout)


class _Checked:
    """Calls a user's scorer and checks what it returns (host metadata only: no device sync); its
    attributes (`inputs`, `prefix_independent`) are the wrapped scorer's, their reading and calling
    failing as a ScorerError too."""

    def __init__(self, scorer, spec: str, V: int, timeout: float | None = None) -> None:
        self.scorer, self.spec, self.V, self.timeout = scorer, spec, V, timeout

    def __getattr__(self, name: str):
        spec, timeout = self.__dict__["spec"], self.__dict__["timeout"]
        try:
            attr = getattr(self.__dict__["scorer"], name)
        except AttributeError:  # absent: a getattr with a default takes that
            raise
        except BaseException as e:
            if from_signal(e):
                raise
            raise ScorerError(f"scorer {spec!r}: reading its {name!r} failed: {_described(e)}") from None
        if not callable(attr):
            return attr
        return lambda *args: users(spec, f"its {name!r} failed", attr, *args, timeout=timeout)

    def __call__(self, step: int, tokens: torch.Tensor, parent: torch.Tensor | None) -> torch.Tensor:
        out = users(self.spec, f"failed at step {step}", self.scorer, step, tokens, parent, timeout=self.timeout)
        want = (*tokens.shape[:2], self.V)
        if not isinstance(out, torch.Tensor) or tuple(out.shape) != want or not out.is_floating_point() \
                or out.device != tokens.device:
            got = (f"{tuple(out.shape)} {out.dtype} on {out.device}" if isinstance(out, torch.Tensor)
                   else type(out).__name__)
            raise ScorerError(f"scorer {self.spec!r} returned {got} at step {step}; expected float logits of shape "
                              f"{want} on {tokens.device}")
        return out


def factory_scorer(factory: str | ScorerFactory, index: ServedIndex,
                   requests: Requests) -> Callable[[slice], _Checked]:
    """rows -> the scorer that the user's factory 'MODULE:FACTORY' (`load_factory`)
    makes for requests[rows], given those rows with every column of the request file as a
    pyarrow.Table, the index's device and level sizes. Errors name the factory (ScorerError)."""
    named = as_factory(factory)
    assert named is not None  # a factory given (None is the codebook scorer's)

    def for_rows(rows: slice) -> _Checked:
        batch = requests.table.slice(rows.start, rows.stop - rows.start)
        return named.for_batch(batch, index.device, index.level_sizes)

    return for_rows
