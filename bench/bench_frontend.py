"""The HTTP front-ends of `sidindex serve --workers N` alone: wrk posting one JSON request per call
to N front-end processes over an engine whose search is a stand-in (`bench_engine.stand_in`: a
device's batch of --stand-in-ms without the GIL, then --top-k rows a request), so that what is
measured is the front-ends' own work on any machine: the body parsed and validated, the link,
the JSON answer written. Per checkout: wrk's requests/s and latency, and the CPU per request of
the front-end processes and of the engine process.

    python bench/bench_frontend.py                                      # data_samples' ROOT, 1 front-end
    python bench/bench_frontend.py --baseline .baseline/REV --runs 3    # against another checkout
    python bench/bench_frontend.py --ads 1000000 --workers 14 --connections 128 --cache /data/bench

--baseline DIR serves the same from another checkout's packages (`git archive REV runtime sidindex
sidindex_cli schemas pipelines | tar x -C DIR`), first on every process's path, the two
alternating --runs times on one machine; each one's run of the median front-end CPU a request is
shown, and their ratio. The bodies are `bench_load.request_pool`'s (one request each, distinct);
wrk is `bench_load`'s. On a 2-core machine wrk, the engine and one front-end share the cores: the
front-ends' CPU per request is the figure to compare, requests/s follows it.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
if os.environ.get("SIDINDEX_BENCH_TREE"):  # a server measuring another checkout imports its packages
    sys.path.insert(0, os.environ["SIDINDEX_BENCH_TREE"])

from bench.bench_engine import REPO, sample_root, stand_in  # noqa: E402
from bench.report import checkout  # noqa: E402


def server(args) -> None:
    """The server process: the engine with a stand-in search, and --workers front-ends, until SIGTERM."""
    import runtime
    from runtime.server.engine import Engine
    from runtime.server.frontend import serve_processes

    watcher = runtime.SnapshotWatcher(args.root, "cpu")
    retriever = runtime.Retriever(watcher, beams=(1, 2, 2, 2), top_k=args.top_k)
    stand_in(retriever, args.stand_in_ms, args.top_k)
    engine = Engine(watcher, retriever, max_batch=args.max_batch, poll_seconds=60.0)
    serve_processes(engine, "127.0.0.1", args.port, args.workers, {}, log=lambda line: print(line, flush=True))


def one_run(args, root: Path, bodies: list[bytes], code: Path | None, work: Path) -> dict:
    """A server of `code`'s packages (None: this checkout's) under wrk: wrk's figures, and the
    CPU per request of its front-ends and of its engine over wrk's run."""
    from bench.bench_load import free_port
    from bench.load_wrk import run_wrk
    from bench.profile_server import processes_cpu

    tree = str((code or REPO).resolve())
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([tree, os.environ.get("PYTHONPATH", "")]),
               SIDINDEX_BENCH_TREE=tree)
    env.pop("TRITON_INTERPRET", None)
    port = free_port()
    cmd = [sys.executable, str(Path(__file__).resolve()), "--role", "server", "--root", str(root), "--port", str(port),
           "--workers", str(args.workers), "--top-k", str(args.top_k), "--stand-in-ms", str(args.stand_in_ms),
           "--max-batch", str(args.max_batch)]
    # its own directory: `python -m` puts the working directory first on a front-end's path
    proc = subprocess.Popen(cmd, env=env, cwd=work, stdout=subprocess.DEVNULL)
    try:
        ready(proc, port, args.workers)
        run_wrk(args.wrk, f"http://127.0.0.1:{port}/retrieve", bodies, connections=args.connections,
                threads=args.wrk_threads, seconds=1, work=work)  # warm: every front-end's first answers
        before = processes_cpu(proc.pid)  # the engine's ("engine") and each front-end's
        figures = run_wrk(args.wrk, f"http://127.0.0.1:{port}/retrieve", bodies, connections=args.connections,
                          threads=args.wrk_threads, seconds=args.seconds, work=work)
        used = {p: c - before[p] for p, c in processes_cpu(proc.pid).items() if p in before}
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    n = max(figures["requests"] or 0, 1)
    return figures | {"frontend_cpu_ms": sum(c for p, c in used.items() if p != "engine") / n * 1e3,
                      "engine_cpu_ms": used["engine"] / n * 1e3, "code": tree}


