"""Artifact contracts: the files of a snapshot directory, their columns, dtypes and shapes, the
relations between them, and the manifest's keys. `sidindex.snapshot` writes, maps and validates
snapshots from these definitions; `python -m schemas` renders them into ``schemas/CONTRACTS.md``,
complete enough for a reader in another language.

Shapes use these letters: L SID length, num_nodes trie nodes (root included), E = num_nodes - 1
child entries, S SIDs (leaves), P SID rows (ad, path), N ads, T k-way partitions, R rows of a
deduplicated matcher table, W_p words of a row of matcher plane p (W_bitmask, W_bloom), A_p
attributes of plane p, H_p exact hashes of plane p. In a shard's files num_nodes, E, S, P, T and R count
that shard's trie.
"""

from __future__ import annotations

from collections.abc import Callable, Container
from dataclasses import dataclass

SNAPSHOT_FORMAT = "sidindex.snapshot"
# Versions 3 to 5 are named by the arrays they hold: 3 without ad values, 4 with them, 5 written by an
# update between rebuilds (docs/design.md §15: the ad states and the lineage). Version 6 adds a fast digest
# of every file (FAST_DIGEST, what a serving host checks when it opens a snapshot) and holds any of
# those groups of arrays (the array list says which). Version 7 lets a full build hold the ad states
# without a lineage (the paused ads it carried forward from the snapshot it replaces, docs/design.md §15);
# Version 8 splits the trie into shards by first-token range (docs/design.md §18): each shard's
# arrays in a directory of their own (`shard_dir`), the ad table and the exact index global (a snapshot
# before it is one shard whose files lie at the top). Version 9 records the ROOT's journal of change
# files (`journal`, docs/design.md §15), what a full build re-applies by. This code writes version 9
# and reads all seven.
VALUE_FREE_VERSION = 3
VALUE_VERSION = 4
UPDATED_VERSION = 5
DIGEST_VERSION = 6
STATES_VERSION = 7
SHARDED_VERSION = 8
JOURNAL_VERSION = 9
SNAPSHOT_VERSION = JOURNAL_VERSION  # the one this code writes
READ_VERSIONS = (VALUE_FREE_VERSION, VALUE_VERSION, UPDATED_VERSION, DIGEST_VERSION, STATES_VERSION, SHARDED_VERSION,
                 JOURNAL_VERSION)
SHARDS_DIR = "shards"
MAX_SHARDS = 32768  # one first-level token each at most (tokens are int16)


def shard_dir(k: int) -> str:
    """The directory, relative to the snapshot's, of shard k's files (version 8)."""
    return f"{SHARDS_DIR}/{k:05d}"

# The fast digest: XXH3-128 (seed 0) of the concatenated 16-byte canonical (big-endian) XXH3-128
# digests of the file's consecutive FAST_DIGEST_CHUNK-byte chunks (the last one shorter; an empty
# file has none), so one large file is verified by many threads at once.
FAST_DIGEST = "xxh3_128"
FAST_DIGEST_CHUNK = 1 << 24


def snapshot_version(arrays: Container[str]) -> int:
    """The format version a snapshot before DIGEST_VERSION holding the arrays named in `arrays` has."""
    if "ad_state" in arrays:
        return UPDATED_VERSION
    return VALUE_VERSION if "ad_value" in arrays else VALUE_FREE_VERSION
GONE_VERSIONS = {1: "raw .bin arrays, no longer read: rebuild the snapshot from its catalog",
                 2: "exact arrays not yet named by matcher plane, no longer read: "
                    "rebuild the snapshot from its catalog"}
MANIFEST_FILE = "manifest.json"
# An Ed25519 signature of manifest.json (`sidindex.signing`), beside it in a signed snapshot; like the
# manifest, not listed in it
SIGNATURE_FILE = "manifest.sig"
UNLISTED = (MANIFEST_FILE, SIGNATURE_FILE)

