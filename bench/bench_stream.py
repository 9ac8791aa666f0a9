"""What a serving host measures, through the public API only: request batches held in memory as
Arrow, `runtime.Retriever.retrieve` per batch, the latency distribution per mode with its
per-stage breakdown, throughput with concurrent callers, the first request after process start,
and the constraint's share of a real-size decoder's time.

    python bench/bench_stream.py                                          # a CPU run: 20k ads, both profiles
    python bench/bench_stream.py --ads 2000000,15000000 --device cuda     # ~4M and ~30M SIDs on a GPU
    python bench/bench_stream.py --ads 2000000,15000000 --device cuda --decoder --cache /data/bench_stream
    python bench/bench_stream.py --profile default                        # one profile

Catalog and snapshot, per size and profile: a generated catalog (`sidindex sample`'s generator,
`bench_build.generate`: 5 bitmask attributes, Bloom locations, values, 32 dims), a frozen
codebook trained on it (`bench_build.train`), and a full build published into a ROOT by
`sidindex.job.run_build` (what `sidindex build` runs) with dynamic k-way partitions (k_max 16,
target fill 0.5). --profile: `default` (SIDs hold few ads), `skewed` (the same catalog with a
share of bulk advertisers' near-duplicate creatives, each advertiser's in one SID per path:
`sidindex.sample.Bulk`), or `both` (the default: each size with each profile, side by side).
With --cache DIR each size's files stay under DIR/ads-N-dimD (the skewed profile's under
DIR/ads-N-dimD-skewed) and a later run reuses them; without, they go to a temporary directory,
removed at the end. The ROOT is loaded with `runtime.load` (checksums verified). Per profile the
run reports ads per SID (p50, p99, max) and the most (request, ad) pairs 1,024 beams reach (the
1,024 largest SIDs' ads together, what the post stage's work is sized by), read on the host from
the snapshot's leaf_ad_offsets (`bench_build.ads_per_sid`).

Requests: `sidindex.sample.sample_requests` (0..64 locations each, embeddings near catalog
ads), cut into --batches distinct batches of B=16 (no request is in two batches), each an Arrow
record batch with buffers of its own (an IPC message, read back: as it would arrive), all made
before any timing.

Per mode (none, cd, cd+gtm, and cd+gtm+kway where the snapshot has partitions), one
`runtime.Retriever(index, mode=..., beams=..., batch_sizes=(16,))` (warmed at construction; the
seconds it took are reported), then:
  latency      every `retriever.retrieve(batch)` timed end to end (Arrow in, an Arrow table on the
               host out), one caller, batches back to back: p50, p90, p99, max (ms per batch);
               the cd+gtm p50 over the none p50 of the same run (target: <= 1, the same path)
  stages       mean ms per batch of each stage from `retriever.counters.seconds` (validate,
               encode, search + post, result); widen, and stalls (captures/compiles/overflows/rewarms):
               the searches widened, graphs captured and Triton kernels compiled while serving the
               stream (each a stall of its batch; 0 after warm-up), the batches answered by the
               worst case's graph, and the searchers warmed again, wider, beside serving after them
               (`retriever.counters`)
  throughput   requests per second with 1 caller (the latency stream) and with 2 caller
               threads, each sending its own half of the batches to the same Retriever (which
               replays a batch on one of a graph's two slots while the other's is read), the p99 a
               caller then sees, and with one caller sending 64 requests (4 batches) per call (the
               Retriever submits each batch before reading the one before it); on CUDA, cd+gtm again
               with one slot per graph (`slots=1`), the reference for the second slot, same run
  check        the first batch's table equals `runtime.retrieve` of the same requests
Beams 1,512,1024,1024 on CUDA, 1,16,32,32 on the CPU (--beams). On the CPU torch and numba run one
thread each (--threads): their thread teams spin at each barrier, and a core the machine gives to
another process then stalls every batch (p50s of hundreds of ms instead of a few).
Cold start (cd+gtm): a fresh Python process (this script, a hidden flag) imports, loads the ROOT,
builds a Retriever (warm-up: kernels compiled, graphs captured) and retrieves one batch read from
an Arrow IPC file: seconds from its spawn to the first result, the phases, and the first batch's
latency after the warm load. On CUDA twice: with an empty Triton cache (TRITON_CACHE_DIR a new
temporary directory) and with the same directory again (warm); on the CPU once (no Triton).

--decoder (CUDA; a CPU run prints a note and skips it): a Qwen3-1.7B-shaped transformer
(`transformers.Qwen3Config`: hidden 2048, 28 layers, 16 heads, 8 KV heads, head dim 128,
intermediate 6144, vocabulary 151,936, random weights in bf16) scores the search as a user's
scorer factory (`Qwen3Scorer`, a KV cache sharing each request's 64 context tokens across its
beams) through the same Retriever, mode none and cd+gtm, --decoder-batches distinct batches each
with a `history` column: ms per batch and the constraint's share of the decode time,
1 - none / cd+gtm (p50s).

Output: rich tables on stdout (one per size: a row per profile and mode), progress on stderr,
every figure with --json PATH (written after each size and profile: `sizes` holds one entry per
size and profile, with its `profile` and `ads_per_sid`).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make `bench` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import torch

import runtime
from bench.bench_build import ads_per_sid
from bench.qwen3_scorer import CONTEXT, Qwen3Decoder
from bench.report import verdict, write_json
from runtime.scorers.factory import ScorerFactory
from sidindex.modes import Mode
from sidindex.sample import PROFILES as CATALOG_PROFILES
from sidindex.sample import check_profile, sample_requests

BATCH = 16
CALL_BATCHES = 4  # batches of BATCH per call in the per-call throughput (64 requests)
MODES = (Mode.NONE, Mode.CD, Mode.CD_GTM, Mode.CD_GTM_KWAY)
KWAY_TOML = '[kway]\nmode = "dynamic"\nk_max = 16\ntarget_fill = 0.5\n'  # bench_search's partitions
# Qwen3-1.7B's shape (its config.json); the weights are random
QWEN3_1_7B = dict(vocab_size=151936, hidden_size=2048, intermediate_size=6144, num_hidden_layers=28,
                  num_attention_heads=16, num_key_value_heads=8, head_dim=128, max_position_embeddings=40960,
                  rms_norm_eps=1e-6, rope_theta=1000000.0, tie_word_embeddings=True)
CPU_BEAMS, CUDA_BEAMS = "1,16,32,32", "1,512,1024,1024"
BATCHES = 256
PROFILES = tuple(CATALOG_PROFILES)  # side by side in this order with --profile both


# --- catalog and snapshot -------------------------------------------------------------------

def catalog_dir(n: int, dim: int, cache: Path, profile: str = "default") -> Path:
    """Where `catalog_root` keeps a size's files: cache/ads-{n}-dim{dim}, with -{profile} after it
    for a profile other than the default (whose caches predate profiles)."""
    return cache / (f"ads-{n}-dim{dim}" + ("" if profile == "default" else f"-{profile}"))


def catalog_root(n: int, dim: int, cache: Path, profile: str = "default") -> dict:
    """The catalog (`sidindex.sample.PROFILES`' `profile`) and published ROOT of n ads under
    `catalog_dir`, reused when a build there published (its build.json written last), else
    generated, trained and built (module doc): the build's report (ads, profile, SIDs, nodes,
    seconds per stage), its paths, and `cached`."""
    from bench.bench_build import generate, train
    from sidindex.job import run_build
    from sidindex.root import Root

    check_profile(profile)
    d = catalog_dir(n, dim, cache, profile)
    done = d / "build.json"
    if done.exists() and Root(d / "root").current_or_none():
        return json.loads(done.read_text()) | {"profile": profile, "cached": True}
    if d.exists():  # an earlier build there did not finish
        shutil.rmtree(d)
    seconds = {}
    t = time.perf_counter()
    generate(n, dim, d / "data", profile)
    seconds["generate"] = time.perf_counter() - t
    t = time.perf_counter()
    train(d / "data" / "catalog.parquet", d / "root")
    seconds["train codebook"] = time.perf_counter() - t
    (d / "build.toml").write_text(KWAY_TOML)
    t = time.perf_counter()
    rep = run_build(d / "data" / "catalog.parquet", d / "data" / "targeting.toml", d / "root", config=d / "build.toml",
                    workers=os.cpu_count())
    seconds["build"] = time.perf_counter() - t
    out = {"ads": n, "dim": dim, "profile": profile, "sids": rep["sids"], "nodes": rep["nodes"],
           "root": str(d / "root"), "catalog": str(d / "data" / "catalog.parquet"),
           "seconds": seconds | {"build stages": rep["seconds"]}}
    done.write_text(json.dumps(out, indent=1))
    return out | {"cached": False}


# --- requests -------------------------------------------------------------------------------

def catalog_embeddings(catalog: Path, most: int = 100_000) -> np.ndarray:
    """(<= most, D) float32: the catalog's first ads' embeddings (the generator's ads come in random
    order), what the requests' embeddings are drawn near."""
    f = pq.ParquetFile(catalog)
    col = next(f.iter_batches(batch_size=most, columns=["embedding"])).column(0)
    return col.flatten().to_numpy().reshape(len(col), -1).astype(np.float32)


