"""A snapshot directory: the GTM index, the exact index, the ad table and the codebook of one build
(layout and relations: `schemas.artifacts`).

Opening checks, in order, before any index can be read: the manifest (`Manifest.read`: sealed,
strict, its id the directory's name), the shapes it declares against each other and the spec, the
directory's files against its list (regular files only, nothing unlisted, sizes), then maps each
Arrow file and validates the structure (`check_structure`) while, with `verify`, every file's fast
digest is checked on another thread (or its sha256 in a snapshot written before fast digests; with
`strong`, every sha256 as well): both are passes over the same pages, and the structure checks
read any bytes safely, so neither waits for the other; a digest that fails wins over what the
structure check found (damage is named by its checksum). Mapping comes before hashing so that a
GPU loader can copy the arrays' bytes while they are hashed and checked; a file that cannot be
mapped is hashed first. With `records`, a snapshot whose checks are on record in its ROOT
(`sidindex.snapshot.records`) has its digests verified alone: they tie every byte to the manifest
the record names; and a file the record lists as verified, unchanged since (the same inode, size,
mtime and ctime), is not hashed again. The carried codebook is loaded into memory, so a served
snapshot never reads its directory again. Nothing is unpickled.
"""

from __future__ import annotations

import contextlib
import functools
import os
import shutil
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from schemas.artifacts import (
    AD_DELETED,
    ARRAYS_BY_NAME,
    EXACT_FORM,
    EXACT_ROWS,
    MANIFEST_FILE,
    MATCHER_PLANES,
    UNLISTED,
    plane_arrays,
    shard_dir,
)
from sidindex.artifact import link_file, list_files, same_file, verify_checksums, verify_files
from sidindex.config import BuildConfig
from sidindex.errors import ArtifactError, SidIndexError
from sidindex.exact import ExactIndex
from sidindex.root import Root, pruned
from sidindex.sid.codebook import Codebook, load_codebook, save_codebook
from sidindex.signing import TrustKey
from sidindex.snapshot.arrays import map_array, prefault_pages, same_memory, write_array
from sidindex.snapshot.manifest import ArrayShape, Counts, FileEntry, Journal, Lineage, Manifest, ShardEntry
from sidindex.snapshot.records import Record, read_record, settled, stat_files, write_record
from sidindex.snapshot.validate import (
    Changed,
    check_counts,
    check_cover,
    check_globals,
    check_lineage,
    check_shard,
    check_structure,
)
from sidindex.targeting import TargetingSpec, spec_from_dict
from sidindex.timing import StageClock
from sidindex.trie.build import GTMIndex
from sidindex.trie.shard import Shard, join_shards
from sidindex.trie.stats import GTMStats

# Digests are checked beside the structure checks; False checks them first (a benchmark's reference)
CHECKS_SIDE_BY_SIDE = True


@dataclass(frozen=True)
class Snapshot:
    """An opened snapshot. Arrays are read-only memory maps of its files."""

    path: Path
    manifest: Manifest
    spec: TargetingSpec
    shards: tuple[Shard, ...]  # in token order
    exact: ExactIndex
    ad_id: np.ndarray  # (N,) int64
    codebook: Codebook | None
    recorded: bool = False  # its checks were on record (`records`): only its digests were verified
    covered: bool = False  # its matchers' cover passed (`cover`: checked, or on record)
    # manifest, files, map, structure (with verify: "checksums + structure", side by side; in turn:
    # checksums, structure), copies (waiting for `while_checking`), prefault
    open_seconds: dict[str, float] = field(default_factory=dict)
    # an opened base's shards and join, which the join may take arrays from (dropped once joined)
    beside: tuple[tuple[Shard, ...], GTMIndex] | None = field(default=None, repr=False, compare=False)

    @functools.cached_property
    def gtm(self) -> GTMIndex:
        """The whole trie, the shards' join (`sidindex.trie.shard.join_shards`: one shard's own
        arrays, several shards' copied once), made when first read: validating, inspecting or
        updating a snapshot never needs it; beside a base, it reuses the base's join's arrays."""
        g = join_shards(self.shards, self.beside)
        object.__setattr__(self, "beside", None)  # the base's join is no longer held
        return g

    def joined(self) -> GTMIndex | None:
        """`gtm` if it was made, else None."""
        return self.__dict__.get("gtm")

    @property
    def id(self) -> str:
        return self.manifest.id

    def arrays(self) -> dict[str, np.ndarray]:
        """Every array of the joined index by its contract name (`schemas.artifacts`)."""
        return self.gtm.arrays() | self.exact.arrays() | {"ads": np.asarray(self.ad_id)}

    @property
    def row_states(self) -> np.ndarray:
        """(N,) uint8 each catalog row's state (`schemas.artifacts.AD_LIVE`, ...; all live for a full build)."""
        return self.exact.states(len(self.ad_id))


