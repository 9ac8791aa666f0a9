"""The fused CD+GTM mask as a Triton kernel (GRACE 3.5, 4.4).

One program per (beam, block of BLOCK child entries of the beam's trie node); BLOCK follows the
depth's mean fan-out (`launch_shape`), so few lanes idle. Each lane is one child entry: CD is the
entry existing at all; then (GTM) the child's subtree-union bitmask row is tested word by word, a
lane that fails loading nothing more (masked loads); only lanes still alive load Bloom rows, kept in
registers while the request's queries stream past four at a time (ANY query of each attribute),
until every live lane has found one; a block with no live lane skips the stream. With k-way
partitions (KWAY), lanes that pass the union test try their partitions until one passes. A
surviving lane writes beam_score + logp[token] (NaN -> -inf) at its token; every other token stays
-inf. GTM and KWAY are compile-time flags, the Mode's properties. Bits are int64 (the uint64 rows
reinterpreted): & and == are the same.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from sidindex.modes import Mode


@triton.jit
def _row_passes(ok, bm, bl, b, bm_table, bl_table, user_rows, query_rows, query_ranges, bl_woff,
                W_BM: tl.constexpr, W_BL: tl.constexpr, A_BL: tl.constexpr, AW: tl.constexpr,
                QSTEP: tl.constexpr):
    """ok & (bitmask row bm passes user row b) & (Bloom row bl passes every attribute), per lane."""
    for w in tl.static_range(W_BM):
        u = tl.load(user_rows + b * W_BM + w)
        r = tl.load(bm_table + bm * W_BM + w, mask=ok, other=0)
        ok = ok & ((r & u) == u)
    wi = tl.arange(0, AW)
    for a in tl.static_range(A_BL):
        w_lo = tl.load(bl_woff + a)
        wm = wi < tl.load(bl_woff + a + 1) - w_lo
        rows = tl.load(bl_table + bl[:, None] * W_BL + w_lo + wi[None, :], mask=ok[:, None] & wm[None, :], other=0)
        q = tl.load(query_ranges + (b * A_BL + a) * 2)
        q_hi = tl.load(query_ranges + (b * A_BL + a) * 2 + 1)
        hit = tl.zeros_like(ok)
        # stream the queries, QSTEP at a time (independent loads in flight), until every live lane
        # has a hit or none is left to test
        q = tl.where(tl.sum(ok.to(tl.int32), axis=0) > 0, q, q_hi)
        while q < q_hi:
            for i in tl.static_range(QSTEP):
                qw = tl.load(query_rows + (q + i) * W_BL + w_lo + wi, mask=wm & (wi * 0 + q + i < q_hi), other=0)
                need = AW + tl.where(q + i < q_hi, 0, 1)  # past the last query nothing can match
                hit = hit | (tl.sum(((rows & qw[None, :]) == qw[None, :]).to(tl.int32), axis=1) == need)
            left = tl.sum((ok & (hit == 0)).to(tl.int32), axis=0)
            q = tl.where(left > 0, q + QSTEP, q_hi)
        ok = ok & hit
    return ok


@triton.jit
def _gtm_mask_kernel(out, logp, beam_score, beam_node, beam_request,
                     node_offsets, csr_tokens, bm_index, bl_index, bm_table, bl_table,
                     part_offsets, part_bm, part_bl, max_parts,
                     user_rows, query_rows, query_ranges, bl_woff, V,
                     GTM: tl.constexpr, KWAY: tl.constexpr, W_BM: tl.constexpr, W_BL: tl.constexpr,
                     A_BL: tl.constexpr, AW: tl.constexpr, BLOCK: tl.constexpr, QSTEP: tl.constexpr):
    m = tl.program_id(0).to(tl.int64)
    score = tl.load(beam_score + m)
    node = tl.load(beam_node + m)
    lo = tl.load(node_offsets + node)
    hi = tl.where(score > float("-inf"), tl.load(node_offsets + node + 1), lo)  # a dead beam has no children
    e = lo + tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = e < hi
    tok = tl.load(csr_tokens + e, mask=ok, other=0).to(tl.int64)
    if GTM:
        b = tl.load(beam_request + m)
        bm = tl.load(bm_index + e, mask=ok, other=0).to(tl.int64)
        bl = tl.load(bl_index + e, mask=ok, other=0).to(tl.int64)
        ok = _row_passes(ok, bm, bl, b, bm_table, bl_table, user_rows, query_rows, query_ranges, bl_woff,
                         W_BM, W_BL, A_BL, AW, QSTEP)
        if KWAY:
            p_lo = tl.load(part_offsets + e, mask=ok, other=0)
            n_p = tl.load(part_offsets + e + 1, mask=ok, other=0) - p_lo
            any_part = tl.zeros_like(ok)
            k = tl.where(tl.sum(ok.to(tl.int32), axis=0) > 0, 0, max_parts)
            while k < max_parts:  # until each live lane found a passing partition or ran out of them
                has = ok & (k < n_p) & (any_part == 0)
                pbm = tl.load(part_bm + p_lo + k, mask=has, other=0).to(tl.int64)
                pbl = tl.load(part_bl + p_lo + k, mask=has, other=0).to(tl.int64)
                any_part = any_part | _row_passes(has, pbm, pbl, b, bm_table, bl_table, user_rows, query_rows,
                                                  query_ranges, bl_woff, W_BM, W_BL, A_BL, AW, QSTEP)
                left = tl.sum((ok & (any_part == 0) & (k + 1 < n_p)).to(tl.int32), axis=0)
                k = tl.where(left > 0, k + 1, max_parts)
            ok = any_part
    val = score + tl.load(logp + m * V + tok, mask=ok, other=float("-inf"))
    val = tl.where(val == val, val, float("-inf"))  # NaN never passes
    tl.store(out + m * V + tok, val, mask=ok)


def launch_shape(index, depth: int) -> tuple[int, int]:
    """(BLOCK, num_warps) for a depth: a block about the depth's mean fan-out, so few lanes idle,
    and warps to match (a small block on many warps only replicates its lanes)."""
    C = index.max_children[depth]
    block = max(16, min(128, triton.next_power_of_2(C), triton.next_power_of_2(index.mean_children[depth])))
    return block, max(1, min(4, block // 32))


def gtm_mask_triton(index, requests, depth: int, beam_request: torch.Tensor, beam_node: torch.Tensor,
                    beam_score: torch.Tensor, logp: torch.Tensor, mode: Mode,
                    shape: tuple[int, int] | None = None) -> torch.Tensor:
    """Same contract as `gtm_mask_reference`. beam_request, beam_node: (M,) int64; beam_score: (M,)
    float32; logp: (M, V) float32 contiguous. shape: (BLOCK, num_warps), default `launch_shape`."""
    M, V = logp.shape
    out = torch.full((M, V), float("-inf"), dtype=torch.float32, device=logp.device)
    C = index.max_children[depth]
    if M == 0 or C == 0:
        return out
    BLOCK, warps = shape or launch_shape(index, depth)
    g = index.gtm
    woff = index.spec.bloom_layout.word_offsets  # the requests' layout, known on the host
    aw = max([hi - lo for lo, hi in zip(woff, woff[1:])] + [1])
    parts = (g.part_offsets, g.part_bitmask_index, g.part_bloom_index) if mode.kway else (g.node_offsets,) * 3
    _gtm_mask_kernel[(M, triton.cdiv(C, BLOCK))](
        out, logp, beam_score, beam_node, beam_request,
        g.node_offsets, g.csr_tokens, g.bitmask_index, g.bloom_index, g.bitmask_table,
        g.bloom_table, *parts, index.max_parts if mode.kway else 0,
        requests.user_rows, requests.query_rows, requests.query_ranges, requests.word_offsets, V,
        GTM=mode.gtm, KWAY=mode.kway, W_BM=g.bitmask_table.shape[1], W_BL=g.bloom_table.shape[1],
        A_BL=len(woff) - 1, AW=triton.next_power_of_2(aw), BLOCK=BLOCK, QSTEP=4, num_warps=warps)
    return out
