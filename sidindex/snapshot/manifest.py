"""The snapshot manifest: one typed, sealed record of a snapshot (keys in `schemas.artifacts`).

`Manifest.read` refuses anything but an exact, intact manifest of this format version: sealed
(`sidindex.artifact.read_sealed`: bounded, canonical, checksummed, no duplicate keys), with exactly the
contract's keys, each of its type, and an id equal to its directory's name (a directory, not a
symbolic link to one). Everything after it reads typed attributes, never keys.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import TYPE_CHECKING, NamedTuple

import numpy as np

from schemas import CHANGE_OPS
from schemas.artifacts import (
    ARRAYS_BY_NAME,
    DIGEST_VERSION,
    FAST_DIGEST,
    GONE_VERSIONS,
    JOURNAL_VERSION,
    MANIFEST_FILE,
    MAX_SHARDS,
    READ_VERSIONS,
    SHARDED_VERSION,
    SNAPSHOT_FORMAT,
    SNAPSHOT_VERSION,
    STATES_VERSION,
    manifest_keys,
    present,
    shard_dir,
    snapshot_version,
)
from sidindex.artifact import read_sealed, seal
from sidindex.config import MAX_TOKEN, BuildConfig
from sidindex.errors import ArtifactError, ConfigError
from sidindex.root import SNAPSHOT_ID, TMP_PREFIX, pruned
from sidindex.trie.build import GTMIndex
from sidindex.trie.stats import GTMStats

if TYPE_CHECKING:
    from sidindex.signing import TrustKey

MAX_ROWS = 1 << 40  # no snapshot array is longer; a larger count is a corrupt manifest
MAX_LEVEL_SIZE = MAX_TOKEN + 1  # tokens are int16
_JSON_TYPES = {"string": str, "int": int, "bool": bool, "object": dict, "list<int>": list, "list<object>": list,
               "null": type(None)}


@dataclass(frozen=True)
class ArrayShape:
    rows: int
    width: int | None  # row width of a 2-D array

    @property
    def shape(self) -> tuple[int, ...]:
        return (self.rows,) if self.width is None else (self.rows, self.width)


@dataclass(frozen=True)
class FileEntry:
    bytes: int
    sha256: str
    fast: str | None = None  # FAST_DIGEST, hex; None in a manifest older than DIGEST_VERSION

    @classmethod
    def of(cls, listing: dict) -> FileEntry:
        """The entry of a manifest's listing (`listing`'s inverse)."""
        return cls(listing["bytes"], listing["sha256"], listing.get(FAST_DIGEST))

    def listing(self) -> dict:
        """The entry as the manifest lists it (`sidindex.artifact.verify_files` reads this)."""
        return {"bytes": self.bytes, "sha256": self.sha256} | ({} if self.fast is None else {FAST_DIGEST: self.fast})


@dataclass(frozen=True)
class ShardEntry:
    """One shard as the manifest lists it (version 8): its first-level tokens [lo, hi) and its
    arrays' shapes; its files lie in `directory` (relative to the snapshot's; "" for the one shard
    of a snapshot written before shards, whose files lie at the top)."""

    lo: int
    hi: int
    arrays: dict[str, ArrayShape]
    directory: str

    def file(self, name: str) -> str:
        """The snapshot-relative path of this shard's array `name`."""
        f = ARRAYS_BY_NAME[name].file
        return f"{self.directory}/{f}" if self.directory else f

    def to_dict(self) -> dict:
        return {"tokens": [self.lo, self.hi], "arrays": {n: asdict(a) for n, a in self.arrays.items()}}


@dataclass(frozen=True)
class Counts:
    """The manifest's `counts`: N catalog rows, P SID rows, S SIDs, the trie's nodes (root included)."""

    ads: int
    sid_rows: int
    sids: int
    nodes: int

    @classmethod
    def of(cls, shards: Sequence[GTMIndex], ad_id: np.ndarray) -> Counts:
        """What the snapshot of an index whose shards' tries are `shards` counts (the nodes of their
        join: one root)."""
        return cls(ads=len(ad_id), sid_rows=sum(len(g.leaf_ads) for g in shards),
                   sids=sum(g.num_leaves for g in shards), nodes=1 + sum(g.num_nodes - 1 for g in shards))

    @classmethod
    def of_shapes(cls, shards: Sequence[ShardEntry], ads: int) -> Counts:
        """`of` from the shards' array shapes (what their arrays hold once mapped)."""
        return cls(ads=ads, sid_rows=sum(e.arrays["leaf_ads"].rows for e in shards),
                   sids=sum(e.arrays["leaf_ad_offsets"].rows - 1 for e in shards),
                   nodes=1 + sum(e.arrays["node_offsets"].rows - 2 for e in shards))

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, doc: dict) -> Counts:
        """`to_dict`'s inverse (ValueError when `doc` is not one)."""
        keys = [f.name for f in fields(cls)]
        if set(doc) != set(keys) or not all(_is_int(doc[k]) and 0 <= doc[k] <= MAX_ROWS for k in keys):
            raise ValueError(f"counts must hold exactly {', '.join(keys)}, each a count")
        return cls(**doc)


