"""The device post stage as Triton kernels around the exact filter's (`runtime.ops.exact_filter`).
The torch reference (`reference`) spends about 60 small launches and several segmented sorts; here
one program per request holds its slots in one block of BLOCK lanes (C rounded up to a power of 2,
its beams in BK lanes) and does a request's work in registers and a little scratch memory:

  _pairs_kernel  1. the live beams' ad counts, their running sum, and each beam's place in
                    (score descending, beam) order
                 2. slot j -> its beam (`gtm_mask.slots_kernel.beam_of_slot`) and ad; rows an update
                    paused or deleted drop out
                 3. the slots in (ad, beam place) order: an ad's first slot there is its best score's
                    first beam
                 4. those first slots compacted, in ad order, to the front of the request's C slots
                    (ad, beam), and the request's counts of live SIDs and generated ads
  exact filter   every plane, on each request's first `generated` slots only
  _count_kernel  each request's eligible slots (and each plane's passes)
  _rank_kernel   5. the rank keys of RANKS over the eligible slots (ineligible ones last)
                 6. the request's rows at their place among the batch's rows in use (after the
                    earlier requests' min(eligible, T))

A block's order comes from `tl.sort` (bitonic, keys only): `_rank_below` stores the sorted keys in
scratch and binary-searches each lane's key there, which gives each lane its place when keys are
distinct. Every key is built distinct (a lane index or a beam's place in its low bits), or only the
places of the lanes that count (the eligible ones) are read.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from runtime.ops.exact_filter import exact_filter
from runtime.ops.expand.layout import RANKS, RRF_K, PostLayout
from runtime.ops.gtm_mask.slots_kernel import beam_of_slot
from schemas.artifacts import AD_LIVE

_INT64_MAX: tl.constexpr = tl.constexpr(2 ** 63 - 1)


def _warps(block: int) -> int:
    """Warps per program: about 16 slots a thread (the sort's and the keys' registers)."""
    return max(4, min(32, block // 512))


@triton.jit
def _descending(x):
    """int64 keys ordering the floats x (float32 or float64, no NaN) descending as ascending ints,
    as `reference._descending` (-0.0 and 0.0 one key; never _INT64_MAX)."""
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
    """int64 in [0, 2^32): float32 scores x descending as ascending ints (`reference.score_key`)."""
    return _descending(x) + 2 ** 31


@triton.jit
def _rank_below(key, scratch, BLOCK: tl.constexpr, LOG: tl.constexpr):
    """(BLOCK,) int64 per lane how many lanes' keys are below its key (BLOCK,) int64: with distinct
    keys, its place in ascending order. scratch: BLOCK int64 words of this program's (LOG = log2 BLOCK)."""
    lanes = tl.arange(0, BLOCK)
    tl.debug_barrier()  # whoever read scratch before has read it
    tl.store(scratch + lanes, tl.sort(key))
    tl.debug_barrier()
    place = tl.zeros([BLOCK], dtype=tl.int64)
    for i in tl.static_range(LOG):  # branchless lower bound over a power of 2
        below = tl.load(scratch + place + ((BLOCK >> (i + 1)) - 1)) < key
        place = tl.where(below, place + (BLOCK >> (i + 1)), place)
    return place


