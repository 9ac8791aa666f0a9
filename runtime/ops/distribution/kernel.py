"""`runtime.ops.distribution.unscored` as one Triton kernel: per request, whether it has live beams
and none of them a finite logit (the torch reference takes eight small kernels a search step). One
program per request, its K beams in one block."""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _unscored_kernel(out, score, logp, K, s_row, BK: tl.constexpr):
    """out[b] (B,) uint8: some score[b, k] > -inf, and logp[b K + k, 0] (rows s_row apart) is NaN
    for every such k."""
    b = tl.program_id(0).to(tl.int64)
    k = tl.arange(0, BK)
    inside = k < K
    live = tl.load(score + b * K + k, mask=inside, other=float("-inf")) > float("-inf")
    first = tl.load(logp + (b * K + k) * s_row, mask=live, other=0.0)
    scored = live & (first == first)  # a row without a finite logit is NaN throughout
    tl.store(out + b, ((tl.max(live.to(tl.int32), axis=0) > 0) & (tl.max(scored.to(tl.int32), axis=0) == 0))
             .to(tl.uint8))


def unscored_triton(logp: torch.Tensor, score: torch.Tensor) -> torch.Tensor:
    """(B,) bool for logp (B, K, V) float32 (contiguous, K >= 1) and score (B, K) float32."""
    B, K, _ = logp.shape
    out = torch.empty(B, dtype=torch.uint8, device=score.device)
    if B:
        _unscored_kernel[(B,)](out, score.contiguous(), logp, K, logp.stride(1), BK=triton.next_power_of_2(K))
    return out.view(torch.bool)
