"""SIGTERM at random moments: `sidindex serve` must exit 0 within its drain, print no traceback, and
answer (200) or refuse (503) every request it accepted, whatever it was doing.

    python bench/bench_shutdown.py                          # 20 stops per process model, CPU, 3,000 ads
    python bench/bench_shutdown.py --device cuda --ads 1000000 --beams 1,512,1024,1024 --workers 1,8

Each run starts a server (`bench_load.Server`: a working copy of the cached ROOT, --workers as
given) and stops it at one moment, the moments taken in turn, each at a random delay:
  warm-up  while the snapshot warms, before /readyz answers 200
  load     under a stream of one-request bodies from --clients threads
  swap     under that load, just after a copy of the served snapshot is published (the server is
           loading or warming it: `bench_load.publish_copy`)
  large    while a body of --large-rows requests runs in pieces, beside the load
A request the server accepted and left without an answer (a reset or a closed connection after
the request was sent) is `unanswered`; one refused at connect (the server stopped listening) is
not: no server took it. Per run: the moment, the delay, the exit code, seconds from SIGTERM to
exit, tracebacks in the server's output, answers by status, and unanswered requests. Output: a
table per process model, the verdicts, every figure with --json PATH.
"""

from __future__ import annotations

import argparse
import random
import shutil
import sys
import tempfile
import threading
import time
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make `bench` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import httpx

from bench.bench_load import Server, large_body, log, publish_copy, request_pool, working_root
from bench.report import verdict, write_json

MOMENTS = ("warm-up", "load", "swap", "large")


class Load:
    """--clients threads posting one-request bodies until stopped; every outcome counted."""

    def __init__(self, url: str, bodies: list[bytes], clients: int, extra: bytes | None = None) -> None:
        self.statuses: dict[int, int] = {}
        self.unanswered = self.refused = 0
        self._stop = threading.Event()
        self._lock = threading.Lock()
        jobs = [(url, bodies[i::clients]) for i in range(clients)]
        self.threads = [threading.Thread(target=self._client, args=job, daemon=True) for job in jobs]
        if extra is not None:  # the large body, once
            self.threads.append(threading.Thread(target=self._client, args=(url, [extra], True), daemon=True))
        for t in self.threads:
            t.start()

    def _client(self, url: str, bodies: list[bytes], once: bool = False) -> None:
        with httpx.Client(timeout=300) as http:
            for i in range(len(bodies) if once else 1 << 30):
                if self._stop.is_set():
                    return
                try:
                    status = http.post(url + "/retrieve", content=bodies[i % len(bodies)],
                                       headers={"content-type": "application/json"}).status_code
                except httpx.ConnectError:  # nothing listens: no server took it
                    with self._lock:
                        self.refused += 1
                    return
                except httpx.TransportError:  # sent, and the connection ended without an answer
                    with self._lock:
                        self.unanswered += 1
                    return
                with self._lock:
                    self.statuses[status] = self.statuses.get(status, 0) + 1

    def stop(self) -> None:
        self._stop.set()
        for t in self.threads:
            t.join(300)


def one_run(root: Path, args, workers: int | None, moment: str, rng: random.Random, bodies: list[bytes],
            work: Path) -> dict:
    """Start a server, stop it at `moment` (module doc), and what happened."""
    run_root = working_root(root, work)
    server = Server(run_root, args, work / "serve.log", workers)
    load = None
    try:
        if moment == "warm-up":
            delay = rng.uniform(0.2, 2.0)
            time.sleep(delay)
            ready = server.proc.poll() is None and _ready(server)
            moment_seen = "warm-up" if not ready else "warm-up (already warm)"
        else:
            server.wait_ready(args.ready_timeout)
            extra = large_body(bodies, args.large_rows) if moment == "large" else None
            load = Load(server.url, bodies, args.clients, extra)
            time.sleep(0.3)  # the load is on
            if moment == "swap":
                from sidindex.root import Root

                publish_copy(run_root, Root(run_root).current_id(), corrupt=False)
            delay = rng.uniform(0.0, 0.5)
            time.sleep(delay)
            moment_seen = moment
        t = time.perf_counter()
        code = server.stop(timeout=args.drain_seconds + 60)
        stop_s = time.perf_counter() - t
    finally:
        if server.proc.poll() is None:
            server.stop()
        if load is not None:
            load.stop()
    text = server.log_path.read_text(errors="replace")
    shutil.rmtree(run_root, ignore_errors=True)
    first = text.find("Traceback")
    return {"workers": workers, "moment": moment_seen, "delay_s": delay, "exit": code, "stop_s": stop_s,
            "tracebacks": text.count("Traceback") + text.count("terminate called"),
            "first_traceback": text[first:first + 3000] if first >= 0 else None,
            "statuses": {} if load is None else load.statuses, "unanswered": 0 if load is None else load.unanswered,
            "refused_at_connect": 0 if load is None else load.refused}


