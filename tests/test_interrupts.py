"""Exit codes mean what happened (docs/design.md §9).

- SIGINT and SIGTERM stop `build`, `update` and `retrieve` with exit 130 and 143 and one line on
  stderr, publishing (or writing) nothing: CURRENT and HISTORY stay as they were, no snapshot
  directory or temporary is left, CURRENT still validates. Each signal lands at a known point:
  while the command waits for the ROOT's lock (held here), or while the user's scorer factory
  runs (it leaves a marker, then sleeps).
- A user's scorer module that exits (sys.exit()), raises KeyboardInterrupt or a BaseException of
  its own, or fails on attribute access, in its import, factory or scorer, is one line naming it
  and exit 2, never a traceback, never another command's exit code (3 is the quality gate's).
- Memory running out is one line saying so and what to do, exit 2; an exit code typer returns
  is never a success.
"""

from __future__ import annotations

import fcntl
import functools
import json
import os
import select
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from tests.conftest import run_cli
from tests.in_process import run_main
from tests.test_retrieve import build_root

CONFIG = '[sid]\nlevels = [16, 8, 8]\nhash_size = 64\npaths = 1\nmin_points_per_centroid = 10\n'

# Starts the console script with SIGINT at its default (a test run from a shell's background job
# would hand it on ignored); exec keeps the pid.
LAUNCH = "import os, signal, sys; signal.signal(signal.SIGINT, signal.SIG_DFL); os.execv(sys.argv[1], sys.argv[1:])"

MODELS = '''
import pathlib
import sys
import time

import torch


class Stop(BaseException):
    """Not an Exception."""


def slow(batch, device, level_sizes):
    pathlib.Path("factory-started").touch()
    time.sleep(60)


def exits(batch, device, level_sizes):
    sys.exit()


def exits_3(batch, device, level_sizes):
    def scorer(step, tokens, parent):
        sys.exit(3)
    return scorer


def interrupts(batch, device, level_sizes):
    raise KeyboardInterrupt


def stops(batch, device, level_sizes):
    def scorer(step, tokens, parent):
        raise Stop("a plug-in's own")
    return scorer


class Opaque:
    def __init__(self, V):
        self.V = V

    def __call__(self, step, tokens, parent):
        return torch.zeros(*tokens.shape[:2], self.V, device=tokens.device)

    def __getattr__(self, name):
        raise RuntimeError(f"{name} is not ready")


def opaque(batch, device, level_sizes):
    return Opaque(max(level_sizes))


def spins(batch, device, level_sizes):
    def scorer(step, tokens, parent):
        while True:
            pass
    return scorer
'''

LAZY = '''
def __getattr__(name):
    raise RuntimeError(f"{name} is not loaded")
'''

EXITS_ON_IMPORT = 'import sys\nsys.exit(1)\n'


@pytest.fixture(scope="module")
def root(sample_dir, tmp_path_factory) -> Path:
    return build_root(sample_dir, tmp_path_factory.mktemp("interrupts"), CONFIG)


@pytest.fixture(scope="module")
def work(sample_dir, root) -> Path:
    """The working directory of the commands: the scorer modules, 2 requests, a change file."""
    work = root.parent / "work"
    work.mkdir()
    for name, text in (("models", MODELS), ("lazy", LAZY), ("exits_on_import", EXITS_ON_IMPORT)):
        (work / f"{name}.py").write_text(text)
    pq.write_table(pq.read_table(sample_dir / "requests.parquet").slice(0, 2), work / "requests.parquet")
    ads = pq.read_table(sample_dir / "catalog.parquet").column("ad_id").slice(0, 3)
    pq.write_table(pa.table({"ad_id": ads, "op": ["pause"] * 3}), work / "changes.parquet")
    return work


