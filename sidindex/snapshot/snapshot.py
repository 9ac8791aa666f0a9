"""A snapshot directory: the GTM index, the exact index and the ad table of one build.

    manifest.json        format, version, id, build inputs (fingerprint, targeting spec, codebook
                         id, config), counts, statistics, and every file with dtype, shape, size
                         and sha256
    <array>.bin          raw arrays (`sidindex.snapshot.arrays`), named as in `GTMIndex`, plus
                         exact_bitmask_rows, exact_hash_offsets, exact_hashes
    ads.arrow            Arrow IPC file: ad_id of each catalog row (leaf_ads index it)
    codebooks/<id>/      the frozen codebook the SIDs came from, when the build had one

Opening checks the manifest (names confined to the directory, dtypes and shapes that agree with
each other), optionally the checksums, then memory-maps every file (checking its header and size)
and validates the structure (`sidindex.snapshot.validate`) before anything can read an index
from it. Nothing is unpickled.
"""

from __future__ import annotations

import json
import math
import re
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pyarrow as pa

from sidindex.artifact import read_manifest, sha256_file
from sidindex.errors import ArtifactError
from sidindex.matchers.bitmask import bitmask_layout
from sidindex.matchers.exact import ExactIndex
from sidindex.snapshot.arrays import DTYPES, map_array, prefault_pages, write_array
from sidindex.snapshot.validate import check_structure
from sidindex.targeting import TargetingSpec, spec_from_dict
from sidindex.timing import StageClock
from sidindex.trie.build import GTMIndex

FORMAT = "sidindex.snapshot"
FORMAT_VERSION = 1
MANIFEST = "manifest.json"
ADS = "ads.arrow"
MAX_DIM = 1 << 40  # no snapshot array is longer; a larger shape is a corrupt manifest

# name -> (dtype, ndim); the optional k-way arrays come together or not at all
ARRAYS = {
    "node_offsets": ("<i8", 1), "csr_child_nodes": ("<i4", 1), "csr_tokens": ("<i2", 1),
    "bitmask_index": ("<i4", 1), "bloom_index": ("<i4", 1), "bitmask_table": ("<u8", 2), "bloom_table": ("<u8", 2),
    "depth_offsets": ("<i8", 1), "leaf_ad_offsets": ("<i8", 1), "leaf_ads": ("<i8", 1),
    "exact_bitmask_rows": ("<u8", 2), "exact_hash_offsets": ("<i8", 2), "exact_hashes": ("<u8", 1),
}
KWAY_ARRAYS = {"part_offsets": ("<i8", 1), "part_bitmask_index": ("<i4", 1), "part_bloom_index": ("<i4", 1)}
_NAME = re.compile(r"^[a-z][a-z0-9_]*\.(bin|arrow)$")


@dataclass(frozen=True)
class Snapshot:
    """An opened snapshot. Arrays are read-only memory maps of its files."""

    path: Path
    manifest: dict
    spec: TargetingSpec
    gtm: GTMIndex
    exact: ExactIndex
    ad_id: np.ndarray  # (N,) int64
    open_seconds: dict[str, float] = field(default_factory=dict)  # manifest, checksums, map, structure, prefault

    @property
    def id(self) -> str:
        return self.manifest["id"]


