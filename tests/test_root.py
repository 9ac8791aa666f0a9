"""A ROOT's publishing and retention: the most recently published snapshots are kept (never an
orphan in place of one), temporaries of every kind that killed builds leave are cleaned, and a
reader racing retention either gets the current snapshot or a clear "pruned" error."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import time
from pathlib import Path

import numpy as np
import pytest

from sidindex.errors import ArtifactError
from sidindex.root import Root, new_snapshot_id
from sidindex.snapshot import open_snapshot
from tests.conftest import run_cli

CONFIG = "[sid]\nlevels = [16, 8, 8]\nhash_size = 128\npaths = 2\nmin_points_per_centroid = 10\n"


def _ids(n: int) -> list[str]:
    """n snapshot ids in publishing order (ids sort by time)."""
    out = []
    for i in range(n):
        out.append(new_snapshot_id(f"{i:08x}"))
        time.sleep(0.002)
    return out


def _publish(root: Root, sid: str, keep: int) -> Path:
    return root.publish(sid, lambda d: (d / "manifest.json").write_text(sid), lambda d: None, keep,
                        expected=root.current_or_none())


def _present(root: Root) -> set[str]:
    return {p.name for p in root.snapshots.iterdir()}


def test_retention_keeps_the_most_recently_published_never_an_orphan(tmp_path):
    root = Root(tmp_path / "root")
    a, b, orphan, c = _ids(4)
    with root.lock():
        _publish(root, a, keep=3)
        _publish(root, b, keep=3)
    # a build killed between its rename and the CURRENT swap: the newest id, never published
    (root.snapshots / orphan).mkdir()
    (root.snapshots / orphan / "manifest.json").write_text(orphan)
    assert root.current_id() == b and root.history() == [a, b]
    with root.lock():
        _publish(root, c, keep=2)
    assert _present(root) == {b, c}  # b was CURRENT before c: kept; the orphan and the oldest go
    assert root.current_id() == c and root.history() == [b, c]
    with root.lock():
        _publish(root, new_snapshot_id("ffffffff"), keep=1)
    assert len(_present(root)) == 1 and root.history() == [root.current_id()]


def test_stale_temporaries_of_every_kind_are_cleaned_by_the_next_publish(tmp_path):
    root = Root(tmp_path / "root")
    with root.lock():
        _publish(root, _ids(1)[0], keep=3)
    stale = [root.snapshots / ".tmp-20200101T000000000000Z-00000000", root.codebooks / ".tmp-abc123"]
    for d in stale:
        d.mkdir(parents=True)
        (d / "level_0.npy").write_bytes(b"half written")
    (root.path / "CURRENT.tmp").write_text("x")
    (root.path / "HISTORY.tmp").write_text("x")
    with root.lock():
        _publish(root, new_snapshot_id("eeeeeeee"), keep=3)
    assert not [p for p in root.path.rglob("*") if p.name.startswith(".tmp-") or p.name.endswith(".tmp")]


def test_a_snapshot_pruned_under_a_reader(tmp_path, sample_dir):
    (tmp_path / "build.toml").write_text(CONFIG)
    args = ["build", "--catalog", sample_dir / "catalog.parquet", "--targeting", sample_dir / "targeting.toml",
            "--out", tmp_path / "root", "--config", tmp_path / "build.toml", "--json", "--force", "--keep", "1"]
    first = json.loads(run_cli(*args).stdout)["path"]
    second = json.loads(run_cli(*args).stdout)
    assert not Path(first).exists()
    with pytest.raises(ArtifactError, match="pruned by retention"):  # a directory a reader held on to
        open_snapshot(first)
    # a ROOT whose CURRENT moved on between reading it and opening the snapshot it named: read again
    resolve, calls = Root.resolve, []

    def stale_then_current(path):
        calls.append(path)
        return Path(first) if len(calls) == 1 else resolve(path)

    Root.resolve = staticmethod(stale_then_current)
    try:
        assert open_snapshot(tmp_path / "root").id == second["snapshot_id"] and len(calls) == 2
    finally:
        Root.resolve = staticmethod(resolve)


def test_builds_killed_at_any_point_leave_no_orphan_or_temporary_after_the_next(tmp_path, sample_dir):
    """SIGKILL from interpreter start to publish, on a fresh ROOT (codebook training included):
    CURRENT always names a valid snapshot, and the next build leaves only what retention keeps."""
    (tmp_path / "build.toml").write_text(CONFIG)
    root = tmp_path / "root"
    args = [shutil.which("sidindex"), "build", "--catalog", sample_dir / "catalog.parquet", "--targeting",
            sample_dir / "targeting.toml", "--out", root, "--config", tmp_path / "build.toml", "--force",
            "--keep", "2"]
    t0 = time.perf_counter()
    subprocess.run(args, capture_output=True, check=True, timeout=300)
    full = time.perf_counter() - t0
    shutil.rmtree(root)
    for delay in np.linspace(0.3, 1.0, 6) * full:
        p = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        time.sleep(delay)
        p.send_signal(signal.SIGKILL)
        p.wait()
        if (root / "CURRENT").exists():
            open_snapshot(root, verify=True)
    r = subprocess.run(args, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    layout = Root(root)
    assert not [p for p in root.rglob("*") if p.name.startswith(".tmp-") or p.name.endswith(".tmp")]
    assert set(layout.history()) == _present(layout) and len(_present(layout)) <= 2
    assert open_snapshot(root, verify=True).id == layout.current_id()


def test_a_root_without_history_keeps_its_newest_snapshots(tmp_path):
    """A ROOT written before HISTORY existed (or whose HISTORY is damaged): its snapshot directories,
    in time order, stand in for it; retention keeps the newest, not CURRENT alone."""
    root = Root(tmp_path / "root")
    a, b, c, d = _ids(4)
    with root.lock():
        for sid in (a, b, c):
            _publish(root, sid, keep=5)
    root.history_file.unlink()
    with root.lock():
        _publish(root, d, keep=3)
    assert _present(root) == {b, c, d} and root.history() == [b, c, d]
    root.history_file.unlink()
    os.mkfifo(root.history_file)  # unreadable: never waited on, and retention still keeps the newest
    with root.lock():
        _publish(root, new_snapshot_id("abababab"), keep=2)
    assert len(_present(root)) == 2 and d in _present(root)


@pytest.mark.parametrize("during", ["write", "commit", "retention"])
def test_a_signal_before_the_commit_stops_the_publication_and_one_after_it_is_noted(tmp_path, monkeypatch, during):
    """A signal before the commit publishes nothing; one during it is held until the commit is done,
    and from then on (retention too) a signal is noted, not raised: the publication succeeded. The
    next job raises it before changing anything."""
    from sidindex.interrupts import Interrupted, interrupts_raise, noted

    root = Root(tmp_path / "root")
    old, new = _ids(2)
    _publish(root, old, keep=3)
    kill = lambda *_: os.kill(os.getpid(), signal.SIGTERM)  # noqa: E731
    replace, prune = Root._replace, Root.prune
    if during == "commit":  # in the middle of it: CURRENT replaced, HISTORY not yet
        monkeypatch.setattr(Root, "_replace", lambda self, path, text: (
            replace(self, path, text), path == self.current_file and kill()))
    elif during == "retention":
        monkeypatch.setattr(Root, "prune", lambda self, keep: (kill(), prune(self, keep))[1])
    write = (lambda d: (kill(), (d / "manifest.json").write_text(new))) if during == "write" else \
        (lambda d: (d / "manifest.json").write_text(new))
    if during == "write":
        with pytest.raises(Interrupted) as e, interrupts_raise():
            root.publish(new, write, lambda d: None, 3, expected=old)
        assert e.value.exit_code == 143 and e.value.published is None
        assert root.current_id() == old and _present(root) == {old} and "nothing published" in e.value.describe()
        return
    with interrupts_raise():
        root.publish(new, write, lambda d: None, 3, expected=old)
        assert noted() == ([signal.SIGTERM], new)
        assert root.current_id() == new and root.history()[-1] == new
        with pytest.raises(Interrupted) as e, root.lock():  # the next job: stopped before it starts
            pass
    assert e.value.exit_code == 143 and f"snapshot {new} was published first" in e.value.describe()
