"""Snapshot swap benchmark: what a serving host pays to swap to a newly published snapshot, per
phase, next to the same swap checking the structure again (beside the digests, or after them) and
the old path (sha256 verification, single-threaded staging), measured in the same run.

    python bench/bench_swap.py                       # 5M and 15M ads (about 10M and 30M SIDs); GPU if present
    python bench/bench_swap.py --ads 200000          # a smoke test, fine on a CPU
    python bench/bench_swap.py --keep DIR; python bench/bench_swap.py --built DIR --cold   # warm, then cold

Each size: the `bench_search` snapshot (the `bench_gtm` catalog, k-way partitions) is built once and
published into a ROOT as a build publishes it (`Root.publish`, checked by `check_to_publish`, which
records its structure check). A serving index is loaded from the first copy and searched once
(kernels compiled, the old index serving), then the swap to the published one is timed, as a host sees
it after the new snapshot was copied onto it (its files in the page cache; --cold: evicted before
every swap), median of --repeats, with the old index serving throughout:
  manifest      read the sealed manifest, check the shapes it declares and the files' sizes
  checks        map every Arrow file and check every file's fast digest (xxh3_128 by 16 MiB
                chunks, all files' chunks on one pool); the structure is on record
                checked: also validate the structure (`check_structure`, shard by shard), the
                digests on another thread beside it (a snapshot without a record: `records=False`)
                in turn: the digests first, then the structure (each one's seconds are printed)
                reference: every file's sha256 first, one thread per file (the largest file bounds it)
  join          reference: the shards' one trie (`Snapshot.gtm`; one shard's own arrays, several
                copied into one); the new path joins in its load (stage)
  stage         pinned allocation (once: the arena is kept), copy of the maps (STAGE_THREADS threads)
                reference: the copy on one thread. The new path is `runtime.load`, a serving host's:
                on a GPU its copies to the device run beside the checks, and stage is
                the wait for what they did not hide
  transfer      host to device (what was not copied beside the checks), then the entry keys, the
                matcher rows renumbered, launch shapes and post bounds made there
  first search  one batch (--batch requests, random logits) through `runtime.Searcher` on the new index
  total         the sum of the phases: the swap's wall time
With several GPUs, the load onto all of them at once (read, verified and staged once) is timed too.
On the CPU the index serves the memory maps themselves (stage copies nothing; transfer is the entry
keys built on the host), so the copy a GPU host's stage makes is also timed, into fresh unpinned
memory (its first-touch page faults included, which pinned memory pays when it is allocated), on
STAGE_THREADS threads and on one.
Target: total <= 0.5 s at 15M ads (30M SIDs) on the H200.
"""

from __future__ import annotations

import argparse
import gc
import json
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make `bench` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch

import runtime.index.staging as staging
import sidindex.snapshot.snapshot as snapshot_module
from bench.bench_snapshot import evict
from bench.common import bench_requests, build_snapshot
from bench.report import verdict, write_json
from runtime import Searcher, load, load_index, to_device
from runtime.index.served import ServedIndex
from schemas.artifacts import MANIFEST_FILE
from sidindex.artifact import THREADS, verify_files
from sidindex.request_encoding import encode_requests
from sidindex.root import Root
from sidindex.snapshot import open_snapshot
from sidindex.snapshot.snapshot import check_to_publish
from sidindex.timing import StageClock

BEAMS = (1, 512, 1024, 1024)
PHASES = ("manifest", "checks", "join", "stage", "transfer", "first search", "total")
# the swap (digests, structure on record); structure checked beside the digests; after them; the old path
VARIANTS = ("new", "checked", "in turn", "reference")


