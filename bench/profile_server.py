"""Where `sidindex serve`'s engine process spends its time under load: wrk posting one JSON
request per call for --seconds, while py-spy (when installed) samples the engine process's
threads; per server, wrk's figures, the engine's batches (rows, wall time, and the Retriever's own
encode and search + post time within it), and the functions the engine's threads are in.

    python bench/profile_server.py --device cuda --ads 1000000 --workers 8 --cache /data/bench
    python bench/profile_server.py --device cuda --baseline .baseline ...   # another checkout beside
    python bench/profile_server.py --device cuda --curve 32,256,512 ...      # and at other connections

--baseline DIR serves a second time from the packages under DIR (another checkout's runtime,
sidindex, sidindex_cli and schemas, put first on PYTHONPATH), in the same run, on the same
catalog, so a change to the server is measured against what it changes on one machine. The
catalog is `bench_stream.catalog_root`'s, the bodies `bench_load.request_pool`'s; wrk is
`bench_load`'s (on PATH, or --wrk). The profile is two py-spy recordings of the engine, taken
together: the threads holding the GIL (--gil: who keeps the others waiting), and every thread
idle or not (--idle: where a batch waits); functions are counted once per sample in which they
are on the stack.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import os
import re
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.bench_engine import cpu_seconds
from bench.bench_load import (
    Server,
    request_pool,
    resolve_server_arguments,
    run_dirs,
    server_arguments,
    server_counts,
    working_root,
)
from bench.load_wrk import run_wrk, wrk_path
from bench.report import checkout, host_speed, write_json

TOP = 24  # functions per thread in the table
SPY_RATE = 200  # py-spy's samples a second
OURS = ("runtime/", "sidindex/", "sidindex_cli/", "schemas/")  # py-spy names these files from the repository


def spy(pid: int, seconds: float, out: Path, *flags: str) -> subprocess.Popen | None:
    """py-spy recording `pid` for `seconds` into `out` (raw stacks), or None without py-spy."""
    exe = shutil.which("py-spy")
    if exe is None:
        return None
    return subprocess.Popen([exe, "record", "-p", str(pid), "-d", str(spy_seconds(seconds)), "-r", str(SPY_RATE),
                             "--nonblocking", "-f", "raw", "-o", str(out), *flags],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)


def spy_seconds(seconds: float) -> int:
    """The whole seconds a py-spy recording of about `seconds` lasts."""
    return max(1, round(seconds))


def _thread(frames: list[str]) -> str:
    """Which of the engine's threads a stack is on, by the functions on it."""
    names = {f.partition(" (")[0] for f in frames}
    for name, label in (("_worker", "batch threads"), ("Batcher._work", "batch threads"),
                        ("EngineLink._serve", "link thread"), ("Engine._poll", "ROOT poller"),
                        ("_run_module_as_main", "event loop")):
        if name in names:
            return label
    return "other"


