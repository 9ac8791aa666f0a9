"""The CD+GTM mask of one beam-search step: for each beam, its trie node's children that pass the
mode's tests, scored beam_score + logp[token]; -inf for every other token. `gtm_mask` gives it
per token (M, V), as Hugging Face's processor needs it; `gtm_candidates` in the compact layout of
`slots` (per request, the beams' child entries only), as the beam search selects from it.

`gtm_mask` runs the Triton kernel on CUDA tensors and the numba matcher on CPU tensors; the plain
torch reference runs anywhere. All three give the same result (tests compare them, the kernel
under TRITON_INTERPRET=1). They read the trie through `ServedIndex.gtm` and the requests through
their device form (`runtime.requests.to_device`), and branch on the mode's properties.
"""

from __future__ import annotations

import torch

from runtime.ops.gtm_mask.reference import gtm_mask_reference, value_key
from runtime.ops.impl import Impl, resolve_impl
from runtime.ops.slots import Slots, compact
from sidindex.modes import Mode


def mask_impl(impl: Impl | str, device: torch.device) -> Impl:
    """The mask implementation `impl` names on `device` (`runtime.ops.impl`: "auto" is triton on
    CUDA, numba elsewhere); the compact layout's bookkeeping runs its kernels with the mask's."""
    return resolve_impl(impl, device, op="the CD+GTM mask", host=Impl.NUMBA)


def gtm_mask(index, requests, depth: int, beam_request: torch.Tensor, beam_node: torch.Tensor,
             beam_score: torch.Tensor, logp: torch.Tensor, mode: Mode, impl: Impl | str = Impl.AUTO,
             with_bound: bool = False, value_weight: float = 0.0):
    """(M, V) float32 candidate scores of the M beams at `depth`. With `with_bound`, also (M, V)
    float32 each candidate's value bound (docs/design.md §16: the largest value of an ad beneath it that
    can pass, from `entry_value`, or the passing partitions' `part_value` in k-way mode; 0 where
    no candidate is); with value_weight > 0 instead, (M, V) float32 the value-guided key
    (`reference.value_key`; -inf where no candidate is). The index must carry values then.

    index: a ServedIndex; requests: EncodedRequests on the index's device.
    beam_request: (M,) int64 request of each beam; beam_node: (M,) int64 its trie node (of depth
    `depth`); beam_score: (M,) float32 (-inf: a dead beam); logp: (M, V) float32 log-probabilities.
    mode: a constrained Mode the index can serve (the caller parsed it, `sidindex.modes.parse_mode`).
    impl: an `Impl` ("auto": triton on CUDA, numba on the CPU; `mask_impl`)
    """
    impl = mask_impl(impl, logp.device)
    if impl is Impl.TRITON:
        from runtime.ops.gtm_mask.kernel import gtm_mask_triton

        return gtm_mask_triton(index, requests, depth, beam_request, beam_node, beam_score, logp.contiguous(), mode,
                               with_bound, value_weight)
    args = (index, requests, depth, beam_request, beam_node, beam_score, logp, mode, with_bound or value_weight > 0)
    if impl is Impl.TORCH:
        got = gtm_mask_reference(*args)
    else:
        from runtime.ops.gtm_mask.cpu import gtm_mask_cpu

        got = gtm_mask_cpu(*args)
    if value_weight > 0:
        score, bound = got
        return score, value_key(score, bound, value_weight)
    return got


def gtm_candidates(index, requests, depth: int, slots: Slots, beam_node: torch.Tensor, beam_score: torch.Tensor,
                   logp: torch.Tensor, mode: Mode, impl: Impl | str = Impl.AUTO, value_weight: float = 0.0,
                   prepare=None):
    """(B, W) float32 candidate scores of a step's B*K beams in the compact layout `slots`
    (`slots.compact` of `gtm_mask`'s): slot j of request b holds its child's beam_score + logp
    where the child passes `mode`, -inf elsewhere and in unused slots. With value_weight > 0, also
    (B, W) float32 the value-guided key (-inf where no candidate is).

    beam_node, beam_score: (B*K,) int64 / float32 request-major; logp: (B*K, V) float32. The
    Triton kernel writes the layout directly; the torch reference and the numba path lay out
    their dense masks. prepare: a `prepare.Plan` the Triton kernel makes in the same launch.
    """
    impl = mask_impl(impl, logp.device)
    if impl is Impl.TRITON:
        from runtime.ops.gtm_mask.kernel import gtm_mask_triton

        return gtm_mask_triton(index, requests, depth, beam_node, beam_node, beam_score, logp.contiguous(), mode,
                               value_weight=value_weight, slots=slots, prepare=prepare)
    B, K = slots.start.shape
    req = torch.arange(B, device=logp.device).repeat_interleave(K)
    got = gtm_mask(index, requests, depth, req, beam_node, beam_score, logp, mode, impl, value_weight=value_weight)
    if value_weight > 0:
        return compact(index, got[0], slots), compact(index, got[1], slots)
    return compact(index, got, slots)
