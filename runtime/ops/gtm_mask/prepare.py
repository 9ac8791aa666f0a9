"""What a search works out for its requests before the masks that read it: the query tables of the
tabled groups (`tables`) and each shared row's test (`shared_rows`: the few distinct union rows of
the depths near the root), for every request of the batch, in one launch.

Both are short chains of dependent loads over little data (at 30M SIDs, 16 requests' tables and
depths 0 and 1 with 2 distinct rows each), so a launch of its own costs its chain's time on a cold
cache: 7.5 us for the tables and about 4 us per depth's rows on the H200, against 141 us for a
search's masks. So a search in the compact layout makes them in its first step's mask launch
(`plan`, then `kernel.gtm_mask_triton`'s `prepare`): programs past the mask's run `prepare_block`
beside it, and that step's lanes test their own rows query by query (its depth's union rows near
the root pass at their first queries). Elsewhere (the dense layout, Hugging Face's processor)
`prepared` launches them alone. The shared rows are tested query by query too: they cannot wait
for tables made in the same launch.

Legend: B requests, T tabled groups, J mask words, CH chunks (`tables`), R shared rows.
"""

from __future__ import annotations

import dataclasses

import torch
import triton
import triton.language as tl

from runtime.ops.gtm_mask.planes import GroupLayout, QueryStack, stack_tables
from runtime.ops.gtm_mask.row_pass import ALL, layout_args, plane_pass
from runtime.ops.gtm_mask.shared_rows import SharedRows
from runtime.ops.gtm_mask.tables import NIBBLES, build_table


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


@dataclasses.dataclass(frozen=True)
class Plan:
    """The preparation of a batch: its QueryStack with the outputs allocated (`tables`, `passed`;
    written by the launch that carries the plan) and the shared rows to test (None: none)."""

    stacked: QueryStack
    shared: SharedRows | None

    def launch_args(self, warps: int) -> tuple[dict, int]:
        """`prepare_block`'s arguments other than the stacks' own, as keywords, for programs of
        `warps` warps (blocks of two table entries per thread: more lanes per thread unroll the
        query loop past the registers), and its blocks per request (0: nothing to make)."""
        q, sr = self.stacked, self.shared
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


def plan(stacked: QueryStack, tables: bool = True, shared: SharedRows | None = None) -> Plan:
    """The preparation of the requests of `stacked` (a QueryStack on a device, or CPU tensors under
    the interpreter): tables (B, T, J, CH, 16) int64 of the layout's tabled groups (`tables`; None
    when not asked for or none is tabled; chunks past a group's words are 0) and passed (B, R)
    int8, 1 where the set's shared row i (of any depth of `shared`) passes request b on every group
    of its plane (None without shared rows)."""
    lay = stacked.layout
    tabled = lay.tabled if tables else []
    B = stacked.ranges.shape[0]
    dev = stacked.words.device
    out = None
    if tabled:
        J, CH = lay.table_words, lay.table_chunks
        ragged = any(lay.group_words[g] * NIBBLES < CH for g in tabled)  # else every entry is written
        out = (torch.zeros if ragged else torch.empty)((B, len(tabled), J, CH, 16), dtype=torch.int64, device=dev)
    passed = None if shared is None else torch.empty((B, shared.size), dtype=torch.int8, device=dev)
    ready = dataclasses.replace(stacked, tables=out, passed=passed, passed_rows=None if shared is None else shared.rows)
    return Plan(ready, shared)


def idle_args(x: torch.Tensor) -> dict:
    """`Plan.launch_args` of a launch that prepares nothing (x: any tensor, for pointers never read)."""
    return dict(tab_out=x, pass_out=x, s_rows=x, s_plane=x, R=0, TG=(), TOFF=(0,), PJ=0, PCH=0, TABLE_BLOCK=1,
                ROW_BLOCK=1)


def launch(p: Plan, stack, warps: int = 4) -> None:
    """Make `p`'s outputs in a launch of their own. stack: the index's `planes.TableStack` the
    shared rows are of (any, without them)."""
    args, blocks = p.launch_args(warps)
    if not blocks:
        return
    q = p.stacked
    untabled = {k: v for k, v in layout_args(untabled_layout(q.layout)).items() if k not in ("J", "CH")}
    _prepare_kernel[(blocks, q.ranges.shape[0])](  # requests on the second axis: it has the 65,535 limit
        q_words=q.words, q_base=q.base, q_ranges=q.ranges, words=stack.words, t_base=stack.base, **args,
        **untabled, QSTEP=4, num_warps=warps)


def untabled_layout(lay: GroupLayout) -> GroupLayout:
    """`lay` with every group tested query by query (no tables)."""
    return dataclasses.replace(lay, group_table=(-1,) * len(lay.group_plane), table_words=0)


def prepare(stacked: QueryStack, tables: bool = True, shared: SharedRows | None = None, stack=None) -> QueryStack:
    """`stacked` with its query tables and its test of the shared rows made (`plan`), in one launch.
    stack: the index's `planes.TableStack` the rows are of (needed with shared)."""
    p = plan(stacked, tables, shared)
    launch(p, stack if stack is not None else stacked)
    return p.stacked


def query_tables(stacked: QueryStack) -> torch.Tensor | None:
    """(B, T, J, CH, 16) int64 the query tables of the layout's tabled groups, or None when no
    group is tabled (`prepare` without shared rows)."""
    return prepare(stacked).tables


def index_stack(index, stacked: QueryStack):
    """The `planes.TableStack` the kernels read `index`'s planes through: the served one, or for an
    index served on the CPU (the interpreter's tests) one stacked here, per call."""
    if index.tables is not None:
        return index.tables
    planes = index.gtm.planes
    return stack_tables([p.table for p in planes], [p.index for p in planes],
                        [p.part_index for p in planes] if index.gtm.part_offsets is not None else None,
                        stacked.words.device)


def shared_pass(index, requests, shared: SharedRows, stack=None) -> torch.Tensor:
    """(B, R) int8: 1 where row i of the shared rows' set passes request b on every word group of
    its plane, else 0. requests: EncodedRequests on the index's device; stack: `index_stack`'s,
    where the caller has it (on the CPU it is stacked per call)."""
    stack = stack if stack is not None else index_stack(index, requests.stacked)
    return prepare(requests.stacked, False, shared, stack).passed


def planned(requests, index) -> tuple:
    """(requests, plan): `EncodedRequests` on `index`'s device whose QueryStack holds the outputs
    of `plan` (their query tables and, where the index has shared rows, each one's test), not yet
    made, and that plan, for a mask launch to make them (`kernel.gtm_mask_triton`'s `prepare`)
    before any mask reads them."""
    shared = next((s for s in index.shared_rows if s is not None), None)
    p = plan(requests.stacked, True, shared)
    return dataclasses.replace(requests, stacked=p.stacked), p


def prepared(requests, index):
    """`EncodedRequests` on `index`'s device with what the mask kernels read made for them, in one
    launch of its own (`planned`). A mask of those requests on that index then launches neither."""
    ready, p = planned(requests, index)
    launch(p, index_stack(index, ready.stacked))
    return ready


def passed_for(stacked: QueryStack, shared: SharedRows) -> torch.Tensor | None:
    """The requests' prepared test of `shared`'s set (`prepared`), or None where it was made for
    another set or not at all."""
    return stacked.passed if stacked.passed_rows is shared.rows and stacked.passed is not None else None