def write_snapshot(directory: Path, gtm: GTMIndex, exact: ExactIndex, ad_id: np.ndarray, spec: TargetingSpec,
                   info: dict) -> dict:
    """Write the files of a snapshot into the new, empty `directory`; returns the manifest.

    info: id, input_fingerprint, codebook_id, build config, stats... (merged into the manifest)
    """
    arrays = {name: getattr(gtm, name) for name in ARRAYS if not name.startswith("exact_")}
    arrays |= {"exact_bitmask_rows": exact.bitmask_rows, "exact_hash_offsets": exact.hash_offsets,
               "exact_hashes": exact.hashes}
    if gtm.part_offsets is not None:
        arrays |= {name: getattr(gtm, name) for name in KWAY_ARRAYS}
    files = {}
    for name, a in arrays.items():
        dtype = (ARRAYS | KWAY_ARRAYS)[name][0]
        path = directory / f"{name}.bin"
        write_array(path, np.asarray(a).astype(dtype, copy=False))
        files[path.name] = {"dtype": dtype, "shape": list(a.shape), "bytes": path.stat().st_size,
                            "sha256": sha256_file(path)}
    with pa.OSFile(str(directory / ADS), "wb") as sink:
        table = pa.table({"ad_id": pa.array(np.asarray(ad_id, dtype=np.int64))})
        with pa.ipc.new_file(sink, table.schema) as writer:
            writer.write_table(table)
    files[ADS] = {"rows": len(ad_id), "bytes": (directory / ADS).stat().st_size, "sha256": sha256_file(directory / ADS)}
    manifest = {"format": FORMAT, "format_version": FORMAT_VERSION, "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                **info, "level_sizes": list(gtm.level_sizes), "targeting": spec.to_dict(),
                "kway": gtm.part_offsets is not None, "files": files}
    (directory / MANIFEST).write_text(json.dumps(manifest, indent=1, sort_keys=True))
    return manifest


def open_snapshot(path: str | Path, *, verify: bool = True, prefault: bool = False) -> Snapshot:
    """Open a snapshot directory (not a ROOT: see `resolve_snapshot`).

    verify:   also check every file's sha256 (reads every byte; structure is always validated)
    prefault: read every page of every file into memory now, so the first queries do not wait on
              page faults (the pages are shared with other processes mapping the same files)
    Time per phase is in the result's `open_seconds`: mapping does not grow with snapshot size;
    structure validation reads the index arrays (vectorised), checksums and prefault every byte.
    """
    path = Path(path)
    clock = StageClock()
    mpath = path / MANIFEST
    m = read_manifest(mpath, FORMAT, FORMAT_VERSION, "snapshot")
    try:
        spec = spec_from_dict(m["targeting"], where=f"{mpath} targeting")
        level_sizes = tuple(m["level_sizes"])
        files = m["files"]
        kway = m["kway"]
    except (KeyError, TypeError) as e:
        raise ArtifactError(f"{mpath}: malformed manifest ({type(e).__name__}: {e})") from None
    specs = _check_manifest(mpath, files, level_sizes, spec, kway)
    clock.lap("manifest")
    if verify:
        for name, entry in files.items():
            fpath = path / name
            size = fpath.stat().st_size if fpath.is_file() else None
            if size != entry["bytes"]:
                raise ArtifactError(f"{fpath}: {size} bytes, the manifest says {entry['bytes']} (missing or truncated?)")
            if sha256_file(fpath) != entry["sha256"]:
                raise ArtifactError(f"{fpath}: checksum mismatch; the file is corrupt")
        clock.lap("checksums")
    arrays = {name: map_array(path / f"{name}.bin", dtype, shape) for name, (dtype, shape) in specs.items()}
    ad_id = _map_ads(path / ADS, files[ADS]["rows"])
    gtm = GTMIndex(level_sizes=level_sizes, **{k: v for k, v in arrays.items() if not k.startswith("exact_")})
    exact = ExactIndex(bitmask_layout(spec), tuple(a.name for a in spec.bloom), arrays["exact_bitmask_rows"],
                       arrays["exact_hash_offsets"], arrays["exact_hashes"])
    clock.lap("map")
    check_structure(path, gtm, exact, len(ad_id))
    clock.lap("structure")
    if prefault:
        for a in (*arrays.values(), ad_id):
            prefault_pages(a)
        clock.lap("prefault")
    return Snapshot(path, m, spec, gtm, exact, ad_id, clock.seconds)