@dataclass(frozen=True)
class Lineage:
    """The manifest's `lineage`, present exactly when an update wrote the snapshot (docs/design.md §15;
    each key's meaning in `schemas.artifacts.MANIFEST_KEYS`). changes: rows per op of
    `schemas.CHANGE_OPS`."""

    full_build: str
    base: str
    updates: int
    source: str
    changes: dict[str, int]
    paused: int
    deleted: int
    stale_entries: int
    dead_sids: int

    _COUNTS = ("updates", "paused", "deleted", "stale_entries", "dead_sids")

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, doc: dict) -> Lineage:
        """`to_dict`'s inverse: ids of snapshots, counts that are non-negative ints, changes per op
        (ValueError when `doc` is not one)."""
        keys = {f.name for f in fields(cls)}
        if set(doc) != keys:
            raise ValueError(f"lineage must hold exactly {sorted(keys)}")
        if not all(isinstance(doc[k], str) and SNAPSHOT_ID.match(doc[k]) for k in ("full_build", "base")):
            raise ValueError("lineage: full_build and base must be snapshot ids")
        if not (isinstance(doc["source"], str) and len(doc["source"]) == 64):
            raise ValueError("lineage: source must be the change file's sha256")
        if not all(_is_int(doc[k]) and 0 <= doc[k] <= MAX_ROWS for k in cls._COUNTS) or doc["updates"] < 1:
            raise ValueError(f"lineage: {', '.join(cls._COUNTS)} must be counts (updates at least 1)")
        ch = doc["changes"]
        if not isinstance(ch, dict) or set(ch) != set(CHANGE_OPS) or not all(_is_int(v) and 0 <= v <= MAX_ROWS
                                                                             for v in ch.values()):
            raise ValueError(f"lineage: changes must map each op ({', '.join(CHANGE_OPS)}) to a count")
        return cls(**{**doc, "changes": dict(ch)})


class JournalRecord(NamedTuple):
    """A change file an update published: the update's snapshot id, the file's name, its sha256."""

    update: str
    name: str
    sha256: str


MAX_JOURNAL = 10_000  # entries a manifest records: well inside its byte bound


@dataclass(frozen=True)
class Journal:
    """The manifest's `journal` (docs/design.md §15): the change files its ROOT journals, what a
    full build re-applies from. through: the newest change file the last full build's export was
    told to hold (None: never told); entries: in the order they were published."""

    through: str | None = None
    entries: tuple[JournalRecord, ...] = ()

    def to_dict(self) -> dict:
        return {"through": self.through, "entries": [r._asdict() for r in self.entries]}

    @classmethod
    def from_dict(cls, doc: dict) -> Journal:
        """`to_dict`'s inverse (ValueError when `doc` is not one)."""
        if set(doc) != {"through", "entries"}:
            raise ValueError("journal must hold exactly ['entries', 'through']")
        if doc["through"] is not None and not _is_file_name(doc["through"]):
            raise ValueError("journal: through must be a change file's name or null")
        entries = doc["entries"]
        if not isinstance(entries, list) or len(entries) > MAX_JOURNAL:
            raise ValueError(f"journal: entries must be a list of at most {MAX_JOURNAL}")
        out = []
        for e in entries:
            if not (isinstance(e, dict) and set(e) == set(JournalRecord._fields)
                    and isinstance(e["update"], str) and SNAPSHOT_ID.match(e["update"])
                    and _is_file_name(e["name"]) and _is_hex(e["sha256"], 64)):
                raise ValueError("journal: each entry must be an update's snapshot id, a file name and a sha256")
            out.append(JournalRecord(e["update"], e["name"], e["sha256"]))
        if len({r.update for r in out}) != len(out):
            raise ValueError("journal: each update publishes one entry")
        return cls(doc["through"], tuple(out))

    def since(self, through: str | None) -> tuple[JournalRecord, ...]:
        """The entries published after the newest one named `through` (all of them when `through`
        is this journal's own watermark, which its entries follow; none when the journal is empty
        and has none: the first watermark a ROOT is told); ValueError when the journal holds no
        such name."""
        at = [k for k, r in enumerate(self.entries) if r.name == through]
        if at:  # the newest of that name: an entry named as the watermark came after it
            return self.entries[at[-1] + 1:]
        if through == self.through or (self.through is None and not self.entries):
            return self.entries
        raise ValueError(through)