def _global_arrays(shards: Sequence[Shard], exact: ExactIndex, ad_id: np.ndarray) -> dict[str, np.ndarray]:
    """The arrays a snapshot holds once (the ad table, states, values, exact index), by name."""
    value = shards[0].gtm.ad_value
    return exact.arrays() | {"ads": np.asarray(ad_id)} | ({} if value is None else {"ad_value": value})


def _shard_arrays(shard: Shard) -> dict[str, np.ndarray]:
    """A shard's own arrays, by name."""
    return {n: a for n, a in shard.gtm.arrays().items() if ARRAYS_BY_NAME[n].scope == "shard"}


def write_snapshot(directory: Path, shards: Sequence[Shard], exact: ExactIndex, ad_id: np.ndarray,
                   spec: TargetingSpec, *, snapshot_id: str, codebook: Codebook | None = None,
                   input_fingerprint: str = "", catalog: str = "", build_config: BuildConfig | None = None,
                   stats: GTMStats | None = None, quality: dict | None = None, base: Snapshot | None = None,
                   lineage: Lineage | None = None, journal: Journal | None = None) -> Manifest:
    """Write the files of a snapshot of `shards` (in token order, covering the first-level tokens)
    into the new, empty `directory` (named `snapshot_id`) and return its manifest (written last,
    as manifest.json).

    base: the snapshot an update started from. An array that is still the base's (the same memory,
    in a shard of the same token range) and the base's codebook are hard-linked from it with their
    manifest entries, not written and hashed again, so an update's cost follows what it changed
    (a shard it did not touch is all links). lineage: the update's. journal: the ROOT's journal
    of change files as of this snapshot (none: empty).
    """
    links = None if base is None else _Links.of(base)
    written = [write_shard(directory, k, shard, links) for k, shard in enumerate(shards)]
    global_arrays = _global_arrays(shards, exact, ad_id)
    kept = write_globals(directory, global_arrays, links)
    for _, linked in written:
        kept |= linked
    return write_manifest(directory, [e for e, _ in written], {n: _shape(a) for n, a in global_arrays.items()}, kept,
                          spec, shards[0].gtm.level_sizes, snapshot_id=snapshot_id, codebook=codebook,
                          input_fingerprint=input_fingerprint, catalog=catalog, build_config=build_config,
                          stats=stats, quality=quality, base=base, lineage=lineage, journal=journal)


@dataclass(frozen=True)
class _Links:
    """What a snapshot written over a base may hard-link from it (`write_snapshot`), found once per
    write: the base's checked arrays by file (`_base_files`) and its shards by token range."""

    base: Snapshot
    theirs: dict[str, tuple[ArrayShape, np.ndarray]]
    by_range: dict[tuple[int, int], ShardEntry]

    @classmethod
    def of(cls, base: Snapshot) -> _Links:
        return cls(base, _base_files(base), {(e.lo, e.hi): e for e in base.manifest.shard_list()})


def write_shard(directory: Path, k: int, shard: Shard, links: _Links | None = None
                ) -> tuple[ShardEntry, dict[str, dict]]:
    """Write shard k's files into `directory`'s shards/<k>/ (made anew; what a failed attempt left
    there is removed); returns its manifest entry and the listing of the files linked from the
    base's shard of the same token range (`write_snapshot`)."""
    where = directory / shard_dir(k)
    shutil.rmtree(where, ignore_errors=True)
    where.parent.mkdir(exist_ok=True)  # not `directory`: one removed meanwhile (a failed build's) stays gone
    where.mkdir()
    arrays = _shard_arrays(shard)
    entry = ShardEntry(shard.lo, shard.hi, {n: _shape(a) for n, a in arrays.items()}, shard_dir(k))
    same = None if links is None else links.by_range.get((shard.lo, shard.hi))
    kept: dict[str, dict] = {}
    for name, a in arrays.items():
        _put(directory, name, a, entry.file(name), None if same is None else same.file(name), links, kept)
    return entry, kept


