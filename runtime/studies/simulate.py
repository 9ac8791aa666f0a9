"""The retrieval study behind `sidindex simulate`: pass rates per stage (GRACE Table 3) and recall of
the best eligible ads, per mode, on one snapshot and request table.

Per mode, retrieval runs as served (beam search, SIDs -> ads, exact filter) and counts, over the
ads the returned SIDs generate (each ad once per request):
  <plane> rate  share passing every attribute of a matcher plane   (each stage tested on its own):
                bitmask rate, bloom rate
  final rate    share eligible (every stage)
Recall@K compares the K best returned eligible ads with the K best eligible ads of the whole
catalog under the same scorer, found exhaustively: every SID's log-probability is computed node by
node down the trie (the scorer asked for every node of a depth at once), an ad scores its best SID,
and the exact filter runs over every ad.

With ad values (docs/design.md §16), value@K compares the summed values of the K most valuable returned
eligible ads with those of the K most valuable eligible ads of the whole catalog that the scorer
can reach (the mean over requests with any), first for the plain search (ranked by log-probability), then for
the value-guided search at each weight λ given (with its recall@K).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from runtime.index.served import ServedIndex
from runtime.requests import device_form
from runtime.scorers.codebook import codebook_scorer
from runtime.scorers.factory import ScorerFactory, factory_scorer
from runtime.search.beam import Scorer, check_value_weight, log_probs_of, parse_beams
from runtime.serving.retrieval import retrieve
from sidindex.exact import eligible_mask
from sidindex.modes import Mode, parse_mode
from sidindex.request_encoding import encode_requests
from sidindex.requests import Requests

BUCKETS = (0, 1, 100, 1_000, 10_000, 100_000)  # generated ads per request: [0, 1), [1, 100), ...


@dataclass(frozen=True)
class TrieLevel:
    """The nodes of one depth, for scoring them all: nodes [lo, hi), their token paths (hi-lo, d)
    int64, and the parent node of each of their child entries [e_lo, e_hi)."""

    lo: int
    hi: int
    paths: torch.Tensor
    e_lo: int
    e_hi: int
    parent: torch.Tensor


def trie_levels(index: ServedIndex) -> list[TrieLevel]:
    """The trie depth by depth (request-independent: built once per study)."""
    g, host, dev = index.gtm, index.snapshot.gtm, index.device  # host: offsets read as Python ints
    tokens = g.csr_tokens.long()
    paths = torch.zeros(1, 0, dtype=torch.int64, device=dev)
    out = []
    for d in range(g.sid_length):
        lo, hi = int(g.depth_offsets[d]), int(g.depth_offsets[d + 1])
        e_lo, e_hi = int(host.node_offsets[lo]), int(host.node_offsets[hi])
        parent = torch.repeat_interleave(torch.arange(lo, hi, device=dev), g.node_offsets[lo + 1:hi + 1]
                                         - g.node_offsets[lo:hi])
        out.append(TrieLevel(lo, hi, paths, e_lo, e_hi, parent))
        if d + 1 < g.sid_length:  # children of depth d, in node order: parent's path + token
            paths = torch.cat([paths[parent - lo], tokens[e_lo:e_hi, None]], dim=1)
    return out


@torch.no_grad()
def node_scores(index: ServedIndex, scorer: Scorer, levels: list[TrieLevel], chunk: int = 16384) -> torch.Tensor:
    """(num_nodes,) float32 accumulated log-probability of every trie node's prefix for one request
    (a scorer for a batch of one), each level's distribution over its `level_sizes[d]` tokens as
    the search's (`runtime.search.beam.log_probs_of`); the root scores 0. Leaves are SIDs. levels:
    `trie_levels`."""
    g = index.snapshot.gtm  # the host index: offsets read as Python ints
    tokens = index.gtm.csr_tokens.long()
    score = torch.zeros(g.num_nodes, dtype=torch.float32, device=index.device)
    for d, lv in enumerate(levels):
        constant = getattr(scorer, "prefix_independent", lambda step: False)(d)
        for s in range(lv.lo, lv.hi, chunk):
            e = min(lv.hi, s + chunk)
            ask = lv.paths[:1] if constant else lv.paths[s - lv.lo:e - lv.lo]
            # no previous beams to reuse: the chunks of a depth are not one call's beams
            logp = log_probs_of(scorer, d, ask[None], None, index.level_sizes[d])[0]  # (n or 1, V)
            e_lo, e_hi = int(g.node_offsets[s]), int(g.node_offsets[e])
            parent = lv.parent[e_lo - lv.e_lo:e_hi - lv.e_lo]
            row = torch.zeros_like(parent) if constant else parent - s
            score[e_lo + 1:e_hi + 1] = score[parent] + logp[row, tokens[e_lo:e_hi]]
    return score


def exhaustive_top_k(index: ServedIndex, requests: Requests, k: int, scorer: ScorerFactory | None = None
                     ) -> tuple[list[np.ndarray], np.ndarray | None]:
    """Per request, the catalog rows of its k best eligible ads (score descending, then ad_id),
    over the whole catalog; and (R,) float64 the summed values of its k most valuable eligible ads
    (None without ad values). scorer: a user's factory (default: the codebook scorer)."""
    snap, g = index.snapshot, index.gtm
    host = encode_requests(requests, index.spec)
    scorer_for = (factory_scorer(scorer, index, requests) if scorer
                  else codebook_scorer(index, device_form(host, index.device)))
    n_ads = len(snap.ad_id)
    leaf_ads = torch.from_numpy(np.asarray(g.leaf_ads)).to(index.device)
    per_leaf = torch.from_numpy(np.diff(g.leaf_ad_offsets)).to(index.device)
    every_ad = np.arange(n_ads, dtype=np.int64)
    levels = trie_levels(index)
    out, value = [], None if snap.gtm.ad_value is None else np.zeros(len(requests))
    for r in range(len(requests)):
        score = node_scores(index, scorer_for(slice(r, r + 1)), levels)[index.leaf_start:]
        on_device = torch.full((n_ads,), float("-inf"), device=index.device)
        on_device.scatter_reduce_(0, leaf_ads, torch.repeat_interleave(score, per_leaf), "amax")
        best = on_device.cpu().numpy()
        eligible = eligible_mask(snap.exact, host, r, every_ad)
        if value is not None:
            value[r] = top_k_sum(np.asarray(snap.gtm.ad_value)[eligible & (best > -np.inf)], k)
        ok = np.flatnonzero(eligible & (best > -np.inf))
        if len(ok) > k:  # the k best, plus every ad tied with the k-th
            ok = ok[best[ok] >= np.partition(best[ok], len(ok) - k)[len(ok) - k]]
        order = np.lexsort((snap.ad_id[ok], -best[ok]))
        out.append(ok[order[:k]])
    return out, value