# Matcher kinds. Each plane has a deduplicated row table, a row index per child entry and, with
# k-way partitions, a row index per partition; a candidate passes when every plane passes. The
# exact ad-level filter keeps, per plane, either the ads' own rows (EXACT_ROWS: the plane's test
# is exact) or the sorted hashes of each ad's values per attribute (EXACT_VALUES). EXACT_FORM is
# the one list of the kinds, in plane order (`sidindex.matchers.kinds.KINDS` implements them).
EXACT_ROWS, EXACT_VALUES = "rows", "values"
EXACT_FORM = {"bitmask": EXACT_ROWS, "bloom": EXACT_VALUES}
MATCHER_PLANES = tuple(EXACT_FORM)
# An ad's value (the catalog's `value`, expected eCPM) lies in [0, MAX_AD_VALUE]: the index keeps
# its bounds as float32 (max 3.4e38), and an eCPM this large is a unit or export bug.
MAX_AD_VALUE = 1e30
# An ad row's state (`ad_state`, written by updates). A paused row is ineligible until resumed; a
# deleted row (an ad deleted, or the old data of an upserted one) is never served again and leaves
# at the next full build. The trie keeps both under their SIDs (a conservative superset).
AD_LIVE, AD_PAUSED, AD_DELETED = 0, 1, 2

ARROW_TYPES = {"|u1": "uint8", "<i2": "int16", "<i4": "int32", "<i8": "int64", "<u8": "uint64", "<f4": "float",
               "<f8": "double"}

# When each group of arrays is present: (with partitions, with values, updated) -> bool, and the words for it
GROUPS: dict[str, tuple[Callable[[bool, bool, bool], bool], str]] = {
          "index": (lambda kway, value, updated: True, "always"),
          "kway": (lambda kway, value, updated: kway, "with k-way partitions"),
          "value": (lambda kway, value, updated: value, "with ad values (docs/design.md §16)"),
          "kway+value": (lambda kway, value, updated: kway and value, "with k-way partitions and ad values"),
          "updated": (lambda kway, value, updated: updated, "with ad states: written by an update, or by a full "
                      "build that carried paused ads forward (docs/design.md §15)")}


@dataclass(frozen=True)
class ArrayFile:
    """One array, stored as `<name>.arrow` (in each shard's directory for scope "shard", at the top
    for "global"): an uncompressed Arrow IPC file holding one record
    batch with one non-null column `column`. 1-D arrays are a primitive column of `rows` values; a
    2-D array (rows, width) is a `fixed_size_list<dtype>[width]` column of `rows` rows."""

    name: str
    dtype: str  # numpy dtype string, little-endian
    rows: str  # length, in the legend's letters
    width: str | None  # row width of a 2-D array, or None
    doc: str
    group: str = "index"  # GROUPS: when the array is present
    column: str = ""
    scope: str = "shard"  # "shard": one per shard, in its directory (version 8); "global": one per snapshot

    @property
    def file(self) -> str:
        return f"{self.name}.arrow"

    @property
    def column_name(self) -> str:
        return self.column or self.name

    @property
    def arrow_type(self) -> str:
        t = ARROW_TYPES[self.dtype]
        return t if self.width is None else f"fixed_size_list<{t}>[{self.width}]"


@dataclass(frozen=True)
class PlaneArrays:
    """The names of one matcher plane's arrays (`plane_arrays`): the one place they are spelt, for
    everything that writes, reads, validates or stages them."""

    plane: str

    @property
    def table(self) -> str:
        return f"{self.plane}_table"

    @property
    def index(self) -> str:
        return f"{self.plane}_index"

    @property
    def part_index(self) -> str:
        return f"part_{self.plane}_index"

    @property
    def exact_rows(self) -> str:
        """The plane's exact form when EXACT_FORM says EXACT_ROWS."""
        return f"exact_{self.plane}_rows"

    @property
    def exact_hash_offsets(self) -> str:
        """With `exact_hashes`, the plane's exact form when EXACT_FORM says EXACT_VALUES."""
        return f"exact_{self.plane}_hash_offsets"

    @property
    def exact_hashes(self) -> str:
        return f"exact_{self.plane}_hashes"


def plane_arrays(plane: str) -> PlaneArrays:
    """The array names of matcher plane `plane` (one of MATCHER_PLANES)."""
    if plane not in MATCHER_PLANES:
        raise ValueError(f"{plane!r} is not a matcher plane (planes: {', '.join(MATCHER_PLANES)})")
    return PlaneArrays(plane)