def _is_file_name(x: object) -> bool:
    return isinstance(x, str) and 0 < len(x) <= 255 and Path(x).name == x and x not in (".", "..")


@dataclass(frozen=True)
class Manifest:
    """A snapshot's manifest. `arrays` maps each array name (`schemas.artifacts.ARRAYS_BY_NAME`)
    present to its shape; `files` every file of the directory but manifest.json. `build_config` and
    `stats` are None for a snapshot written without them (an empty object in the file)."""

    id: str
    created: str
    input_fingerprint: str
    catalog: str
    codebook_id: str | None
    build_config: BuildConfig | None
    targeting: dict
    level_sizes: tuple[int, ...]
    kway: bool
    counts: Counts
    stats: GTMStats | None
    quality: dict | None
    arrays: dict[str, ArrayShape]
    files: dict[str, FileEntry]
    shards: tuple[ShardEntry, ...] = ()  # version 8; `shard_list` reads any version's
    lineage: Lineage | None = None  # an update's (docs/design.md §15); None for a full build
    journal: Journal | None = None  # version 9: never None when written now
    format_version: int = SNAPSHOT_VERSION  # a manifest read keeps its own

    @property
    def version(self) -> int:
        return self.format_version

    @property
    def full_build(self) -> str:
        """The id of the full build this snapshot's updates started from (its own for a full build)."""
        return self.lineage.full_build if self.lineage else self.id

    @property
    def updates(self) -> int:
        """Updates applied since that full build."""
        return self.lineage.updates if self.lineage else 0

    @property
    def total_bytes(self) -> int:
        return sum(f.bytes for f in self.files.values())

    @property
    def global_arrays(self) -> dict[str, ArrayShape]:
        """The arrays one per snapshot (ads, states, values, exact index), by name."""
        return {n: a for n, a in self.arrays.items() if ARRAYS_BY_NAME[n].scope == "global"}

    def shard_list(self) -> tuple[ShardEntry, ...]:
        """The shards, in token order: a snapshot before version 8 is one shard of every token,
        its trie's files at the top."""
        if self.version >= SHARDED_VERSION:
            return self.shards
        trie = {n: a for n, a in self.arrays.items() if ARRAYS_BY_NAME[n].scope == "shard"}
        return (ShardEntry(0, self.level_sizes[0], trie, ""),)

    def shard_bytes(self, shard: ShardEntry) -> int:
        """The bytes of a shard's files."""
        return sum(self.files[shard.file(n)].bytes for n in shard.arrays)

    def sha256(self) -> str:
        """The sha256 of manifest.json (a read one's file is exactly `to_bytes`), as check records
        name it (`sidindex.snapshot.records.write_record`)."""
        return hashlib.sha256(self.to_bytes()).hexdigest()

    def to_bytes(self) -> bytes:
        """The sealed manifest.json text."""
        doc = {f.name: getattr(self, f.name) for f in fields(self)
               if f.name not in ("format_version", "lineage", "shards", "journal")}
        doc |= {"level_sizes": list(self.level_sizes), "counts": self.counts.to_dict(),
                "build_config": {} if self.build_config is None else self.build_config.to_dict(),
                "stats": {} if self.stats is None else self.stats.to_dict(),
                "arrays": {n: asdict(a) for n, a in self.arrays.items()},
                "files": {n: f.listing() for n, f in self.files.items()},
                **({} if self.lineage is None else {"lineage": self.lineage.to_dict()}),
                **({"shards": [e.to_dict() for e in self.shards]} if self.version >= SHARDED_VERSION else {}),
                **({"journal": (self.journal or Journal()).to_dict()} if self.version >= JOURNAL_VERSION else {})}
        if (self.version >= SHARDED_VERSION) != bool(self.shards):
            raise ValueError(f"a manifest lists its shards exactly from format version {SHARDED_VERSION}")
        if not _states_fit(self.version, self.lineage is not None, "ad_state" in self.arrays):
            raise ValueError("a lineage comes with the ad_state array (and before format version "
                             f"{STATES_VERSION}, ad_state with a lineage)")
        if self.version < DIGEST_VERSION and self.version != snapshot_version(self.arrays):
            raise ValueError(f"format version {self.version} does not hold these arrays")
        if any((f.fast is None) == (self.version >= DIGEST_VERSION) for f in self.files.values()):
            raise ValueError(f"files carry {FAST_DIGEST} exactly from format version {DIGEST_VERSION}")
        return seal({"format": SNAPSHOT_FORMAT, "format_version": self.version, **doc})

    @classmethod
    def read(cls, directory: Path, trust: TrustKey | None = None) -> Manifest:
        """The manifest of the snapshot `directory`, checked as the module docstring says, and given
        `trust`, signed by that key (`sidindex.signing`)."""
        path = directory / MANIFEST_FILE
        if directory.is_symlink():  # one pointing out of its ROOT would serve files retention and builds never see
            raise ArtifactError(f"{directory}: is a symbolic link; a snapshot is read from its own directory only")
        if not directory.is_dir():
            raise pruned(directory)
        doc = read_sealed(path, SNAPSHOT_FORMAT, READ_VERSIONS, "snapshot", gone=GONE_VERSIONS)
        if (doc["format_version"] < DIGEST_VERSION and isinstance(doc.get("arrays"), dict)
                and doc["format_version"] != snapshot_version(doc["arrays"])):  # an older version names its arrays
            raise ArtifactError(f"{path}: format version {doc['format_version']} disagrees with its arrays (version "
                                f"{snapshot_version(doc['arrays'])} holds exactly those)")
        m = _parse(path, doc, directory.name.removeprefix(TMP_PREFIX))  # checked before publishing too
        if trust is not None:
            trust.verify(directory, m.to_bytes())
        return m


