"""The compact candidate layout of a search step (docs/design.md §8).

Only a beam's child entries can be candidates, so a step lays out, per request, its beams' child
entries one beam after another: slot `start[b, k] + c` of request b is child c of beam k (children
in token order, so slots keep the (beam, token) order of the dense (K, V) layout: the order the
search's top-k breaks ties by, `runtime.ops.order.top_k`), and slots past `total[b]` are empty.
The width is fixed on the host, so shapes never depend on the data and the step can be captured
in a CUDA graph: by default the bound `ServedIndex.most_children` (the K widest nodes of the
depth), or a cap below it, where a request with more child entries keeps only its first `width`
(`runtime.search.beam.beam_search`'s widths: the search flags it). Top-k then selects among `width`
slots instead of K x V, and a selected slot names its child entry directly: no search for the
(node, token) pair.

Legend: B requests, K beams each, V the logit width, W the layout's width.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

NEG_INF = float("-inf")


@dataclass(frozen=True)
class Slots:
    """start: (B, K) int64 first slot of each beam's children; count: (B, K) int64 its children (0
    for a dead beam); total: (B,) int64 slots in use; first: (B, K) int64 each beam's first child
    entry; width: slots per request (host int)."""

    start: torch.Tensor
    count: torch.Tensor
    total: torch.Tensor
    first: torch.Tensor
    width: int


def slots_of(index, node: torch.Tensor, score: torch.Tensor, width: int, kernel: bool = False) -> Slots:
    """The layout of beams at trie nodes `node` (B, K) int64 with scores `score` (B, K) float32
    (-inf: dead, no children); `width`: slots per request (`total` may exceed it: the slots past
    `width` are not laid out). kernel: in one Triton launch (`kernel`; CUDA tensors, or the
    interpreter), else these torch ops."""
    if kernel:
        from runtime.ops.slots.kernel import slots_triton

        return Slots(*slots_triton(index, node.contiguous(), score.contiguous()), width)
    off, node = index.gtm.node_offsets, node.clamp(min=0)  # a dead beam's node is -1
    first = off[node]
    count = torch.where(score > NEG_INF, off[node + 1] - first, 0)
    end = count.cumsum(1)
    return Slots(end - count, count, end[:, -1].contiguous(), first, width)  # the kernel reads them flat


def beam_of(slots: Slots, slot: torch.Tensor) -> torch.Tensor:
    """(B, n) int64 the beam each slot (B, n) int64 belongs to: the last beam starting at or before
    it (clamped to K-1 past `total`)."""
    return (torch.searchsorted(slots.start, slot.contiguous(), right=True) - 1).clamp(0, slots.start.shape[1] - 1)


def entries(slots: Slots, slot: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """For slots (B, n) int64: their beam (B, n) int64, child entry (B, n) int64 and whether the slot
    is in use (B, n) bool (the entry is meaningless where it is not)."""
    k = beam_of(slots, slot)
    c = slot - slots.start.gather(1, k)
    used = c < slots.count.gather(1, k)
    return k, torch.where(used, slots.first.gather(1, k) + c, 0), used


def every_entry(slots: Slots) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`entries` of every slot of the layout: (B, W) int64 beams, child entries, and (B, W) bool in use."""
    B = slots.start.shape[0]
    return entries(slots, torch.arange(slots.width, device=slots.start.device).expand(B, -1))


def decode(index, slots: Slots, flat: torch.Tensor, chosen: torch.Tensor, tokens: torch.Tensor,
           kernel: bool = False) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The beams top-k chose: flat (B, N) int64 slots with scores chosen (B, N) float32 (-inf:
    dead). Returns their parent beam (B, N) int64, token (B, N) int64 (0 when dead), child node
    (B, N) int64 (-1 when dead) and tokens (B, N, D+1) int64, the parent's tokens (B, K, D) with
    the token appended. kernel: in one Triton launch (`kernel`), else these torch ops."""
    if kernel:
        from runtime.ops.slots.kernel import decode_triton

        return decode_triton(index, slots.start, slots.count, slots.first, flat, chosen, tokens)
    alive = chosen > NEG_INF
    parent, e, _ = entries(slots, flat)
    tok = torch.where(alive, index.gtm.csr_tokens[e].long(), 0)
    child = torch.where(alive, index.gtm.csr_child_nodes[e].long(), -1)
    D = tokens.shape[2]
    return parent, tok, child, torch.cat([tokens.gather(1, parent[..., None].expand(-1, -1, D)), tok[..., None]], 2)


def compact(index, dense: torch.Tensor, slots: Slots, fill: float = NEG_INF) -> torch.Tensor:
    """(B, W) the dense (B*K, V) per-token values laid out in slots; `fill` in unused slots. The
    reference of the kernel's compact output (and the CPU path's)."""
    B, K = slots.start.shape
    k, e, used = every_entry(slots)
    tok = index.gtm.csr_tokens[e].long()
    got = dense.reshape(B, K, -1)[torch.arange(B, device=dense.device)[:, None], k, tok]
    return torch.where(used, got, fill)