def _planes() -> tuple[ArrayFile, ...]:
    out = []
    for p in MATCHER_PLANES:
        a = plane_arrays(p)
        out += [ArrayFile(a.index, "<i4", "E", None, f"Row of `{a.table}` holding child entry e's subtree union."),
                ArrayFile(a.table, "<u8", f"R_{p}", f"W_{p}",
                          f"Deduplicated {p} matcher rows (docs/design.md §4): every row distinct in a full build; "
                          "an update appends its rows, distinct among themselves.")]
    for p in MATCHER_PLANES:
        a = plane_arrays(p)
        out.append(ArrayFile(a.part_index, "<i4", "T", None, f"Row of `{a.table}` of each k-way partition.",
                             group="kway"))
    return tuple(out)


def _exact() -> tuple[ArrayFile, ...]:
    out = []
    for p in MATCHER_PLANES:
        a = plane_arrays(p)
        if EXACT_FORM[p] == EXACT_ROWS:
            out.append(ArrayFile(a.exact_rows, "<u8", "N", f"W_{p}", f"Each ad's own {p} row (exact).",
                                 scope="global"))
        else:
            out += [ArrayFile(a.exact_hash_offsets, "<i8", f"A_{p} * (N + 1)", None,
                              f"Attribute-major: the hashes of ad i for {p} attribute a are {a.exact_hashes}"
                              f"[o[a*(N+1)+i] : o[a*(N+1)+i+1]]; one run rising from 0 to H_{p}.",
                              scope="global"),
                    ArrayFile(a.exact_hashes, "<u8", f"H_{p}", None,
                              "mmh3 x64_128 (seed 0x5EED0E1, first 64 bits) of an ad's values, ascending within "
                              "each ad.", scope="global")]
    return tuple(out)


SNAPSHOT_ARRAYS = (
    ArrayFile("node_offsets", "<i8", "num_nodes + 1", None,
              "Child entries of node i are [node_offsets[i], node_offsets[i+1]); node 0 is the root."),
    ArrayFile("csr_child_nodes", "<i4", "E", None,
              "Child node of entry e; nodes are numbered depth by depth, so this is e + 1."),
    ArrayFile("csr_tokens", "<i2", "E", None, "Token leading to entry e's child; sorted within each node."),
    ArrayFile("depth_offsets", "<i8", "L + 2", None, "Nodes of depth d are [depth_offsets[d], depth_offsets[d+1])."),
    ArrayFile("leaf_ad_offsets", "<i8", "S + 1", None,
              "Ads of leaf s (node depth_offsets[L] + s) are leaf_ads[leaf_ad_offsets[s]:leaf_ad_offsets[s+1]]."),
    ArrayFile("leaf_ads", "<i8", "P", None, "Catalog rows (rows of `ads.arrow`), ascending within each leaf."),
    *_planes(),
    ArrayFile("part_offsets", "<i8", "E + 1", None,
              "Partitions of entry e are [part_offsets[e], part_offsets[e+1]).", group="kway"),
    *_exact(),
    ArrayFile("ads", "<i8", "N", None, "ad_id of each catalog row; unique among rows not deleted.", column="ad_id",
              scope="global"),
    ArrayFile("ad_state", "|u1", "N", None,
              f"State of each catalog row: {AD_LIVE} live, {AD_PAUSED} paused (ineligible until resumed), "
              f"{AD_DELETED} deleted (never served; its SIDs and matcher bits stay until the next full build).",
              group="updated", scope="global"),
    ArrayFile("entry_live", "|u1", "E", None,
              "1 when a live row (`ad_state`) lies beneath child entry e, else 0: the search takes no entry without "
              "one, so it never generates a SID whose ads are all paused or deleted.", group="updated"),
    ArrayFile("ad_value", "<f8", "N", None, "The catalog's `value` of each ad: finite, >= 0.", group="value",
              scope="global"),
    ArrayFile("entry_value", "<f4", "E", None,
              "The largest `ad_value` of the ads under entry e, rounded up to float32: a bound of every ad beneath.",
              group="value"),
    ArrayFile("part_value", "<f4", "T", None,
              "The largest `ad_value` of the ads in each k-way partition, rounded up to float32; an entry's "
              "partitions are ordered by it, largest first (the first passing one bounds what passes).",
              group="kway+value"),
)


