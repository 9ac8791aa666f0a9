"""The matcher planes as the Triton kernel reads them: every plane's rows in one flat buffer with a
small table of where each plane and word group starts, so one kernel serves any set of planes
(`sidindex.matchers.plane`). Rows are int64 (the uint64 bits reinterpreted).

Legend: P planes, G word groups of all planes, E child entries, T k-way partitions.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np
import torch


@dataclass(frozen=True)
class TableStack:
    """An index's matcher tables, stacked.

    words:      (sum of R_p * W_p,) int64 every plane's table, row-major, back to back
    meta:       (P, 2) int64 per plane: its first word in `words`, its row width W_p
    index:      (P, E) int32 row of each child entry's union, per plane
    part_index: (P, T) int32 row of each partition, per plane, or None
    tables:     per plane, (R_p, W_p) views of `words` (what the other paths read)
    """

    words: torch.Tensor
    meta: torch.Tensor
    index: torch.Tensor
    part_index: torch.Tensor | None
    tables: tuple[torch.Tensor, ...]


@dataclass(frozen=True)
class QueryStack:
    """A request batch's queries, stacked.

    words:  (sum of Q_p * W_p,) int64 every plane's query rows, back to back
    base:   (P,) int64 first word of each plane's query rows
    groups: (G, 3) int64 per word group, planes in order: its plane, first word within a row, words
    ranges: (B, G, 2) int64 [start, end) of request b's queries for group g (rows of its plane)
    group_words: the most words of one group (the kernel's tile width)
    """

    words: torch.Tensor
    base: torch.Tensor
    groups: torch.Tensor
    ranges: torch.Tensor
    group_words: int

    def slice(self, lo: int, hi: int) -> QueryStack:
        """Requests lo..hi-1 (the query rows stay shared)."""
        return replace(self, ranges=self.ranges[lo:hi])


def _flat(parts: list[torch.Tensor], device) -> tuple[torch.Tensor, list[int]]:
    """One int64 buffer on `device` holding `parts` (each flattened) back to back, and their starts."""
    starts = np.cumsum([0] + [p.numel() for p in parts]).tolist()
    words = torch.empty(max(starts[-1], 1), dtype=torch.int64, device=device)
    for p, lo, hi in zip(parts, starts, starts[1:]):
        words[lo:hi].copy_(p.reshape(-1), non_blocking=True)
    return words, starts[:-1]


def stack_tables(tables: list[torch.Tensor], index: list[torch.Tensor], part_index: list[torch.Tensor] | None,
                 device) -> TableStack:
    """Stack per-plane tables (R_p, W_p) int64, entry indexes (E,) int32 and partition indexes (T,)
    int32 (host or device tensors) onto `device`, each copied once."""
    words, starts = _flat(tables, device)
    meta = torch.tensor([[s, t.shape[1]] for s, t in zip(starts, tables)], dtype=torch.int64, device=device)
    views = tuple(words[s:s + t.numel()].view(t.shape) for s, t in zip(starts, tables))

    def rows(parts):
        out = torch.empty((len(parts), len(parts[0])), dtype=torch.int32, device=device)
        for p, src in enumerate(parts):
            out[p].copy_(src, non_blocking=True)
        return out

    return TableStack(words, meta, rows(index), None if part_index is None else rows(part_index), views)


def stack_queries(planes, device) -> QueryStack:
    """Stack a batch's per-plane queries (`PlaneQueries` of tensors on `device`, word offsets on the host)."""
    words, starts = _flat([q.rows for q in planes], device)
    groups = [(p, int(lo), int(hi - lo)) for p, q in enumerate(planes)
              for lo, hi in zip(q.word_offsets[:-1], q.word_offsets[1:])]
    return QueryStack(words, torch.tensor(starts, dtype=torch.int64, device=device),
                      torch.tensor(groups, dtype=torch.int64, device=device).reshape(-1, 3),
                      torch.cat([q.ranges for q in planes], dim=1),
                      max([n for _, _, n in groups] + [1]))
