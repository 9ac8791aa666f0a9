"""The preparation's Triton kernel (`prepare`: what it makes, for which requests, and why a
search's first mask launch carries it): `prepare_block` makes one block of a request's query
tables or shared rows' tests, alone (`launch`) or in programs past a mask's (`gtm_mask.kernel`).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from runtime.ops.planes import NIBBLES, QueryStack, untabled_layout
from runtime.ops.planes.row_pass import ALL, layout_args, plane_pass
from runtime.ops.planes.shared_rows import SharedRows
from runtime.ops.planes.tables import build_table


@triton.jit
def prepare_block(i, b, tab_out, pass_out, q_words, q_base, q_ranges, s_rows, s_plane, R, words, t_base,
                  WIDTHS: tl.constexpr, SINGLE: tl.constexpr, GP: tl.constexpr, GLO: tl.constexpr,
                  GW: tl.constexpr, GA: tl.constexpr, GT: tl.constexpr, TG: tl.constexpr, TOFF: tl.constexpr,
                  PJ: tl.constexpr, PCH: tl.constexpr, QSTEP: tl.constexpr, TABLE_BLOCK: tl.constexpr,
                  ROW_BLOCK: tl.constexpr):
    """Block i of request b's preparation: i < TOFF[-1] a block of table TG's entries (table t's
    blocks are TOFF[t]..TOFF[t+1]-1, group TG[t]; PJ mask words, PCH chunks), beyond that a block of
    ROW_BLOCK shared rows, each tested against request b on every word group of its plane, query by
    query (the layout's GT all -1)."""
    G: tl.constexpr = len(GP)
    if i < TOFF[len(TG)]:
        for t in tl.static_range(len(TG)):
            if (i >= TOFF[t]) & (i < TOFF[t + 1]):
                build_table(tab_out, q_words, q_base, q_ranges, b, G, TG[t], GP[TG[t]], t, len(TG), i - TOFF[t],
                            WIDTHS[GP[TG[t]]], GLO[TG[t]], GW[TG[t]] * 256, PJ, PCH, TABLE_BLOCK)  # 16 x 16 a word
    else:
        k = (i - TOFF[len(TG)]) * ROW_BLOCK + tl.arange(0, ROW_BLOCK)
        live = k < R
        r = tl.load(s_rows + k, mask=live, other=0).to(tl.int64)
        pl = tl.load(s_plane + k, mask=live, other=-1)
        hit = tl.zeros([ROW_BLOCK], dtype=tl.int1)
        for p in tl.static_range(len(WIDTHS)):
            hit = hit | plane_pass(live & (pl == p), r, p, b, words, t_base, q_words, q_base, q_ranges, q_words,
                                   WIDTHS, SINGLE, GP, GLO, GW, GA, GT, 0, 0, QSTEP, 0, ALL)
        tl.store(pass_out + b * R + k, hit.to(tl.int8), mask=live)


@triton.jit
def _prepare_kernel(tab_out, pass_out, q_words, q_base, q_ranges, s_rows, s_plane, R, words, t_base,
                    WIDTHS: tl.constexpr, SINGLE: tl.constexpr, GP: tl.constexpr, GLO: tl.constexpr,
                    GW: tl.constexpr, GA: tl.constexpr, GT: tl.constexpr, TG: tl.constexpr, TOFF: tl.constexpr,
                    PJ: tl.constexpr, PCH: tl.constexpr, QSTEP: tl.constexpr, TABLE_BLOCK: tl.constexpr,
                    ROW_BLOCK: tl.constexpr):
    """Program (block i, request b): `prepare_block` alone."""
    prepare_block(tl.program_id(0), tl.program_id(1).to(tl.int64), tab_out, pass_out, q_words, q_base, q_ranges,
                  s_rows, s_plane, R, words, t_base, WIDTHS, SINGLE, GP, GLO, GW, GA, GT, TG, TOFF, PJ, PCH, QSTEP,
                  TABLE_BLOCK, ROW_BLOCK)



def launch_args(stacked: QueryStack, shared: SharedRows | None, warps: int) -> tuple[dict, int]:
    """`prepare_block`'s arguments other than the stacks' own, as keywords, to make a `prepare.Plan`'s
    outputs (`stacked`'s tables and passed, for the rows of `shared`) in programs of `warps` warps
    (blocks of two table entries per thread: more lanes per thread unroll the query loop past the
    registers), and its blocks per request (0: nothing to make)."""
    q, sr = stacked, shared
    lay = q.layout
    tabled = lay.tabled if q.tables is not None else []
    table_block, row_block = 64 * warps, 32 * warps
    toff = [0]
    for g in tabled:
        toff.append(toff[-1] + triton.cdiv(lay.group_words[g] * NIBBLES * 16, table_block))
    blocks = toff[-1] + (0 if sr is None else triton.cdiv(sr.size, row_block))
    none = q.words  # any pointer, for what the launch does not read
    args = dict(tab_out=none if q.tables is None else q.tables, pass_out=none if q.passed is None else q.passed,
                s_rows=none if sr is None else sr.rows, s_plane=none if sr is None else sr.plane,
                R=0 if sr is None else sr.size, TG=tuple(tabled), TOFF=tuple(toff),
                PJ=lay.table_words if tabled else 0, PCH=lay.table_chunks if tabled else 0,
                TABLE_BLOCK=table_block, ROW_BLOCK=row_block)
    return args, blocks if len(q.ranges) else 0


def idle_args(x: torch.Tensor) -> dict:
    """`launch_args` of a launch that prepares nothing (x: any tensor, for pointers never read)."""
    return dict(tab_out=x, pass_out=x, s_rows=x, s_plane=x, R=0, TG=(), TOFF=(0,), PJ=0, PCH=0, TABLE_BLOCK=1,
                ROW_BLOCK=1)


def launch(stacked: QueryStack, shared: SharedRows | None, stack, warps: int = 4) -> None:
    """Make a `prepare.Plan`'s outputs (its `stacked` and `shared`) in a launch of their own.
    stack: the index's `planes.TableStack` the shared rows are of (any, without them)."""
    args, blocks = launch_args(stacked, shared, warps)
    if not blocks:
        return
    q = stacked
    untabled = {k: v for k, v in layout_args(untabled_layout(q.layout)).items() if k not in ("J", "CH")}
    _prepare_kernel[(blocks, q.ranges.shape[0])](  # requests on the second axis: it has the 65,535 limit
        q_words=q.words, q_base=q.base, q_ranges=q.ranges, words=stack.words, t_base=stack.base, **args,
        **untabled, QSTEP=4, num_warps=warps)
