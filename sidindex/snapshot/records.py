"""What a ROOT's check record (`ROOT/checked/<id>`, `sidindex.root.Root`) says of a snapshot, and
the digests it lets a reader skip (docs/design.md §7).

A check record names the snapshot and its manifest's sha256, and lists the checks that manifest
passed (structure; matcher cover). It may also list `files`: each file verified against that
manifest, with its (st_dev, st_ino, st_size, st_mtime_ns, st_ctime_ns) when it was verified. A
reader that finds a file with exactly that stat does not hash it again; any other file is hashed
as without a record. Why a matching ctime is enough, what a record cannot see, the SETTLED_NS
window and when a record counts as none: docs/design.md §7, "Verified files are not hashed again".
`open_snapshot(..., records=False)`, `sidindex validate` and a reader given a trust key hash every
file. Writing a record only ever saves work: it is replaced atomically
(`sidindex.artifact.replace_file`), and one that cannot be written is left out without an error.
"""

from __future__ import annotations

import os
import time
from collections.abc import Collection, Iterable
from dataclasses import dataclass, field
from pathlib import Path

from sidindex import __version__
from sidindex.artifact import MAX_MANIFEST_BYTES, read_sealed, replace_file, seal
from sidindex.errors import ArtifactError
from sidindex.root import CHECK_RECORD_FORMAT, CHECK_RECORD_VERSION, CHECKS, Root

# st_dev, st_ino, st_size, st_mtime_ns, st_ctime_ns of a file when its digest was verified
FileStat = tuple[int, int, int, int, int]
SETTLED_NS = 2_000_000_000  # a file changed this recently is hashed again next time (coarse timestamps)


@dataclass(frozen=True)
class Record:
    """A snapshot's check record: the checks its manifest passed, and the files verified against it."""

    checks: frozenset[str] = frozenset()
    files: dict[str, FileStat] = field(default_factory=dict)

    def unchanged(self, stats: dict[str, FileStat]) -> frozenset[str]:
        """The files of `stats` (each file's stat now) that are exactly as they were verified."""
        return frozenset(n for n, s in stats.items() if self.files.get(n) == s)


def read_record(root: Root, snapshot_id: str, manifest_sha256: str) -> Record:
    """Snapshot `snapshot_id`'s record, if it is of the manifest with sha256 `manifest_sha256` and
    written by this sidindex; else an empty one."""
    try:
        doc = read_sealed(root.checked / snapshot_id, CHECK_RECORD_FORMAT, CHECK_RECORD_VERSION, "check record")
    except ArtifactError:
        return Record()
    checks, files = doc.get("checks"), doc.get("files", {})
    if not (doc.get("snapshot") == snapshot_id and doc.get("manifest_sha256") == manifest_sha256
            and doc.get("checker") == f"sidindex {__version__}" and isinstance(checks, list)
            and all(isinstance(c, str) for c in checks) and isinstance(files, dict)
            and all(_is_stat(s) for s in files.values())):
        return Record()
    return Record(frozenset(checks), {n: (s[0], s[1], s[2], s[3], s[4]) for n, s in files.items()})


def write_record(root: Root, snapshot_id: str, manifest_sha256: str, checks: Collection[str],
                 files: dict[str, FileStat] | None = None) -> bool:
    """Record that snapshot `snapshot_id` (its manifest's sha256) passed `checks` (of
    `sidindex.root.CHECKS`, added to those its record holds) and that `files` (their stat then)
    were verified against it, replacing the files the record listed (None: keeping them); a record
    that would say nothing new is not written. Whether the record now says it."""
    held = read_record(root, snapshot_id, manifest_sha256)
    files = held.files if files is None else files
    merged = (held.checks | set(checks)) & CHECKS
    if merged == held.checks and files == held.files:
        return True
    doc = {"format": CHECK_RECORD_FORMAT, "format_version": CHECK_RECORD_VERSION, "snapshot": snapshot_id,
           "manifest_sha256": manifest_sha256, "checks": sorted(merged), "checker": f"sidindex {__version__}",
           "files": {n: list(s) for n, s in sorted(files.items())}}
    text = seal(doc)
    if len(text) > MAX_MANIFEST_BYTES:  # more than a reader reads: none is better than one refused
        return False
    try:
        root.checked.mkdir(exist_ok=True)
        replace_file(root.checked / snapshot_id, lambda tmp: tmp.write_bytes(text))
    except OSError:
        return False
    return True


def stat_files(directory: Path, names: Iterable[str]) -> tuple[dict[str, FileStat], int]:
    """Each file's stat now (a file gone meanwhile is left out), and the time they were taken
    from (ns since the epoch, read before the first)."""
    now = time.time_ns()
    out: dict[str, FileStat] = {}
    for n in names:
        try:
            st = os.stat(directory / n, follow_symlinks=False)
        except OSError:
            continue
        out[n] = (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)
    return out, now


def settled(stats: dict[str, FileStat], taken: int) -> dict[str, FileStat]:
    """The stats (taken at `taken`) of the files last changed at least SETTLED_NS before: a later
    change cannot leave their ctime as it is."""
    return {n: s for n, s in stats.items() if s[4] <= taken - SETTLED_NS}


def _is_stat(s: object) -> bool:
    return isinstance(s, list) and len(s) == 5 and all(isinstance(x, int) and not isinstance(x, bool) for x in s)
