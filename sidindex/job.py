"""The jobs behind `sidindex build` / `update` and the scheduled rebuild (docs/design.md §1, §7, §15).

build:  ingest + validate -> codebook (frozen or trained) -> SIDs + quality gates -> GTM + exact
        index -> carry paused ads and journaled changes forward -> write, open, validate -> publish
update: verify the published snapshot -> validate the whole change file -> apply it
        (`sidindex.update`) -> write what changed, link the rest -> validate -> publish, journaled

Under ROOT's build lock, over the CURRENT read there; any failure publishes nothing, and an input
fingerprint already published publishes nothing unless `force`. A build keeps the published
snapshot's paused ads and, given the newest change file its export holds (`changes_through`),
re-applies the journal's later change files. Given a signing key, a job signs what it publishes
and first verifies the snapshot it builds on against `trust_key` (default: the signing key's own
public half), accepting an unsigned one only with `adopt_unsigned`. In full: docs/operations.md
("What a job does", "Changes survive full builds", "Signed snapshots").
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, NamedTuple

import numpy as np

from schemas.artifacts import AD_PAUSED, MAX_SHARDS, SIGNATURE_FILE, SNAPSHOT_VERSION
from schemas.contracts import CHANGES_THROUGH_KEY
from sidindex import journal as journals
from sidindex.artifact import regular_input, sha256_file
from sidindex.build import BuiltIndex, build_index
from sidindex.changes import Changes, read_changes
from sidindex.config import BuildConfig, load_config
from sidindex.errors import ArtifactError, ConfigError, QualityGateError, SidIndexError
from sidindex.ingest import Catalog, read_catalog, table_metadata
from sidindex.root import Root, new_snapshot_id
from sidindex.sid import Codebook, assign_sids, hash_tokens, load_codebook, save_codebook, sid_quality, train_codebook
from sidindex.sid.quality import QualityReport
from sidindex.signing import SigningKey, TrustKey
from sidindex.snapshot import Manifest, open_snapshot, read_states, write_snapshot
from sidindex.snapshot.manifest import Counts, Journal, Lineage
from sidindex.snapshot.records import write_record
from sidindex.snapshot.snapshot import check_to_publish, write_manifest
from sidindex.targeting import TargetingSpec, load_targeting
from sidindex.timing import StageClock
from sidindex.trie.stats import gtm_stats
from sidindex.update import Indexed, ad_rows, apply_changes

if TYPE_CHECKING:  # Ray is an optional extra
    from sidindex.ray_build import RayBuilt

Progress = Callable[[str, int, int], None]


def run_build(catalog: Path, targeting: Path, root: Path, *, config: Path | None = None, codebook: Path | None = None,
              force: bool = False, keep: int = 3, progress: Progress | None = None,
              waiting: Callable[[], None] | None = None, engine: str = "local", ray_address: str | None = None,
              workers: int | None = None, changes_through: str | None = None, shards: int | None = None,
              sign_key: SigningKey | str | Path | None = None, trust_key: TrustKey | str | Path | None = None,
              adopt_unsigned: bool = False) -> dict:
    """Run the job; returns its report (status "published" or "unchanged", ids, counts, what was
    carried forward, warnings, seconds).

    engine: "local" (this process; `workers` threads build the trie as subtries, default 1) or "ray"
    (`sidindex.ray_build`: a local Ray on `workers` CPUs, or the cluster at `ray_address`; it
    needs a frozen codebook). Both publish the same arrays.
    changes_through: the name of the newest change file the catalog export holds (see the module
    docstring); None: unknown.
    shards: the snapshot's shard count (docs/design.md §18; default from the catalog's size, at most one
    per first-level token): the shards' arrays depend on it and the catalog alone, not on the engine.
    sign_key, trust_key, adopt_unsigned: see the module docstring (`_signing`).
    """
    if shards is not None and not 1 <= shards <= MAX_SHARDS:
        raise ConfigError(f"a snapshot holds 1 to {MAX_SHARDS} shards, not {shards}")
    if engine not in ENGINES:
        raise ConfigError(f"unknown build engine {engine!r}; expected one of {', '.join(ENGINES)}")
    if ray_address is not None and engine != "ray":
        raise ConfigError("a Ray address applies to the ray engine only")
    if ray_address is not None and workers is not None:
        raise ConfigError("a number of workers sizes a local Ray; a Ray cluster brings its own CPUs")
    exported = table_metadata(catalog, "catalog").get(CHANGES_THROUGH_KEY)  # also: a regular file, before the lock
    if changes_through is not None and exported is not None and changes_through != exported:
        raise ConfigError(f"{catalog}: the export says it holds the change files through {exported!r} (its "
                          f"{CHANGES_THROUGH_KEY!r} metadata), the build was told {changes_through!r}; give one")
    changes_through = changes_through if changes_through is not None else exported
    if changes_through is not None and (not changes_through or Path(changes_through).name != changes_through):
        raise ConfigError(f"{changes_through!r} does not name a change file (a file name, without a directory)")
    progress = progress or (lambda *_: None)
    signer, keys = _signing(sign_key, trust_key)
    clock = StageClock()
    cfg = load_config(config)
    spec = load_targeting(targeting)
    layout = Root(root)
    started_over = _published(layout)
    with layout.lock(waiting), tempfile.TemporaryDirectory(prefix="sidindex-changes-") as copies:
        clock.restart()  # time spent waiting for the lock is not the build's
        published = _published(layout)
        carry = _to_carry(layout, published, changes_through, keys, adopt_unsigned, Path(copies))
        if changes_through is None and published != started_over and any(
                r.update > (started_over or "") for r in carry.journal.entries):
            raise ArtifactError(f"{root}: an update was published while this build waited for the ROOT (CURRENT is "
                                f"now {published}); its changes may be newer than this catalog export and would be "
                                "reverted, so nothing was built. Run the build again (or give it the newest change "
                                "file its export holds)")
        cb, cb_source = _codebook(layout, codebook)
        if signer is not None and cb is not None and cb_source == "reused" and carry.signed \
                and cb.id != carry.codebook_id:  # the signature vouches for the codebook it carries, by content id
            raise ArtifactError(f"{layout.codebooks}: holds codebook {cb.id}, not {carry.codebook_id}, which the "
                                "signed published snapshot carries; a signing build reuses only a codebook a signature "
                                "vouches for. Give the codebook explicitly, or restore the ROOT's")
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
        fingerprint = _fingerprint(catalog, spec.to_dict(), cfg.to_dict(), cb.id, changes_through, shards,
                                   signer.trust.key_id if signer is not None else None)
        if not force and (unchanged := _unchanged(layout, fingerprint)):
            return {**unchanged, **report, "codebook_id": cb.id, "seconds": _rounded(clock)}
        if engine == "ray":  # after the check: unchanged inputs cost no cluster time
            from sidindex.ray_build import ray_cluster

            with ray_cluster(ray_address, workers):
                clock.lap("start ray")
                snapshot_id, path, m, on_ray, carried, warnings = _publish_on_ray(
                    layout, published, Path(catalog), spec, cfg, cb, fingerprint, carry, keep, shards, signer, clock,
                    progress)
            counted = {"shards": len(m.shard_list()), **m.counts.to_dict()}
            stats, shape = on_ray.stats, {"ray": on_ray.shape}
        else:
            built = _locally(cat, spec, cfg, cb, workers, shards, progress)
            del cat  # its columns are in the index now: not held through the write and the check
            clock.seconds |= built.seconds
            clock.restart()
            built, carried, warnings = _carry_changes(layout, published, built, cb, carry)
            clock.lap("carry changes")
            snapshot_id = new_snapshot_id(fingerprint)
            ad_id, local_stats, quality = built.ad_id, built.stats, built.quality
            assert ad_id is not None and local_stats is not None and quality is not None  # an engine's index has them
            stats = local_stats
            counted = {"shards": len(built.shards), **Counts.of([s.gtm for s in built.shards], ad_id).to_dict()}
            shape = {}
            held = [built]  # dropped once written: the check maps the files, and need not find the arrays held too
            del built

            def write(directory: Path) -> None:
                index = held.pop()
                write_snapshot(directory, index.shards, index.exact, ad_id, spec, snapshot_id=snapshot_id,
                               codebook=cb, input_fingerprint=fingerprint, catalog=str(Path(catalog).resolve()),
                               build_config=cfg, stats=stats, quality=quality.to_dict(), journal=carry.journal)

            path = layout.publish(snapshot_id, write, lambda d: check_to_publish(d, layout, snapshot_id), keep,
                                  expected=published, retired=carry.retired, signer=signer,
                                  published=lambda: clock.lap("write + validate + publish"))
            clock.lap("retention")
    return {"status": "published", "snapshot_id": snapshot_id, "path": str(path), **report,
            "fingerprint": fingerprint, "codebook_id": cb.id, **counted, "matcher_bytes": stats.matcher_bytes,
            "carried": carried, "warnings": warnings, **shape, **_signed(signer), "seconds": _rounded(clock)}


ENGINES = ("local", "ray")


def _locally(cat: Catalog, spec: TargetingSpec, cfg: BuildConfig, cb: Codebook, workers: int | None,
             shards: int | None, progress: Progress) -> BuiltIndex:
    """The local engine's index, with the catalog's ad ids and the SID quality report."""
    clock = StageClock()
    tokens = hash_tokens(cat.columns, cb.hash_keys, cb.hash_size)
    assignment = assign_sids(cb, cat.embedding, tokens, progress)
    quality = _gated(sid_quality(assignment, cb, cat.embedding, cfg.quality))  # before the trie: fail fast
    clock.lap("assign SIDs")
    built = build_index(spec, cat.columns, assignment.sids, assignment.ad_index, cb.level_sizes, kway=cfg.kway,
                        ad_value=cat.value, workers=workers, shards=shards)
    return dataclasses.replace(built, ad_id=cat.ad_id, quality=quality,
                               seconds=clock.seconds | {f"build: {k}": v for k, v in built.seconds.items()})


def _gated(quality: QualityReport) -> QualityReport:
    """`quality`, when it passes its gates (else nothing is built or published)."""
    if quality.failures:
        raise QualityGateError("SID quality gate failed, nothing published: " + "; ".join(quality.failures))
    return quality


def _publish_on_ray(root: Root, published: str | None, catalog: Path, spec: TargetingSpec, cfg: BuildConfig,
                    cb: Codebook, fingerprint: str, carry: _Carry, keep: int, shards: int | None,
                    signer: SigningKey | None, clock: StageClock, progress: Progress
                    ) -> tuple[str, Path, Manifest, RayBuilt, dict, list[str]]:
    """The ray engine's build, published (on the Ray of `ray_cluster`): its tasks write the snapshot
    into the ROOT and check it, this process writes the manifest. The changes a build carries forward
    (`_carry_changes`), when there are any, are applied here to the snapshot the tasks wrote, staged
    beside it, into one that links what they leave as it is. Returns the id, the directory, the
    manifest, what the engine built, what was carried and the warnings; seconds per stage into `clock`."""
    from sidindex.ray_build import build_on_ray, check_on_ray

    snapshot_id = new_snapshot_id(fingerprint)
    done: dict = {}

    def write(directory: Path) -> None:
        # staged under a temporary of the ROOT's (what a killed build leaves is cleaned), named as its id says
        holder = directory.with_name(f"{directory.name}.ray")
        staged = holder / snapshot_id if len(carry.paused) or carry.replay else directory
        staged.mkdir(parents=True, exist_ok=True)
        try:
            built = done["built"] = build_on_ray(catalog, spec, cb, staged, kway=cfg.kway, quality=cfg.quality,
                                                 shards=shards, progress=progress)
            clock.seconds |= {f"ray: {k}": v for k, v in built.seconds.items()}
            clock.restart()
            _gated(built.quality)
            m = write_manifest(staged, built.shards, built.global_arrays, built.listed, spec, cb.level_sizes,
                               snapshot_id=snapshot_id, codebook=cb, input_fingerprint=fingerprint,
                               catalog=str(catalog.resolve()), build_config=cfg, stats=built.stats,
                               quality=built.quality.to_dict(), journal=carry.journal)
            clock.lap("write manifest")
            done["carried"], done["warnings"] = {"paused": 0, "replayed": []}, carry.warnings
            if staged != directory:
                # its structure is checked before the changes read it; its digests, those of the files the
                # published snapshot links, are checked there (`check_on_ray`) before it is published
                base = open_snapshot(staged, verify=False)
                index = BuiltIndex(base.shards, base.exact, {}, ad_id=base.ad_id, stats=built.stats,
                                   quality=built.quality)
                index, done["carried"], done["warnings"] = _carry_changes(root, published, index, cb, carry)
                assert index.ad_id is not None and index.stats is not None
                m = write_snapshot(directory, index.shards, index.exact, index.ad_id, spec, snapshot_id=snapshot_id,
                                   codebook=cb, input_fingerprint=fingerprint, catalog=str(catalog.resolve()),
                                   build_config=cfg, stats=index.stats, quality=built.quality.to_dict(), base=base,
                                   journal=carry.journal)
                clock.lap("carry changes")
            done["manifest"] = m
        finally:
            shutil.rmtree(holder, ignore_errors=True)

    def check(directory: Path) -> None:
        clock.restart()
        check_on_ray(directory)  # every part's digests and structure
        write_record(root, snapshot_id, Manifest.read(directory).sha256(), ("structure",))
        clock.lap("check on ray")

    path = root.publish(snapshot_id, write, check, keep, expected=published, retired=carry.retired, signer=signer,
                        published=lambda: clock.lap("publish"))
    clock.lap("retention")
    return snapshot_id, path, done["manifest"], done["built"], done["carried"], done["warnings"]


def _carry_changes(root: Root, published: str | None, built: BuiltIndex, cb: Codebook, carry: _Carry
                   ) -> tuple[BuiltIndex, dict, list[str]]:
    """`built` with the ads the published snapshot has paused paused, and the journal's change files
    `carry` names re-applied in the order they were published; what was carried, and the warnings
    for the report."""
    paused, replay, warnings = carry.paused, carry.replay, carry.warnings
    assert built.ad_id is not None  # an engine's index carries the catalog's ad ids
    index: Indexed = built
    if len(paused):  # an ad the export no longer holds is gone, pause and all
        paused = paused[np.isin(paused, built.ad_id)]
    if published is not None and len(paused):  # (none paused when nothing is published)
        index = apply_changes(index, Changes.pausing(paused, f"{root.snapshot_dir(published)} (paused ads)"), cb)
    for f in replay:
        ids, states = ad_rows(index)
        change = read_changes(str(f), built.exact.spec, hash_keys=cb.hash_keys, dim=cb.dim,
                              values=built.shards[0].gtm.ad_value is not None, ad_id=ids, state=states, replay=True)
        index = apply_changes(index, change, cb)
    carried = {"paused": len(paused), "replayed": [f.name for f in replay]}
    if index is built:
        return built, carried, warnings
    stats = gtm_stats([s.gtm for s in index.shards], tuple(layout.bits for layout in built.exact.spec.layouts)
                      ) if replay else built.stats
    return dataclasses.replace(built, shards=index.shards, exact=index.exact, ad_id=index.ad_id, stats=stats), \
        carried, warnings


class _Carry(NamedTuple):
    """What a build carries forward (`_carry_changes`): the ids (n,) int64 of the ads the published
    snapshot has paused, private copies of the journal's change files to re-apply (checked against
    their records), the warnings for the report, the journal its snapshot records, the journal
    entries that journal drops (deleted once it is published), and the published snapshot's
    codebook and whether its signature was verified."""

    paused: np.ndarray
    replay: list[Path]
    warnings: list[str]
    journal: Journal
    retired: list[Path]
    codebook_id: str | None  # the published snapshot's codebook
    signed: bool  # its signature was verified


def _to_carry(root: Root, published: str | None, through: str | None, keys: tuple[TrustKey, ...],
              adopt_unsigned: bool, copies: Path) -> _Carry:
    """What a build from an export holding the change files through `through` carries forward from
    the published snapshot (signed by one of `keys`, when given); the change files to apply again
    are copied into the private directory `copies`, and checked there."""
    directory = root.snapshot_dir(published) if published is not None else None
    trust = _base_trust(root, directory, keys, adopt_unsigned)
    manifest = _published_manifest(directory, trust, "a build cannot carry that snapshot's paused ads and journal "
                                   "forward. Restore it, or move its ROOT's CURRENT aside to build without them")
    journal, on_record = journals.recorded(root, manifest)
    replay = journals.replayed(journal, through) if through is not None else ()
    files = journals.change_files(root, replay, copies)
    warnings = journals.warnings(journal, on_record, published or "")
    warnings += [f"{d}: a journal entry the published snapshot does not record (forged, a file edited and renamed, "
                 "or one a crash kept from being deleted); not applied" for d in journals.unrecorded(root, journal)]
    if through is None and journal.entries:
        first, last = journal.entries[0].name, journal.entries[-1].name
        warnings.append(f"{len(journal.entries)} change file(s) in the ROOT's journal ({first} .. {last}, published by "
                        "updates since the last build told its export's newest change file) were not re-applied: the "
                        "build was not told which of them its catalog export holds, so the deletes and upserts of any "
                        "it lacks are reverted (paused ads stay paused)")
    new = Journal(through, tuple(replay)) if through is not None else journal
    return _Carry(_paused(root, published, trust), files, warnings, new, journals.retired(root, journal, new),
                  manifest.codebook_id if manifest is not None else None, trust is not None)


def _signing(sign_key: SigningKey | str | Path | None, trust_key: TrustKey | str | Path | None
             ) -> tuple[SigningKey | None, tuple[TrustKey, ...]]:
    """The key a job signs with, and the keys the snapshot it builds on may be signed by: the trust
    key given and the signing key's own public half (rotating keys: the base an earlier job signed
    with the new key passes too); none when the job neither signs nor was given a key."""
    signer = sign_key if isinstance(sign_key, SigningKey) or sign_key is None else SigningKey.load(sign_key)
    keys = [k for k in (TrustKey.of(trust_key), signer.trust if signer is not None else None) if k is not None]
    return signer, tuple(keys)


def _base_trust(root: Root, directory: Path | None, keys: tuple[TrustKey, ...], adopt_unsigned: bool
                ) -> TrustKey | None:
    """The key the snapshot `directory` a job builds on is checked with (of `keys`, the one its
    signature names); none for an unsigned one the job was told to adopt, as long as the ROOT holds
    no signed snapshot (a stripped signature must not be adopted; a signed base is still checked:
    adopting is no way around a bad signature)."""
    if not keys or directory is None:
        return None
    if adopt_unsigned and not os.path.lexists(directory / SIGNATURE_FILE):
        signed = [p.name for p in root.published_dirs() if os.path.lexists(p / SIGNATURE_FILE)]
        if signed:
            raise ArtifactError(f"{directory}: unsigned, and its ROOT holds signed snapshots ({signed[-1]}): its "
                                "signature may have been stripped, so it is not adopted. Restore a signed snapshot")
        return None
    return TrustKey.pick(directory, keys)


def _signed(signer: SigningKey | None) -> dict:
    """The report's word on signing."""
    return {"signed_by": signer.trust.key_id} if signer is not None else {}


