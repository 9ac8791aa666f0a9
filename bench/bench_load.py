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

Scenarios (--scenarios), run in turn on the same server:
  steady     the load alone
  publisher  the load, and every --publish-every seconds `sidindex update WORK_ROOT --changes FILE`
             pausing --pause ads: those a probe request just got back (top ranks first, so that
             answers before and after the swap differ), topped up with random catalog ads
  corrupt    the load; at a third of the scenario a snapshot that cannot load is published: a copy
             of the served one under a new id (its manifest re-sealed for that id, its files
             hard-linked) whose `ads` array file is a copy with one byte flipped, written and made
             CURRENT through `sidindex.root.Root.publish`, so the server never sees it but whole
             and corrupt. The server must keep serving the old snapshot and say why in /snapshot's
             last_error. At two thirds an intact copy of the served snapshot is published; the
             server must swap to it (and clear last_error).
Every publication keeps every snapshot (`sidindex update --keep` a million), so that each one an
answer names can be loaded for its check.

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
import dataclasses
import functools
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make `bench` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import httpx
import numpy as np

# torch, runtime and the catalog helpers are imported where they are used: a client process
# imports only numpy and httpx

SCENARIOS = ("steady", "publisher", "corrupt")
CPU_BEAMS, CUDA_BEAMS = "1,16,32,32", "1,512,1024,1024"
SNAPSHOT_HEADER = "x-sidindex-snapshot"
JSON_HEADERS = {"content-type": "application/json"}
PROC_RATE = 1000  # requests/s a client process is given by default
KEEP = 1_000_000  # retention of the working ROOT: every snapshot an answer may name stays
SCORE_TOL = 1e-5
MONITOR_S = 0.05  # how often CURRENT and /snapshot are read during a scenario
LEAD_S = 0.5  # from the clients' READY to the first scheduled send
FIRST_UPDATE_S, LAST_UPDATE_S = 0.25, 0.5  # the publisher's updates start from, and until before the end


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


# --- catalog, ROOT and requests -------------------------------------------------------------

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
    """`sidindex serve ROOT` in a process of its own, its output in a log file."""

    def __init__(self, root: Path, args, log_path: Path) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        cmd = [sys.executable, "-m", "sidindex_cli", "serve", str(root), "--port", str(self.port),
               "--device", args.device, "--mode", args.mode, "--beams", args.beams,
               "--max-batch", str(args.max_batch), "--max-wait-us", str(args.max_wait_us),
               "--max-queue", str(args.max_queue), "--poll-seconds", str(args.poll_seconds)]
        if args.top_k is not None:
            cmd += ["--top-k", str(args.top_k)]
        env = dict(os.environ, COLUMNS="200")
        env.pop("TRITON_INTERPRET", None)  # a serving host runs the compiled kernels
        if args.threads:
            env |= {"OMP_NUM_THREADS": str(args.threads), "NUMBA_NUM_THREADS": str(args.threads)}
        self.log_path = log_path
        self._log = open(log_path, "w")  # noqa: SIM115 (open for the process's life)
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT, env=env)
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
           "swap_seconds": m.get("sidindex_swap_seconds_sum", 0.0)}
    for k, v in m.items():
        if k.startswith("sidindex_requests_total{"):
            out["outcome " + k.split('"')[1]] = v
    return out


# --- the load -------------------------------------------------------------------------------

def schedule(rate: float, seconds: float, clients: int, pool: int, arrivals: str, seed: int) -> dict[str, np.ndarray]:
    """The scenario's sends, drawn in advance: t (seconds from the start, ascending), client
    (round robin) and idx (the pool's request), as arrays."""
    rng = np.random.default_rng(seed)
    expected = rate * seconds
    if arrivals == "poisson":
        t = np.cumsum(rng.exponential(1 / rate, int(expected + 6 * np.sqrt(expected) + 16)))
        t = t[t < seconds] - t[0]
    else:
        t = np.arange(max(1, round(expected))) / rate
    n = len(t)
    return {"k": np.arange(n), "t": t, "client": np.arange(n) % clients, "idx": rng.integers(0, pool, n)}