def own_buffers(part: pa.Table) -> pa.RecordBatch:
    """`part` as a record batch with buffers of its own: an Arrow IPC message, read back."""
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, part.schema) as w:
        w.write_table(part)
    return pa.ipc.open_stream(sink.getvalue()).read_next_batch()


def request_batches(index, n_batches: int, embeddings: np.ndarray, *, seed: int = 11, batch: int = BATCH,
                    history: int = 0, history_vocab: int = 1) -> list[pa.RecordBatch]:
    """n_batches distinct record batches of `batch` requests (`sample_requests`: 0..64 locations,
    embeddings near `embeddings`), request ids unique across batches; with history > 0 a
    `history` column of that many random token ids in [0, history_vocab) (a decoder's context)."""
    n = n_batches * batch
    table = sample_requests(n, index.spec, dim=embeddings.shape[1], seed=seed, catalog_embedding=embeddings)
    if history:
        ids = np.random.default_rng(seed).integers(0, history_vocab, (n, history), dtype=np.int64)
        offsets = pa.array(np.arange(0, n * history + 1, history, dtype=np.int32))
        table = table.append_column("history", pa.ListArray.from_arrays(offsets, pa.array(ids.reshape(-1))))
    return [own_buffers(table.slice(i * batch, batch)) for i in range(n_batches)]