def _published_manifest(directory: Path | None, trust: TrustKey | None, consequence: str) -> Manifest | None:
    """The published snapshot's manifest (signed by `trust`, when given), None when nothing is
    published; one that cannot be read is refused, saying `consequence`: the journal it records
    would be a guess."""
    if directory is None:
        return None
    try:
        return Manifest.read(directory, trust)
    except ArtifactError as e:
        raise ArtifactError(f"{e}; {consequence}") from None


def _published(root: Root) -> str | None:
    """The id CURRENT names, None when nothing is published; an unreadable CURRENT is refused: a
    build over it could not keep the paused ads of the snapshot it names."""
    try:
        return root.current_id()
    except ArtifactError as e:
        raise ArtifactError(f"{e}; a build cannot carry that snapshot's paused ads forward. Restore CURRENT, or move "
                            "it aside to build without them") from None


def _paused(root: Root, published: str | None, trust: TrustKey | None) -> np.ndarray:
    """(n,) int64 the ids of the ads the published snapshot has paused, read from its verified
    ad ids and states (a full build without ad states has none)."""
    if published is None:
        return np.zeros(0, dtype=np.int64)
    try:
        states = read_states(root.snapshot_dir(published), trust)
    except ArtifactError as e:
        raise ArtifactError(f"cannot carry the ads paused in the published snapshot forward ({e}); a build from the "
                            "catalog alone would serve them again. Restore that snapshot, or move its ROOT's CURRENT "
                            "aside to build without it") from None
    if states is None:
        return np.zeros(0, dtype=np.int64)
    ads, state = states
    return np.asarray(ads)[state == AD_PAUSED]


