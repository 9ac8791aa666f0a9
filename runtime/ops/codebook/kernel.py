"""The codebook scorer's log-probabilities at a semantic level as one Triton kernel: the residual,
the float64 product, the rounding to float32, the NaN guard and the log-softmax of a row, in one
pass that writes only the (M, V) result (`reference.codebook_log_probs_reference` computes the same
in a dozen torch kernels, each a pass over M x V floats or doubles).

One program per block of BM beams, the level's whole row in its registers (BV >= the level's
tokens), so a beam's row is computed alike whatever beams share its batch or block: a request's
scores do not depend on its batch. A residual subtracts the prefix's centroids in float32 in
prefix order, as the reference does; the product accumulates the embedding's D coordinates one by
one in float64.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from runtime.ops.codebook.reference import CodebookTables

ROW_VALUES = 8192  # float64 accumulators a program holds (BM x BV): 64 a thread at 4 warps


@triton.jit
def _log_probs_kernel(out, residual, x, prefix, stack, stack64_t, sq64, temperature, M, K, D, s_pb, s_pk, s_pp,
                      VS: tl.constexpr, STEP: tl.constexpr, N: tl.constexpr, SIZE: tl.constexpr, V: tl.constexpr,
                      BV: tl.constexpr, BM: tl.constexpr, BD: tl.constexpr):
    """out[m, j] (M, V) float32, m = b K + k: the log-softmax over tokens j < SIZE of the logits
    (2 r.C[j] - |C[j]|^2) / temperature of level STEP's N tokens, r = x[b] - sum_p stack[p,
    prefix[b, k, p]] (-inf for j >= N); -inf for j >= SIZE. residual: (M, D) float32 scratch."""
    rows = tl.program_id(0) * BM + tl.arange(0, BM)
    live = rows < M
    m = tl.where(live, rows, 0).to(tl.int64)
    b, k = m // K, m % K
    # 1. the residuals, a tile of BD coordinates at a time (row loads), parked in the scratch rows
    for d0 in range(0, D, BD):
        dims = d0 + tl.arange(0, BD)
        inside = live[:, None] & (dims < D)[None, :]
        r = tl.load(x + b[:, None] * D + dims[None, :], mask=inside, other=0.0)
        for p in tl.static_range(STEP):
            t = tl.load(prefix + b * s_pb + k * s_pk + p * s_pp)
            r = r - tl.load(stack + ((p * VS + t) * D)[:, None] + dims[None, :], mask=inside, other=0.0)
        tl.store(residual + m[:, None] * D + dims[None, :], r, mask=inside)
    tl.debug_barrier()  # the block's threads read one another's residual coordinates below
    # 2. the product, one coordinate at a time: an outer product of the block's residuals and the
    # level's centroids (transposed: a coordinate's centroids are contiguous)
    cols = tl.arange(0, BV)
    acc = tl.zeros((BM, BV), dtype=tl.float64)
    for d in range(D):
        r = tl.load(residual + m * D + d)  # (BM,) float32
        c = tl.load(stack64_t + (STEP * D + d) * VS + cols, mask=cols < VS, other=0.0)  # (BV,) float64
        acc += (r.to(tl.float64) * 2.0)[:, None] * c[None, :]
    # 3. the logits in float32, the NaN guard and the row's log-softmax
    sq = tl.load(sq64 + STEP * VS + cols, mask=cols < VS, other=0.0)
    logit = ((acc - sq[None, :]) / tl.load(temperature)).to(tl.float32)
    level = (cols < SIZE)[None, :]
    finite = (logit == logit) & (tl.abs(logit) < float("inf"))  # NaN and +-inf count as -inf
    logit = tl.where(((cols < N) & (cols < SIZE))[None, :] & finite, logit, float("-inf"))
    top = tl.max(logit, axis=1)  # -inf for a row with no finite logit: NaN below, as log_softmax gives
    shifted = logit - top[:, None]
    logp = shifted - tl.log(tl.sum(tl.exp(shifted), axis=1))[:, None]
    tl.store(out + m[:, None] * V + cols[None, :], tl.where(level, logp, float("-inf")),
             mask=live[:, None] & (cols < V)[None, :])


def fits(tables: CodebookTables) -> bool:
    """The kernel holds a row of the widest semantic level (and the logit width) in a program."""
    return triton.next_power_of_2(max(tables.stack.shape[1], tables.V)) <= ROW_VALUES


def codebook_log_probs_triton(tables: CodebookTables, x: torch.Tensor, temperature: torch.Tensor, step: int,
                              prefix: torch.Tensor, size: int) -> torch.Tensor:
    """(B, K, V) float32 log-probabilities of semantic level `step` (< the semantic levels; `fits`)
    for embeddings x (B, D) float32 and prefixes (B, K, step) int64; temperature: (1,) float64 on
    the device; size: the level's tokens the distribution covers."""
    B, K, _ = prefix.shape
    S, VS, D = tables.stack.shape
    M, V = B * K, tables.V
    out = torch.empty(B, K, V, dtype=torch.float32, device=x.device)
    if M == 0:
        return out
    BV = triton.next_power_of_2(max(VS, V))
    BM = max(1, min(16, ROW_VALUES // BV))
    s_pb, s_pk, s_pp = prefix.stride() if prefix.shape[2] else (0, 0, 0)
    residual = torch.empty(M, D, dtype=torch.float32, device=x.device)
    _log_probs_kernel[(triton.cdiv(M, BM),)](
        out, residual, x.contiguous(), prefix, tables.stack, tables.stack64_t, tables.sq64, temperature, M, K, D,
        s_pb, s_pk, s_pp, VS=VS, STEP=step, N=len(tables.centroids64[step]), SIZE=min(size, V), V=V, BV=BV, BM=BM,
        BD=min(64, triton.next_power_of_2(D)), num_warps=4)
    return out
