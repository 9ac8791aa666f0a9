"""The compact layout's bookkeeping as two Triton kernels (`slots`: their torch reference): a
search step spends its GPU time on the mask and top-k, and the dozen small torch ops that lay out
slots and decode the chosen ones cost more in launches than in work, so each side is one launch.

  _layout_kernel  one program per request: each beam's child count (0 if dead), first child entry
                  and first slot (a running prefix sum over the request's beams), and the total
  _decode_kernel  one lane per chosen slot: its beam (binary search of the starts), child entry,
                  token and child node, and the beam's tokens so far with the new one appended
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

CHUNK = 1024  # beams a layout program takes per round


@triton.jit
def beam_of_slot(start, s, K, mask, LOG_K: tl.constexpr):
    """The beam of each slot s: the last k in [0, K) with start[k] <= s (start: one request's (K,)
    first slots, rising; LOG_K >= log2(K) halvings). Lanes off `mask` load nothing."""
    k = tl.zeros(s.shape, dtype=tl.int64)
    hi = k + K
    for _ in tl.static_range(LOG_K):
        mid = (k + hi) // 2
        go = tl.load(start + mid, mask=mask, other=0) <= s
        k, hi = tl.where(go, mid, k), tl.where(go, hi, mid)
    return k


@triton.jit
def _layout_kernel(node, score, node_offsets, start, count, first, total, K, CHUNK: tl.constexpr):
    b = tl.program_id(0).to(tl.int64)
    carry = tl.sum(tl.zeros([CHUNK], dtype=tl.int64), axis=0)
    for c0 in range(0, K, CHUNK):
        i = c0 + tl.arange(0, CHUNK)
        m = i < K
        nd = tl.maximum(tl.load(node + b * K + i, mask=m, other=0), 0)  # a dead beam's node is -1
        live = m & (tl.load(score + b * K + i, mask=m, other=float("-inf")) > float("-inf"))
        lo = tl.load(node_offsets + nd, mask=m, other=0)
        cnt = tl.where(live, tl.load(node_offsets + nd + 1, mask=m, other=0) - lo, 0)
        end = tl.cumsum(cnt, axis=0) + carry
        tl.store(start + b * K + i, end - cnt, mask=m)
        tl.store(count + b * K + i, cnt, mask=m)
        tl.store(first + b * K + i, lo, mask=m)
        carry = carry + tl.sum(cnt, axis=0)
    tl.store(total + b, carry)


@triton.jit
def _decode_kernel(flat, chosen, start, count, first, csr_tokens, csr_child_nodes, tokens, parent_out, tok_out,
                   child_out, tokens_out, K, N, D: tl.constexpr, LOG_K: tl.constexpr, BLOCK: tl.constexpr):
    b = tl.program_id(0).to(tl.int64)
    j = tl.program_id(1).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    m = j < N
    s = tl.load(flat + b * N + j, mask=m, other=0)
    alive = m & (tl.load(chosen + b * N + j, mask=m, other=float("-inf")) > float("-inf"))
    k = beam_of_slot(start + b * K, s, K, m, LOG_K)
    c = s - tl.load(start + b * K + k, mask=m, other=0)
    ok = alive & (c < tl.load(count + b * K + k, mask=m, other=0))
    e = tl.load(first + b * K + k, mask=ok, other=0) + c
    tok = tl.where(ok, tl.load(csr_tokens + e, mask=ok, other=0).to(tl.int64), 0)
    child = tl.where(ok, tl.load(csr_child_nodes + e, mask=ok, other=0).to(tl.int64), -1)
    row = b * N + j
    tl.store(parent_out + row, k, mask=m)
    tl.store(tok_out + row, tok, mask=m)
    tl.store(child_out + row, child, mask=m)
    for t in tl.static_range(D):
        tl.store(tokens_out + row * (D + 1) + t, tl.load(tokens + (b * K + k) * D + t, mask=m, other=0), mask=m)
    tl.store(tokens_out + row * (D + 1) + D, tok, mask=m)


def slots_triton(index, node: torch.Tensor,
                 score: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """`slots.slots_of` in one launch: the layout's start, count, total and first (`slots.Slots`).
    node, score: (B, K) int64 / float32 contiguous."""
    B, K = node.shape
    start, count, first = (torch.empty((B, K), dtype=torch.int64, device=node.device) for _ in range(3))
    total = torch.empty(B, dtype=torch.int64, device=node.device)
    if B:
        _layout_kernel[(B,)](node, score, index.gtm.node_offsets, start, count, first, total, K,
                             CHUNK=min(CHUNK, triton.next_power_of_2(K)), num_warps=4)
    return start, count, total, first


def decode_triton(index, start: torch.Tensor, count: torch.Tensor, first: torch.Tensor, flat: torch.Tensor,
                  chosen: torch.Tensor, tokens: torch.Tensor):
    """`slots.decode` in one launch. start, count, first: (B, K) int64 the layout's (`slots.Slots`);
    flat: (B, N) int64 chosen slots; chosen: (B, N) float32 their scores (-inf: dead); tokens:
    (B, K, D) int64 the beams' tokens so far."""
    B, N = flat.shape
    K, D = start.shape[1], tokens.shape[2]
    parent, tok, child = (torch.empty((B, N), dtype=torch.int64, device=flat.device) for _ in range(3))
    out = torch.empty((B, N, D + 1), dtype=torch.int64, device=flat.device)
    if B and N:
        BLOCK = 128
        g = index.gtm
        _decode_kernel[(B, triton.cdiv(N, BLOCK))](
            flat.contiguous(), chosen.contiguous(), start, count, first, g.csr_tokens,
            g.csr_child_nodes, tokens.contiguous(), parent, tok, child, out, K, N, D=D,
            LOG_K=max(1, (K - 1).bit_length()), BLOCK=BLOCK, num_warps=4)
    return parent, tok, child, out
