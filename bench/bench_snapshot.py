"""Snapshot open benchmark: open time per phase and first-query time, 1M vs 10M ads in one run.

    python bench/bench_snapshot.py                    # 1M and 10M ads (about 5 minutes)
    python bench/bench_snapshot.py --ads 200000 2000000

Each size: the `bench_gtm` catalog and SIDs are generated in one process, built and written as a
snapshot in a second; then each measurement runs in a fresh process after evicting the snapshot's
files from the page cache (posix_fadvise DONTNEED), so every open starts cold (median of 3):
  cold      open (verify off), then the first query faults its pages in from disk
  prefault  open with prefault on (every page read at open), then the first query
  verify    open with checksums on (the default: every byte hashed)
A query is 1,000 random catalog SIDs walked for one request: the CD+GTM matcher at each node on the
path, then the exact filter on the SID's ads (what one request's search and post stage touch).
The ratio column divides each 10M figure by the 1M one measured in the same run: mapping should
stay flat, while structure validation, checksums and prefault read the arrays and grow with them.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make `bench` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np
import polars as pl

from bench.bench_gtm import LEVELS, bench_spec, generate, run_child
from sidindex.build import build_index
from sidindex.sample import sample_requests
from sidindex.snapshot import open_snapshot, write_snapshot

QUERY_SIDS = 1000


def write(inputs: Path, out: Path, kway=None) -> dict:
    """Build the index from the files `generate` wrote and write it as a snapshot in `out`; returns
    seconds (build, write) and counts."""
    spec = bench_spec()
    columns = pl.read_ipc(inputs / "catalog.arrow")
    built = build_index(spec, columns, np.load(inputs / "sids.npy"), np.load(inputs / "ad_index.npy"), LEVELS,
                        kway=kway)
    out.mkdir()
    t = time.perf_counter()
    write_snapshot(out, built.gtm, built.exact, np.arange(columns.height, dtype=np.int64), spec,
                   {"id": "bench", "input_fingerprint": "-", "codebook_id": None, "build_config": {},
                    "counts": {"ads": columns.height}, "stats": built.stats.to_dict()})
    os.sync()  # no writeback left to compete with the cold reads measured next
    return {"build": sum(built.seconds.values()), "write": time.perf_counter() - t, "sids": built.stats.sids,
            "nodes": built.stats.num_nodes}


def evict(snapshot: Path) -> None:
    """Drop the snapshot's files from the page cache (clean pages; nothing has them mapped)."""
    for f in snapshot.iterdir():
        fd = os.open(f, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def query(snap, requests, sids: np.ndarray) -> int:
    """Walk each SID for request 0 (CD+GTM at every node, then the exact filter); eligible ads found."""
    from sidindex.matchers.exact import eligible_mask
    from sidindex.trie.match import passing_tokens

    g, found = snap.gtm, 0
    for sid in sids:
        node = 0
        for token in sid:
            if token not in passing_tokens(g, requests[0], 0, node, "cd+gtm"):
                break
            lo = g.node_offsets[node]
            node = int(g.csr_child_nodes[lo + np.searchsorted(g.csr_tokens[lo:g.node_offsets[node + 1]], token)])
        else:
            leaf = node - g.depth_offsets[g.sid_length]
            ads = g.leaf_ads[g.leaf_ad_offsets[leaf]:g.leaf_ad_offsets[leaf + 1]]
            found += int(eligible_mask(snap.exact, requests[1], 0, ads).sum())
    return found


def measure(snapshot: Path, how: str, repeats: int = 3) -> dict:
    """Cold opens (each followed by its first query) in this fresh process; the median of `repeats`."""
    from sidindex.matchers.exact import encode_exact_requests
    from sidindex.trie.match import encode_gtm_requests

    spec = bench_spec()
    req = pl.from_arrow(sample_requests(1, spec, dim=1, seed=5)).select([a.name for a in spec.attributes])
    # compile the numba matchers on a throwaway open, then evict again: only the snapshot is cold
    warm = open_snapshot(snapshot, verify=False)
    requests = (encode_gtm_requests(spec, req), encode_exact_requests(warm.exact, req))
    leaves = np.random.default_rng(7).integers(0, warm.gtm.num_leaves, QUERY_SIDS)
    sids = warm.gtm.leaf_sids(leaves)
    query(warm, requests, sids)
    del warm
    runs = []
    for _ in range(repeats):
        evict(snapshot)
        t = time.perf_counter()
        snap = open_snapshot(snapshot, verify=how == "verify", prefault=how == "prefault")
        open_s = time.perf_counter() - t
        t = time.perf_counter()
        query(snap, requests, sids)
        runs.append({"open_s": open_s, "query_s": time.perf_counter() - t, **snap.open_seconds})
        del snap
    med = {k: float(np.median([r[k] for r in runs])) for k in runs[0]}
    return {"open_s": med.pop("open_s"), "query_s": med.pop("query_s"), "phases": med,
            "bytes": sum(f["bytes"] for f in json.loads((snapshot / "manifest.json").read_text())["files"].values())}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--ads", type=int, nargs="+", default=[1_000_000, 10_000_000])
    ap.add_argument("--generate", type=Path, help=argparse.SUPPRESS)
    ap.add_argument("--write", type=Path, nargs=2, help=argparse.SUPPRESS)
    ap.add_argument("--measure", nargs=2, help=argparse.SUPPRESS)
    ap.add_argument("--json", help="write the results as JSON here")
    args = ap.parse_args()
    if args.generate:
        generate(args.ads[0], 2, args.generate)
        return 0
    if args.write:
        write(*args.write)
        return 0
    if args.measure:
        print(json.dumps(measure(Path(args.measure[0]), args.measure[1])))
        return 0
    results = {}
    for n in args.ads:
        with tempfile.TemporaryDirectory() as tmp:
            tmp = Path(tmp)
            print(f"generating and building {n:,} ads ...", file=sys.stderr, flush=True)
            run_child(__file__, "--generate", str(tmp), "--ads", str(n))
            run_child(__file__, "--write", str(tmp), str(tmp / "snapshot"))
            results[n] = {how: json.loads(run_child(__file__, "--measure", str(tmp / "snapshot"), how).strip().splitlines()[-1])
                          for how in ("cold", "prefault", "verify")}
    rows = [("snapshot GB", lambda r: r["cold"]["bytes"] / 1e9),
            ("open: manifest s", lambda r: r["cold"]["phases"]["manifest"]),
            ("open: map s", lambda r: r["cold"]["phases"]["map"]),
            ("open: structure validation s", lambda r: r["cold"]["phases"]["structure"]),
            ("open, verify off (total) s", lambda r: r["cold"]["open_s"]),
            ("first query, cold s", lambda r: r["cold"]["query_s"]),
            ("open: prefault s", lambda r: r["prefault"]["phases"]["prefault"]),
            ("first query after prefault s", lambda r: r["prefault"]["query_s"]),
            ("open: checksums s", lambda r: r["verify"]["phases"]["checksums"]),
            ("open, verify on (total) s", lambda r: r["verify"]["open_s"])]
    sizes = list(results)
    print("| | " + " | ".join(f"{n:,} ads" for n in sizes) + (" | ratio |" if len(sizes) > 1 else " |"))
    print("|---|" + "---|" * (len(sizes) + (len(sizes) > 1)))
    for name, get in rows:
        vals = [get(results[n]) for n in sizes]
        ratio = f" | {vals[-1] / vals[0]:.2f}x" if len(sizes) > 1 and vals[0] > 0 else (" | -" if len(sizes) > 1 else "")
        print(f"| {name} | " + " | ".join(f"{v:.4f}" for v in vals) + ratio + " |")
    if len(sizes) > 1:
        small, big = (results[n]["cold"]["phases"]["manifest"] + results[n]["cold"]["phases"]["map"] for n in (sizes[0], sizes[-1]))
        grow = sizes[-1] / sizes[0]
        print(f"\n{'PASS' if big <= 2 * small + 0.01 else 'MISS'}  manifest + map does not grow with size: "
              f"{small * 1e3:.1f} ms -> {big * 1e3:.1f} ms for {grow:.0f}x the ads")
    if args.json:
        Path(args.json).write_text(json.dumps({str(k): v for k, v in results.items()}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
