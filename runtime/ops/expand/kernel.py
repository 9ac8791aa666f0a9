"""The device post stage as Triton kernels around the exact filter's (`runtime.ops.exact_filter`).
The torch reference (`reference`) spends about 60 small launches and several segmented sorts; here
no kernel sorts: a bitonic `tl.sort` of a request's slots on one SM (78 stages at 4,096 lanes; two
to dedupe, one to five to rank) cost more than all the rest. Order comes instead from a hash table
(which slot is an ad's first) and from counting (a slot's place is the number of keys below its own):

  _pairs_kernel     one program per request, its slots in one block of BLOCK lanes (C rounded up to
                    a power of 2, at least a lane per thread; its beams in BK lanes):
                    1. the live beams' ad counts and their running sum
                    2. slot j -> its beam (`gtm_mask.slots_kernel.beam_of_slot`) and ad, and its key
                       (score descending, beam); rows an update paused or deleted drop out
                    3. each ad's cell in a hash table in scratch memory, claimed by compare-and-swap
                    4. the smallest key per cell (atomic min) marks the ad's first slot: its best
                       score's first beam; those slots compacted, in slot order, to the front of the
                       request's C slots (ad, beam), with the request's counts of live SIDs and ads
  exact filter      every plane, on each request's first `generated` slots only
  _eligible_kernel  5. one program per request: its eligible slots compacted with their score keys,
                       and its counts (eligible, each plane's passes)
  _place_kernel     6. programs of TILE eligible slots (B x C/TILE): a slot's place in RANKS's order
                       by counting, one pass per key of the ranking (score 1, value 2, fused 3), the
                       last writing the request's rows at their place among the batch's rows in use
                       (after the earlier requests' min(eligible, T))

Every key pair a place pass compares is distinct (the ad's place in ad_id order, or an earlier
pass's place, breaks ties), so the places of a request's eligible slots are 0 .. eligible - 1.
Counting costs eligible^2 compares per request, over many SMs; the ads a request keeps after the
exact filter are a fraction of its slots.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from runtime.ops.exact_filter import exact_filter
from runtime.ops.expand.layout import RANKS, RRF_K, PostLayout, pow2
from runtime.ops.gtm_mask.slots_kernel import beam_of_slot
from schemas.artifacts import AD_LIVE

_INT64_MAX: tl.constexpr = tl.constexpr(2 ** 63 - 1)
_TILE, _CHUNK = 64, 32  # a place program's eligible slots, and the slots it compares them with per round: in
# registers at 4 warps (96 a thread for sm_90; a 64 x 128 round took 255 and spilled)


def _warps(block: int) -> int:
    """Warps per program: 4 slots a thread up to 32 warps. A request's one program is bound by its
    chains of dependent loads, so more threads in flight pay (H200, 4,096 slots: 0.145 ms a batch
    at 32 warps, 0.170 at 8, 0.231 at 4)."""
    return max(4, min(32, block // 128))


@triton.jit
def _descending(x):
    """int64 keys ordering the floats x (float32 or float64, no NaN) descending as ascending ints,
    as `runtime.ops.order.descending` (-0.0 and 0.0 one key; never _INT64_MAX)."""
    x = x + 0.0  # -0.0 -> 0.0
    if x.dtype == tl.float32:
        bits = x.to(tl.int32, bitcast=True).to(tl.int64)
        ordered = bits ^ ((bits >> 31) & 0x7FFFFFFF)
    else:
        bits = x.to(tl.int64, bitcast=True)
        ordered = bits ^ ((bits >> 63) & _INT64_MAX)
    return -ordered - 1


@triton.jit
def _score_key(x):
    """int64 in [0, 2^32): float32 scores x descending as ascending ints (`runtime.ops.order.score_key`)."""
    return _descending(x) + 2 ** 31


@triton.jit
def _pairs_kernel(pair_ad, pair_beam, buf, scratch, leaf, score, offsets, leaf_ads, ad_state,
                  B, K, C, s_leaf, s_score, s_scratch,
                  HAS_STATE: tl.constexpr, LIVE: tl.constexpr, BLOCK: tl.constexpr, LOG: tl.constexpr,
                  BK: tl.constexpr, LOG_K: tl.constexpr):
    """Steps 1-4 for request b: pair_ad, pair_beam (B, C) int64 its first slots' ad and beam, in slot
    order; buf[b] its live SIDs, buf[B + b] its ads (generated). BLOCK slot lanes, BK beam lanes.
    scratch: the request's BK words (its beams' first slots), then a hash table of 2 BLOCK words
    (ads) and 2 BLOCK words (their best slot key)."""
    b = tl.program_id(0).to(tl.int64)
    lanes = tl.arange(0, BLOCK).to(tl.int64)
    sk = scratch + b * s_scratch
    table, best = sk + BK, sk + BK + 2 * BLOCK  # 2 BLOCK cells: at most half full, a handful of probes
    cells = tl.arange(0, 2 * BLOCK)
    tl.store(table + cells, tl.full([2 * BLOCK], -1, tl.int64))
    tl.store(best + cells, tl.full([2 * BLOCK], _INT64_MAX, tl.int64))
    # 1. live beams, their ad counts and running sum
    k = tl.arange(0, BK).to(tl.int64)
    kin = k < K
    lf = tl.load(leaf + b * s_leaf + k, mask=kin, other=-1)
    sc = tl.load(score + b * s_score + k, mask=kin, other=float("-inf"))
    alive = (lf >= 0) & (sc > float("-inf"))
    lf = tl.where(alive, lf, 0)
    cnt = tl.load(offsets + lf + 1, mask=alive, other=0) - tl.load(offsets + lf, mask=alive, other=0)
    total = tl.sum(cnt, axis=0)
    tl.store(sk + k, tl.cumsum(cnt, axis=0) - cnt)  # each beam's first slot
    tl.debug_barrier()
    # 2. slot j -> its beam and ad, and its key: (score descending, beam), distinct per beam
    valid = lanes < tl.minimum(total, C)  # C bounds distinct leaves' ads (as the reference cuts them)
    beam = tl.minimum(beam_of_slot(sk, lanes, K, valid, LOG_K), K - 1)
    within = lanes - tl.load(sk + beam, mask=valid, other=0)
    lfb = tl.load(leaf + b * s_leaf + beam, mask=valid, other=0)
    ad = tl.load(leaf_ads + tl.load(offsets + lfb, mask=valid, other=0) + within, mask=valid, other=0).to(tl.int64)
    if HAS_STATE:  # rows an update paused or deleted are never served
        valid = valid & (tl.load(ad_state + ad, mask=valid, other=0) == LIVE)
    key = _score_key(tl.load(score + b * s_score + beam, mask=valid, other=0.0)) * BK + beam
    # 3. each ad's cell in the table (linear probing from a multiplicative hash), claimed by
    #    compare-and-swap; a lane done swaps its cell's ad for itself, and a lane without a pair
    #    compares with a value no cell holds (its own, spread over the table: one cell would
    #    serialise them): no-ops, as `tl.atomic_cas` takes no mask
    ad = tl.where(valid, ad, -2 - lanes)
    cell = ((ad * 2654435761) & 0xFFFFFFFF) >> (31 - LOG)  # Knuth's: the top LOG + 1 of 32 bits
    pending = valid
    left = tl.sum(pending.to(tl.int32), axis=0)
    while left > 0:
        seen = tl.atomic_cas(table + cell, tl.where(pending, -1, ad), ad)
        pending = pending & (seen != -1) & (seen != ad)
        cell = tl.where(pending, (cell + 1) & (2 * BLOCK - 1), cell)
        left = tl.sum(pending.to(tl.int32), axis=0)
    # 4. an ad's first slot holds its smallest key: the best score's first beam; those slots
    #    compacted to the front, in slot order
    tl.atomic_min(best + cell, key, mask=valid)
    tl.debug_barrier()
    first = valid & (tl.load(best + cell, mask=valid, other=0, cache_modifier=".cg") == key)  # L2: the atomics'
    f = first.to(tl.int64)
    out = b * C + tl.cumsum(f, axis=0) - f
    tl.store(pair_ad + out, ad, mask=first)
    tl.store(pair_beam + out, beam, mask=first)
    tl.store(buf + b, tl.sum(alive.to(tl.int64), axis=0))
    tl.store(buf + B + b, tl.sum(f, axis=0))


@triton.jit
def _eligible_kernel(buf, pair_ad, pair_beam, passed, keys, elig, score, ad_order, B, C, s_score,
                     P: tl.constexpr, STAGES: tl.constexpr, BLOCK: tl.constexpr):
    """Step 5 for request b: its eligible slots (every plane passed) compacted, in slot order, into
    elig (B, C) (their slot) and keys[0] (B, C, 2) (the score rank's keys: the score's key and the
    ad's place in ad_id order); their count into buf[2B + b], with STAGES each plane's passes into
    buf[(3 + p) B + b]: the counts `_place_kernel`'s programs size and place their rows by."""
    b = tl.program_id(0).to(tl.int64)
    lanes = tl.arange(0, BLOCK).to(tl.int64)
    real = lanes < tl.load(buf + B + b)
    ok = real
    for p in tl.static_range(P):
        hit = real & (tl.load(passed + (p * B + b) * C + lanes, mask=real, other=0) != 0)
        if STAGES:
            tl.store(buf + (3 + p) * B + b, tl.sum(hit.to(tl.int64), axis=0))
        ok = ok & hit
    n = ok.to(tl.int64)
    at = b * C + tl.cumsum(n, axis=0) - n
    beam = tl.load(pair_beam + b * C + lanes, mask=ok, other=0)
    ad = tl.load(pair_ad + b * C + lanes, mask=ok, other=0)
    tl.store(elig + at, lanes, mask=ok)
    tl.store(keys + 2 * at, _score_key(tl.load(score + b * s_score + beam, mask=ok, other=0.0)), mask=ok)
    tl.store(keys + 2 * at + 1, tl.load(ad_order + ad, mask=ok, other=0), mask=ok)
    tl.store(buf + 2 * B + b, tl.sum(n, axis=0))


@triton.jit
def _place_kernel(buf, pair_ad, pair_beam, elig, keys, score, tokens, ads, ad_order, ad_value,
                  B, C, T, s_score, s_tok_b, s_tok_k, s_tok_l,
                  PASS: tl.constexpr, RANK: tl.constexpr, HAS_VALUE: tl.constexpr, L: tl.constexpr,
                  F: tl.constexpr, NC: tl.constexpr, RRF: tl.constexpr, TILE: tl.constexpr, CH: tl.constexpr,
                  BB: tl.constexpr):
    """Step 6, pass PASS of RANK's (score 1, value 2, fused 3) for TILE of request b's eligible
    slots: each one's place among them, counting the slots whose key pair (keys[PASS % 2], the
    first key then the second; the second distinct) is below its own. The last pass writes the
    rows of the first T places (F words each) after the rows of requests 0..b-1 (min(eligible, T)
    each, BB >= B); the others write the next pass's keys into keys[1 - PASS % 2]:
      score place -> (the value descending, the score place)        (value's place)
      value place -> (the fused score descending, the ad_id place)  (fused's place)"""
    b = tl.program_id(0).to(tl.int64)
    i = tl.program_id(1).to(tl.int64) * TILE + tl.arange(0, TILE)
    E = tl.load(buf + 2 * B + b)
    mine = i < E
    src = keys + ((PASS % 2) * B + b) * C * 2
    k1, k2 = tl.load(src + 2 * i, mask=mine, other=0), tl.load(src + 2 * i + 1, mask=mine, other=0)
    below = tl.zeros([TILE], dtype=tl.int64)
    end = tl.where(tl.program_id(1).to(tl.int64) * TILE < E, E, 0)  # a tile past the eligible ones reads none
    for j0 in range(0, end, CH):
        j = j0 + tl.arange(0, CH)
        m = j < E
        o1 = tl.load(src + 2 * j, mask=m, other=_INT64_MAX)
        o2 = tl.load(src + 2 * j + 1, mask=m, other=_INT64_MAX)
        lt = (o1[None, :] < k1[:, None]) | ((o1[None, :] == k1[:, None]) & (o2[None, :] < k2[:, None]))
        below += tl.sum(lt.to(tl.int64), axis=1)
    slot = tl.load(elig + b * C + i, mask=mine, other=0)
    ad = tl.load(pair_ad + b * C + slot, mask=mine, other=0)
    if PASS < RANK:  # the next pass's keys, at the same lanes
        dst = keys + ((1 - PASS % 2) * B + b) * C * 2
        if PASS == 0:
            tl.store(dst + 2 * i, _descending(tl.load(ad_value + ad, mask=mine, other=0.0)), mask=mine)
            tl.store(dst + 2 * i + 1, below, mask=mine)
        else:  # reciprocal-rank fusion of the two 1-based ranks (k2: the score place)
            fused = 1.0 / (RRF + k2 + 1).to(tl.float64) + 1.0 / (RRF + below + 1).to(tl.float64)
            tl.store(dst + 2 * i, _descending(fused), mask=mine)
            tl.store(dst + 2 * i + 1, tl.load(ad_order + ad, mask=mine, other=0), mask=mine)
    else:
        # the rows in use before this request's: each earlier request's min(eligible, T)
        e = tl.arange(0, BB)
        before = tl.sum(tl.minimum(tl.load(buf + 2 * B + e, mask=e < b, other=0), T), axis=0)
        keep = mine & (below < T)
        beam = tl.load(pair_beam + b * C + slot, mask=keep, other=0)
        row = buf + NC * B + (before + below) * F
        tl.store(row, ad, mask=keep)
        tl.store(row + 1, tl.load(ads + ad, mask=keep, other=0), mask=keep)
        for t in tl.static_range(L):
            tl.store(row + 2 + t, tl.load(tokens + b * s_tok_b + beam * s_tok_k + t * s_tok_l, mask=keep, other=0),
                     mask=keep)
        sc = tl.load(score + b * s_score + beam, mask=keep, other=0.0)
        tl.store(row + 2 + L, sc.to(tl.int32, bitcast=True).to(tl.int64), mask=keep)
        if HAS_VALUE:
            value = tl.load(ad_value + ad, mask=keep, other=0.0)
            tl.store(row + 3 + L, value.to(tl.int64, bitcast=True), mask=keep)


def first_slots(leaf: torch.Tensor, score: torch.Tensor, offsets: torch.Tensor, leaf_ads: torch.Tensor,
                ad_state: torch.Tensor | None, C: int, buf: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Steps 1-4 (`_pairs_kernel`): each request's ads under its live beams, once each, with the
    beam of its best score (the first such beam), in the order of those slots.

    leaf (B, K) int64 (-1: not a catalog SID), score (B, K) float32 (-inf: dead), both unit stride
    along K; offsets (S+1,) int64 and leaf_ads (P,) int32/int64: the SID -> ad CSR; ad_state (N,)
    uint8 or None (every row live); C: the slots a request holds (its first C are expanded).
    Returns pair_ad, pair_beam (B, C) int64, request b's first buf[B + b] valid; writes buf[b]
    (its live beams) and buf[B + b] (its ads) of buf (>= 2B,) int64."""
    B, K = leaf.shape
    block, beam_block = pow2(C), pow2(K)
    warps = _warps(max(block, beam_block))
    # every lane of the compare-and-swap loop in a thread of its own: a thread holding a copy of
    # another's lane relies on the return value reaching every copy (Triton before mid-2025 did not)
    lanes = max(block, 32 * warps)
    pair_ad = torch.empty((B, C), dtype=torch.int64, device=leaf.device)
    pair_beam = torch.empty((B, C), dtype=torch.int64, device=leaf.device)
    scratch = torch.empty((B, beam_block + 4 * lanes), dtype=torch.int64, device=leaf.device)
    _pairs_kernel[(B,)](
        pair_ad, pair_beam, buf, scratch, leaf, score, offsets, leaf_ads, ad_state if ad_state is not None else buf,
        B, K, C, leaf.stride(0), score.stride(0), scratch.stride(0),
        HAS_STATE=ad_state is not None, LIVE=AD_LIVE, BLOCK=lanes, LOG=lanes.bit_length() - 1, BK=beam_block,
        LOG_K=beam_block.bit_length() - 1, num_warps=warps)
    return pair_ad, pair_beam


def expand_triton(layout: PostLayout, arrays: dict[str, torch.Tensor], ad_order: torch.Tensor,
                  steps: dict[str, tuple[int, ...]], requests, beams, max_values: int) -> torch.Tensor:
    """`runtime.ops.expand.expand_beams` as the kernels and the exact filter's (same arguments;
    B, C >= 1; any block, but past `MAX_BLOCK` a request's one program holds more lanes than
    was measured)."""
    B, K, C, T = layout.batch, layout.beams, layout.pairs, layout.kept
    leaf, score, tokens = beams.leaf, beams.score, beams.tokens
    if not (leaf.shape == score.shape == (B, K) and tokens.shape == (B, K, layout.length)
            and leaf.stride(1) == score.stride(1) == 1):
        raise ValueError(f"beams: expected tokens (B, K, L) = {(B, K, layout.length)}, score and leaf (B, K) with unit "
                         f"stride along K; got {tuple(tokens.shape)}, {tuple(score.shape)} strides {score.stride()}, "
                         f"{tuple(leaf.shape)} strides {leaf.stride()}")
    block = layout.block
    dev = beams.score.device
    a = arrays
    buf = torch.empty(layout.size, dtype=torch.int64, device=dev)
    pair_ad, pair_beam = first_slots(leaf, score, a["leaf_ad_offsets"], a["leaf_ads"], a.get("ad_state"), C, buf)
    passed = torch.stack(exact_filter(a, requests, pair_ad, steps, max_values, "triton", live=buf[B:2 * B]))
    passed = passed.view(torch.uint8)  # pair_ad past a request's `live` count is never written: these kernels skip it
    elig = torch.empty((B, C), dtype=torch.int64, device=dev)
    keys = torch.empty((2, B, C, 2), dtype=torch.int64, device=dev)  # a pass's keys, the next pass's
    _eligible_kernel[(B,)](buf, pair_ad, pair_beam, passed, keys, elig, score, ad_order, B, C, score.stride(0),
                           P=len(passed), STAGES=layout.stages, BLOCK=block, num_warps=_warps(block))
    value = a["ad_value"] if layout.has_value else score
    rank = RANKS.index(layout.rank)
    for step in range(rank + 1):
        _place_kernel[(B, triton.cdiv(C, _TILE))](
            buf, pair_ad, pair_beam, elig, keys, score, tokens, a["ads"], ad_order, value,
            B, C, T, score.stride(0), tokens.stride(0), tokens.stride(1), tokens.stride(2),
            PASS=step, RANK=rank, HAS_VALUE=layout.has_value, L=layout.length, F=layout.row_words,
            NC=len(layout.counts), RRF=RRF_K, TILE=_TILE, CH=_CHUNK, BB=pow2(B), num_warps=4)
    return buf
