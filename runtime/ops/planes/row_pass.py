"""The matcher planes' test as the Triton kernels run it (`sidindex.matchers.plane`): a lane's row
of each plane against its request's queries, word group by word group, compiled for the planes'
layout (`planes.GroupLayout`, as constexpr tuples). The mask (`gtm_mask.kernel`) runs it on each lane's own
rows, `prepare` on the shared rows of a search's requests.

A plane with one query per request (bitmask) is tested word by word, a lane that failed loading
nothing more (masked loads), and no lane loading a word the query has no bit in (a request's one
country is one word of the four); otherwise a lane keeps its row's words of the group in registers
while the request's queries stream past a few at a time, until every live lane has a hit; a block
with no live lane skips the stream. A tabled group (`tables`) streams only its first LEAD queries
and then looks the rest up.
"""

from __future__ import annotations

import triton
import triton.language as tl

from runtime.ops.planes.tables import table_pass

# which word groups `plane_pass` tests (bits: a plane's kinds of groups, `plane_kinds`)
UNTABLED = tl.constexpr(1)
TABLED = tl.constexpr(2)
ALL = tl.constexpr(3)


@triton.jit
def group_pass(ok, row, q_lo, q_range, tab, W: tl.constexpr, W_LO: tl.constexpr, N_W: tl.constexpr,
               A_W: tl.constexpr, ONE: tl.constexpr, QSTEP: tl.constexpr, TABLED: tl.constexpr, LEAD: tl.constexpr,
               J: tl.constexpr, CH: tl.constexpr):
    """ok & (each lane's `row` passes ANY of the queries q_range[0]..q_range[1]-1 on the group's
    words W_LO..W_LO+N_W-1); rows and queries are W words wide, A_W is N_W rounded up to a power of 2.
    TABLED: `tab` is the group's query table (J mask words, CH chunks): the first LEAD queries are
    streamed, and lanes without a hit then look the group up in the table."""
    q = tl.load(q_range)
    if ONE:  # one query: word by word, a lane that failed loads nothing more, nor a word the query has no bit in
        for w in tl.static_range(N_W):
            u = tl.load(q_lo + q * W + W_LO + w)
            x = tl.load(row + W_LO + w, mask=tl.where(u != 0, ok, tl.zeros_like(ok)), other=0)
            ok = ok & ((x & u) == u)
    else:  # ANY query: the rows' words stay in registers while the queries stream past
        hit = tl.zeros_like(ok)
        if not TABLED or LEAD > 0:
            wi = tl.arange(0, A_W)
            wm = wi < N_W
            rows = tl.load(row[:, None] + W_LO + wi[None, :], mask=ok[:, None] & wm[None, :], other=0)
            q_end = tl.load(q_range + 1)
            if TABLED:
                q_end = tl.minimum(q_end, q + LEAD)
            # QSTEP queries at a time (independent loads in flight), until every live lane has a hit
            # or none is left to stream
            q = tl.where(tl.sum(ok.to(tl.int32), axis=0) > 0, q, q_end)
            while q < q_end:
                for i in tl.static_range(QSTEP):
                    qw = tl.load(q_lo + (q + i) * W + W_LO + wi, mask=wm & (wi * 0 + q + i < q_end), other=0)
                    need = A_W + tl.where(q + i < q_end, 0, 1)  # past the last query nothing can match
                    hit = hit | (tl.sum(((rows & qw[None, :]) == qw[None, :]).to(tl.int32), axis=1) == need)
                left = tl.sum((ok & (hit == 0)).to(tl.int32), axis=0)
                q = tl.where(left > 0, q + QSTEP, q_end)
        if TABLED:
            rest = ok & (hit == 0)
            if tl.sum(rest.to(tl.int32), axis=0) > 0:
                hit = hit | table_pass(rest, row, tab, W_LO, N_W, J, CH)
        ok = ok & hit
    return ok


@triton.jit
def plane_pass(ok, r, p: tl.constexpr, b, words, t_base, q_words, q_base, q_ranges, tables,
               WIDTHS: tl.constexpr, SINGLE: tl.constexpr, GP: tl.constexpr, GLO: tl.constexpr,
               GW: tl.constexpr, GA: tl.constexpr, GT: tl.constexpr, J: tl.constexpr, CH: tl.constexpr,
               QSTEP: tl.constexpr, LEAD: tl.constexpr, KIND: tl.constexpr):
    """ok & (each lane's row r (int64) of plane p passes request b on every word group of the
    plane, or only on its groups of KIND: ALL, UNTABLED or TABLED). `tables`: request b's query
    tables (`prepare.query_tables`: per tabled group J mask words x CH chunks x 16). Layout tuples
    (`planes.GroupLayout`): per plane its width and whether it has one query per group; per group
    its plane, first word, words, words rounded up to a power of two, and its table (-1: tested
    query by query); LEAD: queries streamed before a tabled group's lookups."""
    G: tl.constexpr = len(GP)
    row = words + tl.load(t_base + p) + r * WIDTHS[p]  # each lane's row of plane p
    q_lo = q_words + tl.load(q_base + p)
    for g in tl.static_range(G):
        if GP[g] == p and (KIND == ALL or (KIND == TABLED) == (GT[g] >= 0)):  # resolved at compile time
            ok = group_pass(ok, row, q_lo, q_ranges + (b * G + g) * 2, tables + GT[g] * (J * CH * 16),
                             WIDTHS[p], GLO[g], GW[g], GA[g], SINGLE[p], QSTEP, GT[g] >= 0, LEAD, J, CH)
    return ok


@triton.jit
def rows_pass(ok, idx, stride, pos, b, words, t_base, q_words, q_base, q_ranges, tables,
              WIDTHS: tl.constexpr, SINGLE: tl.constexpr, PKIND: tl.constexpr, GP: tl.constexpr, GLO: tl.constexpr,
              GW: tl.constexpr, GA: tl.constexpr, GT: tl.constexpr, J: tl.constexpr, CH: tl.constexpr,
              QSTEP: tl.constexpr, LEAD: tl.constexpr, KIND: tl.constexpr):
    """ok & (each lane's rows pass request b on every plane's groups of KIND, `plane_pass`). A
    lane's row of plane p is idx[p * stride + pos]; a plane without a group of KIND (PKIND[p], bits
    of the kinds it has) is not read."""
    for p in tl.static_range(len(WIDTHS)):
        if KIND == ALL or PKIND[p] == ALL or PKIND[p] == KIND:  # resolved at compile time
            r = tl.load(idx + p * stride + pos, mask=ok, other=0).to(tl.int64)
            ok = plane_pass(ok, r, p, b, words, t_base, q_words, q_base, q_ranges, tables,
                            WIDTHS, SINGLE, GP, GLO, GW, GA, GT, J, CH, QSTEP, LEAD, KIND)
    return ok


def layout_args(lay) -> dict:
    """The constexpr arguments of `plane_pass` for a `planes.GroupLayout`."""
    return dict(WIDTHS=lay.widths, SINGLE=lay.single, GP=lay.group_plane, GLO=lay.group_lo, GW=lay.group_words,
                GA=tuple(triton.next_power_of_2(max(w, 1)) for w in lay.group_words), GT=lay.group_table,
                J=lay.table_words, CH=lay.table_chunks)


def plane_kinds(lay) -> tuple[int, ...]:
    """Per plane, the kinds of its word groups (bits UNTABLED, TABLED): the mask's PKIND."""
    kinds = [0] * len(lay.widths)
    for p, t in zip(lay.group_plane, lay.group_table):
        kinds[p] |= TABLED.value if t >= 0 else UNTABLED.value
    return tuple(kinds)
