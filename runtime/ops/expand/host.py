"""The post stage on the host (`runtime.serving.post.expand` where the beams are on the CPU, or the index
has no `ServedIndex.post`): numba passes over the snapshot's memory maps, to the rows of
`runtime.result.Retrieved`. Expand + dedupe with a hash table per request, the exact filter of
`sidindex.exact`, a merge sort per request; the device path (`expand_beams`) gives the
same rows.

Legend: B requests, K beams, L SID length, N catalog rows, S SIDs, P (SID, ad) pairs, n (request,
ad) pairs.
"""

from __future__ import annotations

import numba
import numpy as np

from runtime.ops.expand.layout import RANKS, RRF_K
from schemas.artifacts import AD_LIVE, MATCHER_PLANES
from sidindex.exact import ALL_STAGES, eligible_pairs, stage_flags
from sidindex.matchers.plane import PARALLEL_PAIRS
from sidindex.parallel import sized
from sidindex.request_encoding import EncodedRequests
from sidindex.snapshot import Snapshot


def expand_host(snap: Snapshot, requests: EncodedRequests, beams, top_k: int | None, stages: bool,
                rank: str) -> dict:
    """The fields of `runtime.result.Retrieved`, by name: the eligible ads under the beams' SIDs,
    ranked per request by `rank` (RANKS), the first `top_k` (None: all), with `stages` each
    stage's passes counted on its own.

    snap: the served snapshot (its SID -> ad arrays, ad ids, values and exact index are the host
    memory maps). requests: the batch's host encoding. beams: tokens (B, K, L) int64, score (B, K)
    float32 (-inf: dead), leaf (B, K) int64 (-1: not a catalog SID), on any device (read on the host).
    """
    g = snap.gtm
    tokens, score, leaf = (t.cpu().numpy() for t in (beams.tokens, beams.score, beams.leaf))
    B = len(score)
    # 1-3. live beams -> their live ads, one row per (request, ad): the best score's beam
    state = snap.exact.ad_state if snap.exact.ad_state is not None else np.zeros(0, dtype=np.uint8)
    req, ad, beam, sc, sids, generated = _best_pairs(leaf, score, g.leaf_ad_offsets, g.leaf_ads, state)
    # 4. the exact filter (`sidindex.exact`: the one exact test)
    ok, per_stage = exact_pairs(snap.exact, requests, req, ad, B, stages)
    # 5. rank per request (RANKS), then ad_id, and keep the top_k
    value = np.zeros(0) if g.ad_value is None else g.ad_value
    rows, place, eligible, sid, ad_id = _rank_rows(req, ad, beam, sc, ok, snap.ad_id, value, tokens,
                                                   RANKS.index(rank), -1 if top_k is None else top_k)
    req, ad = req[rows], ad[rows]
    return {"request": req, "rank": place, "ad_row": ad, "ad_id": ad_id, "sid": sid, "score": sc[rows],
            "sids": sids, "ads_generated": generated, "ads_eligible": eligible, **per_stage,
            "value": None if g.ad_value is None else np.asarray(value[ad], np.float64)}


def exact_pairs(exact, requests: EncodedRequests, req: np.ndarray, ad: np.ndarray, batch: int,
                stages: bool) -> tuple[np.ndarray, dict]:
    """(n,) bool: does ad ad[i] (catalog row) pass request req[i] exactly (`sidindex.exact`),
    and with `stages` {"ads_per_stage": per matcher plane (B,) int64 the pairs passing its attributes,
    each plane on its own} (else {}), as `runtime.result.Retrieved` takes it. req, ad: (n,) int64;
    exact: an ExactIndex."""
    if not stages:
        return eligible_pairs(exact, requests, req, ad), {}
    flags = stage_flags(exact, requests, req, ad)
    return flags == ALL_STAGES, {"ads_per_stage": {p: np.bincount(req[(flags & (1 << i)) > 0], minlength=batch)
                                                   for i, p in enumerate(MATCHER_PLANES)}}


