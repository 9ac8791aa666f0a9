"""The load benchmark's pass with `wrk` (bench/load_wrk.py): its report read into figures, and wrk
posting a pool of JSON bodies to a real `sidindex serve` with every answer a 200, where wrk is
installed or its Debian package can be fetched for the run."""

from __future__ import annotations

import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from bench.load_wrk import lua_script, parse, run_wrk, wrk_path

REPORT = """Running 2s test @ http://127.0.0.1:8000
  2 threads and 16 connections
  Thread Stats   Avg      Stdev     Max   +/- Stdev
    Latency     2.10ms    1.00ms  40.00ms   90.00%
  Latency Distribution
     50%  850.00us
     75%    1.50ms
     90%    2.25ms
     99%    1.20s
  12345 requests in 2.00s, 9.87MB read
  Socket errors: connect 0, read 2, write 0, timeout 1
  Non-2xx or 3xx responses: 7
Requests/sec:   6172.50
Transfer/sec:      4.93MB
"""


def test_the_report_becomes_figures_in_ms():
    assert parse(REPORT) == {"requests": 12345, "rps": 6172.5, "p50_ms": 0.85, "p90_ms": 2.25, "p99_ms": 1200.0,
                             "non_2xx": 7, "socket_errors": 3}
    with pytest.raises(ValueError, match="no Requests/sec"):
        parse("unable to connect to 127.0.0.1:1 Connection refused")


def test_the_script_deals_every_body_as_it_is():
    bodies = [json.dumps({"requests": [{"request_id": i, "note": "]] [[ \"x\""}]}).encode() for i in range(3)]
    script = lua_script(bodies)
    assert all(f"[==[{b.decode()}]==]" in script for b in bodies) and "i % #bodies + 1" in script


def _unpacked_wrk(dest: Path) -> str | None:
    """wrk and its LuaJIT from the Debian packages, unpacked under dest without root (`apt-get
    download`, `dpkg -x`), behind a script that points the loader at them; None where apt-get or
    dpkg is missing or the download fails (no package index, no registry)."""
    if shutil.which("apt-get") is None or shutil.which("dpkg") is None:
        return None
    try:
        subprocess.run(["apt-get", "download", "wrk", "libluajit-5.1-2"], cwd=dest, check=True, capture_output=True,
                       timeout=60)
        for deb in dest.glob("*.deb"):
            subprocess.run(["dpkg", "-x", str(deb), str(dest / "root")], check=True, capture_output=True, timeout=60)
    except (OSError, subprocess.SubprocessError):
        return None
    binary = dest / "root" / "usr" / "bin" / "wrk"
    if not binary.exists():
        return None
    libs = ":".join(sorted({str(f.parent) for f in (dest / "root").rglob("libluajit*.so*")}))
    loader = f'LD_LIBRARY_PATH={shlex.quote(libs)}"${{LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}}" ' if libs else ""
    wrapper = dest / "wrk"
    wrapper.write_text(f'#!/bin/sh\n{loader}exec {shlex.quote(str(binary))} "$@"\n')
    wrapper.chmod(0o755)
    try:  # it runs here (its libraries found): `wrk -v` prints its version, and exits 1
        probe = subprocess.run([str(wrapper), "-v"], capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    return str(wrapper) if (probe.stdout + probe.stderr).startswith("wrk ") else None


@pytest.fixture(scope="module")
def wrk(tmp_path_factory) -> str:
    """wrk on PATH, else the Debian packages fetched for this run: the CI image does not carry it."""
    found = wrk_path(None) or _unpacked_wrk(tmp_path_factory.mktemp("wrk"))
    if found is None:
        pytest.skip("wrk is not installed (the Debian package wrk), and apt-get could not fetch it")
    return found


def test_wrk_gets_only_answers_from_the_console_script(wrk, sample_dir, tmp_path):
    from tests.test_retrieve import CONFIG, build_root
    from tests.test_server import _free_port, _wait_ready

    root = build_root(sample_dir, tmp_path, CONFIG)
    rows = pq.read_table(sample_dir / "requests.parquet").slice(0, 8).to_pylist()
    bodies = [json.dumps({"requests": [r]}).encode() for r in rows]
    port = _free_port()
    p = subprocess.Popen([str(Path(sys.executable).parent / "sidindex"), "serve", str(root), "--port", str(port),
                          "--beams", "1,8,16,16"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         env=os.environ | {"COLUMNS": "200"})
    try:
        _wait_ready(port)
        got = run_wrk(wrk, f"http://127.0.0.1:{port}", bodies, connections=4, threads=1, seconds=2,
                      work=tmp_path)
    finally:
        p.send_signal(signal.SIGTERM)
        _, err = p.communicate(timeout=60)
    assert p.returncode == 0 and "Traceback" not in err, err
    assert got["requests"] > 4 and got["rps"] > 0 and got["non_2xx"] == 0 and got["socket_errors"] == 0
    assert got["p50_ms"] <= got["p99_ms"]
