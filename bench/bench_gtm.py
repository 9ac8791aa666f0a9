"""GTM build benchmark: per-stage build time, peak RSS and matcher storage at 1M, 10M and 30M ads,
and the trie built in shards (by first token) on one core and on every core.

    python bench/bench_gtm.py                       # 1M, 10M and 30M ads (about 15 minutes on 2 cores)
    python bench/bench_gtm.py --ads 1000000         # one size

Data: a generated catalog with GRACE-like widths (the sample spec plus an `interest` attribute:
6 bitmask words; one 256-bit Bloom attribute, ~10 locations per restricted ad) and generated SIDs
(L=4, 512 per level, 2 paths per ad, hash level from the advertiser). The build runs from the
catalog's strings. In the same process it times a plain numpy CD-only CSR build from the same SIDs
(the STATIC-style floor: sort, unique prefixes per depth, offsets; no matchers) and reports the
core (trie stage: SIDs and encoded rows to the finished index, k-way off) as a ratio to it.
Each size is generated in one process and written to files (an Arrow IPC catalog, the SIDs);
a second process reads them ("load") and builds, so peak RSS is the build's alone.
Each size is built as one shard (the whole trie at once, every core for the other stages); at the
sizes given to --cores, the trie is also built in 4 shards per core (`--shards`, `--workers`) on 1
core (the process pinned to it) and on N cores, and its join compared with the whole build's (every
array but the matcher tables, and every entry's and partition's matcher rows).
Targets (2 cores): 10M ads <= 60 s end to end, peak RSS <= 8 GB; core <= 4x the CD-only floor;
30M ads <= 3 min, peak RSS <= 20 GB.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make `bench` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np
import polars as pl
from pyarrow import feather

from bench.report import verdict, write_json
from schemas.artifacts import MATCHER_PLANES
from sidindex.build import build_index
from sidindex.sample import sample_catalog, sample_spec, zipf_weights
from sidindex.sid.assign import run_starts, sid_keys
from sidindex.sid.hashing import hash_tokens
from sidindex.targeting import BITMASK, Attribute, TargetingSpec

LEVELS = (512, 512, 512, 512)


def bench_spec() -> TargetingSpec:
    base = sample_spec()
    interest = Attribute("interest", BITMASK, values=tuple(f"topic{i:02d}" for i in range(64)))
    return TargetingSpec(base.attributes[:5] + (interest,) + base.attributes[5:])


def generated_sids(advertiser: pl.DataFrame, paths: int, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """(P, 4) int16 SID rows in (ad, path) order, and their ads: Zipf-popular coarse tokens, distinct
    first tokens per ad, the advertiser's hash token last (as `sidindex sid assign` produces)."""
    n = advertiser.height
    hashed = hash_tokens(advertiser, ("advertiser_id",), LEVELS[3])
    first = rng.choice(LEVELS[0], size=n, p=zipf_weights(LEVELS[0], 0.8))
    rows = []
    for p in range(paths):
        t0 = (first + p * rng.integers(1, LEVELS[0], size=n) * (p > 0)) % LEVELS[0]
        t1 = rng.choice(LEVELS[1], size=n, p=zipf_weights(LEVELS[1], 0.6))
        t2 = rng.integers(0, LEVELS[2], size=n)
        rows.append(np.stack([t0, t1, t2, hashed], axis=1))
    sids = np.stack(rows, axis=1).reshape(n * paths, 4).astype(np.int16)
    return sids, np.repeat(np.arange(n, dtype=np.int64), paths)


