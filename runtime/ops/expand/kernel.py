"""The device post stage as Triton kernels around the exact filter's (`runtime.ops.exact_filter`)
and the ranking's sorts (`runtime.ops.expand.rank`).

Passes: `_beams_kernel` (one program per request: its beams' ad counts, the pairs reached, whether
they overflow C), `_clear_kernel` (the request's hash table emptied), `_pairs_kernel` (slot -> beam
and ad, each ad deduplicated by compare-and-swap, keeping its best key by atomic min), the exact
filter, `_keys_kernel` (eligibility and ranking keys), `rank_slots` (the sorts) and `_rows_kernel`
(the kept rows). Every pass but the first runs many programs per request, a tile of TILE slots
each, and a tile past its request's pairs does almost nothing: the work grows with the pairs the
beams reach, the memory with the capacity C the caller chose, and a SID may hold any number of
ads. No kernel holds a request's slots in one block, so C is bounded only by the grid
(`layout.MAX_PAIRS`). Grids, memory per request and launches: docs/kernels.md ("Post kernels").
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from runtime.ops.exact_filter import exact_filter
from runtime.ops.expand import layout as lay
from runtime.ops.expand.layout import PostLayout, pow2
from runtime.ops.expand.rank import ORDER_BITS, rank_slots
from runtime.ops.slots.kernel import beam_of_slot
from schemas.artifacts import AD_LIVE

_INT64_MAX: tl.constexpr = tl.constexpr(2 ** 63 - 1)
_ORDER_SCALE: tl.constexpr = tl.constexpr(1 << ORDER_BITS)  # the score key's place above the ad_id place
# the buffer's counts (`layout`), as the kernels read them
_SIDS: tl.constexpr = tl.constexpr(lay.SIDS)
_REACHED: tl.constexpr = tl.constexpr(lay.REACHED)
_GENERATED: tl.constexpr = tl.constexpr(lay.GENERATED)
_ELIGIBLE: tl.constexpr = tl.constexpr(lay.ELIGIBLE)
_STAGE0: tl.constexpr = tl.constexpr(lay.STAGE0)
# a program's slots, one lane per thread (32 x _WARPS): the compare-and-swap loop reads each lane's
# returned value, and a thread holding a copy of another's lane relies on the value reaching every
# copy (Triton before mid-2025 did not)
_TILE, _WARPS = 128, 4
_CLEAR = 1024  # table cells a clearing program empties
_CHUNK = 1024  # beams a `_beams_kernel` program takes per round


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
def _beams_kernel(buf, start, held, leaf, score, offsets, B, K, C, s_leaf, s_score,
                  NC: tl.constexpr, CHUNK: tl.constexpr):
    """Pass 1 for request b. leaf (B, K) int64 (-1: not a catalog SID), score (B, K) float32 (-inf:
    dead), row strides s_leaf, s_score; offsets (S+1,) int64. Writes start (B, K) int64 each beam's
    first slot (a dead beam holds no slot), held (B,) int64 the request's slots (its reached
    pairs, or 0 when they pass C), and of buf's NC counts (B each): live SIDs, reached, and 0 for
    the others (the later passes add to them)."""
    b = tl.program_id(0).to(tl.int64)
    carry = tl.sum(tl.zeros([CHUNK], dtype=tl.int64), axis=0)
    live = tl.sum(tl.zeros([CHUNK], dtype=tl.int64), axis=0)
    for c0 in range(0, K, CHUNK):
        k = c0 + tl.arange(0, CHUNK).to(tl.int64)
        m = k < K
        lf = tl.load(leaf + b * s_leaf + k, mask=m, other=-1)
        alive = m & (lf >= 0) & (tl.load(score + b * s_score + k, mask=m, other=float("-inf")) > float("-inf"))
        lf = tl.where(alive, lf, 0)
        cnt = tl.load(offsets + lf + 1, mask=alive, other=0) - tl.load(offsets + lf, mask=alive, other=0)
        tl.store(start + b * K + k, carry + tl.cumsum(cnt, axis=0) - cnt, mask=m)
        carry += tl.sum(cnt, axis=0)
        live += tl.sum(alive.to(tl.int64), axis=0)
    tl.store(buf + _SIDS * B + b, live)
    tl.store(buf + _REACHED * B + b, carry)
    for n in tl.static_range(_GENERATED, NC):
        tl.store(buf + n * B + b, 0)
    tl.store(held + b, tl.where(carry <= C, carry, 0))


@triton.jit
def _clear_kernel(table, best, held, s_table, BLOCK: tl.constexpr):
    """Pass 2: request b's first 2 held[b] cells of table (B, s_table) int64 emptied (-1), and of
    best (B, s_table) int64 (INT64_MAX); a block past them stores nothing."""
    b = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    m = c < 2 * tl.load(held + b)
    tl.store(table + b * s_table + c, tl.full([BLOCK], -1, tl.int64), mask=m)
    tl.store(best + b * s_table + c, tl.full([BLOCK], _INT64_MAX, tl.int64), mask=m)


@triton.jit
def _pairs_kernel(pair_ad, pair_cell, buf, table, best, start, held, leaf, score, offsets, leaf_ads, ad_state,
                  B, K, C, s_leaf, s_score, s_table,
                  HAS_STATE: tl.constexpr, LIVE: tl.constexpr, LOG_K: tl.constexpr, TILE: tl.constexpr):
    """Pass 3 for request b's slots j in this program's tile: the ad's cell among the request's
    n = 2 held[b] cells of table (B, s_table) int64 (its ad) and best (the smallest key of the
    slots holding it: score key x K + beam); the lane that claims a cell appends (ad, cell) to
    pair_ad, pair_cell (B, C) int64, at a place counted in buf's `generated` count."""
    b = tl.program_id(0).to(tl.int64)
    t0 = tl.program_id(1).to(tl.int64) * TILE
    H = tl.load(held + b)
    if t0 < H:  # a tile past the request's slots does nothing
        j = t0 + tl.arange(0, TILE).to(tl.int64)
        valid = j < H
        beam = tl.minimum(beam_of_slot(start + b * K, j, K, valid, LOG_K), K - 1)
        within = j - tl.load(start + b * K + beam, mask=valid, other=0)
        lf = tl.load(leaf + b * s_leaf + beam, mask=valid, other=0)
        ad = tl.load(leaf_ads + tl.load(offsets + lf, mask=valid, other=0) + within, mask=valid, other=0).to(tl.int64)
        if HAS_STATE:  # rows an update paused or deleted are never served
            valid = valid & (tl.load(ad_state + ad, mask=valid, other=0) == LIVE)
        key = _score_key(tl.load(score + b * s_score + beam, mask=valid, other=0.0)) * K + beam
        # the ad's cell: linear probing from a multiplicative hash (Knuth's), its 32 bits scaled to
        # the n cells (at most half full: a handful of probes); claimed by compare-and-swap. A lane
        # done swaps its cell's ad for itself, and a lane without a pair compares with a value no
        # cell holds (its own, spread over the table: one cell would serialise them): no-ops, as
        # `tl.atomic_cas` takes no mask
        n = 2 * H
        ad = tl.where(valid, ad, -2 - j)
        cell = (((ad * 2654435761) & 0xFFFFFFFF) * n) >> 32
        cells, bests = table + b * s_table, best + b * s_table
        pending = valid
        claimed = valid & (j < 0)
        left = tl.sum(pending.to(tl.int32), axis=0)
        while left > 0:
            seen = tl.atomic_cas(cells + cell, tl.where(pending, -1, ad), ad)
            claimed = claimed | (pending & (seen == -1))
            pending = pending & (seen != -1) & (seen != ad)
            cell = tl.where(pending, tl.where(cell + 1 == n, 0, cell + 1), cell)
            left = tl.sum(pending.to(tl.int32), axis=0)
        # the smallest key per cell: the ad's best score's first beam (read by the next passes)
        tl.atomic_min(bests + cell, key, mask=valid)
        f = claimed.to(tl.int64)
        at = b * C + tl.atomic_add(buf + _GENERATED * B + b, tl.sum(f, axis=0)) + tl.cumsum(f, axis=0) - f
        tl.store(pair_ad + at, ad, mask=claimed)
        tl.store(pair_cell + at, cell, mask=claimed)


