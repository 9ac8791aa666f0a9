"""What the benchmarks share: the index and requests of `bench_search` (which `bench_post`,
`bench_serving` and `bench_swap` measure too), timers (wall clock, CUDA events, CUDA graph
replays, each falling back to the wall clock without a GPU: a smoke run) and the profiler's
per-kernel table.
"""

from __future__ import annotations

import statistics
import time
from pathlib import Path

import numpy as np
import polars as pl
import torch

from bench.bench_gtm import bench_spec, generate
from bench.bench_snapshot import write
from runtime.search.beam import beam_search
from sidindex.config import KWayConfig
from sidindex.modes import Mode
from sidindex.requests import Requests, requests_from
from sidindex.sample import location_vocabulary, sample_requests, zipf_weights

KWAY = KWayConfig(mode="dynamic", k_max=16, target_fill=0.5)


def build_snapshot(n: int, out: Path, codebook=None) -> dict:
    """Generate, build and write a snapshot of n ads under out/snapshot (carrying `codebook` if
    given); seconds per stage, its path."""
    t = time.perf_counter()
    generate(n, 2, out)
    return {"generate": time.perf_counter() - t, **write(out, out / "snapshot", kway=KWAY, codebook=codebook)}


def bench_requests(B: int, n_locations: int, seed: int = 3) -> Requests:
    """B requests with `n_locations` distinct Zipf-drawn locations each."""
    spec = bench_spec()
    table = pl.from_arrow(sample_requests(B, spec, dim=1, seed=seed))
    rng = np.random.default_rng(seed)
    vocab = location_vocabulary()
    p = zipf_weights(len(vocab), 1.0)
    locs = [vocab[rng.choice(len(vocab), n_locations, replace=False, p=p)].tolist() for _ in range(B)]
    table = table.drop("embedding").with_columns(pl.Series("locations", locs))
    return requests_from(table, spec, source="bench")


def wall_ms(fn, reps: int, warmup: int = 2) -> float:
    """Median wall-clock milliseconds of fn() (host work)."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t) * 1e3)
    return statistics.median(times)


def cuda_ms(fn, reps: int, warmup: int = 2) -> float:
    """Median milliseconds of fn() on the current stream (the wall clock without a GPU: a smoke run)."""
    if not torch.cuda.is_available():
        return wall_ms(fn, reps, warmup)
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def captured(fn):
    """fn() captured as a CUDA graph (warmed up on a side stream first): (replay, fn's outputs).
    Without a GPU (a smoke run), fn itself."""
    if not torch.cuda.is_available():
        return fn, fn()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # compilation and the allocator's warm-up, outside the capture
        fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn()
    return graph.replay, out


def graph_ms(fn, reps: int) -> float:
    """Median ms of replaying fn() captured as a CUDA graph: its GPU time without Python's launch
    overhead (a kernel call of the search costs tens of microseconds to launch eagerly)."""
    return cuda_ms(captured(fn)[0], reps)


def same_beams(a, b) -> bool:
    """Two searches' `Beams` hold the same tokens, scores and leaves, bit for bit."""
    return bool(torch.equal(a.tokens, b.tokens) and torch.equal(a.score, b.score) and torch.equal(a.leaf, b.leaf))


def graph_search_ms(index, dreq, scorer, beams, mode: Mode, reps: int, value_weight: float = 0.0,
                    layout: str = "compact", widths=None) -> tuple[float, bool]:
    """Median ms of replaying the whole search (compact layout capped to `widths`) captured as a
    CUDA graph, and whether the replay gives the eager uncapped search's beams."""
    replay, static = captured(lambda: beam_search(index, dreq, scorer, beams, mode, "triton", value_weight, layout,
                                                  widths))
    ms = cuda_ms(replay, reps)
    return ms, same_beams(static, beam_search(index, dreq, scorer, beams, mode, "triton", value_weight, layout))


def profile_kernels(fn, runs: int = 5) -> list[dict]:
    """GPU time per kernel over one call of fn (a search, a post stage; mean of `runs`, after a
    warm-up call), every kernel, largest first: what bounds it."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(runs):
            fn()
        torch.cuda.synchronize()

    def us(e) -> float:
        return getattr(e, "self_device_time_total", None) or getattr(e, "self_cuda_time_total", 0.0)

    rows = [{"kernel": e.key[:70], "us": us(e) / runs, "calls": e.count / runs}
            for e in prof.key_averages() if us(e) > 0]
    return sorted(rows, key=lambda r: -r["us"])


def print_profile(profile: list[dict], what: str) -> None:
    """A `profile_kernels` table (nothing without one)."""
    if profile:
        print(f"\nwhere {what} spends GPU time (profiler):\n| kernel | us | calls |\n|---|---|---|")
        for p in profile[:12]:  # the largest
            print(f"| {p['kernel']} | {p['us']:.1f} | {p['calls']:.0f} |")
