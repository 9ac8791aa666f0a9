"""A ROOT: where builds publish snapshots and keep codebooks (DESIGN.md §7). Every reader and
writer of a ROOT goes through `Root`; no other module spells these names.

    ROOT/.lock                 flock: one build or update publishes at a time (a second waits)
    ROOT/CURRENT               the published snapshot's id, replaced by rename
    ROOT/HISTORY               ids in the order they were published, one a line, replaced by rename
    ROOT/snapshots/<id>/       published snapshots, never modified once renamed into place
    ROOT/snapshots/.tmp-<id>/  a snapshot being written
    ROOT/codebooks/<id>/       frozen codebooks;  ROOT/codebooks/.tmp-*/  one being written

Publishing: the new snapshot is written into a temporary directory, checked, fsynced and renamed
into place; CURRENT is then replaced (CURRENT.tmp, fsync, rename, fsync ROOT), and HISTORY after
it. A crash at any point leaves CURRENT naming a complete snapshot. Retention keeps the `keep`
most recently published snapshots (by HISTORY, CURRENT always among them) and deletes every other
snapshot directory, orphans of a build killed between its rename and the CURRENT swap included;
the next build also removes temporaries that killed builds left. A process that has a snapshot
open keeps its memory maps when retention deletes the files.
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

from schemas.artifacts import MANIFEST_FILE
from sidindex.artifact import fsync_path, publish_dir, read_bounded
from sidindex.errors import ArtifactError

SNAPSHOT_ID = re.compile(r"^[0-9]{8}T[0-9]{12}Z-[0-9a-f]{8}$")
TMP_PREFIX = ".tmp-"
_POINTER_BYTES = 256  # CURRENT holds one id
_HISTORY_BYTES = 1 << 20


def new_snapshot_id(fingerprint: str) -> str:
    """Sortable by time (microseconds, UTC), tagged with the input fingerprint."""
    now = time.time()
    return time.strftime("%Y%m%dT%H%M%S", time.gmtime(now)) + f"{int(now % 1 * 1e6):06d}Z-{fingerprint[:8]}"


def pruned(directory: Path) -> ArtifactError:
    """The error for a snapshot directory that is gone: retention deletes old snapshots under readers."""
    return ArtifactError(f"{directory}: no such snapshot (pruned by retention, or never published); open its ROOT "
                         "again for the current one")


class Root:
    """The directory layout above; methods that change it expect `lock()` to be held."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.snapshots = self.path / "snapshots"
        self.codebooks = self.path / "codebooks"
        self.current_file = self.path / "CURRENT"
        self.history_file = self.path / "HISTORY"

    def snapshot_dir(self, snapshot_id: str) -> Path:
        return self.snapshots / snapshot_id

    # --- reading ----------------------------------------------------------------------------

    def current_id(self) -> str | None:
        """The id CURRENT names, or None when nothing is published. Bounded, never blocks."""
        try:
            raw = read_bounded(self.current_file, _POINTER_BYTES)
        except ArtifactError:
            if not os.path.lexists(self.current_file):
                return None
            raise
        name = raw.decode("ascii", "replace").strip()
        if not SNAPSHOT_ID.match(name):
            raise ArtifactError(f"{self.current_file}: does not name a snapshot ({name[:80]!r})")
        return name

    def history(self) -> list[str]:
        """Published ids, oldest first. Without a readable HISTORY (a ROOT from before it, or a
        damaged one) the snapshot directories stand in, in time order (their ids sort by time), with
        CURRENT last: retention then keeps the newest, never all but CURRENT."""
        try:
            raw = read_bounded(self.history_file, _HISTORY_BYTES)
            return [s for s in raw.decode("ascii", "replace").split() if SNAPSHOT_ID.match(s)]
        except ArtifactError:
            ids = sorted(p.name for p in self.snapshots.iterdir() if SNAPSHOT_ID.match(p.name)) \
                if self.snapshots.is_dir() else []
            current = self.current_id()
            return [i for i in ids if i != current] + ([current] if current else [])

    @staticmethod
    def resolve(path: str | Path) -> Path:
        """A snapshot directory from a ROOT (its CURRENT) or a snapshot directory."""
        path = Path(path)
        root = Root(path)
        if os.path.lexists(root.current_file):
            current = root.current_id()
            if current is None:
                raise ArtifactError(f"{path}: a ROOT with no published snapshot (no CURRENT)")
            directory = root.snapshot_dir(current)
            if directory.is_symlink():
                raise ArtifactError(f"{directory}: is a symbolic link; a ROOT's snapshots are its own directories")
            return directory
        if os.path.lexists(path / MANIFEST_FILE):
            return path
        if not os.path.lexists(path):
            if SNAPSHOT_ID.match(path.name):
                raise pruned(path)
            raise ArtifactError(f"{path}: no such file or directory")
        if root.snapshots.is_dir():
            raise ArtifactError(f"{path}: a ROOT with no published snapshot (no CURRENT)")
        raise ArtifactError(f"{path}: neither a ROOT (with CURRENT) nor a snapshot directory (with {MANIFEST_FILE})")

    # --- writing ----------------------------------------------------------------------------

    @contextmanager
    def lock(self, waiting: Callable[[], None] | None = None) -> Iterator[None]:
        """Hold ROOT/.lock; `waiting` is called once if another build holds it."""
        self.path.mkdir(parents=True, exist_ok=True)
        with open(self.path / ".lock", "a+b") as f:
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

    def clean_temporaries(self) -> list[Path]:
        """Remove what killed builds left (we hold the lock, so nothing of ours is in progress)."""
        doomed = [p for d in (self.snapshots, self.codebooks) if d.is_dir() for p in d.glob(TMP_PREFIX + "*")]
        doomed += [p for p in (self.path / "CURRENT.tmp", self.path / "HISTORY.tmp") if os.path.lexists(p)]
        for p in doomed:
            if p.is_dir() and not p.is_symlink():
                shutil.rmtree(p, ignore_errors=True)
            else:
                p.unlink(missing_ok=True)
        return doomed

    def publish(self, snapshot_id: str, write: Callable[[Path], None], check: Callable[[Path], None],
                keep: int) -> Path:
        """Write, check and publish a snapshot, then apply retention; returns its directory.

        write(directory) fills the new, empty directory; check(directory) raises if it is not sound.
        """
        self.snapshots.mkdir(parents=True, exist_ok=True)
        self.clean_temporaries()
        tmp = self.snapshots / f"{TMP_PREFIX}{snapshot_id}"
        tmp.mkdir()
        final = self.snapshot_dir(snapshot_id)
        try:
            write(tmp)
            check(tmp)
            publish_dir(tmp, final)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        self._replace(self.current_file, snapshot_id + "\n")
        history = [i for i in self.history() if i != snapshot_id] + [snapshot_id]
        self._replace(self.history_file, "\n".join(history) + "\n")
        self.prune(keep)
        return final

    def _replace(self, path: Path, text: str) -> None:
        tmp = path.with_name(path.name + ".tmp")
        with open(tmp, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        fsync_path(self.path)

    def prune(self, keep: int) -> list[str]:
        """Keep the `keep` most recently published snapshots (CURRENT always); delete every other
        snapshot directory, orphans included. Returns the deleted ids."""
        current = self.current_id()
        published = [i for i in self.history() if i != current]
        kept = set(published[max(0, len(published) - (keep - 1)):] if keep > 1 else []) | {current}
        doomed = sorted(p.name for p in self.snapshots.iterdir() if SNAPSHOT_ID.match(p.name) and p.name not in kept)
        for i in doomed:
            shutil.rmtree(self.snapshot_dir(i), ignore_errors=True)
        self._replace(self.history_file, "".join(f"{i}\n" for i in self.history() if i in kept))
        return doomed