def _unchanged(root: Root, fingerprint: str) -> dict | None:
    """The "unchanged" report when the published snapshot was built from `fingerprint`, else None."""
    published = root.current_or_none()
    try:
        manifest = Manifest.read(root.snapshot_dir(published)) if published else None
    except ArtifactError:  # unreadable: build anew
        return None
    if manifest is None or manifest.input_fingerprint != fingerprint:
        return None
    return {"status": "unchanged", "snapshot_id": published, "fingerprint": fingerprint,
            "ads": manifest.counts.ads}


def run_update(root: Path, changes: Path, *, keep: int = 3, waiting: Callable[[], None] | None = None,
               once: bool = False, sign_key: SigningKey | str | Path | None = None,
               trust_key: TrustKey | str | Path | None = None, adopt_unsigned: bool = False) -> dict:
    """Apply a change file to ROOT's published snapshot and publish the result; returns its report
    (status "published", "unchanged" for a file without rows, or with `once` "already applied" for
    a file the published snapshot holds (`sidindex.journal.holds`); ids, counts, lineage, seconds).
    sign_key, trust_key, adopt_unsigned: see the module docstring.

    Nothing read is trusted: every file of the published snapshot has its digest verified before it
    is used, since whatever it holds is written into the new snapshot under fresh digests; its
    structure and matchers' cover are checked too, unless ROOT's check record says that this very
    manifest passed them (`sidindex.snapshot.records`: the digests tie each byte to it). A base checked
    in full is recorded; so is the new snapshot once validated (its shared files are the base's,
    the files it wrote are checked), so a chain of updates checks each snapshot's structure once.
    The change file is read, digested and journaled from one copy; messages name the user's path."""
    clock = StageClock()
    layout = Root(root)
    regular_input(changes, "change file")  # before the lock: a FIFO would hold it while blocking the read
    signer, keys = _signing(sign_key, trust_key)
    _to_update(layout)  # before the lock too: a refused update creates nothing
    with layout.lock(waiting, create=False), _private_copy(Path(changes)) as mine, _naming(mine, Path(changes)), \
            layout.staged_change(mine) as staged:
        clock.restart()
        published = _to_update(layout)
        source = sha256_file(mine)
        directory = layout.snapshot_dir(published)
        trust = _base_trust(layout, directory, keys, adopt_unsigned)
        journal, on_record = journals.recorded(layout, _published_manifest(
            directory, trust, "an update cannot build on it. Restore it, or publish a new one with a full build"))
        if once and journals.holds(journal, Path(changes).name, source):
            return {"status": "already applied", "snapshot_id": None, "root": str(root), "seconds": _rounded(clock)}
        # its checks on record are not made again, but every file is hashed: its bytes go into the
        # new snapshot under fresh digests
        base = open_snapshot(directory, verify=True, cover=True, records=True, rehash=True, trust=trust)
        cb = base.codebook
        if cb is None:
            raise ArtifactError(f"{base.path}: carries no codebook, so new ads cannot get SIDs; rebuild it")
        clock.lap("verify base")
        base_ids, base_states = ad_rows(base)
        change = read_changes(str(mine), base.spec, hash_keys=cb.hash_keys, dim=cb.dim,
                              values=base.shards[0].gtm.ad_value is not None, ad_id=base_ids, state=base_states)
        clock.lap("read changes")
        report = {"root": str(root), "base": base.id, "base_checks": "recorded" if base.recorded else "full",
                  "changes": change.counts, "warnings": journals.warnings(journal, on_record, base.id)}
        if change.empty:
            return {"status": "unchanged", "snapshot_id": base.id, **report, "seconds": _rounded(clock)}
        updated = apply_changes(base, change, cb)
        ad_id, ad_state = updated.ad_id, updated.exact.ad_state
        assert (ad_id is not None and ad_state is not None and updated.stale_entries is not None
                and updated.dead_sids is not None)  # an update's index carries them all
        clock.seconds |= {f"apply: {k}": v for k, v in updated.seconds.items()}
        clock.restart()
        fingerprint = hashlib.sha256((base.manifest.input_fingerprint + source).encode()).hexdigest()
        snapshot_id = new_snapshot_id(fingerprint)
        m = base.manifest
        paused, deleted = updated.exact.paused_and_deleted()
        lineage = Lineage(full_build=m.full_build, base=base.id, updates=m.updates + 1, source=source,
                          changes=change.counts, paused=paused, deleted=deleted,
                          stale_entries=updated.stale_entries, dead_sids=updated.dead_sids)
        journaled = journals.after_update(journal, snapshot_id, Path(changes).name, source)

        def write(directory: Path) -> None:
            write_snapshot(directory, updated.shards, updated.exact, ad_id, base.spec, snapshot_id=snapshot_id,
                           codebook=cb, input_fingerprint=fingerprint, catalog=m.catalog,
                           build_config=m.build_config, stats=m.stats, quality=m.quality, base=base, lineage=lineage,
                           journal=journaled)

        # files linked from the base were verified above, in this job; the new ones were digested as
        # read back from disk once written (hashing them again would compare them with themselves);
        # their structure is checked, and the cover when new SIDs brought matcher rows (the
        # relations not kept from the base, whose cover passed); it is then checked as a whole, and
        # recorded so (a record of a snapshot that never publishes is pruned)
        def check(directory: Path) -> None:
            new = open_snapshot(directory, verify=False, cover=updated.new_sid_rows > 0, base=base)
            write_record(layout, snapshot_id, new.manifest.sha256(), ("structure", "cover"))

        path = layout.publish(snapshot_id, write, check, keep, expected=published, journal=(staged, source),
                              retired=journals.retired(layout, journal, journaled), signer=signer,
                              published=lambda: clock.lap("write + validate + publish"))
        clock.lap("retention")
    return {"status": "published", "snapshot_id": snapshot_id, "path": str(path), **report,
            **Counts.of([s.gtm for s in updated.shards], ad_id).to_dict(), "new_sid_rows": updated.new_sid_rows,
            "lineage": lineage.to_dict(), **_signed(signer), "seconds": _rounded(clock)}


