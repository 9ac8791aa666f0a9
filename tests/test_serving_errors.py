"""A serving process that no snapshot and no option can kill (docs/design.md §8, §9, §11).

- Once loaded, an index needs nothing from its snapshot directory: deleting it does not break retrieval.
- `SnapshotWatcher.poll` never raises and never waits, whatever CURRENT and the new snapshot hold,
  and keeps serving the old snapshot.
- Bad query-time options (mode, device, beams too wide for the memory) are ConfigErrors that say
  what to do, raised before any work; from the CLI they are one line on stderr and exit 2.
"""

from __future__ import annotations

import functools
import os
import re
import shutil
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch

import runtime
from runtime.index import loader
from runtime.search.beam import check_fits
from sidindex.errors import ArtifactError, ConfigError
from sidindex.modes import Mode, parse_mode, served_modes
from sidindex.root import Root
from sidindex.trie.match import passing_tokens
from tests.conftest import run_cli
from tests.in_process import run_main
from tests.test_retrieve import build_root

# No [kway] section; the wide hash level (V = 32768) makes wide beams cost what they would at scale.
CONFIG = '[sid]\nlevels = [16, 8, 8]\nhash_size = 32768\npaths = 1\nmin_points_per_centroid = 10\n'
HUGE = "1,100000,100000,100000"
NEW_ID = "29991231T000000000000Z-deadbeef"  # a snapshot id nothing published
SMALL = (1, 4, 8, 8)


@pytest.fixture(scope="module")
def root(sample_dir, tmp_path_factory) -> Path:
    """Two published snapshots, CURRENT naming the second: a watcher serving it can be pointed at
    the first, spoiled."""
    base = tmp_path_factory.mktemp("serving")
    root = build_root(sample_dir, base, CONFIG)
    r = run_cli("build", "--catalog", sample_dir / "catalog.parquet", "--targeting", sample_dir / "targeting.toml",
                "--out", root, "--config", base / "build.toml", "--force", "--keep", "5", "--json")
    assert r.returncode == 0, r.stderr
    return root


@pytest.fixture(scope="module")
def index(root) -> runtime.ServedIndex:
    return runtime.load(root, "cpu")


@pytest.fixture(scope="module")
def reqs(index, sample_dir):
    return runtime.read_requests(sample_dir / "requests.parquet", index)


def test_parse_mode():
    assert [m.value for m in Mode] == ["none", "cd", "cd+gtm", "cd+gtm+kway"]
    assert [(m.constrained, m.gtm, m.kway) for m in Mode] == [(False, False, False), (True, False, False),
                                                              (True, True, False), (True, True, True)]
    assert parse_mode("cd+gtm") is Mode.CD_GTM and parse_mode(Mode.CD) is Mode.CD
    assert parse_mode("cd+gtm+kway") is Mode.CD_GTM_KWAY  # availability unknown: not checked
    assert served_modes(False) == (Mode.CD, Mode.CD_GTM) and served_modes(True)[-1] is Mode.CD_GTM_KWAY
    with pytest.raises(ConfigError, match=r"mode must be one of none, cd, cd\+gtm, cd\+gtm\+kway; got 'bogus'"):
        parse_mode("bogus")
    with pytest.raises(ConfigError, match=r"built without k-way partitions; a build whose config has a \[kway\]"):
        parse_mode("cd+gtm+kway", kway_available=False)


def test_every_entry_point_refuses_kway_without_partitions(index, reqs):
    assert not index.kway
    enc = runtime.encode_requests(reqs.head(2), index.spec)
    dev = runtime.to_device(enc, index.device)
    calls = [lambda: runtime.retrieve(index, reqs, mode="cd+gtm+kway", beams=SMALL),
             lambda: runtime.beam_search(index, dev, runtime.codebook_scorer(index, dev)(slice(0, 2)), SMALL,
                                         "cd+gtm+kway"),
             lambda: passing_tokens(index.snapshot.gtm, enc, 0, 0, "cd+gtm+kway")]
    for call in calls:
        with pytest.raises(ConfigError, match="built without k-way partitions") as e:
            call()
        assert "--" not in str(e.value)  # the library names no CLI flag


