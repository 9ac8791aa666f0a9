"""Batched calls on `sidindex serve`: callers that already batch (a recommendation backend) send
--rows requests per call, over Arrow Flight (`do_exchange`) and as an Arrow stream over HTTP
(POST /retrieve), from --clients closed-loop clients; requests/s against the Retriever's own on
the same batches in the same run, and every answer checked.

    python bench/bench_batched.py                                        # CPU: 20k ads, 64 rows a call
    python bench/bench_batched.py --device cuda --ads 1000000 --workers 8 --clients 32 --cache /data/bench

Catalog and ROOT: `bench_stream.catalog_root` (kept under --cache), served from a working copy
(`bench_load.working_root`). Requests: a pool of --pool (`sidindex.sample.sample_requests`, near
catalog ads), request_id its place, cut into pool / rows batches of --rows; client c's i-th call
sends batch (c + i x clients) mod batches.

1. direct: before the server starts, in this process, `runtime.Retriever` (the server's mode,
   beams, top_k and --max-batch as its batch size) retrieves every batch once: the reference
   answers; then 2 threads call `Retriever.retrieve` on the batches in turn for --seconds: the
   requests/s a server's calls are set against (the ratio).
2. `sidindex serve WORK_ROOT --flight-port P` (--workers, --max-batch passed through), warm; then
   per path, flight and http, --clients clients in --procs processes (threads; this script,
   importing numpy, pyarrow and httpx only), each with its own exchange or keep-alive connection,
   call in a closed loop for --seconds after a common start. Then SIGTERM: the server must exit 0.
Every answer is checked in its client against the reference of its batch: request ids, ad_id
and rank lists equal per request; a request whose ad_ids differ but whose scores agree rank by
rank within 1e-5 is a near tie (a GPU's float sums depend on the batch a request shares), any
other difference a mismatch. A call that fails (a transport or server error) is counted.
Output: a table (path, calls, requests/s and the ratio to direct, per-call p50 / p99 ms, failed,
mismatches, near ties), progress on stderr, every figure with --json PATH.
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
import pyarrow as pa

from bench.load_check import SCORE_TOL
from bench.load_report import percentiles
from bench.report import verdict, write_json

# torch and runtime are imported where they are used: a client process imports numpy, pyarrow and httpx
PATHS = ("flight", "http")
ARROW_STREAM = "application/vnd.apache.arrow.stream"  # runtime.server.http's
LEAD_S = 3.0  # from the client processes' start to the common first call: their imports and connections


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def write_arrow(path: Path, table: pa.Table) -> None:
    with pa.OSFile(str(path), "wb") as f, pa.ipc.new_file(f, table.schema) as w:
        w.write_table(table)


def stream_bytes(batch: pa.RecordBatch) -> bytes:
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, batch.schema) as w:
        w.write_batch(batch)
    return sink.getvalue().to_pybytes()


# --- the check -----------------------------------------------------------------------------------

def by_request(table: pa.Table) -> dict[int, tuple[np.ndarray, np.ndarray, np.ndarray]]:
    """Per request id its (rank, ad_id, score) arrays, in rank order."""
    rid = table.column("request_id").to_numpy()
    rank, ad = table.column("rank").to_numpy(), table.column("ad_id").to_numpy()
    score = table.column("score").to_numpy()
    order = np.lexsort((rank, rid))
    rid, rank, ad, score = rid[order], rank[order], ad[order], score[order]
    cuts = np.flatnonzero(np.diff(rid)) + 1
    return {int(r[0]): (k, a, s) for r, k, a, s in zip(np.split(rid, cuts), np.split(rank, cuts),
                                                       np.split(ad, cuts), np.split(score, cuts)) if len(r)}


def compare(got: pa.Table, want: dict, ids: np.ndarray) -> tuple[int, int]:
    """(mismatches, near ties) of one answer against the reference rows of its requests `ids`
    (a request with no rows in either is equal)."""
    answer = by_request(got)
    extra = set(answer) - {int(i) for i in ids}
    mismatches, near = len(extra), 0
    empty = (np.zeros(0, np.int64),) * 2 + (np.zeros(0, np.float32),)
    for i in ids.tolist():
        (gr, ga, gs), (wr, wa, ws) = answer.get(i, empty), want.get(i, empty)
        if np.array_equal(gr, wr) and np.array_equal(ga, wa):
            continue
        if len(gs) == len(ws) and np.allclose(gs, ws, rtol=0, atol=SCORE_TOL):
            near += 1
        else:
            mismatches += 1
    return mismatches, near


# --- the clients (processes of their own) ---------------------------------------------------------

def client_calls(spec: dict, thread: int, batches: list[pa.RecordBatch], want: dict, out: list) -> None:
    """One client's closed loop (module doc), its calls appended to `out` as (start, end, batch,
    ok, mismatches, near ties)."""
    n = len(batches)
    c, clients = spec["first_client"] + thread, spec["clients"]
    ids = [b.column(0).to_numpy() for b in batches]
    if spec["path"] == "flight":
        import pyarrow.flight as flight

        conn = flight.connect(spec["url"])
        writer, reader = conn.do_exchange(flight.FlightDescriptor.for_command(b"retrieve"))
        writer.begin(batches[0].schema)

        def call(j: int) -> pa.Table:
            writer.write_batch(batches[j])
            return pa.Table.from_batches([reader.read_chunk().data])
    else:
        import httpx

        http = httpx.Client(base_url=spec["url"], timeout=spec["timeout"])
        bodies = [stream_bytes(b) for b in batches]
        http.get("/readyz")  # the connection, opened before the clock starts

        def call(j: int) -> pa.Table:
            r = http.post("/retrieve", content=bodies[j], headers={"content-type": ARROW_STREAM})
            r.raise_for_status()
            return pa.ipc.open_stream(r.content).read_all()
    time.sleep(max(0.0, spec["start"] - time.time()))
    i = 0
    while time.time() < spec["end"]:
        j = (c + i * clients) % n
        t0 = time.time()
        try:
            got = call(j)
        except Exception:
            out.append((t0, time.time(), j, False, 0, 0))
            if spec["path"] == "flight":
                return  # a failed exchange is over
            continue
        t1 = time.time()
        out.append((t0, t1, j, True, *compare(got, want, ids[j])))
        i += 1
    if spec["path"] == "flight":
        writer.done_writing()
        writer.close()


def client_process(spec_path: str) -> int:
    """A client process: spec["threads"] clients (module doc); its calls to spec["out"] as JSON."""
    spec = json.loads(Path(spec_path).read_text())
    with pa.memory_map(spec["pool"]) as f:
        pool = pa.ipc.open_file(f).read_all().combine_chunks()
    with pa.memory_map(spec["reference"]) as f:
        want = by_request(pa.ipc.open_file(f).read_all())
    rows = spec["rows"]
    batches = [b for b in pool.to_batches(max_chunksize=rows)]
    outs: list[list] = [[] for _ in range(spec["threads"])]
    threads = [threading.Thread(target=client_calls, args=(spec, t, batches, want, outs[t]), daemon=True)
               for t in range(spec["threads"])]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    Path(spec["out"]).write_text(json.dumps([c for o in outs for c in o]))
    return 0


def drive(path: str, url: str, args, work: Path, n_batches: int) -> dict:
    """--clients clients of `path` in --procs processes for --seconds: the calls' figures."""
    procs = max(1, min(args.procs, args.clients))
    share = [args.clients // procs + (p < args.clients % procs) for p in range(procs)]
    start = time.time() + LEAD_S
    children, outs = [], []
    for p, threads in enumerate(share):
        spec = {"path": path, "url": url, "pool": str(work / "pool.arrow"), "reference": str(work / "reference.arrow"),
                "rows": args.rows, "threads": threads, "first_client": sum(share[:p]), "clients": args.clients,
                "start": start, "end": start + args.seconds, "timeout": args.timeout,
                "out": str(work / f"{path}-{p}.json")}
        spec_path = work / f"{path}-{p}.spec.json"
        spec_path.write_text(json.dumps(spec))
        outs.append(Path(spec["out"]))
        children.append(subprocess.Popen([sys.executable, __file__, "--client", str(spec_path)]))
    for child in children:
        child.wait(timeout=LEAD_S + args.seconds + args.timeout + 120)
    calls = np.array([c for o in outs if o.exists() for c in json.loads(o.read_text())], dtype=float).reshape(-1, 6)
    ok = calls[:, 3] > 0
    lo, hi = start, start + args.seconds
    done = ok & (calls[:, 1] <= hi + args.timeout)
    return {"path": path, "calls": int(ok.sum()), "failed": int((~ok).sum()),
            "requests_per_s": float(done.sum() * args.rows / max(1e-9, calls[done, 1].max(initial=lo) - lo)),
            **percentiles((calls[ok, 1] - calls[ok, 0]) * 1e3),
            "mismatches": int(calls[:, 4].sum()), "near_ties": int(calls[:, 5].sum()),
            "clients_exited": [c.returncode for c in children]}


# --- the run --------------------------------------------------------------------------------------

def direct(root: Path, catalog: Path, args, work: Path) -> dict:
    """The pool (written to work/pool.arrow), its reference answers (work/reference.arrow) and the
    Retriever's own requests/s on its batches from 2 threads (module doc, 1)."""
    import torch

    import runtime
    from bench.bench_stream import catalog_embeddings
    from sidindex.sample import sample_requests

    index = runtime.load(root, args.device)
    emb = catalog_embeddings(catalog)
    pool = sample_requests(args.pool, index.spec, dim=emb.shape[1], seed=args.seed, catalog_embedding=emb)
    pool = pool.set_column(0, "request_id", pa.array(np.arange(args.pool, dtype=np.int64)))
    write_arrow(work / "pool.arrow", pool)
    retriever = runtime.Retriever(index, mode=args.mode, beams=args.beams, top_k=args.top_k,
                                  batch_sizes=(args.max_batch,))
    batches = pool.to_batches(max_chunksize=args.rows)
    reference = pa.concat_tables([retriever.retrieve(b) for b in batches])
    write_arrow(work / "reference.arrow", reference)
    done, end = [0, 0], time.perf_counter() + args.seconds

    def loop(t: int) -> None:
        i = t
        while time.perf_counter() < end:
            retriever.retrieve(batches[i % len(batches)])
            done[t] += 1
            i += 2

    t0 = time.perf_counter()
    threads = [threading.Thread(target=loop, args=(t,)) for t in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    seconds = time.perf_counter() - t0
    device = torch.cuda.get_device_name(index.device) if index.device.type == "cuda" else "cpu"
    retriever.close()
    return {"path": "direct", "calls": sum(done), "requests_per_s": sum(done) * args.rows / seconds,
            "device": device, "reference_rows": reference.num_rows}


def free_device() -> None:
    import gc

    import torch

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def run(args) -> dict:
    from bench.bench_load import Server, free_port, working_root
    from bench.bench_stream import catalog_root

    cache = args.cache or Path(tempfile.mkdtemp(prefix="bench_batched_"))
    res: dict = {"config": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}}
    work = None
    try:
        log(f"{args.ads:,} ads ({args.profile}): catalog and ROOT ...")
        size = catalog_root(args.ads, args.dim, cache, args.profile)
        res["catalog"] = {k: size[k] for k in ("ads", "dim", "profile", "sids", "cached")}
        work = Path(tempfile.mkdtemp(prefix="bench_batched_work_", dir=cache))
        root = working_root(Path(size["root"]), work)
        log(f"direct: the Retriever on {args.device}, {args.pool // args.rows} batches of {args.rows} ...")
        res["direct"] = direct(root, Path(size["catalog"]), args, work)
        free_device()  # the direct Retriever's graphs and index, before the server takes the device
        port = free_port()
        options = ("--flight-port", str(port)) if "flight" in args.paths else ()
        log(f"sidindex serve {root} {' '.join(options)}" + (f" --workers {args.workers}" if args.workers else ""))
        server = Server(root, args, work / "serve.log", args.workers, options=options)
        try:
            res["server_ready_s"] = server.wait_ready(args.ready_timeout)
            res["paths"] = []
            for path in args.paths:
                log(f"{path}: {args.clients} clients, {args.rows} requests a call, {args.seconds:.0f} s ...")
                url = f"grpc://127.0.0.1:{port}" if path == "flight" else server.url
                res["paths"].append(drive(path, url, args, work, args.pool // args.rows))
        finally:
            res["server_exit"] = server.stop()
            if res["server_exit"] != 0:
                log(server.tail())
        write_json(args.json, res)
    finally:
        if args.cache is None:
            shutil.rmtree(cache, ignore_errors=True)
        elif work is not None:
            shutil.rmtree(work, ignore_errors=True)
    return res


def report(res: dict) -> bool:
    """The table and verdicts; False when an answer mismatched, a call failed or the server did
    not exit 0."""
    d = res["direct"]
    cfg = res["config"]
    print(f"\n{d['device']}: {res['catalog']['ads']:,} ads ({res['catalog']['profile']}), {cfg['rows']} requests a "
          f"call, {cfg['clients']} clients, mode {cfg['mode']}, beams {cfg['beams']}, top_k {cfg['top_k']}, "
          f"--max-batch {cfg['max_batch']}, --workers {cfg['workers'] or 'default'}")
    print("\n| path | calls | requests/s | / direct | p50 ms a call | p99 ms a call | failed | mismatches | near ties |"
          "\n|---|---|---|---|---|---|---|---|---|")
    print(f"| direct (Retriever, 2 threads) | {d['calls']:,} | {d['requests_per_s']:,.0f} | 1.00 | - | - | - | - | - |")
    good = res.get("server_exit") == 0
    for p in res.get("paths", []):
        ratio = p["requests_per_s"] / d["requests_per_s"]
        pct = [f"{p[k]:.2f}" if p[k] is not None else "-" for k in ("p50_ms", "p99_ms")]
        print(f"| {p['path']} | {p['calls']:,} | {p['requests_per_s']:,.0f} | {ratio:.2f} | {pct[0]} | {pct[1]} | "
              f"{p['failed']} | {p['mismatches']} | {p['near_ties']} |")
        good &= p["failed"] == 0 and p["mismatches"] == 0 and p["calls"] > 0
    print()
    print(verdict(res.get("server_exit") == 0, f"the server exited {res.get('server_exit')} on SIGTERM"))
    for p in res.get("paths", []):
        print(verdict(p["failed"] == 0 and p["mismatches"] == 0 and p["calls"] > 0,
                      f"{p['path']}: {p['calls']:,} calls, {p['failed']} failed, {p['mismatches']} mismatched"))
    return bool(good)


def main(argv: list[str] | None = None) -> int:
    if argv is None and len(sys.argv) == 3 and sys.argv[1] == "--client":  # a client process: no torch
        return client_process(sys.argv[2])
    from sidindex.sample import PROFILES

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--ads", type=int, default=20_000, help="catalog size (about 2 SIDs per ad)")
    ap.add_argument("--dim", type=int, default=32, help="embedding dimensions of the generated catalog")
    ap.add_argument("--profile", choices=PROFILES, default="default", help="the catalog's profile")
    ap.add_argument("--device", default=None, help="the server's device (default: cuda when there is one)")
    ap.add_argument("--mode", default="cd+gtm")
    ap.add_argument("--beams", help="beam sizes (default 1,512,1024,1024 on CUDA, 1,16,32,32 on the CPU)")
    ap.add_argument("--top-k", type=int, default=100, help="the server's --top-k (0: every eligible ad)")
    ap.add_argument("--rows", type=int, default=64, help="requests a call")
    ap.add_argument("--pool", type=int, default=4096, help="distinct requests, cut into batches of --rows")
    ap.add_argument("--clients", type=int, default=8, help="concurrent clients, closed loop")
    ap.add_argument("--procs", type=int, default=4, help="client processes (at most --clients)")
    ap.add_argument("--seconds", type=float, default=10.0, help="seconds of calls per path")
    ap.add_argument("--paths", type=lambda s: s.split(","), default=list(PATHS),
                    help="comma-separated, of " + ", ".join(PATHS))
    ap.add_argument("--max-batch", type=int, default=64, help="the server's --max-batch, and the direct Retriever's "
                                                              "batch size")
    ap.add_argument("--max-wait-us", type=int, default=500, help="the server's --max-wait-us")
    ap.add_argument("--max-queue", type=int, default=4096, help="the server's --max-queue")
    ap.add_argument("--poll-seconds", type=float, default=1.0, help="the server's --poll-seconds")
    ap.add_argument("--workers", type=int, help="the server's --workers (default: its own)")
    ap.add_argument("--threads", type=int, help="the server's torch and numba threads (default: 1 on the CPU)")
    ap.add_argument("--timeout", type=float, default=60.0, help="seconds a call may take before it fails")
    ap.add_argument("--ready-timeout", type=float, default=1800.0, help="seconds the server may take to be warm")
    ap.add_argument("--seed", type=int, default=7)
    ap.add_argument("--cache", type=Path, help="keep the catalog and its ROOT here, and reuse them")
    ap.add_argument("--json", type=Path, help="write every figure as JSON here")
    args = ap.parse_args(argv)
    if [p for p in args.paths if p not in PATHS] or not args.paths:
        ap.error(f"--paths {','.join(args.paths)}: choose from {', '.join(PATHS)}")
    if min(args.rows, args.clients, args.procs, args.max_batch) < 1 or args.pool < args.rows or args.top_k < 0 \
            or args.seconds <= 0:
        ap.error("--rows, --clients, --procs and --max-batch must be at least 1, --pool at least --rows, --top-k at "
                 "least 0 and --seconds positive")
    args.top_k = args.top_k or None
    args.pool -= args.pool % args.rows  # whole batches
    import torch

    args.device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        print("no CUDA device: run with --device cpu (the default without one)", file=sys.stderr)
        return 2
    args.beams = args.beams or ("1,512,1024,1024" if args.device.startswith("cuda") else "1,16,32,32")
    if args.threads is None and args.device == "cpu":
        args.threads = 1
    return 0 if report(run(args)) else 1


if __name__ == "__main__":
    sys.exit(main())
