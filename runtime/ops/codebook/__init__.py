"""The built-in codebook scorer's step (`runtime.CodebookScorer`): a level's log-probabilities for
a batch's beams. `codebook_log_probs` runs the fused Triton kernel on CUDA tensors and the plain
torch reference elsewhere; both give the distribution `runtime.ops.distribution.level_log_probs`
gives of the scorer's logits (tests compare them, the kernel under TRITON_INTERPRET=1), to the
last bit where the level is uniform (the hash level) and to a few units in float32's last place
elsewhere.
"""

from __future__ import annotations

import torch

from runtime.ops.codebook.reference import CodebookTables, codebook_log_probs_reference, codebook_logits
from runtime.ops.impl import Impl, resolve_impl


def codebook_log_probs(tables: CodebookTables, x: torch.Tensor, temperature: float, step: int,
                       prefix: torch.Tensor, size: int, impl: Impl | str = Impl.AUTO,
                       temperature_t: torch.Tensor | None = None) -> torch.Tensor:
    """(B, K, V) float32 log-probabilities over the first `size` tokens of level `step` for
    embeddings x (B, D) float32 and the beams' prefixes (B, K, step) int64 (-inf beyond `size`).
    impl: "auto" (triton on CUDA, torch elsewhere), "triton" or "torch"; temperature_t: the
    temperature as a (1,) float64 tensor on x's device (the kernel reads it there; made here
    when None). The hash level is one uniform row, computed once and copied to every beam."""
    B, K, _ = prefix.shape
    if B * K == 0 or x.shape[0] != B:  # (the reference broadcasts a single embedding)
        return codebook_log_probs_reference(tables, x, temperature, step, prefix, size)
    if step >= tables.semantic:
        row = codebook_log_probs_reference(tables, x[:1], temperature, step, prefix[:1, :1], size)
        return row.expand(B, K, -1).contiguous()
    if resolve_impl(impl, x.device, op="the codebook scorer") is Impl.TRITON:
        from runtime.ops.codebook.kernel import codebook_log_probs_triton, fits  # triton only where it runs

        if fits(tables):
            if temperature_t is None:
                temperature_t = torch.full((1,), temperature, dtype=torch.float64, device=x.device)
            return codebook_log_probs_triton(tables, x, temperature_t, step, prefix, size)
    return codebook_log_probs_reference(tables, x, temperature, step, prefix, size)


__all__ = ["CodebookTables", "codebook_log_probs", "codebook_log_probs_reference", "codebook_logits"]
