"""The one distribution of a search step: a level's log-probabilities from a scorer's logits
(`runtime.search.beam`, `runtime.search.hf`, `runtime.studies.simulate`, `runtime.search.sharded`,
and the reference of the codebook scorer's fused kernel, `runtime.ops.codebook`)."""

from __future__ import annotations

import torch

from runtime.ops.impl import Impl, resolve_impl

NEG_INF = float("-inf")


def level_log_probs(logits: torch.Tensor, size: int) -> torch.Tensor:
    """(..., V) float32 log-probabilities of a level of `size` tokens from logits (..., V): the
    log-softmax over the first `size` logits, -inf beyond them whatever the logits are there. Only
    finite logits count: a NaN or infinite one is taken as -inf, so its token is never chosen and
    the rest of its row keeps its distribution (no NaN); a row with no finite logit among the
    level's is NaN throughout (never chosen either; `scored_rows` tells them apart). `size` is a
    host int: a slice, no host synchronisation."""
    logits = logits.float()
    V = logits.shape[-1]
    level = (logits if size >= V else logits[..., :size]).nan_to_num(nan=NEG_INF, posinf=NEG_INF, neginf=NEG_INF)
    if size >= V:
        return torch.log_softmax(level, dim=-1)
    return torch.nn.functional.pad(torch.log_softmax(level, dim=-1), (0, V - size), value=NEG_INF)


def scored_rows(logp: torch.Tensor) -> torch.Tensor:
    """(...) bool: which rows of log-probabilities logp (..., V) (`level_log_probs`) had a finite
    logit. Such a row holds no NaN, and a row without one is NaN throughout, so its first entry
    tells: no pass over the row, no synchronisation."""
    return ~logp[..., 0].isnan()


def unscored(logp: torch.Tensor, score: torch.Tensor, impl: Impl | str = Impl.AUTO) -> torch.Tensor:
    """(B,) bool: the request has live beams (score (B, K) float32 > -inf) and none of them has a
    finite logit (`scored_rows` of logp (B, K, V) float32). On the device, no
    synchronisation: a captured search records it too. impl: "auto" (one Triton kernel on CUDA,
    `runtime.ops.distribution.kernel`; these torch ops elsewhere), "triton" or "torch"."""
    if resolve_impl(impl, score.device, op="the scored check") is Impl.TRITON and logp.is_contiguous() \
            and logp.shape[1] > 0:
        from runtime.ops.distribution.kernel import unscored_triton  # triton only where it runs

        return unscored_triton(logp, score)
    live = score > NEG_INF
    return live.any(dim=1) & ~(live & scored_rows(logp)).any(dim=1)
