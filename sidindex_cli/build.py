"""Commands that make artifacts: `sample`, `sid train`, `sid assign`, `build`."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Optional

import typer

from sidindex.errors import QualityGateError
from sidindex_cli.options import (
    ADOPT_OPT,
    CATALOG_OPT,
    CONFIG_OPT,
    JSON_OPT,
    SIGN_KEY_OPT,
    TARGETING_OPT,
    TRUST_KEY_OPT,
    output_file,
    progress_bar,
    write_table,
)
from sidindex_cli.render import emit, err, print_quality, print_seconds

app = typer.Typer()
sid_app = typer.Typer(help="Semantic IDs: train a frozen codebook, assign SIDs to a catalog.", no_args_is_help=True)
app.add_typer(sid_app, name="sid")


@app.command()
def sample(
    out_dir: Path = typer.Option(..., "--out", help="Directory to write catalog.parquet, requests.parquet, "
                                 "targeting.toml."),
    ads: int = typer.Option(5000, "--ads", min=1, help="Number of ads."),
    requests: int = typer.Option(1000, "--requests", min=1, help="Number of requests."),
    dim: int = typer.Option(64, "--dim", min=1, help="Embedding dimension."),
    seed: int = typer.Option(0, "--seed", min=0, help="Random seed; the same seed gives the same files."),
    profile: str = typer.Option("default", "--profile", help="Catalog profile: default (SIDs hold few ads) or "
                                "skewed (the same catalog with 1.5% of its ads rewritten as bulk advertisers' "
                                "near-duplicate creatives, so that some SIDs hold hundreds to thousands of ads; "
                                "see below)."),
    as_json: bool = JSON_OPT,
) -> None:
    """Generate a synthetic catalog, targeting spec and requests.

    Clustered anisotropic embeddings; Zipf targeting over five bitmask attributes (country ~250
    values, age, gender, language, platform) and one bloom attribute (locations, 40k values, heavy
    tail); advertisers with many ads each; a `value` column.

    --profile skewed models what makes serving cost vary: a large advertiser's near-identical
    creatives land in one SID (the codebook is frozen, the final SID level hashes advertiser_id).
    1.5% of the ads, chosen at random, become creatives of new bulk advertisers (40 creatives each
    on average, sizes Zipf with exponent 0.7), each its advertiser's embedding plus noise of 0.001
    per dimension; their targeting, values and the other ads are the default's. Built, the largest
    SID then holds ~30 ads at 2,000 ads (default: ~4), ~840 at 1M, ~5,500 at 15M, where the 1,024
    largest hold ~200,000 (sidindex.sample.Bulk). The default profile's files are the same for a
    seed as before profiles existed.
    """
    from sidindex.sample import write_sample

    t0 = time.perf_counter()
    paths = write_sample(out_dir, ads, requests, dim=dim, seed=seed, profile=profile)
    summary = {"ads": ads, "requests": requests, "dim": dim, "profile": profile,
               "seconds": round(time.perf_counter() - t0, 2),
               **{f"{k}_file": str(v) for k, v in paths.items()}}
    emit(summary, as_json, "sample written")


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
    from sidindex.root import Root
    from sidindex.sid import save_codebook, train_codebook
    from sidindex.targeting import load_targeting

    cfg = load_config(config)
    spec = load_targeting(targeting) if targeting else None
    t0 = time.perf_counter()
    cat = read_catalog(catalog, spec=spec, hash_keys=cfg.sid.hash_keys)
    with progress_bar(not as_json and err.is_terminal) as progress:
        cb = train_codebook(cat.embedding, cfg.sid, progress)
    with Root(root).lock(lambda: err.print("waiting for a build on this ROOT ...")):  # builds clean temporaries
        path = save_codebook(cb, root)
    summary = {"codebook_id": cb.id, "path": str(path), "ads": len(cat), "dim": cb.dim,
               "level_sizes": list(cb.level_sizes), "paths": cb.paths, "balanced": cfg.sid.balanced,
               "notes": list(cb.notes), "seconds": round(time.perf_counter() - t0, 2)}
    emit(summary, as_json, "codebook trained")


@sid_app.command("assign")
def sid_assign(
    catalog: Path = CATALOG_OPT,
    codebook: Path = typer.Option(..., "--codebook", help="Codebook directory, or a ROOT holding exactly one."),
    out_file: Path = typer.Option(..., "--out", callback=output_file,
                                  help="Output Parquet file: ad_id, path, sid (L plain int16 tokens)."),
    targeting: Optional[Path] = TARGETING_OPT,
    config: Optional[Path] = CONFIG_OPT,
    report: Optional[Path] = typer.Option(None, "--report", callback=output_file,
                                          help="Also write the quality report as JSON here."),
    as_json: bool = JSON_OPT,
) -> None:
    """Assign SIDs to every ad with a frozen codebook, and report their quality.

    Each ad gets one SID per path (its m nearest first-level centroids, each quantised down on its
    own, sharing the hashed last token). The SID scheme comes from the codebook; of --config only
    \\[quality] applies. Exits 3 without writing --out when a quality gate fails (e.g. a level
    collapsed to one code).
    """
    from sidindex.config import load_config
    from sidindex.ingest import read_catalog
    from sidindex.sid import assign_sids, hash_tokens, load_codebook, sid_quality, sid_table
    from sidindex.targeting import load_targeting

    cfg = load_config(config)
    cb = load_codebook(codebook)
    spec = load_targeting(targeting) if targeting else None
    t0 = time.perf_counter()
    cat = read_catalog(catalog, spec=spec, hash_keys=cb.hash_keys, dim=cb.dim)
    with progress_bar(not as_json and err.is_terminal) as progress:
        tokens = hash_tokens(cat.columns, cb.hash_keys, cb.hash_size)
        assignment = assign_sids(cb, cat.embedding, tokens, progress)
    seconds = time.perf_counter() - t0
    quality = sid_quality(assignment, cb, cat.embedding, cfg.quality)
    if report:
        report.write_text(json.dumps(quality.to_dict(), indent=2))
    if quality.failures:
        raise QualityGateError("SID quality gate failed: " + "; ".join(quality.failures))
    write_table(sid_table(assignment, cat.ad_id), out_file)
    summary = {"codebook_id": cb.id, "out": str(out_file), "ads": len(cat), "sid_rows": quality.n_sid_rows,
               "seconds": round(seconds, 2), "quality": quality.to_dict()}
    if as_json:
        emit(summary, True, "")
    else:
        emit({k: v for k, v in summary.items() if k != "quality"}, False, "SIDs assigned")
        print_quality(quality)


@app.command()
def build(
    catalog: Path = CATALOG_OPT,
    targeting: Path = typer.Option(..., "--targeting", help="Targeting spec (TOML); every attribute column is "
                                   "validated."),
    root: Path = typer.Option(..., "--out", help="ROOT: snapshots go to ROOT/snapshots/<id>/, ROOT/CURRENT names the "
                              "published one."),
    config: Optional[Path] = CONFIG_OPT,
    codebook: Optional[Path] = typer.Option(None, "--codebook", help="Frozen codebook to use (directory, or a ROOT "
                                            "holding one). Default: the one in ROOT/codebooks, trained there if none."),
    force: bool = typer.Option(False, "--force", help="Publish even when the inputs match the published snapshot."),
    keep: int = typer.Option(3, "--keep", min=1, help="Published snapshots to keep (older ones are deleted)."),
    engine: str = typer.Option("local", "--engine", help="Where the build runs: local (this process) or ray "
                               "(Ray tasks over the Parquet catalog's row groups, each shard written by its own "
                               "task, so this process holds no array of the catalog's length; needs a frozen "
                               "codebook, the ray "
                               "extra: pip install 'sidindex\\[ray]', and on a cluster the ROOT mounted at the "
                               "same path on every node). Both publish the same arrays."),
    ray_address: Optional[str] = typer.Option(None, "--ray-address", help="Ray cluster to run on (ADDR, or auto: "
                                              "the one this host belongs to). Default: start a local Ray for the "
                                              "build."),
    workers: Optional[int] = typer.Option(None, "--workers", min=1, help="local: threads building the trie's "
                                          "shards (default 1). ray: CPUs of the local Ray (default: every core)."),
    shards: Optional[int] = typer.Option(None, "--shards", min=1, max=32768, help="Split the trie into this many "
                                         "shards by first-level token, each about as many SID rows (default: one "
                                         "per 32M SID rows). An update rewrites only the shards it touches and a "
                                         "serving host re-checks only those; several shards are copied into one "
                                         "trie when loaded and repeat the matcher rows they share. Results do not "
                                         "depend on it."),
    changes_through: Optional[str] = typer.Option(
        None, "--changes-applied-through", metavar="NAME",
        help="The newest change file (its file name) whose changes the catalog export already holds. Change files "
             "that `sidindex update` published after it are applied again on top of the build, so their deletes and "
             "upserts survive it. Default: the catalog's own schema metadata "
             "`sidindex.changes_applied_through`, if it has it. Without either none are, and the build warns if "
             "there are some."),
    sign_key: Optional[Path] = SIGN_KEY_OPT,
    trust_key: Optional[Path] = TRUST_KEY_OPT,
    adopt_unsigned: bool = ADOPT_OPT,
    as_json: bool = JSON_OPT,
) -> None:
    """Build and publish a snapshot: the main job, end to end.

    Validates the catalog, reuses the frozen codebook (or trains one on the first build), assigns
    SIDs (quality gates: exit 3), builds the GTM trie in shards and the exact index, writes the
    snapshot, opens and validates it, then publishes it atomically. An unchanged catalog with the same spec, config and
    codebook publishes nothing (status "unchanged") unless --force. On any failure the published
    snapshot stays as it was.

    Changes survive the build. An ad the published snapshot has paused stays paused (pauses are
    not in the catalog): a paused ad is never served again until an update resumes or deletes it.
    Deletes and upserts published by updates after the catalog export are applied again when
    --changes-applied-through names the newest change file the export holds (a name the ROOT's
    journal does not hold is refused). Without it, a build that waited while an update published
    refuses (exit 2; run it again).

    With --sign-key the snapshot is signed, and the published snapshot whose paused ads and journal
    it carries forward must be signed by that key (or --trust-key).
    """
    from sidindex.job import run_build

    with progress_bar(not as_json and err.is_terminal) as progress:
        report = run_build(catalog, targeting, root, config=config, codebook=codebook, force=force, keep=keep,
                           progress=progress, waiting=lambda: err.print("waiting for another build on this ROOT ..."),
                           engine=engine, ray_address=ray_address, workers=workers, changes_through=changes_through,
                           shards=shards, sign_key=sign_key, trust_key=trust_key, adopt_unsigned=adopt_unsigned)
    for warning in report.get("warnings", ()):
        err.print(f"warning: {warning}", highlight=False, soft_wrap=True)
    if as_json:
        emit(report, True, "")
        return
    shown = {k: v for k, v in report.items() if k not in ("seconds", "ray", "carried", "warnings")}
    if "carried" in report:
        shown |= {"paused_ads_kept": report["carried"]["paused"],
                  "changes_applied_again": ", ".join(report["carried"]["replayed"]) or "none"}
    if "ray" in report:
        shape = report["ray"]
        shown |= {"fragments": shape["fragments"], "parts": shape["parts"],
                  "shuffle_mb": round(shape["shuffle_bytes"] / 1e6, 1)}
    emit(shown, False, f"snapshot {report['status']}")
    print_seconds(report["seconds"])


@app.command()
def update(
    root: Path = typer.Argument(..., help="ROOT whose published snapshot the changes apply to."),
    changes: Path = typer.Option(..., "--changes", help="Change file (Parquet or Arrow IPC): ad_id, op (upsert, "
                                 "delete, pause, resume) and, for upserts, every catalog column; see "
                                 "schemas/CONTRACTS.md."),
    keep: int = typer.Option(3, "--keep", min=1, help="Published snapshots to keep (older ones are deleted)."),
    sign_key: Optional[Path] = SIGN_KEY_OPT,
    trust_key: Optional[Path] = TRUST_KEY_OPT,
    adopt_unsigned: bool = ADOPT_OPT,
    as_json: bool = JSON_OPT,
) -> None:
    """Apply ad changes to the published snapshot without a full rebuild, and publish the result.

    Verifies the published snapshot first: every file's digest, and its structure and matcher
    cover unless ROOT/checked holds a record that this very manifest passed them (an update records
    its base and the snapshot it publishes; `base_checks` in the report says which was done). A
    corrupt base is refused (exit 2). Then validates the whole change file (ops, ad ids that
    exist, every upsert row as the catalog's); any error publishes nothing (exit 2). Rows apply in
    file order. pause/resume/delete change ad
    states only (and which prefixes still have a live ad: the search skips the others); upsert
    assigns SIDs with the frozen codebook and adds what they need to the trie. Files the update
    leaves alone are hard-linked from the base snapshot, and a watching serving host applies an
    update of ad states without reloading the index.

    Matchers only grow between full builds: a paused, deleted or narrowed ad's targeting stays in
    its prefixes' matchers (never served; `inspect` counts these stale entries) until the next
    `sidindex build` compacts them. Run full builds on schedule and updates in between.

    With --sign-key the snapshot is signed, and its base must be signed by that key (or
    --trust-key): an update never vouches for a base it cannot verify.
    """
    from sidindex.job import run_update

    report = run_update(root, changes, keep=keep, waiting=lambda: err.print("waiting for a build on this ROOT ..."),
                        sign_key=sign_key, trust_key=trust_key, adopt_unsigned=adopt_unsigned)
    for warning in report.get("warnings", ()):
        err.print(f"warning: {warning}", highlight=False, soft_wrap=True)
    if as_json:
        emit(report, True, "")
        return
    shown = {k: v for k, v in report.items() if k not in ("seconds", "lineage", "changes", "warnings")}
    shown["changes"] = ", ".join(f"{n} {op}" for op, n in report["changes"].items() if n) or "none"
    if "lineage" in report:
        lin = report["lineage"]
        shown |= {"updates_since_full_build": lin["updates"], "paused_ads": lin["paused"],
                  "deleted_rows": lin["deleted"], "stale_entries": lin["stale_entries"], "dead_sids": lin["dead_sids"]}
    emit(shown, False, f"snapshot {report['status']}")
    print_seconds(report["seconds"])
