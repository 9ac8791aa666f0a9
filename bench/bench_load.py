"""Load on `sidindex serve` over HTTP: an open-loop stream of single requests from concurrent
clients while the served ROOT changes under the server, every answer checked against a direct
retrieve on the snapshot it names.

    python bench/bench_load.py                                   # a CPU run: 20k ads, 200 req/s, 10 s a scenario
    python bench/bench_load.py --device cuda --ads 15000000 --beams 1,512,1024,1024 --rate 5000 --clients 64 \\
        --max-batch 64 --cache /data/bench_load

Catalog and ROOT: `bench_stream.catalog_root` (a generated catalog, a codebook trained on it, a
full build with k-way partitions), kept under --cache DIR and reused, else in a temporary
directory. Each run serves a working copy of that ROOT (hard links: published files are never
written again, so the cached ROOT stays a full build) through one `sidindex serve WORK_ROOT`
process (a free port; --mode, --beams, --top-k (default 100 ads per answer; 0: all),
--max-batch, --max-wait-us, --max-queue, --poll-seconds (default 0.1) passed through; on the CPU
its torch and numba threads set by --threads, default 1), from /readyz (warm) to SIGTERM (it
must drain and exit 0).

Requests: a pool of --pool distinct requests (`sidindex.sample.sample_requests`: 0..64 locations,
embeddings near catalog ads), each one JSON body {"requests": [one request]} made before any
timing, request_id its place in the pool. Each HTTP call carries one request.

Load: open loop. Send times for --rate requests/s in total over --seconds are drawn in advance
(--arrivals poisson: exponential gaps; uniform: evenly spaced) and dealt round robin to --clients
clients, each an `httpx.AsyncClient` with one keep-alive connection (opened before the clock
starts). A client sends each of its requests at its time, or as soon as its previous answer came
when that is later; latency runs from the scheduled time, so waiting behind a slow answer is
counted, not hidden. The clients run in --procs processes of their own (this script, importing
numpy and httpx only; a Python process drives a few thousand calls a second at most; by default
one per 1,000 requests/s), apart from the process that publishes and watches. Whether the
generator kept up: the generator lag, from when a client was free to send a request (its time,
or its previous answer's) to when it did (p99 reported), should stay well below the latencies;
and sends that found their client still waiting (too few --clients) are counted. Answers are
parsed after the clock stops.

Scenarios (--scenarios; default steady,publisher,corrupt), run in turn on the same server:
  steady     the load alone
  publisher  the load, and every --publish-every seconds `sidindex update WORK_ROOT --changes FILE`
             (the update path warmed first by one update of a scratch copy: numba's kernels compiled;
             the scenario's load lasts at least four such updates and 3 s for a swap, so one lands in it)
             pausing --pause ads: those a probe request just got back (top ranks first, so that
             answers before and after the swap differ), topped up with random catalog ads
  corrupt    the load; at a third of the scenario a snapshot that cannot load is published: a copy
             of the served one under a new id (its manifest re-sealed for that id, its files
             hard-linked) whose `ads` array file is a copy with one byte flipped, written and made
             CURRENT through `sidindex.root.Root.publish`, so the server never sees it but whole
             and corrupt. The server must keep serving the old snapshot and say why in /snapshot's
             last_error. At two thirds an intact copy of the served snapshot is published; the
             server must swap to it (and clear last_error).
  large      the load; at a third of the scenario one body of --large-rows requests (default 4,096,
             the server's most), which the server runs in pieces that take turns with the load's:
             the requests in flight meanwhile ("in swaps" in the table: its window) against the
             others, and the server's mean batch time, say what it cost them
Every publication keeps every snapshot (`sidindex update --keep` a million), so that each one an
answer names can be loaded for its check.

Process models (--workers, the server's option): with several values (e.g. 1,8), the first server
runs every scenario, then one server per other value runs the steady scenario and the wrk pass, and
a table sets them side by side, wrk's requests/s as a ratio of the first's.

After the scenarios, on the same server, a closed-loop pass with a client we did not write: `wrk`
(--wrk-connections connections for --seconds, the pool's bodies round robin; `bench/load_wrk.py`),
its requests/s and latency percentiles in a table of their own. Skipped with a note when wrk is
not on PATH (--wrk names another), or with --no-wrk.

Checks, after the load (the server stopped, so that checking takes nothing from it): every 200
answer's rows against `runtime.Retriever(snapshot, mode=..., beams=..., top_k=...,
batch_sizes=(1,), warm=False).retrieve([the same request])` on the snapshot the answer names
(WORK_ROOT/snapshots/<id>, `runtime.load`ed on --check-device), ad_id and rank lists equal, scores
within 1e-5; the X-Sidindex-Snapshot header equal to the body's snapshot; rows of the request sent.
A request is retrieved once per snapshot. An answer that fails any check is a mismatch (one a swap
served from a mix of snapshots would be one); a non-200 answer or a transport error is a failure.
Mismatches whose scores agree within 1e-5 rank by rank (ads of near-equal scores in another order,
or another of them at the top-k cut) are counted apart as near ties: on a GPU the float sums of a
request's scores can depend on the batch it shares, which reorders such ads.

Per scenario: requests sent, answered 200, throughput (answers/s), latency p50/p99/p99.9 (ms from
the scheduled send), failures by status, answers checked and mismatches, snapshots seen in the
answers (swaps seen: that number - 1), and p99 of requests in flight during a swap (from CURRENT
naming a new snapshot, polled every 50 ms with /snapshot, to the server serving it or refusing it)
against the others; the server's batches (mean rows per batch) and swaps from /metrics.
Output: rich tables on stdout, progress on stderr, every figure with --json PATH.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make `bench` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import httpx
import numpy as np

from bench.load_check import Checker
from bench.load_clients import JSON_HEADERS, child_clients, merged, parse_answers, schedule
from bench.load_report import load_figures, report
from bench.load_wrk import run_wrk, wrk_path
from bench.report import write_json

REPO = Path(__file__).resolve().parents[1]

# torch, runtime and the catalog helpers are imported where they are used: a client process
# imports only numpy and httpx

SCENARIOS = ("steady", "publisher", "corrupt")  # the default
CHOICES = (*SCENARIOS, "large")
CPU_BEAMS, CUDA_BEAMS = "1,16,32,32", "1,512,1024,1024"
PROC_RATE = 1000  # requests/s a client process is given by default
KEEP = 1_000_000  # retention of the working ROOT: every snapshot an answer may name stays
MONITOR_S = 0.05  # how often CURRENT and /snapshot are read during a scenario
LEAD_S = 0.5  # from the clients' READY to the first scheduled send
FIRST_UPDATE_S, LAST_UPDATE_S = 0.25, 0.5  # the publisher's updates start from, and until before the end
SWAP_MARGIN_S = 3.0  # `publisher_seconds`: the server's poll, load and warm-up of a new snapshot


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


# --- catalog, ROOT and requests -------------------------------------------------------------

@contextlib.contextmanager
def run_dirs(cache: Path | None, prefix: str) -> Iterator[tuple[Path, Path]]:
    """(the cache, a work directory in it) for one run: `cache` (a temporary one when None, removed
    after the run) keeps catalogs and ROOTs between runs; the work directory (served copies, logs)
    is removed either way."""
    given = cache is not None
    cache = cache if cache is not None else Path(tempfile.mkdtemp(prefix=f"{prefix}_"))
    cache.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix=f"{prefix}_work_", dir=cache))
    try:
        yield cache, work
    finally:
        shutil.rmtree(work if given else cache, ignore_errors=True)


def working_root(root: Path, work: Path) -> Path:
    """A copy of ROOT at work/root whose files are hard links to ROOT's (copies across file
    systems): builds and updates replace files by rename and never write a published one, so
    ROOT stays as it was. The lock file is not shared."""
    def link(src: str, dst: str) -> None:
        try:
            os.link(src, dst)
        except OSError:
            shutil.copy2(src, dst)

    return Path(shutil.copytree(root, work / "root", copy_function=link, ignore=shutil.ignore_patterns(".lock")))


def warm_updates(root: Path, work: Path, ad: int) -> float:
    """The publisher's `sidindex update` (pausing `ad`) once on a scratch copy of ROOT, dropped
    after: it compiles the update path's numba kernels into their on-disk cache and brings the
    command's modules into the page cache, as on a builder host that ran an update before. Its
    seconds: what the publisher scenario's load is sized by (`publisher_seconds`)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    scratch = work / "warm"
    scratch.mkdir()
    changes = scratch / "pause.parquet"
    pq.write_table(pa.table({"ad_id": pa.array([ad], pa.int64()), "op": ["pause"]}), changes)
    t = time.perf_counter()
    subprocess.run(update_command(working_root(root, scratch), changes), check=True, capture_output=True)
    seconds = time.perf_counter() - t
    shutil.rmtree(scratch)
    return seconds