class Clients:
    """The clients of one client process: `open` (a connection each), then `run` the sends dealt
    to them from a monotonic start time; `raw` then holds (sent, done, status, header, body) per
    send (status 0: a transport error, its message as the body)."""

    def __init__(self, url: str, bodies: list[bytes], sends: dict[str, np.ndarray], timeout: float) -> None:
        self.url, self.bodies, self.sends, self.timeout = url, bodies, sends, timeout
        self.http: dict[int, httpx.AsyncClient] = {}
        self.raw: list = [None] * len(sends["k"])

    async def open(self) -> None:
        for c in np.unique(self.sends["client"]).tolist():
            self.http[c] = httpx.AsyncClient(base_url=self.url, timeout=self.timeout,
                                             limits=httpx.Limits(max_connections=1, max_keepalive_connections=1))
        await asyncio.gather(*(h.get("/healthz") for h in self.http.values()))

    async def run(self, start: float) -> None:
        client = self.sends["client"]
        await asyncio.gather(*(self._client(self.http[c], start, np.flatnonzero(client == c).tolist())
                               for c in self.http))

    async def _client(self, http: httpx.AsyncClient, start: float, mine: list[int]) -> None:
        t, idx = self.sends["t"], self.sends["idx"]
        for j in mine:
            wait = start + t[j] - time.monotonic()
            if wait > 0:
                await asyncio.sleep(wait)
            sent = time.monotonic()
            try:
                r = await http.post("/retrieve", content=self.bodies[idx[j]], headers=JSON_HEADERS)
                self.raw[j] = (sent, time.monotonic(), r.status_code, r.headers.get(SNAPSHOT_HEADER), r.content)
            except httpx.HTTPError as e:
                self.raw[j] = (sent, time.monotonic(), 0, None, f"{type(e).__name__}: {e}".encode())

    async def close(self) -> None:
        await asyncio.gather(*(h.aclose() for h in self.http.values()))


def parse_answers(sends: dict[str, np.ndarray], raw: list, start: float) -> dict[str, np.ndarray]:
    """The sends' answers as arrays: per send k, client, idx, t (scheduled), sent and done
    (seconds from the start), status, snapshot (the body's; '' unless 200), header_ok, own (every
    row is the request's), rows (row count), error (a failure's message, or what is wrong with a
    200 body that is not the contract's; '' otherwise); per row ad_id, rank, score (-inf for null)."""
    n = len(raw)
    sent, done = np.empty(n), np.empty(n)
    status = np.zeros(n, np.int32)
    snapshot, error = [""] * n, [""] * n
    header_ok, own = np.zeros(n, bool), np.zeros(n, bool)
    counts = np.zeros(n, np.int64)
    ad_id, rank, score = [], [], []
    for j, (s, d, code, header, body) in enumerate(raw):
        sent[j], done[j], status[j] = s - start, d - start, code
        try:
            doc = json.loads(body)
            if code != 200:
                error[j] = str(doc["error"])
                continue
            rows = doc["rows"]
            got = ([r["ad_id"] for r in rows], [r["rank"] for r in rows],
                   [-np.inf if r["score"] is None else r["score"] for r in rows])
            own[j] = all(r["request_id"] == int(sends["idx"][j]) for r in rows)
            snapshot[j] = str(doc["snapshot"])
        except (ValueError, KeyError, TypeError) as e:
            why = f"{type(e).__name__}: {e}" if code == 200 else body[:200].decode(errors="replace")
            error[j] = ("a 200 body not as the contract says: " if code == 200 else "") + why
            continue
        header_ok[j] = header == snapshot[j]
        counts[j] = len(rows)
        ad_id += got[0]
        rank += got[1]
        score += got[2]
    return {"k": sends["k"], "client": sends["client"], "idx": sends["idx"], "t": sends["t"], "sent": sent,
            "done": done, "status": status, "snapshot": np.array(snapshot, dtype=str), "header_ok": header_ok,
            "own": own, "rows": counts, "error": np.array(error, dtype=str), "ad_id": np.array(ad_id, np.int64),
            "rank": np.array(rank, np.int64), "score": np.array(score, np.float64)}


def merged(parts: list[dict[str, np.ndarray]]) -> dict[str, np.ndarray]:
    """Several processes' `parse_answers`, as one, in send order."""
    if len(parts) == 1:
        return parts[0]
    per_send = [k for k in parts[0] if k not in ("ad_id", "rank", "score")]
    whole = {k: np.concatenate([p[k] for p in parts]) for k in parts[0]}
    order = np.argsort(whole["k"], kind="stable")
    starts = np.concatenate([[0], np.cumsum(whole["rows"])[:-1]])
    rows = np.concatenate([np.arange(s, s + c) for s, c in zip(starts[order], whole["rows"][order])] or [[]])
    rows = rows.astype(np.int64)
    return {k: whole[k][order] for k in per_send} | {k: whole[k][rows] for k in ("ad_id", "rank", "score")}


