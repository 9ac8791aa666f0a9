"""The ranking keys of `runtime.ops.order.position_keys` as one Triton kernel: a float32 score's
order-preserving bits times 2^32, less its position, in one pass (the torch reference takes seven
kernels: a sign fold, a view, a shift, two masks, a widening and the position's subtraction). One
program per (block of BLOCK candidates, row)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK = 1024


@triton.jit
def _keys_kernel(out, score, pos, N, s_b, s_n, HAS_POS: tl.constexpr, BLOCK: tl.constexpr):
    """out[b, n] (B, N) int64 = ordered(score[b, n]) * 2^32 - (pos[b, n] if HAS_POS else n)."""
    b = tl.program_id(1).to(tl.int64)
    n = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    inside = n < N
    x = tl.load(score + b * s_b + n * s_n, mask=inside, other=0.0)
    x = tl.where(x == 0.0, 0.0, x)  # -0.0 and 0.0 compare equal: one key
    bits = x.to(tl.int32, bitcast=True)
    key = ((bits >> 31) & 0x7FFFFFFF) ^ bits  # a negative's magnitude bits flipped: monotonic as signed ints
    if HAS_POS:
        p = tl.load(pos + b * N + n, mask=inside, other=0)
    else:
        p = n
    tl.store(out + b * N + n, key.to(tl.int64) * 4294967296 - p, mask=inside)


def position_keys_triton(score: torch.Tensor, pos: torch.Tensor | None = None) -> torch.Tensor:
    """(B, N) int64 keys of score (B, N) float32 (any strides) and pos (B, N) int64 (None: each
    column's index); B < 65,536 (a grid dimension)."""
    B, N = score.shape
    out = torch.empty(B, N, dtype=torch.int64, device=score.device)
    if out.numel():
        _keys_kernel[(triton.cdiv(N, BLOCK), B)](out, score, out if pos is None else pos.contiguous(), N,
                                                 *score.stride(), HAS_POS=pos is not None, BLOCK=BLOCK)
    return out
