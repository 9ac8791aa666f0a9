"""Build benchmark through `run_build` (what `sidindex build` runs): the local engine against the
Ray engine, end to end (ingest, SIDs, trie, write, validate, publish), same catalog, same run.

    python bench/bench_build.py                                  # 10M ads: local, ray (2 CPUs)
    python bench/bench_build.py --ads 1000000 --engines local local:2 ray:2 --codebook ROOT
    python bench/bench_build.py --ads 30000000 --engines ray:2 --shards 8       # the Ray driver at 30M

Data: a generated catalog (`sidindex sample`: 5 bitmask attributes, Bloom locations, values, 32
dims; --profile skewed: with bulk advertisers' near-duplicates, `sidindex.sample.Bulk`) written as
Parquet (row groups of 262,144 rows: the Ray engine's fragments), and a frozen codebook (given, or
trained on 500k of its ads; training is not a build's). An engine spec is
`local` (whole trie), `local:N` (subtries on N threads) or `ray:N` (a local Ray of N CPUs). Each
build runs in its own process; memory is the machine's peak in use during the build above what was
in use before it (MemTotal - MemAvailable, sampled every 50 ms), so it counts Ray's workers and
object store too, and beside it the build process's own peak RSS (the Ray engine's driver).
Every engine's snapshot is compared array by array with the first's.
Target (2 cores): the Ray engine at 10M ads within 1.3x of the local engine.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make `bench` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np

from bench.report import write_json


def used_bytes() -> int:
    info = dict(line.split(":", 1) for line in Path("/proc/meminfo").read_text().splitlines())
    return (int(info["MemTotal"].split()[0]) - int(info["MemAvailable"].split()[0])) * 1024


def generate(n: int, dim: int, out: Path, profile: str = "default") -> None:
    """The benchmarks' catalog of n ads (seed 5; `sidindex.sample.PROFILES`' profile), its
    targeting spec and 64 requests under `out`."""
    from sidindex.sample import write_sample

    write_sample(out, n, 64, dim=dim, seed=5, profile=profile)


# the SID beams the most (request, ad) pairs are counted for (`ads_per_sid`): a serving search's last
PAIR_BEAMS = 1024


def ads_per_sid(snapshot, beams: int = PAIR_BEAMS) -> dict:
    """How many ads the SIDs of a snapshot (a `Snapshot`, or a ROOT or snapshot directory, opened
    without checksums) hold, read on the host from each shard's leaf_ad_offsets: the SIDs, p50,
    p99 and max ads per SID, and `most_pairs`, the most (request, ad) pairs `beams` distinct SIDs
    reach, the sum of the `beams` largest SIDs' ads (`runtime.index.served.largest_sum`: what the post
    stage sizes its work by, `PostBounds.most_pairs`)."""
    from runtime.index.served import largest_sum
    from sidindex import histogram
    from sidindex.snapshot import Snapshot, open_snapshot

    snap = snapshot if isinstance(snapshot, Snapshot) else open_snapshot(snapshot, verify=False)
    h = np.zeros(1, dtype=np.int64)
    for shard in snap.shards:
        h = histogram.merged(h, histogram.histogram(np.diff(shard.gtm.leaf_ad_offsets)))
    return {"sids": histogram.items(h), "p50": histogram.percentile(h, 50), "p99": histogram.percentile(h, 99),
            "max": histogram.largest(h), "beams": beams, "most_pairs": largest_sum(h, beams)}


def train(catalog: Path, root: Path) -> None:
    import polars as pl

    from sidindex.config import load_config
    from sidindex.sid import save_codebook, train_codebook

    cat = pl.read_parquet(catalog, columns=["embedding"])
    emb = np.ascontiguousarray(cat.sample(min(len(cat), 500_000), seed=1)["embedding"].to_numpy(), dtype=np.float32)
    save_codebook(train_codebook(emb, load_config(None).sid), root)


def single(data: Path, root: Path, codebook: Path, engine: str, shards: int) -> dict:
    from sidindex.job import run_build

    name, _, n = engine.partition(":")
    t = time.perf_counter()
    report = run_build(data / "catalog.parquet", data / "targeting.toml", root, codebook=codebook, engine=name,
                       workers=int(n) if n else None, force=True, shards=shards or None)
    import resource

    return {"seconds": time.perf_counter() - t, "stages": report["seconds"], "sid_rows": report["sid_rows"],
            "ray": report.get("ray"), "process_gb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6}


def child(*args: str) -> tuple[dict, float]:
    """Run this script with `args` in a fresh process: (its JSON result, peak memory in use above the start)."""
    base, peak, done = used_bytes(), [0], threading.Event()

    def sample():
        while not done.wait(0.05):
            peak[0] = max(peak[0], used_bytes() - base)

    threading.Thread(target=sample, daemon=True).start()
    out = subprocess.run([sys.executable, __file__, *args], capture_output=True, text=True)
    done.set()
    if out.returncode:
        sys.exit(f"{' '.join(args)} failed:\n{out.stderr}")
    return json.loads(out.stdout.strip().splitlines()[-1]), peak[0] / 1e9


def same_arrays(a: Path, b: Path) -> bool:
    from sidindex.snapshot import open_snapshot

    x, y = open_snapshot(a, verify=False).arrays(), open_snapshot(b, verify=False).arrays()
    return x.keys() == y.keys() and all(x[k].dtype == y[k].dtype and np.array_equal(x[k], y[k]) for k in x)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--ads", type=int, nargs="+", default=[10_000_000])
    ap.add_argument("--dim", type=int, default=32)
    ap.add_argument("--profile", choices=("default", "skewed"), default="default",
                    help="the catalog's profile (sidindex.sample.PROFILES; skewed: bulk advertisers' near-duplicates)")
    ap.add_argument("--engines", nargs="+", default=["local", "ray:2"])
    ap.add_argument("--codebook", type=Path, help="a frozen codebook (default: train one on 500k ads)")
    ap.add_argument("--dir", type=Path, help="work directory (default: a temporary one, removed)")
    ap.add_argument("--shards", type=int, default=0, help="the snapshot's shards (default: from its size)")
    ap.add_argument("--json", type=Path, help="write the results as JSON here")
    ap.add_argument("--generate", nargs=2, help=argparse.SUPPRESS)
    ap.add_argument("--train", nargs=2, help=argparse.SUPPRESS)
    ap.add_argument("--single", nargs=5, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.generate:
        generate(int(args.generate[0]), args.dim, Path(args.generate[1]), args.profile)
        print("{}")
        return 0
    if args.train:
        train(Path(args.train[0]), Path(args.train[1]))
        print("{}")
        return 0
    if args.single:
        print(json.dumps(single(*map(Path, args.single[:3]), args.single[3], int(args.single[4]))))
        return 0
    work = args.dir or Path(tempfile.mkdtemp(prefix="bench_build_"))
    rows = []
    try:
        for n in args.ads:
            tag = "" if args.profile == "default" else f"_{args.profile}"
            data = work / f"data_{n}{tag}"
            if not (data / "catalog.parquet").exists():
                print(f"generating {n:,} ads ({args.profile}) ...", file=sys.stderr, flush=True)
                child("--generate", str(n), str(data), "--dim", str(args.dim), "--profile", args.profile)
            codebook = args.codebook or work / f"cb{tag}"
            if args.codebook is None and not any(codebook.glob("codebooks/cb-*")):
                child("--train", str(data / "catalog.parquet"), str(codebook))
            first = None
            for engine in args.engines:
                root = work / f"root_{n}_{engine.replace(':', '_')}"
                print(f"{n:,} ads, {engine} ...", file=sys.stderr, flush=True)
                r, peak = child("--single", str(data), str(root), str(codebook), engine, str(args.shards))
                same = True if first is None else same_arrays(first, root)
                first = first or root
                rows.append({"ads": n, "profile": args.profile, "engine": engine, "peak_gb": peak, "same": same, **r})
    finally:
        if args.dir is None:
            shutil.rmtree(work, ignore_errors=True)
    print(f"catalog profile: {args.profile}")
    print("| ads | SID rows | engine | seconds | / first engine | peak memory GB | its process's peak RSS GB "
          "| same arrays |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        ref = next(x for x in rows if x["ads"] == r["ads"])
        print(f"| {r['ads']:,} | {r['sid_rows']:,} | {r['engine']} | {r['seconds']:.1f} | "
              f"{r['seconds'] / ref['seconds']:.2f}x | {r['peak_gb']:.2f} | {r['process_gb']:.2f} | "
              f"{'yes' if r['same'] else 'NO'} |")
    print()
    for r in rows:
        print(f"{r['ads']:,} {r['engine']}: " + ", ".join(f"{k} {v:.1f}" for k, v in r["stages"].items()))
        if r["ray"]:
            shape = r["ray"]
            rows_, secs = np.array(shape["part_sid_rows"]), np.array(shape["part_seconds"])
            print(f"  {shape['fragments']} fragments, {shape['shards']} shards in {shape['parts']} parts; "
                  f"shuffle {shape['shuffle_bytes'] / 1e9:.2f} GB ({shape['shuffle_bytes'] / r['sid_rows']:.0f} B per "
                  f"SID row); per part: {rows_.mean():,.0f} SID rows "
                  f"(max {rows_.max():,}), {secs.mean():.2f} s (max {secs.max():.2f}), "
                  f"{secs.sum() / rows_.sum() * 1e6:.2f} us per SID row")
            if "shard_peak_bytes" in shape:
                print(f"  per shard: {np.mean(shape['shard_sid_rows']):,.0f} SID rows, its task (combine, write, "
                      f"digests) {np.mean(shape['shard_seconds']):.1f} s (max {max(shape['shard_seconds']):.1f}), "
                      f"its growth in RSS {max(shape['shard_peak_bytes']) / 1e9:.2f} GB (max); the globals' task's "
                      f"{shape['globals_peak_bytes'] / 1e9:.2f} GB, {shape['globals_seconds']:.1f} s")
    write_json(args.json, rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
