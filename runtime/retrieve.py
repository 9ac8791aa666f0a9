"""Retrieval end to end: requests -> constrained beam search -> eligible ads, in batches."""

from __future__ import annotations

import time
from dataclasses import dataclass, field, fields

import numpy as np
import pyarrow as pa
import torch

from runtime.loader import DeviceIndex
from runtime.post import Retrieved, expand
from runtime.requests import encode_requests
from runtime.scorer import CodebookScorer
from runtime.search import DEFAULT_BEAMS, Scorer, beam_search
from sidindex.errors import ArtifactError, InputError
from sidindex.ingest import Requests
from sidindex.matchers.exact import encode_exact_requests
from sidindex.sid import load_codebook


@dataclass
class RetrievalRun:
    """The result rows (`Retrieved`, request rows of the whole table) and where the time went."""

    result: Retrieved
    seconds: dict[str, float] = field(default_factory=dict)

    def table(self, request_id: np.ndarray) -> pa.Table:
        """request_id, rank, ad_id, sid (list<int16> of L tokens), score."""
        r = self.result
        L = r.sid.shape[1] if r.sid.ndim == 2 else 0
        sid = pa.FixedSizeListArray.from_arrays(pa.array(r.sid.reshape(-1).astype(np.int16)), L)
        return pa.table({"request_id": pa.array(request_id[r.request]), "rank": pa.array(r.rank),
                         "ad_id": pa.array(r.ad_id), "sid": sid, "score": pa.array(r.score)})


def codebook_scorer(index: DeviceIndex, requests: Requests, temperature: float = 1.0):
    """rows -> the codebook scorer for requests[rows], from the codebook the snapshot carries
    (loaded and checked once)."""
    snap = index.snapshot
    if requests.embedding is None:
        raise InputError(f"{requests.path}: the codebook scorer needs an `embedding` column in the requests")
    cb_dir = snap.path / "codebooks" / str(snap.manifest.get("codebook_id"))
    if not cb_dir.is_dir():
        raise ArtifactError(f"{snap.path}: carries no codebook (expected {cb_dir}); the codebook scorer needs it")
    cb = load_codebook(cb_dir)
    if cb.dim != requests.embedding.shape[1]:
        raise InputError(f"{requests.path}: embedding has {requests.embedding.shape[1]} dimensions, the codebook {cb.dim}")

    def for_rows(rows: slice) -> Scorer:
        emb = torch.from_numpy(np.ascontiguousarray(requests.embedding[rows], dtype=np.float32)).to(index.device)
        return CodebookScorer(cb, emb, temperature)

    return for_rows


def retrieve(index: DeviceIndex, requests: Requests, *, mode: str = "cd+gtm", beams: tuple[int, ...] = DEFAULT_BEAMS,
             top_k: int | None = None, batch_size: int = 16, scorer=None, impl: str = "auto",
             stages: bool = False, progress=None) -> RetrievalRun:
    """Ranked eligible ads for every request, `batch_size` requests per search.

    scorer: rows (a slice of the request table) -> Scorer for those rows; default the codebook scorer
    """
    scorer = scorer or codebook_scorer(index, requests)
    spec = index.snapshot.spec
    dev_req = encode_requests(spec, requests, index.device)
    exact_req = encode_exact_requests(index.snapshot.exact, requests.columns)
    parts, seconds = [], {"search": 0.0, "post": 0.0}
    n = len(requests)
    for lo in range(0, n, batch_size):
        hi = min(n, lo + batch_size)
        t = time.perf_counter()
        found = beam_search(index, dev_req.slice(lo, hi), scorer(slice(lo, hi)), beams, mode, impl)
        if index.device.type == "cuda":
            torch.cuda.synchronize(index.device)
        seconds["search"] += time.perf_counter() - t
        t = time.perf_counter()
        part = expand(index.snapshot, _rows(exact_req, lo, hi), found, top_k, stages)
        parts.append((lo, part))
        seconds["post"] += time.perf_counter() - t
        if progress:
            progress("retrieve", hi, n)
    return RetrievalRun(_concat(parts), seconds)


def _rows(req, lo: int, hi: int):
    """ExactRequests of requests lo..hi-1."""
    return type(req)(req.user_rows[lo:hi], req.hash_offsets[:, lo:hi + 1], req.hashes)


def _concat(parts: list[tuple[int, Retrieved]]) -> Retrieved:
    """Batches -> one result; request rows shifted to the whole table's."""
    out = {}
    for f in fields(Retrieved):
        vals = [getattr(p, f.name) for _, p in parts]
        if f.name == "request":
            vals = [v + lo for v, (lo, _) in zip(vals, parts)]
        out[f.name] = None if vals[0] is None else np.concatenate(vals)
    return Retrieved(**out)
