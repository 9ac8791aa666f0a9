"""SID quality report: collisions, utilisation, reconstruction error, multi-path share, gates.

Codebook collapse (every ad under a handful of SIDs) must be caught when the codebook is made, not
when retrieval quality drops: `check_gates` turns configured thresholds into failures.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np

from sidindex import histogram
from sidindex.config import QualityThresholds
from sidindex.sid.assign import SIDAssignment, key_counts, key_tokens, sid_keys
from sidindex.sid.codebook import Codebook

NEAR_SECOND_RATIO = 1.05  # GR4AD-X: share of ads whose 2nd centroid is within 5% of the 1st
BLOCK = 65536  # ads per pass over the embeddings: bounds the float64 temporaries


@dataclass(frozen=True)
class LevelUsage:
    level: int
    kind: str            # "semantic" or "hash"
    size: int
    used: int
    dead: int
    perplexity: float    # exp(entropy) of code usage over SID rows; `size` when perfectly uniform
    gini: float          # 0 = uniform usage, -> 1 = one code takes everything


@dataclass(frozen=True)
class QualityReport:
    n_ads: int
    n_sid_rows: int
    sids_per_ad_mean: float
    sids_per_ad_counts: dict[int, int]   # number of SIDs -> number of ads
    distinct_sids: int
    ads_per_sid_p50: float
    ads_per_sid_p99: float
    ads_per_sid_max: int
    largest_group_sid: tuple[int, ...]
    largest_group_share: float           # of all ads
    collision_rate: float                # share of SID rows whose SID holds more than one ad
    levels: tuple[LevelUsage, ...]
    mse: tuple[float, ...]               # mean ||x - x_hat||^2 after each semantic level (path 0)
    relative_mse: float                  # final mse / mean ||x - mean(x)||^2
    near_second_share: float             # share of ads with d2 <= 1.05 d1 at the first level
    notes: tuple[str, ...]
    failures: tuple[str, ...] = ()

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


@dataclass(frozen=True)
class QualitySums:
    """What the quality report needs from the embeddings, summed over a catalog's fragments
    (`merge` adds two); everything else comes from the SIDs.

    n_ads: ads; near_second: ads with d2 <= NEAR_SECOND_RATIO d1 at the first level
    sq_error: (L_sem,) float64 summed ||x - x_hat||^2 after each semantic level, over path-0 rows
    mean: (D,) float64 mean embedding; spread: float64 summed ||x - mean||^2 (Chan's merge of moments)
    """

    n_ads: int
    near_second: int
    sq_error: np.ndarray
    mean: np.ndarray
    spread: float

    def merge(self, other: QualitySums) -> QualitySums:
        n = self.n_ads + other.n_ads
        delta = other.mean - self.mean
        return QualitySums(n, self.near_second + other.near_second, self.sq_error + other.sq_error,
                           self.mean + delta * (other.n_ads / max(n, 1)),
                           self.spread + other.spread + float(delta @ delta) * self.n_ads * other.n_ads / max(n, 1))

    def to_dict(self) -> dict:
        return {"n_ads": self.n_ads, "near_second": self.near_second, "sq_error": self.sq_error.tolist(),
                "mean": self.mean.tolist(), "spread": self.spread}

    @classmethod
    def from_dict(cls, d: dict) -> QualitySums:
        return cls(int(d["n_ads"]), int(d["near_second"]), np.array(d["sq_error"], dtype=np.float64),
                   np.array(d["mean"], dtype=np.float64), float(d["spread"]))


def quality_sums(assignment: SIDAssignment, codebook: Codebook, embedding: np.ndarray) -> QualitySums:
    """The embedding sums of one fragment's assignment; embedding: (N, D) float32, its ads'."""
    mean = embedding.mean(axis=0, dtype=np.float64) if len(embedding) else np.zeros(embedding.shape[1])
    spread = sum(float(np.sum((embedding[i:i + BLOCK] - mean) ** 2))  # float64 in blocks: no copy of it all
                 for i in range(0, len(embedding), BLOCK))
    return QualitySums(len(embedding), int(np.sum(assignment.first_ratio <= NEAR_SECOND_RATIO)),
                       _reconstruction_error(codebook, embedding, assignment), mean, spread)


@dataclass(frozen=True)
class SidSums:
    """What the quality report needs from the distinct SIDs, summed over sets of them that follow
    each other in key order (a snapshot's shards; `merge` adds the next set's).

    use:     per level l, (level_sizes[l],) int64 the SID rows under each token
    per_sid: (M,) int64 histogram of the SIDs' row counts (`sidindex.histogram`)
    top:     the row count of the first SID (in key order) with the most rows; top_sid: its tokens
    """

    use: tuple[np.ndarray, ...]
    per_sid: np.ndarray
    top: int
    top_sid: tuple[int, ...]

    @classmethod
    def of(cls, sids: np.ndarray, counts: np.ndarray, level_sizes: tuple[int, ...]) -> SidSums:
        """The sums of distinct SIDs (S, L) int16 in key order holding counts (S,) int64 rows each."""
        top = int(np.argmax(counts)) if len(counts) else 0
        return cls(tuple(np.bincount(sids[:, level].astype(np.int64), weights=counts, minlength=size).astype(np.int64)
                         for level, size in enumerate(level_sizes)),
                   histogram.histogram(counts), int(counts[top]) if len(counts) else 0,
                   tuple(int(t) for t in sids[top]) if len(counts) else ())

    def merge(self, other: SidSums) -> SidSums:
        first = self if self.top >= other.top else other  # a tie: the SID first in key order
        return SidSums(tuple(a + b for a, b in zip(self.use, other.use)), histogram.merged(self.per_sid, other.per_sid),
                       first.top, first.top_sid)


def sid_quality(assignment: SIDAssignment, codebook: Codebook, embedding: np.ndarray,
                thresholds: QualityThresholds | None = None) -> QualityReport:
    """Report on an assignment; `failures` lists the crossed thresholds (empty when none).

    embedding: (N, D) float32, the embeddings the assignment was made from
    """
    uniq, counts = key_counts(sid_keys(assignment.sids, assignment.level_sizes))
    return quality_report(SidSums.of(key_tokens(uniq, assignment.level_sizes), counts, assignment.level_sizes),
                          ads_rows(assignment), quality_sums(assignment, codebook, embedding), codebook, thresholds)


def ads_rows(assignment: SIDAssignment) -> np.ndarray:
    """(M,) int64 histogram of the SID rows of each ad of the assignment (ads without any count 0)."""
    return histogram.histogram(np.bincount(assignment.ad_index, minlength=assignment.n_ads))


def quality_report(sids: SidSums, per_ad: np.ndarray, sums: QualitySums, codebook: Codebook,
                   thresholds: QualityThresholds | None = None) -> QualityReport:
    """The report of an assignment given as its distinct SIDs' sums, the histogram (M,) int64 of
    its ads' SID rows, and its embedding sums."""
    n = histogram.items(per_ad)
    levels = []
    n_sem = len(codebook.centroids)
    for level, (size, use) in enumerate(zip(codebook.level_sizes, sids.use)):
        levels.append(LevelUsage(level, "semantic" if level < n_sem else "hash", size,
                                 int((use > 0).sum()), int((use == 0).sum()), _perplexity(use), _gini(use)))
    rows = histogram.total(sids.per_sid)
    mse = tuple(float(e / max(n, 1)) for e in sums.sq_error)
    spread = sums.spread / max(n, 1)
    report = QualityReport(
        n_ads=n,
        n_sid_rows=rows,
        sids_per_ad_mean=histogram.mean(per_ad),
        sids_per_ad_counts={int(k): int(v) for k, v in enumerate(per_ad) if v},
        distinct_sids=histogram.items(sids.per_sid),
        ads_per_sid_p50=histogram.percentile(sids.per_sid, 50),
        ads_per_sid_p99=histogram.percentile(sids.per_sid, 99),
        ads_per_sid_max=sids.top,
        largest_group_sid=sids.top_sid,
        largest_group_share=float(sids.top / n),
        collision_rate=float(histogram.total(sids.per_sid, 2) / rows),
        levels=tuple(levels),
        mse=mse,
        relative_mse=mse[-1] / spread if spread > 0 else 0.0,
        near_second_share=float(sums.near_second / max(n, 1)),
        notes=codebook.notes,
    )
    if thresholds is not None:
        report = dataclasses.replace(report, failures=tuple(check_gates(report, thresholds)))
    return report


def check_gates(report: QualityReport, t: QualityThresholds) -> list[str]:
    """Human-readable failures for every threshold the report crosses."""
    out = []
    for lv in report.levels:
        if lv.kind != "semantic":
            continue
        if t.min_level_codes is not None and lv.size >= 2 and lv.used < min(t.min_level_codes, lv.size):
            out.append(f"level {lv.level} uses {lv.used} of {lv.size} codes (min_level_codes = "
                       f"{t.min_level_codes}): the codebook collapsed")
        if t.min_level_perplexity is not None and lv.size >= 2 and lv.perplexity < t.min_level_perplexity:
            out.append(f"level {lv.level} perplexity {lv.perplexity:.2f} < min_level_perplexity "
                       f"{t.min_level_perplexity}")
    if t.max_sid_share is not None and report.largest_group_share > t.max_sid_share:
        out.append(f"SID {list(report.largest_group_sid)} holds {report.largest_group_share:.1%} of the ads "
                   f"(max_sid_share = {t.max_sid_share})")
    return out


def _reconstruction_error(codebook: Codebook, embedding: np.ndarray, a: SIDAssignment) -> np.ndarray:
    """(L_sem,) float64 summed squared reconstruction error after each semantic level, over each
    ad's path 0 (ad_index relative to `embedding`)."""
    rows = a.path == 0
    idx, toks = a.ad_index[rows], a.sids[rows]
    sums = np.zeros(len(codebook.centroids), dtype=np.float64)
    for start in range(0, len(idx), BLOCK):
        sl = slice(start, start + BLOCK)
        r = embedding[idx[sl]].astype(np.float32)
        for level, c in enumerate(codebook.centroids):
            r -= c[toks[sl, level]]
            sums[level] += np.einsum("nd,nd->", r, r, dtype=np.float64)
    return sums


def _perplexity(counts: np.ndarray) -> float:
    p = counts[counts > 0] / counts.sum()
    return float(np.exp(-(p * np.log(p)).sum()))


def _gini(counts: np.ndarray) -> float:
    x = np.sort(counts.astype(np.float64))
    k = len(x)
    if k < 2 or x.sum() == 0:
        return 0.0
    i = np.arange(1, k + 1)
    return float(((2 * i - k - 1) * x).sum() / (k * x.sum()))
