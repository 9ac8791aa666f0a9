"""The codebook scorer's logits and log-probabilities in plain torch: the reference of the fused
kernel (`runtime.ops.codebook.kernel`), and the path off the GPU.

At a semantic level the logit of token j is -||r - C[j]||^2 / temperature, r the embedding's
residual after the beam's prefix, computed as (2 r.C - ||C||^2) / temperature (||r||^2 is the same
for every token and cancels in the softmax) in float64 and rounded once to float32: a float32
product's rounding depends on the blocking the matrix library picks for the batch's shape, so a
request's scores would change with the requests that share its batch. Every token of the hash
level gets logit 0; tokens beyond a level's size get -inf.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from runtime.ops.distribution import level_log_probs

NEG_INF = float("-inf")


@dataclass(frozen=True)
class CodebookTables:
    """A codebook on a device. centroids64: per semantic level (V_l, D) float64 (the reference's
    product); sizes: every level's tokens, the hash level's last; V: the logit width (the largest
    level); stack (S, Vs, D) float32 the S semantic levels' centroids padded with zeros to the
    largest, Vs tokens (the residuals); stack64_t (S, D, Vs) float64 transposed (the kernel's
    product); sq64 (S, Vs) float64 their squared norms."""

    centroids64: list[torch.Tensor]
    sizes: tuple[int, ...]
    V: int
    stack: torch.Tensor
    stack64_t: torch.Tensor
    sq64: torch.Tensor

    @classmethod
    def of(cls, centroids: list[torch.Tensor], sizes: tuple[int, ...], V: int) -> CodebookTables:
        """The tables of semantic levels' centroids (V_l, D) float32 on one device."""
        c64 = [c.double() for c in centroids]
        S, D, dev = len(centroids), centroids[0].shape[1], centroids[0].device
        Vs = max(len(c) for c in centroids)
        stack = torch.zeros(S, Vs, D, dtype=torch.float32, device=dev)
        sq64 = torch.zeros(S, Vs, dtype=torch.float64, device=dev)
        for s, c in enumerate(c64):
            stack[s, :len(c)] = centroids[s]
            sq64[s, :len(c)] = (c * c).sum(dim=1)
        return cls(c64, tuple(sizes), V, stack, stack.double().transpose(1, 2).contiguous(), sq64)

    @property
    def semantic(self) -> int:
        """The semantic levels (the steps before the hash level)."""
        return len(self.centroids64)


def codebook_logits(tables: CodebookTables, x: torch.Tensor, temperature: float, step: int,
                    prefix: torch.Tensor) -> torch.Tensor:
    """(B, K, V) float32 logits of step `step` for embeddings x (B, D) float32 and prefixes
    prefix (B, K, step) int64."""
    B, K, _ = prefix.shape
    out = torch.full((B, K, tables.V), NEG_INF, device=x.device)
    if step >= tables.semantic:  # the hash level
        out[..., :tables.sizes[step]] = 0.0
        return out
    r = x[:, None, :].expand(B, K, -1)
    for p in range(step):
        r = r - tables.stack[p][prefix[..., p]]  # a token's row: its centroid (the padding is never read)
    c = tables.centroids64[step]
    out[..., :len(c)] = ((2 * r.double() @ c.T - tables.sq64[step, :len(c)]) / temperature).float()
    return out


def codebook_log_probs_reference(tables: CodebookTables, x: torch.Tensor, temperature: float, step: int,
                                 prefix: torch.Tensor, size: int) -> torch.Tensor:
    """(B, K, V) float32 `level_log_probs` of `codebook_logits` over the level's first `size`."""
    return level_log_probs(codebook_logits(tables, x, temperature, step, prefix), size)