def top_k_sum(values: np.ndarray, k: int) -> float:
    """The sum of the k largest of `values` (all of them when fewer)."""
    return float(values.sum() if len(values) <= k else np.partition(values, len(values) - k)[len(values) - k:].sum())


def value_at_k(r, best_value: np.ndarray, k: int) -> float | None:
    """Mean over requests with eligible value of (summed values of the k most valuable returned
    eligible ads) / best_value (`exhaustive_top_k`'s); r: a `Retrieved` with values."""
    at = _request_rows(r, len(best_value))
    ratios = [top_k_sum(r.value[at[q]:at[q + 1]], k) / best_value[q] for q in range(len(best_value))
              if best_value[q] > 0]
    return float(np.mean(ratios)) if ratios else None


def recall_at_k(r, truth: list[np.ndarray], k: int) -> float | None:
    """Mean over requests with eligible ads of the share of their k best (`exhaustive_top_k`) among
    the k first returned."""
    at = _request_rows(r, len(truth))
    recall = [len(np.intersect1d(r.ad_row[at[q]:at[q + 1]][r.rank[at[q]:at[q + 1]] <= k], best)) / len(best)
              for q, best in enumerate(truth) if len(best)]
    return float(np.mean(recall)) if recall else None


def _request_rows(r, n: int) -> np.ndarray:
    """(n+1,) int64: request q's rows of `r` (ordered by request) are [at[q], at[q+1])."""
    return np.searchsorted(r.request, np.arange(n + 1))