@pytest.mark.parametrize("device", ["tpu", "gpu", "cuda:x", "cuda:-1", "cpu:0", ""])
def test_unknown_devices_are_config_errors(root, device):
    for make in (runtime.load, runtime.SnapshotWatcher):
        with pytest.raises(ConfigError, match=re.escape(f"device {device!r} is not supported; use cpu, cuda or "
                                                        "cuda:N")):
            make(root, device)


def test_missing_cuda_devices_are_config_errors(root):
    n = torch.cuda.device_count() if torch.cuda.is_available() else 0
    with pytest.raises(ConfigError, match="no CUDA device" if n == 0 else f"this host has {n} CUDA device"):
        runtime.load(root, "cuda" if n == 0 else f"cuda:{n}")


def test_beams_too_wide_for_memory_are_refused_before_any_work(index, reqs):
    dev = runtime.to_device(runtime.encode_requests(reqs.head(16), index.spec), index.device)
    asked = []

    def scorer(step, tokens, parent):  # the search must stop before its first step
        asked.append(step)
        raise AssertionError("the search started")

    t = time.perf_counter()
    with pytest.raises(ConfigError) as e:
        runtime.beam_search(index, dev, scorer, HUGE, "cd+gtm")
    assert time.perf_counter() - t < 1.0 and not asked
    message = str(e.value)
    assert re.search(rf"beams {HUGE} need about [0-9.,]+ [GT]iB for 16 requests at once; about [0-9.,]+ [MGT]iB "
                     r"are free on cpu; beams up to 1,\d+,\d+,\d+ fit", message), message
    fit = tuple(int(b) for b in re.search(r"beams up to ([0-9,]+) fit", message).group(1).split(","))
    check_fits(fit, 16, index.vocab_size, index.device)  # the advice holds
    with pytest.raises(ConfigError, match=f"beams {HUGE} need about"):
        runtime.retrieve(index, reqs, beams=HUGE)


def test_retrieval_needs_nothing_from_the_snapshot_directory_once_loaded(root, reqs, tmp_path):
    work = Path(shutil.copytree(root, tmp_path / "root"))
    index = runtime.load(work, "cpu")
    assert index.codebook is not None
    shutil.rmtree(work)
    got = runtime.retrieve(index, reqs, beams=SMALL).result
    want = runtime.retrieve(runtime.load(root, "cpu"), reqs, beams=SMALL).result
    assert len(got.ad_id) > 0
    for name in ("request", "rank", "ad_id", "sid", "score"):
        np.testing.assert_array_equal(getattr(got, name), getattr(want, name))


def _poll_within(watcher: runtime.SnapshotWatcher, seconds: float = 1.0) -> bool | None:
    """watcher.poll() run in a thread: its result, or None when it did not return in time."""
    result = []
    t = threading.Thread(target=lambda: result.append(watcher.poll()), daemon=True)
    t.start()
    t.join(seconds)
    return result[0] if result else None


def _bad_utf8_current(root: Root, other: Path) -> None:
    root.current_file.write_bytes(b"\xff\xfe" + other.name.encode())


def _missing_snapshot(root: Root, other: Path) -> None:
    root.current_file.write_text(NEW_ID)


def _fifo_manifest(root: Root, other: Path) -> None:
    (other / "manifest.json").unlink()
    os.mkfifo(other / "manifest.json")
    root.current_file.write_text(other.name)


def _deep_manifest(root: Root, other: Path) -> None:
    (other / "manifest.json").write_text("[" * 100_000)
    root.current_file.write_text(other.name)


def _corrupt_codebook(root: Root, other: Path) -> None:
    level = next((other / "codebooks").glob("*/level_0.npy"))
    data = bytearray(level.read_bytes())
    data[-1] ^= 0xFF
    level.write_bytes(bytes(data))
    root.current_file.write_text(other.name)


@pytest.mark.parametrize("spoil", [_bad_utf8_current, _missing_snapshot, _fifo_manifest, _deep_manifest,
                                   _corrupt_codebook])