def update_command(root: Path, changes: Path) -> list[str]:
    """The publisher's update of ROOT: the installed CLI, as an operator runs it."""
    return [sys.executable, "-m", "sidindex_cli", "update", str(root), "--changes", str(changes), "--keep", str(KEEP),
            "--json"]


def publisher_seconds(seconds: float, update_s: float) -> float:
    """The publisher scenario's load: `seconds`, or long enough for its first update to land and be
    swapped in under load (an update under load takes longer than the warm one alone: four of
    them, plus the server's warm-up of the new snapshot) on a slow or busy host. A run in which no
    swap happened would measure no swap."""
    return max(seconds, FIRST_UPDATE_S + LAST_UPDATE_S + 4 * update_s + SWAP_MARGIN_S)


def request_pool(index, catalog: Path, n: int, seed: int) -> list[bytes]:
    """n JSON bodies {"requests": [request]}, request_id i for body i (module doc)."""
    from bench.bench_stream import catalog_embeddings
    from sidindex.sample import sample_requests

    emb = catalog_embeddings(catalog)
    table = sample_requests(n, index.spec, dim=emb.shape[1], seed=seed, catalog_embedding=emb)
    rows = table.to_pylist()
    for i, r in enumerate(rows):
        r["request_id"] = i
    return [json.dumps({"requests": [r]}, separators=(",", ":")).encode() for r in rows]


