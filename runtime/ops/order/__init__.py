"""One order for scores (docs/design.md §8): floats as integer keys that sort like them, and the search
step's top-k, whose ties fall to a fixed key rather than to the order a device's top-k leaves.

Hash-level tokens get equal logits, so a step's candidates often tie at the cut, and a float
top-k keeps whichever tied ones its algorithm meets first: CPU and CUDA, the dense and compact
layouts, and different widths kept different ones. `top_k` ranks as one int64 per candidate
would, the score's order-preserving bits above its position below (it selects by the float score
first and keys only the k it keeps), so no two keys are equal and every device, layout and width
that lays candidates out in the same relative order picks and ranks the same ones
(`runtime.search.beam.beam_search` lays them out by beam, then token). -0.0 and 0.0 are one score; NaN
has no place (callers turn it into -inf first).
"""

from __future__ import annotations

import torch

from runtime.ops.impl import Impl, resolve_impl

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


def position_keys(score: torch.Tensor, pos: torch.Tensor | None = None, impl: Impl | str = Impl.AUTO) -> torch.Tensor:
    """(B, N) int64 ranking keys of float32 scores score (B, N) (no NaN) at positions pos (B, N)
    int64 (None: each column's index), below 2^32: `ordered(score)` x 2^32 - pos, so a higher score
    ranks first and, among equal scores, the lower position; no two positions of a row share a key.
    impl: "auto" (one Triton kernel on CUDA, `kernel`; these torch ops elsewhere), "triton" or
    "torch"."""
    if resolve_impl(impl, score.device, op="the ranking keys") is Impl.TRITON and score.shape[0] < 1 << 16 \
            and score.dtype == torch.float32:
        from runtime.ops.order.kernel import position_keys_triton  # triton only where it runs

        return position_keys_triton(score, pos)
    key = ordered(score).mul_(TIE_LIMIT)  # |ordered| < 2^31: no overflow
    return key.sub_(torch.arange(score.shape[1], device=score.device) if pos is None else pos)


FLOAT_FIRST = 1 << 16  # from this many candidates a row, `top_k` selects by the float score first (H100,
# B=16, k=1,024, in a CUDA graph: 1.85x the all-keys top-k at 2^19, equal at 2^16, 0.9x at 2^15)


def top_k(score: torch.Tensor, k: int, float_first: bool | None = None) -> torch.Tensor:
    """(B, k) int64 per row the positions of its k best scores, ranked: score (B, N) float32 (no NaN:
    callers turn it into -inf; -inf: no candidate) descending, ties to the lower position. The rank
    is one int64 key per kept candidate (the score's `ordered` bits x 2^32 - position): on every
    device the same positions in the same order, and a -inf never ranks above a finite score.
    Keying all N and taking their top-k costs 2-3.6x a float top-k on a GPU, so from FLOAT_FIRST
    candidates a row (`float_first`: None) the k are chosen by the float score first (ties at the
    k-th score to the lower position) and only they are keyed; below, the dozen launches that takes
    cost more than keying all N. No host synchronisation (a CUDA graph captures it). N <= 2^32
    (ValueError otherwise); k > N raises as `torch.topk` does."""
    B, N = score.shape
    if N > TIE_LIMIT:
        raise ValueError(f"{N:,} candidates a row: at most {TIE_LIMIT:,} have distinct keys")
    if not (N >= FLOAT_FIRST if float_first is None else float_first):
        return position_keys(score).topk(k, dim=1, sorted=True).indices
    # --- 1. THE K-TH BEST SCORE --- a float top-k, unordered: (B, k) scores and positions that hold
    # every score above the k-th (fewer than k of them) and some of those equal to it, whichever the
    # device met first. Values are compared, never bits: -0.0 == 0.0 (as `ordered` has them),
    # whichever one a device returns.
    best, at = score.topk(k, dim=1, sorted=False)
    if best.numel() == 0:  # k == 0 or no rows: no k-th score
        return at
    kth = best.amin(dim=1, keepdim=True)  # (B, 1) float32; -inf where a row has fewer than k finite scores
    tied = best == kth  # (B, k) bool: the k - above slots whose positions the rule, not the device, picks
    # --- 2. THE LOWEST-POSITION TIES --- the j-th score equal to kth along its row, j = 1..k: the first
    # position whose running count of them reaches j. One running count over the batch flattened,
    # a device-wide scan (a scan along each row gives a row to one thread group: 5x the float top-k
    # at N = 2^19); each row's count starts where the previous row's ended.
    counter = torch.int32 if B * N < 2 ** 31 else torch.int64
    tie = torch.eq(score, kth, out=torch.empty(B, N, dtype=counter, device=score.device)).view(-1)  # (B N,) 0/1
    count = tie.cumsum(0, dtype=counter)  # (B N,)
    j = torch.arange(k + 1, dtype=count.dtype, device=score.device) + (count[::N] - tie[::N]).unsqueeze(1)
    nth_tie = torch.searchsorted(count.view(B, N), j)  # (B, k + 1) int64: column j the j-th tie (column 0 unread)
    # --- 3. THE K KEPT --- top-k's positions above kth, and in its tied slots, in slot order, the
    # k - above lowest positions equal to kth: a gather, so no data-dependent shape.
    pos = torch.where(tied, nth_tie.gather(1, tied.cumsum(dim=1)), at)  # (B, k) int64; the c-th tied slot: column c
    # --- 4. RANK THE K BY THE KEY --- a tied slot's score is kth by value, so `ordered` keys it alike.
    key = position_keys(best, pos)  # > -2^63: ordered(-inf) > -2^31 + 2^23, pos < 2^32
    return pos.gather(1, key.sort(dim=1, descending=True).indices)
