"""A snapshot directory: the GTM index, the exact index, the ad table and the codebook of one build
(layout and relations: `schemas.artifacts`).

Opening checks, in order, before any index can be read: the manifest (`Manifest.read`: sealed,
strict, its id the directory's name), the shapes it declares against each other and the spec, the
directory's files against its list (regular files only, nothing unlisted, sizes; with `verify`,
every file's fast digest, or its sha256 in a snapshot written before fast digests; with `strong`,
every sha256 as well), then maps each Arrow file and validates the structure (`check_structure`). The
carried codebook is loaded into memory, so a served snapshot never reads its directory again.
Nothing is unpickled.
"""

from __future__ import annotations

import os
import time
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
    plane_arrays,
    written_version,
)
from sidindex.artifact import link_file, list_files, same_file, verify_files
from sidindex.config import BuildConfig
from sidindex.errors import ArtifactError, SidIndexError
from sidindex.matchers.exact import ExactIndex
from sidindex.root import Root, pruned
from sidindex.sid.codebook import Codebook, load_codebook, save_codebook
from sidindex.snapshot.arrays import map_array, prefault_pages, same_memory, write_array
from sidindex.snapshot.manifest import ArrayShape, Counts, FileEntry, Lineage, Manifest
from sidindex.snapshot.validate import STATE_ARRAYS, check_cover, check_lineage, check_structure
from sidindex.targeting import TargetingSpec, spec_from_dict
from sidindex.timing import StageClock
from sidindex.trie.build import GTMIndex
from sidindex.trie.stats import GTMStats


@dataclass(frozen=True)
class Snapshot:
    """An opened snapshot. Arrays are read-only memory maps of its files."""

    path: Path
    manifest: Manifest
    spec: TargetingSpec
    gtm: GTMIndex
    exact: ExactIndex
    ad_id: np.ndarray  # (N,) int64
    codebook: Codebook | None
    open_seconds: dict[str, float] = field(default_factory=dict)  # manifest, files, map, structure, prefault

    @property
    def id(self) -> str:
        return self.manifest.id

    def arrays(self) -> dict[str, np.ndarray]:
        """Every array by its contract name (`schemas.artifacts`)."""
        return _arrays(self.gtm, self.exact, self.ad_id)

    @property
    def row_states(self) -> np.ndarray:
        """(N,) uint8 each catalog row's state (`schemas.artifacts.AD_LIVE`, ...; all live for a full build)."""
        return self.exact.states(len(self.ad_id))


def _arrays(gtm: GTMIndex, exact: ExactIndex, ad_id: np.ndarray) -> dict[str, np.ndarray]:
    """Every array of a snapshot by its contract name."""
    return gtm.arrays() | exact.arrays() | {"ads": np.asarray(ad_id)}


def write_snapshot(directory: Path, gtm: GTMIndex, exact: ExactIndex, ad_id: np.ndarray, spec: TargetingSpec, *,
                   snapshot_id: str, codebook: Codebook | None = None, input_fingerprint: str = "",
                   catalog: str = "", build_config: BuildConfig | None = None, stats: GTMStats | None = None,
                   quality: dict | None = None, base: Snapshot | None = None,
                   lineage: Lineage | None = None) -> Manifest:
    """Write the files of a snapshot into the new, empty `directory` (named `snapshot_id`) and
    return its manifest (written last, as manifest.json).

    base: the snapshot an update started from. An array that is still the base's (the same memory)
    and the base's codebook are hard-linked from it with their manifest entries, not written and
    hashed again, so an update's cost follows what it changed. lineage: the update's.
    """
    arrays = _arrays(gtm, exact, ad_id)
    kept = {}  # files linked from the base, with the base's manifest entries
    shared = base.arrays() if base is not None else {}
    for name, a in arrays.items():
        spec_ = ARRAYS_BY_NAME[name]
        if base is not None and name in shared and same_memory(shared[name], a):
            link_file(base.path / spec_.file, directory / spec_.file)
            kept[spec_.file] = base.manifest.files[spec_.file]
        else:
            write_array(directory, spec_, a)
    if codebook is not None:
        if base is not None and base.manifest.codebook_id == codebook.id:
            for name, entry in base.manifest.files.items():
                if name.startswith(f"codebooks/{codebook.id}/"):
                    link_file(base.path / name, directory / name)
                    kept[name] = entry
        else:
            save_codebook(codebook, directory)
    manifest = Manifest(
        id=snapshot_id, created=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        input_fingerprint=input_fingerprint, catalog=catalog, codebook_id=codebook.id if codebook else None,
        build_config=build_config, targeting=spec.to_dict(), level_sizes=tuple(gtm.level_sizes),
        kway=gtm.part_offsets is not None, counts=Counts.of(gtm, ad_id), stats=stats, quality=quality,
        arrays={n: ArrayShape(len(a), a.shape[1] if a.ndim == 2 else None) for n, a in arrays.items()},
        files={n: FileEntry.of(e) for n, e in list_files(directory, MANIFEST_FILE,
                                                          {n: f.listing() for n, f in kept.items()},
                                                          fast=True).items()},
        lineage=lineage, format_version=written_version(arrays, lineage is not None))
    (directory / MANIFEST_FILE).write_bytes(manifest.to_bytes())
    return manifest