def write_globals(directory: Path, arrays: dict[str, np.ndarray], links: _Links | None = None) -> dict[str, dict]:
    """Write the global arrays (`_global_arrays`) into `directory`; returns the listing of the files
    linked from the base (`write_snapshot`)."""
    kept: dict[str, dict] = {}
    for name, a in arrays.items():
        _put(directory, name, a, ARRAYS_BY_NAME[name].file, ARRAYS_BY_NAME[name].file, links, kept)
    return kept


def _put(directory: Path, name: str, a: np.ndarray, file: str, source: str | None, links: _Links | None,
         kept: dict[str, dict]) -> None:
    """Array `name` as `file`, linked from the base's `source` (its listing into `kept`) when that
    holds this very array."""
    if links is not None and source in links.theirs and same_memory(links.theirs[source][1], a):
        link_file(links.base.path / source, directory / file)
        kept[file] = links.base.manifest.files[source].listing()
        return
    write_array((directory / file).parent, ARRAYS_BY_NAME[name], a)


def list_shard(directory: Path, k: int) -> dict[str, dict]:
    """The manifest listing (sizes, digests) of the files of shard k, by path below `directory`:
    what a Ray task that wrote the shard hands the manifest's writer instead of the arrays."""
    return {f"{shard_dir(k)}/{n}": e for n, e in list_files(directory / shard_dir(k), UNLISTED, fast=True).items()}


def write_manifest(directory: Path, shards: Sequence[ShardEntry], global_arrays: dict[str, ArrayShape],
                   listed: dict[str, dict], spec: TargetingSpec, level_sizes: tuple[int, ...], *, snapshot_id: str,
                   codebook: Codebook | None,
                   input_fingerprint: str = "", catalog: str = "", build_config: BuildConfig | None = None,
                   stats: GTMStats | None = None, quality: dict | None = None, base: Snapshot | None = None,
                   lineage: Lineage | None = None, journal: Journal | None = None) -> Manifest:
    """Write the codebook (linked from `base` when it has this one) and manifest.json into the
    `directory` that holds the shards and global arrays described (`write_shard`, `write_globals`);
    listed: files whose listing is known (linked, or listed by whoever wrote them), the rest are hashed
    here. Returns the manifest."""
    kept = dict(listed)
    if codebook is not None:
        if base is not None and base.manifest.codebook_id == codebook.id:
            for name, entry in base.manifest.files.items():
                if name.startswith(f"codebooks/{codebook.id}/"):
                    link_file(base.path / name, directory / name)
                    kept[name] = entry.listing()
        else:
            save_codebook(codebook, directory)
    first = shards[0].arrays
    manifest = Manifest(
        id=snapshot_id, created=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        input_fingerprint=input_fingerprint, catalog=catalog, codebook_id=codebook.id if codebook else None,
        build_config=build_config, targeting=spec.to_dict(), level_sizes=tuple(level_sizes),
        kway="part_offsets" in first,
        counts=Counts.of_shapes(shards, global_arrays["ads"].rows),
        stats=stats, quality=quality, arrays=dict(global_arrays),
        files={n: FileEntry.of(e) for n, e in list_files(directory, UNLISTED, kept, fast=True).items()},
        shards=tuple(shards), lineage=lineage, journal=journal or Journal())
    (directory / MANIFEST_FILE).write_bytes(manifest.to_bytes())
    return manifest


MAX_JOINED = 2**31 - 1  # nodes and table rows of the shards' join: int32 child ids and row indexes


def _shape(a: np.ndarray) -> ArrayShape:
    return ArrayShape(len(a), a.shape[1] if a.ndim == 2 else None)


