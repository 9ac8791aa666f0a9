"""Post stage: SIDs -> ads -> exact filter -> ranked ads per request (DESIGN.md §3, §8).

The SID -> ad CSR expands every live beam into its ads (dropping rows an update paused or
deleted), an ad reached through several SIDs keeps its best score and that SID (on equal scores
the first beam's: the search ranks its beams in one order on every device, `runtime.search`), and
the exact ad-level filter drops every ineligible ad (Bloom false positives stop here). Ranked per
request by one of RANKS:
  score  the ad's best log-probability (the default)
  value  the ad's value (the catalog's `value`), then its score
  fused  reciprocal-rank fusion of the two rankings, 1/(RRF_K + score rank) + 1/(RRF_K + value rank)
         (as GR4AD-X fuses its rankings)
then ad_id: a total order, so equal scores (hash-level SIDs tie) rank alike on both paths below.

Two implementations of the one contract (`Retrieved`), and `expand` picks:
  host    numba passes over the snapshot's memory maps (beams on the CPU, or an index without
          `ServedIndex.post`): expand + dedupe with a hash table per request, the exact filter of
          `sidindex.matchers.exact`, a merge sort per request.
  device  `DevicePost`: `runtime.ops.expand` (Triton kernels around the exact filter's, or its torch
          reference) on the tensors of `ServedIndex.post`, every shape fixed by the batch,
          the beams and bounds of the index known on the host, no host synchronisation, so a CUDA
          graph can capture it right after the search; the result's counts, then its rows in use, come
          back through pinned memory.

Legend: B requests, K beams, L SID length, N catalog rows, C the most (request, ad) pairs K beams
can reach, T the result rows kept per request (min(top_k, C)), A a plane's attributes, M the most
values a request has for one attribute.
"""

from __future__ import annotations

from dataclasses import dataclass

import numba
import numpy as np
import torch

from runtime.ops.expand import RANKS, RRF_K, PostLayout, expand_beams
from runtime.requests import to_device
from runtime.search import Beams
from runtime.served import POST_ARRAYS, ServedIndex, post_bounds
from schemas.artifacts import AD_LIVE, MATCHER_PLANES
from sidindex.errors import ConfigError
from sidindex.requests import MAX_REQUEST_VALUES
from sidindex.matchers.exact import ALL_STAGES, eligible_pairs, stage_flags
from sidindex.matchers.plane import PARALLEL_PAIRS
from sidindex.parallel import sized
from sidindex.requests import EncodedRequests

DEVICE_ROWS = 1 << 31  # the device path packs a catalog row into 31 bits of its sort keys: larger catalogs run on the host


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
    The device path's rows are strided views of one (n, F) block, as numpy's column views are.
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


def on_device(index: ServedIndex) -> bool:
    """The index's post stage runs on its GPU (`DevicePost`): its post arrays are there, and its
    catalog has fewer than DEVICE_ROWS rows."""
    return index.post is not None and len(index.post["ads"]) < DEVICE_ROWS


def check_top_k(top_k: int | None) -> None:
    """top_k is None (every eligible ad) or a positive number of ads per request (ConfigError)."""
    if top_k is not None and top_k < 1:
        raise ConfigError(f"top_k {top_k}: expected a positive number of ads per request")


def expand(index: ServedIndex, requests: EncodedRequests, beams: Beams, top_k: int | None = None,
           stages: bool = False, rank: str = "score") -> Retrieved:
    """The eligible ads under the searched SIDs, ranked per request by `rank` (RANKS); `top_k`
    caps each request; `stages` also counts the ads passing each stage (a matcher plane's
    attributes) on its own.

    Beams on a GPU with the index's post arrays there (`ServedIndex.post`) run `DevicePost`
    (requests: best their device form, `runtime.requests.to_device`; a host encoding is moved
    first); otherwise the host path runs (requests: the encoding on the host). Same result either way.
    """
    check_rank(index, rank)
    check_top_k(top_k)  # both paths refuse what one would: the host's loop would keep nothing
    if beams.score.is_cuda and on_device(index):
        if requests.stacked is None:
            requests = to_device(requests, beams.score.device)
        post = DevicePost(index, *beams.score.shape, top_k=top_k, rank=rank, stages=stages)
        return post.result(post.run(requests, beams))
    return _expand_host(index, requests, beams, top_k, stages, rank)


# --- the host path --------------------------------------------------------------------------------