# --- the server -----------------------------------------------------------------------------

def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """`sidindex serve ROOT` in a process of its own, its output in a log file; env: variables
    set for it beside this process's (e.g. PYTHONPATH, to serve another checkout); options: more
    of the command's options (e.g. --flight-port)."""

    def __init__(self, root: Path, args, log_path: Path, workers: int | None = None,
                 env: dict[str, str] | None = None, options: tuple[str, ...] = ()) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        cmd = [sys.executable, "-m", "sidindex_cli", "serve", str(Path(root).resolve()), "--port", str(self.port),
               "--device", args.device, "--mode", args.mode, "--beams", args.beams,
               "--max-batch", str(args.max_batch), "--max-wait-us", str(args.max_wait_us),
               "--max-queue", str(args.max_queue), "--poll-seconds", str(args.poll_seconds)]
        if args.top_k is not None:
            cmd += ["--top-k", str(args.top_k)]
        if workers is not None:
            cmd += ["--workers", str(workers)]
        cmd += options
        env = dict(os.environ, COLUMNS="200") | (env or {})
        # this checkout's packages after those env puts first (another checkout's): `python -m` puts
        # its working directory first on sys.path, so the server and its front-ends start in the
        # log's directory, not in a checkout (started here, a baseline ran this checkout's code)
        env["PYTHONPATH"] = os.pathsep.join(p for p in (env.get("PYTHONPATH", ""), str(REPO)) if p)
        env.pop("TRITON_INTERPRET", None)  # a serving host runs the compiled kernels
        if args.threads:
            env |= {"OMP_NUM_THREADS": str(args.threads), "NUMBA_NUM_THREADS": str(args.threads)}
        self.log_path = log_path
        self._log = open(log_path, "w")  # noqa: SIM115 (open for the process's life)
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT, env=env,
                                     cwd=Path(log_path).resolve().parent)
        self.exit_code: int | None = None

    def tail(self, lines: int = 30) -> str:
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])

    def wait_ready(self, timeout: float) -> float:
        """Seconds until /readyz answered 200 (RuntimeError with the log's tail if the process
        exits or the time runs out first)."""
        t0 = time.perf_counter()
        while time.perf_counter() - t0 < timeout:
            if self.proc.poll() is not None:
                raise RuntimeError(f"sidindex serve exited with {self.proc.returncode}:\n{self.tail()}")
            try:
                if httpx.get(self.url + "/readyz", timeout=5).status_code == 200:
                    return time.perf_counter() - t0
            except httpx.TransportError:
                pass
            time.sleep(0.2)
        raise RuntimeError(f"sidindex serve was not ready after {timeout:.0f} s:\n{self.tail()}")

    def get(self, path: str):
        r = httpx.get(self.url + path, timeout=30)
        return r.json() if path != "/metrics" else prometheus(r.text)

    def stop(self, timeout: float = 120) -> int:
        """SIGTERM, then the exit code (the server drains what is in flight and exits 0)."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except Exception:
                self.proc.kill()
                self.proc.wait()
        self._log.close()
        self.exit_code = self.proc.returncode
        return self.exit_code


def prometheus(text: str) -> dict[str, float]:
    """Prometheus text as {'name{labels}': value} (comments dropped)."""
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            out[name] = float(value)
    return out


def server_counts(m: dict[str, float]) -> dict:
    """What a scenario reports of the server's metrics (differences of two of these)."""
    out = {"swaps": m.get("sidindex_swaps_total", 0.0), "batches": m.get("sidindex_batch_requests_count", 0.0),
           "batch_rows": m.get("sidindex_batch_requests_sum", 0.0),
           "batch_seconds": m.get("sidindex_batch_seconds_sum", 0.0),
           "swap_seconds": m.get("sidindex_swap_seconds_sum", 0.0)}
    for k, v in m.items():
        if k.startswith("sidindex_requests_total{"):
            out["outcome " + k.split('"')[1]] = v
    return out