async def child_clients(url: str, bodies_path: Path, sends: dict[str, np.ndarray], timeout: float, work: Path,
                        name: str) -> tuple:
    """A client process (this script, --load-child) driving `sends`: started, awaited until it
    is READY (its connections open); returns (process, output path)."""
    plan, out = work / f"{name}.npz", work / f"{name}.out.npz"
    np.savez(plan, **sends)
    spec = json.dumps({"url": url, "bodies": str(bodies_path), "plan": str(plan), "out": str(out), "timeout": timeout})
    proc = await asyncio.create_subprocess_exec(sys.executable, str(Path(__file__).resolve()), "--load-child", spec,
                                                stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE)
    line = await proc.stdout.readline()
    if line.strip() != b"READY":
        raise RuntimeError(f"a client process failed before the start ({await proc.wait()})")
    return proc, out


def load_child(spec: str) -> int:
    """A client process: its plan's clients opened, READY, a start time on stdin, the sends, the
    parsed answers into its output file."""
    p = json.loads(spec)
    bodies = Path(p["bodies"]).read_bytes().splitlines()
    sends = dict(np.load(p["plan"]))

    async def main() -> dict:
        clients = Clients(p["url"], bodies, sends, p["timeout"])
        await clients.open()
        print("READY", flush=True)
        start = float(await asyncio.get_running_loop().run_in_executor(None, sys.stdin.readline))
        await clients.run(start)
        await clients.close()
        return parse_answers(clients.sends, clients.raw, start)

    np.savez(p["out"], **asyncio.run(main()))
    return 0


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
            proc = await asyncio.create_subprocess_exec(
                sys.executable, "-m", "sidindex_cli", "update", str(root), "--changes", str(changes), "--keep",
                str(KEEP), "--json", stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
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


async def scenario(name: str, server: Server, root: Path, args, bodies: list[bytes], bodies_path: Path,
                   ad_ids: np.ndarray, seed: int, work: Path) -> tuple[dict, dict[str, np.ndarray]]:
    """One scenario's load and ROOT changes: its figures without the checks, and its answers."""
    sends = schedule(args.rate, args.seconds, args.clients, len(bodies), args.arrivals, seed)
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
    watch = asyncio.create_task(monitor(root, server.url, start, stop, samples))
    action = None
    if name == "publisher":
        action = asyncio.create_task(publisher(root, server.url, start, args.seconds, args.publish_every, args.pause,
                                               bodies, ad_ids, seed, work, events))
    elif name == "corrupt":
        action = asyncio.create_task(corrupter(root, start, args.seconds, events))
    for proc, _ in children:
        if await proc.wait() != 0:
            raise RuntimeError(f"a client process of scenario {name} exited with {proc.returncode}")
    if action is not None:
        await action
    await asyncio.sleep(min(1.0, 4 * args.poll_seconds + 2 * MONITOR_S))  # the last publication's outcome
    stop.set()
    await watch
    answers = merged([dict(np.load(out)) for _, out in children])
    end = float(answers["done"].max()) if len(answers["done"]) else args.seconds
    after = server_counts(server.get("/metrics"))
    res = {"scenario": name, "events": events, "windows": swap_windows(samples, end),
           "server": {k: after.get(k, 0.0) - before.get(k, 0.0) for k in after},
           "snapshot_after": server.get("/snapshot")}
    res["last_errors_seen"] = sorted({s[3] for s in samples if s[3]})
    if name == "corrupt":
        res["answered_while_refused"] = answered_while_refused(answers, res["windows"], end)
    return res | load_figures(answers, res["windows"], args), answers


def answered_while_refused(a: dict[str, np.ndarray], windows: list[dict], end: float) -> int | None:
    """200 answers that came after the server refused the corrupt snapshot and before the next
    publication (None when it was not refused)."""
    refused = next((w for w in windows if w["outcome"] == "refused"), None)
    if refused is None:
        return None
    until = min([w["from_s"] for w in windows if w["from_s"] > refused["from_s"]], default=end + 1)
    return int(((a["status"] == 200) & (a["done"] >= refused["until_s"]) & (a["done"] < until)).sum())


# --- figures and checks ---------------------------------------------------------------------

def percentiles(ms: np.ndarray) -> dict:
    if not len(ms):
        return {"p50_ms": None, "p99_ms": None, "p99.9_ms": None, "max_ms": None}
    p50, p99, p999 = np.percentile(ms, [50, 99, 99.9])
    return {"p50_ms": float(p50), "p99_ms": float(p99), "p99.9_ms": float(p999), "max_ms": float(ms.max())}


def load_figures(a: dict[str, np.ndarray], windows: list[dict], args) -> dict:
    """Throughput, latency (from the scheduled send), failures by status, send lag, snapshots
    seen and the latency of requests in flight during a swap window against the others."""
    ok = a["status"] == 200
    latency = (a["done"] - a["t"]) * 1e3
    behind, lag = generator_lag(a)
    during = np.zeros(len(ok), bool)
    for w in windows:
        during |= (a["t"] <= w["until_s"]) & (a["done"] >= w["from_s"])
    failed = {}
    for code, err in zip(a["status"][~ok].tolist(), a["error"][~ok].tolist()):
        key = "transport" if code == 0 else str(code)
        failed.setdefault(key, {"count": 0, "first": err})["count"] += 1
    seen = list(dict.fromkeys(a["snapshot"][ok][np.argsort(a["done"][ok], kind="stable")].tolist()))
    span = float(a["done"][ok].max()) if ok.any() else float("nan")
    return {"sent": int(len(ok)), "ok": int(ok.sum()), "failed": int((~ok).sum()), "errors": failed,
            "offered_rps": len(ok) / args.seconds, "throughput_rps": float(ok.sum()) / span if ok.any() else 0.0,
            "latency": percentiles(latency[ok]), "sends_behind_previous": behind,
            "generator_lag_p99_ms": float(np.percentile(lag, 99) * 1e3) if len(lag) else None,
            "rows_per_answer": float(a["rows"][ok].mean()) if ok.any() else 0.0,
            "snapshots_seen": seen, "swaps_seen": max(0, len(seen) - 1),
            "during_swaps": int((during & ok).sum()),
            "p99_during_swaps_ms": percentiles(latency[ok & during])["p99_ms"],
            "p99_other_ms": percentiles(latency[ok & ~during])["p99_ms"],
            "timeline": timeline(a, latency, lag),
            "latencies_ms": np.round(latency[ok], 3).tolist()}


def timeline(a: dict[str, np.ndarray], latency: np.ndarray, lag: np.ndarray, step: float = 0.5) -> list[dict]:
    """Per `step` seconds of scheduled send time: sends, failures, latency p50 and max of the
    answered, the generator lag's max (where a stall came from: the server or the generator)."""
    ok = a["status"] == 200
    bucket = (a["t"] // step).astype(np.int64)
    out = []
    for b in np.unique(bucket).tolist():
        m = bucket == b
        lat = latency[m & ok]
        out.append({"from_s": b * step, "sent": int(m.sum()), "failed": int((m & ~ok).sum()),
                    "p50_ms": round(float(np.median(lat)), 2) if len(lat) else None,
                    "max_ms": round(float(lat.max()), 2) if len(lat) else None,
                    "lag_max_ms": round(float(lag[m].max()) * 1e3, 2)})
    return out


def generator_lag(a: dict[str, np.ndarray]) -> tuple[int, np.ndarray]:
    """Sends whose client was still waiting for its previous answer at the scheduled time (too
    few clients for the rate and latency), and per send the seconds from when its client was
    free to send it (its time, or its previous answer's) to when it did, in send order: the
    generator's own delay, which should stay well below the latencies measured."""
    order = np.lexsort((a["k"], a["client"]))
    client, t, done, sent = a["client"][order], a["t"][order], a["done"][order], a["sent"][order]
    previous = np.concatenate([[-np.inf], done[:-1]])
    previous[np.concatenate([[True], client[1:] != client[:-1]])] = -np.inf
    lag = np.empty(len(order))
    lag[order] = sent - np.maximum(t, previous)
    return int((previous > t).sum()), lag


class Checker:
    """Direct retrieves on the snapshots answers name (module doc), one per (snapshot, request)."""

    def __init__(self, root: Path, args, bodies: list[bytes]) -> None:
        self.root, self.args = root, args
        self.requests = [json.loads(b)["requests"][0] for b in bodies]
        self.refs: dict[str, dict[int, tuple]] = {}
        self.missing: dict[str, str] = {}
        self._base = None

    def prepare(self, answers: list[dict[str, np.ndarray]]) -> None:
        """Retrieve every (snapshot, request) pair an answer needs, snapshot by snapshot."""
        import runtime

        need: dict[str, set[int]] = {}
        for a in answers:
            ok = a["status"] == 200
            for s, i in zip(a["snapshot"][ok].tolist(), a["idx"][ok].tolist()):
                if i not in self.refs.get(s, {}):
                    need.setdefault(s, set()).add(i)
        for s, idx in need.items():
            path = self.root / "snapshots" / s
            try:
                index = runtime.load(path, self.args.check_device, base=self._base)
            except Exception as e:  # an answer naming a snapshot that cannot be loaded: every one a mismatch
                self.missing[s] = f"{type(e).__name__}: {e}".splitlines()[0]
                continue
            self._base = index
            idx = sorted(idx)
            log(f"  checking: {len(idx)} requests on snapshot {s}")
            retriever = runtime.Retriever(index, mode=self.args.mode, beams=self.args.beams, top_k=self.args.top_k,
                                          batch_sizes=(1,), warm=False)
            table = retriever.retrieve([self.requests[i] for i in idx], source="pool requests")
            rid = table.column("request_id").to_numpy()
            ad, rank = table.column("ad_id").to_numpy(), table.column("rank").to_numpy()
            score = table.column("score").to_numpy(zero_copy_only=False)
            bounds = np.searchsorted(rid, np.concatenate([idx, [np.iinfo(np.int64).max]]))  # rows by request, sorted
            refs = self.refs.setdefault(s, {})
            for j, i in enumerate(idx):
                lo, hi = bounds[j], bounds[j + 1]
                refs[i] = (ad[lo:hi].astype(np.int64), rank[lo:hi].astype(np.int64), score[lo:hi].astype(np.float64))

    def check(self, a: dict[str, np.ndarray]) -> dict:
        """Every 200 answer of a scenario against its reference: checked, mismatches, those of
        them that are near ties (`difference`), the first few described, and per pool request with
        a mismatch [its mismatches, its answers] (one that differs whatever batch it shared, or now
        and then)."""
        ok = np.flatnonzero(a["status"] == 200)
        starts = np.concatenate([[0], np.cumsum(a["rows"])])
        bad, ties, samples, requests = 0, 0, [], {}
        for j in ok.tolist():
            s, i = str(a["snapshot"][j]), int(a["idx"][j])
            lo, hi = starts[j], starts[j + 1]
            why, tie = None, False
            if a["error"][j]:
                why = str(a["error"][j])
            elif s in self.missing:
                why = f"names snapshot {s}, which does not load: {self.missing[s]}"
            elif not a["header_ok"][j]:
                why = "its X-Sidindex-Snapshot header is not its body's snapshot"
            elif not a["own"][j]:
                why = "holds rows of another request_id"
            else:
                why, tie = difference(a["ad_id"][lo:hi], a["rank"][lo:hi], a["score"][lo:hi], *self.refs[s][i])
            if why:
                bad, ties = bad + 1, ties + tie
                requests[i] = requests.get(i, 0) + 1
                if len(samples) < 5:
                    samples.append(f"send {int(a['k'][j])} (request {i}, snapshot {s}): {why}")
        answered = np.bincount(a["idx"][ok], minlength=len(self.requests))
        return {"checked": len(ok), "mismatches": bad, "near_ties": ties, "mismatch_samples": samples,
                "mismatched_requests": {str(i): [n, int(answered[i])] for i, n in sorted(requests.items())}}


def difference(ad: np.ndarray, rank: np.ndarray, score: np.ndarray, want_ad: np.ndarray, want_rank: np.ndarray,
               want_score: np.ndarray) -> tuple[str | None, bool]:
    """How an answer's rows differ from the direct retrieve's, in words (None: they agree): the
    first row where they part, both sides' ad and score there, and whether the ads are the same
    set; and whether the difference is a near tie: rank by rank the scores agree within 1e-5, and
    so do those of every ad both hold (ads of near-equal scores in another order, or another of
    them at the top-k cut: what float sums that depend on the batch give)."""
    close = functools.partial(np.isclose, rtol=SCORE_TOL, atol=SCORE_TOL)
    if np.array_equal(ad, want_ad) and np.array_equal(rank, want_rank):
        if close(score, want_score).all():
            return None, False
        j = int(np.argmax(~close(score, want_score)))
        return (f"scores differ from the direct retrieve beyond 1e-5 (rank {rank[j]}: {score[j]:.9g} against "
                f"{want_score[j]:.9g})"), False
    n = min(len(ad), len(want_ad))
    j = int(np.argmax((ad[:n] != want_ad[:n]) | (rank[:n] != want_rank[:n]))) if n else 0
    if n and ad[j] == want_ad[j] and rank[j] == want_rank[j]:
        j = n  # one is a prefix of the other
    here = f"ad {ad[j]} score {score[j]:.7g}" if j < len(ad) else "nothing"
    there = f"ad {want_ad[j]} score {want_score[j]:.7g}" if j < len(want_ad) else "nothing"
    theirs = dict(zip(want_ad.tolist(), want_score.tolist()))
    common = [(x, theirs[a]) for a, x in zip(ad.tolist(), score.tolist()) if a in theirs]
    tie = len(ad) == len(want_ad) and bool(close(score, want_score).all()) and \
        all(close(x, y) for x, y in common) and np.array_equal(rank, want_rank)
    same = "the same ads in another order" if sorted(ad.tolist()) == sorted(want_ad.tolist()) else \
        f"{len(set(ad.tolist()) ^ set(want_ad.tolist()))} ads in one only"
    return (f"{'near tie: ' if tie else ''}ads differ from the direct retrieve ({len(ad)} rows against "
            f"{len(want_ad)}; from row {j}: {here} against {there}; {same})"), tie


# --- the run, the report --------------------------------------------------------------------

async def run_scenarios(server: Server, root: Path, args, bodies: list[bytes], bodies_path: Path,
                        ad_ids: np.ndarray, work: Path) -> list[tuple[dict, dict]]:
    out = []
    for n, name in enumerate(args.scenarios):
        log(f"scenario {name}: {args.rate:g} req/s from {args.clients} clients for {args.seconds:g} s ...")
        out.append(await scenario(name, server, root, args, bodies, bodies_path, ad_ids, args.seed + 1 + n, work))
    return out


def run(args) -> dict:
    import pyarrow.parquet as pq
    import torch

    import runtime
    from bench.bench_stream import catalog_root

    device = torch.device(args.device)
    args.beams = args.beams or (CUDA_BEAMS if device.type == "cuda" else CPU_BEAMS)
    if args.threads is None and device.type == "cpu":
        args.threads = 1
    args.check_device = args.check_device or args.device
    cache = args.cache or Path(tempfile.mkdtemp(prefix="bench_load_"))
    res = {"device": "cpu", "config": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()
                                       if k != "load_child"}}
    work = None
    try:
        log(f"{args.ads:,} ads: catalog and ROOT ...")
        size = catalog_root(args.ads, args.dim, cache)
        res["catalog"] = {k: size[k] for k in ("ads", "dim", "sids", "nodes", "cached")}
        work = Path(tempfile.mkdtemp(prefix="bench_load_work_", dir=cache))
        root = working_root(Path(size["root"]), work)
        index = runtime.load(root, "cpu", verify=False)
        bodies = request_pool(index, Path(size["catalog"]), args.pool, args.seed)
        del index
        bodies_path = work / "bodies.jsonl"
        bodies_path.write_bytes(b"\n".join(bodies) + b"\n")
        ad_ids = pq.read_table(size["catalog"], columns=["ad_id"]).column(0).to_numpy()
        log(f"sidindex serve {root} on {args.device} ...")
        server = Server(root, args, work / "serve.log")
        try:
            res["server_ready_s"] = server.wait_ready(args.ready_timeout)
            res["served_first"] = server.get("/snapshot")["id"]
            results = asyncio.run(run_scenarios(server, root, args, bodies, bodies_path, ad_ids, work))
        finally:
            res["server_exit"] = server.stop()
            log_text = server.log_path.read_text(errors="replace")
            res["server_log_tail"] = server.tail(10)
            res["server_tracebacks"] = log_text.count("Traceback")
        if device.type == "cuda":  # CUDA is first initialised here, after the load: the checks run there
            res["device"] = torch.cuda.get_device_name(device)
        log("checking every answer against a direct retrieve ...")
        checker = Checker(root, args, bodies)
        t = time.perf_counter()
        checker.prepare([a for _, a in results])
        res["scenarios"] = []
        for figures, answers in results:
            res["scenarios"].append(figures | checker.check(answers))
        res["check_s"] = time.perf_counter() - t
        res["snapshots_published"] = len(list((root / "snapshots").iterdir()))
        if args.json:
            args.json.write_text(json.dumps(res, indent=1))
    finally:
        if args.cache is None:
            shutil.rmtree(cache, ignore_errors=True)
        elif work is not None:
            shutil.rmtree(work, ignore_errors=True)
    return res


def ms(v) -> str:
    return "-" if v is None else f"{v:.1f}"


def report(res: dict, console=None) -> None:
    from rich.console import Console
    from rich.table import Table

    console = console or Console(width=None if sys.stdout.isatty() else 220)
    c, cat = res["config"], res["catalog"]
    for s in res["scenarios"]:
        t = Table(title=f"{s['scenario']}: {cat['ads']:,} ads ({res['device']}), {c['mode']}, beams {c['beams']}, "
                        f"{c['rate']:g} req/s offered ({c['arrivals']}) from {c['clients']} clients for "
                        f"{c['seconds']:g} s, max batch {c['max_batch']}; ms from the scheduled send",
                  title_justify="left")
        for col in ("sent", "ok", "req/s", "p50", "p99", "p99.9", "max", "failed", "checked", "mismatches",
                    "swaps seen", "p99 in swaps", "p99 other", "in swaps", "rows/answer", "rows/batch",
                    "gen lag p99"):
            t.add_column(col, justify="right")
        lat, srv = s["latency"], s["server"]
        failed = ", ".join(f"{k}: {v['count']}" for k, v in s["errors"].items()) or "0"
        per_batch = f"{srv['batch_rows'] / srv['batches']:.1f}" if srv.get("batches") else "-"
        t.add_row(str(s["sent"]), str(s["ok"]), f"{s['throughput_rps']:,.0f}", ms(lat["p50_ms"]), ms(lat["p99_ms"]),
                  ms(lat["p99.9_ms"]), ms(lat["max_ms"]), failed, str(s["checked"]),
                  f"{s['mismatches']} ({s['near_ties']} ties)" if s["near_ties"] else str(s["mismatches"]),
                  str(s["swaps_seen"]), ms(s["p99_during_swaps_ms"]), ms(s["p99_other_ms"]), str(s["during_swaps"]),
                  f"{s['rows_per_answer']:.1f}", per_batch, ms(s["generator_lag_p99_ms"]))
        console.print(t)
        for line in scenario_notes(s):
            console.print("  " + line, highlight=False)
    console.print(f"server: ready {res['server_ready_s']:.1f} s after start; exit code {res['server_exit']} on "
                  f"SIGTERM; {res['server_tracebacks']} tracebacks in its log; checks {res['check_s']:.1f} s",
                  highlight=False)
    for s in res["scenarios"]:
        for ok, line in verdicts(s):
            console.print(f"{'PASS' if ok else 'MISS'}  {s['scenario']}: {line}", highlight=False)


def scenario_notes(s: dict) -> list[str]:
    out = []
    updates = [e for e in s["events"] if e["kind"] == "update"]
    if updates:
        took = np.mean([e["finished_s"] - e["started_s"] for e in updates])
        failed = [e for e in updates if "error" in e]
        out.append(f"publisher: {len(updates) - len(failed)} updates published ({took:.2f} s each), "
                   f"{sum(len(e['paused']) for e in updates)} ads paused, "
                   f"{sum(e['paused_returned'] for e in updates)} of them just returned by a probe"
                   + (f"; {len(failed)} failed: {failed[0]['error'].splitlines()[-1]}" if failed else ""))
    for w in s["windows"]:
        out.append(f"{w['snapshot']}: published at {w['from_s']:.2f} s, {w['outcome']} at {w['until_s']:.2f} s")
    srv = s["server"]
    if srv["swaps"]:
        out.append(f"server: {srv['swaps']:.0f} swaps, {srv['swap_seconds'] / srv['swaps']:.2f} s each to load and "
                   "warm (sidindex_swap_seconds)")
    if s["last_errors_seen"]:
        out.append(f"/snapshot last_error: {s['last_errors_seen'][0]}")
    for k, v in s["errors"].items():
        out.append(f"failed ({k}): {v['count']}, the first: {v['first']}")
    if s["sends_behind_previous"] > 0.01 * s["sent"]:
        out.append(f"{s['sends_behind_previous']} sends waited for their client's previous answer (latency counts the "
                   "wait; more --clients would have sent them on time)")
    if s["mismatched_requests"]:
        out.append(f"mismatches came from {len(s['mismatched_requests'])} pool requests (mismatches/answers): "
                   + ", ".join(f"{i}: {n}/{m}" for i, (n, m) in list(s["mismatched_requests"].items())[:12]))
    out += [f"mismatch: {m}" for m in s["mismatch_samples"]]
    return out


def verdicts(s: dict) -> list[tuple[bool, str]]:
    """What a user relies on, per scenario."""
    ties = f" ({s['near_ties']} of them near ties: the same scores within 1e-5 rank by rank, ads of near-equal " \
        "scores in another order)" if s["near_ties"] else ""
    out = [(s["checked"] == s["ok"] > 0 and s["mismatches"] == 0,
            f"{s['checked']} answers checked, {s['mismatches']} differ from a direct retrieve on the snapshot they "
            f"name{ties}"),
           (s["failed"] == 0, f"{s['failed']} of {s['sent']} requests failed")]
    if s["scenario"] == "publisher":
        out.append((s["swaps_seen"] >= 1, f"{s['swaps_seen']} swaps seen in the answers"))
    if s["scenario"] == "corrupt":
        corrupt = {e["snapshot"] for e in s["events"] if e["kind"] == "corrupt"}
        refused = [w for w in s["windows"] if w["snapshot"] in corrupt and w["outcome"] == "refused"]
        served = corrupt & set(s["snapshots_seen"])
        why = refused[0]["last_error"].rpartition(": ")[2] if refused else None
        out.append((len(refused) == len(corrupt) > 0 and not served,
                    f"the corrupt snapshot was {'served' if served else 'refused' if refused else 'not refused'}"
                    + (f", /snapshot's last_error set ('... {why}')" if why else "")))
        out.append((bool(s.get("answered_while_refused")),
                    f"{s.get('answered_while_refused')} answers from the old snapshot after the refusal"))
        intact = {e["snapshot"] for e in s["events"] if e["kind"] == "intact copy"}
        recovered = intact & set(s["snapshots_seen"]) and s["snapshot_after"]["last_error"] is None
        out.append((bool(recovered), "an intact snapshot published next was served, last_error cleared" if recovered
                    else "an intact snapshot published next was not served"))
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--ads", type=int, default=20_000, help="catalog size (about 2 SIDs per ad)")
    ap.add_argument("--dim", type=int, default=32, help="embedding dimensions of the generated catalog")
    ap.add_argument("--device", default=None, help="the server's device (default: cuda when there is one)")
    ap.add_argument("--mode", default="cd+gtm")
    ap.add_argument("--beams", help=f"beam sizes (default {CUDA_BEAMS} on CUDA, {CPU_BEAMS} on the CPU)")
    ap.add_argument("--top-k", type=int, default=100, help="the server's --top-k, ads per answer at most (0: every "
                                                           "eligible ad the search reached)")
    ap.add_argument("--rate", type=float, default=200.0, help="requests per second, all clients together")
    ap.add_argument("--clients", type=int, default=8, help="concurrent clients, one connection each")
    ap.add_argument("--seconds", type=float, default=10.0, help="seconds of load per scenario")
    ap.add_argument("--arrivals", choices=("poisson", "uniform"), default="poisson")
    ap.add_argument("--procs", type=int, help=f"client processes (default: one per {PROC_RATE:,} requests/s, at most "
                                              "half the cores)")
    ap.add_argument("--scenarios", type=lambda s: s.split(","), default=list(SCENARIOS),
                    help="comma-separated, of " + ", ".join(SCENARIOS))
    ap.add_argument("--pool", type=int, default=1024, help="distinct requests sent")
    ap.add_argument("--pause", type=int, default=4, help="ads each update of the publisher scenario pauses")
    ap.add_argument("--publish-every", type=float, default=1.0, help="seconds between the publisher's updates")
    ap.add_argument("--max-batch", type=int, default=16, help="the server's --max-batch")
    ap.add_argument("--max-wait-us", type=int, default=500, help="the server's --max-wait-us")
    ap.add_argument("--max-queue", type=int, default=1024, help="the server's --max-queue")
    ap.add_argument("--poll-seconds", type=float, default=0.1, help="the server's --poll-seconds")
    ap.add_argument("--threads", type=int, help="the server's torch and numba threads (default: 1 on the CPU)")
    ap.add_argument("--check-device", help="device of the direct retrieves (default: --device)")
    ap.add_argument("--timeout", type=float, default=60.0, help="seconds a request may take before it fails")
    ap.add_argument("--ready-timeout", type=float, default=1800.0, help="seconds the server may take to be warm")
    ap.add_argument("--seed", type=int, default=7)
    ap.add_argument("--cache", type=Path, help="keep the catalog and its ROOT here, and reuse them")
    ap.add_argument("--json", type=Path, help="write every figure as JSON here")
    ap.add_argument("--load-child", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.load_child:
        return load_child(args.load_child)
    unknown = [s for s in args.scenarios if s not in SCENARIOS]
    if unknown or not args.scenarios:
        ap.error(f"--scenarios {','.join(args.scenarios)}: choose from {', '.join(SCENARIOS)}")
    if args.procs is None:
        args.procs = max(1, min(-(-int(args.rate) // PROC_RATE), (os.cpu_count() or 2) // 2))
    if min(args.rate, args.seconds) <= 0 or min(args.clients, args.procs, args.pool) < 1 or args.top_k < 0:
        ap.error("--rate and --seconds must be positive, --clients, --procs and --pool at least 1, --top-k at least 0")
    args.top_k = args.top_k or None
    import torch

    args.device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        print("no CUDA device: run with --device cpu (the default without one)", file=sys.stderr)
        return 2
    report(run(args))
    return 0


if __name__ == "__main__":
    sys.exit(main())