class RandomLogits:
    """Fixed random logits per step (only the search is timed), with `inputs` so a `Searcher`
    captures it in a CUDA graph (refreshed, unused: a real scorer's compute is its own)."""

    def __init__(self, B: int, V: int, device: torch.device) -> None:
        gen = torch.Generator(device=device).manual_seed(0)
        self.logits, k = [], 1
        for d in range(len(BEAMS)):
            self.logits.append(torch.randn(B, k, V, device=device, generator=gen) * 2)
            k = min(BEAMS[d + 1] if d + 1 < len(BEAMS) else BEAMS[-1], k * V)
        self.inputs = {"embedding": torch.zeros(B, 64, device=device)}

    def __call__(self, step, tokens, parent):
        return self.logits[step]


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def swap(path: Path, device: torch.device, searcher: Searcher, requests, scorer_for, reference: bool,
         base: ServedIndex | None = None, records: bool = True) -> dict:
    """One swap to the snapshot at `path`: seconds per phase (PHASES). reference: the old path;
    scorer_for(index): the first search's scorer on the new index; base: the index served
    before (an update's base, whose files and device tensors the new one may share), as a watcher
    swaps after an update; records: trust ROOT's check record (`runtime.load`)."""
    out = {}
    if reference:  # the old serving path: sha256 of every file, then an open, the join, the load
        listing = {n: {"bytes": f.bytes, "sha256": f.sha256} for n, f in open_snapshot(path, verify=False)
                   .manifest.files.items()}
        t = time.perf_counter()
        verify_files(path, listing, MANIFEST_FILE)
        out["checks"] = time.perf_counter() - t
        snap = open_snapshot(path, verify=False)
        t = time.perf_counter()
        snap.gtm  # noqa: B018 (joined here, timed apart from the load that reads it)
        out["join"] = time.perf_counter() - t
        staging.STAGE_THREADS = 1
        try:
            index = load_index(snap, device)
        finally:
            staging.STAGE_THREADS = THREADS
    else:  # a serving host's (`runtime.load`, as its watcher calls it): on a GPU the copies run beside the checks
        index = load(path, device, base=base, records=records)
        snap = index.snapshot
        out |= {"checks": 0.0, "join": 0.0}  # the join is in the load's stage
    o = snap.open_seconds
    checks = ("checksums + structure", "checksums", "structure")  # side by side, or in turn
    out |= {"manifest": o["manifest"] + o["files"],
            "checks": out["checks"] + o["map"] + sum(o.get(k, 0.0) for k in checks)}
    out |= {f"{k} alone": o[k] for k in checks[1:] if k in o and "checksums" in o}
    p = index.load_info["phases"]
    # on a GPU the new path's copies run beside the checks: what they did not hide is waited for
    out |= {"stage": o.get("copies", 0.0) + p.get("pin", 0.0) + p["stage"], "transfer": p["transfer"]}
    t = time.perf_counter()
    searcher.search(index, requests, scorer_for(index))
    sync(device)
    out["first search"] = time.perf_counter() - t
    out["total"] = sum(out[k] for k in PHASES[:-1])
    out["bytes moved"] = index.load_info["bytes"]
    out["copied while checking"] = index.load_info.get("while_checking", {})
    return out


def median_swap(runs: list[dict]) -> dict:
    """The median of each number of several `swap`s (what else they give, the last one's)."""
    return {k: statistics.median(r[k] for r in runs) if isinstance(v, (int, float)) else runs[-1][k]
            for k, v in runs[0].items()}


def host_copy(path: Path, threads: int) -> float:
    """Seconds to copy every array of the snapshot into unpinned host memory on `threads` threads
    (the copy a GPU host's stage makes)."""
    snap = open_snapshot(path, verify=False)
    staging.STAGE_THREADS = threads
    try:
        clock = StageClock()
        staging.stage_arrays(snap.arrays(), clock, pinned=False)
    finally:
        staging.STAGE_THREADS = THREADS
    return clock.seconds["stage"]


