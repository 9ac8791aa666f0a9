"""Update benchmark: `sidindex update` against a full build in the same run, and the time from an
update's publish to the first search that sees it on a serving host.

    python bench/bench_update.py                          # 10M ads (about 15 minutes on 2 cores)
    python bench/bench_update.py --ads 1000000 --device cuda

One ROOT, through the public API (`sidindex.job.run_build` / `run_update`, what the CLI runs):
  1. a generated catalog (`sidindex sample`: 5 bitmask attributes, Bloom locations, values) and a
     frozen codebook trained on a sample of it (training is not a build's: codebooks are frozen);
  2. full build: `run_build` with that codebook (ingest, SIDs, trie, write, validate, publish);
  3. updates of 0.1% and 1% of the ads, mixed ops (30% pause, 10% resume, 20% delete, 25% upsert
     of an existing ad with another ad's data, 15% new ads of new advertisers), then 1% of ad-state
     changes alone: `run_update`, each as a ratio of the full build (targets: 1% mixed <= 5%, 1% of
     ad states <= 1%);
  4. what an update's trust in nothing costs, on the last update's snapshot: opening it with its
     structure checked alone, against verifying it in full (every file's digest, the structure, the
     matchers' cover: an update's base without a check record) and with its checks on record (the
     digests alone: an update's base after an update), best of 3 each;
  5. swaps: before each update, ROOT's snapshot is loaded onto --device and searched (a warm
     server); after it, the swap to the update's snapshot is timed per phase (`bench_swap.swap`) as
     a watcher makes it, beside the served base (its files and device tensors shared where still
     the same), and whole, as a host that served nothing would (median of --swap-reps; target
     after a 1% update: <= 0.2 s at 30M SIDs on the H200);
  6. serving: a `SnapshotWatcher` polling every 10 ms and a `Searcher` serving one batch in a loop;
     a separate `sidindex update` process pauses an ad the batch returns; the latency is from the
     publish (CURRENT's replacement) to the first search whose result no longer holds the ad
     (target: <= 1 s), with the watcher's swap phases. Repeated, median reported.
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make `bench` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np
import polars as pl

import runtime
from bench.bench_swap import PHASES, median_swap, swap, sync
from bench.report import write_json
from runtime.serving.post import expand
from sidindex.config import load_config
from sidindex.job import run_build, run_update
from sidindex.root import Root
from sidindex.sample import write_sample
from sidindex.sid import load_codebook, save_codebook, train_codebook
from sidindex.snapshot import open_snapshot
from sidindex.trie.dedup import RowTable

MIX = (("pause", 0.30), ("resume", 0.10), ("delete", 0.20), ("upsert", 0.25), ("new", 0.15))
STATES_ONLY = (("pause", 0.6), ("resume", 0.2), ("delete", 0.2))
UPDATES = {"0.1%": "update 0.1%", "1%": "update 1%", "states": "update 1%, states only"}  # --updates: row names
SHARES = {"0.1%": (0.001, MIX), "1%": (0.01, MIX), "states": (0.01, STATES_ONLY)}  # share of the ads, ops

def changes(cat: pl.DataFrame, live: np.ndarray, paused: np.ndarray, n: int, rng: np.random.Generator,
            next_id: int, mix=MIX) -> pl.DataFrame:
    """n ops on distinct ads (`live` ids, `paused` ids that resume) as a change frame, in shares
    `mix`. Upserts take another ad's data with its embedding moved a little (an edited creative);
    new ads also get new advertisers, so many of their SIDs are new to the trie."""
    counts = {op: int(round(n * share)) for op, share in mix} | {op: 0 for op, _ in MIX if op not in dict(mix)}
    counts["resume"] = min(counts["resume"], len(paused))
    picked = rng.choice(live, counts["pause"] + counts["delete"] + counts["upsert"], replace=False)
    p, d = counts["pause"], counts["pause"] + counts["delete"]
    donors = cat.sample(counts["upsert"] + counts["new"], seed=int(rng.integers(2**31)))
    new_ids = np.concatenate([picked[d:], next_id + np.arange(counts["new"])])
    emb = donors["embedding"].to_numpy()
    if len(emb):
        emb = emb + rng.normal(0, 0.05 * emb.std(), emb.shape).astype(np.float32)
    advertiser = donors["advertiser_id"].to_numpy().copy()
    advertiser[counts["upsert"]:] = next_id + np.arange(counts["new"])
    upserts = donors.with_columns(pl.Series("ad_id", new_ids), pl.Series("embedding", emb),
                                  pl.Series("advertiser_id", advertiser), op=pl.lit("upsert"))
    ops = pl.DataFrame({"ad_id": np.concatenate([picked[:p], rng.choice(paused, counts["resume"], replace=False),
                                                 picked[p:d]]),
                        "op": ["pause"] * p + ["resume"] * counts["resume"] + ["delete"] * (d - p)})
    return pl.concat([ops, upserts], how="diagonal").sample(fraction=1.0, shuffle=True, seed=int(rng.integers(2**31)))


def serving_latency(root: Path, requests: Path, device: str, reps: int, out: Path) -> dict:
    """Median seconds from an update's publish to the first search without the paused ad."""
    watcher = runtime.SnapshotWatcher(root, device)
    reqs = runtime.read_requests(requests, watcher.current).head(16)
    searcher = runtime.Searcher()
    stop = threading.Event()

    def poll():
        while not stop.is_set():
            watcher.poll()
            time.sleep(0.01)

    def served(index) -> np.ndarray:
        host = runtime.encode_requests(reqs, index.spec)
        dev = runtime.to_device(host, index.device)
        beams = searcher.search(index, dev, runtime.codebook_scorer(index, dev)(slice(0, len(reqs))))
        return expand(index, host, beams).ad_id

    poller = threading.Thread(target=poll, daemon=True)
    poller.start()
    seen, swaps = [], []
    try:
        for rep in range(reps):
            index = watcher.current
            ad = int(served(index)[rep])
            path = out / f"pause{rep}.parquet"
            pl.DataFrame({"ad_id": [ad], "op": ["pause"]}).write_parquet(path)
            proc = subprocess.Popen([shutil.which("sidindex"), "update", str(root), "--changes", str(path)],
                                    stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
            while True:
                index = watcher.current
                if ad not in served(index):
                    break
            t_seen = time.time_ns()
            assert proc.wait() == 0, proc.stderr.read()
            published = Root(root).current_file.stat().st_mtime_ns
            seen.append((t_seen - published) / 1e9)
            swaps.append(index.load_info)
    finally:
        stop.set()
        poller.join()
    return {"latency_s": statistics.median(seen), "latencies_s": seen, "moved_bytes": swaps[-1]["bytes"],
            "device": device}


def update_swaps(root: Path, requests: Path, base: runtime.ServedIndex, reps: int) -> dict:
    """Median seconds per phase of the swap from `base` (served, warm) to ROOT's current snapshot,
    beside the base and whole: {"beside base": phases, "whole": phases}."""
    path = Root.resolve(root)
    reqs = runtime.read_requests(requests, base).head(16)
    dev = runtime.to_device(runtime.encode_requests(reqs, base.spec), base.device)
    searcher = runtime.Searcher()

    def scorer_for(index):
        return runtime.codebook_scorer(index, dev)(slice(0, len(reqs)))

    searcher.search(base, dev, scorer_for(base))  # kernels compiled, graphs captured
    sync(base.device)
    out = {}
    for name, beside in (("beside base", base), ("whole", None)):
        runs = [swap(path, base.device, searcher, dev, scorer_for, False, base=beside) for _ in range(reps)]
        out[name] = median_swap(runs)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--ads", type=int, default=10_000_000)
    ap.add_argument("--dim", type=int, default=32)
    ap.add_argument("--device", default="cuda" if _has_cuda() else "cpu")
    ap.add_argument("--reps", type=int, default=5, help="pauses timed from publish to search")
    ap.add_argument("--codebook", type=Path, help="a frozen codebook to use (default: train one on 500k ads)")
    ap.add_argument("--dir", type=Path, help="work directory (default: a temporary one, removed)")
    ap.add_argument("--json", type=Path, help="write the results as JSON here")
    ap.add_argument("--swap-reps", type=int, default=3, help="swaps timed after each update")
    ap.add_argument("--shards", type=int, help="the snapshot's shards (default: the build's, from the catalog's size)")
    ap.add_argument("--updates", nargs="+", choices=tuple(UPDATES), default=list(UPDATES),
                    help="the updates to run, in this order (default: all)")
    args = ap.parse_args()
    work = args.dir or Path(tempfile.mkdtemp(prefix="bench_update_"))
    work.mkdir(parents=True, exist_ok=True)
    try:
        results = run(args, work)
    finally:
        if args.dir is None:
            shutil.rmtree(work, ignore_errors=True)
    write_json(args.json, results)
    return 0


def run(args, work: Path) -> dict:
    t = time.perf_counter()
    paths = write_sample(work / "data", args.ads, 64, dim=args.dim, seed=5)
    print(f"generated {args.ads:,} ads in {time.perf_counter() - t:.0f} s", flush=True)
    cfg = load_config(None)
    cat = pl.read_parquet(paths["catalog"])
    emb = np.ascontiguousarray(cat.sample(min(len(cat), 500_000), seed=1)["embedding"].to_numpy(), dtype=np.float32)
    root = work / "root"
    save_codebook(load_codebook(args.codebook) if args.codebook else train_codebook(emb, cfg.sid), root)
    del emb
    t = time.perf_counter()
    full = run_build(paths["catalog"], paths["targeting"], root, shards=args.shards)
    full_s = time.perf_counter() - t
    print(f"full build {full_s:.1f} s, {full['shards']} shard(s)", flush=True)
    disk = storage(root)
    rows = [("full build", args.ads, full_s, 1.0, full["seconds"])]
    rng = np.random.default_rng(7)
    ids = cat["ad_id"].to_numpy()
    paused, next_id = np.zeros(0, dtype=np.int64), int(ids.max()) + 1
    live = ids
    swaps: dict[str, dict] = {}
    for name, share, mix in ((UPDATES[u], *SHARES[u]) for u in args.updates):
        n = int(args.ads * share)
        ch = changes(cat, live, paused, n, rng, next_id, mix)
        path = work / f"changes_{len(rows)}.parquet"
        ch.write_parquet(path)
        served = runtime.load(root, args.device)  # the snapshot a serving host holds when the update publishes
        t = time.perf_counter()
        rep = run_update(root, path)
        s = time.perf_counter() - t
        rows.append((name, len(ch), s, s / full_s, rep["seconds"] | {"new SID rows": rep["new_sid_rows"],
                                                                     "base checks": rep["base_checks"]}))
        print(f"{name}: {s:.2f} s", flush=True)
        swaps[name] = update_swaps(root, paths["requests"], served, args.swap_reps)
        del served
        print(f"  swap to it: beside the base {swaps[name]['beside base']['total']:.3f} s, "
              f"whole {swaps[name]['whole']['total']:.3f} s", flush=True)
        gone = ch.filter(pl.col("op").is_in(["pause", "delete"]))["ad_id"].to_numpy()
        live = np.setdiff1d(np.union1d(live, ch.filter(pl.col("op") == "upsert")["ad_id"].to_numpy()), gone)
        paused = np.setdiff1d(np.union1d(paused, ch.filter(pl.col("op") == "pause")["ad_id"].to_numpy()),
                              ch.filter(pl.col("op") == "resume")["ad_id"].to_numpy())
        next_id += n
    trust = base_verification(root)
    serve = serving_latency(root, paths["requests"], args.device, args.reps, work)
    print()
    print("| step | rows | seconds | / full build | target |")
    print("|---|---|---|---|---|")
    for name, n, s, ratio, _ in rows:
        target = {"update 1%": "<= 5%", "update 1%, states only": "<= 1%"}.get(name, "")
        print(f"| {name} | {n:,} | {s:.2f} | {ratio:.2%} | {target} |")
    print(f"| publish -> first search without the paused ad ({serve['device']}) | 1 | "
          f"{serve['latency_s']:.3f} (median of {len(serve['latencies_s'])}) | - | <= 1 s |")
    print(f"\nbase verification ({trust['bytes'] / 1e9:.2f} GB): structure only {trust['structure']:.2f} s; "
          f"digests + structure + cover {trust['full']:.2f} s ({trust['full'] / full_s:.2%} of the full build); "
          f"digests with the checks on record {trust['recorded']:.2f} s ({trust['recorded'] / full_s:.2%})")
    print("each update's base: " + ", ".join(f"{name} {phases['base checks']}" for name, _, _, _, phases in rows[1:]))
    print(f"bytes moved to the device by the watcher's swap: {serve['moved_bytes']}")
    print(f"\nswap to each update's snapshot on {args.device}, median of {args.swap_reps}, seconds "
          "(beside the served base / whole)\n")
    print("| update | " + " | ".join(PHASES) + " | bytes moved |")
    print("|---|" + "---|" * (len(PHASES) + 1))
    for name, sw in swaps.items():
        b, w = sw["beside base"], sw["whole"]
        print(f"| {name} | " + " | ".join(f"{b[k]:.3f} / {w[k]:.3f}" for k in PHASES)
              + f" | {b['bytes moved'] / 1e9:.2f} / {w['bytes moved'] / 1e9:.2f} GB |")
    print(f"storage ({full['shards']} shard(s)): {disk['bytes'] / 1e9:.3f} GB; matcher rows repeated across shards "
          f"{disk['repeated_bytes'] / 1e6:.1f} MB, {disk['overhead']:.2%} over one table per plane (target <= 5%)")
    for name, _, _, _, phases in rows:
        print(f"{name}: " + ", ".join(f"{k} {v}" if isinstance(v, str) else f"{k} {v:.2f}" for k, v in phases.items()))
    return {"rows": [dict(zip(("step", "rows", "seconds", "ratio", "phases"), r)) for r in rows],
            "base_verification": trust, "serving": serve, "swaps": swaps, "shards": full["shards"], "storage": disk}


def storage(root: Path) -> dict:
    """The full build's bytes on disk, and what its shards' own matcher tables cost over one table
    per plane deduplicated across the catalog (the unsharded format's): the rows that several
    shards each hold."""
    snap = open_snapshot(root, verify=False)
    repeated = 0
    for p in range(len(snap.shards[0].gtm.planes)):
        tables = np.concatenate([np.asarray(s.gtm.planes[p].table) for s in snap.shards])
        distinct = RowTable(tables.shape[1], len(tables))
        distinct.add(tables)
        repeated += tables.nbytes - distinct.table().nbytes
    total = snap.manifest.total_bytes
    return {"bytes": total, "repeated_bytes": repeated, "overhead": repeated / (total - repeated)}


def base_verification(root: Path) -> dict:
    """Seconds to open ROOT's snapshot with its structure checked alone, verified in full (digests,
    structure, matcher cover) and with its checks on record (digests), best of 3 each (the page
    cache warm for all)."""
    def best(**kw) -> tuple[float, object]:
        times = []
        for _ in range(3):
            t = time.perf_counter()
            snap = open_snapshot(root, **kw)
            times.append(time.perf_counter() - t)
        return min(times), snap

    structure, snap = best(verify=False)
    full, _ = best(verify=True, cover=True)
    recorded, _ = best(verify=True, cover=True, records=True)  # the last update recorded it
    return {"structure": structure, "full": full, "recorded": recorded, "bytes": snap.manifest.total_bytes}


def _has_cuda() -> bool:
    import torch

    return torch.cuda.is_available()


if __name__ == "__main__":
    sys.exit(main())