@sized(PARALLEL_PAIRS)
@numba.njit(parallel=True, cache=True)
def _best_pairs(leaf, score, leaf_ad_offsets, leaf_ads, ad_state):
    """One row per (request, live ad) under the request's live beams, grouped by request: the
    ad's best score and its beam (the first beam of that score). Requests in parallel, each with
    a hash table (open addressing, at most half full) that finds an ad's row.

    leaf: (B, K) int64 (-1: not a catalog SID); score: (B, K) float32 (-inf: dead);
    leaf_ad_offsets: (S+1,) int64; leaf_ads: (P,) catalog rows; ad_state: (N,) uint8, or (0,)
    when every row is live. Returns req, ad, beam (n,) int64, score (n,) float32, and per request
    (B,) int64 sids (its live beams on catalog SIDs) and generated (its rows).
    """
    B, K = leaf.shape
    sids = np.zeros(B, dtype=np.int64)
    reach = np.zeros(B + 1, dtype=np.int64)  # 1. the rows each request can reach: where its rows go
    for r in numba.prange(B):
        for k in range(K):
            if leaf[r, k] >= 0 and score[r, k] > -np.inf:
                sids[r] += 1
                reach[r + 1] += leaf_ad_offsets[leaf[r, k] + 1] - leaf_ad_offsets[leaf[r, k]]
    reach = np.cumsum(reach)
    ad = np.empty(reach[B], dtype=np.int64)
    beam = np.empty(reach[B], dtype=np.int64)
    best = np.empty(reach[B], dtype=np.float32)
    generated = np.zeros(B, dtype=np.int64)
    for r in numba.prange(B):  # 2. per request: its ads, each once, with the best score
        size = 1
        while size < 2 * (reach[r + 1] - reach[r]):
            size *= 2
        mask = np.uint64(size - 1)
        slot_row = np.full(size, -1, dtype=np.int64)
        n = reach[r]
        for k in range(K):
            lf, s = leaf[r, k], score[r, k]
            if lf < 0 or not s > -np.inf:
                continue
            for j in range(leaf_ad_offsets[lf], leaf_ad_offsets[lf + 1]):
                a = np.int64(leaf_ads[j])
                if len(ad_state) and ad_state[a] != AD_LIVE:
                    continue
                h = (np.uint64(a) * np.uint64(0x9E3779B97F4A7C15)) >> np.uint64(32) & mask  # Fibonacci hashing
                while slot_row[h] >= 0 and ad[slot_row[h]] != a:
                    h = (h + np.uint64(1)) & mask
                if slot_row[h] < 0:
                    slot_row[h] = n
                    ad[n], beam[n], best[n] = a, k, s
                    n += 1
                elif s > best[slot_row[h]]:
                    best[slot_row[h]], beam[slot_row[h]] = s, k
        generated[r] = n - reach[r]
    start = np.zeros(B + 1, dtype=np.int64)  # 3. the rows packed, request after request
    start[1:] = np.cumsum(generated)
    out_req = np.empty(start[B], dtype=np.int64)
    out_ad = np.empty(start[B], dtype=np.int64)
    out_beam = np.empty(start[B], dtype=np.int64)
    out_best = np.empty(start[B], dtype=np.float32)
    for r in numba.prange(B):
        for i in range(generated[r]):
            src, dst = reach[r] + i, start[r] + i
            out_req[dst], out_ad[dst], out_beam[dst], out_best[dst] = r, ad[src], beam[src], best[src]
    return out_req, out_ad, out_beam, out_best, sids, generated


@numba.njit(cache=True)
def _before(i, j, first, second, ad_id):
    """Row i ranks before row j: first descending, then second descending, then ad_id."""
    if first[i] != first[j]:
        return first[i] > first[j]
    if second[i] != second[j]:
        return second[i] > second[j]
    return ad_id[i] < ad_id[j]


