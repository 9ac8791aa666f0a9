"""A ROOT: where builds publish snapshots and keep codebooks (DESIGN.md §7). Every reader and
writer of a ROOT goes through `Root`; no other module spells these names.

    ROOT/.lock                 flock: one build or update publishes at a time (a second waits)
    ROOT/CURRENT               the published snapshot's id, replaced by rename
    ROOT/HISTORY               ids in the order they were published, one a line, replaced by rename
    ROOT/snapshots/<id>/       published snapshots, never modified once renamed into place
    ROOT/snapshots/.tmp-<id>/  a snapshot being written
    ROOT/codebooks/<id>/       frozen codebooks;  ROOT/codebooks/.tmp-*/  one being written
    ROOT/changes/<id>.<sha256>/<name>  the journal: change file `name` (its sha256) that update <id> published
    ROOT/changes/THROUGH       the newest change file name a full build's catalog export held

Publishing: the new snapshot is written into a temporary directory, checked, fsynced and renamed
into place; CURRENT is then replaced (CURRENT.tmp, fsync, rename, fsync ROOT), and HISTORY after
it. A crash at any point leaves CURRENT naming a complete snapshot. A publication refuses to
replace a CURRENT other than the one its job started from (another writer published meanwhile, and
this one would revert it), and its commit (the renames) runs with SIGINT and SIGTERM held, so an
interrupt lands before it or after it, never inside. Retention keeps the `keep`
most recently published snapshots (by HISTORY, CURRENT always among them) and deletes every other
snapshot directory, orphans of a build killed between its rename and the CURRENT swap included;
the next build also removes temporaries that killed builds left. A process that has a snapshot
open keeps its memory maps when retention deletes the files.

The journal lets a full build keep the changes published after its catalog export was taken
(`sidindex.job`): an update copies its change file into ROOT/changes/<its id>.<sha256>/ before
its CURRENT swap; an entry newer than CURRENT is an update that never published (a crash in
between) and the next writer removes it. A full build told which change file its export holds through
records that name in THROUGH and drops the entries at or before it.
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
from typing import NamedTuple

from schemas.artifacts import MANIFEST_FILE
from sidindex.artifact import fsync_path, publish_dir, read_bounded
from sidindex.errors import ArtifactError
from sidindex.interrupts import Interrupted, interrupts_deferred

SNAPSHOT_ID = re.compile(r"^[0-9]{8}T[0-9]{12}Z-[0-9a-f]{8}$")
JOURNAL_ENTRY = re.compile(SNAPSHOT_ID.pattern.removesuffix("$") + r"\.[0-9a-f]{64}$")  # <update id>.<sha256 of its file>
TMP_PREFIX = ".tmp-"
_POINTER_BYTES = 256  # CURRENT holds one id
_HISTORY_BYTES = 1 << 20


class JournalEntry(NamedTuple):
    """A change file an update published: the update's snapshot id, the file's sha256, the file."""

    update: str
    digest: str
    file: Path


def new_snapshot_id(fingerprint: str) -> str:
    """Sortable by time (microseconds, UTC), tagged with the input fingerprint."""
    now = time.time()
    return time.strftime("%Y%m%dT%H%M%S", time.gmtime(now)) + f"{int(now % 1 * 1e6):06d}Z-{fingerprint[:8]}"


def pruned(directory: Path) -> ArtifactError:
    """The error for a snapshot directory that is gone, or going: retention deletes old snapshots
    under readers."""
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
        self.changes = self.path / "changes"
        self.through_file = self.changes / "THROUGH"

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

    def current_or_none(self) -> str | None:
        """The published id; None when nothing is published or CURRENT is unreadable (what a writer
        replaces)."""
        try:
            return self.current_id()
        except ArtifactError:
            return None

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
        """A snapshot directory from a ROOT (its CURRENT) or a snapshot directory (opening refuses
        either through a symbolic link: `Manifest.read`)."""
        path = Path(path)
        root = Root(path)
        if os.path.lexists(root.current_file):
            current = root.current_id()
            if current is None:
                raise ArtifactError(f"{path}: a ROOT with no published snapshot (no CURRENT)")
            return root.snapshot_dir(current)
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
    def lock(self, waiting: Callable[[], None] | None = None, *, create: bool = True) -> Iterator[None]:
        """Hold ROOT/.lock; `waiting` is called once if another build holds it. create: make the
        ROOT (and its parents) when missing (a first build); else a missing ROOT is refused and
        nothing is created (an update needs one that exists)."""
        if create:
            self.path.mkdir(parents=True, exist_ok=True)
        elif not self.path.is_dir():
            raise ArtifactError(f"{self.path}: no such ROOT (a directory that builds publish into)")
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
        """Remove what killed builds and updates left (we hold the lock, so nothing of ours is in
        progress): temporaries, and journal entries of updates that never published."""
        doomed = [p for d in (self.snapshots, self.codebooks, self.changes) if d.is_dir()
                  for p in d.glob(TMP_PREFIX + "*")]
        doomed += [p.with_name(p.name + ".tmp") for p in (self.current_file, self.history_file, self.through_file)
                   if os.path.lexists(p.with_name(p.name + ".tmp"))]
        current = self.current_or_none()
        if self.changes.is_dir() and current is not None:
            doomed += [p for p in self.changes.iterdir() if JOURNAL_ENTRY.match(p.name) and _entry_id(p) > current]
        for p in doomed:
            if p.is_dir() and not p.is_symlink():
                shutil.rmtree(p, ignore_errors=True)
            else:
                p.unlink(missing_ok=True)
        return doomed

    def publish(self, snapshot_id: str, write: Callable[[Path], None], check: Callable[[Path], None],
                keep: int, *, expected: str | None, journal: tuple[Path, str] | None = None) -> Path:
        """Write, check and publish a snapshot, then apply retention; returns its directory.

        write(directory) fills the new, empty directory; check(directory) raises if it is not sound.
        expected: the id CURRENT named when the job read what it publishes (None: nothing was
            published); another one there now is refused, the job's work is not published.
        journal: (change file, its sha256) an update applied, kept as the journal entry of `snapshot_id`.
        An interrupt (`sidindex.interrupts`) during the commit is raised after it, with
        `published` set: the snapshot is then CURRENT.
        """
        self.snapshots.mkdir(parents=True, exist_ok=True)
        self.clean_temporaries()
        tmp = self.snapshots / f"{TMP_PREFIX}{snapshot_id}"
        tmp.mkdir()
        final = self.snapshot_dir(snapshot_id)
        entry = self.changes / f"{TMP_PREFIX}{snapshot_id}"
        try:
            write(tmp)
            check(tmp)
            if journal is not None:
                entry.mkdir(parents=True)
                shutil.copyfile(journal[0], entry / journal[0].name)
            self._check_current(expected)
            with interrupts_deferred():
                try:
                    if journal is not None:  # before CURRENT: a crash leaves an entry newer than CURRENT, removed
                        publish_dir(entry, self.changes / f"{snapshot_id}.{journal[1]}")
                    publish_dir(tmp, final)
                    self._replace(self.current_file, snapshot_id + "\n")
                    history = [i for i in self.history() if i != snapshot_id] + [snapshot_id]
                    self._replace(self.history_file, "\n".join(history) + "\n")
                except Interrupted as e:  # raised on leaving the held section, after the commit
                    e.published = snapshot_id
                    raise
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)  # gone already once renamed
            shutil.rmtree(entry, ignore_errors=True)
            raise
        self.prune(keep)
        return final

    def _check_current(self, expected: str | None) -> None:
        """Refuse to publish over a CURRENT that is not `expected` (another writer's publication)."""
        now = self.current_or_none()
        if now != expected:
            raise ArtifactError(f"{self.path}: snapshot {now} was published while this job ran (it started from "
                                f"{expected or 'no published snapshot'}); publishing would revert it, so nothing was "
                                "published. Run the job again")

    # --- the change journal -----------------------------------------------------------------

    def journal(self) -> list[JournalEntry]:
        """The published journal entries, oldest first."""
        current = self.current_or_none()
        if current is None or not self.changes.is_dir():
            return []
        out = []
        for d in sorted(p for p in self.changes.iterdir() if JOURNAL_ENTRY.match(p.name) and _entry_id(p) <= current):
            files = [f for f in d.iterdir() if f.is_file() and not f.is_symlink()] if d.is_dir() else []
            if len(files) != 1:
                raise ArtifactError(f"{d}: a journal entry holds exactly one change file, found {len(files)}")
            out.append(JournalEntry(_entry_id(d), d.name.rpartition(".")[2], files[0]))
        return out

    def through(self) -> str | None:
        """The newest change file name a published full build's catalog export held (THROUGH), or None."""
        try:
            raw = read_bounded(self.through_file, _POINTER_BYTES * 4)
        except ArtifactError:
            if not os.path.lexists(self.through_file):
                return None
            raise
        return raw.decode("utf-8", "replace").strip() or None

    def mark_through(self, name: str) -> None:
        """Record that the published full build's export held every change file named up to `name`,
        then drop the journal entries it makes redundant (their names are at or before it)."""
        self.changes.mkdir(parents=True, exist_ok=True)
        self._replace(self.through_file, name + "\n")
        for entry in self.journal():
            if entry.file.name <= name:
                shutil.rmtree(entry.file.parent, ignore_errors=True)

    def _replace(self, path: Path, text: str) -> None:
        tmp = path.with_name(path.name + ".tmp")
        with open(tmp, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        fsync_path(path.parent)

    def prune(self, keep: int) -> list[str]:
        """Keep the `keep` most recently published snapshots (CURRENT always); delete every other
        snapshot directory, orphans included. Returns the deleted ids."""
        current = self.current_id()
        published = [i for i in self.history() if i != current]
        kept = set(published[max(0, len(published) - (keep - 1)):] if keep > 1 else []) | {current}
        doomed = sorted(p.name for p in self.snapshots.iterdir() if SNAPSHOT_ID.match(p.name) and p.name not in kept)
        for i in doomed:  # renamed away first: a reader sees the snapshot whole or gone, never half deleted
            gone = self.snapshots / f"{TMP_PREFIX}pruned-{i}"
            try:
                os.rename(self.snapshot_dir(i), gone)
            except OSError:
                continue
            shutil.rmtree(gone, ignore_errors=True)
        self._replace(self.history_file, "".join(f"{i}\n" for i in self.history() if i in kept))
        return doomed


def _entry_id(entry: Path) -> str:
    """The id of the update a journal entry (<update id>.<sha256>) belongs to."""
    return entry.name.partition(".")[0]
