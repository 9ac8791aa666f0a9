"""The `sidindex` command line. Every command has --help; reporting commands take --json.

Errors of our own type (`SidIndexError`) become one line on stderr and a non-zero exit code:
2 bad input / config / artifact, 3 a quality gate failed.
"""

from __future__ import annotations

import json
import sys
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator, Optional

import typer
from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table
from rich.text import Text

from sidindex.errors import InputError, QualityGateError, SidIndexError

app = typer.Typer(help=__doc__.split("\n")[0] + "\n\nBuilds Semantic-ID indexes for eligibility-constrained "
                  "generative ad retrieval. Start with `sidindex sample`, then `sidindex build`, "
                  "`sidindex inspect`, `sidindex validate`, `sidindex explain`, `sidindex retrieve` and `sidindex simulate`.", no_args_is_help=True, add_completion=False)
sid_app = typer.Typer(help="Semantic IDs: train a frozen codebook, assign SIDs to a catalog.", no_args_is_help=True)
app.add_typer(sid_app, name="sid")

out = Console()
err = Console(stderr=True)

CATALOG_OPT = typer.Option(..., "--catalog", help="Catalog file (Parquet or Arrow IPC), see schemas/CONTRACTS.md.",
                           exists=False, dir_okay=False)
TARGETING_OPT = typer.Option(None, "--targeting",
                             help="Targeting spec (TOML). When given, the whole catalog is validated against it.")
CONFIG_OPT = typer.Option(None, "--config", help="Build config (TOML): [sid] scheme and [quality] gates. "
                                                 "Default: the built-in defaults (see sidindex.config).")
JSON_OPT = typer.Option(False, "--json", help="Print a JSON summary on stdout instead of tables.")


def main() -> None:
    try:
        app(standalone_mode=False)
    except SidIndexError as e:
        err.print(Text.assemble(("error: ", "bold red"), str(e)), highlight=False, soft_wrap=True)
        sys.exit(e.exit_code)
    except OSError as e:  # permissions, a full disk, a file where a directory should be
        err.print(Text.assemble(("error: ", "bold red"), str(e)), highlight=False, soft_wrap=True)
        sys.exit(2)
    except (typer.Abort, KeyboardInterrupt):
        err.print("aborted")
        sys.exit(130)
    except Exception as e:  # click usage errors carry their own exit codes
        import click

        if isinstance(e, click.ClickException):
            e.show()
            sys.exit(e.exit_code)
        raise


@contextmanager
def _progress(enabled: bool) -> Iterator:
    """A progress callback `(stage, done, total)` drawn on stderr when enabled (a terminal, no --json)."""
    if not enabled:
        yield lambda *_: None
        return
    with Progress(TextColumn("{task.description:<10}"), BarColumn(), TextColumn("{task.completed}/{task.total}"),
                  TimeElapsedColumn(), console=err, transient=True) as bar:
        tasks: dict[str, int] = {}

        def update(stage: str, done: int, total: int) -> None:
            if stage not in tasks:
                tasks[stage] = bar.add_task(stage, total=total)
            bar.update(tasks[stage], completed=done, total=total)

        yield update


@app.command()
def sample(
    out_dir: Path = typer.Option(..., "--out", help="Directory to write catalog.parquet, requests.parquet, targeting.toml."),
    ads: int = typer.Option(5000, "--ads", min=1, help="Number of ads."),
    requests: int = typer.Option(1000, "--requests", min=1, help="Number of requests."),
    dim: int = typer.Option(64, "--dim", min=1, help="Embedding dimension."),
    seed: int = typer.Option(0, "--seed", min=0, help="Random seed; the same seed gives the same files."),
    as_json: bool = JSON_OPT,
) -> None:
    """Generate a synthetic catalog, targeting spec and requests.

    Clustered anisotropic embeddings; Zipf targeting over five bitmask attributes (country ~250
    values, age, gender, language, platform) and one bloom attribute (locations, 40k values, heavy
    tail); advertisers with many ads each; a `value` column.
    """
    from sidindex.sample import write_sample

    t0 = time.perf_counter()
    paths = write_sample(out_dir, ads, requests, dim=dim, seed=seed)
    summary = {"ads": ads, "requests": requests, "dim": dim, "seconds": round(time.perf_counter() - t0, 2),
               **{f"{k}_file": str(v) for k, v in paths.items()}}
    _emit(summary, as_json, "sample written")


