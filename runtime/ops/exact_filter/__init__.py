"""The exact ad-level filter of the device post stage (`runtime.serving.post.DevicePost`, docs/design.md §3):
per matcher plane, does each (request, slot) pair's ad pass the plane's attributes for its request
exactly (`sidindex.exact`, the same tests as its numba passes; Bloom false positives stop
here). `exact_filter` runs the Triton kernels on CUDA tensors (one launch per plane) and the plain
torch reference on CPU tensors; both give the same result (tests compare them, the kernels under
TRITON_INTERPRET=1), and neither synchronises with the host, so a CUDA graph can capture either.
"""

from __future__ import annotations

import torch

from runtime.ops.exact_filter.reference import exact_filter_reference, held_slots
from runtime.ops.impl import Impl, resolve_impl


def exact_filter(arrays: dict[str, torch.Tensor], requests, ad: torch.Tensor, steps: dict[str, tuple[int, ...]],
                 max_values: int, impl: Impl | str = Impl.AUTO, live: torch.Tensor | None = None) -> list[torch.Tensor]:
    """Per matcher plane (`MATCHER_PLANES` order) (B, C) bool: ad `ad[b, c]` passes every attribute
    of the plane for request b. A `rows` plane: on every word group ANY of the request's queries q
    has (row & q) == q; a `values` plane: per attribute the ad has no values or ANY request value
    is among its hashes. Slots holding no real pair may return anything, but read nothing out of
    bounds (ads are clamped into the catalog).

    arrays: the post arrays (`ServedIndex.post` or `runtime.serving.post.post_tensors`): per rows plane
      `exact_<p>_rows` (N, W) int64; per values plane `exact_<p>_hash_offsets` (A*(N+1),) int64 and
      `exact_<p>_hashes` (H,) int64, uint64 bits sorted as unsigned within each ad.
    requests: the batch's device form (`runtime.requests.to_device`): `planes` (per plane
      `PlaneQueries`, rows (Q, W) int64, ranges (B, G, 2) int64, word_offsets on the host) and
      `exact` (per values plane `ExactQueries`, hash_offsets (A, B+1) int64, hashes (R,) int64).
    ad: (B, C) int64 catalog rows. steps: per values plane its binary-search steps per attribute
    (`runtime.index.served.PostBounds.steps`). max_values: the most queries or values a request has for one
    group or attribute (the reference's static shape; the kernels loop to the actual counts).
    impl: an `Impl` other than numba ("auto": triton on CUDA tensors, torch elsewhere).
    live: None, or (B,) int64: only request b's first live[b] slots hold pairs; the others are
      False, and the kernels read nothing for them (the post kernels compact each request's pairs).
    """
    if resolve_impl(impl, ad.device, op="the exact filter") is Impl.TRITON:
        from runtime.ops.exact_filter.kernel import exact_filter_triton  # triton only where it runs

        return exact_filter_triton(arrays, requests, ad, steps, live)
    out = exact_filter_reference(arrays, requests, ad, steps, max_values)
    if live is None:
        return out
    B, C = ad.shape
    held = held_slots(live, B, C, ad.device)
    return [p & held for p in out]
