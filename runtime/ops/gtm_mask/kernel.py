"""The fused CD+GTM mask as a Triton kernel (GRACE 3.5, 4.4; docs/kernels.md).

One program per (beam, block of BLOCK child entries of its node), BLOCK following the depth's mean
fan-out (`launch_shape`); each lane is one child entry. CD is the entry existing; GTM is the
matcher planes' test (`row_pass`), compiled for the planes' layout and read through their stacks
(`planes.TableStack`, `planes.QueryStack`), so one kernel serves any set of planes. Groups with
many queries per request are looked up in query tables (`tables`); in the compact layout the
survivors of the untabled groups are packed into full chunks before the lookups (PACK); depths
whose entries share few rows look up results tested once per request (SHARED, `shared_rows`),
which a compact first step makes itself (PREP); with KWAY, lanes that pass the union try their
partitions. A surviving lane writes beam_score + logp[token] (NaN -> -inf) at its token, and with
VALUE its value bound or value-guided key; every other token stays -inf. GTM, KWAY, VALUE and
SHARED are compile-time flags. Why each of these, and what each gained: docs/kernels.md.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from runtime.ops.gtm_mask.reference import NEG_INF, VALUE_FLOOR
from runtime.ops.planes import untabled_layout
from runtime.ops.planes.row_pass import ALL, TABLED, UNTABLED, layout_args, plane_kinds, rows_pass
from runtime.ops.planes.shared_rows import FEW, MOST_ROWS, SharedRows, shared_rows
from runtime.ops.prepare import Plan, index_stack, passed_for, query_tables, shared_pass
from runtime.ops.prepare.kernel import idle_args, launch, launch_args, prepare_block
from runtime.ops.slots import Slots
from runtime.ops.slots.kernel import beam_of_slot
from sidindex.modes import Mode

PACKED_SHAPE = (512, 4, 8)  # (BLOCK, num_warps, queries per round) of a packed compact mask (H200 sweep)
# Lanes (requests x slots) from which a compact mask packs by default. A smaller step (30M SIDs'
# depth 3, 87K lanes: 16.5 against 14.2 us packed) fills about one wave of the GPU and is bound by
# its chain of dependent loads, which packing lengthens; depth 2's 2.8M lanes gain a quarter.
PACK_FROM = 1 << 20


@triton.jit
def _outputs(ok, m, e, tok, score, logp, V, entry_value, part_value, part_offsets, first, weight, floor,
             KWAY: tl.constexpr, VALUE: tl.constexpr):
    """Each lane's value beam_score + logp[tok] (-inf off `ok`, and for NaN) and with VALUE its
    bound or value-guided key (the kernel's docstring; anything without VALUE)."""
    val = score + tl.load(logp + m * V + tok, mask=ok, other=float("-inf"))
    val = tl.where(val == val, val, float("-inf"))  # NaN never passes
    bv = val
    if VALUE > 0:  # 1: the bound; 2: the value-guided key, val + weight * log(max(bound, floor))
        if KWAY:
            bv = tl.load(part_value + tl.load(part_offsets + e, mask=ok, other=0) + first, mask=ok, other=0.0)
        else:
            bv = tl.load(entry_value + e, mask=ok, other=0.0)
        if VALUE == 2:
            bv = tl.where(ok, val + weight * tl.log(tl.maximum(bv, floor)), float("-inf"))
    return val, bv


@triton.jit
def _gtm_mask_kernel(out, logp, beam_score, beam_node, beam_request, node_offsets, csr_tokens,
                     words, t_base, index, E, part_offsets, part_index, T, max_parts,
                     q_words, q_base, q_ranges, tables, tab_stride, V, bound, entry_value, part_value, weight, floor,
                     entry_live, slot_start, slot_total, K, width, shared_lo, shared_local, shared_n, shared_ok,
                     shared_size, scratch, prep_from, tab_out, pass_out, s_rows, s_plane, R,
                     LIVE: tl.constexpr, SHARED: tl.constexpr, GTM: tl.constexpr, KWAY: tl.constexpr,
                     VALUE: tl.constexpr, COMPACT: tl.constexpr, PACK: tl.constexpr, LOG_K: tl.constexpr,
                     WIDTHS: tl.constexpr, SINGLE: tl.constexpr, PKIND: tl.constexpr, GP: tl.constexpr,
                     GLO: tl.constexpr, GW: tl.constexpr, GA: tl.constexpr, GT: tl.constexpr, J: tl.constexpr,
                     CH: tl.constexpr, BLOCK: tl.constexpr, QSTEP: tl.constexpr, LEAD_U: tl.constexpr,
                     LEAD_P: tl.constexpr, PREP: tl.constexpr, TG: tl.constexpr, TOFF: tl.constexpr,
                     PJ: tl.constexpr, PCH: tl.constexpr, TABLE_BLOCK: tl.constexpr, ROW_BLOCK: tl.constexpr):
    prep = False
    if PREP:  # programs past the mask's make what later steps' masks read (`runtime.ops.prepare.kernel.prepare_block`)
        prep = tl.program_id(1) >= prep_from
    if prep:
        prepare_block(tl.program_id(1) - prep_from, tl.program_id(0).to(tl.int64), tab_out, pass_out, q_words,
                      q_base, q_ranges, s_rows, s_plane, R, words, t_base, WIDTHS, SINGLE, GP, GLO, GW, GA, GT, TG,
                      TOFF, PJ, PCH, QSTEP, TABLE_BLOCK, ROW_BLOCK)
    else:
        if COMPACT:  # program (request b, block of slots); a lane is slot s of b's candidate list
            b = tl.program_id(0).to(tl.int64)
            s = tl.program_id(1).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
            real = s < tl.minimum(tl.load(slot_total + b), width)  # past b's last child entry a slot only gets -inf
            m = b * K + beam_of_slot(slot_start + b * K, s, K, real, LOG_K)
            score = tl.load(beam_score + m, mask=real, other=float("-inf"))
            lo = tl.load(node_offsets + tl.load(beam_node + m, mask=real, other=0), mask=real, other=0)
            e = lo + s - tl.load(slot_start + m, mask=real, other=0)
            ok = real & (score > float("-inf"))  # as in the dense path: a dead beam passes nothing
        else:  # program (beam m, block of its node's child entries)
            m = tl.program_id(0).to(tl.int64)
            score = tl.load(beam_score + m)
            node = tl.load(beam_node + m)
            lo = tl.load(node_offsets + node)
            hi = tl.where(score > float("-inf"), tl.load(node_offsets + node + 1), lo)  # a dead beam has no children
            e = lo + tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
            ok = e < hi
            b = tl.load(beam_request + m)
        if PACK == 0:  # (loaded early: the tests hide its latency)
            tok = tl.load(csr_tokens + e, mask=ok, other=0).to(tl.int64)
        if LIVE:  # an update's index: an entry with no live row beneath leads to no ad
            ok = ok & (tl.load(entry_live + e, mask=ok, other=0) != 0)
        tables = tables + b * tab_stride  # request b's query tables
        first = tl.zeros([BLOCK], dtype=tl.int32)  # with KWAY: the position of each lane's first passing partition
        if GTM and SHARED:  # the depth's few distinct rows were tested once per request: look them up
            live = ok & (e >= shared_lo) & (e < shared_lo + shared_n)  # the depth's entries (a caller's node is of it)
            ok = live
            for p in tl.static_range(len(WIDTHS)):  # masked by `live`, not `ok`: every plane's loads in flight at once
                at = tl.load(shared_local + p * shared_n + (e - shared_lo), mask=live, other=0)
                ok = ok & (tl.load(shared_ok + b * shared_size + at, mask=live, other=0) != 0)
        elif PACK > 0:  # (GTM) the untabled groups first; the tabled ones on their survivors, packed
            ok = rows_pass(ok, index, E, e, b, words, t_base, q_words, q_base, q_ranges, tables,
                           WIDTHS, SINGLE, PKIND, GP, GLO, GW, GA, GT, J, CH, QSTEP, LEAD_U, UNTABLED)
            # 1. the lanes that failed are written now
            tl.store(out + b * width + s, float("-inf"), mask=(s < width) & ~ok)
            if VALUE > 0:
                tl.store(bound + b * width + s, 0.0 if VALUE == 1 else float("-inf"), mask=(s < width) & ~ok)
            # 2. the survivors' entries and (beam, slot) side by side in the program's scratch, so that
            # the lookups run on full chunks of PACK lanes rather than on every warp holding one
            n = tl.sum(ok.to(tl.int32), axis=0)
            at = tl.cumsum(ok.to(tl.int32), axis=0) - 1
            own = scratch + (tl.program_id(0).to(tl.int64) * tl.num_programs(1) + tl.program_id(1)) * (2 * BLOCK)
            tl.store(own + at, e, mask=ok)
            tl.store(own + BLOCK + at, (m << 32) | s, mask=ok)
            tl.debug_barrier()
            # 3. chunk by chunk, the tabled groups' test and the survivors' outputs
            for c in range(0, n, PACK):
                i = c + tl.arange(0, PACK)
                live = i < n
                pe = tl.load(own + i, mask=live, other=0)
                ms = tl.load(own + BLOCK + i, mask=live, other=0)
                pm, ps = ms >> 32, ms & 0xFFFFFFFF
                hit = rows_pass(live, index, E, pe, b, words, t_base, q_words, q_base, q_ranges, tables,
                                WIDTHS, SINGLE, PKIND, GP, GLO, GW, GA, GT, J, CH, QSTEP, LEAD_U, TABLED)
                val, bv = _outputs(hit, pm, pe, tl.load(csr_tokens + pe, mask=hit, other=0).to(tl.int64),
                                   tl.load(beam_score + pm, mask=hit, other=0.0), logp, V, entry_value, part_value,
                                   part_offsets, 0, weight, floor, KWAY, VALUE)
                tl.store(out + b * width + ps, tl.where(hit, val, float("-inf")), mask=live)
                if VALUE > 0:
                    tl.store(bound + b * width + ps, bv, mask=live)
        elif GTM:
            ok = rows_pass(ok, index, E, e, b, words, t_base, q_words, q_base, q_ranges, tables,
                           WIDTHS, SINGLE, PKIND, GP, GLO, GW, GA, GT, J, CH, QSTEP, LEAD_U, ALL)
        if GTM and KWAY:
            p_lo = tl.load(part_offsets + e, mask=ok, other=0)
            n_p = tl.load(part_offsets + e + 1, mask=ok, other=0) - p_lo
            any_part = tl.zeros_like(ok)
            k = tl.where(tl.sum(ok.to(tl.int32), axis=0) > 0, 0, max_parts)
            while k < max_parts:  # until each live lane found a passing partition or ran out of them
                has = ok & (k < n_p) & (any_part == 0)
                hit = rows_pass(has, part_index, T, p_lo + k, b, words, t_base, q_words, q_base, q_ranges, tables,
                                WIDTHS, SINGLE, PKIND, GP, GLO, GW, GA, GT, J, CH, QSTEP, LEAD_P, ALL)
                if VALUE > 0:  # the largest value that passes (an entry's partitions fall in value)
                    first = tl.where(hit, k, first)
                any_part = any_part | hit
                left = tl.sum((ok & (any_part == 0) & (k + 1 < n_p)).to(tl.int32), axis=0)
                k = tl.where(left > 0, k + 1, max_parts)
            ok = any_part
        if PACK == 0:  # (packed lanes were written chunk by chunk)
            val, bv = _outputs(ok, m, e, tok, score, logp, V, entry_value, part_value, part_offsets, first, weight,
                               floor, KWAY, VALUE)
            if COMPACT:  # every slot is written: no fill beforehand
                tl.store(out + b * width + s, tl.where(ok, val, float("-inf")), mask=s < width)
                if VALUE > 0:
                    tl.store(bound + b * width + s, bv, mask=s < width)
            else:
                tl.store(out + m * V + tok, val, mask=ok)
                if VALUE > 0:
                    tl.store(bound + m * V + tok, bv, mask=ok)


def launch_shape(index, depth: int) -> tuple[int, int]:
    """(BLOCK, num_warps) for a depth: a block about the depth's mean fan-out, so few lanes idle,
    and warps to match (a small block on many warps only replicates its lanes)."""
    C = index.max_children[depth]
    block = max(16, min(128, triton.next_power_of_2(C), triton.next_power_of_2(index.mean_children[depth])))
    return block, max(1, min(4, block // 32))


def compact_shape(depth: int, mode: Mode, packed: bool = False, shared: bool = False) -> tuple[int, int, int]:
    """(BLOCK, num_warps, queries per round) of the compact layout, from the H200 sweep of
    `bench/bench_search.py --sweep` at 10M SIDs: slots are packed, so blocks of 128 lanes idle
    little; with k-way a block waits for its slowest lane's partitions, so blocks of one warp win;
    shallow unions are nearly full (a lane hits at its first queries: few per round), deeper ones
    miss more (more queries per round keep more loads in flight). From the sweeps at 30M SIDs: a
    packed mask (`packs`) runs blocks of 512 lanes on 4 warps (depth 2: 66 against 90 us unpacked,
    about one lane in ten surviving into chunks of 128), and one looking shared rows up (`shared`),
    blocks of 256 on 2 warps (depth 1: 57-61 against 63-70 us)."""
    if mode.kway:
        return 32, 1, 4
    if packed:
        return PACKED_SHAPE
    if shared:
        return 256, 2, 4  # (no query is streamed)
    return 128, 4, 2 if depth <= 1 else 8


def packs(mode: Mode, shared: SharedRows | None, lay, lanes: int, pack: bool | None = None) -> bool:
    """Whether a compact mask of `lanes` (requests x slots) tests the groups tabled in `lay`
    (`planes.GroupLayout`) only on the lanes that passed the others, packed. It can in a GTM mode
    without k-way or shared rows, with some groups tabled and some not; then pack None: from
    PACK_FROM lanes, True: always, False: never."""
    if not (mode.gtm and not mode.kway and shared is None and len({t >= 0 for t in lay.group_table}) == 2):
        return False
    return lanes >= PACK_FROM if pack is None else pack


def table_leads(depth: int) -> tuple[int, int]:
    """Queries streamed before a tabled group's lookups, (unions, k-way partitions), from the same
    sweep. At depth 1 (millions of child entries, each union the OR of a few thousand ads) nearly
    every lane hits within its first queries, so the lookups only serve the lanes those missed;
    deeper unions and the partitions (a few ads' rows each) mostly miss and go straight to their
    table, and the root's step is too small for either to matter."""
    return (8 if depth == 1 else 0), 0


def gtm_mask_triton(index, requests, depth: int, beam_request: torch.Tensor, beam_node: torch.Tensor,
                    beam_score: torch.Tensor, logp: torch.Tensor, mode: Mode, with_bound: bool = False,
                    value_weight: float = 0.0, shape: tuple[int, int] | None = None, slots: Slots | None = None,
                    qstep: int | None = None, tabled: bool = True, leads: tuple[int, int] | None = None,
                    shared: bool | None = None, pack: bool | None = None, prepare: Plan | None = None):
    """Same contract as `gtm_mask_reference`. beam_request, beam_node: (M,) int64; beam_score: (M,)
    float32; logp: (M, V) float32 contiguous. shape: (BLOCK, num_warps), default `launch_shape`
    (`compact_shape` with slots); qstep: queries tested per round of a group tested query by query
    (default 4, or `compact_shape`'s with slots); tabled: test the groups the request layout tables
    by their query tables (`requests.stacked.tables`, else made here), else query by query; leads:
    queries streamed before the lookups, (unions, partitions) (default `table_leads`). With `slots`
    (`slots.Slots` of the M = B*K beams, request-major), the outputs are (B, slots.width) in that
    layout instead (`slots.compact` of the dense ones). shared: test the depth's distinct union rows
    once per request and look them up (`shared_rows`): None where the index has them
    (`ServedIndex.shared_rows`; an index served on the CPU makes them here, per call), True always,
    False never. With shared rows a beam whose node is not of `depth` passes nothing (the contract
    has it of `depth`). pack: with slots, test the groups tested by table lookups only on the lanes
    that passed the others, packed into full chunks of 32 x num_warps (`compact_shape`'s packed
    shape), where that applies (`packs`): None for steps of PACK_FROM lanes or more, True always,
    False never. prepare: with slots, a `prepare.Plan` of `requests` (`prepare.planned`) whose
    outputs programs past the mask's make in the same launch; the mask itself then tests every
    group query by query and its lanes' own rows (it cannot read what the launch makes)."""
    if prepare is not None and slots is None:
        raise ValueError("a mask launch prepares only in the compact layout (slots)")
    M, V = logp.shape
    value = 2 if value_weight > 0 else 1 if with_bound else 0
    if slots is None:
        out = torch.full((M, V), NEG_INF, dtype=torch.float32, device=logp.device)
        extra = None if not value else torch.full((M, V), 0.0 if value == 1 else NEG_INF, dtype=torch.float32,
                                                  device=logp.device)
        C = index.max_children[depth]
        if M == 0 or C == 0:
            return out if extra is None else (out, extra)
        BLOCK, warps = shape or launch_shape(index, depth)
        qstep = qstep or 4
        grid = (M, triton.cdiv(C, BLOCK))
        start, total, K, width = beam_node, beam_node, 1, 0  # unread
    else:
        B, K = slots.start.shape
        width = slots.width
        out = torch.empty((B, width), dtype=torch.float32, device=logp.device)  # the kernel writes every slot
        extra = None if not value else torch.empty((B, width), dtype=torch.float32, device=logp.device)
        if B == 0 or width == 0:
            if prepare is not None:
                launch(prepare.stacked, prepare.shared, index_stack(index, requests.stacked))
            return out if extra is None else (out, extra)
        start, total = slots.start, slots.total
    if prepare is not None:  # (its tables and shared rows are not made yet)
        tabled, shared = False, False
    g, q, kway = index.gtm, requests.stacked, mode.kway
    t, tab, lay = _stacks(index, requests, mode.gtm and tabled)
    lead_u, lead_p = leads or table_leads(depth)
    sr = _shared(index, depth, shared) if mode.gtm else None
    passed = None if sr is None else passed_for(q, sr)
    if sr is not None and passed is None:  # requests not `prepare.prepared` for this index
        passed = shared_pass(index, requests, sr, t)
    packed = slots is not None and packs(mode, sr, lay, B * width, pack)
    if slots is not None:
        BLOCK, warps, chosen = compact_shape(depth, mode, packed, sr is not None)
        BLOCK, warps = shape or (BLOCK, warps)
        qstep = qstep or chosen
        grid = (B, triton.cdiv(width, BLOCK))
    prep_from, prep = grid[1], idle_args(out)
    if prepare is not None:  # `prepare_block` on programs past the mask's
        prep, blocks = launch_args(prepare.stacked, prepare.shared, warps)
        grid = (B, grid[1] + blocks)
    # with packing, each program's survivors: BLOCK entries, then BLOCK (beam << 32 | slot)
    scratch = torch.empty(grid[0] * grid[1] * 2 * BLOCK, dtype=torch.int64, device=logp.device) if packed else out
    _gtm_mask_kernel[grid](
        out, logp, beam_score, beam_node, beam_request, g.node_offsets, g.csr_tokens,
        t.words, t.base, t.index, t.index.shape[1], g.part_offsets if kway else g.node_offsets,
        t.part_index if kway else t.index, t.part_index.shape[1] if kway else 0, index.max_parts if kway else 0,
        q.words, q.base, q.ranges, q.words if tab is None else tab, 0 if tab is None else tab.stride(0),
        V, out if extra is None else extra, g.entry_value if value else out,
        g.part_value if value and kway else out, float(value_weight), VALUE_FLOOR,
        g.node_offsets if g.entry_live is None else g.entry_live, start, total, K, width,
        0 if sr is None else sr.lo, g.node_offsets if sr is None else sr.local, 0 if sr is None else sr.local.shape[1],
        g.node_offsets if sr is None else passed, 0 if sr is None else sr.size, scratch, prep_from,
        **prep, PREP=grid[1] > prep_from,
        LIVE=g.entry_live is not None, SHARED=sr is not None, GTM=mode.gtm, KWAY=kway, VALUE=value,
        COMPACT=slots is not None, PACK=32 * warps if packed else 0, LOG_K=max(1, (K - 1).bit_length()),
        PKIND=plane_kinds(lay), **layout_args(lay), BLOCK=BLOCK, QSTEP=qstep,
        LEAD_U=lead_u, LEAD_P=lead_p, num_warps=warps)
    return out if extra is None else (out, extra)


def _stacks(index, requests, tabled: bool):
    """What the kernels read the planes and queries through: the index's `planes.TableStack`, the
    requests' query tables (None: every group tested query by query) and the group layout to match."""
    q = requests.stacked
    tab = (q.tables if q.tables is not None else query_tables(q)) if tabled else None
    return index_stack(index, q), tab, q.layout if tab is not None else untabled_layout(q.layout)


def _shared(index, depth: int, shared: bool | None) -> SharedRows | None:
    """The shared rows a mask of `depth` uses (`gtm_mask_triton`'s `shared`)."""
    if shared is False:
        return None
    if shared is None and index.shared_rows:
        return index.shared_rows[depth]
    return shared_rows(index.gtm, *((0, 1 << 62) if shared else (FEW, MOST_ROWS)), only=depth)[depth]