@sid_app.command("train")
def sid_train(
    catalog: Path = CATALOG_OPT,
    root: Path = typer.Option(..., "--out", help="ROOT directory; the codebook goes to ROOT/codebooks/<id>/."),
    targeting: Optional[Path] = TARGETING_OPT,
    config: Optional[Path] = CONFIG_OPT,
    as_json: bool = JSON_OPT,
) -> None:
    """Train a frozen residual k-means codebook from a catalog's embeddings.

    Trains rarely: the codebook fixes every ad's SIDs, and the generative model is trained on them.
    Training is deterministic for a given config. Levels shrink on small catalogs (about 39
    training points per centroid) and the summary says so.
    """
    from sidindex.config import load_config
    from sidindex.ingest import read_catalog
    from sidindex.sid import save_codebook, train_codebook
    from sidindex.targeting import load_targeting

    cfg = load_config(config)
    spec = load_targeting(targeting) if targeting else None
    t0 = time.perf_counter()
    cat = read_catalog(catalog, spec=spec, hash_keys=cfg.sid.hash_keys)
    with _progress(not as_json and err.is_terminal) as progress:
        cb = train_codebook(cat.embedding, cfg.sid, progress)
    path = save_codebook(cb, root)
    summary = {"codebook_id": cb.id, "path": str(path), "ads": len(cat), "dim": cb.dim,
               "level_sizes": list(cb.level_sizes), "paths": cb.paths, "balanced": cfg.sid.balanced,
               "notes": list(cb.notes), "seconds": round(time.perf_counter() - t0, 2)}
    _emit(summary, as_json, "codebook trained")


@sid_app.command("assign")
def sid_assign(
    catalog: Path = CATALOG_OPT,
    codebook: Path = typer.Option(..., "--codebook", help="Codebook directory, or a ROOT holding exactly one."),
    out_file: Path = typer.Option(..., "--out", help="Output Parquet file: ad_id, path, sid (L plain int16 tokens)."),
    targeting: Optional[Path] = TARGETING_OPT,
    config: Optional[Path] = CONFIG_OPT,
    report: Optional[Path] = typer.Option(None, "--report", help="Also write the quality report as JSON here."),
    as_json: bool = JSON_OPT,
) -> None:
    """Assign SIDs to every ad with a frozen codebook, and report their quality.

    Each ad gets one SID per path (its m nearest first-level centroids, each quantised down on its
    own, sharing the hashed last token). The SID scheme comes from the codebook; of --config only
    [quality] applies. Exits 3 without writing --out when a quality gate fails (e.g. a level
    collapsed to one code).
    """
    import pyarrow.parquet as pq

    from sidindex.config import load_config
    from sidindex.ingest import read_catalog
    from sidindex.sid import assign_sids, hash_tokens, load_codebook, sid_quality, sid_table
    from sidindex.targeting import load_targeting

    cfg = load_config(config)
    cb = load_codebook(codebook)
    spec = load_targeting(targeting) if targeting else None
    t0 = time.perf_counter()
    cat = read_catalog(catalog, spec=spec, hash_keys=cb.hash_keys, dim=cb.dim)
    with _progress(not as_json and err.is_terminal) as progress:
        tokens = hash_tokens(cat.columns, cb.hash_keys, cb.hash_size)
        assignment = assign_sids(cb, cat.embedding, tokens, progress)
    seconds = time.perf_counter() - t0
    quality = sid_quality(assignment, cb, cat.embedding, cfg.quality)
    if report:
        report.write_text(json.dumps(quality.to_dict(), indent=2))
    if quality.failures:
        raise QualityGateError("SID quality gate failed: " + "; ".join(quality.failures))
    out_file.parent.mkdir(parents=True, exist_ok=True)
    tmp = out_file.with_name(f".{out_file.name}.tmp")
    pq.write_table(sid_table(assignment, cat.ad_id), tmp)
    tmp.replace(out_file)
    summary = {"codebook_id": cb.id, "out": str(out_file), "ads": len(cat), "sid_rows": quality.n_sid_rows,
               "seconds": round(seconds, 2), "quality": quality.to_dict()}
    if as_json:
        _emit(summary, True, "")
    else:
        _emit({k: v for k, v in summary.items() if k != "quality"}, False, "SIDs assigned")
        _print_quality(quality)