def simulate(index: ServedIndex, requests: Requests, modes: tuple[Mode | str, ...], beams: tuple[int, ...] | str,
             k: int, batch_size: int = 16, scorer: ScorerFactory | None = None, progress=None,
             value_weights: tuple[float, ...] = ()) -> dict:
    """The study's report (plain data, see the module docstring). value_weights: the λ > 0 of the
    value-guided searches to compare (a snapshot with ad values)."""
    parsed = tuple(parse_mode(m, kway_available=index.kway) for m in modes)
    beams = parse_beams(beams, index.sid_length)
    for mode in parsed:
        for w in value_weights if mode.constrained else ():  # mode none has no bounds: plain value@K only
            check_value_weight(index, mode, w)
    progress = progress or (lambda *_: None)
    t = time.perf_counter()
    truth, best_value = exhaustive_top_k(index, requests, k, scorer)
    exhaustive_s = time.perf_counter() - t
    progress("exhaustive", 1, 1)
    n = len(requests)
    report: dict[str, Any] = {"snapshot_id": index.id, "requests": n, "beams": list(beams), "top_k": k,
              "exhaustive_ms_per_request": 1e3 * exhaustive_s / n, "modes": []}
    for mode in parsed:
        run = retrieve(index, requests, mode=mode, beams=beams, batch_size=batch_size, stages=True,
                       scorer=scorer)
        r = run.result
        assert r.ads_per_stage is not None  # retrieved with stages
        valued: dict[str, Any] = {}
        if best_value is not None:
            valued = {f"value_at_{k}": value_at_k(r, best_value, k), "value_by_weight": []}
            for w in value_weights if mode.constrained else ():
                guided = retrieve(index, requests, mode=mode, beams=beams, batch_size=batch_size, scorer=scorer,
                                  value_weight=w).result
                valued["value_by_weight"].append({"weight": w, f"value_at_{k}": value_at_k(guided, best_value, k),
                                                  f"recall_at_{k}": recall_at_k(guided, truth, k)})
        report["modes"].append({
            "mode": mode.value, **_rates(r.ads_generated, r.ads_per_stage, r.ads_eligible),
            "eligible_per_request_mean": float(r.ads_eligible.mean()),
            "eligible_per_request_p10": float(np.percentile(r.ads_eligible, 10)),
            "requests_short_of_k": int((r.ads_eligible < k).sum()),
            "requests_whose_beams_all_died": int((r.sids == 0).sum()),
            f"recall_at_{k}": recall_at_k(r, truth, k), **valued,
            "requests_without_eligible_ads_in_catalog": int(sum(len(b) == 0 for b in truth)),
            "encode_ms_per_request": 1e3 * run.seconds["encode"] / n,
            "search_ms_per_request": 1e3 * run.seconds["search_post"] / n,
            "buckets": _buckets(r.ads_generated, r.ads_per_stage, r.ads_eligible)})
        progress("modes", len(report["modes"]), len(parsed))
    return report


def _rates(generated, stages: dict[str, np.ndarray], eligible) -> dict:
    total = int(generated.sum())

    def rate(x) -> float | None:
        return float(x.sum() / total) if total else None

    return {"ads_generated": total, **{f"ads_{p}": int(x.sum()) for p, x in stages.items()},
            "ads_eligible": int(eligible.sum()), **{f"{p}_rate": rate(x) for p, x in stages.items()},
            "final_rate": rate(eligible)}


def _buckets(generated, stages: dict[str, np.ndarray], eligible) -> list[dict]:
    """The rates over requests grouped by how many ads their SIDs generated."""
    out = []
    edges = BUCKETS + (np.inf,)
    for lo, hi in zip(edges, edges[1:]):
        m = (generated >= lo) & (generated < hi)
        if m.any():
            label = f"{lo:,}+" if hi == np.inf else f"{lo:,}-{int(hi) - 1:,}"
            out.append({"generated": label, "requests": int(m.sum()),
                        **_rates(generated[m], {p: x[m] for p, x in stages.items()}, eligible[m])})
    return out
