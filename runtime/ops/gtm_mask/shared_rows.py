"""Shared rows: where a depth's child entries index few distinct matcher rows, each of those rows is
tested once per request, and the mask's lanes look the results up.

Deep in a catalog nearly every union is a row of its own, but near the root a union is the OR of
many ads and saturates: at 10M SIDs the 262,143 child entries of depth 1 index 2,074 distinct
bitmask rows and 512 distinct Bloom rows, and at step 1 each of the 16 requests of a batch reads
every one of those entries. Testing each lane's rows against its request's queries (a chain of
dependent loads, and for a Bloom attribute a stream of queries or a table's lookups) is then done
4.2M times over 2,586 rows. With shared rows, the row test (`kernel.plane_pass`) runs once per
(request, distinct row), about 41,000 times, before the mask, and a lane's union test becomes one
load per plane: its row's position (`local`), then that position's result. The result is the same
test's, so the mask is exact either way; only where the work is done changes.

A depth has shared rows (`shared_rows`, made when an index is loaded onto a GPU) when its entries
outnumber their distinct rows FEW times or more and those rows are at most MOST_ROWS.

Legend: P planes, E_d child entries of depth d's nodes, R distinct rows of all planes, B requests.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch

FEW = 8  # entries per distinct row from which testing the rows once pays
MOST_ROWS = 1 << 16  # more rows than this are tested as the lanes reach them


@dataclass(frozen=True)
class SharedRows:
    """The distinct matcher rows of one depth's child entries.

    lo:    first child entry of the depth (host int); its entries are lo .. lo + E_d - 1
    local: (P, E_d) int32 the row of entry lo + i in plane p, as a position in `rows`
    rows:  (R,) int32 the distinct rows, plane by plane: plane p's are at positions ends[p] .. ends[p+1]-1
    ends:  (P + 1,) int64 on the device; `size` = R on the host
    """

    lo: int
    local: torch.Tensor
    rows: torch.Tensor
    ends: torch.Tensor
    size: int


def shared_rows(gtm, depth: int, few: int = FEW, most: int = MOST_ROWS) -> SharedRows | None:
    """The shared rows of `depth`'s child entries (tensors where the trie's are), or None where
    they are not few (entries < few x distinct rows, or distinct rows > most). gtm: a GTMIndex of
    tensors (`ServedIndex.gtm`). Each plane's rows in use are marked, not sorted: O(E_d + R_p)."""
    do, off = gtm.depth_offsets, gtm.node_offsets
    lo, hi = (int(x) for x in off[[int(do[depth]), int(do[depth + 1])]].tolist())
    if hi == lo:
        return None
    rows = [p.index[lo:hi] for p in gtm.planes]
    marks = []
    for p, r in zip(gtm.planes, rows):
        mark = torch.zeros(len(p.table), dtype=torch.bool, device=r.device)
        mark[r.long()] = True
        marks.append(mark)
    counts = torch.stack([m.sum() for m in marks]).tolist()
    size = sum(counts)
    if size > most or hi - lo < few * size:
        return None
    ends = [0, *itertools.accumulate(counts)]
    local = torch.empty((len(rows), hi - lo), dtype=torch.int32, device=rows[0].device)
    for p, (r, mark) in enumerate(zip(rows, marks)):
        local[p] = (mark.cumsum(0) - 1 + ends[p])[r.long()]  # a marked row's rank among the plane's marked ones
    distinct = torch.cat([m.nonzero().flatten() for m in marks]).int()
    return SharedRows(lo, local, distinct, torch.tensor(ends, dtype=torch.int64, device=local.device), size)
