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
Every answer is checked in its client against the reference of its batch, request by request as
`bench_load` checks (`load_check.difference`): ad_id and rank lists equal, scores within 1e-5;
rows of a request not sent differ. A difference is a mismatch; those whose scores agree rank by
rank (a GPU's float sums depend on the batch a request shares) are counted apart as near ties.
A call that fails (a transport or server error, or an answer that is not a result table) is
counted, and its client's first errors kept. requests/s counts the calls that ended within the
--seconds window. The run fails (exit 1) on a mismatch, a failed call, a client that made no
call or did not exit 0, an empty reference, or a server that did not exit 0 on SIGTERM.
Output: a table (path, calls, requests/s and the ratio to direct, per-call p50 / p99 ms, failed,
mismatches, near ties), progress on stderr, every figure with --json PATH.
"""

from __future__ import annotations

import argparse
import gc
import json
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make `bench` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np
import pyarrow as pa

from bench.bench_load import log
from bench.load_check import difference
from bench.load_report import percentiles
from bench.report import verdict, write_json

# torch and runtime are imported where they are used: a client process imports numpy, pyarrow and httpx
PATHS = ("flight", "http")
ARROW_STREAM = "application/vnd.apache.arrow.stream"  # runtime.server.http's
LEAD_S = 3.0  # from the client processes' start to the common first call: their imports and connections


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
    """Per request id its (ad_id, rank, score) arrays, in rank order."""
    rid = table.column("request_id").to_numpy()
    rank, ad = table.column("rank").to_numpy(), table.column("ad_id").to_numpy()
    score = table.column("score").to_numpy().astype(np.float64)
    order = np.lexsort((rank, rid))
    rid, rank, ad, score = rid[order], rank[order], ad[order], score[order]
    cuts = np.flatnonzero(np.diff(rid)) + 1
    return {int(r[0]): (a, k, s) for r, a, k, s in zip(np.split(rid, cuts), np.split(ad, cuts),
                                                       np.split(rank, cuts), np.split(score, cuts)) if len(r)}


def compare(got: pa.Table, want: dict, ids: np.ndarray) -> tuple[int, int, str | None]:
    """(mismatches, near ties among them, the first difference in words) of one answer against
    the reference rows of its requests `ids`, request by request as `bench_load` checks
    (`load_check.difference`: ad_id and rank lists equal and scores within 1e-5; a near tie is
    still a mismatch); a request with no rows in either is equal, rows of a request not sent
    differ."""
    answer = by_request(got)
    extra = sorted(set(answer) - {int(i) for i in ids})
    mismatches, near = len(extra), 0
    first = f"rows of request {extra[0]}, which the call did not send" if extra else None
    empty = (np.zeros(0, np.int64),) * 2 + (np.zeros(0, np.float64),)
    for i in ids.tolist():
        why, tie = difference(*answer.get(i, empty), *want.get(i, empty))
        if why is not None:
            mismatches, near = mismatches + 1, near + tie
            first = first or f"request {i}: {why}"
    return mismatches, near, first


# --- the clients (processes of their own) ---------------------------------------------------------

def client_calls(spec: dict, thread: int, batches: list[pa.RecordBatch], want: dict, out: list,
                 errors: list) -> None:
    """One client's closed loop (module doc), its calls appended to `out` as (client, start, end,
    batch, ok, mismatches, near ties), the first few failures and differences to `errors`. A
    client that cannot connect, or a Flight exchange that fails, records one failed call and
    stops; every call, the exchange included, ends by --timeout past the run's end."""
    n = len(batches)
    c, clients = spec["first_client"] + thread, spec["clients"]
    ids = [b.column(0).to_numpy() for b in batches]

    def failed(t0: float, e: object) -> None:
        out.append((c, t0, time.time(), -1, 0, 0, 0))
        if len(errors) < 5:
            errors.append(f"client {c}: {e}".splitlines()[0])

    try:
        if spec["path"] == "flight":
            import pyarrow.flight as flight

            conn = flight.connect(spec["url"])
            options = flight.FlightCallOptions(timeout=spec["end"] + spec["timeout"] - time.time())
            writer, reader = conn.do_exchange(flight.FlightDescriptor.for_command(b"retrieve"), options=options)
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
    except Exception as e:
        failed(time.time(), f"{type(e).__name__}: {e}")
        return
    time.sleep(max(0.0, spec["start"] - time.time()))
    i = 0
    while time.time() < spec["end"]:
        j = (c + i * clients) % n
        t0 = time.time()
        try:
            got = call(j)
            t1 = time.time()
            bad, near, why = compare(got, want, ids[j])
        except Exception as e:  # a transport or server error, or an answer that is not a result table
            failed(t0, f"{type(e).__name__}: {e}")
            if spec["path"] == "flight":
                return  # a failed exchange is over
            time.sleep(0.05)
            continue
        out.append((c, t0, t1, j, 1, bad, near))
        if why is not None and len(errors) < 5:
            errors.append(f"client {c}, batch {j}: {why}")
        i += 1
    if spec["path"] == "flight":
        writer.done_writing()
        writer.close()