SNAPSHOT_ARG = typer.Argument(..., help="A ROOT (its published snapshot, named by ROOT/CURRENT) or a snapshot directory.")


@app.command()
def build(
    catalog: Path = CATALOG_OPT,
    targeting: Path = typer.Option(..., "--targeting", help="Targeting spec (TOML); every attribute column is validated."),
    root: Path = typer.Option(..., "--out", help="ROOT: snapshots go to ROOT/snapshots/<id>/, ROOT/CURRENT names the published one."),
    config: Optional[Path] = CONFIG_OPT,
    codebook: Optional[Path] = typer.Option(None, "--codebook", help="Frozen codebook to use (directory, or a ROOT "
                                            "holding one). Default: the one in ROOT/codebooks, trained there if none."),
    force: bool = typer.Option(False, "--force", help="Publish even when the inputs match the published snapshot."),
    keep: int = typer.Option(3, "--keep", min=1, help="Published snapshots to keep (older ones are deleted)."),
    as_json: bool = JSON_OPT,
) -> None:
    """Build and publish a snapshot: the main job, end to end.

    Validates the catalog, reuses the frozen codebook (or trains one on the first build), assigns
    SIDs (quality gates: exit 3), builds the GTM trie and exact index, writes the snapshot, opens and
    validates it, then publishes it atomically. An unchanged catalog with the same spec, config and
    codebook publishes nothing (status "unchanged") unless --force. On any failure the published
    snapshot stays as it was.
    """
    from sidindex.job import run_build

    with _progress(not as_json and err.is_terminal) as progress:
        report = run_build(catalog, targeting, root, config=config, codebook=codebook, force=force, keep=keep,
                           progress=progress, waiting=lambda: err.print("waiting for another build on this ROOT ..."))
    if as_json:
        _emit(report, True, "")
        return
    _emit({k: v for k, v in report.items() if k != "seconds"}, False, f"snapshot {report['status']}")
    t = Table(title="where the time went", title_justify="left")
    t.add_column("stage")
    t.add_column("seconds", justify="right")
    for k, v in report["seconds"].items():
        t.add_row(k, f"{v:.2f}")
    out.print(t)


