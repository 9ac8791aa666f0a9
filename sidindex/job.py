"""The jobs behind `sidindex build` / `update` and the scheduled rebuild (DESIGN.md §1, §7, §15).

build:  ingest + validate -> codebook (reuse the frozen one, or train) -> SIDs + quality gates ->
        GTM + exact index -> write snapshot -> open and validate it -> publish -> retention
update: open the published snapshot -> validate the whole change file -> apply it
        (`sidindex.update`) -> write what changed, link the rest -> open and validate -> publish

Under ROOT's build lock. The input fingerprint (catalog bytes, targeting spec, build config,
codebook id, snapshot format; for an update, the base's and the change file's bytes) is recorded
in the manifest; when the published snapshot already has a build's, nothing new is published
unless `force`. Any failure publishes nothing.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from schemas.artifacts import AD_LIVE, AD_PAUSED, SNAPSHOT_VERSION
from sidindex.artifact import sha256_file
from sidindex.build import build_index
from sidindex.changes import read_changes
from sidindex.config import BuildConfig, load_config
from sidindex.errors import ArtifactError, ConfigError, QualityGateError
from sidindex.ingest import Catalog, read_catalog
from sidindex.matchers.exact import ExactIndex
from sidindex.root import Root, new_snapshot_id
from sidindex.sid import Codebook, assign_sids, hash_tokens, load_codebook, save_codebook, sid_quality, train_codebook
from sidindex.sid.quality import QualityReport, quality_report
from sidindex.snapshot import Manifest, open_snapshot, write_snapshot
from sidindex.targeting import TargetingSpec, load_targeting
from sidindex.timing import StageClock
from sidindex.trie.build import GTMIndex
from sidindex.trie.stats import GTMStats, gtm_stats
from sidindex.update import ads_in_state, apply_changes

Progress = Callable[[str, int, int], None]


def run_build(catalog: Path, targeting: Path, root: Path, *, config: Path | None = None, codebook: Path | None = None,
              force: bool = False, keep: int = 3, progress: Progress | None = None,
              waiting: Callable[[], None] | None = None, engine: str = "local", ray_address: str | None = None,
              workers: int | None = None) -> dict:
    """Run the job; returns its report (status "published" or "unchanged", ids, counts, seconds).

    engine: "local" (this process; `workers` threads build the trie as subtries, default 1) or "ray"
    (`sidindex.ray_build`: a local Ray on `workers` CPUs, or the cluster at `ray_address`; it
    needs a frozen codebook). Both publish the same arrays.
    """
    if engine not in ENGINES:
        raise ConfigError(f"unknown build engine {engine!r}; expected one of {', '.join(ENGINES)}")
    if ray_address is not None and engine != "ray":
        raise ConfigError("a Ray address applies to the ray engine only")
    if ray_address is not None and workers is not None:
        raise ConfigError("a number of workers sizes a local Ray; a Ray cluster brings its own CPUs")
    progress = progress or (lambda *_: None)
    clock = StageClock()
    cfg = load_config(config)
    spec = load_targeting(targeting)
    layout = Root(root)
    with layout.lock(waiting):
        clock.restart()  # time spent waiting for the lock is not the build's
        cb, cb_source = _codebook(layout, codebook)
        report = {"root": str(root), "codebook": cb_source, "engine": engine}
        if engine == "ray":
            from sidindex.ray_build import fragments

            if cb is None:
                raise ConfigError(f"{root}: holds no frozen codebook, and the ray engine assigns SIDs with one; "
                                  "build once with the local engine (which trains it) or give a codebook")
            fragments(Path(catalog))  # a readable Parquet catalog, before it is read whole
        else:
            hash_keys = cb.hash_keys if cb else cfg.sid.hash_keys
            cat = read_catalog(catalog, spec=spec, hash_keys=hash_keys, dim=cb.dim if cb else None)
            clock.lap("ingest")
            if cb is None:
                cb = train_codebook(cat.embedding, cfg.sid, progress)
                save_codebook(cb, layout.path)
                report["codebook"] = "trained"
                clock.lap("train codebook")
        fingerprint = _fingerprint(catalog, spec.to_dict(), cfg.to_dict(), cb.id)
        if not force and (unchanged := _unchanged(layout, fingerprint)):
            return {**unchanged, **report, "codebook_id": cb.id, "seconds": _rounded(clock)}
        if engine == "ray":  # after the check: unchanged inputs cost no cluster time
            built = _on_ray(catalog, spec, cfg, cb, ray_address, workers)
        else:
            built = _locally(cat, spec, cfg, cb, workers, progress)
        if built.quality.failures:
            raise QualityGateError("SID quality gate failed, nothing published: " + "; ".join(built.quality.failures))
        clock.seconds |= built.seconds
        clock.restart()
        snapshot_id = new_snapshot_id(fingerprint)
        counts = {"ads": len(built.ad_id), "sid_rows": len(built.gtm.leaf_ads), "sids": built.stats.sids,
                  "nodes": built.stats.num_nodes}

        def write(directory: Path) -> None:
            write_snapshot(directory, built.gtm, built.exact, built.ad_id, spec, snapshot_id=snapshot_id, codebook=cb,
                           input_fingerprint=fingerprint, catalog=str(Path(catalog).resolve()),
                           build_config=cfg.to_dict(), counts=counts, stats=built.stats.to_dict(),
                           quality=built.quality.to_dict())

        path = layout.publish(snapshot_id, write, lambda d: open_snapshot(d, verify=True), keep)
        clock.lap("write + validate + publish")
    return {"status": "published", "snapshot_id": snapshot_id, "path": str(path), **report,
            "fingerprint": fingerprint, "codebook_id": cb.id, **counts,
            "matcher_bytes": built.stats.matcher_bytes, **({"ray": built.shape} if built.shape else {}),
            "seconds": _rounded(clock)}


ENGINES = ("local", "ray")


@dataclass(frozen=True)
class _Built:
    """An engine's result: what the snapshot is written from."""

    gtm: GTMIndex
    exact: ExactIndex
    ad_id: np.ndarray
    stats: GTMStats
    quality: QualityReport
    seconds: dict[str, float]
    shape: dict | None = None  # the ray engine's fragments, parts and shuffle