def measure(n: int, scratch: Path, device: torch.device, args) -> dict:
    kept = Path(args.built or "-") / f"ads-{n}" / "build.json"
    if kept.exists():  # built by `bench_search --keep`: the same snapshot, not built again
        build = json.loads(kept.read_text())
    else:
        print(f"building {n:,} ads ...", file=sys.stderr, flush=True)
        where = Path(args.keep) / f"ads-{n}" if args.keep else scratch / f"build-{n}"
        where.mkdir(parents=True)
        build = build_snapshot(n, where)
        if args.keep:
            (where / "build.json").write_text(json.dumps(build))
    old_path = Path(build["path"])
    root = Root(scratch / f"published-{n}")  # published as a build publishes: its structure check recorded
    with root.lock():  # under its id: a snapshot directory is named by it
        new_path = root.publish(old_path.name, lambda d: shutil.copytree(old_path, d, dirs_exist_ok=True),
                                lambda d: check_to_publish(d, root, old_path.name), 1, expected=None)
    res = {"ads": n, "sids": build["sids"], "nodes": build["nodes"], "gb": build["bytes"] / 1e9,
           "build_s": build["build"] + build["generate"]}
    serving = load_index(open_snapshot(old_path), device)  # the old index, serving throughout
    requests = to_device(encode_requests(bench_requests(args.batch, 64), serving.spec), device)
    scorer = RandomLogits(args.batch, serving.vocab_size, device)
    searcher = Searcher(BEAMS)
    searcher.search(serving, requests, scorer)  # kernels compiled, graphs captured: a warm server
    sync(device)
    for name in VARIANTS:
        runs = []
        snapshot_module.CHECKS_SIDE_BY_SIDE = name != "in turn"
        try:
            for _ in range(args.repeats):
                # the old index serving again, so that nothing holds the last swap's index and its
                # maps: pages still mapped are not evicted
                searcher.search(serving, requests, scorer)
                sync(device)
                gc.collect()
                if args.cold:
                    evict(new_path)
                runs.append(swap(new_path, device, searcher, requests, lambda _: scorer, name == "reference",
                                 records=name == "new"))
                print(f"  {name}: " + ", ".join(f"{k} {v:.3f}" for k, v in runs[-1].items() if k in PHASES),
                      file=sys.stderr, flush=True)
        finally:
            snapshot_module.CHECKS_SIDE_BY_SIDE = True
        res[name] = median_swap(runs)
    if device.type == "cpu":
        res["host copy s"] = {"threads": host_copy(new_path, THREADS), "one thread": host_copy(new_path, 1)}
    gpus = torch.cuda.device_count() if device.type == "cuda" else 0
    if gpus > 1:  # one read, verification and staging for every GPU
        t = time.perf_counter()
        indexes = load_index(open_snapshot(new_path), [f"cuda:{i}" for i in range(gpus)])
        res["all gpus"] = {"gpus": gpus, "seconds": time.perf_counter() - t, "phases": indexes[0].load_info["phases"]}
        del indexes
    return res


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--ads", type=int, nargs="+", default=[5_000_000, 15_000_000])
    ap.add_argument("--batch", type=int, default=16, help="requests in the first search's batch")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--cold", action="store_true", help="evict the new snapshot's files from the page cache first")
    ap.add_argument("--json", help="write the results as JSON here")
    ap.add_argument("--built", help="a directory `--keep` (here or bench_search's) built the snapshots in: reuse them")
    ap.add_argument("--keep", help="build into DIR/ads-N and keep it (a later --built DIR reuses it, --cold say)")
    args = ap.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    where = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    results = []
    with tempfile.TemporaryDirectory() as scratch:
        for n in args.ads:
            results.append(measure(n, Path(scratch), device, args))
    print(f"\nsnapshot swap on {where} ({THREADS} threads), {'cold' if args.cold else 'page-cache warm'} files, "
          f"median of {args.repeats}")
    print("\n| phase, s | " + " | ".join(f"{r['ads']:,} ads ({r['sids']:,} SIDs, {r['gb']:.2f} GB) | structure "
                                        "checked | checks in turn | reference | reference / new" for r in results)
          + " |")
    print("|---|" + "---|---|---|---|---|" * len(results))
    for ph in PHASES:
        cells = []
        for r in results:
            new, checked, turn, ref = (r[v][ph] for v in VARIANTS)
            cells += [f"{new:.3f}", f"{checked:.3f}", f"{turn:.3f}", f"{ref:.3f}",
                      f"{ref / new:.1f}x" if new > 0 else "-"]
        print(f"| {ph} | " + " | ".join(cells) + " |")
    for r in results:
        turn = r["in turn"]
        print(f"\n{r['ads']:,} ads, checks: {r['new']['checks']:.3f} s with the structure on record, "
              f"{r['checked']['checks']:.3f} s checking it beside the digests, {turn['checks']:.3f} s in turn "
              f"(digests {turn['checksums alone']:.3f} s, then structure {turn['structure alone']:.3f} s)")
        if "host copy s" in r:
            c = r["host copy s"]
            print(f"\n{r['ads']:,} ads, host copy a GPU's stage makes (unpinned): {c['threads']:.3f} s on {THREADS} "
                  f"threads, {c['one thread']:.3f} s on one ({r['gb'] / c['threads']:.1f} vs "
                  f"{r['gb'] / c['one thread']:.1f} GB/s)")
        if r["new"]["copied while checking"]:
            c = r["new"]["copied while checking"]
            print(f"\n{r['ads']:,} ads, copied to the GPU while the snapshot was hashed and checked (in checks): "
                  f"{c['bytes'] / 1e9:.2f} GB, " + ", ".join(f"{k} {v:.3f} s" for k, v in c.items()
                                                                       if k != "bytes"))
        if "all gpus" in r:
            a = r["all gpus"]
            print(f"\n{r['ads']:,} ads onto all {a['gpus']} GPUs at once: {a['seconds']:.3f} s (open + load; "
                  + ", ".join(f"{k} {v:.3f}" for k, v in a["phases"].items()) + ")")
    last = results[-1]
    total = last["new"]["total"]
    print("\n" + verdict(total <= 0.5, f"swap <= 0.5 s at {last['ads']:,} ads ({last['sids']:,} SIDs): "
          f"{total:.3f} s; the reference path takes {last['reference']['total'] / total:.1f}x as long"))
    write_json(args.json, results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
