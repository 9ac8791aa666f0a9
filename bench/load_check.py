"""The load benchmark's check (`bench/bench_load.py`): every answer against a direct retrieve of
the same request on the snapshot the answer names, and how two answers differ, in words."""

from __future__ import annotations

import functools
import json
from collections.abc import Callable
from pathlib import Path

import numpy as np

SCORE_TOL = 1e-5


class Checker:
    """Direct retrieves on the snapshots answers name (module doc), one per (snapshot, request)."""

    def __init__(self, root: Path, args, bodies: list[bytes], log: Callable[[str], None] = lambda _: None) -> None:
        self.root, self.args, self.log = root, args, log
        self.requests = [json.loads(b)["requests"][0] for b in bodies]
        self.refs: dict[str, dict[int, tuple]] = {}
        self.missing: dict[str, str] = {}
        self._base = None

    def prepare(self, answers: list[dict[str, np.ndarray]]) -> None:
        """Retrieve every (snapshot, request) pair an answer needs, snapshot by snapshot."""
        import runtime

        need: dict[str, set[int]] = {}
        for a in answers:
            ok = a["status"] == 200
            for s, i in zip(a["snapshot"][ok].tolist(), a["idx"][ok].tolist()):
                if i not in self.refs.get(s, {}):
                    need.setdefault(s, set()).add(i)
        for s, idx in need.items():
            path = self.root / "snapshots" / s
            try:
                index = runtime.load(path, self.args.check_device, base=self._base)
            except Exception as e:  # an answer naming a snapshot that cannot be loaded: every one a mismatch
                self.missing[s] = f"{type(e).__name__}: {e}".splitlines()[0]
                continue
            self._base = index
            idx = sorted(idx)
            self.log(f"  checking: {len(idx)} requests on snapshot {s}")
            retriever = runtime.Retriever(index, mode=self.args.mode, beams=self.args.beams, top_k=self.args.top_k,
                                          batch_sizes=(1,), warm=False)
            table = retriever.retrieve([self.requests[i] for i in idx], source="pool requests")
            rid = table.column("request_id").to_numpy()
            ad, rank = table.column("ad_id").to_numpy(), table.column("rank").to_numpy()
            score = table.column("score").to_numpy(zero_copy_only=False)
            bounds = np.searchsorted(rid, np.concatenate([idx, [np.iinfo(np.int64).max]]))  # rows by request, sorted
            refs = self.refs.setdefault(s, {})
            for j, i in enumerate(idx):
                lo, hi = bounds[j], bounds[j + 1]
                refs[i] = (ad[lo:hi].astype(np.int64), rank[lo:hi].astype(np.int64), score[lo:hi].astype(np.float64))

    def check(self, a: dict[str, np.ndarray]) -> dict:
        """Every 200 answer of a scenario against its reference: checked, mismatches, those of
        them that are near ties (`difference`), the first few described, and per pool request with
        a mismatch [its mismatches, its answers] (one that differs whatever batch it shared, or now
        and then)."""
        ok = np.flatnonzero(a["status"] == 200)
        starts = np.concatenate([[0], np.cumsum(a["rows"])])
        bad, ties, samples, requests = 0, 0, [], {}
        for j in ok.tolist():
            s, i = str(a["snapshot"][j]), int(a["idx"][j])
            lo, hi = starts[j], starts[j + 1]
            why, tie = None, False
            if a["error"][j]:
                why = str(a["error"][j])
            elif s in self.missing:
                why = f"names snapshot {s}, which does not load: {self.missing[s]}"
            elif not a["header_ok"][j]:
                why = "its X-Sidindex-Snapshot header is not its body's snapshot"
            elif not a["own"][j]:
                why = "holds rows of another request_id"
            else:
                why, tie = difference(a["ad_id"][lo:hi], a["rank"][lo:hi], a["score"][lo:hi], *self.refs[s][i])
            if why:
                bad, ties = bad + 1, ties + tie
                requests[i] = requests.get(i, 0) + 1
                if len(samples) < 5:
                    samples.append(f"send {int(a['k'][j])} (request {i}, snapshot {s}): {why}")
        answered = np.bincount(a["idx"][ok], minlength=len(self.requests))
        return {"checked": len(ok), "mismatches": bad, "near_ties": ties, "mismatch_samples": samples,
                "mismatched_requests": {str(i): [n, int(answered[i])] for i, n in sorted(requests.items())}}


def difference(ad: np.ndarray, rank: np.ndarray, score: np.ndarray, want_ad: np.ndarray, want_rank: np.ndarray,
               want_score: np.ndarray) -> tuple[str | None, bool]:
    """How an answer's rows differ from the direct retrieve's, in words (None: they agree): the
    first row where they part, both sides' ad and score there, and whether the ads are the same
    set; and whether the difference is a near tie: rank by rank the scores agree within 1e-5, and
    so do those of every ad both hold (ads of near-equal scores in another order, or another of
    them at the top-k cut: what float sums that depend on the batch give)."""
    close = functools.partial(np.isclose, rtol=SCORE_TOL, atol=SCORE_TOL)
    if np.array_equal(ad, want_ad) and np.array_equal(rank, want_rank):
        if close(score, want_score).all():
            return None, False
        j = int(np.argmax(~close(score, want_score)))
        return (f"scores differ from the direct retrieve beyond 1e-5 (rank {rank[j]}: {score[j]:.9g} against "
                f"{want_score[j]:.9g})"), False
    n = min(len(ad), len(want_ad))
    j = int(np.argmax((ad[:n] != want_ad[:n]) | (rank[:n] != want_rank[:n]))) if n else 0
    if n and ad[j] == want_ad[j] and rank[j] == want_rank[j]:
        j = n  # one is a prefix of the other
    here = f"ad {ad[j]} score {score[j]:.7g}" if j < len(ad) else "nothing"
    there = f"ad {want_ad[j]} score {want_score[j]:.7g}" if j < len(want_ad) else "nothing"
    theirs = dict(zip(want_ad.tolist(), want_score.tolist()))
    common = [(x, theirs[a]) for a, x in zip(ad.tolist(), score.tolist()) if a in theirs]
    tie = len(ad) == len(want_ad) and bool(close(score, want_score).all()) and \
        all(close(x, y) for x, y in common) and np.array_equal(rank, want_rank)
    same = "the same ads in another order" if sorted(ad.tolist()) == sorted(want_ad.tolist()) else \
        f"{len(set(ad.tolist()) ^ set(want_ad.tolist()))} ads in one only"
    return (f"{'near tie: ' if tie else ''}ads differ from the direct retrieve ({len(ad)} rows against "
            f"{len(want_ad)}; from row {j}: {here} against {there}; {same})"), tie
