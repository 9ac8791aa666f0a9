"""`sidindex serve --workers N`: N HTTP front-end processes over one engine process that owns the
device (docs/design.md §19).

    clients ──HTTP──▶ front-end 1 ┐   parse, validate,        ┌──────────── engine ─────────────┐
            (one port,   ...      ├── answer (JSON, Arrow) ──▶│ fair batches across front-ends, │
             the kernel front-end N┘  ZeroMQ ipc://, Arrow IPC │ the Retriever on the GPU        │
             spreads them)                                     └─────────────────────────────────┘

The engine process (the one `sidindex serve` runs in) loads and warms the snapshot, binds the
HTTP port, serves its `runtime.server.engine.Engine` over `runtime.server.link`, and starts the
front-ends (`python -m runtime.server.frontend`), each handed a listening socket (`listen`):
parsing, validation and the answer's JSON, the work per request that one Python process can only
do on one core, run in N.
A front-end that exits unexpectedly is started again. On SIGTERM or SIGINT the engine passes the
signal on; each front-end drains as a single-process server does (`RetrievalServer.drain`), and
the engine, which answers their requests meanwhile, stops once they have exited. A front-end
whose engine is gone stops too.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time

from runtime.server.http import DRAIN_SECONDS, SWITCH_INTERVAL_S, RetrievalServer
from runtime.server.metrics import process_gone

RESTART_PAUSE_S = 1.0  # between a front-end's unexpected exit and its replacement


def serve_processes(engine, host: str, port: int, workers: int, http: dict, *, arrived: list[int] | None = None,
                    log=print) -> None:
    """Serve `engine` (a `runtime.server.engine.Engine`, not started) through `workers` front-end
    processes on host:port until SIGTERM or SIGINT (module doc), then stop it (`Engine.close`
    waits for its threads); `http`: the options of `RetrievalServer` (its drain_seconds bounds
    the stop); arrived: signals noted before this ran (they stop it at once); log: one line per event."""
    listening = listen(host, port, workers)
    place = tempfile.mkdtemp(prefix="sidindex-engine-")
    try:
        asyncio.run(_supervise(engine, listening, f"ipc://{place}/engine", workers, http, arrived or [], log))
    finally:
        for s in listening:
            s.close()
        shutil.rmtree(place, ignore_errors=True)


def listen(host: str, port: int, workers: int) -> list[socket.socket]:
    """The listening sockets of `workers` front-ends on host:port (port 0: one the kernel picks), each
    inheritable: on Linux one each, sharing the port (SO_REUSEPORT), over which the kernel spreads
    connections by a hash of their addresses; elsewhere (or for one) one they all share, where the
    busiest front-end, whose loop is awake, accepted most (30-49 of 64 over 4 on Linux) and its
    queue set every client's latency. OSError (EADDRINUSE) when the port is taken, by another
    `sidindex serve` too: the port is bound plainly first, which no socket on it lets through,
    and the shared ones only once that let go (two servers started in that instant could both
    bind)."""
    family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]
    if workers == 1 or not sys.platform.startswith("linux"):  # elsewhere SO_REUSEPORT does not spread them
        shared = socket.create_server((host, port), family=family, backlog=2048)
        shared.set_inheritable(True)
        return [shared]
    with socket.socket(family, socket.SOCK_STREAM) as probe:  # bound, never listening: it accepts nothing
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        probe.bind((host, port))
        port = probe.getsockname()[1]
    sockets: list[socket.socket] = []
    try:
        for _ in range(workers):
            sockets.append(socket.create_server((host, port), family=family, backlog=2048, reuse_port=True))
            sockets[-1].set_inheritable(True)
    except OSError:
        for s in sockets:
            s.close()
        raise
    return sockets


async def _supervise(engine, listening: list[socket.socket], address: str, workers: int, http: dict, arrived: list[int],
                     log) -> None:
    from runtime.server.link import EngineLink

    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for s in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(s, stop.set)
    if arrived:  # before these handlers
        stop.set()
    link = EngineLink(engine, address)
    await engine.start()
    link.start()
    config = {"engine": address, "parent": os.getpid(), "http": http}

    def start(i: int) -> subprocess.Popen:  # the i-th front-end, or its replacement: the i-th socket
        fd = listening[i % len(listening)].fileno()
        return subprocess.Popen([sys.executable, "-m", "runtime.server.frontend", json.dumps(config | {"fd": fd})],
                                pass_fds=(fd,))

    fronts = [] if stop.is_set() else [start(i) for i in range(workers)]  # a stop already: none to start
    try:
        while not stop.is_set():
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(stop.wait(), RESTART_PAUSE_S)
            for i, p in enumerate(fronts):
                if p.poll() is not None and not stop.is_set():
                    log(f"front-end process {p.pid} exited with status {p.returncode}; starting another")
                    process_gone(p.pid)
                    fronts[i] = start(i)
        for sock in listening:  # this process's hold on the port: once the front-ends let go, no one listens
            sock.close()
        for p in fronts:  # each drains: the engine answers its requests in flight meanwhile
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        end = time.monotonic() + http.get("drain_seconds", DRAIN_SECONDS) + 2.0
        while any(p.poll() is None for p in fronts) and time.monotonic() < end:
            await asyncio.sleep(0.05)
    finally:
        for p in fronts:
            if p.poll() is None:
                p.kill()
                p.wait()
            process_gone(p.pid)
        link.close()
        engine.stop()


def main(argv: list[str] | None = None) -> None:
    """A front-end process: `python -m runtime.server.frontend CONFIG` (JSON, from `serve_processes`)."""
    from runtime.server.link import EngineClient

    config = json.loads((sys.argv[1:] if argv is None else argv)[0])
    listening = socket.socket(fileno=config["fd"])
    server = RetrievalServer(EngineClient(config["engine"]), **config["http"])
    parent = config["parent"]

    def orphaned() -> None:  # the engine went away without a word: stop as on SIGTERM
        while os.getppid() == parent:
            time.sleep(1.0)
        os.kill(os.getpid(), signal.SIGTERM)

    threading.Thread(target=orphaned, name="sidindex-orphaned", daemon=True).start()
    sys.setswitchinterval(SWITCH_INTERVAL_S)  # a large body parsed on a thread gives the loop its turns
    gc.freeze()  # the imports' objects: out of the collector's reach (as `sidindex serve` does once warm)
    host, port = listening.getsockname()[:2]
    server.serve(host, port, sockets=[listening])


if __name__ == "__main__":
    main()
