"""Semantic IDs: residual k-means codebooks, multi-path assignment, hashed final level, quality report.

The names below are loaded from their modules when first read (PEP 562), so a reader of a codebook
(`sidindex.sid.codebook`, what a serving host needs) imports neither numba (assignment) nor faiss
(training) nor polars and mmh3 (the hashed level)."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from sidindex.sid.assign import SIDAssignment, assign_sids, sid_table
    from sidindex.sid.codebook import Codebook, load_codebook, resolve_codebook, save_codebook, train_codebook
    from sidindex.sid.hashing import HASH_SEED, hash_tokens
    from sidindex.sid.quality import QualityReport, sid_quality

_MODULE_OF = {
    "SIDAssignment": "assign", "assign_sids": "assign", "sid_table": "assign",
    "Codebook": "codebook", "load_codebook": "codebook", "resolve_codebook": "codebook",
    "save_codebook": "codebook", "train_codebook": "codebook",
    "HASH_SEED": "hashing", "hash_tokens": "hashing",
    "QualityReport": "quality", "sid_quality": "quality",
}

__all__ = [
    "HASH_SEED",
    "Codebook",
    "QualityReport",
    "SIDAssignment",
    "assign_sids",
    "hash_tokens",
    "load_codebook",
    "resolve_codebook",
    "save_codebook",
    "sid_quality",
    "sid_table",
    "train_codebook",
]


def __getattr__(name: str) -> Any:
    module = _MODULE_OF.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{module}"), name)
    globals()[name] = value  # read once: later reads find it here
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
