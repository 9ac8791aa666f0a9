"""The CD+GTM mask of one beam-search step: for each beam, its trie node's children that pass the
mode's tests, scored beam_score + logp[token]; -inf for every other token.

`gtm_mask` runs the Triton kernel on CUDA tensors and the numba matcher on CPU tensors; the plain
torch reference runs anywhere. All three give the same result (tests compare them, the kernel
under TRITON_INTERPRET=1). They read the trie through `ServedIndex.gtm` and the requests through
their device form (`runtime.requests.to_device`), and branch on the mode's properties.
"""

from __future__ import annotations

import torch

from runtime.ops.gtm_mask.reference import gtm_mask_reference
from sidindex.modes import Mode


def gtm_mask(index, requests, depth: int, beam_request: torch.Tensor, beam_node: torch.Tensor,
             beam_score: torch.Tensor, logp: torch.Tensor, mode: Mode, impl: str = "auto") -> torch.Tensor:
    """(M, V) float32 candidate scores of the M beams at `depth`.

    index: a ServedIndex; requests: EncodedRequests on the index's device.
    beam_request: (M,) int64 request of each beam; beam_node: (M,) int64 its trie node (of depth
    `depth`); beam_score: (M,) float32 (-inf: a dead beam); logp: (M, V) float32 log-probabilities.
    mode: a constrained Mode the index can serve (the caller parsed it, `sidindex.modes.parse_mode`).
    impl: "triton", "numba" (CPU tensors), "torch" or "auto" (triton on CUDA, numba on the CPU)
    """
    if impl == "auto":
        impl = "triton" if logp.is_cuda else "numba"
    if impl == "torch":
        return gtm_mask_reference(index, requests, depth, beam_request, beam_node, beam_score, logp, mode)
    if impl == "numba":
        from runtime.ops.gtm_mask.cpu import gtm_mask_cpu

        return gtm_mask_cpu(index, requests, depth, beam_request, beam_node, beam_score, logp, mode)
    from runtime.ops.gtm_mask.kernel import gtm_mask_triton

    return gtm_mask_triton(index, requests, depth, beam_request, beam_node, beam_score, logp.contiguous(), mode)
