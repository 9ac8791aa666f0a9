"""Query tables: a request's many queries of one word group folded into lookups (the Bloom
ANY-of-many test at 16 loads per word per 64 queries, rather than a test per query).

A row passes a group iff some query q has (row & q) == q on the group's words, i.e. for every
4-bit chunk c of those words, q's bits in c are a subset of the row's. So per request and group,
table[j, c, v] is the set, as the bits of an int64, of the queries 64j..64j+63 (of the request's
queries for the group, in order) whose bits in chunk c are a subset of v (0..15); and a row passes
iff for some j, the AND over chunks c of table[j, c, row's chunk c] is not 0. A lane then does 16
lookups per word (each chunk's 16 entries are one 128-byte line, so a warp's lookups of a chunk
share it) in place of testing every query, and the test is the same for a row that passes and one
that fails: the streamed test's lanes that fail try every query, and a block waits for them.

Legend: B requests, T tabled groups, J = ceil(queries / 64) mask words, CH chunks (16 per word of
the widest tabled group).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from runtime.ops.planes import NIBBLES


@triton.jit
def build_table(out, q_words, q_base, q_ranges, b, G, g: tl.constexpr, p: tl.constexpr, t: tl.constexpr,
                T, blk, W: tl.constexpr, W_LO: tl.constexpr, N: tl.constexpr, J: tl.constexpr, CH: tl.constexpr,
                BLOCK: tl.constexpr):
    """Block `blk` of BLOCK entries of request b's table t, for group g (of plane p, words
    W_LO.., N = its words x 16 chunks x 16 values): each lane one entry (chunk, value), the
    request's queries of the group tested 64 at a time, unrolled (all 64 loads in flight at once:
    a loop of 64 loads waited for each, 8.0 against 3.7 us on the H200)."""
    e = blk * BLOCK + tl.arange(0, BLOCK)
    m = e < N
    c, v = e // 16, (e % 16).to(tl.int64)
    word = q_words + tl.load(q_base + p) + W_LO + c // 16
    shift = (c % 16) * 4
    start = tl.load(q_ranges + (b * G + g) * 2)
    end = tl.load(q_ranges + (b * G + g) * 2 + 1)
    for j in range(J):
        acc = tl.zeros([BLOCK], dtype=tl.int64)
        for i in tl.static_range(64):
            q = e * 0 + start + 64 * j + i  # (per lane: the interpreter takes no block & scalar mask)
            nib = (tl.load(word + q * W, mask=m & (q < end), other=0) >> shift) & 15
            acc = acc | ((((nib & ~v) == 0) & (q < end)).to(tl.int64) << i)
        tl.store(out + (((b * T + t) * J + j) * CH + c) * 16 + v, acc, mask=m)


@triton.jit
def table_pass(ok, row, tab, W_LO: tl.constexpr, N_W: tl.constexpr, J: tl.constexpr, CH: tl.constexpr):
    """ok & (each lane's `row` passes ANY of its request's queries of the group whose words are
    W_LO..W_LO+N_W-1): `tab` is the request's (J, CH, 16) table of the group. Lanes off `ok` load
    nothing. Unrolled, so each lookup's place is a constant plus its chunk's value."""
    hit = tl.zeros_like(ok)
    for j in tl.static_range(J):
        acc = tl.full(ok.shape, -1, dtype=tl.int64)
        for w in tl.static_range(N_W):
            x = tl.load(row + W_LO + w, mask=ok, other=0)
            halves = (x.to(tl.int32), (x >> 32).to(tl.int32))  # chunks from 32-bit halves: cheaper shifts
            for c in tl.static_range(16):
                nib = (halves[c // 8] >> (4 * (c % 8))) & 15
                acc = acc & tl.load(tab + ((j * CH + w * 16 + c) * 16) + nib, mask=ok, other=0)
        hit = hit | (acc != 0)
    return ok & hit


def query_tables_reference(stacked) -> torch.Tensor | None:
    """`prepare.query_tables` in plain torch, query by query (what the kernel is tested against)."""
    lay = stacked.layout
    tabled = lay.tabled
    if not tabled:
        return None
    B = stacked.ranges.shape[0]
    J, CH = lay.table_words, lay.table_chunks
    out = torch.zeros((B, len(tabled), J, CH, 16), dtype=torch.int64)
    v = torch.arange(16)
    shifts = torch.arange(NIBBLES) * 4
    for g in tabled:
        p, t, lo, n_w = lay.group_plane[g], lay.group_table[g], lay.group_lo[g], lay.group_words[g]
        base, W = int(stacked.base[p]), lay.widths[p]
        for b in range(B):
            start, end = (int(x) for x in stacked.ranges[b, g])
            for i in range(start, end):
                row = stacked.words[base + i * W + lo: base + i * W + lo + n_w].cpu()
                nib = ((row[:, None] >> shifts) & 15).reshape(-1)  # (n_w * 16,) the query's chunks
                subset = (nib[:, None] & ~v) == 0  # (chunks, 16)
                j, bit = divmod(i - start, 64)
                out[b, t, j, :len(nib)] |= subset.long() << bit
    return out
