"""Shared rows: where a depth's child entries index few distinct matcher rows, each of those rows is
tested once per request, and the mask's lanes look the results up.

Near the root unions saturate: a depth's many entries index few distinct rows, which every request
reads, so testing each lane's rows repeats the same chains of dependent loads (at 10M SIDs, 4.2M
tests at depth 1 over 2,586 rows). Tested once per (request, distinct row) before the mask, a
lane's union test becomes one load per plane: its row's position (`local`), then that position's
result. The test is the same, so the mask is exact either way. A depth has shared rows when its
entries outnumber their distinct rows FEW times or more and those rows are at most MOST_ROWS; the
rows of every such depth make one set, tested in one launch with the query tables (`prepare`).
Figures: docs/kernels.md ("Shared rows").

Legend: P planes, E_d child entries of depth d's nodes, R distinct rows of all planes and depths,
B requests.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

FEW = 8  # entries per distinct row from which testing the rows once pays
MOST_ROWS = 1 << 16  # more rows of one depth than this are tested as the lanes reach them


@dataclass(frozen=True)
class SharedRows:
    """The distinct matcher rows of one depth's child entries, within the set of every depth's.

    lo:    first child entry of the depth (host int); its entries are lo .. lo + E_d - 1
    local: (P, E_d) int32 the row of entry lo + i in plane p, as a position in `rows`
    rows:  (R,) int32 the set's distinct rows (every depth's, one tensor for all of them)
    plane: (R,) int32 the plane of each of `rows`
    size:  R, on the host; count: how many of them are this depth's
    """

    lo: int
    local: torch.Tensor
    rows: torch.Tensor
    plane: torch.Tensor
    size: int
    count: int


def shared_rows(gtm, few: int = FEW, most: int = MOST_ROWS, only: int | None = None) -> tuple[SharedRows | None, ...]:
    """Per depth, its shared rows (tensors where the trie's are), or None where they are not few
    (entries < few x distinct rows, or distinct rows > most); the depths' rows are one set, depth
    by depth and plane by plane. gtm: a GTMIndex of tensors (`ServedIndex.gtm`); only: that depth
    alone (the others None; what one mask made per call tests). Each plane's rows in use are
    marked, not sorted: O(E_d + R_p) per depth."""
    do, off = gtm.depth_offsets, gtm.node_offsets
    found: dict[int, tuple[int, int, list[torch.Tensor], list[int]]] = {}
    for d in range(gtm.sid_length):  # 1. each depth's rows in use, per plane; keep the depths where they are few
        lo, hi = (int(x) for x in off[[int(do[d]), int(do[d + 1])]].tolist())
        if hi == lo or only not in (None, d):
            continue
        marks = []
        for p in gtm.planes:
            mark = torch.zeros(len(p.table), dtype=torch.bool, device=p.index.device)
            mark[p.index[lo:hi].long()] = True
            marks.append(mark)
        counts = torch.stack([m.sum() for m in marks]).tolist()
        if sum(counts) <= most and hi - lo >= few * sum(counts):
            found[d] = (lo, hi, marks, counts)
    # 2. positions in the set: depth by depth, plane by plane; a marked row's rank among its plane's
    # marked ones, after the rows before it
    start, rows, plane, local = 0, [], [], {}
    for d, (lo, hi, marks, counts) in found.items():
        local[d] = torch.empty((len(marks), hi - lo), dtype=torch.int32, device=marks[0].device)
        for p, (pl, mark, n) in enumerate(zip(gtm.planes, marks, counts)):
            local[d][p] = (mark.cumsum(0) - 1 + start)[pl.index[lo:hi].long()]
            rows.append(mark.nonzero().flatten().int())
            plane.append(torch.full((n,), p, dtype=torch.int32, device=mark.device))
            start += n
    if not found:
        return (None,) * gtm.sid_length
    all_rows, all_planes = torch.cat(rows), torch.cat(plane)
    return tuple(SharedRows(found[d][0], local[d], all_rows, all_planes, start, sum(found[d][3]))
                 if d in found else None
                 for d in range(gtm.sid_length))
