"""Plain torch reference of the exact ad-level filter on the device (`sidindex.exact`, the
same tests as its numba passes): whole-tensor ops over every (request, slot) pair, a `rows` plane
as a (B, C, Q, w) comparison per word group, a `values` plane as a fixed-step binary search over
(B, C, M) per attribute. Obviously correct and without host synchronisation, but dozens of ops;
it is what the Triton kernel is tested against.

Legend: B requests, C slots per request, N catalog rows, W a plane's words, Q query rows, G word
groups, A a plane's attributes, M the most values a request has for one attribute, H an index's
hashes, R the batch's hashes.
"""

from __future__ import annotations

import torch

from runtime.ops.gtm_mask.reference import plane_pass
from schemas.artifacts import EXACT_FORM, EXACT_ROWS, MATCHER_PLANES, plane_arrays

_SIGN = torch.iinfo(torch.int64).min  # x ^ _SIGN orders uint64 bits (viewed as int64) as signed int64 compares


def held_slots(live: torch.Tensor | None, B: int, C: int, device) -> torch.Tensor:
    """(B, C) bool: the slots holding a pair, request b's first live[b] (every slot without counts)."""
    if live is None:
        return torch.ones((B, C), dtype=torch.bool, device=device)
    return torch.arange(C, device=device) < live[:, None]


def exact_filter_reference(arrays: dict[str, torch.Tensor], requests, ad: torch.Tensor,
                           steps: dict[str, tuple[int, ...]], max_values: int) -> list[torch.Tensor]:
    """Per matcher plane (B, C) bool: ad `ad` (B, C) int64 passes the plane's attributes for its
    request. Same contract as `runtime.ops.exact_filter.exact_filter`."""
    out = []
    for p, q, ex in zip(MATCHER_PLANES, requests.planes, requests.exact):
        if EXACT_FORM[p] == EXACT_ROWS:
            out.append(rows_pass(arrays[plane_arrays(p).exact_rows][ad], q, max_values))
        else:
            names = plane_arrays(p)
            out.append(values_pass(arrays[names.exact_hash_offsets], arrays[names.exact_hashes], ad, ex, steps[p],
                                   max_values))
    return out


def rows_pass(rows: torch.Tensor, q, max_values: int) -> torch.Tensor:
    """(B, C) bool: rows (B, C, W) int64 pass the request's queries `q` (device `PlaneQueries`):
    for every group ANY of its queries q has (row & q) == q on the group's words (the matcher
    planes' test, `gtm_mask.reference.plane_pass`, with a static number of queries per group)."""
    return plane_pass(rows, q, q.ranges, 1 if q.single else max(1, max_values))


def values_pass(hash_offsets: torch.Tensor, hashes: torch.Tensor, ad: torch.Tensor, ex, steps: tuple[int, ...],
                max_values: int) -> torch.Tensor:
    """(B, C) bool: for every attribute of a `values` plane, ad `ad` (B, C) int64 is unrestricted
    or ANY request value is among its sorted hashes (a binary search of `steps[a]` steps for
    attribute a, `runtime.index.served.PostBounds.steps`). hash_offsets: (A*(N+1),) int64; hashes: (H,) int64,
    uint64 bits sorted as unsigned within each ad; ex: the batch's `ExactQueries` on the device."""
    ok = torch.ones(ad.shape, dtype=torch.bool, device=ad.device)
    if len(hashes) == 0:  # no ad restricted on any attribute (a static shape, not data)
        return ok
    ad_off = hash_offsets.view(len(steps), -1)                                      # (A, N+1)
    H, R = len(hashes), len(ex.hashes)
    j = torch.arange(max_values, device=ad.device)
    for a, n_steps in enumerate(steps):
        lo, hi = ad_off[a][ad], ad_off[a][ad + 1]                                   # (B, C)
        start, end = ex.hash_offsets[a, :-1, None], ex.hash_offsets[a, 1:, None]    # (B, 1)
        asked = (start + j < end)[:, None, :]                                      # (B, 1, M)
        want = ex.hashes[(start + j).clamp(min=0, max=max(R - 1, 0))] if R else torch.zeros_like(start + j)
        want = (want ^ _SIGN)[:, None, :]                                          # (B, 1, M), signed order
        base, size = lo[..., None].expand(-1, -1, len(j)), (hi - lo)[..., None].expand(-1, -1, len(j))
        for _ in range(n_steps):  # lower bound of `want` in hashes[lo:hi]
            half = size // 2
            below = (hashes[(base + half).clamp(max=H - 1)] ^ _SIGN) < want
            go = below & (size > 0)
            base = torch.where(go, base + half + 1, base)
            size = torch.where(go, size - half - 1, half)  # half is 0 when size is
        found = (base < hi[..., None]) & ((hashes[base.clamp(max=H - 1)] ^ _SIGN) == want) & asked
        ok &= (hi == lo) | found.any(-1)
    return ok