def open_snapshot(path: str | Path, *, verify: bool = True, strong: bool = False, cover: bool = False,
                  prefault: bool = False, base: Snapshot | None = None) -> Snapshot:
    """Open a ROOT's published snapshot (its CURRENT) or a snapshot directory.

    verify:   also check every file's fast digest (reads every byte, in parallel chunks; a snapshot
              written before fast digests: its sha256). Structure is always validated
    strong:   with verify, check every file's sha256 too (`sidindex validate`; several times slower)
    cover:    also check that every matcher row covers what lies beneath it (`check_cover`: what
              digests resealed over damaged rows cannot show; `sidindex validate` and an update's base)
    prefault: read every page of every array now, so the first queries do not wait on page faults
    base:     an open snapshot this one may share files with (an update's base): a file that is the
              base's own (the same inode, and the same manifest entry and array shape) is neither
              hashed nor mapped again, its checked array reused; when only the ad states changed,
              only they are validated (what a serving host applies within a second of an update).
              Whatever it shares, a snapshot is accepted exactly when it is without a base
    A ROOT whose snapshot retention prunes while it is being opened (`_pruned`) is read again once,
    for the snapshot CURRENT names now; when that one is pruned too, and for a snapshot directory
    pruned under the reader, the error is `sidindex.root.pruned`. Seconds per phase are in the
    result's `open_seconds`.
    """
    path = Path(path)
    for attempt in range(2):
        directory = Root.resolve(path)
        try:
            return _open(directory, verify, strong, cover, prefault, base)
        except ArtifactError:
            if not _pruned(path, directory):
                raise
            if attempt or directory == path:
                raise pruned(directory) from None
    raise AssertionError("unreachable")