# --- what happens to the ROOT during a scenario -----------------------------------------------

def publish_copy(root: Path, source: str, corrupt: bool) -> str:
    """Publish a copy of snapshot `source` of ROOT under a new id (module doc): its manifest
    re-sealed for that id, its files hard links, except, when `corrupt`, the `ads` array's file:
    a copy with its middle byte flipped. Written and made CURRENT by `Root.publish` (a reader sees
    it whole or not at all), with nothing pruned. Returns the new id."""
    from schemas.artifacts import ARRAYS_BY_NAME, MANIFEST_FILE
    from sidindex.root import Root, new_snapshot_id
    from sidindex.snapshot.manifest import Manifest

    r = Root(root)
    src = r.snapshot_dir(source)
    m = Manifest.read(src)
    new_id = new_snapshot_id(m.input_fingerprint)
    victim = ARRAYS_BY_NAME["ads"].file

    def write(d: Path) -> None:
        for f in src.rglob("*"):
            rel = f.relative_to(src)
            if f.is_dir():
                (d / rel).mkdir(parents=True, exist_ok=True)
            elif str(rel) != MANIFEST_FILE:
                (d / rel).parent.mkdir(parents=True, exist_ok=True)
                if corrupt and str(rel) == victim:
                    data = bytearray(f.read_bytes())
                    data[len(data) // 2] ^= 0xFF
                    (d / rel).write_bytes(bytes(data))
                else:
                    os.link(f, d / rel)
        (d / MANIFEST_FILE).write_bytes(dataclasses.replace(m, id=new_id).to_bytes())

    with r.lock(create=False):
        r.publish(new_id, write, lambda d: None, KEEP, expected=r.current_id())
    return new_id


async def publisher(root: Path, url: str, start: float, seconds: float, every: float, pause: int,
                    bodies: list[bytes], ad_ids: np.ndarray, seed: int, work: Path, events: list) -> None:
    """`sidindex update` every `every` seconds until the scenario ends, pausing `pause` ads each
    (module doc); each update's id, start, end (seconds from the start), ads and errors go to
    `events`."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    rng = np.random.default_rng(seed)
    paused: set[int] = set()
    async with httpx.AsyncClient(base_url=url, timeout=60) as http:
        for n in range(1 << 30):
            due = start + FIRST_UPDATE_S + n * every
            if due > start + seconds - LAST_UPDATE_S:
                return
            await asyncio.sleep(max(0.0, due - time.monotonic()))
            probe = await http.post("/retrieve", content=bodies[rng.integers(len(bodies))], headers=JSON_HEADERS)
            returned = [r["ad_id"] for r in probe.json().get("rows", [])] if probe.status_code == 200 else []
            chosen = list(dict.fromkeys(a for a in returned if a not in paused))[:pause]
            while len(chosen) < pause and len(paused) + len(chosen) < len(ad_ids):
                a = int(ad_ids[rng.integers(len(ad_ids))])
                if a not in paused and a not in chosen:
                    chosen.append(a)
            paused.update(chosen)
            changes = work / f"pause-{n:05d}.parquet"
            pq.write_table(pa.table({"ad_id": pa.array(chosen, pa.int64()), "op": ["pause"] * len(chosen)}), changes)
            t0 = time.monotonic()
            proc = await asyncio.create_subprocess_exec(*update_command(root, changes), stdout=asyncio.subprocess.PIPE,
                                                        stderr=asyncio.subprocess.PIPE)
            out, err = await proc.communicate()
            event = {"kind": "update", "started_s": t0 - start, "finished_s": time.monotonic() - start,
                     "paused": chosen, "paused_returned": len([a for a in chosen if a in returned])}
            if proc.returncode == 0:
                event["snapshot"] = json.loads(out)["snapshot_id"]
            else:
                event["error"] = err.decode(errors="replace").strip()[-400:]
            events.append(event)


async def corrupter(root: Path, start: float, seconds: float, events: list) -> None:
    """The corrupt scenario's publications (module doc): a corrupt copy at a third, an intact
    copy of the served snapshot at two thirds."""
    from sidindex.root import Root

    loop = asyncio.get_running_loop()
    served = Root(root).current_id()
    for at, corrupt in ((seconds / 3, True), (2 * seconds / 3, False)):
        await asyncio.sleep(max(0.0, start + at - time.monotonic()))
        t0 = time.monotonic()
        new_id = await loop.run_in_executor(None, publish_copy, root, served, corrupt)
        events.append({"kind": "corrupt" if corrupt else "intact copy", "snapshot": new_id, "source": served,
                       "started_s": t0 - start, "finished_s": time.monotonic() - start})


def large_body(bodies: list[bytes], rows: int) -> bytes:
    """One JSON body of `rows` requests, the pool's in turn, request ids 0..rows-1."""
    pool = [json.loads(b)["requests"][0] for b in bodies]
    return json.dumps({"requests": [pool[i % len(pool)] | {"request_id": i} for i in range(rows)]},
                      separators=(",", ":")).encode()


async def large_request(url: str, start: float, seconds: float, body: bytes, rows: int, pool: int, events: list,
                        checked: list) -> None:
    """The large scenario's body of `rows` requests, posted at a third of the scenario (module
    doc): when it was sent and answered, its status, and how many of its requests the answer holds
    rows of; its answer, one per request as a single request's would be (`load_clients.parse_answers`:
    request i is the pool's i % pool), into `checked`, for the checker."""
    await asyncio.sleep(max(0.0, start + seconds / 3 - time.monotonic()))
    t0 = time.monotonic()
    async with httpx.AsyncClient(timeout=600) as http:
        r = await http.post(url + "/retrieve", content=body, headers=JSON_HEADERS)
    t1 = time.monotonic()
    doc = r.json() if r.status_code == 200 else None  # tens of megabytes: parsed once
    answered = 0 if doc is None else len({row["request_id"] for row in doc["rows"]})
    events.append({"kind": "large request", "rows": rows, "status": r.status_code, "requests_answered": answered,
                   "started_s": t0 - start, "finished_s": t1 - start})
    if doc is not None:
        per: list[list[dict]] = [[] for _ in range(rows)]
        for row in doc["rows"]:
            per[row["request_id"]].append(row | {"request_id": row["request_id"] % pool})
        sends = {"k": np.arange(rows) + (1 << 40), "client": np.zeros(rows, np.int64), "idx": np.arange(rows) % pool,
                 "t": np.full(rows, t0 - start)}  # k: after every single send
        raw = [(t0, t1, 200, doc["snapshot"], json.dumps({"snapshot": doc["snapshot"], "rows": p}).encode())
               for p in per]
        checked.append(parse_answers(sends, raw, start))


async def monitor(root: Path, url: str, start: float, stop: asyncio.Event, samples: list) -> None:
    """Every MONITOR_S: (seconds from the start, CURRENT's id, the id /snapshot serves, its
    last_error)."""
    from sidindex.root import Root

    r = Root(root)
    async with httpx.AsyncClient(base_url=url, timeout=30) as http:
        while not stop.is_set():
            t = time.monotonic() - start
            published = r.current_or_none()
            try:
                snap = (await http.get("/snapshot")).json()
                samples.append((t, published, snap["id"], snap["last_error"]))
            except (httpx.HTTPError, ValueError, KeyError):
                samples.append((t, published, None, None))
            try:
                await asyncio.wait_for(stop.wait(), MONITOR_S)
            except asyncio.TimeoutError:
                pass


def swap_windows(samples: list, end: float) -> list[dict]:
    """Per snapshot CURRENT came to name during the scenario: from the last sample before it did
    to the first where the server serves another snapshot than it did then (swapped to it, or
    passed it over for a newer one) or its last_error names it (refused); `end` when neither came."""
    out = []
    for i in range(1, len(samples)):
        t0, before, served, _ = samples[i - 1]
        published = samples[i][1]
        if published is None or published == before:
            continue
        window = {"snapshot": published, "from_s": t0, "until_s": end, "outcome": "pending"}
        for t, _, now, error in samples[i:]:
            if now is not None and now != served:
                window |= {"until_s": t, "outcome": "swapped" if now == published else "passed over"}
                break
            if error and published in error:
                window |= {"until_s": t, "outcome": "refused", "last_error": error}
                break
        out.append(window)
    return out


async def scenario(name: str, server: Server, root: Path, args, seconds: float, bodies: list[bytes],
                   bodies_path: Path, ad_ids: np.ndarray, seed: int, work: Path) -> tuple[dict, dict[str, np.ndarray]]:
    """One scenario's `seconds` of load and ROOT changes: its figures without the checks, and its answers."""
    sends = schedule(args.rate, seconds, args.clients, len(bodies), args.arrivals, seed)
    procs = min(args.procs, args.clients)
    before = server_counts(server.get("/metrics"))
    children = await asyncio.gather(*(
        child_clients(server.url, bodies_path, {k: v[sends["client"] % procs == p] for k, v in sends.items()},
                      args.timeout, work, f"{name}-{p}") for p in range(procs)))
    start = time.monotonic() + LEAD_S
    for proc, _ in children:
        proc.stdin.write(f"{start!r}\n".encode())
        await proc.stdin.drain()
    events, samples, stop = [], [], asyncio.Event()
    large: list[dict[str, np.ndarray]] = []  # the large body's answer, per request
    watch = asyncio.create_task(monitor(root, server.url, start, stop, samples))
    action = None
    if name == "publisher":
        action = asyncio.create_task(publisher(root, server.url, start, seconds, args.publish_every, args.pause,
                                               bodies, ad_ids, seed, work, events))
    elif name == "corrupt":
        action = asyncio.create_task(corrupter(root, start, seconds, events))
    elif name == "large":
        action = asyncio.create_task(large_request(server.url, start, seconds, large_body(bodies, args.large_rows),
                                                   args.large_rows, len(bodies), events, large))
    for proc, _ in children:
        if await proc.wait() != 0:
            raise RuntimeError(f"a client process of scenario {name} exited with {proc.returncode}")
    if action is not None:
        await action
    await asyncio.sleep(min(1.0, 4 * args.poll_seconds + 2 * MONITOR_S))  # the last publication's outcome
    stop.set()
    await watch
    answers = merged([dict(np.load(out)) for _, out in children])
    end = float(answers["done"].max()) if len(answers["done"]) else seconds
    after = server_counts(server.get("/metrics"))
    windows = swap_windows(samples, end) + [
        {"snapshot": "a large request", "from_s": e["started_s"], "until_s": e["finished_s"],
         "outcome": "answered" if e["status"] == 200 else f"status {e['status']}"}
        for e in events if e["kind"] == "large request"]
    res = {"scenario": name, "seconds": seconds, "events": events, "windows": windows,
           "server": {k: after.get(k, 0.0) - before.get(k, 0.0) for k in after},
           "snapshot_after": server.get("/snapshot")}
    res["last_errors_seen"] = sorted({s[3] for s in samples if s[3]})
    if name == "corrupt":
        res["answered_while_refused"] = answered_while_refused(answers, res["windows"], end)
    # the large body's rows are checked with the single answers (its requests are the pool's), not timed with them
    return res | load_figures(answers, res["windows"], seconds), merged([answers, *large])


def answered_while_refused(a: dict[str, np.ndarray], windows: list[dict], end: float) -> int | None:
    """200 answers that came after the server refused the corrupt snapshot and before the next
    publication (None when it was not refused)."""
    refused = next((w for w in windows if w["outcome"] == "refused"), None)
    if refused is None:
        return None
    until = min([w["from_s"] for w in windows if w["from_s"] > refused["from_s"]], default=end + 1)
    return int(((a["status"] == 200) & (a["done"] >= refused["until_s"]) & (a["done"] < until)).sum())


# --- the run, the report --------------------------------------------------------------------

async def run_scenarios(server: Server, root: Path, args, update_s: float, bodies: list[bytes], bodies_path: Path,
                        ad_ids: np.ndarray, work: Path) -> list[tuple[dict, dict]]:
    out = []
    for n, name in enumerate(args.scenarios):
        seconds = publisher_seconds(args.seconds, update_s) if name == "publisher" else args.seconds
        log(f"scenario {name}: {args.rate:g} req/s from {args.clients} clients for {seconds:g} s ...")
        out.append(await scenario(name, server, root, args, seconds, bodies, bodies_path, ad_ids, args.seed + 1 + n,
                                  work))
    return out


def wrk_pass(server: Server, args, bodies: list[bytes], work: Path) -> dict | None:
    """wrk's figures on `server` (module doc); {"missing": ...} without wrk, None with --no-wrk."""
    wrk = None if args.no_wrk else wrk_path(args.wrk)
    if wrk is None:
        return None if args.no_wrk else {"missing": args.wrk or "wrk"}
    log(f"wrk: {args.wrk_connections} connections for {args.seconds:g} s ...")
    return run_wrk(wrk, server.url, bodies, connections=args.wrk_connections, threads=args.procs,
                   seconds=args.seconds, work=work)


def stopped(server: Server) -> dict:
    """Stop `server` (SIGTERM): its exit code, its log's tail and its tracebacks."""
    code = server.stop()
    return {"server_exit": code, "server_log_tail": server.tail(10),
            "server_tracebacks": server.log_path.read_text(errors="replace").count("Traceback")}


def run(args) -> dict:
    import pyarrow.parquet as pq
    import torch

    import runtime
    from bench.bench_stream import catalog_root

    device = torch.device(args.device)
    args.check_device = args.check_device or args.device
    res = {"device": "cpu", "config": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}}
    with run_dirs(args.cache, "bench_load") as (cache, work):
        log(f"{args.ads:,} ads ({args.profile}): catalog and ROOT ...")
        size = catalog_root(args.ads, args.dim, cache, args.profile)
        res["catalog"] = {k: size[k] for k in ("ads", "dim", "profile", "sids", "nodes", "cached")}
        root = working_root(Path(size["root"]), work)
        index = runtime.load(root, "cpu", verify=False)
        bodies = request_pool(index, Path(size["catalog"]), args.pool, args.seed)
        del index
        bodies_path = work / "bodies.jsonl"
        bodies_path.write_bytes(b"\n".join(bodies) + b"\n")
        ad_ids = pq.read_table(size["catalog"], columns=["ad_id"]).column(0).to_numpy()
        res["warm_update_s"] = warm_updates(Path(size["root"]), work, int(ad_ids[0]))
        first, *others = args.workers
        log(f"sidindex serve {root} on {args.device}" + (f" --workers {first}" if first else "") + " ...")
        server = Server(root, args, work / "serve.log", first)
        try:
            res["server_ready_s"] = server.wait_ready(args.ready_timeout)
            res["served_first"] = server.get("/snapshot")["id"]
            results = asyncio.run(run_scenarios(server, root, args, res["warm_update_s"], bodies, bodies_path, ad_ids,
                                                work))
            res["wrk"] = wrk_pass(server, args, bodies, work)
        finally:
            res |= stopped(server)
        compared = []  # (workers, its server's figures, its steady scenario's (figures, answers))
        steady_only = argparse.Namespace(**vars(args) | {"scenarios": ["steady"]})
        for w in others:
            log(f"sidindex serve --workers {w}: the steady scenario and wrk, compared ...")
            other = Server(root, args, work / f"serve-{w}.log", w)
            figures: dict = {"workers": w}
            try:
                figures["server_ready_s"] = other.wait_ready(args.ready_timeout)
                (steady,) = asyncio.run(run_scenarios(other, root, steady_only, res["warm_update_s"], bodies,
                                                      bodies_path, ad_ids, work))
                figures["wrk"] = wrk_pass(other, args, bodies, work)
            finally:
                figures |= stopped(other)
            compared.append((figures, steady))
        if device.type == "cuda":  # CUDA is first initialised here, after the load: the checks run there
            res["device"] = torch.cuda.get_device_name(device)
        log("checking every answer against a direct retrieve ...")
        checker = Checker(root, args, bodies, log)
        t = time.perf_counter()
        checker.prepare([a for _, a in results] + [a for _, (_, a) in compared])
        res["scenarios"] = []
        for figures, answers in results:
            res["scenarios"].append(figures | checker.check(answers))
        res["compared"] = [figures | {"steady": steady | checker.check(answers)}
                           for figures, (steady, answers) in compared]
        res["check_s"] = time.perf_counter() - t
        res["snapshots_published"] = len(list((root / "snapshots").iterdir()))
        write_json(args.json, res)
    return res