def _ready(server: Server) -> bool:
    try:
        return httpx.get(server.url + "/readyz", timeout=2).status_code == 200
    except httpx.TransportError:
        return False


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--ads", type=int, default=3000)
    ap.add_argument("--dim", type=int, default=16)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--mode", default="cd+gtm")
    ap.add_argument("--beams", default="1,4,8,8")
    ap.add_argument("--runs", type=int, default=20, help="stops per process model")
    ap.add_argument("--moments", type=lambda s: s.split(","), default=list(MOMENTS),
                    help="comma-separated, of " + ", ".join(MOMENTS) + ", taken in turn")
    ap.add_argument("--workers", type=lambda s: [int(w) for w in s.split(",")], default=[1, 2],
                    help="the server's --workers, one set of runs each")
    ap.add_argument("--clients", type=int, default=4)
    ap.add_argument("--large-rows", type=int, default=4096)
    ap.add_argument("--drain-seconds", type=float, default=30.0, help="the server's --drain-seconds")
    ap.add_argument("--ready-timeout", type=float, default=600.0)
    ap.add_argument("--seed", type=int, default=7)
    ap.add_argument("--cache", type=Path, help="keep the catalog and its ROOT here, and reuse them")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)
    # what bench_load.Server reads
    args.top_k, args.max_batch, args.max_wait_us, args.max_queue, args.poll_seconds, args.threads = \
        100, 16, 500, 1024, 0.1, (1 if args.device == "cpu" else None)
    import runtime
    from bench.bench_stream import catalog_root

    cache = args.cache or Path(tempfile.mkdtemp(prefix="bench_shutdown_"))
    size = catalog_root(args.ads, args.dim, cache)
    root = Path(size["root"])
    bodies = request_pool(runtime.load(root, "cpu", verify=False), Path(size["catalog"]), 256, args.seed)
    rng = random.Random(args.seed)
    runs = []
    for workers in args.workers:
        for i in range(args.runs):
            moment = args.moments[i % len(args.moments)]
            log(f"--workers {workers}, run {i + 1}/{args.runs}: SIGTERM during {moment} ...")
            work = Path(tempfile.mkdtemp(prefix="run_", dir=cache))
            try:
                runs.append(one_run(root, args, workers, moment, rng, bodies, work))
            finally:
                shutil.rmtree(work, ignore_errors=True)
    if args.cache is None:
        shutil.rmtree(cache, ignore_errors=True)
    report(runs, args)
    write_json(args.json, {"config": {k: str(v) for k, v in vars(args).items()}, "runs": runs})
    return 0


def report(runs: list[dict], args) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console(width=None if sys.stdout.isatty() else 200)
    t = Table(title=f"SIGTERM at random moments: {args.ads:,} ads on {args.device}, beams {args.beams}, "
                    f"drain {args.drain_seconds:g} s", title_justify="left")
    for col in ("workers", "moment", "delay s", "exit", "stop s", "tracebacks", "answers", "unanswered",
                "refused at connect"):
        t.add_column(col, justify="right")
    for r in runs:
        answers = ", ".join(f"{k}: {v}" for k, v in sorted(r["statuses"].items())) or "-"
        t.add_row(str(r["workers"]), r["moment"], f"{r['delay_s']:.2f}", str(r["exit"]), f"{r['stop_s']:.2f}",
                  str(r["tracebacks"]), answers, str(r["unanswered"]), str(r["refused_at_connect"]))
    console.print(t)
    for r in runs:
        if r["first_traceback"]:
            console.print(f"--workers {r['workers']}, {r['moment']}: the first traceback of the server's output:\n"
                          f"{r['first_traceback']}", highlight=False, markup=False)
    for workers in args.workers:
        mine = [r for r in runs if r["workers"] == workers]
        clean = [r for r in mine if r["exit"] == 0 and r["tracebacks"] == 0]
        other = sum(v for r in mine for k, v in r["statuses"].items() if k not in (200, 503))
        checks = [(len(clean) == len(mine), f"{len(clean)} of {len(mine)} stops exited 0 with no traceback"),
                  (all(r["stop_s"] <= args.drain_seconds + 5 for r in mine),
                   f"slowest stop {max(r['stop_s'] for r in mine):.2f} s (drain {args.drain_seconds:g} s)"),
                  (sum(r["unanswered"] for r in mine) == 0 and other == 0,
                   f"{sum(r['unanswered'] for r in mine)} requests left unanswered, {other} answered other than "
                   "200 or 503")]
        for ok, line in checks:
            console.print(verdict(ok, f"--workers {workers}: {line}"), highlight=False)


if __name__ == "__main__":
    sys.exit(main())
