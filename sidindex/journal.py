"""The journal of change files (docs/design.md §15): which change files a ROOT holds and in what
order, as the published snapshot's manifest records them (`Journal`), never as a directory lists
them.

An update copies its change file into ROOT/changes/<update id>.<sha256>/<name> (`sidindex.root`)
and records it in its snapshot's manifest after its base's entries. A full build told the newest
change file its catalog export holds (its watermark) re-applies the entries recorded after it,
in the order they were published, and records only those: the rest are in the export. So:
  - a recorded entry that is missing, or whose bytes are not the recorded ones, is refused;
  - an entry no record names (forged, or renamed after an edit) is never applied, and reported;
  - a watermark must name the record's own watermark or one of its entries (the first one a ROOT
    is told, while its journal is empty, is taken as given).
The manifest is sealed, and signed when the ROOT signs (`sidindex.signing`), so whoever can only
write the journal's directory can neither drop, reorder nor add a change.

A ROOT published before manifests recorded the journal (format version 8) has its record read
from the directory and THROUGH, as it was then, until its next update or build records one.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Sequence
from pathlib import Path

from sidindex.artifact import sha256_file
from sidindex.errors import ArtifactError, InputError
from sidindex.root import Root
from sidindex.snapshot.manifest import MAX_JOURNAL, Journal, JournalRecord, Manifest


def recorded(root: Root, manifest: Manifest | None) -> tuple[Journal, bool]:
    """The journal the published snapshot (`manifest`, None: nothing published) records, and
    whether it records one (False: an older snapshot's, read from the directory)."""
    if manifest is None:
        return Journal(), True
    if manifest.journal is not None:
        return manifest.journal, True
    entries = []
    for d in root.entry_dirs():
        files = sorted(f.name for f in d.iterdir()) if d.is_dir() else []
        if len(files) != 1:
            raise ArtifactError(f"{d}: a journal entry holds exactly one change file, found {len(files)}")
        update, _, digest = d.name.partition(".")
        entries.append(JournalRecord(update, files[0], digest))
    return Journal(root.through(), tuple(entries)), False


def change_files(root: Root, entries: Sequence[JournalRecord], copies: Path) -> list[Path]:
    """The change files of recorded `entries`, each copied into the private directory `copies` and
    checked there against its record (present, a regular file alone in its entry, the recorded
    sha256): the copies are what a build applies, so nothing that can write ROOT changes the bytes
    between the check and the parse."""
    out = []
    for k, r in enumerate(entries):
        path = root.entry_dir(r.update, r.sha256) / r.name
        d = path.parent
        if not path.is_file() or path.is_symlink() or not d.is_dir() or d.is_symlink():
            raise ArtifactError(f"{path}: missing; update {r.update} published this change file and the published "
                                "snapshot records it, so the journal was changed. Restore it, or build from an "
                                "export that holds it")
        if len(os.listdir(d)) != 1:
            raise ArtifactError(f"{d}: a journal entry holds exactly one change file; remove the others")
        copy = copies / f"{k:05d}" / r.name
        copy.parent.mkdir()
        shutil.copyfile(path, copy, follow_symlinks=False)
        if sha256_file(copy) != r.sha256:
            raise ArtifactError(f"{path}: its bytes are not those update {r.update} published (sha256 "
                                f"{r.sha256[:12]}...), so the journal was changed. Restore the file, or build from "
                                "an export that holds it")
        out.append(copy)
    return out


def unrecorded(root: Root, journal: Journal) -> list[Path]:
    """The journal entries the directory holds that `journal` does not record: never applied."""
    known = {root.entry_dir(r.update, r.sha256).name for r in journal.entries}
    return [d for d in root.entry_dirs() if d.name not in known]


def replayed(journal: Journal, through: str) -> tuple[JournalRecord, ...]:
    """The entries a build from an export holding the change files through `through` re-applies:
    those published after it (`Journal.since`); InputError when the journal holds no such name."""
    try:
        return journal.since(through)
    except ValueError:
        held = [n for n in (journal.through, *(r.name for r in journal.entries)) if n is not None]
        raise InputError(f"the catalog export holds the change files through {through!r}, a name the ROOT's journal "
                         f"does not hold (it holds {', '.join(map(repr, held[-8:])) or 'none'}"
                         f"{', ...' if len(held) > 8 else ''}): either the export predates the last full build's, "
                         "and building from it would revert the changes in between, or the name is wrong. Build "
                         "from an export that names one of these") from None


def warnings(journal: Journal, on_record: bool, snapshot_id: str) -> list[str]:
    """What a job reading `journal` from snapshot `snapshot_id` says about it: read from the
    directory (an older snapshot's), or close to the most a snapshot records."""
    out = []
    if not on_record:
        out.append(f"the published snapshot {snapshot_id} records no journal (an older format): its entries were read "
                   "from the ROOT's changes directory as listed, and this job records them")
    if len(journal.entries) >= MAX_JOURNAL * 9 // 10:
        out.append(f"the ROOT's journal holds {len(journal.entries)} change files, near the {MAX_JOURNAL} a snapshot "
                   "records (updates are refused then): run a full build told the newest change file its catalog "
                   "export holds, which drops the entries that export holds")
    return out


def after_update(journal: Journal, update: str, name: str, sha256: str) -> Journal:
    """The journal an update publishing change file `name` records."""
    if len(journal.entries) >= MAX_JOURNAL:
        raise ArtifactError(f"the ROOT's journal holds {len(journal.entries)} change files, the most a snapshot "
                            "records; run a full build told the newest change file its catalog export holds, which "
                            "drops the entries that export holds")
    return Journal(journal.through, (*journal.entries, JournalRecord(update, name, sha256)))


def retired(root: Root, old: Journal, new: Journal) -> list[Path]:
    """What a publication recording `new` over `old` deletes after its commit: the old entries the
    new journal no longer records, and an older ROOT's THROUGH (the manifest records it now)."""
    kept = set(new.entries)
    out = [root.entry_dir(r.update, r.sha256) for r in old.entries if r not in kept]
    return out + ([root.through_file] if os.path.lexists(root.through_file) else [])


def holds(journal: Journal, name: str, digest: str) -> bool:
    """Whether the published snapshot holds change file `name` with sha256 `digest`: its journal
    records it, or it is the watermark an export held. A name before that watermark counts too
    when the journal no longer records it: the scheduled rebuild names change files in time order
    (`pipelines.rebuild`), and a full build dropped the entries its export held."""
    if any((r.name, r.sha256) == (name, digest) for r in journal.entries):
        return True
    named = {r.name for r in journal.entries}
    return journal.through is not None and name not in named and name <= journal.through
