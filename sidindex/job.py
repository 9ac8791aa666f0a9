"""The build job behind `sidindex build` and the scheduled rebuild (DESIGN.md §1, §7).

    ingest + validate -> codebook (reuse the frozen one, or train) -> SIDs + quality gates ->
    GTM + exact index -> write snapshot -> open and validate it -> publish -> retention

Under ROOT's build lock. The input fingerprint (catalog bytes, targeting spec, build config,
codebook id, snapshot format) is recorded in the manifest; when the published snapshot already
has it, nothing new is published unless `force`. Any failure publishes nothing.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from pathlib import Path

from schemas.artifacts import SNAPSHOT_VERSION
from sidindex.artifact import sha256_file
from sidindex.build import build_index
from sidindex.config import load_config
from sidindex.errors import ArtifactError, QualityGateError
from sidindex.ingest import read_catalog
from sidindex.root import Root, new_snapshot_id
from sidindex.sid import assign_sids, hash_tokens, load_codebook, save_codebook, sid_quality, train_codebook
from sidindex.snapshot import Manifest, open_snapshot, write_snapshot
from sidindex.targeting import load_targeting
from sidindex.timing import StageClock

Progress = Callable[[str, int, int], None]


def run_build(catalog: Path, targeting: Path, root: Path, *, config: Path | None = None, codebook: Path | None = None,
              force: bool = False, keep: int = 3, progress: Progress | None = None,
              waiting: Callable[[], None] | None = None) -> dict:
    """Run the job; returns its report (status "published" or "unchanged", ids, counts, seconds)."""
    progress = progress or (lambda *_: None)
    clock = StageClock()
    cfg = load_config(config)
    spec = load_targeting(targeting)
    layout = Root(root)
    with layout.lock(waiting):
        clock.restart()  # time spent waiting for the lock is not the build's
        cb, cb_source = _codebook(layout, codebook)
        hash_keys = cb.hash_keys if cb else cfg.sid.hash_keys
        cat = read_catalog(catalog, spec=spec, hash_keys=hash_keys, dim=cb.dim if cb else None)
        clock.lap("ingest")
        if cb is None:
            cb = train_codebook(cat.embedding, cfg.sid, progress)
            save_codebook(cb, layout.path)
            cb_source = "trained"
            clock.lap("train codebook")
        fingerprint = _fingerprint(catalog, spec.to_dict(), cfg.to_dict(), cb.id)
        report = {"root": str(root), "fingerprint": fingerprint, "codebook_id": cb.id, "codebook": cb_source,
                  "ads": len(cat)}
        published = _current(layout)
        if not force and published and _published_fingerprint(layout, published) == fingerprint:
            return {"status": "unchanged", "snapshot_id": published, **report, "seconds": _rounded(clock)}
        tokens = hash_tokens(cat.columns, cb.hash_keys, cb.hash_size)
        assignment = assign_sids(cb, cat.embedding, tokens, progress)
        quality = sid_quality(assignment, cb, cat.embedding, cfg.quality)
        if quality.failures:
            raise QualityGateError("SID quality gate failed, nothing published: " + "; ".join(quality.failures))
        clock.lap("assign SIDs")
        built = build_index(spec, cat.columns, assignment.sids, assignment.ad_index, cb.level_sizes, kway=cfg.kway,
                            ad_value=cat.value)
        clock.seconds |= {f"build: {k}": v for k, v in built.seconds.items()}
        clock.restart()
        snapshot_id = new_snapshot_id(fingerprint)
        counts = {"ads": len(cat), "sid_rows": int(len(assignment.sids)), "sids": built.stats.sids,
                  "nodes": built.stats.num_nodes}

        def write(directory: Path) -> None:
            write_snapshot(directory, built.gtm, built.exact, cat.ad_id, spec, snapshot_id=snapshot_id, codebook=cb,
                           input_fingerprint=fingerprint, catalog=str(Path(catalog).resolve()),
                           build_config=cfg.to_dict(), counts=counts, stats=built.stats.to_dict(),
                           quality=quality.to_dict())

        path = layout.publish(snapshot_id, write, lambda d: open_snapshot(d, verify=True), keep)
        clock.lap("write + validate + publish")
    return {"status": "published", "snapshot_id": snapshot_id, "path": str(path), **report,
            "sid_rows": int(len(assignment.sids)), "sids": built.stats.sids, "nodes": built.stats.num_nodes,
            "matcher_bytes": built.stats.matcher_bytes, "seconds": _rounded(clock)}


def _rounded(clock: StageClock) -> dict[str, float]:
    return {k: round(v, 3) for k, v in clock.seconds.items()}


def _codebook(root: Root, given: Path | None):
    """(codebook, "given" | "reused") or (None, "") when ROOT has none and training is needed."""
    if given is not None:
        return load_codebook(given), "given"
    if not any(root.codebooks.glob("cb-*")):
        return None, ""
    return load_codebook(root.path), "reused"


def _fingerprint(catalog: Path, spec: dict, config: dict, codebook_id: str) -> str:
    h = hashlib.sha256(sha256_file(Path(catalog), follow_links=True).encode())  # a link to the latest export
    h.update(json.dumps({"targeting": spec, "config": config, "codebook": codebook_id,
                         "snapshot_format": SNAPSHOT_VERSION}, sort_keys=True).encode())
    return h.hexdigest()


def _current(root: Root) -> str | None:
    """The published id; None when CURRENT is unreadable (a new build replaces it)."""
    try:
        return root.current_id()
    except ArtifactError:
        return None


def _published_fingerprint(root: Root, snapshot_id: str) -> str | None:
    """The fingerprint the published snapshot was built from (None when it cannot be read: build anew)."""
    try:
        return Manifest.read(root.snapshot_dir(snapshot_id)).input_fingerprint
    except ArtifactError:
        return None