def ready(proc: subprocess.Popen, port: int, workers: int, timeout: float = 300.0) -> None:
    """Wait until the server answers /readyz with its `workers` front-ends started (RuntimeError if
    it exits first or takes `timeout` seconds)."""
    from bench.profile_server import front_ends

    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited {proc.returncode} before it was ready")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/readyz", timeout=5) as r:
                if r.status == 200 and len(front_ends(proc.pid)) == workers:
                    return
        except OSError:
            pass
        time.sleep(0.2)
    raise RuntimeError(f"the server was not ready in {timeout:.0f} s")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--ads", type=int, default=None, help="a generated catalog of this many ads (default: "
                    "data_samples)")
    ap.add_argument("--dim", type=int, default=32)
    ap.add_argument("--workers", type=int, default=1, help="front-end processes")
    ap.add_argument("--connections", type=int, default=16, help="wrk's connections (closed loop)")
    ap.add_argument("--wrk-threads", type=int, default=1)
    ap.add_argument("--seconds", type=float, default=8.0, help="wrk's run, per server")
    ap.add_argument("--top-k", type=int, default=100, help="rows of every answer")
    ap.add_argument("--stand-in-ms", type=float, default=1.0, help="the stand-in device's batch, without the GIL")
    ap.add_argument("--max-batch", type=int, default=64)
    ap.add_argument("--pool", type=int, default=256, help="distinct request bodies")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--runs", type=int, default=1)
    ap.add_argument("--baseline", type=checkout, default=None, help="another checkout's packages, alternating")
    ap.add_argument("--wrk", default=None, help="the wrk to run (default: wrk on PATH)")
    ap.add_argument("--cache", type=Path, default=None)
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--role", choices=["server"], default=None, help=argparse.SUPPRESS)
    ap.add_argument("--root", type=Path, default=None, help=argparse.SUPPRESS)
    ap.add_argument("--port", type=int, default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.role == "server":
        server(args)
        return 0
    from rich.console import Console
    from rich.table import Table

    import runtime
    from bench.bench_load import request_pool
    from bench.load_wrk import wrk_path
    from bench.report import against, host_speed, write_json

    args.wrk = wrk_path(args.wrk)
    if args.wrk is None:
        print("bench_frontend: wrk not found (apt-get download wrk libluajit-5.1-2; dpkg -x; or --wrk)")
        return 2
    host_ms = [host_speed()]  # before the runs, and after them: the host's own speed (it varies with its load)
    cache = args.cache or Path(tempfile.mkdtemp(prefix="bench_frontend_"))
    cache.mkdir(parents=True, exist_ok=True)
    if args.ads is None:
        root, catalog = sample_root(cache), REPO / "data_samples" / "catalog.parquet"
    else:
        from bench.bench_stream import catalog_root

        size = catalog_root(args.ads, args.dim, cache)
        root, catalog = Path(size["root"]), Path(size["catalog"])
    bodies = request_pool(runtime.load(root, "cpu", verify=False), catalog, args.pool, args.seed)
    variants = [("this checkout", None)] + ([] if args.baseline is None else [(str(args.baseline), args.baseline)])
    results: dict[str, list[dict]] = {label: [] for label, _ in variants}
    with tempfile.TemporaryDirectory(prefix="bench_frontend_work_") as work:
        for _ in range(args.runs):
            for label, code in variants:
                results[label].append(one_run(args, root, bodies, code, Path(work)))
    host_ms.append(host_speed())
    t = Table(title=f"the front-ends alone under wrk ({args.workers} front-end(s), {args.connections} connections, "
                    f"{args.top_k} rows an answer, a stand-in engine of {args.stand_in_ms:g} ms a batch); the run of "
                    f"the median front-end CPU; host speed {host_ms[0]:.1f} / {host_ms[1]:.1f} ms before / after")
    for c in ("code", "req/s", "p50 ms", "p99 ms", "non-2xx", "front-ends' CPU ms/req", "engine CPU ms/req",
              "runs (req/s)"):
        t.add_column(c, justify="left" if c == "code" else "right")
    medians = {}
    for label, runs in results.items():
        m = medians[label] = sorted(runs, key=lambda r: r["frontend_cpu_ms"])[len(runs) // 2]
        t.add_row(label, f"{m['rps']:,.0f}", f"{m['p50_ms']:.2f}", f"{m['p99_ms']:.2f}", f"{m['non_2xx']:,}",
                  f"{m['frontend_cpu_ms']:.3f}", f"{m['engine_cpu_ms']:.3f}",
                  ", ".join(f"{r['rps']:,.0f}" for r in runs))
    console = Console(width=200)
    console.print(t)
    if args.baseline is not None:
        console.print(against(str(args.baseline), medians["this checkout"], medians[str(args.baseline)],
                              {"rps": "requests/s", "frontend_cpu_ms": "front-ends' CPU per request"}))
    write_json(args.json, {"config": {k: str(v) for k, v in vars(args).items()}, "host_speed_ms": host_ms,
                           "results": results})
    return 0


if __name__ == "__main__":
    sys.exit(main())