def server_arguments(ap: argparse.ArgumentParser, *, ads: int = 20_000, device: str | None = None,
                     max_batch: int = 16, max_queue: int = 1024, poll_seconds: float = 0.1,
                     ready_timeout: float = 1800.0) -> None:
    """The options of a benchmark's catalog (`bench_stream.catalog_root`) and of the `sidindex serve`
    it starts (`Server` reads them), with the defaults given; `resolve_server_arguments` completes
    them once parsed."""
    from sidindex.sample import PROFILES  # here: the client processes import this script with numpy and httpx

    ap.add_argument("--ads", type=int, default=ads, help="catalog size (about 2 SIDs per ad)")
    ap.add_argument("--dim", type=int, default=32, help="embedding dimensions of the generated catalog")
    ap.add_argument("--profile", choices=PROFILES, default="default",
                    help="the catalog's profile (`sidindex sample --profile`): skewed puts bulk advertisers' "
                         "near-duplicate creatives under a few SIDs")
    ap.add_argument("--device", default=device, help="the server's device (default: cuda when there is one)")
    ap.add_argument("--mode", default="cd+gtm")
    ap.add_argument("--beams", help=f"beam sizes (default {CUDA_BEAMS} on CUDA, {CPU_BEAMS} on the CPU)")
    ap.add_argument("--top-k", type=int, default=100, help="the server's --top-k, ads per answer at most (0: every "
                                                           "eligible ad the search reached)")
    ap.add_argument("--max-batch", type=int, default=max_batch, help="the server's --max-batch")
    ap.add_argument("--max-wait-us", type=int, default=500, help="the server's --max-wait-us")
    ap.add_argument("--max-queue", type=int, default=max_queue, help="the server's --max-queue")
    ap.add_argument("--poll-seconds", type=float, default=poll_seconds, help="the server's --poll-seconds")
    ap.add_argument("--threads", type=int, help="the server's torch and numba threads (default: 1 on the CPU)")
    ap.add_argument("--ready-timeout", type=float, default=ready_timeout,
                    help="seconds the server may take to be warm")
    ap.add_argument("--seed", type=int, default=7)
    ap.add_argument("--cache", type=Path, help="keep the catalog and its ROOT here, and reuse them")
    ap.add_argument("--json", type=Path, help="write every figure as JSON here")