def _check_manifest(mpath: Path, files: object, level_sizes: tuple, spec: TargetingSpec, kway: object,
                    ) -> dict[str, tuple[str, tuple[int, ...]]]:
    """(dtype, shape) of every array, after checking the manifest's file list agrees with itself."""
    def bad(msg: str) -> ArtifactError:
        return ArtifactError(f"{mpath}: {msg}")

    if not isinstance(files, dict) or not isinstance(kway, bool):
        raise bad("'files' must be a table of files and 'kway' true or false")
    if not level_sizes or not all(isinstance(s, int) and 1 <= s <= 32768 for s in level_sizes):
        raise bad(f"level_sizes {list(level_sizes)!r} are not SID level sizes")
    expected = ARRAYS | (KWAY_ARRAYS if kway else {})
    names = {f"{n}.bin" for n in expected} | {ADS}
    for name in files:
        if not isinstance(name, str) or not _NAME.match(name):
            raise bad(f"file name {name!r} is not allowed (names are plain, inside the snapshot directory)")
    if set(files) != names:
        missing, extra = sorted(names - set(files)), sorted(set(files) - names)
        raise bad(f"file list does not match the format (missing {missing}, unexpected {extra})")
    specs = {}
    for name, (dtype, ndim) in expected.items():
        e = files[f"{name}.bin"]
        shape = e.get("shape") if isinstance(e, dict) else None
        if (not isinstance(e, dict) or e.get("dtype") != dtype or dtype not in DTYPES or not isinstance(shape, list)
                or len(shape) != ndim or not all(isinstance(d, int) and 0 <= d <= MAX_DIM for d in shape)
                or not isinstance(e.get("bytes"), int) or not isinstance(e.get("sha256"), str)):
            raise bad(f"entry for {name}.bin is malformed: expected {dtype} with {ndim} dimension(s) of sane size, "
                      "bytes and sha256")
        specs[name] = (dtype, tuple(shape))
    ads = files[ADS]
    if not isinstance(ads, dict) or not all(isinstance(ads.get(k), int) for k in ("rows", "bytes")) or not 0 <= ads["rows"] <= MAX_DIM:
        raise bad(f"entry for {ADS} is malformed")
    # shapes that must agree, checked before any file is mapped
    n = ads["rows"]
    L = len(level_sizes)
    num_nodes = specs["node_offsets"][1][0] - 1
    E = specs["csr_tokens"][1][0]
    agree = [
        ("depth_offsets", specs["depth_offsets"][1] == (L + 2,)),
        ("node_offsets", num_nodes >= 1 and E == num_nodes - 1),
        ("csr_child_nodes", specs["csr_child_nodes"][1] == (E,)),
        ("bitmask_index", specs["bitmask_index"][1] == (E,)),
        ("bloom_index", specs["bloom_index"][1] == (E,)),
        ("bitmask_table", specs["bitmask_table"][1][1] == bitmask_layout(spec).words),
        ("bloom_table", specs["bloom_table"][1][1] == max(1, sum(a.bits // 64 for a in spec.bloom))),
        ("exact_bitmask_rows", specs["exact_bitmask_rows"][1] == (n, bitmask_layout(spec).words)),
        ("exact_hash_offsets", specs["exact_hash_offsets"][1] == (len(spec.bloom), n + 1)),
    ]
    if kway:
        agree.append(("part_offsets", specs["part_offsets"][1] == (E + 1,)))
        T = specs["part_bitmask_index"][1]
        agree.append(("part_bloom_index", specs["part_bloom_index"][1] == T))
    for name, ok in agree:
        if not ok:
            raise bad(f"shape of {name}.bin {list(specs[name][1])} does not fit the rest of the snapshot")
    if math.prod(specs["leaf_ads"][1]) == 0:
        raise bad("leaf_ads.bin is empty: a snapshot holds at least one SID")
    return specs


def _map_ads(path: Path, rows: int) -> np.ndarray:
    """(N,) int64 ad ids from the Arrow IPC file, memory-mapped (no copy)."""
    try:
        table = pa.ipc.open_file(pa.memory_map(str(path), "r")).read_all()
        col = table.column("ad_id")
    except (pa.ArrowException, KeyError, OSError) as e:
        raise ArtifactError(f"{path}: not a valid ads table ({e})") from None
    if table.num_rows != rows or col.type != pa.int64() or col.null_count:
        raise ArtifactError(f"{path}: expected {rows} non-null int64 ad ids, found {table.num_rows} of {col.type}")
    return col.to_numpy() if col.num_chunks == 1 else np.concatenate([c.to_numpy() for c in col.chunks])
