"""The engine process of `sidindex serve --workers N` through its link alone: requests/s, latency
and the CPU per request of the thread every request passes through, with no HTTP in front.

    python bench/bench_engine.py                                  # the CPU: data_samples' ROOT, beams 1,2,2,2
    python bench/bench_engine.py --baseline .baseline             # against another checkout, alternating
    python bench/bench_engine.py --device cuda --ads 1000000 --beams 1,512,1024,1024 --cache /data/bench
    python bench/bench_engine.py --stand-in-ms 2 --window 128 --requests 10000   # the engine's own ceiling
    python bench/bench_engine.py --device cuda --ads 1000000 --beams 1,512,1024,1024 --clients 4 --window 128

The engine (`runtime.server.engine.Engine` and its `runtime.server.link.EngineLink`, as
`serve_processes` runs them) serves in a process of its own; --clients client processes validate
requests as a front-end does and send them through the front-end's own `EngineClient`, keeping
--window requests outstanding among them, --requests in all (one client near fully busy bounds
the figure: "client busy"). The client gathers the requests of one turn of its loop into a
message as a front-end does; --message-rows 1 sends each alone, as most of an HTTP front-end's
requests arrive under load. Every
request passes through the link (a thread of its own; in older checkouts, the engine's event
loop), so its CPU per request (that thread's CPU time over the run) bounds what one engine
answers; the engine process's CPU per request is beside it, and each thread's in the JSON.
--stand-in-ms MS replaces the search by a stand-in for a device's batch (MS without the GIL, two
at a time, top_k rows a request), so that a machine without a GPU measures what the engine's own
work allows; on a 2-core machine the client process takes one core, and its figure bounds.
--switch-intervals S,... runs this checkout's engine again with each GIL switch interval (where
a thread waiting for the GIL is the cost, a shorter one shows it).
--baseline DIR runs the same with another checkout's packages first on sys.path (`git archive
REV runtime sidindex sidindex_cli schemas pipelines | tar x -C DIR`), engine and client both, the
two alternating --runs times on one machine. The ROOT: `data_samples/` built once under --cache,
or with --ads, `bench_stream.catalog_root`'s.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
if os.environ.get("SIDINDEX_BENCH_TREE"):  # a child measuring another checkout imports its packages
    sys.path.insert(0, os.environ["SIDINDEX_BENCH_TREE"])

from bench.report import checkout  # noqa: E402

REPO = Path(__file__).resolve().parents[1]


def engine(args) -> None:
    """The engine process: warm, serve the link until SIGINT, then print the link's and the
    process's CPU per request."""
    import runtime
    from runtime.server.engine import Engine
    from runtime.server.http import SWITCH_INTERVAL_S
    from runtime.server.link import EngineLink

    # as `sidindex serve` runs, or the one given
    sys.setswitchinterval(SWITCH_INTERVAL_S if args.switch_interval is None else args.switch_interval)
    watcher = runtime.SnapshotWatcher(args.root, args.device)
    # `runtime.server.batcher.batch_sizes`, written out: a --baseline checkout may predate it
    sizes = tuple(sorted({b for b in (1, 2, 4, 8, 16, 32, 64) if b < args.max_batch} | {args.max_batch}))
    retriever = runtime.Retriever(watcher, beams=args.beams, batch_sizes=sizes, top_k=args.top_k)
    if args.stand_in_ms is not None:
        stand_in(retriever, args.stand_in_ms, args.top_k)
    eng = Engine(watcher, retriever, max_batch=args.max_batch, poll_seconds=60.0)
    link = EngineLink(eng, args.engine)
    gc.freeze()  # as `sidindex serve` does once warm

    def state() -> dict:  # what the figures are differences of
        c = retriever.counters
        return {"process": time.process_time(), "threads": threads_cpu(), "requests": c.requests,
                "batches": getattr(eng.batcher, "timed", c.batches),  # a --baseline checkout may not count them
                "retriever_batches": c.batches, "stages": dict(getattr(eng.batcher, "seconds", {}))}

    mark: dict = {}

    def on_mark(*_) -> None:  # the clients start now (`clients`): what came before is their warm-up
        mark.update(state())
        print("marked", flush=True)

    signal.signal(signal.SIGUSR1, on_mark)
    if hasattr(link, "start"):  # the link on a thread of its own
        asyncio.run(eng.start())
        link.start()
        mark.update(state())
        print("ready", flush=True)
        try:
            while True:
                signal.pause()
        except KeyboardInterrupt:
            pass
        end = state()
        link.close()
        link_thread = "sidindex-link"
    else:  # a checkout whose link is a task of the engine's event loop (`run`), on the main thread
        async def serve() -> None:
            await eng.start()
            mark.update(state())
            print("ready", flush=True)
            await link.run()

        try:
            asyncio.run(serve())
        except KeyboardInterrupt:
            pass
        end = state()
        link_thread = "MainThread"
    n = max(end["requests"] - mark["requests"], 1)
    batches = max(end["batches"] - mark["batches"], 1)
    threads = {k: v - mark["threads"].get(k, 0.0) for k, v in end["threads"].items()}
    print(json.dumps({"code": str(Path(runtime.__file__).resolve().parents[1]),  # the checkout that ran
                      "link_cpu_us": threads.get(link_thread, 0.0) / n * 1e6,
                      "process_cpu_us": (end["process"] - mark["process"]) / n * 1e6,
                      "rows_per_batch": n / max(end["retriever_batches"] - mark["retriever_batches"], 1),
                      "threads_cpu_us": {k: v / n * 1e6 for k, v in threads.items()},
                      "stage_ms": {k: (v - mark["stages"].get(k, 0.0)) / batches * 1e3
                                   for k, v in end["stages"].items()}}),
          flush=True)
    eng.close(10.0)


