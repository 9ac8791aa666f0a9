"""Where a serving batch's time goes on a GPU: `Retriever.run` of one batch of 16 (search and post
stage, replayed as captured at warm-up) per mode, its wall time against the GPU time of its
kernels, and those kernels, largest first.

    python bench/profile_serving.py --ads 1000000 --cache /data/bench    # CUDA only

The catalog is `bench_stream.catalog_root`'s (reused under --cache); the batch is one of
`bench_stream.request_batches`. A wall time well above the kernels' sum is host work (Python,
launches, the result's copy and synchronisation); kernels named after topk, the mask and the
codebook's matrix product are the search's; the post stage's are named in runtime/ops/expand.
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
from sidindex.modes import Mode

MODES = (Mode.NONE, Mode.CD_GTM)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--ads", type=int, default=1_000_000)
    ap.add_argument("--dim", type=int, default=32)
    ap.add_argument("--beams", default="1,512,1024,1024")
    ap.add_argument("--reps", type=int, default=100, help="timed calls per mode")
    ap.add_argument("--top", type=int, default=15, help="kernels listed per mode")
    ap.add_argument("--cache", type=Path, help="keep the catalog and its ROOT here, and reuse them")
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
    for mode in MODES:
        retriever = runtime.Retriever(index, mode=mode, beams=args.beams, batch_sizes=(batch.num_rows,))
        retriever.run(reqs)
        torch.cuda.synchronize()
        t = time.perf_counter()
        for _ in range(args.reps):
            retriever.run(reqs)  # ends with the result's copy to the host: synchronised
        wall = (time.perf_counter() - t) / args.reps * 1e3
        kernels = profile_kernels(functools.partial(retriever.run, reqs))
        gpu = sum(k["us"] for k in kernels) / 1e3
        print(f"\n{mode.value}: wall {wall:.3f} ms per batch, kernels {gpu:.3f} ms (GPU busy {gpu / wall:.0%})")
        print("| kernel | us | calls | share |\n|---|---|---|---|")
        for k in kernels[:args.top]:
            print(f"| {k['kernel']} | {k['us']:.1f} | {k['calls']:.0f} | {k['us'] / 1e3 / gpu:.0%} |")
        del retriever
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    sys.exit(main())