@triton.jit
def _pairs_kernel(pair_ad, pair_beam, buf, scratch, leaf, score, offsets, leaf_ads, ad_state,
                  B, K, C, s_leaf, s_score, s_scratch,
                  HAS_STATE: tl.constexpr, LIVE: tl.constexpr, BLOCK: tl.constexpr, LOG: tl.constexpr,
                  BK: tl.constexpr, LOG_K: tl.constexpr, S: tl.constexpr):
    """Steps 1-4 for request b: pair_ad, pair_beam (B, C) int64 its first slots' ad and beam, in ad
    order; buf[b] its live SIDs, buf[B + b] its ads (generated). BLOCK slot lanes, BK beam lanes."""
    b = tl.program_id(0).to(tl.int64)
    lanes = tl.arange(0, BLOCK).to(tl.int64)
    sa = scratch + b * s_scratch  # three regions of S = max(BLOCK, BK) words: sorts, places then ads,
    sb, sk = sa + S, sa + 2 * S   # beams' first slots then first flags
    # 1. live beams, their ad counts, running sum, and place by (score descending, beam)
    k = tl.arange(0, BK).to(tl.int64)
    kin = k < K
    lf = tl.load(leaf + b * s_leaf + k, mask=kin, other=-1)
    sc = tl.load(score + b * s_score + k, mask=kin, other=float("-inf"))
    alive = (lf >= 0) & (sc > float("-inf"))
    lf = tl.where(alive, lf, 0)
    cnt = tl.load(offsets + lf + 1, mask=alive, other=0) - tl.load(offsets + lf, mask=alive, other=0)
    total = tl.sum(cnt, axis=0)
    beam_place = _rank_below(tl.where(alive, _score_key(sc), 2 ** 32) * BK + k, sa, BK, LOG_K)
    tl.store(sk + k, tl.cumsum(cnt, axis=0) - cnt)  # each beam's first slot
    tl.store(sb + k, beam_place)
    tl.debug_barrier()
    # 2. slot j -> its beam and ad
    valid = lanes < tl.minimum(total, C)  # C bounds distinct leaves' ads (as the reference cuts them)
    beam = tl.minimum(beam_of_slot(sk, lanes, K, valid, LOG_K), K - 1)
    within = lanes - tl.load(sk + beam, mask=valid, other=0)
    place = tl.load(sb + beam, mask=valid, other=0)
    lfb = tl.load(leaf + b * s_leaf + beam, mask=valid, other=0)
    ad = tl.load(leaf_ads + tl.load(offsets + lfb, mask=valid, other=0) + within, mask=valid, other=0).to(tl.int64)
    if HAS_STATE:  # rows an update paused or deleted are never served
        valid = valid & (tl.load(ad_state + ad, mask=valid, other=0) == LIVE)
    # 3. (ad, beam place) order; the lanes without a pair after every ad, in lane order
    at = _rank_below(tl.where(valid, ad * BK + place, (2 ** 31 + lanes) * BK), sa, BLOCK, LOG)
    tl.debug_barrier()  # the beams' regions are read
    tl.store(sb + at, tl.where(valid, ad, -1))
    tl.debug_barrier()
    first = valid & (tl.load(sb + at - 1, mask=at > 0, other=-1) != ad)
    # 4. the first slots' places among them, by a running sum in ad order
    tl.store(sk + at, first.to(tl.int64))
    tl.debug_barrier()
    f = tl.load(sk + lanes)
    tl.debug_barrier()
    tl.store(sk + lanes, tl.cumsum(f, axis=0) - f)
    tl.debug_barrier()
    out = b * C + tl.load(sk + at)
    tl.store(pair_ad + out, ad, mask=first)
    tl.store(pair_beam + out, beam, mask=first)
    tl.store(buf + b, tl.sum(alive.to(tl.int64), axis=0))
    tl.store(buf + B + b, tl.sum(first.to(tl.int64), axis=0))


@triton.jit
def _count_kernel(buf, passed, B, C, P: tl.constexpr, STAGES: tl.constexpr, BLOCK: tl.constexpr):
    """Request b's eligible slots (every plane passed) into buf[2B + b], and with STAGES each plane's
    into buf[(3 + p) B + b]: the counts `_rank_kernel`'s programs place their rows by."""
    b = tl.program_id(0).to(tl.int64)
    lanes = tl.arange(0, BLOCK).to(tl.int64)
    real = lanes < tl.load(buf + B + b)
    ok = real
    for p in tl.static_range(P):
        hit = real & (tl.load(passed + (p * B + b) * C + lanes, mask=real, other=0) != 0)
        if STAGES:
            tl.store(buf + (3 + p) * B + b, tl.sum(hit.to(tl.int64), axis=0))
        ok = ok & hit
    tl.store(buf + 2 * B + b, tl.sum(ok.to(tl.int64), axis=0))


@triton.jit
def _rank_kernel(buf, pair_ad, pair_beam, passed, scratch, score, tokens, ads, ad_order, ad_value,
                 B, C, T, s_score, s_tok_b, s_tok_k, s_tok_l, s_scratch,
                 P: tl.constexpr, RANK: tl.constexpr, HAS_VALUE: tl.constexpr, L: tl.constexpr, F: tl.constexpr,
                 NC: tl.constexpr, RRF: tl.constexpr, BLOCK: tl.constexpr, LOG: tl.constexpr, BB: tl.constexpr):
    """Steps 5-6 for request b: its first min(eligible, T) ranked rows (F words) into buf's rows,
    after the rows of requests 0..b-1 (their eligible counts, `_count_kernel`'s; BB >= B)."""
    b = tl.program_id(0).to(tl.int64)
    lanes = tl.arange(0, BLOCK).to(tl.int64)
    sa = scratch + b * s_scratch
    real = lanes < tl.load(buf + B + b)
    ad = tl.load(pair_ad + b * C + lanes, mask=real, other=0)
    beam = tl.load(pair_beam + b * C + lanes, mask=real, other=0)
    ok = real
    for p in tl.static_range(P):
        ok = ok & (tl.load(passed + (p * B + b) * C + lanes, mask=real, other=0) != 0)
    # 5. ranks: by score (then ad_id, as the ad's place in ad_id order), the ineligible last
    sc = tl.load(score + b * s_score + beam, mask=real, other=0.0)
    order = tl.load(ad_order + ad, mask=real, other=0)
    place = _rank_below(tl.where(ok, _score_key(sc) * 2 ** 31 + order, (2 ** 32 - 1) * 2 ** 31 + lanes), sa, BLOCK,
                        LOG)
    if HAS_VALUE:
        value = tl.load(ad_value + ad, mask=real, other=0.0)
    if RANK > 0:  # by value (there are values: `runtime.post.check_rank`), then the score place
        dense = _rank_below(tl.where(ok, _descending(value), _INT64_MAX), sa, BLOCK, LOG)
        by_value = _rank_below(dense * BLOCK + place, sa, BLOCK, LOG)
        if RANK == 1:
            place = by_value
        else:  # reciprocal-rank fusion of the two 1-based ranks, then ad_id
            fused = 1.0 / (RRF + place + 1).to(tl.float64) + 1.0 / (RRF + by_value + 1).to(tl.float64)
            dense = _rank_below(tl.where(ok, _descending(fused), _INT64_MAX), sa, BLOCK, LOG)
            place = _rank_below(dense * 2 ** 31 + order, sa, BLOCK, LOG)  # the ineligible: dense above all
    # 6. the rows in use before this request's: each earlier request's min(eligible, T)
    e = tl.arange(0, BB)
    before = tl.sum(tl.minimum(tl.load(buf + 2 * B + e, mask=e < b, other=0), T), axis=0)
    keep = ok & (place < T)
    row = buf + NC * B + (before + place) * F
    tl.store(row, ad, mask=keep)
    tl.store(row + 1, tl.load(ads + ad, mask=keep, other=0), mask=keep)
    for i in tl.static_range(L):
        tl.store(row + 2 + i, tl.load(tokens + b * s_tok_b + beam * s_tok_k + i * s_tok_l, mask=keep, other=0),
                 mask=keep)
    tl.store(row + 2 + L, sc.to(tl.int32, bitcast=True).to(tl.int64), mask=keep)
    if HAS_VALUE:
        tl.store(row + 3 + L, value.to(tl.int64, bitcast=True), mask=keep)