def present(group: str, kway: bool, value: bool, updated: bool = False) -> bool:
    """Whether arrays of `group` are in a snapshot built with (kway) partitions and (value) values,
    and (updated) written by an update."""
    return GROUPS[group][0](kway, value, updated)

ARRAYS_BY_NAME = {a.name: a for a in SNAPSHOT_ARRAYS}

SNAPSHOT_RELATIONS = (
    "depth_offsets: [0] = 0, [1] = 1, strictly rising, [L+1] = num_nodes.",
    "node_offsets: [0] = 0, rising, [num_nodes] = E; node_offsets[depth_offsets[d]] = depth_offsets[d+1] - 1 "
    "(the children of depth d are exactly the nodes of depth d+1; leaves have none).",
    "csr_child_nodes[e] = e + 1.",
    "csr_tokens: entry e of depth d (its child lies at depth d+1) holds a token in [0, level_sizes[d]); strictly "
    "rising within each node.",
    "<plane>_index and part_<plane>_index: in [0, rows of <plane>_table); row width W_bitmask = max(1, "
    "ceil(bitmask bits / 64)), W_bloom = max(1, sum of Bloom bits / 64) from the targeting spec.",
    "leaf_ad_offsets: S + 1 = num_nodes - depth_offsets[L] + 1 entries, [0] = 0, strictly rising (every SID has "
    "an ad), last = P; leaf_ads in [0, N), strictly rising within a leaf.",
    "part_offsets: [0] = 0, strictly rising (every entry has a partition), last = T.",
    "exact_<plane>_rows: N rows of W_<plane> words.",
    "exact_<plane>_hash_offsets: rising from 0 to H_<plane> over all A_<plane> * (N + 1) values, attribute a's "
    "last equal to attribute a+1's first; exact_<plane>_hashes rising within each (attribute, ad) run.",
    "ads: N values; ad_id unique among the rows whose ad_state is not deleted (every row without ad_state).",
    f"ad_state: N values in {{{AD_LIVE}, {AD_PAUSED}, {AD_DELETED}}}; entry_live[e] = 1 exactly when a row of state "
    f"{AD_LIVE} lies beneath entry e (in leaf_ads of a leaf of e's subtree), else 0.",
    "ad_value, entry_value, part_value: in [0, 1e30] (entry and part values rounded up to float32). entry_value "
    "of an inner entry >= that of each child entry; part_value falling (not rising) within each entry's "
    "partitions, the first equal to the entry's entry_value.",
    "level_sizes (manifest): L values in [1, 32768], equal to the carried codebook's.",
    "manifest counts: ads = N, sid_rows = P, sids = S, nodes = num_nodes (of the whole trie: below).",
    "shards (version 8): token ranges [lo, hi) rising from 0 to level_sizes[0], each beginning where the previous "
    "ends. Each shard's arrays hold the trie of the SIDs whose first token lies in its range and satisfy every "
    "relation above on their own (its node 0 a root whose child tokens lie in [lo, hi); leaf_ads catalog rows; "
    "entry_live and the value bounds against the global ad_state and ad_value). The whole trie is the shards' "
    "joined: the root's entries are every shard's root entries, shard after shard, and depth d > 0 is every "
    "shard's depth d, shard after shard; per-entry arrays follow that order, and a row index of shard k's "
    "tables counts the rows of the shards before it. Tables are deduplicated within a shard only.",
    "Cover (no false negative, no bound below a value): per plane, the row of an inner entry holds every bit of "
    "each child entry's row; the bitmask row of a SID's entry holds every bit of each of its ads' "
    "exact_bitmask_rows; the bloom row of a SID's entry has, per attribute, all ones where one of its ads has no "
    "values there and some bit set where it has some (the ads' bloom rows are not kept; k-way partitions are not "
    "covered); entry_value of a SID's entry >= ad_value of each of its ads. An open does not check the cover "
    "(nothing indexes memory by it); `sidindex validate` and an update do (an update's result: the relations it "
    "does not keep from its checked base).",
)