@contextmanager
def _private_copy(path: Path) -> Iterator[Path]:
    """A copy of change file `path` in a directory only this process's user can write: what an
    update reads, digests and journals, so that nothing that can write ROOT (where the journal's
    copy is staged) changes the bytes between the digest and the parse."""
    with tempfile.TemporaryDirectory(prefix="sidindex-changes-") as d:
        copy = Path(d) / path.name
        shutil.copyfile(path, copy)
        yield copy


@contextmanager
def _naming(staged: Path, given: Path) -> Iterator[None]:
    """Within: an error naming the private copy of a change file names the file the user gave."""
    try:
        yield
    except SidIndexError as e:
        if str(staged) not in str(e):
            raise
        raise type(e)(str(e).replace(str(staged), str(given))) from None


def _to_update(root: Root) -> str:
    """The published id an update applies to."""
    published = root.current_id()
    if published is None:
        raise ArtifactError(f"{root.path}: no published snapshot to update; build one first")
    return published


def _rounded(clock: StageClock) -> dict[str, float]:
    return {k: round(v, 3) for k, v in clock.seconds.items()}


def _codebook(root: Root, given: Path | None) -> tuple[Codebook | None, str]:
    """(codebook, "given" | "reused") or (None, "") when ROOT has none and training is needed."""
    if given is not None:
        return load_codebook(given), "given"
    if not any(root.codebooks.glob("cb-*")):
        return None, ""
    return load_codebook(root.path), "reused"


def _fingerprint(catalog: Path, spec: dict, config: dict, codebook_id: str, changes_through: str | None,
                 shards: int | None, signed_by: str | None) -> str:
    h = hashlib.sha256(sha256_file(Path(catalog), follow_links=True).encode())  # a link to the latest export
    h.update(json.dumps({"targeting": spec, "config": config, "codebook": codebook_id,
                         "snapshot_format": SNAPSHOT_VERSION,  # the export's watermark decides what is re-applied
                         **({"changes_through": changes_through} if changes_through else {}),
                         **({"shards": shards} if shards else {}),
                         **({"signed_by": signed_by} if signed_by else {})},  # signing an unsigned ROOT publishes
                        sort_keys=True).encode())
    return h.hexdigest()
