"""The device post stage's buffer: its shapes and layout (`PostLayout`), shared by the two
implementations of `runtime.ops.expand` and by `runtime.post.DevicePost.result`, which reads it."""

from __future__ import annotations

from dataclasses import dataclass

from schemas.artifacts import MATCHER_PLANES

RANKS = ("score", "value", "fused")
RRF_K = 60  # reciprocal-rank fusion's constant (Cormack et al.; GR4AD-X uses the same form)
# the most slots (or beams) the kernels take: one program per request holds a block of them (H200, 10M SIDs:
# at 16,384 slots the kernels took 0.525 ms a batch against the torch reference's 0.682, spilling registers)
MAX_BLOCK = 1 << 14


@dataclass(frozen=True)
class PostLayout:
    """The shapes of one post stage and the layout of its buffer (int64): per request counts
    (`counts`, B each), then B*T result rows of F words (`fields`), those in use first, request by
    request, ranked.

    batch B, beams K, pairs C (the most (request, ad) pairs K beams reach), kept T (result rows per
    request, min(top_k, C)), length L (SID tokens), rank (RANKS), stages (count each plane's passes),
    has_value (rows carry the ad's value bits)."""

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

    @property
    def counts(self) -> list[str]:
        return ["sids", "generated", "eligible"] + ([f"stage_{p}" for p in MATCHER_PLANES] if self.stages else [])

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

    @property
    def block(self) -> int:
        """The kernels' block of slots: C rounded up to a power of 2 (at least 2)."""
        return pow2(self.pairs)

    @property
    def beam_block(self) -> int:
        """The kernels' block of beams: K rounded up to a power of 2 (at least 2)."""
        return pow2(self.beams)


def pow2(n: int) -> int:
    """The smallest power of 2 >= n, at least 2 (a kernel's block)."""
    return 1 << max(1, (n - 1).bit_length())
