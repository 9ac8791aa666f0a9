"""Semantic IDs: residual k-means codebooks, multi-path assignment, hashed final level, quality report."""

from sidindex.sid.assign import SIDAssignment, assign_sids, sid_table
from sidindex.sid.codebook import Codebook, load_codebook, resolve_codebook, save_codebook, train_codebook
from sidindex.sid.hashing import HASH_SEED, hash_tokens
from sidindex.sid.quality import QualityReport, sid_quality

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
