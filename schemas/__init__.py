"""Versioned contracts for everything sidindex reads and writes.

This package is the single source for the input tables (catalog, requests), the targeting spec, the
SID table and the snapshot artifact (`schemas.artifacts`): `sidindex.ingest` and
`sidindex.targeting` validate against these definitions, and `python -m schemas` renders them into
``schemas/CONTRACTS.md``.
"""

from schemas.contracts import (
    CATALOG,
    CHANGE_OPS,
    CHANGES,
    CONTRACTS,
    INT64_MAX,
    INT64_MIN,
    MAX_ABS_EMBEDDING,
    REQUESTS,
    SID_TABLE,
    TARGETING_ATTRIBUTE,
    Contract,
    Field,
    render_markdown,
)

__all__ = [
    "CATALOG",
    "CHANGE_OPS",
    "CHANGES",
    "CONTRACTS",
    "INT64_MAX",
    "INT64_MIN",
    "MAX_ABS_EMBEDDING",
    "REQUESTS",
    "SID_TABLE",
    "TARGETING_ATTRIBUTE",
    "Contract",
    "Field",
    "render_markdown",
]