def resolve_server_arguments(args) -> str | None:
    """`server_arguments`' values completed: the device (cuda where there is one), the beams and
    threads for it, top_k 0 as None; a message when one cannot be served (exit 2)."""
    import torch

    if args.top_k is not None and args.top_k < 0:
        return f"--top-k {args.top_k}: expected at least 0"
    args.top_k = args.top_k or None
    args.device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        return "no CUDA device: run with --device cpu"
    args.beams = args.beams or (CUDA_BEAMS if args.device.startswith("cuda") else CPU_BEAMS)
    if args.threads is None and args.device == "cpu":
        args.threads = 1
    return None


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    server_arguments(ap)
    ap.add_argument("--rate", type=float, default=200.0, help="requests per second, all clients together")
    ap.add_argument("--clients", type=int, default=8, help="concurrent clients, one connection each")
    ap.add_argument("--seconds", type=float, default=10.0, help="seconds of load per scenario")
    ap.add_argument("--arrivals", choices=("poisson", "uniform"), default="poisson")
    ap.add_argument("--procs", type=int, help=f"client processes (default: one per {PROC_RATE:,} requests/s, at most "
                                              "half the cores)")
    ap.add_argument("--scenarios", type=lambda s: s.split(","), default=list(SCENARIOS),
                    help="comma-separated, of " + ", ".join(CHOICES) + " (default: " + ",".join(SCENARIOS) + ")")
    ap.add_argument("--pool", type=int, default=1024, help="distinct requests sent")
    ap.add_argument("--pause", type=int, default=4, help="ads each update of the publisher scenario pauses")
    ap.add_argument("--large-rows", type=int, default=4096, help="requests in the large scenario's body")
    ap.add_argument("--publish-every", type=float, default=1.0, help="seconds between the publisher's updates")
    ap.add_argument("--workers", type=lambda s: [int(w) for w in s.split(",")], default=[None],
                    help="the server's --workers (default: its own); several, e.g. 1,14: the first runs every "
                         "scenario, each other the steady scenario and wrk on a server of its own, in one table")
    ap.add_argument("--check-device", help="device of the direct retrieves (default: --device)")
    ap.add_argument("--timeout", type=float, default=60.0, help="seconds a request may take before it fails")
    ap.add_argument("--wrk", help="the wrk to run after the scenarios, on the same server (default: wrk on PATH)")
    ap.add_argument("--wrk-connections", type=int, default=16, help="wrk's connections (closed loop)")
    ap.add_argument("--no-wrk", action="store_true", help="no wrk pass")
    args = ap.parse_args(argv)
    unknown = [s for s in args.scenarios if s not in CHOICES]
    if unknown or not args.scenarios:
        ap.error(f"--scenarios {','.join(args.scenarios)}: choose from {', '.join(CHOICES)}")
    if args.procs is None:
        args.procs = max(1, min(-(-int(args.rate) // PROC_RATE), (os.cpu_count() or 2) // 2))
    if min(args.rate, args.seconds) <= 0 or min(args.clients, args.procs, args.pool) < 1:
        ap.error("--rate and --seconds must be positive, --clients, --procs and --pool at least 1")
    why = resolve_server_arguments(args)
    if why is not None:
        print(why, file=sys.stderr)
        return 2
    report(run(args))
    return 0


if __name__ == "__main__":
    sys.exit(main())
