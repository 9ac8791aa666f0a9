"""Commands that run the serving path: `retrieve`, `simulate`, `serve`."""

from __future__ import annotations

import gc
import os
import shutil
import signal
import sys
import time
from pathlib import Path
from typing import Optional

import typer

from sidindex.errors import ConfigError
from sidindex.modes import Mode, parse_mode, served_modes
from sidindex_cli.options import (
    BEAMS_OPT,
    DEVICE_OPT,
    JSON_OPT,
    SNAPSHOT_ARG,
    TRUST_KEY_OPT,
    output_file,
    progress_bar,
    write_table,
)
from sidindex_cli.render import emit, err, print_study

SCORER_OPT = typer.Option(
    None, "--scorer", metavar="MODULE:FACTORY",
    help="Your model as the scorer: FACTORY(batch: pyarrow.Table, device, level_sizes) -> scorer(step, tokens, "
         "parent) -> logits, MODULE importable from the working directory or PYTHONPATH; `batch` holds the "
         "batch's request rows with every column of the request file. Default: the codebook scorer.")
SCORER_TIMEOUT_OPT = typer.Option(
    None, "--scorer-timeout", min=0.001, metavar="SECONDS",
    help="With --scorer: the most any one call into your module (its import, the factory, a scorer step) may "
         "take; a call still running then stops the command with one line naming it (exit 2). Default: no limit.")
VALUE_WEIGHT_OPT = typer.Option(
    0.0, "--value-weight", min=0.0, metavar="LAMBDA",
    help="Value-guided search: keep the beams with the best log-probability + LAMBDA x log(value bound), the bound "
         "being the largest value of an ad under the prefix that can pass (1 ranks prefixes by probability x value). "
         "Needs a snapshot built from a catalog with a `value` column. 0: by log-probability alone.")
MODE_OPT = typer.Option("cd+gtm", "--mode", help=" | ".join(m.value for m in Mode) + " (a mode that tests k-way "
                        "partitions needs a snapshot built with \\[kway]).")
TOP_K_OPT = typer.Option(None, "--top-k", min=1, help="Keep at most K ads per request (default: every eligible ad "
                         "the search reached).")
RANK_OPT = typer.Option("score", "--rank", help="Rank each request's ads by score (best log-probability), value (the "
                        "ad's `value`) or fused (reciprocal-rank fusion of both).")
app = typer.Typer()


@app.command()
def retrieve(
    snapshot: Path = SNAPSHOT_ARG,
    requests: Path = typer.Option(..., "--requests", help="Request table (Parquet or Arrow IPC) with an `embedding` "
                                  "column for the codebook scorer, see schemas/CONTRACTS.md."),
    out_file: Path = typer.Option(..., "--out", callback=output_file,
                                  help="Output file: .parquet, or Arrow IPC otherwise. Columns "
                                  "request_id, rank, ad_id, sid, score, and value with ad values."),
    mode: str = MODE_OPT,
    beams: str = BEAMS_OPT,
    device: str = DEVICE_OPT,
    top_k: Optional[int] = TOP_K_OPT,
    batch_size: int = typer.Option(16, "--batch-size", min=1, help="Requests searched together."),
    scorer: Optional[str] = SCORER_OPT,
    scorer_timeout: Optional[float] = SCORER_TIMEOUT_OPT,
    value_weight: float = VALUE_WEIGHT_OPT,
    rank: str = RANK_OPT,
    trust_key: Optional[Path] = TRUST_KEY_OPT,
    as_json: bool = JSON_OPT,
) -> None:
    """Retrieve eligible ads: constrained beam search over SIDs, then SID -> ads and the exact filter.

    Logits come from your model (--scorer MODULE:FACTORY) or the codebook scorer (the request
    embedding's distance to each level's centroids; the hash level is uniform). Every returned ad
    is eligible; a request whose beams all die under the constraints gets fewer (or no) ads,
    counted in the summary; the search never falls back to unconstrained decoding.
    """

    import runtime

    chosen = parse_mode(mode)  # a typo fails before the snapshot loads; retrieve checks it against the index
    factory = _factory(scorer, scorer_timeout)  # so does a module that cannot be imported
    t0 = time.perf_counter()
    index = runtime.load(snapshot, device, verify=False, trust_key=trust_key)  # a key: the digests too
    beam_sizes = runtime.parse_beams(beams, index.sid_length)
    reqs = runtime.read_requests(requests, index)
    load_s = time.perf_counter() - t0
    with progress_bar(not as_json and err.is_terminal) as progress:
        run = runtime.retrieve(index, reqs, mode=chosen, beams=beam_sizes, top_k=top_k, batch_size=batch_size,
                               scorer=factory, progress=progress, value_weight=value_weight, rank=rank)
    table = run.table(reqs.request_id)
    write_table(table, out_file)
    r = run.result
    emit({"snapshot_id": index.id, "device": str(index.device), "mode": chosen.value, "beams": list(beam_sizes),
           "value_weight": value_weight, "rank": rank,
           "requests": len(reqs), "rows": table.num_rows, "out": str(out_file),
           "eligible_ads_per_request_mean": round(float(r.ads_eligible.mean()), 2),
           "requests_without_ads": int((r.ads_eligible == 0).sum()),
           "requests_whose_beams_all_died": int((r.sids == 0).sum()),
           "seconds": {"load": round(load_s, 3), **{k: round(v, 3) for k, v in run.seconds.items()}}},
          as_json, "retrieved")


