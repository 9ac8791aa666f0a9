"""Why a SID (or an ad) is or is not reachable for one request: the trie walk, step by step.

At each position of the SID the search can only take the token if
  cd            the prefix exists in the catalog (a child entry of the current node),
  cd+gtm        and the child's subtree-union matchers pass every attribute,
  cd+gtm+kway   and ANY of the child's k-way partitions passes every attribute;
and at the leaf the exact filter decides, ad by ad. An explanation tests each attribute on its own
(instead of stopping at the first failing word, as the matcher does), so it can name every
attribute that failed. Its verdicts agree with `sidindex.trie.match` and `sidindex.exact`.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import numpy as np

from schemas.artifacts import AD_DELETED, AD_LIVE, AD_PAUSED
from sidindex.errors import InputError
from sidindex.exact import attribute_eligibility
from sidindex.matchers.kinds import KINDS
from sidindex.modes import Mode, parse_mode, served_modes
from sidindex.request_encoding import encode_requests
from sidindex.requests import Requests
from sidindex.snapshot import Snapshot

STATE_NAMES = {AD_LIVE: "live", AD_PAUSED: "paused", AD_DELETED: "deleted"}


@dataclass(frozen=True)
class Step:
    """Taking token `token` at `position` (0-based) after `prefix`.

    failed_union: attributes the subtree-union matchers reject (None when the prefix is not in the catalog)
    failed_partitions: per k-way partition, the attributes it rejects (None without k-way; empty when
                       the prefix is not in the catalog)
    bound: with ad values (docs/design.md §16), the largest value of an ad beneath: the union's bound
    kway_bound: with values and k-way, the largest value of the partitions that pass (None when none does)
    live: a live ad lies beneath (False only after updates paused or deleted every ad under the
          prefix: no constrained mode takes it, docs/design.md §15)
    """

    position: int
    prefix: tuple[int, ...]
    token: int
    in_catalog: bool
    failed_union: tuple[str, ...] | None
    failed_partitions: tuple[tuple[str, ...], ...] | None
    bound: float | None = None
    kway_bound: float | None = None
    live: bool = True

    def allows(self, mode: Mode | str) -> bool:
        """Whether beam search in `mode` can take this token (`mode` needs k-way partitions only
        when the snapshot has them)."""
        mode = parse_mode(mode, kway_available=self.failed_partitions is not None)
        return ((self.in_catalog and self.live or not mode.constrained) and not (mode.gtm and self.failed_union)
                and not (mode.kway and self.failed_partitions is not None and all(self.failed_partitions)))

    @property
    def passes(self) -> dict[str, bool]:
        """The verdict of every constrained mode the snapshot can serve, by mode name."""
        return {m.value: self.allows(m) for m in served_modes(self.failed_partitions is not None)}


@dataclass(frozen=True)
class AdCheck:
    """The exact ad-level filter for one ad: eligible iff `failed` is empty and its row is live
    (`state`: live, paused or deleted, as updates between full builds set it); its value, if any."""

    ad_id: int
    failed: tuple[str, ...]
    value: float | None = None
    state: str = "live"

    @property
    def eligible(self) -> bool:
        return not self.failed and self.state == "live"


@dataclass(frozen=True)
class SidExplanation:
    sid: tuple[int, ...]
    steps: tuple[Step, ...]  # stops at the first prefix that is not in the catalog
    ads: tuple[AdCheck, ...]  # the SID's ads (empty when it is not in the catalog)

    @property
    def reached(self) -> dict[str, bool]:
        """Whether beam search in each mode can generate this SID (given wide enough beams)."""
        modes = self.steps[0].passes.keys()
        return {m: len(self.steps) == len(self.sid) and all(s.passes[m] for s in self.steps) for m in modes}

    def to_dict(self) -> dict:
        return {"sid": list(self.sid), "reached": self.reached,
                "steps": [{**asdict(s), "passes": s.passes} for s in self.steps],
                "ads": [asdict(a) for a in self.ads],
                "eligible_ads": sum(a.eligible for a in self.ads)}


class Explainer:
    """Explanations against one snapshot for one request (row `row` of a validated request table)."""

    def __init__(self, snap: Snapshot, requests: Requests, row: int) -> None:
        self.snap = snap
        self.req = encode_requests(requests.rows(row, row + 1), snap.spec)  # request 0 of it
        self.names = tuple(n for layout in snap.spec.layouts for n in layout.names)  # plane by plane

    def _state(self, row: int) -> str:
        st = self.snap.exact.ad_state
        return STATE_NAMES[int(st[row])] if st is not None else "live"

    def _failed(self, rows: list[int]) -> tuple[str, ...]:
        """The attributes whose matcher rows (`rows`: one per plane) reject the request."""
        ok = np.concatenate([kind.attribute_passes(layout, plane.table[r], q, 0) for kind, layout, plane, q, r
                             in zip(KINDS, self.snap.spec.layouts, self.snap.gtm.planes, self.req.planes, rows)])
        return tuple(n for n, k in zip(self.names, ok) if not k)

    def sid(self, sid: tuple[int, ...], ads: np.ndarray | None = None) -> SidExplanation:
        """Walk `sid` down the trie; at its leaf check `ads` (catalog rows; default: all of the leaf's)."""
        g = self.snap.gtm
        if len(sid) != g.sid_length or not all(0 <= t < s for t, s in zip(sid, g.level_sizes)):
            raise InputError(f"SID {list(sid)} does not fit this snapshot: {g.sid_length} tokens with level sizes "
                             f"{list(g.level_sizes)}")
        steps, node = [], 0
        for d, token in enumerate(sid):
            lo, hi = int(g.node_offsets[node]), int(g.node_offsets[node + 1])
            e = lo + int(np.searchsorted(g.csr_tokens[lo:hi], token))
            if e == hi or g.csr_tokens[e] != token:  # no entry: no partition of it can pass either
                steps.append(Step(d, tuple(sid[:d]), token, False, None, None if g.part_offsets is None else ()))
                return SidExplanation(tuple(sid), tuple(steps), ())
            parts = bound = kway_bound = None
            if g.part_offsets is not None:
                part_index = [pl.part_index for pl in g.planes]
                assert all(r is not None for r in part_index)  # a k-way index partitions every plane
                parts = tuple(self._failed([r[p] for r in part_index if r is not None])
                              for p in range(g.part_offsets[e], g.part_offsets[e + 1]))
            if g.entry_value is not None:  # the value bounds the search weighs this step by
                bound = float(g.entry_value[e])
                if parts is not None:
                    assert g.part_value is not None and g.part_offsets is not None  # values come with their bounds
                    kway_bound = max((float(g.part_value[g.part_offsets[e] + i]) for i, f in enumerate(parts) if not f),
                                     default=None)
            steps.append(Step(d, tuple(sid[:d]), token, True, self._failed([pl.index[e] for pl in g.planes]), parts,
                              bound, kway_bound, g.entry_live is None or bool(g.entry_live[e])))
            node = int(g.csr_child_nodes[e])
        leaf = node - int(g.depth_offsets[g.sid_length])
        if ads is None:
            ads = g.leaf_ads[g.leaf_ad_offsets[leaf]:g.leaf_ad_offsets[leaf + 1]]
        checks = []
        for row in np.unique(ads):
            ok = attribute_eligibility(self.snap.exact, self.req, 0, int(row))
            checks.append(AdCheck(int(self.snap.ad_id[row]), tuple(n for n, k in zip(self.names, ok) if not k),
                                  None if g.ad_value is None else float(g.ad_value[row]), self._state(int(row))))
        return SidExplanation(tuple(sid), tuple(steps), tuple(checks))

    def ad(self, ad_id: int) -> list[SidExplanation]:
        """Every SID of ad `ad_id`, each walked down the trie and checked for that ad alone."""
        g = self.snap.gtm
        rows = np.flatnonzero(self.snap.ad_id == ad_id)
        if len(rows) == 0:
            raise InputError(f"ad {ad_id} is not in snapshot {self.snap.id}")
        row = int(rows[-1])  # an upserted ad's current row follows its deleted ones
        leaves = np.searchsorted(g.leaf_ad_offsets, np.flatnonzero(g.leaf_ads == row), side="right") - 1
        return [self.sid(tuple(int(t) for t in sid), np.array([row])) for sid in g.leaf_sids(np.unique(leaves))]


def request_row(requests: Requests, request_id: int | None) -> int:
    """The row of `request_id`, or row 0 of a single-request table."""
    if request_id is None:
        if len(requests) != 1:
            raise InputError(f"{requests.path}: holds {len(requests)} requests; choose one by its request_id "
                             f"(e.g. {int(requests.request_id[0])})")
        return 0
    rows = np.flatnonzero(requests.request_id == request_id)
    if len(rows) == 0:
        raise InputError(f"{requests.path}: no request with request_id {request_id}")
    return int(rows[0])
