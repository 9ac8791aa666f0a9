"""The matcher planes as the Triton kernel reads them: every plane's rows in one flat buffer with
where each plane starts, and the planes' word groups as a host-side `GroupLayout` the kernel is
compiled for, so one kernel serves any set of planes (`sidindex.matchers.plane`). Rows are int64
(the uint64 bits reinterpreted).

Legend: P planes, G word groups of all planes, E child entries, T k-way partitions.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, replace

import numpy as np
import torch

# A group one of whose requests has this many queries or more is tested by table lookups
# (`tables`): 16 lookups per word per 64 queries, against a test per query per word.
TABLE_FROM = 16
NIBBLES = 16  # a table's 4-bit chunks per 64-bit word (`tables`)


@dataclass(frozen=True)
class TableStack:
    """An index's matcher tables, stacked.

    words:      (sum of R_p * W_p,) int64 every plane's table, row-major, back to back
    base:       (P,) int64 first word of each plane's table in `words`
    index:      (P, E) int32 row of each child entry's union, per plane
    part_index: (P, T) int32 row of each partition, per plane, or None
    tables:     per plane, (R_p, W_p) views of `words` (what the other paths read)
    """

    words: torch.Tensor
    base: torch.Tensor
    index: torch.Tensor
    part_index: torch.Tensor | None
    tables: tuple[torch.Tensor, ...]


@dataclass(frozen=True)
class GroupLayout:
    """The planes' word groups, as the kernel is compiled for them (tuples: constexpr arguments).

    widths:      per plane, its row width W_p
    single:      per plane, whether each request has exactly one query per group
    group_plane, group_lo, group_words: per group (planes in order), its plane, its first word
                 within a row and its number of words
    group_table: per group, its query table (`tables`) or -1: tested query by query
    table_words: mask words J of every table (0 without one): room for 64 J queries per request
    """

    widths: tuple[int, ...]
    single: tuple[bool, ...]
    group_plane: tuple[int, ...]
    group_lo: tuple[int, ...]
    group_words: tuple[int, ...]
    group_table: tuple[int, ...]
    table_words: int

    @property
    def tabled(self) -> list[int]:
        """The tabled groups, in table order."""
        return [g for g, t in enumerate(self.group_table) if t >= 0]

    @property
    def table_chunks(self) -> int:
        """Chunks CH of every table: 16 per word of the widest tabled group (0 without one)."""
        return NIBBLES * max([self.group_words[g] for g in self.tabled], default=0)


def untabled_layout(lay: GroupLayout) -> GroupLayout:
    """`lay` with every group tested query by query (no tables)."""
    return replace(lay, group_table=(-1,) * len(lay.group_plane), table_words=0)


@dataclass(frozen=True)
class QueryStack:
    """A request batch's queries, stacked.

    words:  (sum of Q_p * W_p,) int64 every plane's query rows, back to back
    base:   (P,) int64 first word of each plane's query rows
    ranges: (B, G, 2) int64 [start, end) of request b's queries for group g (rows of its plane),
            the groups of all planes in order
    layout: the groups, on the host
    tables: (B, T, J, CH, 16) int64 the tabled groups' query tables, once a search made them from
            these queries (`prepare.prepared`); None before (and without tabled groups)
    passed: (B, R) int8 each shared row's test (`prepare.prepared`), made with the tables for the
            set whose rows tensor is `passed_rows` (`shared_rows.SharedRows.rows`); None before
    """

    words: torch.Tensor
    base: torch.Tensor
    ranges: torch.Tensor
    layout: GroupLayout
    tables: torch.Tensor | None = None
    passed: torch.Tensor | None = None
    passed_rows: torch.Tensor | None = None

    def slice(self, lo: int, hi: int) -> QueryStack:
        """Requests lo..hi-1 (the query rows stay shared)."""
        return replace(self, ranges=self.ranges[lo:hi], tables=None if self.tables is None else self.tables[lo:hi],
                       passed=None if self.passed is None else self.passed[lo:hi])


def _flat(parts: list[torch.Tensor], device, rows: tuple[int, ...] | None = None):
    """One int64 buffer on `device` holding the (R_i, W_i) `parts` back to back, each with room for
    rows[i] rows (default R_i). Returns the buffer, each part's first word and its (rows[i], W_i)
    view of the buffer, its first R_i rows filled."""
    rows = rows or tuple(len(p) for p in parts)
    starts = np.cumsum([0] + [r * p.shape[1] for r, p in zip(rows, parts)]).tolist()
    words = torch.zeros(max(starts[-1], 1), dtype=torch.int64, device=device)
    views = tuple(words[lo:hi].view(r, p.shape[1]) for p, r, lo, hi in zip(parts, rows, starts, starts[1:]))
    for p, v in zip(parts, views):
        v[:len(p)].copy_(p, non_blocking=True)
    return words, starts[:-1], views


def stack_tables(tables: list[torch.Tensor], index: list[torch.Tensor], part_index: list[torch.Tensor] | None,
                 device) -> TableStack:
    """Stack per-plane tables (R_p, W_p) int64, entry indexes (E,) int32 and partition indexes (T,)
    int32 (host or device tensors) onto `device`, each copied once: bytes only (nothing reads a row
    number, so a loader stacks a snapshot's planes before its structure is checked)."""
    words, starts, views = _flat(tables, device)

    def rows(parts):
        out = torch.empty((len(parts), len(parts[0])), dtype=torch.int32, device=device)
        for p, src in enumerate(parts):
            out[p].copy_(src, non_blocking=True)
        return out

    return TableStack(words, torch.tensor(starts, dtype=torch.int64, device=device), rows(index),
                      None if part_index is None else rows(part_index), views)


def order_by_first_use(stack: TableStack) -> TableStack:
    """Renumber each plane's rows of `stack` in place, on its device, in the order the entries, then
    the partitions, first use them (`first_use_order`): the stack then means the same rows by other
    numbers than its sources. Its row numbers index: they must have been checked."""
    for p, table in enumerate(stack.tables):
        uses = [stack.index[p]] + ([] if stack.part_index is None else [stack.part_index[p]])
        order = first_use_order(uses, len(table))
        new = torch.empty_like(order)
        new[order] = torch.arange(len(order), device=order.device)
        table.copy_(table[order])
        for u in uses:
            u.copy_(new[u.long()])
    return stack


def first_use_order(uses: list[torch.Tensor], rows: int) -> torch.Tensor:
    """(rows,) int64 a plane's row numbers in the order `uses` ((n_i,) int32 row numbers, taken one
    after another) first name them; rows never named last, in their order.

    The entries are numbered depth by depth and a node's children side by side, so in this order
    the rows of a beam's children mostly follow one another: the mask's lanes (consecutive child
    entries) then read consecutive rows, where the build's order (an ad's own row, in catalog order,
    for most deep entries) scatters them."""
    named = torch.cat([u.long() for u in uses])
    first = torch.full((rows,), len(named), dtype=torch.int64, device=named.device)
    first.scatter_reduce_(0, named, torch.arange(len(named), device=named.device), "amin")
    return torch.argsort(first, stable=True)


def stack_queries(planes, device, rows: tuple[int, ...] | None = None, table_from: int | None = None):
    """Stack a batch's per-plane queries (`PlaneQueries` of host or device tensors, word offsets on
    the host) onto `device`, each plane with room for rows[p] query rows (default its own). Returns
    the planes again, their rows and ranges now views of the stack's memory (nothing is held twice,
    and one copy into the stack refreshes both), and the `QueryStack`. A group for which some
    request has `table_from` (default TABLE_FROM) queries or more is tabled (`tables`)."""
    words, starts, views = _flat([q.rows for q in planes], device, rows)
    ranges = torch.cat([q.ranges for q in planes], dim=1)
    layout = group_layout(planes, most_queries(ranges), table_from)  # read where the ranges are
    ranges = ranges.to(device)
    planes = tuple(replace(q, rows=v, ranges=r) for q, v, r in zip(planes, views, plane_ranges(ranges, planes)))
    return planes, QueryStack(words, stack_base(starts, device), ranges, layout)


def most_queries(ranges) -> list[int]:
    """Per group, the most queries a request has: read where the ranges are (numpy or torch; the
    host, from `runtime.to_device`)."""
    if not len(ranges):
        return [0] * ranges.shape[1]
    return (ranges[..., 1] - ranges[..., 0]).max(0).tolist() if isinstance(ranges, np.ndarray) \
        else (ranges[..., 1] - ranges[..., 0]).amax(0).tolist()


def plane_ranges(ranges: torch.Tensor, planes) -> list[torch.Tensor]:
    """Each plane's (B, G_p, 2) view of the groups' ranges (B, G, 2), the planes' groups in order."""
    out, g = [], 0
    for q in planes:
        k = q.ranges.shape[1]
        out.append(ranges[:, g:g + k])
        g += k
    return out


def group_layout(planes, most: list[int], table_from: int | None = None) -> GroupLayout:
    """The `GroupLayout` of `planes` (`PlaneQueries`, word offsets on the host), whose groups have
    at most most[g] queries per request (`most_queries`): a group of a plane with several queries
    per request, `table_from` (default TABLE_FROM) of them or more, is tabled."""
    threshold = TABLE_FROM if table_from is None else table_from
    group_plane: list[int] = []
    group_lo: list[int] = []
    group_words: list[int] = []
    group_table: list[int] = []
    tables = table_words = 0
    for p, q in enumerate(planes):
        woff = q.word_offsets.tolist()
        for lo, hi in zip(woff[:-1], woff[1:]):
            n = most[len(group_plane)]
            group_plane.append(p)
            group_lo.append(lo)
            group_words.append(hi - lo)
            if not q.single and n >= threshold:
                group_table.append(tables)
                tables += 1
                table_words = max(table_words, -(-n // 64))
            else:
                group_table.append(-1)
    return GroupLayout(widths=tuple(int(q.rows.shape[1]) for q in planes), single=tuple(bool(q.single) for q in planes),
                       group_plane=tuple(group_plane), group_lo=tuple(group_lo), group_words=tuple(group_words),
                       group_table=tuple(group_table), table_words=table_words)


@functools.lru_cache(maxsize=64)
def _stack_base(starts: tuple[int, ...], device: torch.device) -> torch.Tensor:
    return torch.tensor(starts, dtype=torch.int64, device=device)


def stack_base(starts: list[int], device: torch.device) -> torch.Tensor:
    """(P,) int64 on `device`: `QueryStack.base` of planes starting at words `starts`. Made once per
    starts and device (a batch size's), and never written: a batch does not wait on its copy."""
    return _stack_base(tuple(starts), torch.device(device))
