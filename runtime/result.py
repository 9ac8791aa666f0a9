"""A retrieval's result: the ranked rows (`Retrieved`), what a caller sees of them (`table_of`, the
Arrow table), and the cut and the join that batching needs (`requests_part`, `concat`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import pyarrow as pa


@dataclass(frozen=True)
class Retrieved:
    """Rows of the result, ordered by (request, rank).

    request: (n,) int64 request row; rank: (n,) int64 1-based; ad_row: (n,) int64 catalog row;
    ad_id: (n,) int64; sid: (n, L) int64 the SID that reached the ad with the best score;
    score: (n,) float32; value: (n,) float64 the ad's value, or None when the snapshot has none.
    Per request (B,) int64: sids (live SIDs the search returned),
    ads_generated (ads under them, counted once per ad), ads_eligible (after the exact filter);
    with `stages`, ads_per_stage: per matcher plane (by name), the generated ads passing its
    attributes exactly (each stage on its own), else None.
    The device path's rows are strided views of one (n, F) block, as numpy's column views are.
    """

    request: np.ndarray
    rank: np.ndarray
    ad_row: np.ndarray
    ad_id: np.ndarray
    sid: np.ndarray
    score: np.ndarray
    sids: np.ndarray
    ads_generated: np.ndarray
    ads_eligible: np.ndarray
    ads_per_stage: dict[str, np.ndarray] | None = None
    value: np.ndarray | None = None


PER_REQUEST = ("sids", "ads_generated", "ads_eligible", "ads_per_stage")  # `Retrieved`'s (B,) fields


def requests_part(r: Retrieved, lo: int, hi: int) -> Retrieved:
    """The rows of requests lo..hi-1 of a result (rows ranked by request), renumbered from 0."""
    r0, r1 = np.searchsorted(r.request, [lo, hi])

    def cut(name: str, v):
        if v is None:
            return None
        if isinstance(v, dict):
            return {k: cut(name, x) for k, x in v.items()}
        return v[lo:hi] if name in PER_REQUEST else v[r0:r1]

    out = {name: cut(name, v) for name, v in vars(r).items()}
    return Retrieved(**out | {"request": out["request"] - lo})


def concat(parts: list[tuple[int, Retrieved]]) -> Retrieved:
    """Batches -> one result; request rows shifted to the whole table's (one batch from request 0:
    itself, not a copy)."""
    if len(parts) == 1 and parts[0][0] == 0:
        return parts[0][1]
    out: dict[str, Any] = {}
    for name in vars(parts[0][1]):
        vals = [getattr(p, name) for _, p in parts]
        if name == "request":
            vals = [v + lo for v, (lo, _) in zip(vals, parts)]
        if vals[0] is None:
            out[name] = None
        elif isinstance(vals[0], dict):  # per stage
            out[name] = {k: np.concatenate([v[k] for v in vals]) for k in vals[0]}
        else:
            out[name] = np.concatenate(vals)
    return Retrieved(**out)


def table_of(r: Retrieved, request_id: np.ndarray) -> pa.Table:
    """request_id, rank, ad_id, sid (fixed_size_list<int16> of L tokens), score, and value when the
    snapshot has ad values."""
    L = r.sid.shape[1] if r.sid.ndim == 2 else 0
    sid = pa.FixedSizeListArray.from_arrays(pa.array(r.sid.reshape(-1).astype(np.int16)), L)
    value = {} if r.value is None else {"value": pa.array(r.value)}
    return pa.table({"request_id": pa.array(request_id[r.request]), "rank": pa.array(r.rank),
                     "ad_id": pa.array(r.ad_id), "sid": sid, "score": pa.array(r.score)} | value)