def open_snapshot(path: str | Path, *, verify: bool = True, strong: bool = False, cover: bool = False,
                  prefault: bool = False, base: Snapshot | None = None,
                  while_checking: Callable[[dict[str, np.ndarray]], None] | None = None,
                  records: bool = False, rehash: bool = False, trust: TrustKey | None = None) -> Snapshot:
    """Open a ROOT's published snapshot (its CURRENT) or a snapshot directory.

    verify:   also check every file's fast digest (reads every byte, in parallel chunks; a snapshot
              written before fast digests: its sha256). Structure is always validated
    strong:   with verify, check every file's sha256 too, and the structure, whatever a check record
              says (`sidindex validate`; several times slower)
    cover:    also check that every matcher row covers what lies beneath it, and every SID's value
              bound its ads' values (`check_cover`: what digests resealed over damaged rows cannot
              show; `sidindex validate` and an update's base)
    prefault: read every page of every array now, so the first queries do not wait on page faults
    base:     an open snapshot this one may share files with (an update's base): a file that is the
              base's own (the same inode, and the same manifest entry and array shape) is neither
              hashed nor mapped again, its checked array reused; when only the ad states changed,
              only they are validated (what a serving host applies within a second of an update).
              Whatever it shares, a snapshot is accepted exactly when it is without a base
    while_checking: called on another thread with the snapshot's arrays by contract name (every
              one when it has one shard, else the global ones), once its files are listed and
              mapped, while they are hashed and validated: it may copy their bytes (a GPU loader
              stages them meanwhile), never read them as an index. The open waits for it, and
              raises its error only once the snapshot passed (a corrupt snapshot's error wins)
    records:  trust and keep its ROOT's check record (`sidindex.snapshot.records`: a serving host's
              load, an update's base): when it says this very manifest passed the structure check
              (and with `cover` the cover), every file's digest is verified (whatever `verify` says:
              they tie the bytes to the manifest) and those checks are not made again; a file it
              lists as verified with the stat the file has now (inode, size, mtime, ctime) is not
              hashed again, unless `trust` is given. Once the snapshot passed, what this open
              verified is recorded. A snapshot outside a ROOT, or without a record, is checked in
              full. The result's `recorded` says whether its structure was on record
    rehash:   with `records`, hash every file even where the record lists it unchanged (an update's
              base, whose bytes are written into the new snapshot under fresh digests: damage below
              the file system, which no stat shows, would be sealed into it)
    trust:    refuse the snapshot unless its manifest carries this key's signature (`sidindex.signing`),
              before anything else is read; every file's digest is then verified, whatever `verify`
              says (they tie the bytes to the signed manifest)
    A ROOT whose snapshot retention prunes while it is being opened (`_pruned`) is read again once,
    for the snapshot CURRENT names now; when that one is pruned too, and for a snapshot directory
    pruned under the reader, the error is `sidindex.root.pruned`. Seconds per phase are in the
    result's `open_seconds`.
    """
    path = Path(path)
    for attempt in range(2):
        directory = Root.resolve(path)
        keep = Root.containing(directory) if records else None
        try:
            return _open(directory, verify, strong, cover, prefault, base, while_checking, keep, not strong, trust,
                         rehash)
        except ArtifactError:
            if not _pruned(path, directory):
                raise
            if attempt or directory == path:
                raise pruned(directory) from None
    raise AssertionError("unreachable")


def check_to_publish(directory: Path, root: Root, snapshot_id: str) -> Snapshot:
    """Open a snapshot written to be published into `root` as `snapshot_id` (`Root.publish`'s
    check; the manifest names that id) verifying every digest and its structure, and record that
    check and the files verified: a serving host's load then neither checks the structure again
    nor hashes a file unchanged since (`open_snapshot(records=True)`)."""
    checked = _open(directory, True, False, False, False, None, None, root, False, None)
    assert checked.id == snapshot_id, "a snapshot is written under its own id"
    return checked


def read_states(directory: Path, trust: TrustKey | None = None) -> tuple[np.ndarray, np.ndarray] | None:
    """(N,) int64 ad ids and (N,) uint8 row states of the snapshot `directory`, or None when it
    holds no states: only their two files are hashed (against the sealed manifest, signed by `trust`
    when given; every other file's presence and size is checked), what a full build carries forward
    without reading the whole snapshot."""
    m = Manifest.read(directory, trust)
    if "ad_state" not in m.arrays:
        return None
    names = ("ads", "ad_state")
    read = frozenset(ARRAYS_BY_NAME[n].file for n in names)
    verify_files(directory, {n: f.listing() for n, f in m.files.items()}, UNLISTED,
                 trusted=frozenset(m.files) - read)
    ads, state = (map_array(directory, ARRAYS_BY_NAME[n], m.arrays[n].shape) for n in names)
    if len(state) != len(ads) or not np.all(state <= AD_DELETED):
        raise ArtifactError(f"{directory / ARRAYS_BY_NAME['ad_state'].file}: one known state per ad row expected; "
                            "the snapshot is corrupt")
    return ads, state


