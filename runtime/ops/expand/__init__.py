"""The post stage's op (`runtime.serving.post`, docs/design.md §3, §8): a batch's beams -> its (request, ad)
pairs, each ad's best score, the exact filter, and the ranked rows.

On the host (`expand_host`, `host`): numba passes over the snapshot's memory maps, to the fields of
`runtime.result.Retrieved`. On the device (`runtime.serving.post.DevicePost`, `expand_beams`): the rows
packed into one int64 buffer (`PostLayout`), with no host synchronisation (a CUDA graph captures
it), every request holding at most C pairs (the capacity the caller chose; a request whose beams
reach more overflows, and its `reached` count says so); two implementations of that one contract,
and `expand_beams` picks:
  triton  Triton kernels around the exact filter's (`kernel`): many programs per request, a tile of
          slots each, whose work grows with the pairs the beams reach; each ad's best slot found
          in a hash table; on CUDA tensors
  torch   the reference (`reference`): whole-tensor ops, a sort along the C slots to dedupe; on
          CPU tensors
Both rank with the same sorts (`rank`), and give every count and every row in use bit for bit, as
the host path gives them, for every request that did not overflow (tests compare all three, the
kernels under TRITON_INTERPRET=1); rows past those in use are unspecified.
"""

from __future__ import annotations

import torch

from runtime.ops.expand.host import expand_host
from runtime.ops.expand.layout import DEFAULT_PAIRS, MAX_PAIRS, RANKS, RRF_K, PostLayout
from runtime.ops.expand.reference import expand_reference
from runtime.ops.impl import Impl, resolve_impl

__all__ = ["DEFAULT_PAIRS", "MAX_PAIRS", "RANKS", "RRF_K", "PostLayout", "expand_beams", "expand_host"]


def expand_beams(layout: PostLayout, arrays: dict[str, torch.Tensor], ad_order: torch.Tensor,
                 steps: dict[str, tuple[int, ...]], requests, beams, max_values: int,
                 impl: Impl | str = Impl.AUTO) -> torch.Tensor:
    """The post stage of one batch: (layout.size,) int64, the buffer `PostLayout` describes.

    arrays: the post arrays by contract name (`ServedIndex.post` or `runtime.serving.post.post_tensors`):
      leaf_ad_offsets (S+1,) int64, leaf_ads (P,) int32/int64 catalog rows, ads (N,) int64 ad ids,
      ad_value (N,) float64 when the layout has values, ad_state (N,) uint8 when updates wrote it,
      and the exact filter's (`runtime.ops.exact_filter`).
    ad_order: (N,) int64 each row's place in ascending ad_id order. steps: per values plane its
    binary-search steps (`runtime.index.served.PostBounds`). requests: the batch's device form
    (`runtime.requests.to_device`). beams: tokens (B, K, L) int64, score (B, K) float32, leaf (B, K)
    int64. max_values: the reference's static query bound. impl: "triton", "torch" or "auto"
    (triton on CUDA tensors, torch elsewhere).
    """
    if resolve_impl(impl, beams.score.device, op="the post stage") is Impl.TRITON:
        from runtime.ops.expand.kernel import expand_triton  # triton only where it runs

        return expand_triton(layout, arrays, ad_order, steps, requests, beams, max_values)
    return expand_reference(layout, arrays, ad_order, steps, requests, beams, max_values)