@dataclass(frozen=True)
class ManifestKey:
    key: str
    type: str
    doc: str
    since: int = 0  # the first format version that has the key
    group: str = "index"  # GROUPS: when the key is present (with the arrays of that group)


def manifest_keys(version: int, updated: bool) -> tuple[ManifestKey, ...]:
    """The keys a manifest of format `version` holds, (updated) written by an update (with a lineage)."""
    return tuple(k for k in MANIFEST_KEYS if version >= k.since and present(k.group, False, False, updated))


MANIFEST_KEYS = (
    ManifestKey("format", "string", f"`{SNAPSHOT_FORMAT}`."),
    ManifestKey("format_version", "int", f"{JOURNAL_VERSION} (written now): the journal of change files "
                                         f"(`journal`), the trie in shards (`shards`), `arrays` "
                                         f"the global arrays, every file with `{FAST_DIGEST}`, `ad_state` with or "
                                         "without `lineage`. Written by earlier sidindex versions and still read: "
                                         f"{SHARDED_VERSION} (the same without `journal`), and "
                                         f"every array at the top as one shard: {STATES_VERSION} (a full build "
                                         "holding `ad_state` without `lineage`, the paused ads it carried forward), "
                                         f"{DIGEST_VERSION} (every file with `{FAST_DIGEST}`; `ad_state` comes with "
                                         f"`lineage`), {UPDATED_VERSION} when an update wrote the snapshot (`ad_state` "
                                         f"and `lineage` present), else {VALUE_VERSION} when it carries the `value` "
                                         f"arrays, else {VALUE_FREE_VERSION}; these three with `sha256` only. A reader "
                                         "refuses other versions (a newer one saying to upgrade)."),
    ManifestKey("id", "string", "Snapshot id, equal to the directory name: `YYYYMMDDTHHMMSSffffffZ-<8 hex>`."),
    ManifestKey("created", "string", "UTC time of the build, ISO 8601."),
    ManifestKey("input_fingerprint", "string", "sha256 over the catalog bytes, spec, config, codebook id, format."),
    ManifestKey("catalog", "string", "Path of the catalog the build read."),
    ManifestKey("codebook_id", "string | null", "The frozen codebook, carried in `codebooks/<id>/` (null: none)."),
    ManifestKey("build_config", "object", "The build configuration ([sid], [quality], [kway])."),
    ManifestKey("targeting", "object", "The targeting spec: `version` and the `attribute` list."),
    ManifestKey("level_sizes", "list<int>", "Vocabulary size of each SID level (L values)."),
    ManifestKey("kway", "bool", "Whether the `kway` arrays are present."),
    ManifestKey("counts", "object", "ads, sid_rows, sids, nodes."),
    ManifestKey("stats", "object", "Build statistics (GRACE Tables 1 and 2)."),
    ManifestKey("quality", "object | null", "The SID quality report of the build."),
    ManifestKey("arrays", "object", "Per array name: `rows` and `width` (null for 1-D); from version "
                                    f"{SHARDED_VERSION} the global arrays only, a shard's are in `shards`."),
    ManifestKey("shards", "list<object>", "Per shard, in token order: `tokens` ([lo, hi), the first-level "
                                          "tokens whose SIDs it holds) and `arrays` (its arrays, as `arrays`); "
                                          "its files lie in `shards/<k>/` (k the position, five digits).",
                since=SHARDED_VERSION),
    ManifestKey("lineage", "object", "Present exactly when an update wrote the snapshot (which then holds `ad_state`): "
                                     "`full_build` (the id of the full build "
                                     "the updates started from), `base` (the snapshot this update was applied to), "
                                     "`updates` (updates since the full build), `source` (sha256 of the change "
                                     "file), `changes` (rows per op of this update), `paused` and `deleted` (rows "
                                     "in each state, as `ad_state` holds them), `stale_entries` (child entries "
                                     "whose matchers still hold a paused or deleted row: conservative supersets "
                                     "until the next full build), `dead_sids` (SIDs with no live row).",
                since=UPDATED_VERSION, group="updated"),
    ManifestKey("journal", "object", "The change files the snapshot's ROOT journals (docs/design.md §15), what a "
                                     "full build re-applies from: `through` (the newest change file the export of "
                                     "the last full build told one held, or null) and `entries`, in the order "
                                     "they were published, each `update` (the id of the snapshot whose update "
                                     "applied it), `name` (the file's name) and `sha256` (its bytes'). Journal "
                                     "files no snapshot records are not applied.",
                since=JOURNAL_VERSION),
    ManifestKey("files", "object", "Every file below the directory but manifest.json and manifest.sig (the "
                                   "carried codebook "
                                   f"included): relative path -> `bytes`, `sha256`, `{FAST_DIGEST}` (version "
                                   f"{DIGEST_VERSION}; the chunked digest below)."),
    ManifestKey("checksum", "string", "sha256 of the canonical manifest without this key (below)."),
)