# --- timing ---------------------------------------------------------------------------------

def distribution(ms: list[float]) -> dict:
    """p50, p90, p99, max and mean of per-batch milliseconds."""
    a = np.asarray(ms, dtype=np.float64)
    p50, p90, p99 = np.percentile(a, [50, 90, 99])
    return {"p50_ms": float(p50), "p90_ms": float(p90), "p99_ms": float(p99), "max_ms": float(a.max()),
            "mean_ms": float(a.mean())}


def stream(retriever, batches: list[pa.RecordBatch]) -> tuple[list[float], pa.Table, float]:
    """Each batch retrieved in turn by one caller: ms per call, the first batch's table, and the
    stream's wall seconds."""
    ms, first = [], None
    start = time.perf_counter()
    for b in batches:
        t = time.perf_counter()
        out = retriever.retrieve(b)
        ms.append((time.perf_counter() - t) * 1e3)
        first = out if first is None else first
    return ms, first, time.perf_counter() - start


def callers(retriever, batches: list[pa.RecordBatch], threads: int) -> dict:
    """`threads` caller threads, thread t sending batches[t::threads] back to back, started
    together: requests per second over the wall time of all, and the latency a caller saw."""
    parts = [batches[t::threads] for t in range(threads)]
    ms: list[list[float]] = [[] for _ in parts]
    failed: list[BaseException] = []
    gate = threading.Barrier(threads + 1)

    def call(t: int) -> None:
        gate.wait()
        try:
            for b in parts[t]:
                s = time.perf_counter()
                retriever.retrieve(b)
                ms[t].append((time.perf_counter() - s) * 1e3)
        except BaseException as e:  # re-raised on the main thread
            failed.append(e)

    pool = [threading.Thread(target=call, args=(t,), daemon=True) for t in range(threads)]
    for p in pool:
        p.start()
    gate.wait()
    start = time.perf_counter()
    for p in pool:
        p.join()
    wall = time.perf_counter() - start
    if failed:
        raise failed[0]
    seen = distribution([x for m in ms for x in m])
    return {"threads": threads, "qps": sum(b.num_rows for b in batches) / wall,
            "p50_ms": seen["p50_ms"], "p99_ms": seen["p99_ms"]}


