"""The built-in codebook scorer (DESIGN.md §8): logits without a trained model.

At a semantic level l the logit of token j is -||r - C_l[j]||^2 / temperature, with r the request
embedding's residual after the beam's prefix (r = x - sum_{p<l} C_p[t_p]): the same residual
quantisation that assigned the catalog's SIDs, so the best-scoring SIDs are the request's nearest
ones. The hash level carries no meaning: every token in range gets logit 0. Tokens beyond a
level's size get -inf. Computed as 2 r.C - ||C||^2 (the ||r||^2 term is the same for every token
and cancels in the softmax).
"""

from __future__ import annotations

import torch

from sidindex.sid.codebook import Codebook


class CodebookScorer:
    """scorer(step, prefix (B, K, step) int64) -> (B, K, V) float32 logits, for request embeddings
    `embedding` (B, D) float32."""

    def __init__(self, codebook: Codebook, embedding: torch.Tensor, temperature: float = 1.0) -> None:
        dev = embedding.device
        self.x = embedding.float()
        self.centroids = [torch.from_numpy(c).to(dev) for c in codebook.centroids]
        self.sq_norms = [(c * c).sum(dim=1) for c in self.centroids]
        self.sizes, self.V, self.temperature = codebook.level_sizes, codebook.vocab_size, temperature

    def prefix_independent(self, step: int) -> bool:
        """True when the logits of `step` do not depend on the prefix (the hash level): an
        exhaustive scan asks once instead of once per trie node."""
        return step >= len(self.centroids)

    def __call__(self, step: int, prefix: torch.Tensor) -> torch.Tensor:
        B, K, _ = prefix.shape
        out = torch.full((B, K, self.V), float("-inf"), device=self.x.device)
        if step >= len(self.centroids):  # the hash level
            out[..., :self.sizes[step]] = 0.0
            return out
        r = self.x[:, None, :].expand(B, K, -1)
        for p in range(step):
            r = r - self.centroids[p][prefix[..., p]]
        c = self.centroids[step]
        out[..., :len(c)] = (2 * r @ c.T - self.sq_norms[step]) / self.temperature
        return out