def client_process(spec_path: str) -> int:
    """A client process: spec["threads"] clients (module doc); their calls and first errors to
    spec["out"] as JSON, written whatever happens to them."""
    spec = json.loads(Path(spec_path).read_text())
    outs: list[list] = [[] for _ in range(spec["threads"])]
    errors: list[str] = []
    try:
        with pa.memory_map(spec["pool"]) as f:
            pool = pa.ipc.open_file(f).read_all().combine_chunks()
        with pa.memory_map(spec["reference"]) as f:
            want = by_request(pa.ipc.open_file(f).read_all())
        batches = pool.to_batches(max_chunksize=spec["rows"])
        threads = [threading.Thread(target=client_calls, args=(spec, t, batches, want, outs[t], errors), daemon=True)
                   for t in range(spec["threads"])]
        for t in threads:
            t.start()
        for t in threads:  # every call ends by --timeout past the run's end (module doc)
            t.join(timeout=max(0.0, spec["end"] + spec["timeout"] + 5 - time.time()))
        errors += [f"client {spec['first_client'] + k}: still calling at the deadline"
                   for k, t in enumerate(threads) if t.is_alive()]
    finally:
        Path(spec["out"]).write_text(json.dumps({"calls": [c for o in outs for c in o], "errors": errors}))
    return 0


def drive(path: str, url: str, args, work: Path) -> dict:
    """--clients clients of `path` in --procs processes for --seconds: the calls' figures.
    requests/s counts the calls that ended within the --seconds window."""
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
    exited: list[int | None] = []
    for child in children:
        try:
            exited.append(child.wait(timeout=max(1.0, start + args.seconds + args.timeout + 60 - time.time())))
        except subprocess.TimeoutExpired:
            child.kill()
            child.wait()
            exited.append(None)
    calls, errors = [], []
    for o in outs:
        got = json.loads(o.read_text()) if o.exists() else {"calls": [], "errors": [f"{o.name}: no output"]}
        calls += got["calls"]
        errors += got["errors"]
    a = np.array(calls, dtype=float).reshape(-1, 7)
    ok = a[:, 4] > 0
    within = ok & (a[:, 2] <= start + args.seconds)
    return {"path": path, "calls": int(ok.sum()), "failed": int((~ok).sum()),
            "requests_per_s": float(within.sum() * args.rows / args.seconds),
            **percentiles((a[ok, 2] - a[ok, 1]) * 1e3),
            "mismatches": int(a[:, 5].sum()), "near_ties": int(a[:, 6].sum()),
            "clients_calling": len(np.unique(a[ok, 0])), "clients_exited": exited, "errors": errors[:5]}


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


def run(args) -> dict:
    import torch

    from bench.bench_load import Server, run_dirs, working_root
    from bench.bench_stream import catalog_root, free

    res: dict = {"config": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}}
    with run_dirs(args.cache, "bench_batched") as (cache, work):
        log(f"{args.ads:,} ads ({args.profile}): catalog and ROOT ...")
        size = catalog_root(args.ads, args.dim, cache, args.profile)
        res["catalog"] = {k: size[k] for k in ("ads", "dim", "profile", "sids", "cached")}
        root = working_root(Path(size["root"]), work)
        log(f"direct: the Retriever on {args.device}, {args.pool // args.rows} batches of {args.rows} ...")
        res["direct"] = direct(root, Path(size["catalog"]), args, work)
        gc.collect()  # the direct Retriever's graphs and index (in cycles), before the server takes the device
        free(torch.device(args.device))
        # the Flight port held bound while Server picks the HTTP one, so the two differ
        with socket.socket() as held:
            held.bind(("127.0.0.1", 0))
            port = held.getsockname()[1]
            options = ("--flight-port", str(port)) if "flight" in args.paths else ()
            log(f"sidindex serve {root} {' '.join(options)}" + (f" --workers {args.workers}" if args.workers else ""))
            server = Server(root, args, work / "serve.log", args.workers, options=options)
        try:
            res["server_ready_s"] = server.wait_ready(args.ready_timeout)
            res["paths"] = []
            for path in args.paths:
                log(f"{path}: {args.clients} clients, {args.rows} requests a call, {args.seconds:.0f} s ...")
                url = f"grpc://127.0.0.1:{port}" if path == "flight" else server.url
                res["paths"].append(drive(path, url, args, work))
        finally:
            res["server_exit"] = server.stop()
            if res["server_exit"] != 0:
                log(server.tail())
        write_json(args.json, res)
    return res