@app.command()
def simulate(
    snapshot: Path = SNAPSHOT_ARG,
    requests: Path = typer.Option(..., "--requests", help="Request table with an `embedding` column (the codebook "
                                  "scorer's input)."),
    modes: Optional[str] = typer.Option(None, "--modes", help="Comma-separated modes (default: every constrained "
                                        "mode the snapshot can serve: cd,cd+gtm, plus cd+gtm+kway with partitions)."),
    beams: str = BEAMS_OPT,
    top_k: int = typer.Option(100, "--top-k", min=1, help="K of recall@K and of 'requests short of K'."),
    max_requests: Optional[int] = typer.Option(None, "--max-requests", min=1, help="Use the first N requests only."),
    device: str = DEVICE_OPT,
    plot: Optional[Path] = typer.Option(None, "--plot", callback=output_file,
                                        help="Also draw pass rates and recall per mode to this PNG."),
    scorer: Optional[str] = SCORER_OPT,
    scorer_timeout: Optional[float] = SCORER_TIMEOUT_OPT,
    value_weights: Optional[str] = typer.Option(None, "--value-weights", metavar="L1,L2,...",
                                                help="Also run the value-guided search at these weights (see "
                                                "retrieve --value-weight) and report its value@K and recall@K."),
    as_json: bool = JSON_OPT,
) -> None:
    """Pass rates and recall of eligible ads per mode (GRACE Table 3, and what it left out).

    Per mode, over the ads the returned SIDs generate: the share passing every bitmask attribute,
    every bloom attribute (each stage on its own) and both (final), overall and bucketed by how
    many ads a request generated; eligible ads per request (mean, p10); requests short of K; and
    recall@K against the K best eligible ads of the whole catalog under the same scorer (yours,
    with --scorer, or the codebook scorer), found exhaustively. Times are per request. With ad
    values: value@K, the summed values of the K most valuable returned eligible ads against those
    of the K most valuable eligible ads of the catalog, for the plain search and per value weight
    (--value-weights; --plot then also draws value@K against the weight).
    """
    import runtime
    from runtime.studies.simulate import simulate as run_study

    named = tuple(parse_mode(m.strip()) for m in modes.split(",")) if modes else None  # typos fail before loading
    weights = _weights(value_weights)
    factory = _factory(scorer, scorer_timeout)
    index = runtime.load(snapshot, device, verify=False)
    beam_sizes = runtime.parse_beams(beams, index.sid_length)
    reqs = runtime.read_requests(requests, index)
    if max_requests is not None:
        reqs = reqs.head(max_requests)
    chosen = named or served_modes(index.kway)
    with progress_bar(not as_json and err.is_terminal) as progress:
        report = run_study(index, reqs, chosen, beam_sizes, top_k, scorer=factory, progress=progress,
                           value_weights=weights)
    report["kway"] = _kway_label(index.snapshot) if index.kway else None
    if plot is not None:
        from sidindex_cli.plot import plot_study

        plot_study(report, plot)
        report["plot"] = str(plot)
    if as_json:
        emit(report, True, "")
        return
    emit({k: round(v, 1) if isinstance(v, float) else v for k, v in report.items() if k != "modes"}, False,
          "simulation")
    print_study(report, top_k)


def _weights(text: str | None) -> tuple[float, ...]:
    """'0.5,1,2' -> (0.5, 1.0, 2.0)."""
    if not text:
        return ()
    try:
        return tuple(float(w) for w in text.split(","))
    except ValueError:
        raise ConfigError(f"--value-weights {text!r}: expected numbers separated by commas, e.g. 0.5,1,2") from None


