"""The device post stage's ranking (`runtime.ops.expand`), one copy for both implementations:
sorts along each request's C slots of int64 keys, so the cost grows as C log C whatever the ties
(the hash level gives sibling SIDs equal scores: a request's eligible ads can tie by the
thousands), with no host synchronisation (a CUDA graph captures it).

Legend: B requests, C slots per request (the pairs capacity), T result rows kept per request.
"""

from __future__ import annotations

import torch

from runtime.ops.expand.layout import RRF_K
from runtime.ops.order import descending

INT64_MAX = torch.iinfo(torch.int64).max
ORDER_BITS = 31  # an ad's place in ad_id order, below the score key in `packed` (`runtime.serving.post.DEVICE_ROWS`)
TOPK_MOST = 1024  # a score ranking keeping at most this many rows selects them (`topk`) rather than sorting C


def rank_slots(packed: torch.Tensor, value_key: torch.Tensor | None, rank: str, kept: int) -> torch.Tensor:
    """(B, T) int64 per request the slots of its first T places, by `rank` (RANKS), then ad_id: its
    eligible slots first, ranked; past them slots unspecified.

    packed: (B, C) int64, an eligible slot's score key (`runtime.ops.order.score_key`, < 2^32)
      x 2^31 + its ad's place in ad_id order (< 2^31), INT64_MAX for the other slots: distinct per
      eligible ad, so one sort ranks by score then ad_id.
    value_key: (B, C) int64 an eligible slot's ad value as `runtime.ops.order.descending`, INT64_MAX
      elsewhere (value and fused; None for score).
    kept: T <= C.
    score: one sort, or for T < C (T <= TOPK_MOST) the T smallest keys (`topk`, sorted); value: a
    stable sort on the value key of the score order (ties: the score place); fused: reciprocal-rank
    fusion of the two 1-based places, 1/(RRF_K + score place) + 1/(RRF_K + value place) in float64,
    descending, ties to ad_id (a sort by ad_id place, then a stable one)."""
    C = packed.shape[1]
    if rank == "score":
        if kept < C and kept <= TOPK_MOST:
            return torch.topk(packed, kept, dim=1, largest=False, sorted=True).indices
        return torch.sort(packed, dim=1).indices
    assert value_key is not None  # value and fused rank by the ads' values
    by_score = torch.sort(packed, dim=1).indices
    by_value = _then(by_score, value_key)
    if rank == "value":
        return by_value[:, :kept]
    ok = packed != INT64_MAX
    place = torch.arange(1, C + 1, device=packed.device).expand_as(packed)
    fused = (1 / (RRF_K + torch.empty_like(packed).scatter_(1, by_score, place)).double()
             + 1 / (RRF_K + torch.empty_like(packed).scatter_(1, by_value, place)).double())
    by_order = torch.sort(torch.where(ok, packed & ((1 << ORDER_BITS) - 1), INT64_MAX), dim=1).indices
    return _then(by_order, torch.where(ok, descending(fused), INT64_MAX))[:, :kept]


def _then(perm: torch.Tensor, key: torch.Tensor) -> torch.Tensor:
    """(B, C) int64 the permutation `perm` (B, C) re-sorted stably by key (B, C) int64: by key,
    then by place in `perm`."""
    return perm.gather(1, torch.sort(key.gather(1, perm), dim=1, stable=True).indices)
