"""The CD+GTM mask of one beam-search step: for each beam, its trie node's children that pass the
mode's tests, scored beam_score + logp[token]; -inf for every other token.

`gtm_mask` runs the Triton kernel on CUDA tensors and the numba matcher on CPU tensors; the plain
torch reference runs anywhere. All three give the same result (tests compare them, the kernel
under TRITON_INTERPRET=1).
"""

from __future__ import annotations

import torch

from runtime.ops.gtm_mask.reference import gtm_mask_reference

MODES = ("cd", "cd+gtm", "cd+gtm+kway")


def gtm_mask(index, requests, depth: int, beam_request: torch.Tensor, beam_node: torch.Tensor,
             beam_score: torch.Tensor, logp: torch.Tensor, mode: str, impl: str = "auto") -> torch.Tensor:
    """(M, V) float32 candidate scores of the M beams at `depth`.

    beam_request: (M,) int64 request of each beam; beam_node: (M,) int64 its trie node (of depth
    `depth`); beam_score: (M,) float32 (-inf: a dead beam); logp: (M, V) float32 log-probabilities.
    impl: "triton", "numba" (CPU tensors), "torch" or "auto" (triton on CUDA, numba on the CPU)
    """
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    if mode == "cd+gtm+kway" and index.part_offsets is None:
        raise ValueError("mode cd+gtm+kway: this snapshot was built without k-way partitions ([kway] in the build config)")
    if impl == "auto":
        impl = "triton" if logp.is_cuda else "numba"
    if impl == "torch":
        return gtm_mask_reference(index, requests, depth, beam_request, beam_node, beam_score, logp, mode)
    if impl == "numba":
        from runtime.ops.gtm_mask.cpu import gtm_mask_cpu

        return gtm_mask_cpu(index, requests, depth, beam_request, beam_node, beam_score, logp, mode)
    from runtime.ops.gtm_mask.kernel import gtm_mask_triton

    return gtm_mask_triton(index, requests, depth, beam_request, beam_node, beam_score, logp.contiguous(), mode)