def _expand_host(index: ServedIndex, requests: EncodedRequests, beams: Beams, top_k: int | None, stages: bool,
                 rank: str) -> Retrieved:
    """`expand` on the host: numba passes over the snapshot's memory maps."""
    snap, g = index.snapshot, index.gtm  # the SID -> ad arrays of `g` are the host memory maps
    tokens, score, leaf = (t.cpu().numpy() for t in (beams.tokens, beams.score, beams.leaf))
    B = len(score)
    # 1-3. live beams -> their live ads, one row per (request, ad): the best score's beam
    state = snap.exact.ad_state if snap.exact.ad_state is not None else np.zeros(0, dtype=np.uint8)
    req, ad, beam, sc, sids, generated = _best_pairs(leaf, score, g.leaf_ad_offsets, g.leaf_ads, state)
    # 4. the exact filter (`sidindex.matchers.exact`: the one exact test)
    ok, per_stage = exact_pairs(snap.exact, requests, req, ad, B, stages)
    # 5. rank per request (RANKS), then ad_id, and keep the top_k
    value = np.zeros(0) if g.ad_value is None else g.ad_value
    rows, place, eligible, sid, ad_id = _rank_rows(req, ad, beam, sc, ok, snap.ad_id, value, tokens,
                                                   RANKS.index(rank), -1 if top_k is None else top_k)
    req, ad = req[rows], ad[rows]
    return Retrieved(req, place, ad, ad_id, sid, sc[rows], sids, generated,
                     eligible, **per_stage, value=None if g.ad_value is None else np.asarray(value[ad], np.float64))


def exact_pairs(exact, requests: EncodedRequests, req: np.ndarray, ad: np.ndarray, batch: int,
                stages: bool) -> tuple[np.ndarray, dict]:
    """(n,) bool: does ad ad[i] (catalog row) pass request req[i] exactly (`sidindex.matchers.exact`),
    and with `stages` {"ads_per_stage": per matcher plane (B,) int64 the pairs passing its attributes,
    each plane on its own} (else {}), as `Retrieved` takes it. req, ad: (n,) int64; exact: an ExactIndex."""
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


# --- the device path ------------------------------------------------------------------------------

def post_tensors(index: ServedIndex, device: str | torch.device = "cpu") -> dict[str, torch.Tensor]:
    """The post stage's arrays of the index's snapshot as tensors on `device`, by contract name, as
    `ServedIndex.post` holds them on a GPU (uint64 bits as int64): for `DevicePost` on CPU
    tensors (tests) or any device."""
    snap = index.snapshot
    out = {}
    for n, a in snap.arrays().items():
        if n in POST_ARRAYS or n in snap.exact.arrays():
            a = a.view(np.int64) if a.dtype == np.uint64 else a
            out[n] = torch.from_numpy(np.array(a)).to(device)
    return out