def _locally(cat: Catalog, spec: TargetingSpec, cfg: BuildConfig, cb: Codebook, workers: int | None,
             progress: Progress) -> _Built:
    clock = StageClock()
    tokens = hash_tokens(cat.columns, cb.hash_keys, cb.hash_size)
    assignment = assign_sids(cb, cat.embedding, tokens, progress)
    quality = sid_quality(assignment, cb, cat.embedding, cfg.quality)
    clock.lap("assign SIDs")
    if quality.failures:  # before the trie: fail fast
        return _Built(None, None, cat.ad_id, None, quality, clock.seconds)
    built = build_index(spec, cat.columns, assignment.sids, assignment.ad_index, cb.level_sizes, kway=cfg.kway,
                        ad_value=cat.value, workers=workers)
    return _Built(built.gtm, built.exact, cat.ad_id, built.stats, quality,
                  clock.seconds | {f"build: {k}": v for k, v in built.seconds.items()})


def _on_ray(catalog: Path, spec: TargetingSpec, cfg: BuildConfig, cb: Codebook, address: str | None,
            workers: int | None) -> _Built:
    from sidindex.ray_build import build_on_ray

    r = build_on_ray(Path(catalog), spec, cb, kway=cfg.kway, address=address, workers=workers)
    clock = StageClock()
    g = r.gtm
    counts = np.diff(g.leaf_ad_offsets)
    quality = quality_report(g.leaf_sids(), counts, np.bincount(g.leaf_ads, minlength=len(r.ad_id)), r.sums, cb,
                             cfg.quality)
    stats = gtm_stats(g, tuple(layout.bits for layout in spec.layouts))
    clock.lap("quality + stats")
    return _Built(g, r.exact, r.ad_id, stats, quality, {f"ray: {k}": v for k, v in r.seconds.items()} | clock.seconds,
                  r.shape)


def _unchanged(root: Root, fingerprint: str) -> dict | None:
    """The "unchanged" report when the published snapshot was built from `fingerprint`, else None."""
    published = _current(root)
    try:
        manifest = Manifest.read(root.snapshot_dir(published)) if published else None
    except ArtifactError:  # unreadable: build anew
        return None
    if manifest is None or manifest.input_fingerprint != fingerprint:
        return None
    return {"status": "unchanged", "snapshot_id": published, "fingerprint": fingerprint,
            "ads": manifest.counts.get("ads")}


def run_update(root: Path, changes: Path, *, keep: int = 3, waiting: Callable[[], None] | None = None) -> dict:
    """Apply a change file to ROOT's published snapshot and publish the result; returns its report
    (status "published", or "unchanged" for a file without rows; ids, counts, lineage, seconds)."""
    clock = StageClock()
    layout = Root(root)
    with layout.lock(waiting):
        clock.restart()
        if _current(layout) is None:
            raise ArtifactError(f"{root}: no published snapshot to update; build one first")
        base = open_snapshot(root, verify=False)  # checked when it was published; its structure again now
        cb = base.codebook
        if cb is None:
            raise ArtifactError(f"{base.path}: carries no codebook, so new ads cannot get SIDs; rebuild it")
        clock.lap("open base")
        change = read_changes(str(changes), base.spec, hash_keys=cb.hash_keys, dim=cb.dim,
                              values=base.gtm.ad_value is not None,
                              known=ads_in_state(base, AD_LIVE, AD_PAUSED), paused=ads_in_state(base, AD_PAUSED))
        clock.lap("read changes")
        report = {"root": str(root), "base": base.id, "changes": change.counts}
        if change.empty:
            return {"status": "unchanged", "snapshot_id": base.id, **report, "seconds": _rounded(clock)}
        updated = apply_changes(base, change, cb)
        clock.seconds |= {f"apply: {k}": v for k, v in updated.seconds.items()}
        clock.restart()
        source = sha256_file(Path(changes), follow_links=True)
        fingerprint = hashlib.sha256((base.manifest.input_fingerprint + source).encode()).hexdigest()
        snapshot_id = new_snapshot_id(fingerprint)
        g = updated.gtm
        counts = {"ads": len(updated.ad_id), "sid_rows": len(g.leaf_ads), "sids": g.num_leaves, "nodes": g.num_nodes}
        lineage = {"full_build": base.manifest.full_build, "base": base.id, "updates": base.manifest.updates + 1,
                   "source": source, "changes": change.counts, **updated.counts}
        m = base.manifest

        def write(directory: Path) -> None:
            write_snapshot(directory, g, updated.exact, updated.ad_id, base.spec, snapshot_id=snapshot_id,
                           codebook=cb, input_fingerprint=fingerprint, catalog=m.catalog,
                           build_config=m.build_config, counts=counts, stats=m.stats, quality=m.quality, base=base,
                           lineage=lineage)

        # the new files were hashed as they were written (read back); the check validates structure
        path = layout.publish(snapshot_id, write, lambda d: open_snapshot(d, verify=False, base=base), keep)
        clock.lap("write + validate + publish")
    return {"status": "published", "snapshot_id": snapshot_id, "path": str(path), **report, **counts,
            "new_sid_rows": updated.sid_rows, "lineage": lineage, "seconds": _rounded(clock)}


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