@app.command()
def validate(snapshot: Path = SNAPSHOT_ARG, as_json: bool = JSON_OPT) -> None:
    """Check a snapshot: checksums and structure; exit 2 naming the first fault.

    Checks the manifest, every file's size and sha256, each array file's header, and the index
    structure (offsets monotone, every index in range, children sorted).
    """
    from sidindex.snapshot import open_snapshot, resolve_snapshot

    t0 = time.perf_counter()
    snap = open_snapshot(resolve_snapshot(snapshot), verify=True)
    _emit({"status": "ok", "snapshot_id": snap.id, "path": str(snap.path), "files": len(snap.manifest["files"]),
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
        from sidindex.plot import plot_positions

        plot_positions(st["positions"], m["kway"], plot, f"snapshot {m['id']}: {m['counts']['ads']:,} ads")
        summary["plot"] = str(plot)
    if as_json:
        _emit({**summary, "positions": st["positions"]}, True, "")
        return
    _emit(summary, False, "snapshot")
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


@app.command()
def explain(
    snapshot: Path = SNAPSHOT_ARG,
    request: Path = typer.Option(..., "--request", help="Request table (Parquet or Arrow IPC), see schemas/CONTRACTS.md."),
    request_id: Optional[int] = typer.Option(None, "--request-id", help="Which request of the table (default: "
                                             "the only one)."),
    sid: Optional[str] = typer.Option(None, "--sid", help="A SID, tokens separated by commas: 12,40,7,300."),
    ad: Optional[int] = typer.Option(None, "--ad", help="An ad_id: explains each of its SIDs for that ad."),
    max_ads: int = typer.Option(20, "--max-ads", min=0, help="Ads listed per SID in the tables (--json lists all)."),
    as_json: bool = JSON_OPT,
) -> None:
    """Why a SID or an ad is, or is not, retrieved for one request.

    Walks the SID down the trie. At each position: is the prefix in the catalog (cd), do the
    subtree-union matchers pass (cd+gtm, naming each failing attribute), does any k-way partition
    pass (cd+gtm+kway, when built). Then the exact filter, ad by ad, naming the attributes an
    ineligible ad fails. With --ad, every SID of that ad is explained for that ad alone.
    """
    from sidindex.explain import Explainer, parse_sid, request_row
    from sidindex.ingest import read_requests
    from sidindex.snapshot import open_snapshot, resolve_snapshot

    if (sid is None) == (ad is None):
        raise InputError("explain: give exactly one of --sid S and --ad A")
    snap = open_snapshot(resolve_snapshot(snapshot), verify=False)
    reqs = read_requests(request, snap.spec)
    row = request_row(reqs, request_id)
    ex = Explainer(snap, reqs, row)
    results = ex.sid(parse_sid(sid)) if sid is not None else None
    results = [results] if results is not None else ex.ad(ad)
    values = reqs.columns.row(row, named=True)
    if as_json:
        _emit({"snapshot_id": snap.id, "request_id": int(reqs.request_id[row]), "request": values,
               "explanations": [r.to_dict() for r in results]}, True, "")
        return
    out.print(f"request {int(reqs.request_id[row])}: " + "  ".join(
        f"{k}={v}" if not isinstance(v, list) else f"{k}=[{len(v)} values]" for k, v in values.items()), highlight=False)
    for r in results:
        _print_explanation(r, max_ads)


@app.command()
def retrieve(
    snapshot: Path = SNAPSHOT_ARG,
    requests: Path = typer.Option(..., "--requests", help="Request table (Parquet or Arrow IPC) with an `embedding` "
                                  "column for the codebook scorer, see schemas/CONTRACTS.md."),
    out_file: Path = typer.Option(..., "--out", help="Output file: .parquet, or Arrow IPC otherwise. Columns "
                                  "request_id, rank, ad_id, sid, score."),
    mode: str = typer.Option("cd+gtm", "--mode", help="none | cd | cd+gtm | cd+gtm+kway (needs a snapshot built "
                             "with [kway])."),
    beams: str = typer.Option("1,512,1024,1024", "--beams", help="Beam size per SID position: beams[0] is the root "
                              "(1), beams[d] are kept after step d-1, beams[-1] after the last step."),
    device: str = typer.Option("cpu", "--device", help="cpu, cuda or cuda:N. On cuda the mask is the Triton kernel."),
    top_k: Optional[int] = typer.Option(None, "--top-k", min=1, help="Keep at most K ads per request (default: "
                                        "every eligible ad the search reached)."),
    batch_size: int = typer.Option(16, "--batch-size", min=1, help="Requests searched together."),
    as_json: bool = JSON_OPT,
) -> None:
    """Retrieve eligible ads: constrained beam search over SIDs, then SID -> ads and the exact filter.

    Logits come from the codebook scorer (the request embedding's distance to each level's
    centroids; the hash level is uniform). Every returned ad is eligible; a request whose beams all
    die under the constraints gets fewer (or no) ads, counted in the summary; the search never
    falls back to unconstrained decoding.
    """
    import pyarrow.parquet as pq
    from pyarrow import feather

    from runtime.loader import load
    from runtime.retrieve import retrieve as run_retrieval
    from runtime.search import parse_beams
    from sidindex.ingest import read_requests

    t0 = time.perf_counter()
    index = load(snapshot, device, verify=False)
    beam_sizes = parse_beams(beams, index.sid_length)
    reqs = read_requests(requests, index.snapshot.spec)
    load_s = time.perf_counter() - t0
    with _progress(not as_json and err.is_terminal) as progress:
        run = run_retrieval(index, reqs, mode=mode, beams=beam_sizes, top_k=top_k, batch_size=batch_size,
                            progress=progress)
    table = run.table(reqs.request_id)
    out_file.parent.mkdir(parents=True, exist_ok=True)
    tmp = out_file.with_name(f".{out_file.name}.tmp")
    if out_file.suffix == ".parquet":
        pq.write_table(table, tmp)
    else:
        feather.write_feather(table, str(tmp), compression="uncompressed")
    tmp.replace(out_file)
    r = run.result
    _emit({"snapshot_id": index.id, "device": str(index.device), "mode": mode, "beams": list(beam_sizes),
           "requests": len(reqs), "rows": table.num_rows, "out": str(out_file),
           "eligible_ads_per_request_mean": round(float(r.ads_eligible.mean()), 2),
           "requests_without_ads": int((r.ads_eligible == 0).sum()),
           "requests_whose_beams_all_died": int((r.sids == 0).sum()),
           "seconds": {"load": round(load_s, 3), **{k: round(v, 3) for k, v in run.seconds.items()}}},
          as_json, "retrieved")


@app.command()
def simulate(
    snapshot: Path = SNAPSHOT_ARG,
    requests: Path = typer.Option(..., "--requests", help="Request table with an `embedding` column (the codebook "
                                  "scorer's input)."),
    modes: Optional[str] = typer.Option(None, "--modes", help="Comma-separated modes (default: cd,cd+gtm, plus "
                                        "cd+gtm+kway when the snapshot has partitions)."),
    beams: str = typer.Option("1,512,1024,1024", "--beams", help="Beam size per SID position, as for retrieve."),
    top_k: int = typer.Option(100, "--top-k", min=1, help="K of recall@K and of 'requests short of K'."),
    max_requests: Optional[int] = typer.Option(None, "--max-requests", min=1, help="Use the first N requests only."),
    device: str = typer.Option("cpu", "--device", help="cpu, cuda or cuda:N."),
    plot: Optional[Path] = typer.Option(None, "--plot", help="Also draw pass rates and recall per mode to this PNG."),
    as_json: bool = JSON_OPT,
) -> None:
    """Pass rates and recall of eligible ads per mode (GRACE Table 3, and what it left out).

    Per mode, over the ads the returned SIDs generate: the share passing every bitmask attribute,
    every bloom attribute (each stage on its own) and both (final), overall and bucketed by how
    many ads a request generated; eligible ads per request (mean, p10); requests short of K; and
    recall@K against the K best eligible ads of the whole catalog under the same codebook scorer,
    found exhaustively. Times are per request.
    """
    from runtime.loader import load
    from runtime.search import parse_beams
    from runtime.simulate import simulate as run_study
    from sidindex.ingest import read_requests

    index = load(snapshot, device, verify=False)
    beam_sizes = parse_beams(beams, index.sid_length)
    reqs = read_requests(requests, index.snapshot.spec)
    if max_requests is not None:
        reqs = reqs.head(max_requests)
    kway = index.part_offsets is not None
    chosen = tuple(m.strip() for m in modes.split(",")) if modes else ("cd", "cd+gtm") + (("cd+gtm+kway",) if kway else ())
    with _progress(not as_json and err.is_terminal) as progress:
        report = run_study(index, reqs, chosen, beam_sizes, top_k, progress=progress)
    cfg = (index.snapshot.manifest.get("build_config") or {}).get("kway") if kway else None
    report["kway"] = None if not cfg else (f"static, k {cfg['k']}" if cfg.get("mode") == "static" else
                                           f"dynamic, k_max {cfg.get('k_max')}, target fill {cfg.get('target_fill')}")
    if plot is not None:
        from sidindex.plot import plot_study

        plot_study(report, plot)
        report["plot"] = str(plot)
    if as_json:
        _emit(report, True, "")
        return
    _emit({k: round(v, 1) if isinstance(v, float) else v for k, v in report.items() if k != "modes"}, False,
          "simulation")
    t = Table(title=f"per mode ({report['requests']} requests): ads generated and their pass rates per stage, "
              f"eligible ads per request, requests short of {top_k}, recall, ms per request", title_justify="left")
    cols = ["mode", "generated", "bitmask", "bloom", "final", "eligible/req", "p10", f"<{top_k}", f"recall@{top_k}",
            "search ms", "post ms"]
    for c in cols:
        t.add_column(c, justify="right")
    for m in report["modes"]:
        t.add_row(m["mode"], f"{m['ads_generated']:,}", _pct(m["bitmask_rate"]), _pct(m["bloom_rate"]),
                  _pct(m["final_rate"]), f"{m['eligible_per_request_mean']:.1f}", f"{m['eligible_per_request_p10']:.0f}",
                  str(m["requests_short_of_k"]), "-" if m[f"recall_at_{top_k}"] is None else f"{m[f'recall_at_{top_k}']:.3f}",
                  f"{m['search_ms_per_request']:.1f}", f"{m['post_ms_per_request']:.1f}")
    out.print(t)
    b = Table(title="final rate by ads generated per request", title_justify="left")
    for c in ("mode", "ads generated", "requests", "bitmask rate", "bloom rate", "final rate"):
        b.add_column(c, justify="right")
    for m in report["modes"]:
        for k in m["buckets"]:
            b.add_row(m["mode"], k["generated"], str(k["requests"]), _pct(k["bitmask_rate"]), _pct(k["bloom_rate"]),
                      _pct(k["final_rate"]))
    out.print(b)


def _pct(x) -> str:
    return "-" if x is None else f"{100 * x:.2f}%"


def _print_explanation(r, max_ads: int) -> None:
    def fails(names) -> str:
        return "pass" if not names else "fails " + ", ".join(names)

    kway = r.steps[0].failed_partitions is not None
    t = Table(title=f"SID {','.join(map(str, r.sid))}", title_justify="left")
    for c in ["position", "token", "prefix in catalog", "union matchers"] + (["k-way partitions"] if kway else []):
        t.add_column(c)
    for s in r.steps:
        row = [str(s.position), str(s.token), "yes" if s.in_catalog else "no: not a catalog prefix",
               fails(s.failed_union) if s.in_catalog else "-"]
        if kway:
            parts = s.failed_partitions or ()
            row.append("-" if not s.in_catalog else f"{sum(not f for f in parts)} of {len(parts)} pass" +
                       "".join(f"\n#{i}: {fails(f)}" for i, f in enumerate(parts) if f))
        t.add_row(*row)
    out.print(t)
    if r.ads:
        eligible = sum(not a.failed for a in r.ads)
        ta = Table(title=f"exact filter: {eligible} of {len(r.ads)} ads eligible", title_justify="left")
        ta.add_column("ad_id", justify="right")
        ta.add_column("exact filter")
        for a in r.ads[:max_ads]:
            ta.add_row(str(a.ad_id), "eligible" if not a.failed else fails(a.failed))
        if len(r.ads) > max_ads:
            ta.add_row("...", f"{len(r.ads) - max_ads} more (--max-ads, --json)")
        out.print(ta)
    def verdict(mode: str, ok: bool) -> str:
        stop = next((s.position for s in r.steps if not s.passes[mode]), None)
        return f"{mode} yes" if ok else f"{mode} no (pruned at position {stop})"

    out.print("generated by beam search in mode: " + ", ".join(verdict(m, ok) for m, ok in r.reached.items()),
              highlight=False)


def _emit(summary: dict, as_json: bool, title: str) -> None:
    if as_json:
        out.print_json(json.dumps(summary))
        return
    table = Table(title=title, show_header=False, title_justify="left")
    for k, v in summary.items():
        table.add_row(k, _cell(v))
    out.print(table)


def _cell(v) -> str:
    """Lists of strings (notes) one per line, lists of numbers comma-separated, '-' when empty;
    tables as `key value` pairs."""
    if isinstance(v, dict):
        return "  ".join(f"{k} {x}" for k, x in v.items())
    if not isinstance(v, list):
        return str(v)
    if not v:
        return "-"
    return ("\n" if isinstance(v[0], str) else ", ").join(map(str, v))


def _print_quality(q) -> None:
    t = Table(title="SID quality", show_header=False, title_justify="left")
    t.add_row("distinct SIDs", f"{q.distinct_sids} over {q.n_sid_rows} SID rows of {q.n_ads} ads")
    t.add_row("SIDs per ad", f"mean {q.sids_per_ad_mean:.2f}  " +
              "  ".join(f"{k}: {v} ads" for k, v in q.sids_per_ad_counts.items()))
    t.add_row("ads per SID", f"p50 {q.ads_per_sid_p50:g}  p99 {q.ads_per_sid_p99:g}  max {q.ads_per_sid_max}")
    t.add_row("largest group", f"{list(q.largest_group_sid)}: {q.ads_per_sid_max} ads ({q.largest_group_share:.2%})")
    t.add_row("collision rate", f"{q.collision_rate:.2%} of SID rows share their SID")
    t.add_row("reconstruction MSE", "  ".join(f"L{i}: {m:.4g}" for i, m in enumerate(q.mse)) +
              f"  (relative {q.relative_mse:.4f})")
    t.add_row("2nd centroid within 5%", f"{q.near_second_share:.2%} of ads")
    out.print(t)
    lv = Table(title="per level", title_justify="left")
    for col in ("level", "kind", "size", "used", "dead", "perplexity", "gini"):
        lv.add_column(col, justify="right")
    for u in q.levels:
        lv.add_row(str(u.level), u.kind, str(u.size), str(u.used), str(u.dead), f"{u.perplexity:.1f}", f"{u.gini:.3f}")
    out.print(lv)
    for note in q.notes:
        out.print(f"note: {note}", highlight=False)