def _kway_label(snap) -> str | None:
    """How the snapshot's k-way partitions were built, from its build config, for the report."""
    config = snap.manifest.build_config
    k = None if config is None else config.kway
    if k is None:
        return None
    return f"static, k {list(k.k)}" if k.mode == "static" else f"dynamic, k_max {k.k_max}, target fill {k.target_fill}"


def _factory(scorer: str | None, timeout: float | None):
    """The user's scorer factory named by --scorer (imported now: a module that cannot be imported
    fails before any work), or None for the codebook scorer."""
    from runtime.scorers.factory import load_factory

    if timeout is not None and not scorer:
        raise ConfigError("--scorer-timeout limits a scorer given with --scorer; give one, or drop the timeout")
    return load_factory(scorer, timeout) if scorer else None


@app.command()
def serve(
    root: Path = typer.Argument(..., help="The ROOT to serve: its published snapshot, swapped for each newer one."),
    device: str = DEVICE_OPT,
    mode: str = MODE_OPT,
    beams: str = BEAMS_OPT,
    scorer: Optional[str] = SCORER_OPT,
    max_batch: int = typer.Option(16, "--max-batch", min=1, help="The most request rows searched together; a "
                                  "request of more rows runs in pieces of this many, taking turns with the others."),
    max_wait_us: int = typer.Option(500, "--max-wait-us", min=0, help="How long a request waits for others to "
                                    "join its batch, in microseconds."),
    max_queue: int = typer.Option(1024, "--max-queue", min=1, help="The most requests waiting; one more gets 503 "
                                  "with Retry-After."),
    max_body_bytes: int = typer.Option(16 << 20, "--max-body-bytes", min=1, help="The largest request body; a "
                                       "larger one gets 413 before it is read whole."),
    max_request_rows: int = typer.Option(4096, "--max-request-rows", min=1, help="The most requests in one body; "
                                         "more get 413."),
    timeout_ms: int = typer.Option(10_000, "--timeout-ms", min=0, help="How long a request may wait for its "
                                   "answer; past it, 504 and its rows not yet run are dropped (0: no limit)."),
    drain_seconds: float = typer.Option(30.0, "--drain-seconds", min=0.1, help="On SIGTERM or SIGINT, how long "
                                        "the requests in flight may take; one still waiting then gets 503."),
    unready_after: int = typer.Option(5, "--unready-after", min=1, help="/readyz answers 503 once this many "
                                      "batches in a row failed (a scorer, the device), and 200 after one succeeds."),
    poll_seconds: float = typer.Option(1.0, "--poll-seconds", min=0.01, help="How often ROOT is checked for a newly "
                                       "published snapshot (warmed, then swapped in between batches)."),
    workers: Optional[int] = typer.Option(None, "--workers", min=1, help="HTTP front-end processes: each parses, "
                                          "validates and answers requests, and one engine process batches them all "
                                          "on the device. 1: one process does everything. Default: the host's cores "
                                          "less two on a GPU (at least 1), 1 on the CPU."),
    host: str = typer.Option("127.0.0.1", "--host", help="Address to listen on (0.0.0.0: every interface)."),
    port: int = typer.Option(8000, "--port", min=0, max=65535, help="Port to listen on."),
    flight_port: Optional[int] = typer.Option(None, "--flight-port", min=0, max=65535, help="Also serve Arrow "
                                              "Flight on this port (do_exchange: record batches of requests in, "
                                              "of ranked ads out), for callers that already batch."),
    warmup: Optional[Path] = typer.Option(None, "--warmup", help="A request table (Parquet or Arrow IPC, as "
                                          "`sidindex retrieve --requests` reads) of real requests, a few hundred "
                                          "from traffic, to warm up with besides the generated ones: the search's "
                                          "widths and the post stage's room then fit real requests before the first "
                                          "arrives, and each new snapshot warms with them too."),
    value_weight: float = VALUE_WEIGHT_OPT,
    rank: str = RANK_OPT,
    top_k: Optional[int] = TOP_K_OPT,
    trust_key: Optional[Path] = TRUST_KEY_OPT,
) -> None:
    """Serve retrieval over HTTP, batching concurrent requests and following ROOT's snapshots.

    POST /retrieve takes JSON {"requests": \\[{"request_id": 1, "embedding": \\[...], "country": "US"}]} or an
    Arrow IPC stream, and answers in the same form with the ranked eligible ads and the snapshot that served them.

    GET /healthz, /readyz, /snapshot and /metrics (Prometheus) report on it. A bad request gets 400 with one
    line; a body too large 413; a full queue 503 with Retry-After; a request past --timeout-ms 504.

    SIGTERM or SIGINT, at any moment (warming, swapping, under load): no new requests, the ones in flight answered
    within --drain-seconds (503 for one that cannot be), then exit 0.

    With --trust-key a snapshot that key did not sign is refused like a corrupt one: the one served goes on,
    and /snapshot's last_error says why.

    Needs the extra: pip install 'sidindex\\[serve]'. Example: sidindex serve runs/sample --port 8000
    """
    try:
        import uvicorn  # noqa: F401 (the extra's check)
        import zmq  # noqa: F401

        from runtime.server.http import RetrievalServer
    except ImportError as e:
        raise ConfigError(f"sidindex serve needs the extra 'serve' ({e.name} is missing): "
                          "pip install 'sidindex[serve]'") from None
    import runtime
    from runtime.server.batcher import batch_sizes
    from runtime.server.engine import Engine
    from runtime.server.metrics import share_between_processes

    chosen = parse_mode(mode)
    factory = _factory(scorer, None)  # batches run off the main thread, where no alarm can stop a scorer
    if workers is None:
        workers = max(1, (os.cpu_count() or 1) - 2) if device.startswith("cuda") else 1
    metrics_dir = None
    if workers > 1:  # before any metric is made: every process writes them to one place
        metrics_dir = share_between_processes()
    watcher = runtime.SnapshotWatcher(root, device, trust_key=trust_key)
    sizes = batch_sizes(max_batch)
    warm_with = None if warmup is None else runtime.read_requests(warmup, watcher.current)
    err.print(f"warming snapshot {watcher.current.id} on {watcher.device} (batch sizes {', '.join(map(str, sizes))}"
              + ("" if warm_with is None else f"; with {len(warm_with):,} requests from {warmup}") + ")",
              highlight=False)
    # a SIGTERM until serving starts raises Interrupted: `sidindex_cli.app.main` stops with exit 0
    retriever = runtime.Retriever(watcher, mode=chosen, beams=beams, scorer=factory, batch_sizes=sizes,
                                  value_weight=value_weight, rank=rank, top_k=top_k, warmup=warm_with)
    engine = Engine(watcher, retriever, max_batch=max_batch, max_wait_us=max_wait_us, max_queue=max_queue,
                    poll_seconds=poll_seconds, unready_after=unready_after)
    http = {"max_body_bytes": max_body_bytes, "max_request_rows": max_request_rows, "timeout_ms": timeout_ms or None,
            "drain_seconds": drain_seconds}
    endpoint = None
    if flight_port is not None:
        from runtime.server.flight import start_flight

        endpoint = start_flight(retriever, host, flight_port, max_batch=max_batch, max_request_rows=max_request_rows)
        err.print(f"serving Arrow Flight on grpc://{host}:{endpoint.port}", highlight=False)
    processes = f" ({workers} front-end processes)" if workers > 1 else ""
    err.print(f"serving {root} on http://{host}:{port}{processes}", highlight=False)
    # from here a signal is noted for the server to act on once it listens (it drains then), and
    # uvicorn, which drains on one, raises it again for the handler it found: a drained stop is
    # this command's success
    arrived: list[int] = []
    previous = {s: signal.signal(s, lambda signum, _: arrived.append(signum)) for s in (signal.SIGTERM, signal.SIGINT)}
    # the batch thread gives up the GIL in every Arrow, numba and CUDA call; while the event loop
    # parses requests it would wait Python's default 5 ms to get it back, several times a batch
    from runtime.server.http import SWITCH_INTERVAL_S

    sys.setswitchinterval(SWITCH_INTERVAL_S)
    # what loading and warming made lives as long as this process: out of the collector's reach, a
    # full collection (which holds the GIL, 130 ms over the 270,000 objects of a warm engine on a
    # 2-core VM) walks only what serving makes. This process's, not the library's: a caller
    # serving in its own process decides for its own heap
    gc.freeze()
    server = RetrievalServer(engine, **http)
    try:
        if workers > 1:
            from runtime.server.frontend import serve_processes

            serve_processes(engine, host, port, workers, http, arrived=arrived,
                            log=lambda line: err.print(line, highlight=False))
        else:
            server.serve(host, port, arrived=arrived)
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
    stopped = server.close(timeout=drain_seconds, flight=endpoint)
    if metrics_dir is not None:
        shutil.rmtree(metrics_dir, ignore_errors=True)
    err.print("stopped: every request in flight was answered", highlight=False)
    if not stopped:  # a thread still in native code (a warm-up's batch) would abort the interpreter's exit
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)
