"""The device post stage's buffer: its shapes and layout (`PostLayout`), shared by the two
implementations of `runtime.ops.expand` and by `runtime.serving.post.DevicePost.result`, which reads it."""

from __future__ import annotations

from dataclasses import dataclass

from schemas.artifacts import MATCHER_PLANES

RANKS = ("score", "value", "fused")
RRF_K = 60  # reciprocal-rank fusion's constant (Cormack et al.; GR4AD-X uses the same form)
# a request's pairs capacity when the caller gives none: the bound (`PostBounds.most_pairs`), at most this many.
# The bound is the worst case (the ads of the K largest SIDs together): 298,175 for 1,024 beams on a 15M-ad
# catalog whose requests reach a few thousand; a serving host chooses its capacity from real traffic
# (`DevicePost.last_reached`)
DEFAULT_PAIRS = 1 << 16
MAX_PAIRS = 1 << 22  # the kernels' grid: a request's C / 128 tiles along CUDA's second grid dimension (< 65,536)
# the buffer's counts, B words each, in this order (then each plane's passes, with stages)
SIDS, REACHED, GENERATED, ELIGIBLE, STAGE0 = range(5)


@dataclass(frozen=True)
class PostLayout:
    """The shapes of one post stage and the layout of its buffer (int64): per request counts
    (`counts`, B each), then B*T result rows of F words (`fields`), those in use first, request by
    request, ranked.

    batch B, beams K, pairs C (the capacity: the most (request, ad) pairs a request's beams may
    reach; a request reaching more overflows, its rows and counts past `reached` untrusted), kept T
    (result rows per request, min(top_k, C)), length L (SID tokens), rank (RANKS), stages (count
    each plane's passes), has_value (rows carry the ad's value bits).

    Counts per request: sids (its live beams on catalog SIDs), reached (the pairs they hold: the sum
    of their ad counts, before paused rows drop out and before any capacity cut), generated (its
    distinct live ads), eligible (those passing the exact filter), with stages each plane's passes.
    A request with reached > C holds no pairs: its generated, eligible and passes are 0."""

    batch: int
    beams: int
    pairs: int
    kept: int
    length: int
    rank: str
    stages: bool
    has_value: bool

    def __post_init__(self) -> None:
        if self.rank not in RANKS or (self.rank != "score" and not self.has_value):
            raise ValueError(f"rank {self.rank!r}: expected one of {', '.join(RANKS)}, and value or fused only with "
                             "the ads' values (has_value)")
        if not 1 <= self.pairs <= MAX_PAIRS or not 1 <= self.kept <= self.pairs:
            raise ValueError(f"pairs {self.pairs}, kept {self.kept}: expected 1 <= kept <= pairs <= {MAX_PAIRS:,}")

    @property
    def counts(self) -> list[str]:
        return (["sids", "reached", "generated", "eligible"]
                + ([f"stage_{p}" for p in MATCHER_PLANES] if self.stages else []))

    @property
    def fields(self) -> list[tuple[str, int]]:
        """(name, words) of a result row: ad_row, ad_id, sid (L), score (float32 bits), [value (float64 bits)]."""
        return [("ad_row", 1), ("ad_id", 1), ("sid", self.length), ("score", 1)] + ([("value", 1)] if self.has_value
                                                                                   else [])

    @property
    def row_words(self) -> int:
        return sum(w for _, w in self.fields)

    @property
    def size(self) -> int:
        return len(self.counts) * self.batch + self.batch * self.kept * self.row_words


def pow2(n: int) -> int:
    """The smallest power of 2 >= n, at least 2 (a kernel's block)."""
    return 1 << max(1, (n - 1).bit_length())
