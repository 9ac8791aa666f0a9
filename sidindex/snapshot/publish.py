"""Publishing snapshots under a ROOT, atomically (DESIGN.md §7).

    ROOT/.lock               flock: one build publishes at a time (a second waits)
    ROOT/CURRENT             the published snapshot's id, replaced by rename
    ROOT/snapshots/<id>/     published snapshots, never modified once renamed into place
    ROOT/snapshots/.tmp-*    a build in progress (removed when a later build finds it stale)

A snapshot is written into a temporary directory, fsynced, opened and validated like a reader
would, renamed into place, and only then named by CURRENT (written to CURRENT.tmp, fsynced,
renamed over CURRENT, directory fsynced). A crash at any point leaves CURRENT naming the previous,
complete snapshot. Retention deletes the oldest snapshots beyond `keep`, never the current one;
a reader that has one memory-mapped keeps its pages until it closes them.
"""

from __future__ import annotations

import fcntl
import os
import re
import shutil
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

from sidindex.artifact import fsync_path
from sidindex.errors import ArtifactError

CURRENT = "CURRENT"
_ID = re.compile(r"^[0-9]{8}T[0-9]{12}Z-[0-9a-f]{8}$")


def new_snapshot_id(fingerprint: str) -> str:
    """Sortable by time (microseconds, UTC), tagged with the input fingerprint."""
    now = time.time()
    return time.strftime("%Y%m%dT%H%M%S", time.gmtime(now)) + f"{int(now % 1 * 1e6):06d}Z-{fingerprint[:8]}"


def current_id(root: Path) -> str | None:
    """The id CURRENT names, or None when nothing is published."""
    try:
        name = (root / CURRENT).read_text().strip()
    except FileNotFoundError:
        return None
    if not _ID.match(name):
        raise ArtifactError(f"{root / CURRENT}: does not name a snapshot ({name[:80]!r})")
    return name


def resolve_snapshot(path: str | Path) -> Path:
    """A snapshot directory from a ROOT (its CURRENT) or a snapshot directory."""
    path = Path(path)
    if (path / CURRENT).exists():
        sid = current_id(path)
        return path / "snapshots" / sid
    if (path / "manifest.json").is_file():
        return path
    if (path / "snapshots").is_dir():
        raise ArtifactError(f"{path}: a ROOT with no published snapshot (no {CURRENT})")
    raise ArtifactError(f"{path}: neither a ROOT (with {CURRENT}) nor a snapshot directory (with manifest.json)")


@contextmanager
def build_lock(root: Path, waiting: Callable[[], None] | None = None) -> Iterator[None]:
    """Hold ROOT/.lock; `waiting` is called once if another build holds it."""
    root.mkdir(parents=True, exist_ok=True)
    with open(root / ".lock", "a+b") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            if waiting:
                waiting()
            fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def publish(root: Path, snapshot_id: str, write: Callable[[Path], None], check: Callable[[Path], None], keep: int) -> Path:
    """Write, check and publish a snapshot; the caller holds `build_lock(root)`.

    write(directory) fills the new, empty directory; check(directory) raises if it is not sound.
    Returns the published directory.
    """
    snaps = root / "snapshots"
    snaps.mkdir(parents=True, exist_ok=True)
    for stale in snaps.glob(".tmp-*"):  # left by a build that crashed (we hold the lock)
        shutil.rmtree(stale, ignore_errors=True)
    tmp = snaps / f".tmp-{snapshot_id}"
    tmp.mkdir()
    try:
        write(tmp)
        for p in sorted(tmp.rglob("*"), reverse=True):  # files before the directories holding them
            fsync_path(p)
        fsync_path(tmp)
        check(tmp)
        final = snaps / snapshot_id
        os.rename(tmp, final)
        fsync_path(snaps)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    pointer = root / f"{CURRENT}.tmp"
    with open(pointer, "w") as f:
        f.write(snapshot_id + "\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(pointer, root / CURRENT)
    fsync_path(root)
    prune(root, keep)
    return final


def prune(root: Path, keep: int) -> list[str]:
    """Delete the oldest published snapshots beyond `keep` (never the current one); returns their ids."""
    cur = current_id(root)
    ids = sorted((p.name for p in (root / "snapshots").iterdir() if _ID.match(p.name)), reverse=True)
    doomed = [i for i in ids[max(keep, 1):] if i != cur]
    for i in doomed:
        shutil.rmtree(root / "snapshots" / i, ignore_errors=True)
    return doomed
