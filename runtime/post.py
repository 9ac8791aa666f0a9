"""Post stage: SIDs -> ads -> exact filter -> ranked ads per request (DESIGN.md §3, §8).

Runs on the host over the snapshot's memory maps: the SID -> ad CSR expands every live beam into
its ads (dropping rows an update paused or deleted), an ad reached through several SIDs keeps its
best score, and the exact ad-level filter drops every ineligible ad (Bloom false positives stop
here). Ranked per request by one of RANKS:
  score  the ad's best log-probability (the default)
  value  the ad's value (the catalog's `value`), then its score
  fused  reciprocal-rank fusion of the two rankings, 1/(RRF_K + score rank) + 1/(RRF_K + value rank)
         (as GR4AD-X fuses its rankings)
then ad_id. Vectorised passes over the expanded (request, ad) pairs.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from runtime.loader import ServedIndex
from runtime.search import Beams
from schemas.artifacts import MATCHER_PLANES
from sidindex.matchers.exact import ALL_STAGES, eligible_pairs, stage_flags
from sidindex.errors import ConfigError
from sidindex.requests import EncodedRequests
from sidindex.trie.build import expand_runs

RANKS = ("score", "value", "fused")
RRF_K = 60  # reciprocal-rank fusion's constant (Cormack et al.; GR4AD-X uses the same form)


@dataclass(frozen=True)
class Retrieved:
    """Rows of the result, ordered by (request, rank).

    request: (n,) int64 request row; rank: (n,) int64 1-based; ad_row: (n,) int64 catalog row;
    ad_id: (n,) int64; sid: (n, L) int64 the SID that reached the ad with the best score;
    score: (n,) float32; value: (n,) float64 the ad's value, or None when the snapshot has none.
    Per request (B,) int64: sids (live SIDs the search returned),
    ads_generated (ads under them, counted once per ad), ads_eligible (after the exact filter);
    with `stages`, ads_per_stage: per matcher plane (by name), the generated ads passing its
    attributes exactly (each stage on its own), else None.
    """

    request: np.ndarray
    rank: np.ndarray
    ad_row: np.ndarray
    ad_id: np.ndarray
    sid: np.ndarray
    score: np.ndarray
    sids: np.ndarray
    ads_generated: np.ndarray
    ads_eligible: np.ndarray
    ads_per_stage: dict[str, np.ndarray] | None = None
    value: np.ndarray | None = None


def check_rank(index: ServedIndex, rank: str) -> None:
    """rank is one of RANKS; value and fused need the snapshot's ad values (ConfigError)."""
    if rank not in RANKS:
        raise ConfigError(f"rank {rank!r}: expected one of {', '.join(RANKS)}")
    if rank != "score" and index.gtm.ad_value is None:
        raise ConfigError(f"rank {rank!r}: snapshot {index.id} carries no ad values; build it from a catalog with a "
                          "`value` column")


def expand(index: ServedIndex, requests: EncodedRequests, beams: Beams, top_k: int | None = None,
           stages: bool = False, rank: str = "score") -> Retrieved:
    """The eligible ads under the searched SIDs, ranked per request by `rank` (RANKS); `top_k`
    caps each request; `stages` also counts the ads passing each stage (a matcher plane's
    attributes) on its own.

    requests: the searched batch's encoding on the host (the exact filter reads it there).
    """
    check_rank(index, rank)
    snap, g = index.snapshot, index.gtm  # the SID -> ad arrays of `g` are the host memory maps
    tokens, score, leaf = (t.cpu().numpy() for t in (beams.tokens, beams.score, beams.leaf))
    B = len(score)
    # 1. live beams on catalog SIDs
    b, k = np.nonzero((leaf >= 0) & (score > -np.inf))
    lf = leaf[b, k]
    # 2. each beam -> its leaf's ads (a leaf lists each ad once)
    start, count = g.leaf_ad_offsets[lf], g.leaf_ad_offsets[lf + 1] - g.leaf_ad_offsets[lf]
    beam = np.repeat(np.arange(len(lf)), count)
    ad = np.asarray(g.leaf_ads[expand_runs(start, count)], dtype=np.int64)
    if snap.exact.ad_state is not None:  # rows an update paused or deleted are never served
        live = snap.exact.live(ad)
        beam, ad = beam[live], ad[live]
    req, sc = b[beam], score[b[beam], k[beam]]
    # 3. one row per (request, ad), the best-scoring SID's: sort by request, ad, then score descending
    order = np.lexsort((-sc, ad, req))
    req, ad, beam, sc = req[order], ad[order], beam[order], sc[order]
    first_of = np.ones(len(req), dtype=bool)
    first_of[1:] = (req[1:] != req[:-1]) | (ad[1:] != ad[:-1])
    req, ad, beam, sc = req[first_of], ad[first_of], beam[first_of], sc[first_of]
    generated = np.bincount(req, minlength=B)
    # 4. the exact filter
    per_stage = {}
    if stages:
        flags = stage_flags(snap.exact, requests, req, ad)
        ok = flags == ALL_STAGES
        per_stage = {"ads_per_stage": {p: np.bincount(req[(flags & (1 << i)) > 0], minlength=B)
                                       for i, p in enumerate(MATCHER_PLANES)}}
    else:
        ok = eligible_pairs(snap.exact, requests, req, ad)
    req, ad, beam, sc = req[ok], ad[ok], beam[ok], sc[ok]
    # 5. rank per request (RANKS), then ad_id
    ad_id = snap.ad_id[ad]
    val = None if g.ad_value is None else np.asarray(g.ad_value[ad], dtype=np.float64)
    by = {"score": (-sc,), "value": (-sc, -val) if val is not None else None}
    if rank == "fused":
        fused = 1 / (RRF_K + _ranks(req, ad_id, by["score"])) + 1 / (RRF_K + _ranks(req, ad_id, by["value"]))
        by["fused"] = (-fused,)
    order = np.lexsort((ad_id, *by[rank], req))
    req, ad, ad_id, beam, sc = req[order], ad[order], ad_id[order], beam[order], sc[order]
    val = None if val is None else val[order]
    starts = np.searchsorted(req, np.arange(B))
    place = np.arange(len(req)) - starts[req] + 1
    eligible = np.bincount(req, minlength=B)
    if top_k is not None:
        keep = place <= top_k
        req, ad, ad_id, beam, sc, place = req[keep], ad[keep], ad_id[keep], beam[keep], sc[keep], place[keep]
        val = None if val is None else val[keep]
    return Retrieved(req.astype(np.int64), place.astype(np.int64), ad, np.asarray(ad_id, dtype=np.int64),
                     tokens[b[beam], k[beam]], sc.astype(np.float32), np.bincount(b, minlength=B), generated, eligible,
                     **per_stage, value=val)


def _ranks(req: np.ndarray, ad_id: np.ndarray, keys: tuple[np.ndarray, ...]) -> np.ndarray:
    """(n,) int64 1-based rank of each (request, ad) row within its request by `keys` (ascending;
    the last key first, as np.lexsort), then ad_id."""
    order = np.lexsort((ad_id, *keys, req))
    out = np.empty(len(req), dtype=np.int64)
    out[order] = np.arange(len(req)) - np.searchsorted(req[order], req[order], side="left") + 1
    return out