def _pruned(path: Path, directory: Path) -> bool:
    """Whether retention took `directory`, opened from `path`, away: it is gone, or `path` is a ROOT
    whose CURRENT names another snapshot now (retention deletes only what CURRENT does not name,
    and a reader may see a file missing while it still is)."""
    if not os.path.lexists(directory):
        return True
    if directory == path:
        return False
    try:
        return Root(path).current_id() != directory.name
    except ArtifactError:  # CURRENT unreadable: the snapshot's own error says more
        return False


def _open(directory: Path, verify: bool, strong: bool, cover: bool, prefault: bool, base: Snapshot | None,
          while_checking: Callable[[dict[str, np.ndarray]], None] | None,
          keep: Root | None, trusting: bool, trust: TrustKey | None, rehash: bool = False) -> Snapshot:
    """`open_snapshot` of the snapshot `directory`; keep: the ROOT whose check record of it is
    read (when `trusting`) and written once the snapshot passed (`sidindex.snapshot.records`);
    rehash: no file is taken as verified by the record."""
    clock = StageClock()
    m, spec = _manifest(directory, trust)
    digest = m.sha256() if keep is not None else ""
    record = read_record(keep, m.id, digest) if keep is not None and trusting else Record()
    needs = ("structure", "cover") if cover else ("structure",)
    on_record = record.checks.issuperset(needs)
    verify = verify or on_record or trust is not None  # a signature vouches for the manifest, digests for the rest
    clock.lap("manifest")
    entries = m.shard_list()
    theirs = _base_files(base) if base is not None and _comparable(m, spec, base) else {}
    held = _held(m)
    shared = frozenset(f for f, (shape, _) in theirs.items() if held.get(f) == shape and base is not None
                       and base.manifest.files.get(f) == m.files.get(f) and same_file(directory / f, base.path / f))
    listing = {n: f.listing() for n, f in m.files.items()}
    verify_files(directory, listing, UNLISTED, checksums=False)  # regular files of the listed sizes
    # taken before anything is hashed: a file changed meanwhile is recorded as it was, so hashed next time
    stats, taken = stat_files(directory, listing) if keep is not None and verify else ({}, 0)
    unchanged = frozenset() if rehash else record.unchanged(stats)  # files as they were when verified
    # with a trust key the record never stands in for a digest: whoever can rewrite ROOT can
    # rewrite its records, and only the digests tie the bytes to the signed manifest
    trusted = shared | unchanged if trust is None else shared
    clock.lap("files")

    def array(name: str, file: str, shape: tuple[int, ...]) -> np.ndarray:
        if file in shared:
            return theirs[file][1]
        return _map(directory, name, file, shape)

    stop = threading.Event()  # set when the open is interrupted: the digests beside it end early

    def checksums() -> None:
        verify_checksums(directory, listing, strong=strong, trusted=trusted, stop=stop)

    try:  # mapped before they are hashed, so that a GPU loader's copies run beside the hashing
        glob = {n: array(n, ARRAYS_BY_NAME[n].file, s.shape) for n, s in m.global_arrays.items()}
        ad_id = glob["ads"]
        exact = ExactIndex.from_arrays(spec, glob, len(ad_id))
        shards = tuple(_mapped_shard(m, entry, glob, array) for entry in entries)
    except ArtifactError:
        if verify:  # a file that cannot be read as an array is damaged: its checksum says so first
            checksums()
        raise
    clock.lap("map")
    with _beside(while_checking, glob | (_shard_arrays(shards[0]) if len(shards) == 1 else {})):
        side_by_side = verify and CHECKS_SIDE_BY_SIDE and not on_record
        if verify and not side_by_side:
            checksums()
            clock.lap("checksums")
        if on_record:  # the structure (and cover): the record's
            codebook = _codebook(directory, m)
        else:
            with _beside(checksums if side_by_side else None, wins=True, stop=stop):
                codebook = _checked(directory, m, shards, exact, ad_id, shared, base, cover)
            clock.lap("checksums + structure" if side_by_side else "structure")
    if keep is not None and verify:  # what this open verified, on record (a saving, never an error)
        write_record(keep, m.id, digest, () if on_record or shared else needs,
                     settled({n: st for n, st in stats.items() if n not in shared or n in unchanged}, taken))
    if while_checking is not None:
        clock.lap("copies")  # waiting for what the checks did not outlast
    if prefault:
        for x in [*exact.arrays().values(), *(a for s in shards for a in _shard_arrays(s).values())]:
            prefault_pages(x)
        clock.lap("prefault")
    beside = None
    if base is not None and (joined := base.joined()) is not None:
        beside = (base.shards, joined)
    return Snapshot(directory, m, spec, shards, exact, ad_id, codebook, on_record, cover, clock.seconds, beside)