def _parse(path: Path, doc: dict, dirname: str) -> Manifest:
    def bad(msg: str) -> ArtifactError:
        return ArtifactError(f"{path}: {msg}")

    version = doc["format_version"]
    states = isinstance(doc.get("arrays"), dict) and "ad_state" in doc["arrays"]
    if not _states_fit(version, "lineage" in doc, states):
        raise bad("an update's lineage comes with the ad_state array" + (
            f", and before format version {STATES_VERSION} ad_state with a lineage"
            if version < STATES_VERSION else ""))
    contract = manifest_keys(version, "lineage" in doc)
    keys = {k.key for k in contract}
    if set(doc) != keys:
        missing, extra = sorted(keys - set(doc)), sorted(set(doc) - keys)
        raise bad(f"keys do not match the snapshot format (missing {missing}, unexpected {extra})")
    for k in contract:  # each key of the JSON type the contract gives it
        allowed = tuple(_JSON_TYPES[t.strip()] for t in k.type.split("|"))
        if not isinstance(doc[k.key], allowed) or (int in allowed and isinstance(doc[k.key], bool)):
            raise bad(f"'{k.key}' must be {k.type}, not {type(doc[k.key]).__name__}")
    if not SNAPSHOT_ID.match(doc["id"]) or doc["id"] != dirname:
        raise bad(f"id {doc['id'][:80]!r} does not name this snapshot directory ({dirname!r})")
    sizes = doc["level_sizes"]
    if not sizes or not all(_is_int(s) and 1 <= s <= MAX_LEVEL_SIZE for s in sizes):
        raise bad(f"level_sizes {sizes[:8]!r} are not SID level sizes (each in 1..{MAX_LEVEL_SIZE})")
    sharded = version >= SHARDED_VERSION
    value = "ad_value" in doc["arrays"]  # a catalog with values: every value array
    updated = "ad_state" in doc["arrays"]  # ad states (an update's, or carried forward)
    arrays = _arrays(bad, doc["arrays"], doc["kway"], value, updated, ("global",) if sharded else ("global", "shard"))
    files = _files(bad, doc["files"], version >= DIGEST_VERSION)
    shards = _shards(bad, doc["shards"], sizes[0], doc["kway"], value, updated) if sharded else ()
    try:  # the typed records: their own checks, with this manifest's path
        counts = Counts.from_dict(doc["counts"])
        lineage = Lineage.from_dict(doc["lineage"]) if "lineage" in doc else None
        journal = Journal.from_dict(doc["journal"]) if "journal" in doc else None
        stats = GTMStats.from_dict(doc["stats"]) if doc["stats"] else None
        config = BuildConfig.from_dict(doc["build_config"], "build_config") if doc["build_config"] else None
    except (ValueError, ConfigError) as e:
        raise bad(str(e)) from None
    return Manifest(
        **{k: doc[k] for k in ("id", "created", "input_fingerprint", "catalog", "codebook_id", "targeting", "kway",
                               "quality")},
        build_config=config, level_sizes=tuple(sizes), counts=counts, stats=stats, arrays=arrays, files=files,
        shards=shards, lineage=lineage, journal=journal, format_version=version)