def stand_in(retriever, ms: float, top_k: int) -> None:
    """`retriever.run` replaced by a stand-in for a device's batch: `ms` without the GIL, then
    `top_k` rows a request (counted in its counters), with two batches at a time as on a GPU.
    What is left is the engine's own work: the link, the batcher, the answers."""
    import numpy as np

    from runtime.result import Retrieved

    def run(requests, index=None, **_):
        time.sleep(ms / 1e3)
        n = len(requests)
        ads = np.arange(n * top_k, dtype=np.int64)
        per = np.full(n, top_k, dtype=np.int64)
        retriever.counters.requests += n
        retriever.counters.batches += 1
        return Retrieved(request=np.repeat(np.arange(n, dtype=np.int64), top_k),
                         rank=np.tile(np.arange(1, top_k + 1, dtype=np.int64), n), ad_row=ads, ad_id=ads,
                         sid=np.zeros((n * top_k, 4), dtype=np.int64), score=np.ones(n * top_k, dtype=np.float32),
                         sids=per, ads_generated=per, ads_eligible=per), {"encode": 0.0, "search_post": ms / 1e3}

    retriever.run = run
    type(retriever).in_flight = property(lambda self: 2)


def threads_cpu() -> dict[str, float]:
    """CPU seconds of this process's threads since they started, summed by name: Python's
    threads by theirs, the others (ZeroMQ's I/O threads, CUDA's) as "native", from /proc (Linux)."""
    import threading

    names = {t.native_id: t.name for t in threading.enumerate()}
    out: dict[str, float] = {}
    for task in Path("/proc/self/task").iterdir():
        name = names.get(int(task.name), "native")
        out[name] = out.get(name, 0.0) + thread_cpu(int(task.name))
    return out


def thread_cpu(native_id: int) -> float:
    """CPU seconds (user and system) of a thread of this process, from /proc (Linux)."""
    return cpu_seconds(f"/proc/self/task/{native_id}/stat")


