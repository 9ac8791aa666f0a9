"""Commands that read a snapshot: `inspect`, `validate`, `explain`."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Optional

import typer
from rich.table import Table

from sidindex_cli.options import JSON_OPT, SNAPSHOT_ARG
from sidindex_cli.render import emit, out

app = typer.Typer()


@app.command()
def validate(snapshot: Path = SNAPSHOT_ARG, as_json: bool = JSON_OPT) -> None:
    """Check a snapshot: checksums and structure; exit 2 naming the first fault.

    Checks the manifest, every file's size and sha256, each array file's header, and the index
    structure (offsets monotone, every index in range, children sorted).
    """
    from sidindex.snapshot import open_snapshot, resolve_snapshot

    t0 = time.perf_counter()
    snap = open_snapshot(resolve_snapshot(snapshot), verify=True)
    emit({"status": "ok", "snapshot_id": snap.id, "path": str(snap.path), "files": len(snap.manifest["files"]),
           "bytes": sum(f["bytes"] for f in snap.manifest["files"].values()),
           "seconds": round(time.perf_counter() - t0, 2)}, as_json, "snapshot valid")


@app.command()
def inspect(
    snapshot: Path = SNAPSHOT_ARG,
    plot: Optional[Path] = typer.Option(None, "--plot", help="Also draw fill rate and storage per position to this "
                                        "PNG (needs matplotlib: pip install 'sidindex[plot]')."),
    as_json: bool = JSON_OPT,
) -> None:
    """Show a snapshot: trie shape, matcher storage, fill rates, SID statistics.

    Build inputs (codebook, fingerprint), then per transition position: parents, entries, matcher
    storage (KB with one row per entry -> KB after dedup), fill rates (union, and k-way partitions
    when built).
    """
    from sidindex.snapshot import open_snapshot, resolve_snapshot

    snap = open_snapshot(resolve_snapshot(snapshot), verify=False)
    m = snap.manifest
    st = m["stats"]
    summary = {"snapshot_id": m["id"], "created": m["created"], "path": str(snap.path), "codebook_id": m["codebook_id"],
               "input_fingerprint": m["input_fingerprint"][:16], "level_sizes": m["level_sizes"], **m["counts"],
               "kway": m["kway"], "matcher_table_bytes": st["bitmask_table_bytes"] + st["bloom_table_bytes"],
               "ads_per_sid": f"p50 {st['ads_per_sid_p50']:g}  p99 {st['ads_per_sid_p99']:g}  max {st['ads_per_sid_max']}",
               "sids_per_ad": f"mean {st['sids_per_ad_mean']:.2f}  max {st['sids_per_ad_max']}"}
    if plot is not None:
        from sidindex_cli.plot import plot_positions

        plot_positions(st["positions"], m["kway"], plot, f"snapshot {m['id']}: {m['counts']['ads']:,} ads")
        summary["plot"] = str(plot)
    if as_json:
        emit({**summary, "positions": st["positions"]}, True, "")
        return
    emit(summary, False, "snapshot")
    t = Table(title="per transition position", title_justify="left")
    cols = ["position", "parents", "entries", "bitmask KB", "Bloom KB",
            "bitmask fill", "Bloom fill"] + (["partitions", "part bitmask fill", "part Bloom fill"] if m["kway"] else [])
    for c in cols:
        t.add_column(c, justify="right")
    for p in st["positions"]:
        row = [str(p["position"]), f"{p['parents']:,}", f"{p['entries']:,}",
               f"{p['bitmask_bytes_before'] / 1e3:,.1f} -> {p['bitmask_bytes_after'] / 1e3:,.1f}",
               f"{p['bloom_bytes_before'] / 1e3:,.1f} -> {p['bloom_bytes_after'] / 1e3:,.1f}",
               f"{p['bitmask_fill']:.3f}", f"{p['bloom_fill']:.3f}"]
        if m["kway"]:
            row += [f"{p['partitions']:,}", f"{p['part_bitmask_fill']:.3f}", f"{p['part_bloom_fill']:.3f}"]
        t.add_row(*row)
    out.print(t)
