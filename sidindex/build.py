"""Build the GTM and exact indexes from validated catalog columns and a SID assignment.

Stages (timed, so a build can report where its time goes):
  flatten         each targeting column's strings -> integer codes (Arrow kernels, two columns at a
                  time); a column is flattened once for its matcher rows and the exact index
  encode <plane>  the ads' rows of each matcher plane (N, W_p): bitmask, bloom
  exact index     sorted value hashes per ad and bloom attribute
  trie            CSR trie, subtree unions, k-way partitions, dedup, SID -> ad
  stats           GRACE Tables 1 and 2
"""

from __future__ import annotations

import functools
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np
import polars as pl

from sidindex.exact import ExactIndex, build_exact_index
from sidindex.matchers.bits import list_codes
from sidindex.matchers.kinds import KINDS
from sidindex.sid.quality import QualityReport
from sidindex.targeting import TargetingSpec
from sidindex.timing import StageClock
from sidindex.trie.build import GTMIndex
from sidindex.trie.kway import KWayConfig
from sidindex.trie.shard import Shard, build_shards, join_shards
from sidindex.trie.stats import GTMStats, gtm_stats


@dataclass(frozen=True)
class BuiltIndex:
    """An index a build or an update made: what a snapshot is written from, and what its job
    reports of it. `build_index`, the job's engines and `sidindex.update.apply_changes` each return
    one; a field a step has nothing for stays None.

    shards, exact: the GTM index's shards (in token order) and the exact index; `gtm` is their join
    seconds:       per stage
    ad_id:         (N,) int64 each catalog row's ad id (None from `build_index`, which reads only the
                   targeting columns: its caller holds the ids)
    stats:         a full build's GTM statistics (an update's snapshot keeps its full build's)
    quality:       a full build's SID quality report
    new_sid_rows:  SID rows an update inserted
    stale_entries, dead_sids: after an update, the entries whose matchers hold a row that is not
                   live and the SIDs without a live row (`sidindex.trie.patch.liveness`)
    """

    shards: tuple[Shard, ...]
    exact: ExactIndex
    seconds: dict[str, float]
    ad_id: np.ndarray | None = None
    stats: GTMStats | None = None
    quality: QualityReport | None = None
    new_sid_rows: int = 0
    stale_entries: int | None = None
    dead_sids: int | None = None

    @functools.cached_property
    def gtm(self) -> GTMIndex:
        """The whole trie: the shards joined (`sidindex.trie.shard.join_shards`)."""
        return join_shards(self.shards)


def encode_ads(spec: TargetingSpec, columns: pl.DataFrame, clock: StageClock | None = None
               ) -> tuple[dict[str, np.ndarray], ExactIndex]:
    """The ads' matcher rows per plane ((N, W_p) uint64, in plane order) and their exact index,
    from validated targeting columns (one row per ad)."""
    clock = clock or StageClock()
    with ThreadPoolExecutor(2) as pool:  # Arrow's kernels release the GIL
        # declared values (a categorical kind's) fix the codes; free strings are coded as met
        flat = pool.map(lambda a: list_codes(columns.get_column(a.name), a.values or None), spec.attributes)
        codes = dict(zip((a.name for a in spec.attributes), flat))
    clock.lap("flatten")
    ad_rows = {}
    for kind, layout in zip(KINDS, spec.layouts):
        ad_rows[kind.name] = kind.encode_ads(layout, columns, codes)
        clock.lap(f"encode {kind.name}")
    return ad_rows, build_exact_index(spec, columns, ad_rows, codes)


def build_index(spec: TargetingSpec, columns: pl.DataFrame, sids: np.ndarray, ad_index: np.ndarray,
                level_sizes: tuple[int, ...], *, kway: KWayConfig | None = None,
                ad_value: np.ndarray | None = None, workers: int | None = None, shards: int | None = None
                ) -> BuiltIndex:
    """columns: the catalog's targeting columns (validated, `Catalog.columns`), one row per ad
    sids: (P, L) int16 SID rows; ad_index: (P,) int64 row of each SID row's ad in `columns`
    ad_value: (N,) float64 the ads' values (`Catalog.value`), or None: no value bounds
    workers: threads building the trie's shards (default 1); shards: how many (default from the
             catalog's size, `sidindex.trie.shard.default_shards`); the shards do not depend on workers
    """
    clock = StageClock()
    ad_rows, exact = encode_ads(spec, columns, clock)
    clock.lap("exact index")
    bits = tuple(layout.bits for layout in spec.layouts)
    parts = build_shards(sids, ad_index, level_sizes, ad_rows, shards=shards, kway=kway, matcher_bits=sum(bits),
                         ad_value=ad_value, workers=workers)
    clock.lap("trie")
    stats = gtm_stats([s.gtm for s in parts], bits)
    clock.lap("stats")
    return BuiltIndex(parts, exact, clock.seconds, stats=stats)
