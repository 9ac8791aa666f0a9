"""The load benchmark's pass with a client we did not write (`bench/bench_load.py --wrk`): `wrk`
(the Debian package; on a host without it, unpack its .deb and libluajit-5.1-2's with `dpkg -x`)
posting JSON bodies of one request each, closed loop: each of its connections sends the next
request once the last was answered, as fast as the server answers. A Lua script deals the
bodies round robin (a pool of distinct requests, not one replayed). What wrk measures is its
own: requests/s, latency percentiles from its --latency histogram, and non-2xx answers. Its
answers are not checked (the open-loop scenarios check every answer).
"""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

_UNITS = {"us": 1e-3, "ms": 1.0, "s": 1e3, "m": 6e4}


def wrk_path(given: str | None) -> str | None:
    """The wrk to run: `given` (a path or a name on PATH), or wrk on PATH; None when there is none."""
    return shutil.which(given or "wrk")


def lua_script(bodies: list[bytes]) -> str:
    """A wrk script posting `bodies` (JSON, one request each) round robin to /retrieve."""
    items = []
    for b in bodies:
        text = b.decode()
        assert "]==]" not in text  # the long bracket closing each body
        items.append(f"[==[{text}]==]")
    return ("wrk.method = \"POST\"\n"
            "wrk.headers[\"Content-Type\"] = \"application/json\"\n"
            f"local bodies = {{{', '.join(items)}}}\n"
            "local i = 0\n"
            "request = function()\n"
            "  i = i % #bodies + 1\n"
            "  return wrk.format(nil, \"/retrieve\", nil, bodies[i])\n"
            "end\n")


def parse(output: str) -> dict:
    """wrk's report (with --latency) as figures: requests, requests/s, p50/p90/p99 ms, non-2xx
    answers and socket errors. ValueError when it holds no requests/s line."""
    rps = re.search(r"Requests/sec:\s+([\d.]+)", output)
    if rps is None:
        raise ValueError(f"wrk printed no Requests/sec line:\n{output[-2000:]}")
    done = re.search(r"(\d+) requests in", output)
    pct = {f"p{p}_ms": float(v) * _UNITS[u]
           for p, v, u in re.findall(r"^\s+(\d+)%\s+([\d.]+)(us|ms|s|m)\s*$", output, re.M)}
    non2xx = re.search(r"Non-2xx or 3xx responses:\s+(\d+)", output)
    errors = re.search(r"Socket errors: connect (\d+), read (\d+), write (\d+), timeout (\d+)", output)
    return {"requests": int(done.group(1)) if done else None, "rps": float(rps.group(1)),
            "p50_ms": pct.get("p50_ms"), "p90_ms": pct.get("p90_ms"), "p99_ms": pct.get("p99_ms"),
            "non_2xx": int(non2xx.group(1)) if non2xx else 0,
            "socket_errors": sum(map(int, errors.groups())) if errors else 0}


def run_wrk(wrk: str, url: str, bodies: list[bytes], *, connections: int, threads: int, seconds: float,
            work: Path) -> dict:
    """wrk against `url` for `seconds` with `connections` connections over `threads` threads,
    posting `bodies`: its figures (`parse`) and the command line."""
    script = work / "wrk_post.lua"
    script.write_text(lua_script(bodies))
    cmd = [wrk, f"-t{max(1, min(threads, connections))}", f"-c{connections}", f"-d{max(1, round(seconds))}s",
           "--latency", "-s", str(script), url]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=seconds + 60)
    if out.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} exited with {out.returncode}: {out.stderr.strip()[-500:]}")
    return parse(out.stdout) | {"command": " ".join(cmd[:-3] + ["wrk_post.lua", url]), "connections": connections,
                                "threads": threads, "seconds": seconds}