def cd_only_floor(sids: np.ndarray) -> float:
    """Seconds for a plain numpy CD-only CSR build: the least any trie build must do."""
    t = time.perf_counter()
    keys = np.sort(sid_keys(sids, LEVELS))
    keys = keys[run_starts(keys)]  # sorted distinct SIDs
    node_offsets, tokens = [], []
    radix = np.cumprod((1,) + LEVELS[::-1])[::-1]  # radix[d] = product of sizes below depth d
    parent_keys = np.zeros(1, dtype=np.int64)
    for d in range(1, len(LEVELS) + 1):
        prefix = keys // radix[d]
        child = prefix[run_starts(prefix)]
        tokens.append((child % LEVELS[d - 1]).astype(np.int16))
        counts = np.bincount(np.searchsorted(parent_keys, child // LEVELS[d - 1]), minlength=len(parent_keys))
        node_offsets.append(np.cumsum(counts))
        parent_keys = child
    return time.perf_counter() - t


def generate(n: int, paths: int, out: Path) -> None:
    """Write the benchmark's inputs to `out`: catalog.arrow (the targeting columns, as a catalog
    file would hold them), sids.npy and ad_index.npy."""
    spec = bench_spec()
    table = sample_catalog(n, spec, dim=1, seed=0)
    sids, ad_index = generated_sids(pl.DataFrame({"advertiser_id": table["advertiser_id"].to_numpy()}), paths,
                                    np.random.default_rng(0))
    feather.write_feather(table.select([a.name for a in spec.attributes] + ["value"]), out / "catalog.arrow",
                          compression="uncompressed")
    np.save(out / "sids.npy", sids)
    np.save(out / "ad_index.npy", ad_index)


def retrieved_arrays(g) -> dict[str, np.ndarray]:
    """What retrieval reads of an index, whatever its tables' row order and sharing: every array
    but the matcher tables and row indexes, and per plane a fingerprint of each entry's and each
    partition's row (a sharded index repeats rows across shards)."""
    out = {n: np.asarray(a) for n, a in g.arrays().items() if "table" not in n and "index" not in n}
    for p in g.planes:
        table = np.asarray(p.table)
        mix = (table * np.uint64(0x9E3779B97F4A7C15)).sum(axis=1, dtype=np.uint64) ^ table[:, 0]
        out[f"{p.name}_rows"] = mix[p.index]
        if p.part_index is not None:
            out[f"part_{p.name}_rows"] = mix[p.part_index]
    return out


def run_one(inputs: Path, workers: int | None, shards: int | None, compare: Path | None) -> dict:
    """Build from the files `generate` wrote, in a process that holds nothing else; `compare`: a
    whole build's arrays (`np.savez`) to check this one's against, or where to save them (None: neither)."""
    spec = bench_spec()
    t = time.perf_counter()
    columns = pl.read_ipc(inputs / "catalog.arrow")
    sids, ad_index = np.load(inputs / "sids.npy"), np.load(inputs / "ad_index.npy")
    load_s = time.perf_counter() - t
    floor_s = cd_only_floor(sids)  # first: its arrays are gone before the build's peak
    built = build_index(spec, columns, sids, ad_index, LEVELS, workers=workers, shards=shards or 1)
    same = None
    if compare is not None:
        ours = retrieved_arrays(built.gtm)
        if compare.exists():
            with np.load(compare) as whole:
                same = whole.files == sorted(ours) and all(np.array_equal(whole[k], ours[k]) for k in whole.files)
        else:
            np.savez(compare, **dict(sorted(ours.items())))
    st = built.stats
    seconds = {"load": load_s, **built.seconds}
    return {
        "ads": columns.height, "sid_rows": len(sids), "seconds": seconds, "same_as_whole": same,
        "total_s": sum(seconds.values()), "floor_s": floor_s, "core_vs_floor": built.seconds["trie"] / floor_s,
        "peak_rss_gb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6,
        **{f"{p.name}_words": int(p.table.shape[1]) for p in built.gtm.planes},
        "positions": [p.to_dict() for p in st.positions], "sids": st.sids, "num_nodes": st.num_nodes,
        "table_bytes": st.matcher_bytes,
    }


def run_child(script: str, *args: str, pin: bool = False) -> str:
    """Run `script` with `args` in a fresh process (its memory and page faults are its own); stdout.
    pin: on core 0 alone, every thread pool sized to one."""
    env = dict(os.environ)
    prefix = []
    if pin:
        prefix = ["taskset", "-c", "0"]
        env |= {k: "1" for k in ("NUMBA_NUM_THREADS", "POLARS_MAX_THREADS", "OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS")}
    out = subprocess.run([*prefix, sys.executable, script, *args], capture_output=True, text=True, env=env)
    if out.returncode:
        sys.exit(f"{' '.join(args)} failed:\n{out.stderr}")
    return out.stdout


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--ads", type=int, nargs="+", default=[1_000_000, 10_000_000, 30_000_000])
    ap.add_argument("--cores", type=int, nargs="*", default=[10_000_000],
                    help="sizes at which the subtries are built on 1 core and on every core too")
    ap.add_argument("--paths", type=int, default=2)
    ap.add_argument("--generate", type=Path, help=argparse.SUPPRESS)
    ap.add_argument("--single", type=Path, help=argparse.SUPPRESS)
    ap.add_argument("--workers", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--shards", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--compare", type=Path, help=argparse.SUPPRESS)
    ap.add_argument("--json", help="write the results as JSON here")
    args = ap.parse_args()
    if args.generate:
        generate(args.ads[0], args.paths, args.generate)
        return 0
    if args.single:
        print(json.dumps(run_one(args.single, args.workers, args.shards, args.compare)))
        return 0
    results = []
    cores = len(os.sched_getaffinity(0))
    for n in args.ads:
        with tempfile.TemporaryDirectory() as tmp:
            print(f"generating {n:,} ads ...", file=sys.stderr, flush=True)
            run_child(__file__, "--generate", tmp, "--ads", str(n), "--paths", str(args.paths))
            runs = [("whole trie", False, [])]
            if n in args.cores:
                whole = ["--compare", str(Path(tmp) / "whole.npz")]
                shards = ["--shards", str(4 * cores)]
                runs = [("whole trie, 1 core", True, whole), ("whole trie", False, []),
                        (f"{4 * cores} shards, 1 core", True, [*whole, *shards, "--workers", "1"]),
                        (f"{4 * cores} shards, {cores} cores", False, [*whole, *shards, "--workers", str(cores)])]
            for label, pin, extra in runs:
                print(f"building {n:,} ads, {label} ...", file=sys.stderr, flush=True)
                r = json.loads(run_child(__file__, "--single", tmp, *extra, pin=pin).strip().splitlines()[-1])
                results.append(r | {"run": label})
    stages = list(results[0]["seconds"])
    print("| ads | SID rows | run | " + " | ".join(f"{s} s" for s in stages)
          + " | total s | CD-only floor s | core / floor | peak RSS GB | same arrays as whole |")
    print("|" + "---|" * (len(stages) + 8))
    for r in results:
        same = {None: "-", True: "yes", False: "NO"}[r["same_as_whole"]]
        print(f"| {r['ads']:,} | {r['sid_rows']:,} | {r['run']} | "
              + " | ".join(f"{r['seconds'][s]:.2f}" for s in stages)
              + f" | {r['total_s']:.1f} | {r['floor_s']:.2f} | {r['core_vs_floor']:.2f}x | {r['peak_rss_gb']:.2f} "
              f"| {same} |")
    for r in (r for r in results if r["run"] == "whole trie"):
        words = " + ".join(f"{r[f'{p}_words']} {p}" for p in MATCHER_PLANES)
        print(f"\n{r['ads']:,} ads: {r['num_nodes']:,} nodes, {r['sids']:,} SIDs, "
              f"matcher tables {r['table_bytes'] / 1e6:.0f} MB ({words} words per row)")
        print("| position | parents | entries | " + " | ".join(f"{p} MB before -> after dedup" for p in MATCHER_PLANES)
              + " | " + " | ".join(f"{p} fill" for p in MATCHER_PLANES) + " |")
        print("|---|---|---|" + "---|" * (2 * len(MATCHER_PLANES)))
        for p in r["positions"]:
            print(f"| {p['position']} | {p['parents']:,} | {p['entries']:,} | "
                  + " | ".join(f"{p[f'{m}_bytes_before'] / 1e6:.1f} -> {p[f'{m}_bytes_after'] / 1e6:.1f}"
                               for m in MATCHER_PLANES)
                  + " | " + " | ".join(f"{p[f'{m}_fill']:.3f}" for m in MATCHER_PLANES) + " |")
    default = {r["ads"]: r for r in results if r["run"] == "whole trie"}
    for n, limit_s, limit_gb in ((10_000_000, 60, 8), (30_000_000, 180, 20)):
        if n in default:
            r = default[n]
            print("\n" + verdict(r['total_s'] <= limit_s, f"{n:,} ads end to end <= {limit_s} s: "
                  f"{r['total_s']:.1f} s"))
            print(verdict(r['peak_rss_gb'] <= limit_gb, f"peak RSS <= {limit_gb} GB: "
                  f"{r['peak_rss_gb']:.2f} GB"))
    if 10_000_000 in default:
        print(verdict(default[10_000_000]['core_vs_floor'] <= 4, f"core <= 4x CD-only floor: "
              f"{default[10_000_000]['core_vs_floor']:.2f}x"))
    write_json(args.json, results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