def per_call(retriever, batches: list[pa.RecordBatch], batches_per_call: int = CALL_BATCHES) -> float:
    """One caller sending `batches_per_call` batches in each call (one table, made before timing):
    requests per second. The Retriever submits each batch of a call before reading the one
    before it."""
    tables = [pa.Table.from_batches(batches[lo:lo + batches_per_call])
              for lo in range(0, len(batches), batches_per_call)]
    start = time.perf_counter()
    for t in tables:
        retriever.retrieve(t)
    return sum(t.num_rows for t in tables) / (time.perf_counter() - start)


def stage_ms(counters) -> dict:
    """Mean ms per batch of each stage (`runtime.serving.retriever.STAGES`) from a Retriever's counters."""
    return {k: v / counters.batches * 1e3 for k, v in counters.seconds.items()}


def same_tables(a: pa.Table, b: pa.Table) -> bool:
    return a.schema == b.schema and a.equals(b)


STALLS = ("captures", "compiles", "overflows", "rewarms")  # a mode's stalls column, in this order


def measure_mode(index, mode: Mode, beams: tuple[int, ...], batches: list[pa.RecordBatch], *,
                 threads: tuple[int, ...] = (2,), warmup: pa.Table | None = None, scorer=None,
                 check: bool = True, slots: int = 2) -> tuple[dict, pa.Table]:
    """One mode (module doc): its figures, and the first batch's table."""
    t = time.perf_counter()
    retriever = runtime.Retriever(index, mode=mode, beams=beams, batch_sizes=(BATCH,), warmup=warmup, scorer=scorer,
                                  slots=slots)
    warm_s = time.perf_counter() - t
    ms, first, wall = stream(retriever, batches)
    c = retriever.counters
    row = {"mode": mode.value, "warm_s": warm_s, **distribution(ms), "widenings": int(c.widenings),
           "stalls": {"captures": c.captures, "compiles": c.compiles, "overflows": c.overflows, "rewarms": c.rewarms},
           "stages_ms": stage_ms(c), "rows_per_request": first.num_rows / batches[0].num_rows,
           "qps": {"1": sum(b.num_rows for b in batches) / wall}, "latencies_ms": ms, "counters": c.to_dict()}
    for n in threads:
        got = callers(retriever, batches, n)
        row["qps"][str(n)] = got["qps"]
        row[f"callers_{n}"] = got
    row["qps"]["per_call"] = per_call(retriever, batches)
    row["widenings_total"] = int(retriever.counters.widenings)
    if check:  # the same requests through runtime.retrieve
        reqs = runtime.requests_from(batches[0], index)
        want = runtime.retrieve(index, reqs, mode=mode, beams=beams, batch_size=BATCH,
                                scorer=scorer).table(reqs.request_id)
        row["same_as_retrieve"] = same_tables(first, want)
    retriever.close()
    retriever.join_warmups()
    del retriever
    free(index.device)
    return row, first