def _map(directory: Path, name: str, file: str, shape: tuple[int, ...]) -> np.ndarray:
    """Array `name` of the snapshot `directory`, mapped from its `file` (a path below it)."""
    return map_array(directory / Path(file).parent, ARRAYS_BY_NAME[name], shape)


def _mapped_shard(m: Manifest, entry: ShardEntry, glob: dict[str, np.ndarray],
                  array: Callable[[str, str, tuple[int, ...]], np.ndarray]) -> Shard:
    """The shard the manifest's `entry` lists, its arrays from array(name, file, shape), over the
    global arrays `glob` (each shard's index reads the catalog's values)."""
    return Shard(entry.lo, entry.hi, GTMIndex.from_arrays(
        m.level_sizes, {n: array(n, entry.file(n), s.shape) for n, s in entry.arrays.items()} | _value(glob),
        MATCHER_PLANES))


def _manifest(directory: Path, trust: TrustKey | None = None) -> tuple[Manifest, TargetingSpec]:
    """The snapshot's manifest and spec, once the shapes it declares agree (`_check_shapes`) and,
    given `trust`, its signature."""
    m = Manifest.read(directory, trust)
    where = directory / MANIFEST_FILE
    try:
        spec = spec_from_dict(m.targeting, where=f"{where} targeting")
    except SidIndexError as e:
        raise ArtifactError(str(e)) from None
    _check_shapes(where, m, spec)
    return m, spec


def check_part(directory: Path, part: int | None) -> None:
    """Check one part of the snapshot `directory` as `open_snapshot(directory, verify=True)` checks
    it, so that the parts of a large snapshot are checked side by side (a Ray build's tasks), none
    holding it whole: part None the manifest, the file list and sizes, the counts, the global
    arrays' digests and structure, the lineage and the codebook; part k shard k's digests and trie
    (against the global arrays it reads). A snapshot passes `open_snapshot` exactly when part None
    and each of its shards' parts pass; the first error met may differ."""
    m, spec = _manifest(directory)
    listing = {n: f.listing() for n, f in m.files.items()}
    entries = m.shard_list()
    entry = None if part is None else entries[part]
    if entry is None:
        verify_files(directory, listing, UNLISTED, checksums=False)
        theirs = {e.file(n) for e in entries for n in e.arrays}
        mine = {n: e for n, e in listing.items() if n not in theirs}
    else:
        mine = {entry.file(n): listing[entry.file(n)] for n in entry.arrays}
    array = functools.partial(_map, directory)
    try:
        glob = {n: array(n, ARRAYS_BY_NAME[n].file, s.shape) for n, s in m.global_arrays.items()}
        exact = ExactIndex.from_arrays(spec, glob, len(glob["ads"]))
        shard = None if entry is None else _mapped_shard(m, entry, glob, array)
    except ArtifactError:
        verify_checksums(directory, mine)
        raise
    verify_checksums(directory, mine)
    if entry is not None and shard is not None:
        check_shard(directory / entry.directory, shard, exact, len(glob["ads"]))
        return
    check_globals(directory, exact, glob["ads"])
    check_counts(directory, m.counts, Counts.of_shapes(entries, len(glob["ads"])))
    check_lineage(directory, m.lineage, exact)
    _codebook(directory, m)