@numba.njit(parallel=True, cache=True)
def _segment_order(starts, first, second, ad_id):
    """(n,) int64 the rows in ranked order: within each segment [starts[r], starts[r+1]) by first
    descending, second descending, then ad_id (a total order: ad_ids are distinct per request).
    Segments in parallel, each an insertion sort of runs of 16, then bottom-up merges; a merge
    whose halves are already in order only copies them (the beams come best first, so the rows
    of a score ranking mostly do). first, second: (n,) float64; ad_id: (n,) int64."""
    order = np.arange(len(ad_id))
    tmp = np.empty_like(order)
    for r in numba.prange(len(starts) - 1):
        lo, hi = starts[r], starts[r + 1]
        for run in range(lo, hi, 16):
            for i in range(run + 1, min(run + 16, hi)):
                x, j = order[i], i
                while j > run and _before(x, order[j - 1], first, second, ad_id):
                    order[j] = order[j - 1]
                    j -= 1
                order[j] = x
        width = 16
        while width < hi - lo:
            for left in range(lo, hi, 2 * width):
                mid, right = min(left + width, hi), min(left + 2 * width, hi)
                if mid == right or not _before(order[mid], order[mid - 1], first, second, ad_id):
                    tmp[left:right] = order[left:right]  # already in order (the rows mostly come ranked)
                    continue
                a, b, o = left, mid, left
                while a < mid and b < right:
                    if _before(order[b], order[a], first, second, ad_id):
                        tmp[o] = order[b]
                        b += 1
                    else:
                        tmp[o] = order[a]
                        a += 1
                    o += 1
                tmp[o:o + mid - a] = order[a:mid]
                o += mid - a
                tmp[o:o + right - b] = order[b:right]
            order[lo:hi] = tmp[lo:hi]
            width *= 2
    return order


@sized(PARALLEL_PAIRS)
@numba.njit(parallel=True, cache=True)
def _rank_rows(req, ad, beam, score, ok, ad_ids, values, tokens, rank, top_k):
    """The ok rows ranked within each request by RANKS[rank], then ad_id; the first top_k (-1: all).
    The gathers from the catalog's arrays (random reads of large maps) run in parallel.

    req: (n,) int64 grouped by request; ad, beam: (n,) int64 catalog rows and beams; score: (n,)
    float32; ok: (n,) bool; ad_ids: (N,) int64; values: (N,) float64 (or (0,) when ranked by
    score); tokens: (B, K, L) int64 the beams' SIDs. Returns rows (m,) int64 indices of the kept
    rows in output order, their places (m,) int64 (1-based), eligible (B,) int64 the ok rows per
    request, sid (m, L) int64 each kept row's SID and their ad_ids (m,) int64.
    """
    B = tokens.shape[0]
    eligible = np.zeros(B, dtype=np.int64)
    keep = np.empty(len(req), dtype=np.int64)
    m = 0
    for i in range(len(req)):
        if ok[i]:
            keep[m] = i
            eligible[req[i]] += 1
            m += 1
    keep = keep[:m]
    starts = np.zeros(B + 1, dtype=np.int64)
    starts[1:] = np.cumsum(eligible)
    ad_id = np.empty(m, dtype=np.int64)
    sc = np.empty(m, dtype=np.float64)
    val = np.zeros(m, dtype=np.float64)
    for j in numba.prange(m):
        ad_id[j], sc[j] = ad_ids[ad[keep[j]]], score[keep[j]]
        if rank != 0:
            val[j] = values[ad[keep[j]]]
    none = np.zeros(m, dtype=np.float64)
    if rank == 0:  # score
        order = _segment_order(starts, sc, none, ad_id)
    elif rank == 1:  # value, then score
        order = _segment_order(starts, val, sc, ad_id)
    else:  # fused: 1/(RRF_K + score rank) + 1/(RRF_K + value rank)
        fused = np.zeros(m, dtype=np.float64)
        for order in (_segment_order(starts, sc, none, ad_id), _segment_order(starts, val, sc, ad_id)):
            for r in range(B):
                for p in range(starts[r], starts[r + 1]):
                    fused[order[p]] += 1 / (RRF_K + (p - starts[r] + 1))
        order = _segment_order(starts, fused, none, ad_id)
    rows = np.empty(m, dtype=np.int64)
    place = np.empty(m, dtype=np.int64)
    kept_id = np.empty(m, dtype=np.int64)
    n = 0
    for r in range(B):
        for p in range(starts[r], starts[r + 1]):
            if top_k >= 0 and p - starts[r] >= top_k:
                break
            rows[n], place[n], kept_id[n] = keep[order[p]], p - starts[r] + 1, ad_id[order[p]]
            n += 1
    sid = np.empty((n, tokens.shape[2]), dtype=np.int64)
    for i in numba.prange(n):
        sid[i] = tokens[req[rows[i]], beam[rows[i]]]
    return rows[:n], place[:n], eligible, sid, kept_id[:n]
