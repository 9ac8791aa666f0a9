"""`sidindex ARGS` through the console script's own entry point, `sidindex_cli.app.main`, in the test's
process: the exit code, report and one-line error the script gives, without the 1-2 s a new
interpreter spends importing torch, polars and numba. For the variations of a behaviour: each
behaviour keeps a test of the installed script itself (`tests.conftest.run_cli`), which alone sees
what a fresh process adds (output of its imports, the exit code the interpreter ends with)."""

from __future__ import annotations

import importlib
import os
import signal
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path


def run_main(monkeypatch, capsys, *args, cwd: Path | None = None,
             timeout: float | None = None) -> subprocess.CompletedProcess:
    """What `run_cli(*args, cwd=cwd)` returns (exit code, stdout, stderr), from `main` in this
    process; `timeout` is taken for run_cli's signature and unused."""
    from sidindex_cli.app import main

    return run_entry(monkeypatch, capsys, main, ["sidindex", *map(str, args)], cwd)


def run_entry(monkeypatch, capsys, entry: Callable[[], int | None], argv: list[str],
              cwd: Path | None = None) -> subprocess.CompletedProcess:
    """entry() (a console script's main, reading sys.argv = argv) in this process, as a
    CompletedProcess: the code it returns or exits with, and what it printed (output captured
    before the call is dropped). A module the command imported from `cwd` (a user's scorer) is
    forgotten after it, so the next command imports its own; the working directory, sys.path and
    the SIGINT and SIGTERM handlers (which a command that published leaves noting signals) are put
    back."""
    here = Path(cwd).resolve() if cwd is not None else None
    handlers = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    with monkeypatch.context() as m:
        if here is not None:
            m.chdir(here)
        m.setattr(sys, "argv", argv)
        m.setattr(sys, "path", list(sys.path))  # `runtime.scorers.factory.load_factory` adds the working directory
        importlib.invalidate_caches()  # a module written since the last import is found
        capsys.readouterr()
        try:
            code = entry() or 0
        except SystemExit as e:  # as the interpreter turns it into an exit code
            code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        finally:
            for s, handler in handlers.items():
                signal.signal(s, handler)
            if here is not None:
                inside = f"{here}{os.sep}"  # where the command's os.getcwd() imported them from
                for name, mod in list(sys.modules.items()):
                    if (getattr(mod, "__file__", None) or "").startswith(inside):
                        del sys.modules[name]
        out, err = capsys.readouterr()
    return subprocess.CompletedProcess(argv, code, out, err)