def cpu_seconds(stat: str) -> float:
    """CPU seconds (user and system) of the process or thread whose /proc stat file is `stat` (Linux)."""
    fields = Path(stat).read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def client(args) -> None:
    """The client process: --requests requests through an EngineClient, --window outstanding."""

    import runtime
    from runtime.server.link import EngineClient
    from sidindex.sample import sample_requests

    index = runtime.load(args.root, "cpu", verify=False)
    cb = index.codebook
    pool = sample_requests(args.pool, index.spec, dim=1 if cb is None else cb.dim, seed=args.seed).to_pylist()
    validated = [runtime.requests_from([dict(r, request_id=i)], index, source="bench") for i, r in enumerate(pool)]

    async def drive() -> dict:
        link = EngineClient(args.engine)  # gathering as the link does, unless told
        if args.message_rows is not None:
            import inspect

            import runtime.server.link as linked

            if "gather_rows" in inspect.signature(EngineClient).parameters:
                link = EngineClient(args.engine, args.message_rows)
            else:  # a baseline's EngineClient reads only the module's constant
                linked.GATHER_ROWS = args.message_rows
        await link.start()
        target = await link.target()
        seconds: list[float] = []
        window = asyncio.Semaphore(args.window)

        async def one(i: int) -> None:
            async with window:
                t = time.perf_counter()
                await link.answer(validated[i % len(validated)], target, None)
                seconds.append(time.perf_counter() - t)

        for i in range(min(args.window, args.requests)):  # every batch size once, off the clock
            await one(i)
        print("ready", flush=True)  # then the clients start together (`one_run`)
        await asyncio.get_running_loop().run_in_executor(None, sys.stdin.readline)
        t0, cpu = time.monotonic(), time.process_time()  # one clock for every process (Linux)
        await asyncio.gather(*(one(i) for i in range(args.requests)))
        t1, cpu = time.monotonic(), time.process_time() - cpu
        link.stop()
        return {"start": t0, "end": t1, "requests": args.requests, "client_busy": cpu / (t1 - t0),
                "ms": [x * 1e3 for x in seconds[-args.requests:]]}

    print(json.dumps(asyncio.run(drive())), flush=True)


def one_run(args, root: Path, code: Path | None, interval: float | None = None) -> dict:
    """An engine process (with `interval` its GIL switch interval) and a client process with
    `code` (another checkout's packages) first on sys.path: their figures."""
    env = dict(os.environ)
    env.pop("SIDINDEX_BENCH_TREE", None)
    if code is not None:  # first on sys.path, before this checkout the script puts there
        env["SIDINDEX_BENCH_TREE"] = str(code.resolve())
    env.pop("TRITON_INTERPRET", None)
    place = tempfile.mkdtemp(prefix="be-")  # short: a socket path's limit
    address = f"ipc://{place}/engine"
    common = ["--root", str(root), "--engine", address, "--device", args.device, "--beams", args.beams,
              "--max-batch", str(args.max_batch), "--top-k", str(args.top_k)] + \
        ([] if args.message_rows is None else ["--message-rows", str(args.message_rows)]) + \
        ([] if args.stand_in_ms is None else ["--stand-in-ms", str(args.stand_in_ms)])
    me = [sys.executable, str(Path(__file__).resolve())]
    switch = [] if interval is None else ["--switch-interval", str(interval)]
    server = subprocess.Popen(me + ["--role", "engine"] + common + switch, stdout=subprocess.PIPE, text=True, env=env)
    try:
        assert server.stdout is not None
        line = read_line(server, server, "the engine")
        if line != "ready":
            raise RuntimeError(f"the engine did not start ({line!r}); exit {server.wait()}")
        figures = clients(args, me + ["--role", "client"] + common, env, server)
        server.send_signal(signal.SIGINT)
        rest, _ = server.communicate(timeout=60)
        return figures | json.loads(rest.strip().splitlines()[-1])
    finally:
        if server.poll() is None:
            server.kill()
            server.wait()
        shutil.rmtree(place, ignore_errors=True)