MANIFEST_DOC = (
    "`manifest.json` is canonical JSON: keys sorted, one-space indent, ASCII only, a final newline, exactly "
    "the text `json.dumps(m, indent=1, sort_keys=True, ensure_ascii=True) + \"\\n\"`; `checksum` is the sha256 "
    "of that text for the manifest without `checksum`. A reader refuses a manifest that is not byte-for-byte "
    "canonical, has unknown, missing or duplicate keys, an id other than its directory's name, or lists "
    "other files than the directory holds. "
    f"`{FAST_DIGEST}` of a file is the XXH3-128 (seed 0, hex) of the concatenated 16-byte canonical (big-endian) "
    f"XXH3-128 digests of its consecutive chunks of {FAST_DIGEST_CHUNK} bytes ({FAST_DIGEST_CHUNK >> 20} MiB) "
    "(the last one shorter; an empty file has none): chunks are verified in parallel. Opening a snapshot "
    "checks it (and `sha256` for a file without it); `sidindex validate` checks both."
)


def render_artifacts() -> list[str]:
    """The snapshot contract as Markdown lines."""
    out = [f"## snapshot directory (format `{SNAPSHOT_FORMAT}`, version {JOURNAL_VERSION}; versions "
           f"{VALUE_FREE_VERSION} to {SHARDED_VERSION} are still read)", "",
           "A snapshot is a directory `ROOT/snapshots/<id>/` holding `manifest.json` (and, when signed, "
           f"`{SIGNATURE_FILE}`: `sidindex.signing`), the global arrays below "
           f"(one Arrow IPC file each), a directory `{SHARDS_DIR}/<k>/` per shard (k = 00000, 00001, ...) holding "
           "the shard's arrays, and the frozen codebook in `codebooks/<codebook_id>/` (`codebook.json` and "
           "`level_<l>.npy`). A snapshot before version 8 holds every array at the top, as one shard. Every "
           "`.arrow` file opens with `pyarrow.ipc.open_file(pyarrow.memory_map(path))`, "
           "`polars.read_ipc` and, through Arrow, duckdb.", "",
           __doc__.split("\n\n")[1].replace("\n", " "), "",
           "| file | column | Arrow type | rows | present | meaning |", "| --- | --- | --- | --- | --- | --- |"]
    for a in SNAPSHOT_ARRAYS:
        present = GROUPS[a.group][1]
        where = a.file if a.scope == "global" else f"{SHARDS_DIR}/<k>/{a.file}"
        out.append(f"| `{where}` | `{a.column_name}` | `{a.arrow_type}` | {a.rows} | {present} | {a.doc} |")
    out += ["", "Relations a reader may rely on (`sidindex validate` checks every one before any index is used):", ""]
    out += [f"- {r}" for r in SNAPSHOT_RELATIONS]
    out += ["", "### manifest.json", "", MANIFEST_DOC, "", "| key | type | meaning |", "| --- | --- | --- |"]
    out += [f"| `{k.key}` | `{k.type.replace('|', chr(92) + '|')}` | {k.doc} |" for k in MANIFEST_KEYS]
    return out + [""]
