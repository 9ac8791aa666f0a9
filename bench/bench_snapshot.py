"""Snapshot benchmark: write, open (per phase), verify, first query and load onto a device, 1M vs
10M ads, and the same against an earlier revision's snapshot format measured in the same run.

    python bench/bench_snapshot.py                                # 1M and 10M ads (about 8 minutes)
    python bench/bench_snapshot.py --ads 200000 2000000 --baseline 43830fa

Each size: the `bench_gtm` catalog and SIDs are generated once, then for each tree (the working
tree, and with --baseline that revision checked out into a temporary worktree, whose `sidindex`
and `runtime` the child processes import instead) the index is built and written as a snapshot in a
child process, and each measurement runs in a fresh process after evicting the snapshot's files from
the page cache (posix_fadvise DONTNEED), so every open starts cold (median of 3):
  cold      open (verify off), then the first query faults its pages in from disk
  prefault  open with prefault on (every page read at open), then the first query
  verify    open with checksums on (the default: every byte hashed)
  load      open (verify off), then load the index onto the device (`runtime.index.loader.load_index`;
            cuda when there is one, else cpu)
A query walks 1,000 random catalog SIDs down the trie for one request, reading each entry's matcher
rows and the exact rows of the SID's ads (the pages one request's search and post stage touch).
Ratios: each 10M figure over the 1M one, and each figure over the baseline's (same size, same run).
"""

from __future__ import annotations

import argparse
import inspect
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make `bench` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
if os.environ.get("SIDINDEX_BENCH_TREE"):  # a child measuring another revision imports its packages
    sys.path.insert(0, os.environ["SIDINDEX_BENCH_TREE"])

import numpy as np
import polars as pl

from bench.bench_gtm import LEVELS, bench_spec, generate, run_child
from bench.report import write_json

QUERY_SIDS = 1000
SNAPSHOT_ID = "20260101T000000000000Z-00000000"  # a snapshot's directory is named by its id
HOWS = ("cold", "prefault", "verify", "load")


def write(inputs: Path, out: Path, kway=None, codebook=None) -> dict:
    """Build the index from the files `generate` wrote and write it as the snapshot `out/SNAPSHOT_ID`
    (carrying `codebook` if given) with whichever `sidindex` this process imports; returns seconds
    (build, write), bytes and the snapshot's path."""
    from sidindex.build import build_index
    from sidindex.snapshot import write_snapshot

    spec = bench_spec()
    columns = pl.read_ipc(inputs / "catalog.arrow")
    valued = "value" in columns.columns and "ad_value" in inspect.signature(build_index).parameters
    value = {"ad_value": columns["value"].to_numpy()} if valued else {}  # value bounds, where this sidindex has them
    built = build_index(spec, columns.drop("value", strict=False), np.load(inputs / "sids.npy"),
                        np.load(inputs / "ad_index.npy"), LEVELS, kway=kway, **value)
    directory = out / SNAPSHOT_ID
    directory.mkdir(parents=True)
    ad_id = np.arange(columns.height, dtype=np.int64)
    t = time.perf_counter()
    if "snapshot_id" in inspect.signature(write_snapshot).parameters:  # the trie: in shards, or whole before them
        trie = built.shards if "shards" in inspect.signature(write_snapshot).parameters else built.gtm
        write_snapshot(directory, trie, built.exact, ad_id, spec, snapshot_id=SNAPSHOT_ID,
                       stats=built.stats,
                       **({} if codebook is None else {"codebook": codebook}))
    else:  # the raw-array format (before Arrow IPC): an info dict
        write_snapshot(directory, built.gtm, built.exact, ad_id, spec,
                       {"id": SNAPSHOT_ID, "input_fingerprint": "-", "codebook_id": None, "build_config": {},
                        "counts": {"ads": columns.height}, "stats": built.stats.to_dict()})
    seconds = time.perf_counter() - t
    os.sync()  # no writeback left to compete with the cold reads measured next
    return {"build": sum(built.seconds.values()), "write": seconds, "path": str(directory),
            "sids": built.stats.sids, "nodes": built.stats.num_nodes,
            "bytes": sum(p.stat().st_size for p in directory.rglob("*") if p.is_file())}


