"""Commands that read a snapshot: `inspect`, `validate` (`explain` has its own module)."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Optional

import typer

from schemas.artifacts import AD_DELETED, AD_PAUSED
from sidindex.errors import ArtifactError
from sidindex_cli.options import JSON_OPT, SNAPSHOT_ARG, TRUST_KEY_OPT, output_file
from sidindex_cli.render import emit, print_positions, print_shards

app = typer.Typer()


@app.command()
def validate(snapshot: Path = SNAPSHOT_ARG, trust_key: Optional[Path] = TRUST_KEY_OPT,
             as_json: bool = JSON_OPT) -> None:
    """Check a snapshot: every byte and the structure; exit 2 naming the first fault.

    Checks the manifest (sealed by its own checksum, strict keys, id = directory name), that the
    directory holds exactly the files it lists (regular files, no links), each file's size,
    sha256 and fast digest (the carried codebook included; opening checks the fast digest alone),
    each Arrow file's schema and lengths, the index structure (offsets rising without
    wrap-around, every index in range, every relation between arrays; see schemas/CONTRACTS.md),
    and that every matcher row covers what lies beneath it (a row damaged under resealed digests).

    Digests find corruption, not someone who can rewrite the ROOT: an edit resealed under fresh
    digests passes. With --trust-key, a snapshot not signed by that key (unsigned, another key's,
    or a manifest changed since it was signed) is refused too.
    """
    from sidindex.signing import TrustKey
    from sidindex.snapshot import open_snapshot

    t0 = time.perf_counter()
    trust = TrustKey.of(trust_key)
    snap = open_snapshot(snapshot, verify=True, strong=True, cover=True, trust=trust, records=True)
    emit({"status": "ok", "snapshot_id": snap.id, "path": str(snap.path), "files": len(snap.manifest.files),
          "bytes": snap.manifest.total_bytes, **({"signed_by": trust.key_id} if trust else {}),
          "seconds": round(time.perf_counter() - t0, 2)}, as_json, "snapshot valid")


@app.command()
def inspect(
    snapshot: Path = SNAPSHOT_ARG,
    plot: Optional[Path] = typer.Option(None, "--plot", callback=output_file, help="Also draw fill rate and storage "
                                        "per position to this PNG (needs matplotlib: pip install "
                                        "'sidindex\\[plot]')."),
    as_json: bool = JSON_OPT,
) -> None:
    """Show a snapshot: trie shape, matcher storage, fill rates, SID statistics, staleness.

    Build inputs (codebook, fingerprint), then per transition position: parents, entries, matcher
    storage (KB with one row per entry -> KB after dedup), fill rates (union, and k-way partitions
    when built); then per shard: its first-level token range, SID rows, SIDs and bytes on disk.
    A snapshot written by `sidindex update` also shows its full build, the updates
    since, its paused and deleted rows, and the entries whose matchers still hold a paused or
    deleted row (stale supersets: they cost selectivity, never correctness, until the next full
    build); its statistics are its full build's. Structure is validated as always; checksums are
    left to `sidindex validate`.
    """
    from sidindex.snapshot import open_snapshot

    snap = open_snapshot(snapshot, verify=False)
    m, st = snap.manifest, snap.manifest.stats
    if st is None:
        raise ArtifactError(f"{snap.path / 'manifest.json'}: holds no statistics (the snapshot was written "
                            "without them)")
    summary = {"snapshot_id": m.id, "created": m.created, "path": str(snap.path), "codebook_id": m.codebook_id,
               "input_fingerprint": m.input_fingerprint[:16], "level_sizes": list(m.level_sizes),
               **m.counts.to_dict(), "kway": m.kway, "matcher_table_bytes": st.matcher_bytes,
               "ads_per_sid": f"p50 {st.ads_per_sid_p50:g}  p99 {st.ads_per_sid_p99:g}  max {st.ads_per_sid_max}",
               "sids_per_ad": f"mean {st.sids_per_ad_mean:.2f}  max {st.sids_per_ad_max}", **_lineage(snap)}
    if plot is not None:
        from sidindex_cli.plot import plot_positions

        plot_positions(st.positions, m.kway, plot, f"snapshot {m.id}: {m.counts.ads:,} ads")
        summary["plot"] = str(plot)
    shards = [{"tokens": [e.lo, e.hi], "sid_rows": s.sid_rows, "sids": s.gtm.num_leaves, "nodes": s.gtm.num_nodes,
               "bytes": m.shard_bytes(e)} for e, s in zip(m.shard_list(), snap.shards)]
    summary["shards"] = len(shards)
    if as_json:
        emit({**summary, "positions": [p.to_dict() for p in st.positions], "shards": shards}, True, "")
        return
    emit(summary, False, "snapshot")
    print_positions(st.positions, m.kway)
    print_shards(shards)


def _lineage(snap) -> dict:
    """What inspect shows of a snapshot's updates since its full build (and of the ad states a full
    build kept: paused ads carried forward, changes applied again after its export)."""
    m = snap.manifest
    if m.lineage is None:
        states = {} if snap.exact.ad_state is None else {
            "paused_ads": int((snap.row_states == AD_PAUSED).sum()),
            "deleted_rows": int((snap.row_states == AD_DELETED).sum())}
        return {"full_build": m.id, "updates_since_full_build": 0, **states}
    lin = m.lineage
    return {"full_build": lin.full_build, "updates_since_full_build": lin.updates, "update_base": lin.base,
            "paused_ads": lin.paused, "deleted_rows": lin.deleted, "stale_entries": lin.stale_entries,
            "dead_sids": lin.dead_sids, "statistics_of": f"full build {lin.full_build}"}