def clients(args, command: list[str], env: dict, server: subprocess.Popen) -> dict:
    """--clients client processes, --window and --requests shared among them, started together
    once each is ready and the engine marked where their warm-up ended: requests/s over the span
    from the first start to the last end, latency percentiles over every request, and the
    busiest client's CPU share (near 100%: the clients bound)."""
    import numpy as np

    n = args.clients

    def share(total: int, i: int) -> int:
        return max(1, total // n + (i < total % n))

    procs = [subprocess.Popen(command + ["--window", str(share(args.window, i)), "--requests",
                                         str(share(args.requests, i)), "--pool", str(args.pool),
                                         "--seed", str(args.seed + i)],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
             for i in range(n)]
    try:
        for p in procs:
            line = read_line(p, server, "a client")
            if line != "ready":
                raise RuntimeError(f"a client did not start ({line!r}); exit {p.wait()}")
        server.send_signal(signal.SIGUSR1)
        if (line := read_line(server, server, "the engine")) != "marked":
            raise RuntimeError(f"the engine did not mark the clients' start ({line!r})")
        for p in procs:
            assert p.stdin is not None
            p.stdin.write("go\n")
            p.stdin.flush()
        runs = []
        for p in procs:
            out = read_line(p, server, "a client")
            if p.wait(timeout=60) or not out:
                raise RuntimeError(f"a client exited {p.returncode}")
            runs.append(json.loads(out))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    ms = np.concatenate([r["ms"] for r in runs])
    span = max(r["end"] for r in runs) - min(r["start"] for r in runs)
    return {"rps": sum(r["requests"] for r in runs) / span, "client_busy": max(r["client_busy"] for r in runs),
            "p50_ms": float(np.percentile(ms, 50)), "p99_ms": float(np.percentile(ms, 99))}


def read_line(proc: subprocess.Popen, engine: subprocess.Popen, who: str, timeout: float = 600.0) -> str:
    """The next line `proc` prints (stripped; "" at its end), within `timeout` seconds and while the
    engine process lives: RuntimeError naming `who` otherwise."""
    import selectors

    assert proc.stdout is not None
    end = time.monotonic() + timeout
    with selectors.DefaultSelector() as sel:
        sel.register(proc.stdout, selectors.EVENT_READ)
        while not sel.select(timeout=1.0):
            if engine is not proc and engine.poll() is not None:
                raise RuntimeError(f"the engine exited {engine.returncode} while {who} ran")
            if time.monotonic() > end:
                raise RuntimeError(f"{who} printed nothing in {timeout:.0f} s")
    return proc.stdout.readline().strip()


def sample_root(cache: Path) -> Path:
    """data_samples/ built once under `cache` (`sidindex build`)."""
    root = cache / "engine-sample-root"
    if not (root / "CURRENT").exists():
        samples = REPO / "data_samples"
        subprocess.run([sys.executable, "-m", "sidindex_cli", "build", "--catalog", str(samples / "catalog.parquet"),
                        "--targeting", str(samples / "targeting.toml"), "--out", str(root)], check=True,
                       capture_output=True)
    return root


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--beams", default="1,2,2,2")
    ap.add_argument("--ads", type=int, default=None, help="a generated catalog of this many ads (default: "
                    "data_samples)")
    ap.add_argument("--dim", type=int, default=32)
    ap.add_argument("--max-batch", type=int, default=64)
    ap.add_argument("--top-k", type=int, default=100)
    ap.add_argument("--window", type=int, default=64, help="requests outstanding, over all clients")
    ap.add_argument("--clients", type=int, default=1, help="client processes (one, near 100%% busy, bounds what "
                    "it measures)")
    ap.add_argument("--requests", type=int, default=3000)
    ap.add_argument("--message-rows", type=int, default=None, help="the most rows a client's message gathers "
                    "(default: the link's; 1: each request a message of its own, as most of an HTTP front-end's "
                    "requests arrive under load)")
    ap.add_argument("--pool", type=int, default=1024)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--stand-in-ms", type=float, default=None, help="replace the search by a stand-in for a "
                    "device's batch taking this long without the GIL (two at a time, top_k rows a request): the "
                    "engine's own ceiling, on any machine")
    ap.add_argument("--baseline", type=checkout, default=None)
    ap.add_argument("--switch-intervals", type=lambda v: [float(x) for x in v.split(",")], default=[],
                    help="also run this checkout's engine with each of these GIL switch intervals (seconds, "
                         "comma-separated; `sidindex serve` sets runtime.server.http.SWITCH_INTERVAL_S), alternating")
    ap.add_argument("--switch-interval", type=float, default=None, help=argparse.SUPPRESS)
    ap.add_argument("--cache", type=Path, default=None)
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--role", choices=["engine", "client"], default=None, help=argparse.SUPPRESS)
    ap.add_argument("--root", type=Path, default=None, help=argparse.SUPPRESS)
    ap.add_argument("--engine", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if any(x <= 0 for x in args.switch_intervals):
        ap.error(f"--switch-intervals {args.switch_intervals}: give positive seconds")
    args.switch_intervals = sorted(set(args.switch_intervals))
    if args.clients < 1:
        ap.error(f"--clients {args.clients}: give at least 1")
    if args.role == "engine":
        engine(args)
        return 0
    if args.role == "client":
        client(args)
        return 0
    from rich.console import Console
    from rich.table import Table

    from bench.report import against, host_speed, write_json

    host_ms = [host_speed()]  # before the runs, and after them: the host's own speed (it varies with its load)
    cache = args.cache or Path(tempfile.mkdtemp(prefix="bench_engine_"))
    cache.mkdir(parents=True, exist_ok=True)
    if args.ads is None:
        root = sample_root(cache)
    else:
        from bench.bench_stream import catalog_root

        root = Path(catalog_root(args.ads, args.dim, cache)["root"])
    variants = [("this checkout", None, None)] + [(f"switch interval {x:g} s", None, x)
                                                  for x in args.switch_intervals]
    variants += [] if args.baseline is None else [(f"{args.baseline}", args.baseline, None)]
    results: dict[str, list[dict]] = {label: [] for label, _, _ in variants}
    for _ in range(args.runs):
        for label, code, interval in variants:
            results[label].append(one_run(args, root, code, interval))
    host_ms.append(host_speed())
    t = Table(title=f"the engine through its link ({args.device}, beams {args.beams}, max batch {args.max_batch}, "
                    f"{args.window} outstanding from {args.clients} client(s), {args.requests:,} requests a run); "
                    f"the median run; host speed {host_ms[0]:.1f} / {host_ms[1]:.1f} ms before / after")
    for c in ("code", "req/s", "p50 ms", "p99 ms", "link CPU µs/req", "engine CPU µs/req", "rows per batch",
              "batch ms: read / encode / search+post / answer", "client busy", "runs (req/s)"):
        t.add_column(c, justify="left" if c == "code" else "right")
    medians = {}
    for label, runs in results.items():
        m = sorted(runs, key=lambda r: r["rps"])[len(runs) // 2]
        medians[label] = m
        t.add_row(label, f"{m['rps']:,.0f}", f"{m['p50_ms']:.2f}", f"{m['p99_ms']:.2f}", f"{m['link_cpu_us']:.0f}",
                  f"{m['process_cpu_us']:.0f}", f"{m['rows_per_batch']:.1f}",
                  " / ".join(f"{m['stage_ms'][k]:.2f}" for k in ("read", "encode", "search_post", "answer"))
                  if m.get("stage_ms") else "-", f"{m['client_busy']:.0%}",
                  ", ".join(f"{r['rps']:,.0f}" for r in runs))
    console = Console(width=200)
    console.print(t)
    if args.baseline is not None:
        console.print(against(str(args.baseline), medians["this checkout"], medians[str(args.baseline)],
                              {"rps": "requests/s", "link_cpu_us": "link CPU per request",
                               "process_cpu_us": "engine CPU per request"}))
    write_json(args.json, {"config": {k: str(v) for k, v in vars(args).items()}, "host_speed_ms": host_ms,
                           "results": results})
    return 0


if __name__ == "__main__":
    sys.exit(main())