def path_verdict(p: dict, clients: int) -> tuple[bool, str]:
    """Whether a path's run holds what a user relies on, and in words: every client called and
    exited 0, no call failed, no answer differed."""
    good = (p["calls"] > 0 and p["failed"] == 0 and p["mismatches"] == 0 and p["clients_calling"] == clients
            and all(e == 0 for e in p["clients_exited"]) and not p["errors"])
    ties = f" ({p['near_ties']} near ties)" if p["near_ties"] else ""
    return good, (f"{p['path']}: {p['calls']:,} calls from {p['clients_calling']} of {clients} clients, "
                  f"{p['failed']} failed, {p['mismatches']} differ from the direct Retriever's{ties}")


def report(res: dict) -> bool:
    """The table and verdicts; False when an answer differed, a call or a client failed, the
    reference held no rows or the server did not exit 0."""
    d = res["direct"]
    cfg = res["config"]
    print(f"\n{d['device']}: {res['catalog']['ads']:,} ads ({res['catalog']['profile']}), {cfg['rows']} requests a "
          f"call, {cfg['clients']} clients, mode {cfg['mode']}, beams {cfg['beams']}, top_k {cfg['top_k']}, "
          f"--max-batch {cfg['max_batch']}, --workers {cfg['workers'] or 'default'}")
    print("\n| path | calls | requests/s | / direct | p50 ms a call | p99 ms a call | failed | mismatches | near ties |"
          "\n|---|---|---|---|---|---|---|---|---|")
    print(f"| direct (Retriever, 2 threads) | {d['calls']:,} | {d['requests_per_s']:,.0f} | 1.00 | - | - | - | - | - |")
    for p in res.get("paths", []):
        ratio = p["requests_per_s"] / d["requests_per_s"]
        pct = [f"{p[k]:.2f}" if p[k] is not None else "-" for k in ("p50_ms", "p99_ms")]
        print(f"| {p['path']} | {p['calls']:,} | {p['requests_per_s']:,.0f} | {ratio:.2f} | {pct[0]} | {pct[1]} | "
              f"{p['failed']} | {p['mismatches']} | {p['near_ties']} |")
    print()
    checks = [(res.get("server_exit") == 0, f"the server exited {res.get('server_exit')} on SIGTERM"),
              (d["reference_rows"] > 0, f"the reference answers hold {d['reference_rows']:,} rows")]
    checks += [path_verdict(p, cfg["clients"]) for p in res.get("paths", [])]
    for ok, text in checks:
        print(verdict(ok, text))
    for p in res.get("paths", []):
        for e in p["errors"]:
            print(f"  {p['path']}: {e}")
    return all(ok for ok, _ in checks) and len(res.get("paths", [])) == len(cfg["paths"])


def main(argv: list[str] | None = None) -> int:
    if argv is None and len(sys.argv) == 3 and sys.argv[1] == "--client":  # a client process: no torch
        return client_process(sys.argv[2])
    from bench.bench_load import resolve_server_arguments, server_arguments

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    server_arguments(ap, max_batch=64, max_queue=4096, poll_seconds=1.0)
    ap.add_argument("--rows", type=int, default=64, help="requests a call")
    ap.add_argument("--pool", type=int, default=4096, help="distinct requests, cut into batches of --rows")
    ap.add_argument("--clients", type=int, default=8, help="concurrent clients, closed loop")
    ap.add_argument("--procs", type=int, default=4, help="client processes (at most --clients)")
    ap.add_argument("--seconds", type=float, default=10.0, help="seconds of calls per path")
    ap.add_argument("--paths", type=lambda s: s.split(","), default=list(PATHS),
                    help="comma-separated, of " + ", ".join(PATHS))
    ap.add_argument("--workers", type=int, help="the server's --workers (default: its own)")
    ap.add_argument("--timeout", type=float, default=60.0, help="seconds a call may take before it fails")
    args = ap.parse_args(argv)
    if [p for p in args.paths if p not in PATHS] or not args.paths:
        ap.error(f"--paths {','.join(args.paths)}: choose from {', '.join(PATHS)}")
    if min(args.rows, args.clients, args.procs, args.max_batch) < 1 or args.pool < args.rows or args.seconds <= 0:
        ap.error("--rows, --clients, --procs and --max-batch must be at least 1, --pool at least --rows and --seconds "
                 "positive")
    args.pool -= args.pool % args.rows  # whole batches
    why = resolve_server_arguments(args)  # the direct Retriever's batch size is the server's --max-batch
    if why is not None:
        print(why, file=sys.stderr)
        return 2
    return 0 if report(run(args)) else 1


if __name__ == "__main__":
    sys.exit(main())
