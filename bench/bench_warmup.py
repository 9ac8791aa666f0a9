"""Whether a warm-up's widths fit the traffic that follows: per profile and mode, a
`runtime.Retriever` warmed as it warms by itself (synthetic requests: `runtime.serving.retriever`'s
`largest_requests`), then the same with `warmup=` real requests (the reference: widths measured on
traffic like the served one), each serving the same distinct batches; reported per warm-up: the
batches past its widths (overflows, answered by the worst case's graph), re-warms started, the
widths it settled on per step, and its seconds.

    python bench/bench_warmup.py                                       # a CPU run: 20k ads
    python bench/bench_warmup.py --ads 1000000 --beams 1,512,1024,1024 --batches 64 --cache DIR

Catalogs, snapshots and requests are `bench_stream`'s (`catalog_root`, `request_batches`: 0..64
locations a request, embeddings near the catalog's ads); the real warm-up requests are
--warmup more of them, drawn with another seed. A batch past the widths is exact either way, but
costs the worst case's search (a few ms on a GPU): the synthetic warm-up should leave as few as
the reference. torch and numba run one thread each on the CPU (--threads), as in bench_stream.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make `bench` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import pyarrow as pa
import torch
from rich.console import Console
from rich.table import Table

import runtime
from bench.bench_stream import (
    BATCH,
    CPU_BEAMS,
    CUDA_BEAMS,
    PROFILES,
    beams_for,
    catalog_embeddings,
    catalog_root,
    free,
    request_batches,
    set_threads,
)
from bench.report import write_json
from sidindex.modes import Mode

MODES = (Mode.CD, Mode.CD_GTM)  # the modes with capped widths


def served(index, mode: Mode, beams: tuple[int, ...], batches: list[pa.RecordBatch], warmup: pa.Table | None) -> dict:
    """A Retriever warmed with `warmup` (None: its synthetic warm-up alone), then every batch."""
    t = time.perf_counter()
    retriever = runtime.Retriever(index, mode=mode, beams=beams, batch_sizes=(BATCH,), warmup=warmup)
    warm_s = time.perf_counter() - t
    widths = retriever.widths  # as the warm-up settled them, before any re-warm
    for b in batches:
        retriever.retrieve(b)
    c = retriever.counters
    out = {"warm_s": warm_s, "widths": list(widths or ()), "overflows": c.overflows, "rewarms": c.rewarms,
           "widenings": c.widenings, "batches": c.batches}
    retriever.close()
    retriever.join_warmups()
    free(index.device)
    return out


def run(args) -> dict:
    device = torch.device(args.device)
    beams = beams_for(args.beams, device)
    set_threads(args.threads or (1 if device.type == "cpu" else None))
    profiles = PROFILES if args.profile == "both" else (args.profile,)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for profile in profiles:
            size = catalog_root(args.ads, args.dim, args.cache or Path(tmp), profile)
            index = runtime.load(size["root"], device)
            emb = catalog_embeddings(Path(size["catalog"]))
            batches = request_batches(index, args.batches, emb)
            real = pa.Table.from_batches(request_batches(index, -(-args.warmup // BATCH), emb, seed=12))
            for mode in MODES:
                for name, warmup in (("synthetic", None), (f"{real.num_rows} real", real)):
                    print(f"{profile}, {mode}, {name} warm-up ...", file=sys.stderr, flush=True)
                    rows.append({"profile": profile, "mode": mode.value, "warmup": name,
                                 **served(index, mode, beams, batches, warmup)})
    return {"device": str(device), "ads": args.ads, "beams": list(beams), "batches": args.batches, "rows": rows}


def report(res: dict) -> None:
    t = Table(title=f"{res['ads']:,} ads ({res['device']}): {res['batches']} distinct batches of {BATCH} after each "
                    f"warm-up, beams {','.join(map(str, res['beams']))}")
    for col in ("profile", "mode", "warm-up", "overflows", "re-warms", "widths per step", "warm-up s"):
        t.add_column(col, justify="left" if col in ("profile", "mode", "warm-up") else "right")
    for r in res["rows"]:
        widths = " / ".join("full" if w is None else f"{w:,}" for w in r["widths"]) or "-"
        t.add_row(r["profile"], r["mode"], r["warmup"], f"{r['overflows']}/{r['batches']}", str(r["rewarms"]), widths,
                  f"{r['warm_s']:.1f}")
    Console(width=None if sys.stdout.isatty() else 160).print(t)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--ads", type=int, default=20_000)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--beams", help=f"beam sizes (default {CUDA_BEAMS} on CUDA, {CPU_BEAMS} on the CPU)")
    ap.add_argument("--batches", type=int, default=64, help=f"distinct batches of {BATCH} served after each warm-up")
    ap.add_argument("--warmup", type=int, default=256, help="real requests the reference warms up with")
    ap.add_argument("--profile", choices=(*PROFILES, "both"), default="both")
    ap.add_argument("--threads", type=int, help="torch's and numba's threads (default: 1 on the CPU)")
    ap.add_argument("--dim", type=int, default=32, help="embedding dimensions of the generated catalog")
    ap.add_argument("--cache", type=Path, help="keep the catalogs and ROOTs here, and reuse them (bench_stream's)")
    ap.add_argument("--json", type=Path, help="write the figures as JSON here")
    args = ap.parse_args(argv)
    res = run(args)
    report(res)
    write_json(args.json, res)
    return 0


if __name__ == "__main__":
    sys.exit(main())