class DevicePost:
    """The post stage on the device (`runtime.ops.expand`: Triton kernels around the exact filter's),
    for a batch of `batch` requests x `beams` beams.

    Every shape is fixed here, from host-known bounds: C = the most (request, ad) pairs `beams`
    distinct leaves hold (`runtime.served.PostBounds`), T = min(top_k, C) result rows per request; the
    torch reference also takes M = `max_values` request values per attribute (the bound
    `sidindex.requests.requests_from` enforces; the kernels loop to each request's own). `run` makes
    no host synchronisation, so it can be captured in a CUDA graph after the search; `result`
    copies the buffer's counts, then only the result rows in use, to the host (with `pinned`,
    through pinned memory the stage keeps: for a stage read batch after batch, as
    `runtime.Searcher`'s; a one-off stage would pay more to pin it than it saves).

        post = DevicePost(index, 16, 1024, top_k=100)
        buffer = post.run(requests_on_device, beams)   # capturable
        retrieved = post.result(buffer)

    arrays: the post arrays (`ServedIndex.post`, the default; `post_tensors` builds them anywhere).
    impl: `runtime.ops.expand`'s ("auto": its Triton kernels on a GPU, the torch reference elsewhere).
    The buffer's layout: `layout` (`runtime.ops.expand.PostLayout`).
    """

    def __init__(self, index: ServedIndex, batch: int, beams: int, *, top_k: int | None = None, rank: str = "score",
                 stages: bool = False, max_values: int = MAX_REQUEST_VALUES,
                 arrays: dict[str, torch.Tensor] | None = None, pinned: bool = False, impl: str = "auto") -> None:
        check_rank(index, rank)
        self.arrays = index.post if arrays is None else arrays
        if self.arrays is None:
            raise ConfigError(f"snapshot {index.id} is served on {index.device}, whose post stage runs on the host; "
                              "the device post stage needs an index loaded onto a GPU (or pass its arrays)")
        if len(self.arrays["ads"]) >= DEVICE_ROWS:
            raise ConfigError(f"snapshot {index.id} has {len(self.arrays['ads']):,} catalog rows; the device post stage "
                              f"serves fewer than {DEVICE_ROWS:,}: run the post stage on the host (`expand` does)")
        check_top_k(top_k)
        if rank != "score" and "ad_value" not in self.arrays:
            raise ConfigError(f"rank {rank!r}: the post arrays given for snapshot {index.id} carry no ad values")
        self.index, self.rank, self.max_values, self.impl = index, rank, max_values, impl
        self.bounds = index.post_bounds if arrays is None else post_bounds(arrays, index.snapshot)
        pairs = self.bounds.most_pairs(beams)  # C
        self.layout = PostLayout(batch, beams, pairs, pairs if top_k is None else min(top_k, pairs),
                                 index.sid_length, rank, stages, "ad_value" in self.arrays)
        self.pinned = pinned
        self._host: torch.Tensor | None = None  # with `pinned`: `result`'s copies land here

    def check(self, requests: EncodedRequests) -> None:
        """Refuse a batch with more values per attribute than the stage was sized for (ConfigError),
        from the bound the host knows (`PlaneQueries.most`): no sync."""
        for q in requests.planes:
            if not q.single and q.max_queries > self.max_values:
                raise ConfigError(f"{requests.source}: a request has {q.max_queries} values for one attribute; the "
                                  f"device post stage was sized for {self.max_values} (read the requests with "
                                  "that bound, or pass max_values)")

    def run(self, requests: EncodedRequests, beams: Beams) -> torch.Tensor:
        """The post stage of one batch into one int64 buffer (`result` reads it); no host sync.

        requests: the batch on the device (`runtime.requests.to_device`, exact queries included);
        beams: tokens (B, K, L) int64, score (B, K) float32, leaf (B, K) int64 on the device.
        """
        self.check(requests)
        return expand_beams(self.layout, self.arrays, self.bounds.ad_order, self.bounds.steps, requests, beams,
                            self.max_values, self.impl)

    def _fetch(self, buffer: torch.Tensor, lo: int, hi: int) -> np.ndarray:
        """buffer[lo:hi] on the host: with `pinned`, from a GPU through the stage's pinned memory
        (overwritten by the next call)."""
        if not (buffer.is_cuda and self.pinned):
            return buffer[lo:hi].cpu().numpy()
        if self._host is None or len(self._host) < len(buffer):
            self._host = torch.empty(len(buffer), dtype=torch.int64, pin_memory=True)
        self._host[lo:hi].copy_(buffer[lo:hi], non_blocking=True)
        torch.cuda.current_stream(buffer.device).synchronize()
        return self._host[lo:hi].numpy()

    def result(self, buffer: torch.Tensor) -> Retrieved:
        """The `Retrieved` of a `run`'s buffer: its counts, then the rows in use, to the host."""
        lay = self.layout
        B, T, F = lay.batch, lay.kept, lay.row_words
        head = len(lay.counts) * B
        counts = dict(zip(lay.counts, self._fetch(buffer, 0, head).reshape(-1, B).copy()))
        n = np.minimum(counts["eligible"], T)  # rows per request
        total = int(n.sum())
        # one copy (the pinned buffer serves the next call); the fields are views of it: copying
        # each strided column on its own costs five times as much
        rows = self._fetch(buffer, head, head + total * F).reshape(total, F).copy()
        parts, at = {}, 0
        for name, width in lay.fields:
            parts[name] = rows[:, at:at + width] if name == "sid" else rows[:, at]
            at += width
        req = np.repeat(np.arange(B, dtype=np.int64), n)
        rank = np.arange(total, dtype=np.int64) - np.repeat(np.cumsum(n) - n, n) + 1
        per_stage = {"ads_per_stage": {p: counts[f"stage_{p}"] for p in MATCHER_PLANES}} if lay.stages else {}
        return Retrieved(req, rank, parts["ad_row"], parts["ad_id"], parts["sid"],
                         parts["score"].astype(np.int32).view(np.float32), counts["sids"], counts["generated"],
                         counts["eligible"], **per_stage,
                         value=parts["value"].view(np.float64) if lay.has_value else None)
