"""The load benchmark's clients (`bench/bench_load.py`): a scenario's send times drawn in advance,
the client processes that send them (this module run as a script: it imports numpy and httpx only,
so a process drives a few thousand calls a second), and their answers parsed into arrays."""

from __future__ import annotations

import asyncio
import json
import sys
import time
from pathlib import Path

import httpx
import numpy as np

SNAPSHOT_HEADER = "x-sidindex-snapshot"
JSON_HEADERS = {"content-type": "application/json"}


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
    """A client process (this module as a script) driving `sends`: started, awaited until it is
    READY (its connections open); returns (process, output path)."""
    plan, out = work / f"{name}.npz", work / f"{name}.out.npz"
    np.savez(plan, **sends)
    spec = json.dumps({"url": url, "bodies": str(bodies_path), "plan": str(plan), "out": str(out), "timeout": timeout})
    proc = await asyncio.create_subprocess_exec(sys.executable, str(Path(__file__).resolve()), spec,
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


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("load_clients.py PLAN_JSON: a client process, started by bench/bench_load.py")
    sys.exit(load_child(sys.argv[1]))
