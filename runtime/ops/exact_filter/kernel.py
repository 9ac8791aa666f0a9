"""The exact ad-level filter as Triton kernels: one launch per matcher plane.

One program per (request b, block of BLOCK slots); b is uniform in a program, so the request's
queries and values are scalars every lane shares. Each lane is one slot, its ad clamped into the
catalog (a slot that is not valid reads a real row; the caller masks it).
  rows    word group by word group, the matcher kernel's group test (`planes.row_pass.group_pass`,
          the one copy of "ANY query q has (row & q) == q"): a lane's words of the group stay in
          registers while the request's queries stream past, until every live lane has a hit
  values  attribute by attribute, the request's values stream past (a scalar loop to the request's
          own count); each lane binary-searches the value in its ad's sorted hashes in the
          attribute's fixed number of steps (`runtime.index.served.PostBounds.steps`), compared as uint64, until every
          live lane found one; an ad with no values passes, a lane that failed an attribute loads
          nothing more
With `live` counts (HAS_LIVE), a request's slots past its count are False and load nothing: a block
past them only stores. Bits are int64 (the uint64 words reinterpreted): & and == are the same; only the hashes' order
needs the unsigned view.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from runtime.ops.exact_filter.reference import held_slots
from runtime.ops.planes.row_pass import group_pass
from schemas.artifacts import EXACT_FORM, EXACT_ROWS, MATCHER_PLANES, plane_arrays

BLOCK, WARPS = 128, 4  # slots per program: a request's C slots are many (C >= 1,024 at 1,024 beams)
QSTEP = 4  # queries per round of a rows group (independent loads in flight)


@triton.jit
def _rows_kernel(out, ad, held, words, q_words, q_ranges, C, N, s_ad, s_rb, s_rg,
                 W: tl.constexpr, QW: tl.constexpr, SINGLE: tl.constexpr, GLO: tl.constexpr, GW: tl.constexpr,
                 GA: tl.constexpr, HAS_LIVE: tl.constexpr, BLOCK: tl.constexpr, QSTEP: tl.constexpr):
    """out[b, c] = ad[b, c]'s row words (N, W) passes request b's queries (rows QW words apart,
    ranges (B, G, 2) with strides s_rb, s_rg, 1) on every word group (first word, words, words
    rounded up to a power of 2); with HAS_LIVE only for c < held[b]."""
    b = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    real = c < C
    ok = _held(real, c, held, b, HAS_LIVE)
    r = tl.load(ad + b * s_ad + c, mask=ok, other=0)
    row = words + tl.minimum(tl.maximum(r, 0), N - 1) * W
    for g in tl.static_range(len(GLO)):
        ok = group_pass(ok, row, q_words, q_ranges + b * s_rb + g * s_rg, q_words, QW, GLO[g], GW[g], GA[g], SINGLE,
                         QSTEP, False, 0, 0, 0)  # no query table: a pair's ad is one row
    tl.store(out + b * C + c, ok, mask=real)


@triton.jit
def _held(real, c, held, b, HAS_LIVE: tl.constexpr):
    """real & (slot c holds a pair: c < held[b], the `live` counts) with HAS_LIVE, else real."""
    if HAS_LIVE:
        real = real & (c < tl.load(held + b))
    return real


@triton.jit
def _lower_bound(hashes, lo, hi, want, live, STEPS: tl.constexpr):
    """Per lane the first position in hashes[lo:hi] (sorted as uint64) whose hash is not below
    `want` (uint64), in STEPS halvings (enough for hi - lo < 2**STEPS); lanes not `live` load nothing."""
    base, size = lo, hi - lo
    for _ in tl.static_range(STEPS):
        half = size // 2
        x = tl.load(hashes + base + half, mask=live & (size > 0), other=0).to(tl.uint64, bitcast=True)
        go = (x < want) & (size > 0)
        base = tl.where(go, base + half + 1, base)
        size = tl.where(go, size - half - 1, half)  # half is 0 when size is
    return base


@triton.jit
def _values_kernel(out, ad, held, ad_off, hashes, req_off, req_hashes, C, N, s_ad, s_qa, s_qb,
                   STEPS: tl.constexpr, HAS_LIVE: tl.constexpr, BLOCK: tl.constexpr):
    """out[b, c] = for every attribute a, ad ad[b, c] has no hashes (ad_off (A, N+1) into hashes,
    sorted as uint64) or one of request b's (req_off (A, B+1) with strides s_qa, s_qb into
    req_hashes) is among them; STEPS[a] binary-search steps cover the most hashes an ad has; with
    HAS_LIVE only for c < held[b]."""
    b = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    real = c < C
    ok = _held(real, c, held, b, HAS_LIVE)
    r = tl.minimum(tl.maximum(tl.load(ad + b * s_ad + c, mask=ok, other=0), 0), N - 1)
    for a in tl.static_range(len(STEPS)):
        lo = tl.load(ad_off + tl.cast(N + 1, tl.int64) * a + r, mask=ok, other=0)
        hi = tl.load(ad_off + tl.cast(N + 1, tl.int64) * a + r + 1, mask=ok, other=0)
        found = hi == lo  # unrestricted on a
        j = tl.load(req_off + a * s_qa + b * s_qb)
        end = tl.load(req_off + a * s_qa + (b + 1) * s_qb)
        # until every live lane found one of the request's values, or none is left to try
        j = tl.where(tl.sum((ok & (found == 0)).to(tl.int32), axis=0) > 0, j, end)
        while j < end:
            want = tl.load(req_hashes + j).to(tl.uint64, bitcast=True)
            live = ok & (found == 0)
            base = _lower_bound(hashes, lo, hi, want, live, STEPS[a])
            inside = live & (base < hi)
            x = tl.load(hashes + base, mask=inside, other=0).to(tl.uint64, bitcast=True)
            found = found | (inside & (x == want))
            left = tl.sum((ok & (found == 0)).to(tl.int32), axis=0)
            j = tl.where(left > 0, j + 1, end)
        ok = ok & found
    tl.store(out + b * C + c, ok, mask=real)


def exact_filter_triton(arrays: dict[str, torch.Tensor], requests, ad: torch.Tensor,
                        steps: dict[str, tuple[int, ...]], live: torch.Tensor | None = None) -> list[torch.Tensor]:
    """Same contract as `runtime.ops.exact_filter.exact_filter` (without its static query bound: the
    kernels loop to each request's own counts). ad: (B, C) int64 with unit stride along C."""
    if ad.dtype != torch.int64 or ad.dim() != 2 or (ad.shape[1] > 1 and ad.stride(1) != 1):
        raise ValueError(f"ad: expected (B, C) int64 with unit stride along C, got {tuple(ad.shape)} {ad.dtype} "
                         f"strides {ad.stride()}")
    B, C = ad.shape
    grid = (B, triton.cdiv(C, BLOCK))
    has_live = live is not None
    held = live if has_live else ad  # without counts, a pointer the kernels never read

    out = []
    for p, q, ex in zip(MATCHER_PLANES, requests.planes, requests.exact):
        if EXACT_FORM[p] == EXACT_ROWS:
            woff = [int(w) for w in q.word_offsets]
            if not (B and C and len(woff) > 1):  # a plane without attributes passes every ad (static)
                out.append(held_slots(live, B, C, ad.device))  # every slot holding a pair, no launch
                continue
            passed = torch.empty((B, C), dtype=torch.bool, device=ad.device)  # the kernel writes every slot
            rows, q_rows = arrays[plane_arrays(p).exact_rows].contiguous(), q.rows.contiguous()
            ranges = q.ranges if q.ranges.stride(2) == 1 else q.ranges.contiguous()
            _rows_kernel[grid](
                passed, ad, held, rows, q_rows, ranges, C, len(rows), ad.stride(0), ranges.stride(0), ranges.stride(1),
                W=rows.shape[1], QW=q_rows.shape[1], SINGLE=bool(q.single), GLO=tuple(woff[:-1]),
                GW=tuple(hi - lo for lo, hi in zip(woff[:-1], woff[1:])),
                GA=tuple(triton.next_power_of_2(max(hi - lo, 1)) for lo, hi in zip(woff[:-1], woff[1:])),
                HAS_LIVE=has_live, BLOCK=BLOCK, QSTEP=QSTEP, num_warps=WARPS)
        else:
            hashes, ad_off = arrays[plane_arrays(p).exact_hashes], arrays[plane_arrays(p).exact_hash_offsets]
            if not (B and C and len(hashes)):  # no hashes: no ad restricted on any attribute (static)
                out.append(held_slots(live, B, C, ad.device))  # every slot holding a pair, no launch
                continue
            passed = torch.empty((B, C), dtype=torch.bool, device=ad.device)
            A = len(steps[p])
            _values_kernel[grid](
                passed, ad, held, ad_off.contiguous(), hashes.contiguous(), ex.hash_offsets, ex.hashes.contiguous(),
                C, len(ad_off) // A - 1, ad.stride(0), ex.hash_offsets.stride(0), ex.hash_offsets.stride(1),
                STEPS=tuple(steps[p]), HAS_LIVE=has_live, BLOCK=BLOCK, num_warps=WARPS)
        out.append(passed)
    return out
