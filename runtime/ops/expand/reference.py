"""Plain torch reference of the device post stage (`runtime.ops.expand`): whole-tensor ops over
every (request, slot) pair, sorts along the C slots (the exact filter's own pick of kernels or
torch: `runtime.ops.exact_filter`); no host synchronisation (no `.item()`, no
boolean-mask indexing, no data-dependent branch: padded slots carry a sentinel and sort last).

Legend: B requests, K beams, L SID length, N catalog rows, C the most (request, ad) pairs K beams
can reach, T the result rows kept per request.
"""

from __future__ import annotations

import torch

from runtime.ops.exact_filter import exact_filter
from runtime.ops.expand.layout import RRF_K, PostLayout
from runtime.ops.order import descending, score_key
from schemas.artifacts import AD_LIVE

_INT64_MAX = torch.iinfo(torch.int64).max


def expand_reference(layout: PostLayout, arrays: dict[str, torch.Tensor], ad_order: torch.Tensor,
                     steps: dict[str, tuple[int, ...]], requests, beams, max_values: int) -> torch.Tensor:
    """`runtime.ops.expand.expand_beams` in torch ops (same arguments)."""
    a = arrays
    B, K, C, T, L = layout.batch, layout.beams, layout.pairs, layout.kept, layout.length
    dev = beams.score.device
    offsets, leaf_ads, n_ads = a["leaf_ad_offsets"], a["leaf_ads"], len(a["ads"])
    # 1. live beams on catalog SIDs, and where each one's ads start among its request's C slots
    alive = (beams.leaf >= 0) & (beams.score > float("-inf"))                      # (B, K)
    leaf = beams.leaf.clamp(min=0)
    count = torch.where(alive, offsets[leaf + 1] - offsets[leaf], 0)                # (B, K)
    upto = count.cumsum(1)                                                          # (B, K) inclusive
    # 2. slot j of a request -> its beam (the first whose inclusive count passes j) and ad
    slot = torch.arange(C, device=dev).repeat(B, 1)                                 # (B, C)
    beam = torch.searchsorted(upto, slot, right=True).clamp(max=K - 1)              # (B, C)
    within = slot - (upto.gather(1, beam) - count.gather(1, beam))
    valid = slot < upto[:, -1:]
    pos = (offsets[leaf.gather(1, beam)] + within).clamp(max=len(leaf_ads) - 1)
    ad = torch.where(valid, leaf_ads[pos].long(), 0)
    if "ad_state" in a:  # rows an update paused or deleted are never served
        valid &= a["ad_state"][ad] == AD_LIVE
    score = beams.score.gather(1, beam)                                             # (B, C) float32
    # 3. one slot per (request, ad), best score first (stable: the first beam on ties): one sort
    #    of ad x 2^32 + the score's 32-bit key (catalog rows < 2^31: it fits in int64)
    perm = torch.sort(torch.where(valid, ad, n_ads) * 2 ** 32 + score_key(score), dim=1, stable=True).indices
    ad, beam, score, valid = (t.gather(1, perm) for t in (ad, beam, score, valid))
    first = valid.clone()
    first[:, 1:] &= ad[:, 1:] != ad[:, :-1]
    # 4. the exact filter, every plane on its own (stage flags), on the first slot of each ad
    passed = [p & first for p in exact_filter(a, requests, ad, steps, max_values)]
    ok = first
    for p in passed:
        ok = ok & p
    # 5. rank: ineligible slots last, then RANKS, then ad_id (as the ad's place in ad_id order)
    order = ad_order[ad]
    value = a["ad_value"][ad] if layout.has_value else None
    if layout.rank == "score":
        top = _sorted(_score_order(score, order, ok))
    else:
        assert value is not None  # a layout ranks by value only with the catalog's values
        by_value = _lex_order(_eligible_first([_score_order(score, order), descending(value)], ok))
        top = by_value
        if layout.rank == "fused":  # ranks among the request's eligible ads, which sort first
            rs, rv = _ranks(_sorted(_score_order(score, order, ok))), _ranks(by_value)
            top = _lex_order(_eligible_first([order, descending(1 / (RRF_K + rs).double()
                                                                 + 1 / (RRF_K + rv).double())], ok))
    top = top[:, :T]
    beam, ad = beam.gather(1, top), ad.gather(1, top)
    counts = [alive.sum(1), first.sum(1), ok.sum(1)] + ([p.sum(1) for p in passed] if layout.stages else [])
    rows = [ad[..., None], a["ads"][ad][..., None], beams.tokens.gather(1, beam[..., None].expand(B, T, L)),
            score.gather(1, top).view(torch.int32).long()[..., None]]
    rows += [value.gather(1, top).view(torch.int64)[..., None]] if value is not None else []  # has_value
    # 6. the rows in use first, in (request, rank) order: the host copies one prefix
    used = (torch.arange(T, device=dev) < counts[2][:, None]).reshape(-1)                    # (B*T,)
    dest = torch.where(used, used.cumsum(0) - 1, used.sum() + (~used).cumsum(0) - 1)
    table = torch.cat(rows, dim=2).reshape(B * T, -1)
    packed = torch.empty_like(table).index_copy_(0, dest, table)                             # (B*T, F)
    return torch.cat([torch.stack(counts).reshape(-1), packed.reshape(-1)])


def _score_order(score: torch.Tensor, order: torch.Tensor, ok: torch.Tensor | None = None) -> torch.Tensor:
    """(B, C) int64 keys ranking slots by score (B, C) float32 descending, then `order` (B, C) int64
    in [0, 2^31), ascending, packed in one int64; the slots not `ok` (B, C) bool get the largest
    score key (a live score's is below it) and sort last."""
    key = score_key(score) if ok is None else torch.where(ok, score_key(score), 2 ** 32 - 1)
    return key * 2 ** 31 + order


def _sorted(key: torch.Tensor) -> torch.Tensor:
    """(B, C) int64 per row the permutation sorting key (B, C) int64 ascending."""
    return torch.sort(key, dim=1).indices


def _eligible_first(keys: list[torch.Tensor], ok: torch.Tensor) -> list[torch.Tensor]:
    """`keys` (for `_lex_order`) with the slots not `ok` (B, C) bool last: the most significant
    key set to a sentinel no real key reaches (`descending` never gives _INT64_MAX)."""
    return keys[:-1] + [torch.where(ok, keys[-1], _INT64_MAX)]


def _lex_order(keys: list[torch.Tensor]) -> torch.Tensor:
    """(B, C) int64 per row the permutation sorting by keys (each (B, C) int64, ascending), the
    last key the most significant: one stable sort per key, least significant first."""
    perm = None
    for key in keys:
        k = key if perm is None else key.gather(1, perm)
        idx = torch.sort(k, dim=1, stable=True).indices
        perm = idx if perm is None else perm.gather(1, idx)
    assert perm is not None  # keys is never empty
    return perm


def _ranks(perm: torch.Tensor) -> torch.Tensor:
    """(B, C) int64 the 1-based place of each slot in its row's order `perm` (B, C)."""
    place = torch.arange(1, perm.shape[1] + 1, device=perm.device).expand_as(perm)
    return torch.empty_like(perm).scatter_(1, perm, place)