def start(*args, cwd: Path) -> subprocess.Popen:
    exe = shutil.which("sidindex")
    assert exe, "the sidindex console script is not installed (pip install -e .)"
    return subprocess.Popen([sys.executable, "-c", LAUNCH, exe, *map(str, args)], cwd=cwd,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def published(root: Path) -> tuple:
    """What a ROOT has published: CURRENT, HISTORY and every entry of snapshots/ and codebooks/."""
    return ((root / "CURRENT").read_text(), (root / "HISTORY").read_text(),
            sorted(os.listdir(root / "snapshots")), sorted(os.listdir(root / "codebooks")))


def stopped(p: subprocess.Popen, signum: int) -> list[str]:
    """Send `signum` to the command, which must then exit 128 + signum; its remaining stderr lines."""
    p.send_signal(signum)
    _, err = p.communicate(timeout=60)
    assert p.returncode == 128 + signum, err
    assert "Traceback" not in err
    return err.strip().splitlines()


SIGNALS = [(signal.SIGINT, "SIGINT"), (signal.SIGTERM, "SIGTERM")]


@pytest.mark.parametrize("signum, name", SIGNALS)
@pytest.mark.parametrize("command", ["build", "update"])
def test_a_signal_while_waiting_for_the_root_publishes_nothing(root, work, sample_dir, command, signum, name,
                                                               monkeypatch, capsys):
    before = published(root)
    args = (("build", "--catalog", sample_dir / "catalog.parquet", "--targeting", sample_dir / "targeting.toml",
             "--out", root, "--config", root.parent / "build.toml", "--force") if command == "build" else
            ("update", root, "--changes", work / "changes.parquet"))
    with open(root / ".lock", "a+b") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # another build holds the ROOT
        try:
            p = start(*args, cwd=work)
            ready, _, _ = select.select([p.stderr], [], [], 60)
            assert ready, "the command did not wait for the lock"
            lines = stopped(p, signum)
        finally:
            if p.poll() is None:
                p.kill()
                p.wait()
    assert lines[-1] == f"interrupted by {name}; nothing published"
    assert all(line.startswith("waiting for") for line in lines[:-1]), lines
    assert published(root) == before
    r = run_main(monkeypatch, capsys, "validate", root)  # `sidindex validate` in this process
    assert r.returncode == 0, r.stderr


@pytest.mark.parametrize("signum, name", SIGNALS)
def test_a_signal_during_retrieve_writes_nothing(root, work, signum, name):
    marker, out = work / "factory-started", work / f"{name}.parquet"
    marker.unlink(missing_ok=True)
    p = start("retrieve", root, "--requests", "requests.parquet", "--out", out, "--device", "cpu",
              "--scorer", "models:slow", cwd=work)
    try:
        deadline = time.monotonic() + 120
        while not marker.exists():  # the factory runs: the search has begun
            assert p.poll() is None, p.communicate()[1]
            assert time.monotonic() < deadline, "the scorer factory was never called"
            time.sleep(0.02)
        lines = stopped(p, signum)
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
    assert lines == [f"interrupted by {name}; nothing written"]
    assert not out.exists() and not list(work.glob(f".{out.name}*"))


FAILING = [  # factory, what the line says, the commands that reach the failure
    ("models:exits", "the factory failed: it called sys.exit()", ("retrieve", "simulate")),
    ("models:exits_3", "failed at step 0: it called sys.exit(3)", ("retrieve", "simulate")),
    ("models:interrupts", "the factory failed: KeyboardInterrupt", ("retrieve", "simulate")),
    ("models:stops", "failed at step 0: Stop: a plug-in's own", ("retrieve", "simulate")),
    ("lazy:make", "reading 'make' of 'lazy': RuntimeError: make is not loaded", ("retrieve", "simulate")),
    # simulate asks a scorer whether a step depends on the prefix; retrieve on the CPU reads no attribute
    ("models:opaque", "reading its 'prefix_independent' failed: RuntimeError: prefix_independent is not ready",
     ("simulate",)),
    ("exits_on_import:make", "cannot import 'exits_on_import': it called sys.exit(1)", ("retrieve",)),
]


@pytest.mark.parametrize("factory, message, command",
                         [(f, m, c) for f, m, commands in FAILING for c in commands])
def test_a_scorer_that_exits_or_raises_a_base_exception_is_one_line_exit_2(root, work, factory, message, command,
                                                                             monkeypatch, capsys):
    """The scorer that calls sys.exit(3) through the console script (its exit code must not become
    the process's); the others through its entry point in this process (`run_main`)."""
    out = work / "failed.parquet"
    extra = ("--out", out) if command == "retrieve" else ("--top-k", "5")
    run = run_cli if (factory, command) == ("models:exits_3", "retrieve") else functools.partial(
        run_main, monkeypatch, capsys)
    r = run(command, root, "--requests", "requests.parquet", "--device", "cpu", "--scorer", factory, *extra,
            cwd=work, timeout=300)
    assert r.returncode == 2, (r.returncode, r.stderr)
    assert r.stderr.strip().splitlines() == [f"error: scorer {factory!r}: {message}"], r.stderr
    assert not out.exists()


@pytest.mark.parametrize("raised, line", [
    (MemoryError("Unable to allocate 192. MiB for an array"),
     "error: out of host memory: `sidindex retrieve` could not allocate what it needed (Unable to allocate 192. MiB "
     "for an array); give it more memory or less to hold at once: fewer requests per file, or per search "
     "(--batch-size)"),
    (RuntimeError("[enforce fail at alloc_cpu.cpp:127] err == 0. DefaultCPUAllocator: can't allocate memory: you "
                  "tried to allocate 33554432 bytes."),
     "error: out of host memory: `sidindex retrieve` could not allocate what it needed ([enforce fail at "
     "alloc_cpu.cpp:127] err == 0. DefaultCPUAllocator: can't allocate memory: you tried to allocate 33554432 "
     "bytes.); give it more memory or less to hold at once: fewer requests per file, or per search (--batch-size)"),
])
def test_running_out_of_memory_is_one_line_exit_2(monkeypatch, capsys, raised, line):
    """What numpy or pyarrow (a MemoryError) and torch's CPU allocator (a RuntimeError) raise when an
    allocation fails; a real one needs a process limit that depends on the host."""
    def app(standalone_mode):
        raise raised

    assert _main_exits(monkeypatch, app) == 2
    assert capsys.readouterr().err.strip().splitlines() == [line]


def test_an_exit_code_typer_returns_is_never_a_success(monkeypatch, capsys):
    """typer returns 130 for a KeyboardInterrupt it caught (raised by code: a SIGINT is Interrupted)."""
    assert _main_exits(monkeypatch, lambda standalone_mode: 130) == 130
    assert capsys.readouterr().err.strip().splitlines() == ["interrupted; nothing written"]


def _main_exits(monkeypatch, app) -> int:
    """The exit code of `sidindex retrieve` whose typer app is `app`."""
    from sidindex_cli import app as cli

    monkeypatch.setattr(cli, "app", app)
    monkeypatch.setattr(sys, "argv", ["sidindex", "retrieve"])
    with pytest.raises(SystemExit) as e:
        cli.main()
    return e.value.code


@pytest.mark.parametrize("factory, message", [
    ("models:slow", "the factory failed: no result within 0.5 s (the scorer timeout)"),
    ("models:spins", "failed at step 0: no result within 0.5 s (the scorer timeout)"),
])
def test_a_scorer_that_outlives_its_timeout_is_one_line_exit_2(root, work, factory, message, monkeypatch, capsys):
    """The factory that sleeps through the console script; the scorer that spins, and the option
    without --scorer, through its entry point in this process (`run_main`; its alarm is the main
    thread's there too)."""
    here = functools.partial(run_main, monkeypatch, capsys)
    r = (run_cli if factory == "models:slow" else here)(
        "retrieve", root, "--requests", "requests.parquet", "--device", "cpu", "--scorer", factory,
        "--scorer-timeout", "0.5", "--out", work / "late.parquet", cwd=work, timeout=50)
    assert r.returncode == 2 and r.stderr.strip().splitlines() == [f"error: scorer {factory!r}: {message}"], r.stderr
    r = here("retrieve", root, "--requests", "requests.parquet", "--scorer-timeout", "0.5", "--out",
             work / "late.parquet", cwd=work)
    assert r.returncode == 2 and "--scorer-timeout limits a scorer given with --scorer" in r.stderr


# Runs the console script's entry point with a signal sent to itself at one phase after the commit
# (CURRENT names the new snapshot): while the commit finishes, in retention, while the report is
# printed, and at interpreter exit.
AFTER_COMMIT = """
import atexit, os, signal, sys
phase, signum, exe, *args = sys.argv[1:]
kill = lambda *_: os.kill(os.getpid(), int(signum))
import sidindex.root as root
import sidindex_cli.render as render
if phase == "commit":
    replace = root.Root._replace
    root.Root._replace = lambda self, path, text: (replace(self, path, text), path == self.current_file and kill())
elif phase == "retention":
    prune = root.Root.prune
    root.Root.prune = lambda self, keep: (kill(), prune(self, keep))[1]
elif phase == "report":
    emit = render.emit
    render.emit = lambda *a, **k: (kill(), emit(*a, **k))
else:
    atexit.register(kill)
sys.argv = [exe, *args]
from sidindex_cli.app import main
main()
"""


@pytest.mark.parametrize("command, phase, signum, name", [
    ("build", "commit", *SIGNALS[0]), ("update", "retention", *SIGNALS[1]), ("build", "report", *SIGNALS[1]),
    ("update", "report", *SIGNALS[0]), ("update", "exit", *SIGNALS[1])])
def test_a_signal_after_the_commit_leaves_a_success_that_says_so(root, work, sample_dir, tmp_path, command, phase,
                                                                 signum, name, monkeypatch, capsys):
    """From the moment CURRENT names the new snapshot no signal turns the success into a failure:
    exit 0, the report printed, and a note of the signal (at interpreter exit, after the note's
    time, the exit code alone)."""
    target = Path(shutil.copytree(root, tmp_path / "root"))
    args = (("build", "--catalog", sample_dir / "catalog.parquet", "--targeting", sample_dir / "targeting.toml",
             "--out", target, "--config", root.parent / "build.toml", "--force") if command == "build" else
            ("update", target, "--changes", work / "changes.parquet"))
    p = subprocess.run([sys.executable, "-c", AFTER_COMMIT, phase, str(int(signum)), shutil.which("sidindex"),
                        *map(str, args), "--json"], cwd=work, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0 and "Traceback" not in p.stderr, p.stderr
    report = json.loads(p.stdout)
    assert report["status"] == "published" and (target / "CURRENT").read_text().strip() == report["snapshot_id"]
    notes = [line for line in p.stderr.splitlines() if line.startswith("note:")]
    want = [f"note: {name} arrived after snapshot {report['snapshot_id']} was published; the command finished"]
    assert notes == ([] if phase == "exit" else want), p.stderr
    assert run_main(monkeypatch, capsys, "validate", target).returncode == 0  # in this process


def test_a_change_file_refused_leaves_the_root_as_it_was_and_names_the_users_path(root, work, tmp_path):
    """A .toml change file on a ROOT no update touched: exit 2, one line naming the file the user
    gave (never the journal's staged copy), and no changes/ directory made."""
    target = Path(shutil.copytree(root, tmp_path / "root"))
    assert not (target / "changes").exists()
    some = tmp_path / "some.toml"
    some.write_text('op = "pause"\n')
    r = run_cli("update", target, "--changes", some)
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 2 and len(lines) == 1 and str(some) in lines[0] and ".tmp-" not in lines[0], r.stderr
    assert not (target / "changes").exists() and published(target) == published(root)