def stacks(path: Path) -> dict:
    """A raw py-spy file summed per thread (`_thread`): its samples, the functions of this
    repository on its stacks (counted once per sample), and where its stacks end (any code)."""
    threads: dict[str, dict] = {}
    total = 0
    for line in (path.read_text(errors="replace").splitlines() if path.exists() else []):
        stack, _, n = line.rpartition(" ")
        if not n.isdigit():
            continue
        frames = [f for f in stack.split(";") if not f.startswith(("thread (", "process "))]
        count = int(n)
        total += count
        t = threads.setdefault(_thread(frames), {"samples": 0, "ours": collections.Counter(),
                                                 "ends": collections.Counter()})
        t["samples"] += count
        seen = set()
        for f in frames:
            name, _, where = f.partition(" (")
            file = where.rsplit(":", 1)[0]
            if file.startswith(OURS) and (key := f"{file}:{name}") not in seen:
                seen.add(key)
                t["ours"][key] += count
        if frames:
            name, _, where = frames[-1].partition(" (")
            t["ends"][f"{Path(where.rsplit(':', 1)[0]).name}:{name}"] += count
    return {"samples": total, "threads": {k: {"samples": v["samples"], "ours": v["ours"].most_common(TOP),
                                              "ends": v["ends"].most_common(TOP // 3)}
                                          for k, v in sorted(threads.items(), key=lambda kv: -kv[1]["samples"])}}


def engine_figures(before: dict, after: dict, counters: dict) -> dict:
    """Batches the engine ran between two /metrics reads, and the Retriever's seconds per batch."""
    a, b = server_counts(before), server_counts(after)
    batches = b["batches"] - a["batches"]
    per = max(batches, 1.0)
    def mean_ms(name: str) -> float:  # a histogram's mean between the two reads
        n = after.get(f"{name}_count", 0.0) - before.get(f"{name}_count", 0.0)
        return (after.get(f"{name}_sum", 0.0) - before.get(f"{name}_sum", 0.0)) / max(n, 1.0) * 1e3

    def stages(name: str, names: tuple[str, ...], n: float) -> dict[str, float]:
        """A stage counter's ms per n between the reads; {} where the server has none (an older checkout)."""
        keys = {k: f'{name}{{stage="{k}"}}' for k in names}
        if not all(key in after for key in keys.values()):
            return {}
        return {k: (after[key] - before.get(key, 0.0)) / max(n, 1.0) * 1e3 for k, key in keys.items()}

    ok = b.get("outcome ok", 0.0) - a.get("outcome ok", 0.0)
    return {"batches": batches, "rows_per_batch": (b["batch_rows"] - a["batch_rows"]) / per,
            "request_stage_ms": stages("sidindex_request_stage_seconds_total", ("parse", "wait", "write"), ok),
            "batch_stage_ms": stages("sidindex_batch_stage_seconds_total", ("read", "encode", "search_post", "answer"),
                                     batches),
            "queue_wait_ms": mean_ms("sidindex_queue_wait_seconds"),
            "request_ms": mean_ms("sidindex_request_seconds"),
            "batch_ms": (b["batch_seconds"] - a["batch_seconds"]) / per * 1e3,
            "encode_ms_all": counters["seconds"]["encode"] / max(counters["batches"], 1) * 1e3,
            "search_post_ms_all": counters["seconds"]["search_post"] / max(counters["batches"], 1) * 1e3}


def front_ends(pid: int) -> list[str]:
    """The pids of the engine process `pid`'s front-end processes, from /proc (Linux; none elsewhere)."""
    out = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                fields = (d / "stat").read_text().rsplit(")", 1)[1].split()
                if int(fields[1]) == pid and b"runtime.server.frontend" in (d / "cmdline").read_bytes():
                    out.append(d.name)
            except (OSError, IndexError, ValueError):
                continue  # gone meanwhile
    return out


def processes_cpu(pid: int) -> dict[str, float]:
    """CPU seconds (user and system) of the engine process `pid` ("engine") and of each of its
    front-end processes (by pid), from /proc (Linux; empty elsewhere)."""
    out: dict[str, float] = {}
    try:
        out["engine"] = cpu_seconds(f"/proc/{pid}/stat")
    except OSError:
        return out
    for f in front_ends(pid):
        with contextlib.suppress(OSError, IndexError, ValueError):  # gone meanwhile
            out[f] = cpu_seconds(f"/proc/{f}/stat")
    return out


def port_sockets(port: int, state: str) -> set[str]:
    """The sockets on local `port` in TCP `state` ("01" established, "0A" listening) as a process's
    fd links name them ("socket:[INODE]"), from /proc (Linux; none elsewhere)."""
    inodes = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with contextlib.suppress(OSError):
            for line in Path(table).read_text().splitlines()[1:]:
                f = line.split()
                if len(f) > 9 and f[3] == state and int(f[1].rsplit(":", 1)[1], 16) == port:
                    inodes.add(f"socket:[{f[9]}]")
    return inodes


def held(pid: int | str, sockets: set[str]) -> set[str]:
    """Which of `sockets` (`port_sockets`) process `pid` holds open (none once it is gone)."""
    out = set()
    with contextlib.suppress(OSError):
        for fd in Path(f"/proc/{pid}/fd").iterdir():
            with contextlib.suppress(OSError):
                if (link := os.readlink(fd)) in sockets:
                    out.add(link)
    return out


def connections(pid: int, port: int) -> list[int]:
    """How many established connections to `port` each front-end of the engine process `pid`
    holds, most first, from /proc (Linux; empty elsewhere): how evenly the kernel spread them."""
    established = port_sockets(port, "01")
    return sorted((len(held(front, established)) for front in front_ends(pid)), reverse=True)


def one_server(label: str, root: Path, args, bodies: list[bytes], work: Path, wrk: str, env: dict) -> dict:
    """Serve ROOT, drive it with wrk for --seconds while py-spy samples the engine: the figures."""
    print(f"{label}: sidindex serve --workers {args.workers} ...", flush=True)
    name = re.sub(r"[^A-Za-z0-9_.-]+", "_", label)  # a file name, whatever the label (a baseline's path)
    server = Server(root, args, work / f"serve-{name}.log", args.workers, env)
    out: dict = {"label": label}
    try:
        out["ready_s"] = server.wait_ready(args.ready_timeout)
        run_wrk(wrk, server.url, bodies, connections=args.connections, threads=args.wrk_threads, seconds=2,
                work=work)  # every batch size's graph replayed once before the clock
        before, cpu, began = server.get("/metrics"), processes_cpu(server.proc.pid), time.monotonic()
        held, every = work / f"{name}-gil.txt", work / f"{name}-idle.txt"
        recording = args.seconds - 2  # inside wrk's run
        out["spy_ticks"] = SPY_RATE * spy_seconds(recording)  # the most samples a recording holds
        spies = [spy(server.proc.pid, recording, held, "--gil"),
                 spy(server.proc.pid, recording, every, "--idle", "--threads")]
        # halfway through wrk's run: the connections each front-end holds
        spread = threading.Timer(args.seconds / 2, lambda: out.update(
            connections=connections(server.proc.pid, server.port)))
        spread.start()
        out["wrk"] = run_wrk(wrk, server.url, bodies, connections=args.connections, threads=args.wrk_threads,
                             seconds=args.seconds, work=work)
        spread.join()
        out["cpu_ms_per_request"] = cpu_per_request(server, cpu, began, out["wrk"])
        for s in spies:
            if s is not None:
                _, err = s.communicate(timeout=60)
                if s.returncode:
                    out.setdefault("spy_errors", []).append(err.decode(errors="replace")[-300:])
        out["engine"] = engine_figures(before, server.get("/metrics"), server.get("/snapshot")["counters"])
        out["gil"], out["idle"] = stacks(held), stacks(every)
        out["curve"] = []
        for c in args.curve:  # a point that fails is noted: the figures above stand
            try:
                out["curve"].append(loaded(server, wrk, bodies, work, args, c))
            except (RuntimeError, OSError, subprocess.SubprocessError) as e:
                out["curve"].append({"connections": c, "error": str(e).splitlines()[0] if str(e) else type(e).__name__})
    finally:
        out["exit"] = server.stop()
    return out


def cpu_per_request(server: Server, cpu: dict[str, float], began: float, w: dict) -> dict[str, float]:
    """The CPU ms a request answered by wrk's run `w` took in the engine process and in the
    front-ends since `cpu` (`processes_cpu`) was read at `began`, and how busy the busiest
    front-end was."""
    spent = {k: v - cpu.get(k, 0.0) for k, v in processes_cpu(server.proc.pid).items()}
    elapsed = time.monotonic() - began
    answered = max(w.get("requests", 0) - w.get("non_2xx", 0), 1)
    return {"engine": spent.pop("engine", 0.0) / answered * 1e3, "front-ends": sum(spent.values()) / answered * 1e3,
            "busiest front-end busy": max(spent.values(), default=0.0) / elapsed}


def loaded(server: Server, wrk: str, bodies: list[bytes], work: Path, args, connections: int) -> dict:
    """One more wrk run of --seconds at `connections` on the warm server, without py-spy: wrk's
    figures, the engine's batches and the CPU a request (a point of the requests/s-latency curve:
    where more connections stop adding requests/s, the server is bound by what it can do, not by
    the latency of a closed loop)."""
    before, cpu, began = server.get("/metrics"), processes_cpu(server.proc.pid), time.monotonic()
    w = run_wrk(wrk, server.url, bodies, connections=connections, threads=min(args.wrk_threads, connections),
                seconds=args.seconds, work=work)
    return {"connections": connections, "wrk": w, "cpu_ms_per_request": cpu_per_request(server, cpu, began, w),
            "engine": engine_figures(before, server.get("/metrics"), server.get("/snapshot")["counters"])}


def connection_counts(text: str) -> list[int]:
    """An argparse type for --curve: comma-separated numbers of connections, each at least 1."""
    import argparse

    try:
        counts = [int(c) for c in text.split(",") if c.strip()]
    except ValueError:
        counts = []
    if not counts or min(counts) < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: give numbers of connections, each at least 1, e.g. 64,256,512")
    return counts


def report(results: list[dict], host_ms: list[float]) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console(width=200)
    t = Table(title="sidindex serve under wrk (one JSON request per call); engine batches during the run; "
                    f"host speed {host_ms[0]:.1f} / {host_ms[1]:.1f} ms before / after")
    for c in ("server", "req/s", "p50 ms", "p99 ms", "non-2xx", "in the server ms", "queue wait ms", "rows/batch",
              "batch ms", "encode ms", "search+post ms", "exit"):
        t.add_column(c, justify="left" if c == "server" else "right")
    for r in results:
        w, e = r.get("wrk", {}), r.get("engine", {})
        t.add_row(r["label"], f"{w.get('rps', 0):,.0f}", f"{w.get('p50_ms', 0):.1f}", f"{w.get('p99_ms', 0):.1f}",
                  str(w.get("non_2xx", "")), f"{e.get('request_ms', 0):.2f}", f"{e.get('queue_wait_ms', 0):.2f}",
                  f"{e.get('rows_per_batch', 0):.1f}", f"{e.get('batch_ms', 0):.2f}",
                  f"{e.get('encode_ms_all', 0):.2f}", f"{e.get('search_post_ms_all', 0):.2f}", str(r.get("exit")))
    console.print(t)
    for r in results:
        e = r.get("engine", {})
        if e.get("request_stage_ms"):
            console.print(f"{r['label']}: a request's ms in its front-end, parse / wait / write: "
                          + " / ".join(f"{v:.2f}" for v in e["request_stage_ms"].values())
                          + "; a batch's ms in the engine, read / encode / search+post / answer: "
                          + " / ".join(f"{v:.2f}" for v in e.get("batch_stage_ms", {}).values()))
        c = r.get("cpu_ms_per_request")
        if c:
            console.print(f"{r['label']}: CPU ms a request: engine process {c['engine']:.2f}, front-ends "
                          f"{c['front-ends']:.2f} (the busiest front-end {c['busiest front-end busy']:.0%} busy)")
        if r.get("connections"):
            console.print(f"{r['label']}: connections each front-end held, most first: {r['connections']}")
    if any(r.get("curve") for r in results):
        c = Table(title="the same servers at other numbers of wrk connections (no py-spy)")
        for name in ("server", "connections", "req/s", "p50 ms", "p99 ms", "non-2xx", "rows/batch", "queue wait ms",
                     "batch ms", "engine CPU ms", "front-ends CPU ms", "busiest front-end"):
            c.add_column(name, justify="left" if name == "server" else "right")
        for r in results:
            for point in r.get("curve", []):
                if "error" in point:
                    c.add_row(r["label"], str(point["connections"]), f"failed: {point['error']}")
                    continue
                w, e, u = point["wrk"], point["engine"], point["cpu_ms_per_request"]
                c.add_row(r["label"], str(point["connections"]), f"{w.get('rps', 0):,.0f}", f"{w.get('p50_ms', 0):.1f}",
                          f"{w.get('p99_ms', 0):.1f}", str(w.get("non_2xx", "")), f"{e['rows_per_batch']:.1f}",
                          f"{e['queue_wait_ms']:.2f}", f"{e['batch_ms']:.2f}", f"{u['engine']:.2f}",
                          f"{u['front-ends']:.2f}", f"{u['busiest front-end busy']:.0%}")
        console.print(c)
    if len(results) == 2 and results[0].get("wrk") and results[1].get("wrk"):
        console.print(f"{results[0]['label']} / {results[1]['label']}: "
                      f"{results[0]['wrk']['rps'] / max(results[1]['wrk']['rps'], 1e-9):.2f}x requests/s")
    for r in results:
        for kind in ("gil", "idle"):
            s = r.get(kind)
            if not s or not s["samples"]:
                continue
            held = f" of {r['spy_ticks']:,} ticks: the GIL held {s['samples'] / r['spy_ticks']:.0%} of the time" \
                if kind == "gil" and r.get("spy_ticks") else ""
            console.print(f"\n[bold]{r['label']}, engine process, py-spy --{kind}[/bold]: {s['samples']:,} samples"
                          + held)
            for thread, t in s["threads"].items():
                console.print(f"  {thread}: {t['samples'] / s['samples']:.1%} of the samples; stacks end in "
                              + ", ".join(f"{k} {n / t['samples']:.0%}" for k, n in t["ends"]), highlight=False)
                for name, n in t["ours"]:
                    console.print(f"    {n / t['samples']:6.1%}  {name}", highlight=False)
        for e in r.get("spy_errors", []):
            console.print(f"py-spy: {e}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    server_arguments(ap, ads=1_000_000, device="cuda", max_batch=64, poll_seconds=1.0, ready_timeout=900.0)
    ap.add_argument("--workers", type=int, default=8)
    ap.add_argument("--seconds", type=float, default=10.0)
    ap.add_argument("--connections", type=int, default=64)
    ap.add_argument("--curve", type=connection_counts, default=[],
                    help="comma-separated numbers of connections, each one more wrk run of --seconds on each "
                         "server after the profiled one (a requests/s-latency curve)")
    ap.add_argument("--wrk-threads", type=int, default=4)
    ap.add_argument("--wrk", default=None)
    ap.add_argument("--pool", type=int, default=1024)
    ap.add_argument("--baseline", type=checkout, default=None, help="another checkout's packages, served beside")
    args = ap.parse_args(argv)
    why = resolve_server_arguments(args)
    if why is not None:
        print(f"profile_server: {why}")
        return 2
    wrk = wrk_path(args.wrk)
    if wrk is None:
        print("profile_server: wrk not found (apt-get download wrk libluajit-5.1-2; dpkg -x; or --wrk)")
        return 2
    import runtime
    from bench.bench_stream import catalog_root

    host_ms = [host_speed()]  # before the runs, and after them: the host's own speed (it varies with its load)
    with run_dirs(args.cache, "profile_server") as (cache, work):
        print(f"{args.ads:,} ads ({args.profile}): catalog and ROOT ...", flush=True)
        size = catalog_root(args.ads, args.dim, cache, args.profile)
        root = working_root(Path(size["root"]), work)
        bodies = request_pool(runtime.load(root, "cpu", verify=False), Path(size["catalog"]), args.pool, args.seed)
        results = [one_server("this checkout", root, args, bodies, work, wrk, {})]
        if args.baseline is not None:
            path = os.pathsep.join([str(args.baseline.resolve()), os.environ.get("PYTHONPATH", "")])
            results.append(one_server(f"baseline ({args.baseline})", root, args, bodies, work, wrk,
                                      {"PYTHONPATH": path}))
        host_ms.append(host_speed())
        report(results, host_ms)
        write_json(args.json, {"config": {k: str(v) for k, v in vars(args).items()}, "host_speed_ms": host_ms,
                               "results": results})
    return 0


if __name__ == "__main__":
    sys.exit(main())