@triton.jit
def _keys_kernel(packed, value_key, buf, pair_ad, pair_cell, best, passed, ad_order, ad_value,
                 B, K, C, s_table,
                 P: tl.constexpr, STAGES: tl.constexpr, HAS_VALUE_KEY: tl.constexpr, TILE: tl.constexpr):
    """Pass 4 for request b's slots i in this program's tile: a pair (i < generated) is eligible
    when it passed every plane (passed (P, B, C) uint8); packed (B, C) int64 its score key x 2^31
    + its ad's place in ad_id order (ad_order (N,) int64), with HAS_VALUE_KEY value_key (B, C)
    int64 its ad's value (ad_value (N,) float64) descending; INT64_MAX for every other slot. Adds
    the tile's eligible pairs (and with STAGES each plane's passes) to buf's counts."""
    b = tl.program_id(0).to(tl.int64)
    t0 = tl.program_id(1).to(tl.int64) * TILE
    i = t0 + tl.arange(0, TILE).to(tl.int64)
    G = tl.load(buf + _GENERATED * B + b)
    real = i < G
    ad = tl.load(pair_ad + b * C + i, mask=real, other=0)
    key = tl.load(best + b * s_table + tl.load(pair_cell + b * C + i, mask=real, other=0), mask=real, other=0)
    ok = real
    for p in tl.static_range(P):
        hit = real & (tl.load(passed + (p * B + b) * C + i, mask=real, other=0) != 0)
        if STAGES:
            if t0 < G:
                tl.atomic_add(buf + (_STAGE0 + p) * B + b, tl.sum(hit.to(tl.int64), axis=0))
        ok = ok & hit
    if t0 < G:
        tl.atomic_add(buf + _ELIGIBLE * B + b, tl.sum(ok.to(tl.int64), axis=0))
    inside = i < C
    order = tl.load(ad_order + ad, mask=ok, other=0)
    tl.store(packed + b * C + i, tl.where(ok, (key // K) * _ORDER_SCALE + order, _INT64_MAX), mask=inside)
    if HAS_VALUE_KEY:
        value = tl.load(ad_value + ad, mask=ok, other=0.0)
        tl.store(value_key + b * C + i, tl.where(ok, _descending(value), _INT64_MAX), mask=inside)


@triton.jit
def _rows_kernel(buf, top, pair_ad, pair_cell, best, score, tokens, ads, ad_value,
                 B, K, C, T, s_top, s_table, s_score, s_tok_b, s_tok_k, s_tok_l,
                 NC: tl.constexpr, HAS_VALUE: tl.constexpr, L: tl.constexpr, F: tl.constexpr,
                 TILE: tl.constexpr, BB: tl.constexpr):
    """Pass 6 for request b's places r in this program's tile: the slot top (B, >= T) int64 ranks
    r-th; its row (F words: ad_row, ad_id, L tokens, score bits, with HAS_VALUE value bits) at row
    `before + r` after buf's NC counts, before = the rows of requests 0..b-1 (min(eligible, T)
    each; BB >= B lanes), for r < min(eligible, T)."""
    b = tl.program_id(0).to(tl.int64)
    t0 = tl.program_id(1).to(tl.int64) * TILE
    E = tl.minimum(tl.load(buf + _ELIGIBLE * B + b), T)
    if t0 < E:  # a tile past the request's rows writes none
        r = t0 + tl.arange(0, TILE).to(tl.int64)
        keep = r < E
        e = tl.arange(0, BB)
        before = tl.sum(tl.minimum(tl.load(buf + _ELIGIBLE * B + e, mask=e < b, other=0), T), axis=0)
        slot = tl.load(top + b * s_top + r, mask=keep, other=0)
        ad = tl.load(pair_ad + b * C + slot, mask=keep, other=0)
        cell = tl.load(pair_cell + b * C + slot, mask=keep, other=0)
        beam = tl.load(best + b * s_table + cell, mask=keep, other=0) % K
        row = buf + NC * B + (before + r) * F
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


class Pairs(NamedTuple):
    """Passes 1-3 of a batch: request b's first buf[GENERATED * B + b] slots of ad and cell (B, C)
    int64 hold its distinct live ads (in no particular order) and each one's cell of best (B, 2C)
    int64, whose key is score key x K + the beam of the ad's best score (the first such beam)."""

    ad: torch.Tensor
    cell: torch.Tensor
    best: torch.Tensor


def distinct_pairs(leaf: torch.Tensor, score: torch.Tensor, offsets: torch.Tensor, leaf_ads: torch.Tensor,
                   ad_state: torch.Tensor | None, C: int, buf: torch.Tensor, counts: int) -> Pairs:
    """Passes 1-3 (`_beams_kernel`, `_clear_kernel`, `_pairs_kernel`): each request's distinct live
    ads under its live beams, with the beam of its best score, when its beams reach at most C
    pairs (none otherwise).

    leaf (B, K) int64 (-1: not a catalog SID), score (B, K) float32 (-inf: dead), both unit stride
    along K; offsets (S+1,) int64 and leaf_ads (P,) int32/int64: the SID -> ad CSR; ad_state (N,)
    uint8 or None (every row live); buf (>= counts x B,) int64 the buffer whose first `counts` x B
    words are the counts (`layout.PostLayout.counts`): writes sids and reached, sets the others to
    0 and adds the ads to generated."""
    B, K = leaf.shape
    dev = leaf.device
    start = torch.empty((B, K), dtype=torch.int64, device=dev)
    held = torch.empty(B, dtype=torch.int64, device=dev)
    _beams_kernel[(B,)](buf, start, held, leaf, score, offsets, B, K, C, leaf.stride(0), score.stride(0),
                        NC=counts, CHUNK=_CHUNK, num_warps=4)
    table = torch.empty((B, 2 * C), dtype=torch.int64, device=dev)
    best = torch.empty((B, 2 * C), dtype=torch.int64, device=dev)
    _clear_kernel[(B, triton.cdiv(2 * C, _CLEAR))](table, best, held, table.stride(0), BLOCK=_CLEAR, num_warps=4)
    pair_ad = torch.empty((B, C), dtype=torch.int64, device=dev)
    pair_cell = torch.empty((B, C), dtype=torch.int64, device=dev)
    _pairs_kernel[(B, triton.cdiv(C, _TILE))](
        pair_ad, pair_cell, buf, table, best, start, held, leaf, score, offsets, leaf_ads,
        ad_state if ad_state is not None else buf, B, K, C, leaf.stride(0), score.stride(0), table.stride(0),
        HAS_STATE=ad_state is not None, LIVE=AD_LIVE, LOG_K=pow2(K).bit_length() - 1, TILE=_TILE, num_warps=_WARPS)
    return Pairs(pair_ad, pair_cell, best)


def expand_triton(layout: PostLayout, arrays: dict[str, torch.Tensor], ad_order: torch.Tensor,
                  steps: dict[str, tuple[int, ...]], requests, beams, max_values: int) -> torch.Tensor:
    """`runtime.ops.expand.expand_beams` as the kernels, the exact filter's and the ranking's sorts
    (same arguments)."""
    B, K, C, T = layout.batch, layout.beams, layout.pairs, layout.kept
    leaf, score, tokens = beams.leaf, beams.score, beams.tokens
    if not (leaf.shape == score.shape == (B, K) and tokens.shape == (B, K, layout.length)
            and leaf.stride(1) == score.stride(1) == 1):
        raise ValueError(f"beams: expected tokens (B, K, L) = {(B, K, layout.length)}, score and leaf (B, K) with unit "
                         f"stride along K; got {tuple(tokens.shape)}, {tuple(score.shape)} strides {score.stride()}, "
                         f"{tuple(leaf.shape)} strides {leaf.stride()}")
    dev = score.device
    a = arrays
    buf = torch.empty(layout.size, dtype=torch.int64, device=dev)
    if not (B and K):
        return buf.zero_()  # no pairs: every count 0, no rows
    pairs = distinct_pairs(leaf, score, a["leaf_ad_offsets"], a["leaf_ads"], a.get("ad_state"), C, buf,
                           len(layout.counts))
    generated = buf[lay.GENERATED * B:(lay.GENERATED + 1) * B]
    passed = torch.stack(exact_filter(a, requests, pairs.ad, steps, max_values, "triton", live=generated))
    passed = passed.view(torch.uint8)  # pair_ad past a request's `generated` is never written: nothing reads it
    packed = torch.empty((B, C), dtype=torch.int64, device=dev)
    value_key = torch.empty((B, C), dtype=torch.int64, device=dev) if layout.rank != "score" else None
    value = a["ad_value"] if layout.has_value else score  # without values, a pointer never read
    grid = (B, triton.cdiv(C, _TILE))
    _keys_kernel[grid](packed, packed if value_key is None else value_key, buf, pairs.ad, pairs.cell, pairs.best,
                       passed, ad_order, value, B, K, C, pairs.best.stride(0),
                       P=len(passed), STAGES=layout.stages, HAS_VALUE_KEY=value_key is not None, TILE=_TILE,
                       num_warps=_WARPS)
    top = rank_slots(packed, value_key, layout.rank, T)
    _rows_kernel[(B, triton.cdiv(T, _TILE))](
        buf, top, pairs.ad, pairs.cell, pairs.best, score, tokens, a["ads"], value,
        B, K, C, T, top.stride(0), pairs.best.stride(0), score.stride(0), tokens.stride(0), tokens.stride(1),
        tokens.stride(2), NC=len(layout.counts), HAS_VALUE=layout.has_value, L=layout.length, F=layout.row_words,
        TILE=_TILE, BB=pow2(B), num_warps=_WARPS)
    return buf