def free(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()


def set_threads(n: int | None) -> None:
    """torch's intra-op threads and numba's to n (None: as they are)."""
    if n:
        import numba

        torch.set_num_threads(n)
        numba.set_num_threads(min(n, numba.config.NUMBA_NUM_THREADS))


# --- cold start -----------------------------------------------------------------------------

def cold_start(root: str, device: str, mode: Mode, beams: tuple[int, ...], batch: pa.RecordBatch, work: Path,
               triton_cache: Path | None, threads: int | None = None) -> dict:
    """A fresh process of this script (`--cold-child`) serving `batch` from `root`: seconds from
    its spawn to the first result, its phases (imports, load, Retriever warm-up), the first
    batch's ms; triton_cache: its TRITON_CACHE_DIR (None: the environment's); threads: its
    `set_threads`."""
    path = work / "first_batch.arrow"
    with pa.ipc.new_file(path, batch.schema) as w:
        w.write_batch(batch)
    env = dict(os.environ)
    env.pop("TRITON_INTERPRET", None)  # a serving host runs the compiled kernels
    if triton_cache is not None:
        env["TRITON_CACHE_DIR"] = str(triton_cache)
    payload = json.dumps({"root": root, "device": device, "mode": mode.value, "beams": list(beams),
                          "batch": str(path), "threads": threads})
    spawned = time.time()
    done = subprocess.run([sys.executable, str(Path(__file__).resolve()), "--cold-child", payload], env=env,
                          capture_output=True, text=True, timeout=1800)
    lines = [x for x in done.stdout.splitlines() if x.startswith("COLD ")]
    if done.returncode != 0 or not lines:
        raise RuntimeError(f"the cold-start process failed ({done.returncode}):\n{done.stderr[-4000:]}")
    t = json.loads(lines[-1][5:])
    return {"triton_cache": None if triton_cache is None else t["triton_cache"],
            "start_to_first_result_s": t["first_result"] - spawned, "imports_s": t["imported"] - spawned,
            "load_s": t["loaded"] - t["imported"], "warm_s": t["warmed"] - t["loaded"],
            "first_batch_ms": t["first_batch_ms"], "rows": t["rows"]}


def cold_child(payload: str) -> int:
    """The cold-start process (`cold_start`): one line 'COLD {json}' of wall-clock times."""
    imported = time.time()  # this module's imports (torch, pyarrow, runtime) ran before main
    p = json.loads(payload)
    set_threads(p["threads"])
    cache = os.environ.get("TRITON_CACHE_DIR")
    was_empty = cache is not None and not any(Path(cache).iterdir())
    index = runtime.load(p["root"], p["device"])
    loaded = time.time()
    retriever = runtime.Retriever(index, mode=p["mode"], beams=tuple(p["beams"]), batch_sizes=(BATCH,))
    warmed = time.time()
    with pa.memory_map(p["batch"]) as f:
        batch = pa.ipc.open_file(f).get_batch(0)
        t = time.perf_counter()
        out = retriever.retrieve(batch)
        first_ms = (time.perf_counter() - t) * 1e3
    print("COLD " + json.dumps({"imported": imported, "loaded": loaded, "warmed": warmed, "first_result": time.time(),
                                "first_batch_ms": first_ms, "rows": out.num_rows,
                                "triton_cache": "empty" if was_empty else "filled"}), flush=True)
    return 0


def cold_starts(root: str, device: torch.device, beams: tuple[int, ...], batch: pa.RecordBatch,
                threads: int | None = None) -> list[dict]:
    """On CUDA an empty Triton cache, then the same directory again; on the CPU one start."""
    with tempfile.TemporaryDirectory(prefix="bench_stream_cold_") as tmp:
        tmp = Path(tmp)
        if device.type != "cuda":
            return [cold_start(root, str(device), Mode.CD_GTM, beams, batch, tmp, None, threads)]
        cache = tmp / "triton"
        cache.mkdir()
        return [cold_start(root, str(device), Mode.CD_GTM, beams, batch, tmp, cache, threads) for _ in range(2)]


# --- a real-size decoder --------------------------------------------------------------------

def decoder_rows(index, decoder: Qwen3Decoder, beams: tuple[int, ...], batches: list[pa.RecordBatch]) -> dict:
    """The decoder's search through a Retriever in mode none and cd+gtm: latency per mode and the
    constraint's share of the decode time, 1 - none / cd+gtm (p50s)."""
    factory = ScorerFactory(decoder.scorer, "bench_stream:Qwen3Decoder.scorer")
    rows = {}
    for mode in (Mode.NONE, Mode.CD_GTM):
        print(f"  decoder, {mode}", file=sys.stderr, flush=True)
        row, _ = measure_mode(index, mode, beams, batches, threads=(), scorer=factory, check=False)
        rows[mode.value] = {k: row[k] for k in ("warm_s", "p50_ms", "p90_ms", "p99_ms", "max_ms", "mean_ms",
                                                "widenings", "stages_ms", "rows_per_request", "latencies_ms")}
    none, gtm = rows["none"]["p50_ms"], rows["cd+gtm"]["p50_ms"]
    return {"modes": rows, "constraint_share": 1 - none / gtm, "batches": len(batches),
            "parameters": sum(p.numel() for p in decoder.model.parameters()),
            "dtype": str(next(decoder.model.parameters()).dtype)}


def decoder_size(index, config: dict, decoders: dict, beams: tuple[int, ...], embeddings: np.ndarray,
                 n_batches: int) -> dict:
    """`decoder_rows` of a decoder of `config` (kept in `decoders` for the next size of the same
    level sizes) over n_batches batches with a `history`."""
    if index.level_sizes not in decoders:
        decoders.clear()
        decoders[index.level_sizes] = Qwen3Decoder(config, index.level_sizes, index.device)
    dec = decoders[index.level_sizes]
    batches = request_batches(index, n_batches, embeddings, seed=13, history=CONTEXT, history_vocab=dec.history_vocab)
    return decoder_rows(index, dec, beams, batches)


# --- one size, the report -------------------------------------------------------------------

def one_size(n: int, profile: str, args, beams: tuple[int, ...], device: torch.device, cache: Path,
             decoder_config: dict | None, decoders: dict) -> dict:
    name = f"{n:,} ads ({profile})"
    print(f"{name}: catalog and snapshot ...", file=sys.stderr, flush=True)
    size = catalog_root(n, args.dim, cache, profile)
    t = time.perf_counter()
    index = runtime.load(size["root"], device)
    size["load_s"] = time.perf_counter() - t
    size["ads_per_sid"] = ads_per_sid(index.snapshot)
    emb = catalog_embeddings(Path(size["catalog"]))
    batches = request_batches(index, args.batches, emb)
    warmup = None
    if args.warmup:  # real requests, none of them timed
        warmup = pa.Table.from_batches(request_batches(index, -(-args.warmup // BATCH), emb, seed=12))
    size["modes"] = {}
    for mode in MODES:
        if mode.kway and not index.kway:
            continue
        print(f"{name}, {mode}: {len(batches)} batches ...", file=sys.stderr, flush=True)
        size["modes"][mode.value], _ = measure_mode(index, mode, beams, batches, warmup=warmup)
    m = size["modes"]
    size["cd+gtm_over_none_p50"] = m["cd+gtm"]["p50_ms"] / m["none"]["p50_ms"]
    if device.type == "cuda":  # the reference for the graphs' second slot, in the same run
        print(f"{name}, cd+gtm with one slot ...", file=sys.stderr, flush=True)
        one, _ = measure_mode(index, Mode.CD_GTM, beams, batches, warmup=warmup, check=False, slots=1)
        size["one_slot"] = {k: one[k] for k in ("p50_ms", "p99_ms", "qps")}
    print(f"{name}: cold start ...", file=sys.stderr, flush=True)
    size["cold_start"] = kept("cold start", lambda: cold_starts(size["root"], device, beams, batches[0], args.threads))
    if decoder_config is not None:
        print(f"{name}: decoder ...", file=sys.stderr, flush=True)
        size["decoder"] = kept("decoder", lambda: decoder_size(index, decoder_config, decoders, beams, emb,
                                                               args.decoder_batches))
        if "error" in size["decoder"]:
            decoders.clear()
    return size


def kept(what: str, fn):
    """fn(), or {"error": ...} when it raises: a part that fails is reported, the figures measured
    before it kept."""
    try:
        return fn()
    except Exception as e:
        print(f"{what} failed: {type(e).__name__}: {e}", file=sys.stderr, flush=True)
        return {"error": f"{type(e).__name__}: {e}"}


def beams_for(text: str | None, device: torch.device) -> tuple[int, ...]:
    """--beams as a tuple (None: CUDA_BEAMS on CUDA, CPU_BEAMS elsewhere), for the serving benchmarks."""
    return tuple(int(b) for b in (text or (CUDA_BEAMS if device.type == "cuda" else CPU_BEAMS)).split(","))


def run(args) -> dict:
    device = torch.device(args.device)
    beams = beams_for(args.beams, device)
    if args.threads is None and device.type == "cpu":
        args.threads = 1
    set_threads(args.threads)
    decoder_config = None
    if args.decoder and device.type != "cuda":
        print("--decoder: a Qwen3-1.7B-sized model needs a CUDA device; its row is skipped on the CPU", flush=True)
    elif args.decoder:
        decoder_config = QWEN3_1_7B
    profiles = PROFILES if args.profile == "both" else (args.profile,)
    res = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu", "batch": BATCH,
           "beams": list(beams), "batches": args.batches, "threads": args.threads, "profiles": list(profiles),
           "sizes": []}
    if args.decoder and decoder_config is None:
        res["decoder_skipped"] = "no CUDA device"
    cache = args.cache or Path(tempfile.mkdtemp(prefix="bench_stream_"))
    decoders: dict = {}
    try:
        for n in args.ads:
            for profile in profiles:
                res["sizes"].append(one_size(n, profile, args, beams, device, cache, decoder_config, decoders))
                free(device)  # the size's index, gone with its frame
                write_json(args.json, res)
    finally:
        if args.cache is None:
            shutil.rmtree(cache, ignore_errors=True)
    return res


def by_ads(sizes: list[dict]) -> dict[int, list[dict]]:
    """The run's entries (one per size and profile) grouped by size, in run order."""
    out: dict[int, list[dict]] = {}
    for size in sizes:
        out.setdefault(size["ads"], []).append(size)
    return out


def skew_line(size: dict) -> str:
    """A size's ads per SID and the most (request, ad) pairs its beams reach, in words."""
    a = size["ads_per_sid"]
    return (f"{size.get('profile', 'default')}: {a['sids']:,} SIDs, ads per SID p50 {a['p50']:g}, p99 {a['p99']:g}, "
            f"max {a['max']:,}; the {a['beams']:,} largest SIDs hold {a['most_pairs']:,} ads (the most (request, ad) "
            f"pairs {a['beams']:,} beams reach)")


def report(res: dict, console=None) -> bool:
    """Print the tables and verdicts of `run`'s figures; False when a mode's first batch differed
    from `runtime.retrieve`."""
    from rich.console import Console
    from rich.table import Table

    console = console or Console(width=None if sys.stdout.isatty() else 220)
    beams = ",".join(map(str, res["beams"]))
    for n, sizes in by_ads(res["sizes"]).items():
        t = Table(title=f"{n:,} ads ({res['device']}): {res['batches']} distinct batches of {res['batch']}, beams "
                        f"{beams}; ms per batch, Arrow in -> Arrow on the host", title_justify="left")
        for c in ("profile", "mode", "p50", "p90", "p99", "max", "/ none", "widen", "stalls", "validate", "encode",
                  "search+post", "result", "req/s", "req/s 2 callers", "p99 2 callers",
                  f"req/s {CALL_BATCHES * BATCH}/call", "ads/req", "= retrieve",
                  "warm-up s"):
            t.add_column(c, justify="left" if c in ("profile", "mode") else "right")
        for size in sizes:
            none = size["modes"]["none"]["p50_ms"]
            for mode, r in size["modes"].items():
                s = r["stages_ms"]
                two = r.get("callers_2")
                t.add_row(size["profile"], mode, *(f"{r[k]:.3f}" for k in ("p50_ms", "p90_ms", "p99_ms", "max_ms")),
                          f"{r['p50_ms'] / none:.2f}", str(r["widenings"]),
                          "/".join(str(r["stalls"].get(k, 0)) for k in STALLS),
                          *(f"{s[k]:.3f}" for k in ("validate", "encode", "search_post", "result")),
                          f"{r['qps']['1']:,.0f}", "-" if two is None else f"{two['qps']:,.0f}",
                          "-" if two is None else f"{two['p99_ms']:.3f}", f"{r['qps']['per_call']:,.0f}",
                          f"{r['rows_per_request']:.1f}",
                          str(r.get("same_as_retrieve", "-")), f"{r['warm_s']:.3f}")
        console.print(t)
        for size in sizes:
            console.print("  " + skew_line(size), highlight=False)
            if "one_slot" in size:
                one, two = size["one_slot"], size["modes"]["cd+gtm"]
                console.print(f"  {size['profile']}, cd+gtm, two slots over one (same run): p50 {two['p50_ms']:.3f} vs "
                              f"{one['p50_ms']:.3f} ms; 2 callers {two['qps']['2']:,.0f} vs {one['qps']['2']:,.0f} "
                              f"req/s ({two['qps']['2'] / one['qps']['2']:.2f}x); {CALL_BATCHES * BATCH} per call "
                              f"{two['qps']['per_call']:,.0f} vs {one['qps']['per_call']:,.0f} req/s "
                              f"({two['qps']['per_call'] / one['qps']['per_call']:.2f}x)", highlight=False)
        cold = Table(title=f"{n:,} ads: cold start (a fresh process, cd+gtm; snapshot load in this one: "
                     + ", ".join(f"{z['profile']} {z['load_s']:.2f} s" for z in sizes) + ")", title_justify="left")
        cold.add_column("profile", justify="left")
        for col in ("Triton cache", "spawn -> first result s", "imports s", "load s", "Retriever warm-up s",
                    "first batch ms"):
            cold.add_column(col, justify="right")
        for size in sizes:
            for r in [] if "error" in size["cold_start"] else size["cold_start"]:
                cold.add_row(size["profile"], r["triton_cache"] or "-", f"{r['start_to_first_result_s']:.2f}",
                             f"{r['imports_s']:.2f}", f"{r['load_s']:.2f}", f"{r['warm_s']:.2f}",
                             f"{r['first_batch_ms']:.3f}")
        console.print(cold)
        for size in sizes:
            if "error" in size["cold_start"]:
                console.print(f"cold start failed ({size['profile']}): {size['cold_start']['error']}", highlight=False)
            if "decoder" in size and "error" in size["decoder"]:
                console.print(f"decoder failed ({size['profile']}): {size['decoder']['error']}", highlight=False)
            elif "decoder" in size:
                d = size["decoder"]
                k = Table(title=f"{n:,} ads ({size['profile']}): Qwen3-1.7B-shaped decoder "
                                f"({d['parameters'] / 1e9:.2f}B parameters, {d['dtype']}, random weights) as the "
                                f"scorer, {d['batches']} batches: constraint share {d['constraint_share']:.1%} of the "
                                "decode time", title_justify="left")
                for col in ("mode", "p50", "p90", "p99", "max", "search+post", "widenings", "ads / request"):
                    k.add_column(col, justify="left" if col == "mode" else "right")
                for mode, r in d["modes"].items():
                    k.add_row(mode, *(f"{r[x]:.2f}" for x in ("p50_ms", "p90_ms", "p99_ms", "max_ms")),
                              f"{r['stages_ms']['search_post']:.2f}", str(r["widenings"]),
                              f"{r['rows_per_request']:.1f}")
                console.print(k)
    exact = True
    for size in res["sizes"]:
        q, tag = size["cd+gtm_over_none_p50"], f"{size['sids']:,} SIDs ({size['profile']})"
        console.print(verdict(q <= 1, f"{tag}: cd+gtm p50 "
                      f"{size['modes']['cd+gtm']['p50_ms']:.3f} ms <= none {size['modes']['none']['p50_ms']:.3f} ms "
                      f"through the same path ({q:.2f}x)"), highlight=False)
        same = all(r.get("same_as_retrieve", True) for r in size["modes"].values())
        console.print(verdict(same, f"{tag}: every mode's first batch equals "
                      "runtime.retrieve of the same requests"), highlight=False)
        still = sum(sum(r["stalls"].values()) for r in size["modes"].values())
        console.print(verdict(still == 0, f"{tag}: {still} captures, compiles, overflows or warm-ups while "
                      "serving"), highlight=False)
        exact = exact and same
    return exact


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--ads", type=lambda s: [int(x) for x in s.split(",")], default=[20_000],
                    help="catalog sizes, comma-separated (about 2 SIDs per ad)")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--beams", help=f"beam sizes (default {CUDA_BEAMS} on CUDA, {CPU_BEAMS} on the CPU)")
    ap.add_argument("--batches", type=int, default=BATCHES, help=f"distinct batches of {BATCH}")
    ap.add_argument("--threads", type=int, help="torch's and numba's threads (default: 1 on the CPU, so that what "
                                                "else the machine runs does not stall their thread teams; their own "
                                                "with CUDA)")
    ap.add_argument("--dim", type=int, default=32, help="embedding dimensions of the generated catalog")
    ap.add_argument("--profile", choices=(*PROFILES, "both"), default="both",
                    help="the catalog's profile: default, skewed (bulk advertisers' near-duplicates, some SIDs "
                         "holding hundreds to thousands of ads: sidindex.sample.Bulk) or both, side by side")
    ap.add_argument("--warmup", type=int, default=0, help="real requests (none timed) each Retriever warms up with")
    ap.add_argument("--decoder", action="store_true", help="the Qwen3-1.7B-shaped decoder row (CUDA)")
    ap.add_argument("--decoder-batches", type=int, default=16)
    ap.add_argument("--cache", type=Path, help="keep each size's catalog and ROOT here, and reuse them")
    ap.add_argument("--json", type=Path, help="write every figure as JSON here")
    ap.add_argument("--cold-child", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.cold_child:
        return cold_child(args.cold_child)
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        print("no CUDA device: run with --device cpu (the default without one)", file=sys.stderr)
        return 2
    # a wrong answer fails the run (`gpu_check.sh check` counts on it); a stall is a figure, not a failure
    return 0 if report(run(args)) else 1


if __name__ == "__main__":
    sys.exit(main())
