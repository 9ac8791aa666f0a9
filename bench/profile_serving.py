"""Where a serving batch's time goes on a GPU: `Retriever.run` of one batch of 16 (search and post
stage, replayed as captured at warm-up) per mode, its wall time against the GPU time of its
kernels, and those kernels, largest first.

    python bench/profile_serving.py --ads 1000000 --cache /data/bench    # CUDA only

The catalog is `bench_stream.catalog_root`'s (reused under --cache); the batch is one of
`bench_stream.request_batches`. A wall time well above the kernels' sum is host work (Python,
launches, the result's copy and synchronisation); kernels named after topk, the mask and the
codebook's matrix product are the search's; the post stage's are named in runtime/ops/expand.

Each mode runs twice: as served (the codebook scorer's fused step, `runtime.ops.codebook`), and
with the reference of that step measured in the same run (the scorer's logits, then the search's
log-softmax: what a scorer without its own `log_probs` costs), so the ratio holds on a shared card.
"""

from __future__ import annotations

import argparse
import functools
import sys
import tempfile
import time
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make `bench` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch

import runtime
from bench.bench_stream import catalog_embeddings, catalog_root, request_batches
from bench.common import profile_kernels
from bench.report import write_json
from runtime.ops.distribution import level_log_probs
from runtime.scorers.codebook import CodebookScorer
from runtime.search.beam import logits_of
from sidindex.modes import Mode

MODES = (Mode.NONE, Mode.CD_GTM)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--ads", type=int, default=1_000_000)
    ap.add_argument("--dim", type=int, default=32)
    ap.add_argument("--beams", default="1,512,1024,1024")
    ap.add_argument("--reps", type=int, default=100, help="timed calls per mode")
    ap.add_argument("--top", type=int, default=12, help="kernels listed per mode")
    ap.add_argument("--cache", type=Path, help="keep the catalog and its ROOT here, and reuse them")
    ap.add_argument("--json", type=Path, help="also write every figure and every kernel here")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("profile_serving needs a CUDA device", file=sys.stderr)
        return 2
    size = catalog_root(args.ads, args.dim, args.cache or Path(tempfile.mkdtemp(prefix="profile_serving_")))
    index = runtime.load(size["root"], "cuda")
    batch = request_batches(index, 1, catalog_embeddings(Path(size["catalog"])))[0]
    reqs = runtime.requests_from(batch, index)
    print(f"{torch.cuda.get_device_name()}: {args.ads:,} ads, {size['sids']:,} SIDs, B={batch.num_rows}, "
          f"beams {args.beams}; Retriever.run of one batch (search + post stage, replayed)")
    fused_step = CodebookScorer.log_probs

    def unfused(scorer, step, tokens, parent, size):  # the search's path for any other scorer's logits
        return level_log_probs(logits_of(scorer, step, tokens, parent), size)

    rows = []
    for mode in MODES:
        for step in ("fused", "reference"):
            # the reference: the search log-softmaxes the scorer's logits (`runtime.search.beam.log_probs_of`)
            CodebookScorer.log_probs = fused_step if step == "fused" else unfused
            rows.append(profile_one(index, reqs, mode, step, args))
    CodebookScorer.log_probs = fused_step
    print("\n| mode | codebook step | wall ms | kernels ms | launches | GPU busy |\n|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['mode']} | {r['step']} | {r['wall']:.3f} | {r['gpu']:.3f} | {r['launches']:.0f} | "
              f"{r['gpu'] / r['wall']:.0%} |")
    print("\nOne batch's wall time, from the profiler's timeline (ms, mean; the profiler adds to the host's):\n"
          "| mode | codebook step | wall | host before the first kernel | first to last kernel | "
          "of which gaps | host after the last | encode | search+post |\n" + "|---" * 9 + "|")
    for r in rows:
        t, st = r["timeline"], r["stages"]
        print(f"| {r['mode']} | {r['step']} | {t['wall']:.3f} | {t['before']:.3f} | {t['span']:.3f} | "
              f"{t['span'] - t['busy']:.3f} | {t['after']:.3f} | {st['encode']:.3f} | "
              f"{st['search_post']:.3f} |")
    write_json(args.json, rows)
    return 0


def timeline(fn, runs: int = 20) -> dict:
    """Mean ms per call of fn (synchronous): its wall time, the host's time before its first device
    activity and after its last, the span from the first to the last, and the time within the span
    some kernel or copy ran (the rest are gaps: launches, dependencies, the host feeding the GPU)."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile, record_function

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(runs):
            with record_function("one batch"):
                fn()
    events = prof.events()
    calls = sorted((e.time_range.start, e.time_range.end) for e in events
                   if e.name == "one batch" and e.device_type == DeviceType.CPU)
    device = sorted((e.time_range.start, e.time_range.end) for e in events
                    if e.device_type == DeviceType.CUDA and e.name != "one batch")  # not the range's GPU twin
    out = dict.fromkeys(("wall", "before", "span", "busy", "after"), 0.0)
    for i, (lo, hi) in enumerate(calls):
        nxt = calls[i + 1][0] if i + 1 < len(calls) else float("inf")
        mine = [(a, b) for a, b in device if lo <= a < nxt]
        if not mine:
            continue
        first, last = mine[0][0], max(b for _, b in mine)
        busy, reach = 0.0, first
        for a, b in mine:  # the union of the intervals
            busy += max(0.0, b - max(a, reach))
            reach = max(reach, b)
        for k, v in (("wall", hi - lo), ("before", first - lo), ("span", last - first), ("busy", busy),
                     ("after", max(0.0, hi - last))):
            out[k] += v / len(calls) / 1e3
    return out


def profile_one(index, reqs, mode: Mode, step: str, args) -> dict:
    """One mode's wall time per batch, its kernels' time and launches, and its largest kernels (printed)."""
    retriever = runtime.Retriever(index, mode=mode, beams=args.beams, batch_sizes=(len(reqs),))
    retriever.run(reqs)
    torch.cuda.synchronize()
    stages = dict.fromkeys(("encode", "search_post"), 0.0)
    t = time.perf_counter()
    for _ in range(args.reps):
        _, seconds = retriever.run(reqs)  # ends with the result's copy to the host: synchronised
        for k in stages:
            stages[k] += seconds[k] * 1e3 / args.reps
    wall = (time.perf_counter() - t) / args.reps * 1e3
    kernels = profile_kernels(functools.partial(retriever.run, reqs))
    gpu = sum(k["us"] for k in kernels) / 1e3
    launches = sum(k["calls"] for k in kernels)
    print(f"\n{mode.value}, codebook step {step}: wall {wall:.3f} ms per batch, kernels {gpu:.3f} ms in "
          f"{launches:.0f} launches (GPU busy {gpu / wall:.0%})")
    print("| kernel | us | calls | share |\n|---|---|---|---|")
    for k in kernels[:args.top]:
        print(f"| {k['kernel']} | {k['us']:.1f} | {k['calls']:.0f} | {k['us'] / 1e3 / gpu:.0%} |")
    spans = timeline(functools.partial(retriever.run, reqs))
    del retriever
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    return {"mode": mode.value, "step": step, "wall": wall, "gpu": gpu, "launches": launches, "stages": stages,
            "timeline": spans, "kernels": kernels}


if __name__ == "__main__":
    sys.exit(main())