def _states_fit(version: int, lineage: bool, states: bool) -> bool:
    """An update writes ad states and its lineage; from STATES_VERSION on a full build may write
    states alone (the paused ads it carried forward)."""
    return states if lineage else (not states or version >= STATES_VERSION)


def _is_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _arrays(bad: Callable[[str], Exception], arrays: object, kway: bool, value: bool, updated: bool,
            scopes: tuple[str, ...], where: str = "") -> dict[str, ArrayShape]:
    """An array list holding exactly the arrays of `scopes` that a snapshot with (kway) partitions,
    (value) values and (updated) ad states has; where: the shard it belongs to, for messages."""
    expected = {n for n, a in ARRAYS_BY_NAME.items() if a.scope in scopes and present(a.group, kway, value, updated)}
    if not isinstance(arrays, dict) or set(arrays) != expected:
        found = set(arrays) if isinstance(arrays, dict) else set()
        missing, extra = sorted(expected - found), sorted(found - expected)
        raise bad(f"{where}array list does not match the format (missing {missing}, unexpected {extra})")
    out = {}
    for name, e in arrays.items():
        two_d = ARRAYS_BY_NAME[name].width is not None
        if (not isinstance(e, dict) or set(e) != {"rows", "width"} or not _is_int(e["rows"])
                or not 0 <= e["rows"] <= MAX_ROWS
                or not (_is_int(e["width"]) and 1 <= e["width"] <= 4096 if two_d else e["width"] is None)):
            raise bad(f"{where}array {name!r}: expected rows in 0..{MAX_ROWS}" + (
                " and a width in 1..4096" if two_d else " and width null"))
        out[name] = ArrayShape(e["rows"], e["width"])
    return out


def _shards(bad: Callable[[str], Exception], shards: list, vocab: int, kway: bool, value: bool, updated: bool
            ) -> tuple[ShardEntry, ...]:
    """The shard list: 1..MAX_SHARDS shards whose token ranges run, each from where the one before
    ends, from 0 to `vocab`, each with its arrays."""
    if not 1 <= len(shards) <= MAX_SHARDS:
        raise bad(f"shards: expected 1 to {MAX_SHARDS} shards, found {len(shards)}")
    out, at = [], 0
    for k, e in enumerate(shards):
        where = f"shard {k}: "
        if not isinstance(e, dict) or set(e) != {"tokens", "arrays"}:
            raise bad(f"{where}expected exactly the keys arrays and tokens")
        t = e["tokens"]
        if not (isinstance(t, list) and len(t) == 2 and all(_is_int(x) for x in t) and t[0] == at and t[0] < t[1]
                <= vocab):
            raise bad(f"{where}tokens {str(t)[:80]} must be [lo, hi) with lo = {at} (where the shard before ends) "
                      f"and lo < hi <= {vocab}: shards cover the first-level tokens once, in order")
        at = t[1]
        out.append(ShardEntry(t[0], t[1], _arrays(bad, e["arrays"], kway, value, updated, ("shard",), where),
                              shard_dir(k)))
    if at != vocab:
        raise bad(f"shards cover the first-level tokens up to {at}, not all {vocab}")
    return tuple(out)


def _files(bad: Callable[[str], Exception], files: dict, fast: bool) -> dict[str, FileEntry]:
    """The file list; with `fast` (DIGEST_VERSION on) every entry carries FAST_DIGEST too."""
    keys = {"bytes", "sha256"} | ({FAST_DIGEST} if fast else set())
    out = {}
    for name, e in files.items():
        parts = name.split("/")
        if not parts or any(p in ("", ".", "..") or p.startswith(".") for p in parts) or "\\" in name:
            raise bad(f"file name {name[:80]!r} is not a plain path inside the snapshot directory")
        if (not isinstance(e, dict) or set(e) != keys or not _is_int(e["bytes"]) or e["bytes"] < 0
                or not _is_hex(e["sha256"], 64) or (fast and not _is_hex(e[FAST_DIGEST], 32))):
            raise bad(f"entry for file {name!r} must be {{{', '.join(sorted(keys))}}} (digests in hex)")
        out[name] = FileEntry.of(e)
    return out


def _is_hex(x: object, length: int) -> bool:
    return isinstance(x, str) and len(x) == length and all(c in "0123456789abcdef" for c in x)