def _checked(directory: Path, m: Manifest, shards: Sequence[Shard], exact: ExactIndex, ad_id: np.ndarray,
             shared: frozenset[str], base: Snapshot | None, cover: bool) -> Codebook | None:
    """Validate an opened snapshot's structure (beside the base's checked files it `shared`), its
    lineage and, with `cover`, its matchers' cover; then load its codebook into memory."""
    entries, changed = m.shard_list(), None
    if shared and base is not None and len(ad_id) >= len(base.ad_id):  # rows never leave an update's base
        changed = Changed(frozenset(n for n in m.global_arrays if ARRAYS_BY_NAME[n].file not in shared),
                          tuple(frozenset(n for n in entry.arrays if entry.file(n) not in shared) for entry in entries))
    placed = [(directory / entry.directory, shard) for entry, shard in zip(entries, shards)]
    check_structure(directory, placed, exact, ad_id, m.counts, changed=changed,
                    base_state=None if base is None else base.row_states)
    check_lineage(directory, m.lineage, exact)
    if cover:  # beside a base whose cover passed, under the same spec, the relations it kept hold
        kept = {(s.lo, s.hi): (s.gtm, base.exact) for s in base.shards} if (
            base is not None and base.covered and _comparable(m, exact.spec, base)) else {}
        for where, shard in placed:
            check_cover(where, shard.gtm, exact, kept.get((shard.lo, shard.hi)))
    if base is not None and shared and m.codebook_id == base.manifest.codebook_id and all(
            n in shared for n in m.files if n.startswith("codebooks/")):
        return base.codebook
    return _codebook(directory, m)


@contextlib.contextmanager
def _beside(fn: Callable[..., None] | None, *args: object, wins: bool = False,
            stop: threading.Event | None = None) -> Iterator[None]:
    """fn(*args) on another thread while the block runs, waited for either way; an interrupt of
    the block sets `stop` first (fn watches it to end early). When both fail, the block's error is
    raised, or with `wins` fn's when it is about the snapshot (`SidIndexError`; an interrupt is
    never replaced); the other is added to it as a note."""
    if fn is None:
        yield
        return
    with ThreadPoolExecutor(1) as pool:
        done = pool.submit(fn, *args)
        try:
            yield
        except BaseException as e:
            interrupted = not isinstance(e, Exception)
            if interrupted and stop is not None:
                stop.set()
            wait([done])
            if (theirs := done.exception()) is None or interrupted and stop is not None:
                raise
            if wins and not interrupted and isinstance(theirs, SidIndexError):
                theirs.add_note(f"(what ran beside it failed too: {e!r})")
                raise theirs from None
            e.add_note(f"(what ran while checking failed too: {theirs!r})")
            raise
        done.result()