def read_states(directory: Path) -> tuple[np.ndarray, np.ndarray] | None:
    """(N,) int64 ad ids and (N,) uint8 row states of the snapshot `directory`, or None when it
    holds no states: only their two files are hashed (against the sealed manifest; every other file's
    presence and size is checked), what a full build carries forward without reading the whole
    snapshot."""
    m = Manifest.read(directory)
    if "ad_state" not in m.arrays:
        return None
    names = ("ads", "ad_state")
    read = frozenset(ARRAYS_BY_NAME[n].file for n in names)
    verify_files(directory, {n: f.listing() for n, f in m.files.items()}, MANIFEST_FILE,
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


def _open(directory: Path, verify: bool, strong: bool, cover: bool, prefault: bool, base: Snapshot | None
          ) -> Snapshot:
    clock = StageClock()
    m = Manifest.read(directory)
    where = directory / MANIFEST_FILE
    try:
        spec = spec_from_dict(m.targeting, where=f"{where} targeting")
    except SidIndexError as e:
        raise ArtifactError(str(e)) from None
    _check_shapes(where, m, spec)
    clock.lap("manifest")
    shared = _shared_files(directory, m, spec, base) if base is not None else frozenset()
    verify_files(directory, {n: f.listing() for n, f in m.files.items()}, MANIFEST_FILE, checksums=verify,
                 strong=strong, trusted=shared)
    clock.lap("checksums" if verify else "files")
    reused = ({n: a for n, a in base.arrays().items() if ARRAYS_BY_NAME[n].file in shared}
              if base is not None and shared else {})
    arrays = {n: reused[n] if n in reused else map_array(directory, ARRAYS_BY_NAME[n], s.shape)
              for n, s in m.arrays.items()}
    ad_id = arrays["ads"]
    exact = ExactIndex.from_arrays(spec, arrays, len(ad_id))
    gtm = GTMIndex.from_arrays(m.level_sizes, arrays, MATCHER_PLANES)
    clock.lap("map")
    check_structure(directory, gtm, exact, ad_id, m.counts, changed=set(arrays) - set(reused) if reused else None,
                    base_state=None if base is None else base.row_states)
    check_lineage(directory, m.lineage, exact.ad_state)
    if cover:
        check_cover(directory, gtm, exact)
    codebook = base.codebook if base is not None and shared and m.codebook_id == base.manifest.codebook_id and all(
        n in shared for n in m.files if n.startswith("codebooks/")) else _codebook(directory, m)
    clock.lap("structure")
    if prefault:
        for a in arrays.values():
            prefault_pages(a)
        clock.lap("prefault")
    return Snapshot(directory, m, spec, gtm, exact, ad_id, codebook, clock.seconds)


def _shared_files(directory: Path, m: Manifest, spec: TargetingSpec, base: Snapshot) -> frozenset[str]:
    """The files of `directory` that are the base's own: one inode, and everything the manifests
    say of it the same (its entry, the shape of the array it holds). None when the manifests
    disagree on what the arrays mean (level sizes, spec, partitions, codebook, the arrays present
    but an update's), since the base's checks held for the base's manifest."""
    b = base.manifest
    if (m.level_sizes != b.level_sizes or spec != base.spec or m.kway != b.kway or m.codebook_id != b.codebook_id
            or set(m.arrays) - STATE_ARRAYS != set(b.arrays) - STATE_ARRAYS):
        return frozenset()
    held = {ARRAYS_BY_NAME[n].file: n for n in m.arrays}  # one array per file
    return frozenset(n for n, f in m.files.items()
                     if b.files.get(n) == f and (n not in held or m.arrays[held[n]] == b.arrays.get(held[n]))
                     and same_file(directory / n, base.path / n))


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
    s = {n: a.rows for n, a in m.arrays.items()}
    width = {n: a.width for n, a in m.arrays.items()}
    L, N = len(m.level_sizes), s["ads"]
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
        if EXACT_FORM[p] == EXACT_ROWS:
            agree.append((a.exact_rows, s[a.exact_rows] == N and width[a.exact_rows] == layout.words))
        else:
            agree.append((a.exact_hash_offsets, s[a.exact_hash_offsets] == len(layout.names) * (N + 1)))
        if m.kway:
            agree.append((a.part_index, s[a.part_index] == T))
    if m.kway:
        agree.append(("part_offsets", s["part_offsets"] == E + 1))
    if "ad_state" in s:
        agree += [("ad_state", s["ad_state"] == N), ("entry_live", s["entry_live"] == E)]
    if "ad_value" in s:
        agree += [("ad_value", s["ad_value"] == N), ("entry_value", s["entry_value"] == E)]
        if m.kway:
            agree.append(("part_value", s["part_value"] == T))
    for name, ok in agree:
        if not ok:
            raise ArtifactError(f"{where}: the shape of {name} ({m.arrays[name].shape}) does not fit the rest of "
                                "the snapshot")
    missing = sorted(ARRAYS_BY_NAME[n].file for n in m.arrays if ARRAYS_BY_NAME[n].file not in m.files)
    if missing:
        raise ArtifactError(f"{where}: the file list lacks {missing}")