def evict(snapshot: Path) -> None:
    """Drop the snapshot's files from the page cache (clean pages; nothing has them mapped)."""
    for f in snapshot.rglob("*"):
        if f.is_file():
            fd = os.open(f, os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def query(snap, sids: np.ndarray) -> int:
    """Walk each SID down the trie reading every entry's matcher rows, then its ads' exact rows."""
    g, touched = snap.gtm, 0
    if hasattr(g, "planes"):
        planes, exact_rows = [(p.table, p.index) for p in g.planes], snap.exact.planes[0].rows
    else:  # a baseline tree's index, from before matcher planes
        planes = [(g.bitmask_table, g.bitmask_index), (g.bloom_table, g.bloom_index)]
        exact_rows = snap.exact.bitmask_rows
    for sid in sids:
        node = 0
        for token in sid:
            lo, hi = int(g.node_offsets[node]), int(g.node_offsets[node + 1])
            e = lo + int(np.searchsorted(g.csr_tokens[lo:hi], token))
            touched += sum(int(table[index[e]][0] & 1) for table, index in planes)
            node = int(g.csr_child_nodes[e])
        leaf = node - int(g.depth_offsets[g.sid_length])
        ads = g.leaf_ads[g.leaf_ad_offsets[leaf]:g.leaf_ad_offsets[leaf + 1]]
        touched += int(exact_rows[ads, 0].sum() & 1)
    return touched


def measure(snapshot: Path, how: str, repeats: int = 3) -> dict:
    """Cold opens (each followed by its first query, or a load) in this fresh process; medians."""
    from sidindex.snapshot import open_snapshot

    warm = open_snapshot(snapshot, verify=False)
    sids = warm.gtm.leaf_sids(np.random.default_rng(7).integers(0, warm.gtm.num_leaves, QUERY_SIDS))
    del warm
    runs = []
    for _ in range(repeats):
        evict(snapshot)
        t = time.perf_counter()
        snap = open_snapshot(snapshot, verify=how == "verify", prefault=how == "prefault")
        run = {"open_s": time.perf_counter() - t, **snap.open_seconds}
        t = time.perf_counter()
        if how == "load":
            import torch

            from runtime.index.loader import load_index

            load_index(snap, "cuda" if torch.cuda.is_available() else "cpu")
            run["load_s"] = time.perf_counter() - t
        else:
            query(snap, sids)
            run["query_s"] = time.perf_counter() - t
        runs.append(run)
        del snap
    return {k: float(np.median([r[k] for r in runs])) for k in runs[0]}


def checkout(rev: str, into: Path) -> Path:
    """`rev` of this repository as a plain tree under `into` (git archive: no worktree bookkeeping),
    or `rev` itself when it is a directory holding such a tree (where no git repository travels)."""
    if Path(rev).is_dir():
        return Path(rev).resolve()
    repo = Path(__file__).resolve().parents[1]
    tree = into / "baseline"
    tree.mkdir()
    archive = subprocess.run(["git", "-C", str(repo), "archive", rev], check=True, capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", str(tree)], input=archive, check=True)
    return tree


def child(tree: Path | None, *args: str) -> dict:
    """Run this file in a child process importing `tree`'s packages (None: the working tree)."""
    env = dict(os.environ)
    env.pop("SIDINDEX_BENCH_TREE", None)
    if tree is not None:
        env["SIDINDEX_BENCH_TREE"] = str(tree)
    out = subprocess.run([sys.executable, __file__, *args], env=env, check=True, capture_output=True, text=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def phase(r: dict, how: str, *names: str) -> float:
    return sum(r[how].get(n, 0.0) for n in names)


ROWS = [
    ("snapshot GB", lambda r: r["write"]["bytes"] / 1e9),
    ("write s", lambda r: r["write"]["write"]),
    ("open: manifest + file list s", lambda r: phase(r, "cold", "manifest", "files")),
    ("open: map s", lambda r: phase(r, "cold", "map")),
    ("open: structure validation s", lambda r: phase(r, "cold", "structure")),
    ("open, verify off (total) s", lambda r: r["cold"]["open_s"]),
    ("first query, cold s", lambda r: r["cold"]["query_s"]),
    ("open: prefault s", lambda r: phase(r, "prefault", "prefault")),
    ("first query after prefault s", lambda r: r["prefault"]["query_s"]),
    ("open: checksums + structure (side by side) s", lambda r: phase(r, "verify", "checksums + structure")),
    ("open, verify on (total) s", lambda r: r["verify"]["open_s"]),
    ("load onto the device s", lambda r: r["load"]["load_s"]),
]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--ads", type=int, nargs="+", default=[1_000_000, 10_000_000])
    ap.add_argument("--baseline", help="a git revision whose snapshot format to measure alongside, e.g. 43830fa "
                                       "(or a directory holding that revision's packages)")
    ap.add_argument("--generate", type=Path, help=argparse.SUPPRESS)
    ap.add_argument("--write", type=Path, nargs=2, help=argparse.SUPPRESS)
    ap.add_argument("--measure", nargs=2, help=argparse.SUPPRESS)
    ap.add_argument("--json", help="write the results as JSON here")
    args = ap.parse_args()
    if args.generate:
        generate(args.ads[0], 2, args.generate)
        return 0
    if args.write:
        print(json.dumps(write(*args.write)))
        return 0
    if args.measure:
        print(json.dumps(measure(Path(args.measure[0]), args.measure[1])))
        return 0
    results: dict[str, dict] = {}
    with tempfile.TemporaryDirectory() as scratch:
        scratch = Path(scratch)
        base = Path(args.baseline).name if args.baseline else ""
        trees = {"current": None} | ({f"baseline {base}": checkout(args.baseline, scratch)} if args.baseline else {})
        for n in args.ads:
            inputs = scratch / f"inputs-{n}"
            inputs.mkdir()
            print(f"generating {n:,} ads ...", file=sys.stderr, flush=True)
            run_child(__file__, "--generate", str(inputs), "--ads", str(n))
            for name, tree in trees.items():
                print(f"  {name}: build, write, measure ...", file=sys.stderr, flush=True)
                out = scratch / f"snap-{n}-{name.split()[0]}"
                r = {"write": child(tree, "--write", str(inputs), str(out))}
                r |= {how: child(tree, "--measure", str(out / SNAPSHOT_ID), how) for how in HOWS}
                results[f"{name} {n:,}"] = r
    cols = list(results)
    header = "| | " + " | ".join(cols)
    ratios = []
    if len(args.ads) > 1:
        ratios.append((f"{args.ads[-1]:,} / {args.ads[0]:,}", f"current {args.ads[-1]:,}", f"current {args.ads[0]:,}"))
    if args.baseline:
        ratios += [(f"current / baseline at {n:,}", f"current {n:,}", f"baseline {base} {n:,}") for n in args.ads]
    print(header + "".join(f" | {r[0]}" for r in ratios) + " |")
    print("|---|" + "---|" * (len(cols) + len(ratios)))
    for label, get in ROWS:
        vals = {c: get(results[c]) for c in cols}
        cells = [f"{vals[c]:.4f}" for c in cols]
        cells += [f"{vals[a] / vals[b]:.2f}x" if vals[b] > 0 else "-" for _, a, b in ratios]
        print(f"| {label} | " + " | ".join(cells) + " |")
    write_json(args.json, results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
