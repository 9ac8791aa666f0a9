"""The path of one batch through the code: which project modules `runtime.Retriever.retrieve`
enters, in order, for a batch of B=16 requests after warm-up. A call from one project module into
another counts as one visit of the callee's module (numba and Triton kernels, torch and pyarrow
are not project modules). It reads how straight the request's path is: how many modules a reader
follows, and which ones it enters again and again.

    python bench/request_walk.py                       # 20k ads on the CPU, cd+gtm
    python bench/request_walk.py --device cuda --ads 1000000 --cache /data/bench_stream

Catalog, snapshot and requests: `bench_stream`'s (`catalog_root` under --cache). On the CPU the
search runs eagerly, so each step enters the constraint and its ops again; on a GPU the search and
post stage replay as one graph. Output: the visits and modules, each module's visits, and the
path.
"""

from __future__ import annotations

import argparse
import collections
import sys
import tempfile
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make `bench` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch

import runtime
from bench.bench_stream import beams_for, catalog_embeddings, catalog_root, request_batches

PROJECT = ("runtime", "sidindex", "schemas")


def module_of(frame) -> str | None:
    """The project module a frame runs in (runtime.serving.searcher; a package's __init__ by the
    package's name), else None."""
    name = frame.f_globals.get("__name__", "")
    return name if name.split(".")[0] in PROJECT else None


def walk(fn) -> list[str]:
    """The project modules `fn()` enters, in order: each call whose nearest project caller is in
    another module (consecutive calls into one module count once)."""
    path: list[str] = []

    def profile(frame, event, arg) -> None:
        if event != "call" or (m := module_of(frame)) is None:
            return
        caller = frame.f_back
        while caller is not None and module_of(caller) is None:
            caller = caller.f_back
        if (caller is None or module_of(caller) != m) and (not path or path[-1] != m):
            path.append(m)

    before = sys.getprofile()  # a profiler already running (cProfile) goes on after
    sys.setprofile(profile)
    try:
        fn()
    finally:
        sys.setprofile(before)
    return path


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ads", type=int, default=20_000)
    ap.add_argument("--dim", type=int, default=32)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--mode", default="cd+gtm")
    ap.add_argument("--beams", help="default: 1,512,1024,1024 on CUDA, 1,16,32,32 on the CPU")
    ap.add_argument("--cache", type=Path, help="where catalogs and ROOTs are kept (default: a temporary directory)")
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="request_walk_") as tmp:
        size = catalog_root(args.ads, args.dim, args.cache or Path(tmp))
        index = runtime.load(size["root"], args.device)
        beams = beams_for(args.beams, torch.device(args.device))
        retriever = runtime.Retriever(index, mode=args.mode, beams=beams, batch_sizes=(16,))
        first, batch = request_batches(index, 2, catalog_embeddings(Path(size["catalog"])))
        retriever.retrieve(first)  # what a first batch alone does (arenas, stagings) is not the path
        path = walk(lambda: retriever.retrieve(batch))
    counts = collections.Counter(path)
    print(f"{len(path)} module visits, {len(counts)} modules ({args.device}, {args.mode}, {args.ads:,} ads)")
    for module, n in counts.most_common():
        print(f"{n:4d}  {module}")
    print("\n" + " -> ".join(path))
    return 0


if __name__ == "__main__":
    sys.exit(main())
