"""One order for scores (docs/design.md §8): floats as integer keys that sort like them, and the search
step's top-k, whose ties fall to a fixed key rather than to the order a device's top-k leaves.

Hash-level tokens get equal logits, so a step's candidates often tie at the cut, and a float
top-k keeps whichever tied ones its algorithm meets first: CPU and CUDA, the dense and compact
layouts, and different widths kept different ones. `top_k` ranks by one int64 per candidate
instead, the score's order-preserving bits above its position below, so no two keys are equal and
every device, layout and width that lays candidates out in the same relative order picks and ranks
the same ones (`runtime.search.beam_search` lays them out by beam, then token). -0.0 and 0.0 are
one score; NaN has no place (callers turn it into -inf first).
"""

from __future__ import annotations

import torch

TIE_LIMIT = 1 << 32  # the positions a row's key holds below the score's 32 bits


def ordered(x: torch.Tensor) -> torch.Tensor:
    """int64 keys ordering the floats of x (float32 or float64, no NaN) ascending as signed ints;
    -0.0 and 0.0 get one key (they compare equal). float32 keys lie in [-2^31, 2^31)."""
    bits = (x + 0.0).view(torch.int32 if x.dtype == torch.float32 else torch.int64)  # + 0.0: -0.0 -> 0.0
    flip = bits >> (bits.element_size() * 8 - 1)  # all ones where x < 0: flip the magnitude's bits
    flip &= torch.iinfo(bits.dtype).max
    flip ^= bits  # monotonic in x, as signed ints
    return flip.long()


def descending(x: torch.Tensor) -> torch.Tensor:
    """int64 keys ordering the floats of x (float32 or float64, no NaN) descending as ascending
    ints; -0.0 and 0.0 one key; never the largest int64 (a sentinel of the rows sorted last)."""
    return -ordered(x) - 1


def score_key(x: torch.Tensor) -> torch.Tensor:
    """int64 keys in [0, 2^32) ordering float32 scores x descending as ascending ints."""
    return descending(x) + 2 ** 31


def top_k(score: torch.Tensor, k: int) -> torch.Tensor:
    """(B, k) int64 per row the positions of its k best scores, ranked: score (B, N) float32 (no NaN;
    -inf: no candidate) descending, ties to the lower position. One int64 key per candidate (the
    score's `ordered` bits x 2^32 + 2^32 - 1 - position) is top-k'd: on every device the same
    positions in the same order, and a -inf never ranks above a finite score. No host
    synchronisation. N <= 2^32 (ValueError otherwise)."""
    B, N = score.shape
    if N > TIE_LIMIT:
        raise ValueError(f"{N:,} candidates a row: at most {TIE_LIMIT:,} have distinct keys")
    key = ordered(score).mul_(TIE_LIMIT)  # |ordered| < 2^31: no overflow (a left shift of a negative is not defined)
    key += torch.arange(TIE_LIMIT - 1, TIE_LIMIT - 1 - N, -1, device=score.device)  # the lower position first
    return key.topk(k, dim=1, sorted=True).indices