def _value(glob: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """The catalog's values, which every shard's index reads (an empty dict without them)."""
    return {"ad_value": glob["ad_value"]} if "ad_value" in glob else {}


def _held(m: Manifest) -> dict[str, ArrayShape]:
    """The shape of the array each of the manifest's array files holds, by file."""
    out = {ARRAYS_BY_NAME[n].file: a for n, a in m.global_arrays.items()}
    for e in m.shard_list():
        out |= {e.file(n): a for n, a in e.arrays.items()}
    return out


def _base_files(base: Snapshot) -> dict[str, tuple[ArrayShape, np.ndarray]]:
    """The base's array files: each one's shape and checked array, by file."""
    m = base.manifest
    glob = _global_arrays(base.shards, base.exact, base.ad_id)
    out = {ARRAYS_BY_NAME[n].file: (m.arrays[n], a) for n, a in glob.items()}
    for e, s in zip(m.shard_list(), base.shards):
        out |= {e.file(n): (e.arrays[n], a) for n, a in _shard_arrays(s).items()}
    return out


def _comparable(m: Manifest, spec: TargetingSpec, base: Snapshot) -> bool:
    """Whether the manifests agree on what the arrays mean (level sizes, spec, partitions, codebook,
    the arrays present but an update's), so that a base's checks hold for a file both share."""
    b = base.manifest
    return (m.level_sizes == b.level_sizes and spec == base.spec and m.kway == b.kway
            and m.codebook_id == b.codebook_id
            and set(m.global_arrays) - {"ad_state"} == set(b.global_arrays) - {"ad_state"})


def _codebook(directory: Path, m: Manifest) -> Codebook | None:
    """The carried codebook, in memory (its files were listed and checked with the snapshot's)."""
    if m.codebook_id is None:
        return None
    cb_dir = Root(directory).codebooks / m.codebook_id  # carried as a ROOT keeps it
    if not any(n.startswith(f"codebooks/{m.codebook_id}/") for n in m.files):
        raise ArtifactError(f"{cb_dir}: the snapshot's codebook {m.codebook_id!r} is not in it")
    cb = load_codebook(cb_dir, verify=False)
    if cb.id != m.codebook_id or cb.level_sizes != m.level_sizes:
        raise ArtifactError(f"{directory / MANIFEST_FILE}: level_sizes {list(m.level_sizes)} or codebook id "
                            f"{m.codebook_id!r} disagree with the carried codebook ({cb.id}, {list(cb.level_sizes)})")
    return cb


def _check_shapes(where: Path, m: Manifest, spec: TargetingSpec) -> None:
    """The shapes the manifest declares agree with each other, the spec and the counts (before
    anything is mapped: a structure check may then rely on them)."""
    s = {n: a.rows for n, a in m.global_arrays.items()}
    width = {n: a.width for n, a in m.global_arrays.items()}
    L, N = len(m.level_sizes), s["ads"]
    agree = []
    for p, layout in zip(MATCHER_PLANES, spec.layouts):
        a = plane_arrays(p)
        if EXACT_FORM[p] == EXACT_ROWS:
            agree.append((a.exact_rows, s[a.exact_rows] == N and width[a.exact_rows] == layout.words))
        else:
            agree.append((a.exact_hash_offsets, s[a.exact_hash_offsets] == len(layout.names) * (N + 1)))
    if "ad_state" in s:
        agree.append(("ad_state", s["ad_state"] == N))
    if "ad_value" in s:
        agree.append(("ad_value", s["ad_value"] == N))
    for name, ok in agree:
        if not ok:
            raise ArtifactError(f"{where}: the shape of {name} ({m.arrays[name].shape}) does not fit the rest of "
                                "the snapshot")
    for k, e in enumerate(m.shard_list()):
        _check_shard_shapes(where, f"shard {k}: " if e.directory else "", e.arrays, L, spec, m.kway)
    # the join numbers nodes and each plane's table rows across shards in int32
    joined = {"nodes": 1 + sum(e.arrays["node_offsets"].rows - 2 for e in m.shard_list())}
    joined |= {f"{p} table rows": sum(e.arrays[plane_arrays(p).table].rows for e in m.shard_list())
               for p in MATCHER_PLANES}
    for what, n in joined.items():
        if n > MAX_JOINED:
            raise ArtifactError(f"{where}: the shards hold {n:,} {what} together, more than the {MAX_JOINED:,} one "
                                "index numbers")
    listed = [ARRAYS_BY_NAME[n].file for n in m.global_arrays] + [e.file(n) for e in m.shard_list() for n in e.arrays]
    missing = sorted(f for f in listed if f not in m.files)
    if missing:
        raise ArtifactError(f"{where}: the file list lacks {missing[:8]}")


def _check_shard_shapes(where: Path, shard: str, arrays: dict[str, ArrayShape], L: int, spec: TargetingSpec,
                        kway: bool) -> None:
    """A shard's shapes agree with each other and the spec (shard: its name in messages)."""
    s = {n: a.rows for n, a in arrays.items()}
    width = {n: a.width for n, a in arrays.items()}
    num_nodes = s["node_offsets"] - 1
    E = num_nodes - 1
    agree = [
        ("depth_offsets", s["depth_offsets"] == L + 2),
        ("node_offsets", num_nodes >= L + 1),
        ("csr_child_nodes", s["csr_child_nodes"] == E),
        ("csr_tokens", s["csr_tokens"] == E),
        ("leaf_ad_offsets", s["leaf_ad_offsets"] >= 2),
        ("leaf_ads", s["leaf_ads"] >= 1),
    ]
    T = s.get(plane_arrays(MATCHER_PLANES[0]).part_index)  # k-way partitions, as the first plane counts them
    for p, layout in zip(MATCHER_PLANES, spec.layouts):
        a = plane_arrays(p)
        agree += [(a.index, s[a.index] == E), (a.table, width[a.table] == layout.words)]
        if kway:
            agree.append((a.part_index, s[a.part_index] == T))
    if kway:
        agree.append(("part_offsets", s["part_offsets"] == E + 1))
    if "entry_live" in s:
        agree.append(("entry_live", s["entry_live"] == E))
    if "entry_value" in s:
        agree.append(("entry_value", s["entry_value"] == E))
        if kway:
            agree.append(("part_value", s["part_value"] == T))
    for name, ok in agree:
        if not ok:
            raise ArtifactError(f"{where}: {shard}the shape of {name} ({arrays[name].shape}) does not fit the rest of "
                                "the snapshot")
