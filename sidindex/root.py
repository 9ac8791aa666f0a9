"""A ROOT: where builds publish snapshots and keep codebooks (docs/design.md §7). Every reader and
writer of a ROOT goes through `Root`; no other module spells these names.

    ROOT/.lock, CURRENT, HISTORY   the publish lock, the published snapshot's id, ids in publishing order
    ROOT/snapshots/<id>/           published snapshots, never modified (.tmp-<id>/: one being written)
    ROOT/codebooks/<id>/           frozen codebooks
    ROOT/changes/<id>.<sha256>/    the journal: the change file that update <id> published
    ROOT/checked/<id>              a check record: the checks snapshot <id>'s manifest passed

Publishing renames a checked snapshot into place, then replaces CURRENT and HISTORY, so a crash
at any point leaves CURRENT naming a complete snapshot; a job publishes only over the CURRENT it
started from. Retention keeps the `keep` most recently published snapshots. The full layout,
publishing, retention, check records, the journal and why ROOT's directories may not link out of
it: docs/snapshot-format.md ("The ROOT", "Publishing and retention"), docs/operations.md.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import re
import shutil
import time
from collections.abc import Callable, Collection, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING

from schemas.artifacts import MANIFEST_FILE
from sidindex.artifact import (
    fsync_tree,
    read_bounded,
    rename_synced,
    replace_file,
    temporary_file,
)
from sidindex.errors import ArtifactError
from sidindex.interrupts import committed, interrupts_deferred, job_starts

if TYPE_CHECKING:
    from sidindex.signing import SigningKey

SNAPSHOT_ID = re.compile(r"^[0-9]{8}T[0-9]{12}Z-[0-9a-f]{8}$")
# <update id>.<sha256 of its file>
JOURNAL_ENTRY = re.compile(SNAPSHOT_ID.pattern.removesuffix("$") + r"\.[0-9a-f]{64}$")
TMP_PREFIX = ".tmp-"
_POINTER_BYTES = 256  # CURRENT holds one id
_HISTORY_BYTES = 1 << 20
CHECK_RECORD_FORMAT = "sidindex-check-record"
CHECK_RECORD_VERSION = 1
CHECKS = frozenset({"structure", "cover"})  # what a check record may hold (digests are verified by every reader)


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
        self.checked = self.path / "checked"

    def snapshot_dir(self, snapshot_id: str) -> Path:
        return self.snapshots / snapshot_id

    def own_directories(self) -> None:
        """Refuse a ROOT whose snapshots/, changes/, codebooks/ or checked/ is a symbolic link out of
        it (one inside it is left alone: it moves nothing out of retention's and the lock's reach)."""
        inside = None
        for d in (self.snapshots, self.changes, self.codebooks, self.checked):
            if d.is_symlink():
                inside = inside or self.path.resolve()
                target = d.resolve()
                if not target.is_relative_to(inside) or target == inside:
                    raise ArtifactError(f"{d}: a symbolic link out of its ROOT (to {target}); a ROOT's snapshots, "
                                        "journal, codebooks and check records are read from its own directories only")

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
            root.own_directories()
            current = root.current_id()
            if current is None:
                raise ArtifactError(f"{path}: a ROOT with no published snapshot (no CURRENT)")
            return root.snapshot_dir(current)
        if os.path.lexists(path / MANIFEST_FILE):
            if (holder := Root.containing(path)) is not None:  # a published snapshot, named by its path
                holder.own_directories()
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
        job_starts()  # a signal noted after an earlier job's commit stops this one before it waits
        with open(self.path / ".lock", "a+b") as f:
            try:
                fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                if waiting:
                    waiting()
                fcntl.flock(f, fcntl.LOCK_EX)
            try:
                self.own_directories()
                yield
            finally:
                fcntl.flock(f, fcntl.LOCK_UN)

    def clean_temporaries(self, spare: Path | None = None) -> list[Path]:
        """Remove what killed builds and updates left (we hold the lock, so nothing of ours is in
        progress but `spare`, a change file being staged): temporaries, and journal entries of
        updates that never published (newer than CURRENT; with nothing published, the whole journal
        and THROUGH belong to no snapshot)."""
        doomed = [p for d in (self.snapshots, self.codebooks, self.changes) if d.is_dir()
                  for p in d.glob(TMP_PREFIX + "*") if p != spare]
        doomed += [temporary_file(p) for p in (self.current_file, self.history_file, self.through_file)
                   if os.path.lexists(temporary_file(p))]
        if self.changes.is_dir():
            try:
                current = self.current_id()
            except ArtifactError:  # unreadable: a build refuses it, and nothing here is touched
                current = ""
            entries = [p for p in self.changes.iterdir() if JOURNAL_ENTRY.match(p.name)]
            if current is None:
                doomed += entries + ([self.through_file] if os.path.lexists(self.through_file) else [])
            elif current:  # an update HISTORY names did publish (CURRENT was moved back since): kept
                published = set(self.history())
                doomed += [p for p in entries if _entry_id(p) > current and _entry_id(p) not in published]
        for p in doomed:
            if p.is_dir() and not p.is_symlink():
                shutil.rmtree(p, ignore_errors=True)
            else:
                p.unlink(missing_ok=True)
        return doomed

    def publish(self, snapshot_id: str, write: Callable[[Path], None], check: Callable[[Path], object],
                keep: int, *, expected: str | None, journal: tuple[Path, str] | None = None,
                retired: Collection[Path] = (), signer: SigningKey | None = None,
                published: Callable[[], object] | None = None) -> Path:
        """Write, check and publish a snapshot, then apply retention; returns its directory.

        write(directory) fills the new, empty directory; check(directory) raises if it is not sound.
        expected: the id CURRENT named when the job read what it publishes (None: nothing was
            published). The lock keeps other writers out; one that does not take it and published
            meanwhile is refused rather than reverted.
        journal: (change file staged by `staged_change`, its sha256) an update applied, which becomes
            the journal entry of `snapshot_id` in the commit.
        retired: journal entries (and a THROUGH file) the new snapshot's journal no longer records,
            deleted after the commit.
        signer: signs the manifest once written (`sidindex.signing`), before the check.
        published: called once the snapshot is CURRENT, before retention deletes what it no longer
            keeps (a job's clock tells the two apart: deleting a snapshot's own files costs time
            that grows with its size, not with what the job changed).
        The commit (the renames) runs with SIGINT and SIGTERM held; once CURRENT names the new
        snapshot the job has succeeded, and under `interrupts_raise` (the CLI, the scheduled
        rebuild) a signal from then on is noted, not raised (`sidindex.interrupts.committed`); a
        library caller's own handler gets it once the commit is done.
        """
        self.snapshots.mkdir(parents=True, exist_ok=True)
        self.clean_temporaries(spare=journal[0].parent if journal is not None else None)
        tmp = self.snapshots / f"{TMP_PREFIX}{snapshot_id}"
        tmp.mkdir()
        final = self.snapshot_dir(snapshot_id)
        try:
            write(tmp)
            if signer is not None:
                signer.sign(tmp)
            # synced beside the check (the disk's work and the check's overlap), before the held
            # section: a signal waits for the renames alone
            with ThreadPoolExecutor(1, thread_name_prefix="sidindex-fsync") as syncing:
                synced = syncing.submit(fsync_tree, tmp)
                check(tmp)
            synced.result()
            self._check_current(expected)
            if journal is not None:
                fsync_tree(journal[0].parent)
            with interrupts_deferred():
                if journal is not None:  # before CURRENT: a crash leaves an entry newer than CURRENT, removed
                    rename_synced(journal[0].parent, self.changes / f"{snapshot_id}.{journal[1]}")
                rename_synced(tmp, final)
                self._replace(self.current_file, snapshot_id + "\n")
                committed(snapshot_id)
                history = [i for i in self.history() if i != snapshot_id] + [snapshot_id]
                self._replace(self.history_file, "\n".join(history) + "\n")
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)  # gone already once renamed
            raise
        if published is not None:
            published()
        self.prune(keep)
        for p in retired:  # each renamed away first: a crash leaves a temporary, never half an entry
            gone = self.changes / f"{TMP_PREFIX}retired-{p.name}"
            with contextlib.suppress(OSError):  # the publication stands; a later writer cleans what is left
                os.rename(p, gone)
                if gone.is_dir() and not gone.is_symlink():
                    shutil.rmtree(gone)
                else:
                    gone.unlink()
        return final

    def _check_current(self, expected: str | None) -> None:
        """Refuse to publish over a CURRENT that is not `expected`: a writer that does not take the
        lock (another host, a hand) published meanwhile, and this job would revert it."""
        now = self.current_or_none()
        if now != expected:
            raise ArtifactError(f"{self.path}: snapshot {now} was published while this job ran (it started from "
                                f"{expected or 'no published snapshot'}); publishing would revert it, so nothing was "
                                "published. Run the job again")

    # --- the change journal -----------------------------------------------------------------

    @contextmanager
    def staged_change(self, path: Path) -> Iterator[Path]:
        """A copy of change file `path` (an update's private copy: the bytes it read and digested) in
        a temporary journal entry, which `publish` makes the update's entry. Removed on leaving,
        unless published."""
        entry = self.changes / f"{TMP_PREFIX}{os.getpid()}-{time.time_ns()}"
        made = not os.path.lexists(self.changes)
        entry.mkdir(parents=True)
        try:
            shutil.copyfile(path, entry / path.name)
            yield entry / path.name
        finally:
            shutil.rmtree(entry, ignore_errors=True)
            if made:  # a refused update leaves the ROOT as it found it (the directory stays once it holds an entry)
                with contextlib.suppress(OSError):
                    self.changes.rmdir()

    def published_dirs(self) -> list[Path]:
        """The snapshot directories the ROOT holds (published, or orphans retention has yet to delete)."""
        if not self.snapshots.is_dir():
            return []
        return sorted(p for p in self.snapshots.iterdir() if SNAPSHOT_ID.match(p.name))

    def entry_dir(self, update: str, digest: str) -> Path:
        """The journal entry of update `update`, whose change file has sha256 `digest`."""
        return self.changes / f"{update}.{digest}"

    def entry_dirs(self) -> list[Path]:
        """The journal entries as the directory lists them, of updates published by CURRENT's time
        (`clean_temporaries` removes newer ones), by name; what they are worth is for the published
        manifest's journal to say (`sidindex.journal`)."""
        current = self.current_id()
        if current is None or not self.changes.is_dir():
            return []
        return sorted(p for p in self.changes.iterdir() if JOURNAL_ENTRY.match(p.name) and _entry_id(p) <= current)

    def through(self) -> str | None:
        """The newest change file name a full build's catalog export held, as ROOTs published before
        the manifest recorded its journal keep it (THROUGH), or None."""
        try:
            raw = read_bounded(self.through_file, _POINTER_BYTES * 4)
        except ArtifactError:
            if not os.path.lexists(self.through_file):
                return None
            raise
        return raw.decode("utf-8", "replace").strip() or None

    @staticmethod
    def containing(directory: Path) -> Root | None:
        """The ROOT a published snapshot directory (ROOT/snapshots/<id>) belongs to; None for one
        elsewhere (nothing records its checks)."""
        if directory.parent.name == "snapshots" and SNAPSHOT_ID.match(directory.name):
            root = Root(directory.parent.parent)
            if os.path.lexists(root.current_file):
                return root
        return None

    def _replace(self, path: Path, text: str) -> None:
        """Replace one of ROOT's small files (CURRENT, HISTORY, THROUGH) with `text`."""
        replace_file(path, lambda tmp: tmp.write_text(text))

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
        if self.checked.is_dir():  # a record outlives no snapshot, nor one that never published
            for record in self.checked.iterdir():
                if record.name not in kept:
                    with contextlib.suppress(OSError):  # not a file of ours: left as it is
                        record.unlink()
        return doomed


def _entry_id(entry: Path) -> str:
    """The id of the update a journal entry (<update id>.<sha256>) belongs to."""
    return entry.name.partition(".")[0]