def expand_triton(layout: PostLayout, arrays: dict[str, torch.Tensor], ad_order: torch.Tensor,
                  steps: dict[str, tuple[int, ...]], requests, beams, max_values: int) -> torch.Tensor:
    """`runtime.ops.expand.expand_beams` as the kernels and the exact filter's (same arguments;
    B, C >= 1; any block, but past `MAX_BLOCK` the sorts are slow to compile and to run)."""
    B, K, C, T = layout.batch, layout.beams, layout.pairs, layout.kept
    leaf, score, tokens = beams.leaf, beams.score, beams.tokens
    if not (leaf.shape == score.shape == (B, K) and tokens.shape == (B, K, layout.length)
            and leaf.stride(1) == score.stride(1) == 1):
        raise ValueError(f"beams: expected tokens (B, K, L) = {(B, K, layout.length)}, score and leaf (B, K) with unit "
                         f"stride along K; got {tuple(tokens.shape)}, {tuple(score.shape)} strides {score.stride()}, "
                         f"{tuple(leaf.shape)} strides {leaf.stride()}")
    block, beam_block = layout.block, layout.beam_block
    log, wide = block.bit_length() - 1, max(block, beam_block)
    dev = beams.score.device
    a = arrays
    buf = torch.empty(layout.size, dtype=torch.int64, device=dev)
    pair_ad = torch.empty((B, C), dtype=torch.int64, device=dev)
    pair_beam = torch.empty((B, C), dtype=torch.int64, device=dev)
    scratch = torch.empty((B, 3 * wide), dtype=torch.int64, device=dev)
    state = a.get("ad_state")
    _pairs_kernel[(B,)](
        pair_ad, pair_beam, buf, scratch, leaf, score, a["leaf_ad_offsets"], a["leaf_ads"],
        state if state is not None else buf, B, K, C, leaf.stride(0), score.stride(0), scratch.stride(0),
        HAS_STATE=state is not None, LIVE=AD_LIVE, BLOCK=block, LOG=log, BK=beam_block,
        LOG_K=beam_block.bit_length() - 1, S=wide, num_warps=_warps(wide))
    passed = torch.stack(exact_filter(a, requests, pair_ad, steps, max_values, "triton", live=buf[B:2 * B]))
    passed = passed.view(torch.uint8)  # pair_ad past a request's `live` count is never written: these kernels skip it
    _count_kernel[(B,)](buf, passed, B, C, P=len(passed), STAGES=layout.stages, BLOCK=block, num_warps=4)
    value = a["ad_value"] if layout.has_value else score
    _rank_kernel[(B,)](
        buf, pair_ad, pair_beam, passed, scratch, score, tokens, a["ads"], ad_order, value,
        B, C, T, score.stride(0), tokens.stride(0), tokens.stride(1), tokens.stride(2), scratch.stride(0),
        P=len(passed), RANK=RANKS.index(layout.rank), HAS_VALUE=layout.has_value, L=layout.length,
        F=layout.row_words, NC=len(layout.counts), RRF=RRF_K, BLOCK=block, LOG=log,
        BB=max(2, triton.next_power_of_2(B)), num_warps=_warps(block))
    return buf
