"""Plain torch reference of the device post stage (`runtime.ops.expand`): whole-tensor ops over
every (request, slot) pair, a sort along the C slots to dedupe, the ranking's sorts
(`runtime.ops.expand.rank`) and the exact filter's own pick of kernels or torch
(`runtime.ops.exact_filter`); no host synchronisation (no `.item()`, no boolean-mask indexing, no
data-dependent branch: padded slots carry a sentinel and sort last).

Legend: B requests, K beams, L SID length, N catalog rows, C the pairs capacity of a request, T
the result rows kept per request.
"""

from __future__ import annotations

import torch

from runtime.ops.exact_filter import exact_filter
from runtime.ops.expand.layout import PostLayout
from runtime.ops.expand.rank import INT64_MAX, ORDER_BITS, rank_slots
from runtime.ops.order import descending, score_key
from schemas.artifacts import AD_LIVE


def expand_reference(layout: PostLayout, arrays: dict[str, torch.Tensor], ad_order: torch.Tensor,
                     steps: dict[str, tuple[int, ...]], requests, beams, max_values: int) -> torch.Tensor:
    """`runtime.ops.expand.expand_beams` in torch ops (same arguments)."""
    a = arrays
    B, K, C, T, L = layout.batch, layout.beams, layout.pairs, layout.kept, layout.length
    dev = beams.score.device
    offsets, leaf_ads, n_ads = a["leaf_ad_offsets"], a["leaf_ads"], len(a["ads"])
    # 1. live beams on catalog SIDs, and where each one's ads start among its request's slots; a
    #    request reaching more than C pairs (an overflow) holds none
    alive = (beams.leaf >= 0) & (beams.score > float("-inf"))                      # (B, K)
    leaf = beams.leaf.clamp(min=0)
    count = torch.where(alive, offsets[leaf + 1] - offsets[leaf], 0)                # (B, K)
    upto = count.cumsum(1)                                                          # (B, K) inclusive
    reached = upto[:, -1]
    held = torch.where(reached <= C, reached, 0)                                    # (B,)
    # 2. slot j of a request -> its beam (the first whose inclusive count passes j) and ad
    slot = torch.arange(C, device=dev).repeat(B, 1)                                 # (B, C)
    beam = torch.searchsorted(upto, slot, right=True).clamp(max=K - 1)              # (B, C)
    within = slot - (upto.gather(1, beam) - count.gather(1, beam))
    valid = slot < held[:, None]
    pos = torch.where(valid, offsets[leaf.gather(1, beam)] + within, 0)
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
    # 5. rank (`rank.rank_slots`): the eligible slots' keys
    packed = torch.where(ok, score_key(score) * 2 ** ORDER_BITS + ad_order[ad], INT64_MAX)
    value = a["ad_value"][ad] if layout.has_value else None
    value_key = None if value is None or layout.rank == "score" else torch.where(ok, descending(value), INT64_MAX)
    top = rank_slots(packed, value_key, layout.rank, T)                              # (B, T)
    beam, ad = beam.gather(1, top), ad.gather(1, top)
    counts = [alive.sum(1), reached, first.sum(1), ok.sum(1)] + ([p.sum(1) for p in passed] if layout.stages else [])
    rows = [ad[..., None], a["ads"][ad][..., None], beams.tokens.gather(1, beam[..., None].expand(B, T, L)),
            score.gather(1, top).view(torch.int32).long()[..., None]]
    rows += [value.gather(1, top).view(torch.int64)[..., None]] if value is not None else []  # has_value
    # 6. the rows in use first, in (request, rank) order: the host copies one prefix
    used = (torch.arange(T, device=dev) < counts[3][:, None]).reshape(-1)                    # (B*T,)
    dest = torch.where(used, used.cumsum(0) - 1, used.sum() + (~used).cumsum(0) - 1)
    table = torch.cat(rows, dim=2).reshape(B * T, -1)
    packed_rows = torch.empty_like(table).index_copy_(0, dest, table)                        # (B*T, F)
    return torch.cat([torch.stack(counts).reshape(-1), packed_rows.reshape(-1)])