def test_watcher_keeps_serving_whatever_a_new_snapshot_holds(root, reqs, tmp_path, spoil):
    work = Root(shutil.copytree(root, tmp_path / "root"))
    watcher = runtime.SnapshotWatcher(work.path, "cpu")
    good = watcher.current
    other = next(p for p in work.snapshots.iterdir() if p.name != good.id)  # published before, not served
    spoil(work, other)
    try:
        assert _poll_within(watcher) is False, "poll blocked or swapped"
    finally:  # a reader stuck on the FIFO gets end-of-file and its thread ends
        if (other / "manifest.json").is_fifo():
            try:
                os.close(os.open(other / "manifest.json", os.O_WRONLY | os.O_NONBLOCK))
            except OSError:  # no reader waiting on it
                pass
    assert watcher.current is good and good.id in watcher.last_error
    assert len(runtime.retrieve(watcher.current, reqs.head(4), beams=SMALL).result.ad_id) > 0


def test_a_poll_never_waits_for_another(root, tmp_path, monkeypatch):
    work = Path(shutil.copytree(root, tmp_path / "root"))
    watcher = runtime.SnapshotWatcher(work, "cpu")
    entered, release = threading.Event(), threading.Event()

    def slow_broken_load(*args, **kwargs):
        entered.set()
        release.wait(10)
        raise ArtifactError("slow and broken")

    monkeypatch.setattr(loader, "load", slow_broken_load)
    Root(work).current_file.write_text(NEW_ID)
    first = threading.Thread(target=watcher.poll, daemon=True)
    first.start()
    assert entered.wait(5)
    t = time.perf_counter()
    assert watcher.poll() is False and time.perf_counter() - t < 0.5
    release.set()
    first.join(5)
    assert not first.is_alive() and "slow and broken" in watcher.last_error


@pytest.mark.parametrize("args, message", [
    (("--mode", "cd+gtm+kway"), "built without k-way partitions"),
    (("--mode", "bogus"), "mode must be one of none, cd, cd+gtm, cd+gtm+kway"),
    (("--device", "tpu"), "device 'tpu' is not supported; use cpu, cuda or cuda:N"),
    (("--beams", HUGE), f"beams {HUGE} need about"),
])
def test_cli_errors_are_one_line(root, sample_dir, tmp_path, args, message, monkeypatch, capsys):
    """The beams too wide for memory through the console script (were the refusal to go, the
    allocation would hit that process alone); the others through its entry point in this process
    (`run_main`: the same exit code and line)."""
    run = run_cli if args[0] == "--beams" else functools.partial(run_main, monkeypatch, capsys)
    r = run("retrieve", root, "--requests", sample_dir / "requests.parquet", "--out", tmp_path / "x.parquet", *args,
            timeout=300)
    assert r.returncode == 2, r.stderr
    assert len(r.stderr.strip().splitlines()) == 1 and message in r.stderr, r.stderr
    assert "Traceback" not in r.stderr + r.stdout and not (tmp_path / "x.parquet").exists()


def test_a_snapshot_that_failed_to_load_is_not_read_again_until_current_moves(root, tmp_path, monkeypatch):
    """With checksums on, every poll would otherwise hash a broken snapshot in full again."""
    work = Root(shutil.copytree(root, tmp_path / "root"))
    watcher = runtime.SnapshotWatcher(work.path, "cpu")
    other = next(p for p in work.snapshots.iterdir() if p.name != watcher.current.id)
    _corrupt_codebook(work, other)
    real_load, calls = loader.load, []
    monkeypatch.setattr(loader, "load", lambda *a, **kw: calls.append(a[0]) or real_load(*a, **kw))
    assert watcher.poll() is False and watcher.poll() is False and len(calls) == 1
    work.current_file.write_text(watcher.current.id)  # CURRENT moves on (back): nothing to load
    assert watcher.poll() is False and len(calls) == 1
    work.current_file.write_text(other.name)  # named again after moving: tried again
    assert watcher.poll() is False and len(calls) == 2
