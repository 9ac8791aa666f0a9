"""Table and spec contracts (the inputs; the artifacts sidindex writes are in `schemas.artifacts`).

A `Field` names a column (or a spec key), its logical type, whether it must be present and whether
it may be null. Names in angle brackets are templates: ``<bitmask attribute>`` stands for one column
per attribute of that kind declared in the targeting spec, ``<hash key>`` for each configured
hash-key column.

Logical types (what the validators accept, and what they convert to):
    int64            any integer column without nulls; converted to int64
    float64          any numeric column; converted to float64
    string           utf8 / large_utf8 / categorical
    list<string>     list or large_list of string
    vector<float32>  fixed-size or variable list of floats, all rows one length, finite values;
                     converted to a (N, D) float32 matrix
    int|string       integer or string; hashed through its decimal / UTF-8 text
    list<int16>[L]   fixed-size list of L integers
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Field:
    name: str
    type: str
    required: bool
    nullable: bool
    doc: str


@dataclass(frozen=True)
class Contract:
    name: str
    version: int
    doc: str
    fields: tuple[Field, ...]

    def field(self, name: str) -> Field:
        for f in self.fields:
            if f.name == name:
                return f
        raise KeyError(name)


# Embedding elements are refused beyond this absolute value. faiss k-means and the SID assignment compute
# squared distances in float32: with |x| <= 1e6 a squared distance stays below 4e12 * D, finite for any
# realistic D, while 1e19 squares to 1e38, at float32's limit (3.4e38): the sums overflow to inf and faiss
# aborts the whole process (SIGABRT, no message) or trains on garbage.
# Real embeddings are normalised or close to it; a value this large is a unit or export bug.

MAX_ABS_EMBEDDING = 1e6  # every embedding element (catalog and requests) within +-this
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1  # an int64 column's values

# Schema metadata key of a catalog export: the newest change file (its file name) whose changes
# the export holds, which a full build re-applies the journal after (docs/design.md §15)
CHANGES_THROUGH_KEY = "sidindex.changes_applied_through"

CATALOG = Contract(
    name="catalog",
    version=1,
    doc=f"One row per ad; Parquet or Arrow IPC. The schema's metadata may carry `{CHANGES_THROUGH_KEY}`: the "
        "name of the newest change file whose changes the export holds, so that a full build applies the "
        "change files published after it again (the build option of that name says the same).",
    fields=(
        Field("ad_id", "int64", True, False, "Unique ad identifier; an unsigned id must fit int64 (below 2**63)."),
        Field("embedding", "vector<float32>", True, False,
              "Ad embedding used for the semantic SID levels; one length for all rows, finite, every element "
              "within [-1e6, 1e6] (larger values overflow the float32 distances of k-means)."),
        Field("<hash key>", "int|string", True, False,
              "Columns named by the codebook's `hash_keys` (default `advertiser_id`); their values "
              "are hashed into the final SID level."),
        Field("<bitmask attribute>", "list<string>", True, True,
              "Declared values the ad targets; null or empty = unrestricted. A value not declared "
              "in the targeting spec is an error."),
        Field("<bloom attribute>", "list<string>", True, True,
              "Free strings the ad targets (e.g. locations); null or empty = unrestricted."),
        Field("value", "float64", False, False,
              "Expected eCPM of the ad: in [0, 1e30] (0 for unknown). With it the index keeps value bounds per "
              "prefix for value-aware search and ranking (docs/design.md §16)."),
    ),
)

REQUESTS = Contract(
    name="requests",
    version=1,
    doc="One row per retrieval request; Parquet or Arrow IPC.",
    fields=(
        Field("request_id", "int64", True, False, "Unique request identifier; must fit int64."),
        Field("<bitmask attribute>", "string", True, True,
              "The request's value; null or undeclared = unknown (matches unrestricted ads only)."),
        Field("<bloom attribute>", "list<string>", True, True,
              "The request's values (at most `max_request_values`, default 64); null or empty "
              "matches unrestricted ads only."),
        Field("embedding", "vector<float32>", False, True,
              "Request embedding, used by the codebook scorer; same length as the codebook's, finite, within "
              "[-1e6, 1e6]."),
    ),
)

TARGETING_ATTRIBUTE = Contract(
    name="targeting",
    version=1,
    doc=("Targeting spec (TOML): an ordered array of `[[attribute]]` tables. The attribute's name is "
         "its column name in the catalog and in requests. Top-level key `version` (optional) must "
         "equal this contract's version."),
    fields=(
        Field("name", "string", True, False, "Column name; unique within the spec."),
        Field("kind", "string", True, False, "`bitmask` (declared values) or `bloom` (free strings)."),
        Field("values", "list<string>", False, False,
              "bitmask only, required: the declared values, unique and non-empty."),
        Field("bits", "int64", False, False, "bloom only: Bloom row width, a positive multiple of 64 (default 256)."),
        Field("hashes", "int64", False, False, "bloom only: bit positions per value, 1..16 (default 2)."),
    ),
)

SID_TABLE = Contract(
    name="sid_table",
    version=1,
    doc="Output of `sidindex sid assign`: one row per (ad, path); Parquet.",
    fields=(
        Field("ad_id", "int64", True, False, "The ad."),
        Field("path", "int8", True, False,
              "0 for the nearest first-level centroid, 1 for the second nearest, ..."),
        Field("sid", "list<int16>[L]", True, False,
              "The Semantic ID as L plain tokens; token l lies in [0, level_sizes[l])."),
    ),
)

CHANGE_OPS = ("upsert", "delete", "pause", "resume")

CHANGES = Contract(
    name="changes",
    version=1,
    doc="Changes between full builds, for `sidindex update` (docs/design.md §15); Parquet or Arrow IPC. Rows apply in "
        "file order; an ad's last `upsert` or `delete` decides its data, and `pause`/`resume` after it its state.",
    fields=(
        Field("ad_id", "int64", True, False, "The ad changed."),
        Field("op", "string", True, False,
              "`upsert` (a new ad, or new data for an existing one: its SIDs re-assigned with the frozen codebook; "
              "a paused ad stays paused), `delete` (never served again), `pause` (ineligible until `resume`), "
              "`resume`. `delete`, `pause` and `resume` need an ad that exists at that point of the file."),
        Field("<catalog columns>", "as in the catalog", True, True,
              "Every catalog column (embedding, hash keys, targeting, value when the snapshot has values); "
              "validated as the catalog's in `upsert` rows, ignored (and may be null) in the others."),
    ),
)

CONTRACTS = (CATALOG, REQUESTS, TARGETING_ATTRIBUTE, SID_TABLE, CHANGES)


def render_markdown() -> str:
    """Render every contract as Markdown (the text of ``schemas/CONTRACTS.md``)."""
    from schemas.artifacts import render_artifacts

    out = ["# Data and artifact contracts", "",
           "Generated from `schemas/contracts.py` and `schemas/artifacts.py` by `python -m schemas`; do not edit "
           "by hand.", ""]
    for c in CONTRACTS:
        out += [f"## {c.name} (version {c.version})", "", c.doc, "",
                "| field | type | required | nullable | meaning |",
                "| --- | --- | --- | --- | --- |"]
        for f in c.fields:
            out.append(f"| `{f.name}` | `{f.type.replace('|', chr(92) + '|')}` | {'yes' if f.required else 'no'} | "
                       f"{'yes' if f.nullable else 'no'} | {f.doc} |")
        out.append("")
    return "\n".join(out + render_artifacts())
