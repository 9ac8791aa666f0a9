"""The search step's top-k (`runtime.ops.order.top_k`, docs/design.md §8) against a float top-k
without its tie order (the floor) and the int64-key top-k over all candidates it replaced (the
reference, kept here), on one batch of scores per row width.

    python -m bench.bench_topk                    # CUDA if there is one, else a CPU smoke run (seconds)
    python -m bench.bench_topk --device cuda      # B=16, k=1024, N = 32768, 131072, 524288

Scores: B rows of N float32 candidates, as a step's beams x tokens with realistic ties: log-
probability-like normals, a quarter of the candidates sharing one of three values (hash-level tokens
get equal logits), the highest of them placed so that the k-th place falls inside its ties; an
eighth -inf (missing candidates), and the first row with only k/2 finite scores (the cut among its
-inf). Columns: ms of `score.topk(k, sorted=False)` (float32, no tie order: the floor), of the
int64-key reference, of `top_k`, the ratio top_k / float, the speed-up over the reference, and
whether `top_k` gives the reference's positions exactly. On CUDA `triton.testing.do_bench`
(eager, median) and `do_bench_cudagraph` (replayed from a CUDA graph, as the search runs); on the
CPU the median of a wall-clock loop.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make `bench` and `runtime` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch

from bench.common import wall_ms
from bench.report import write_json
from runtime.ops.order import TIE_LIMIT, ordered, top_k

CUDA_SIZES = (32768, 131072, 524288)
CPU_SIZES = (4096, 16384, 65536)


def int64_key_top_k(score: torch.Tensor, k: int) -> torch.Tensor:
    """The reference: `top_k` before it selected by the float score, one int64 key per candidate
    (the score's `ordered` bits x 2^32 + 2^32 - 1 - position) top-k'd over all N. score (B, N)
    float32 -> (B, k) int64."""
    key = ordered(score).mul_(TIE_LIMIT)
    key += torch.arange(TIE_LIMIT - 1, TIE_LIMIT - 1 - score.shape[1], -1, device=score.device)
    return key.topk(k, dim=1, sorted=True).indices


def tied_scores(B: int, N: int, k: int, device: torch.device, seed: int = 0) -> torch.Tensor:
    """(B, N) float32 scores with the module doc's ties and -inf."""
    gen = torch.Generator().manual_seed(seed)
    score = torch.randn(B, N, generator=gen) * 2 - 8
    top = score.kthvalue(N - k // 2, dim=1, keepdim=True).values  # k/2 normals above it: the cut among its ties
    ties = torch.cat([top, top - 1, top - 3], dim=1)
    u = torch.rand(B, N, generator=gen)
    tied = u < 0.25
    score[tied] = ties.gather(1, torch.randint(0, 3, (B, N), generator=gen))[tied]
    score[(u >= 0.25) & (u < 0.375)] = float("-inf")
    score[0, k // 2:] = float("-inf")
    return score.to(device)


def timers(device: torch.device, reps: int) -> dict:
    """name -> ms of fn(), by the device's timers (module doc)."""
    if device.type != "cuda":
        return {"wall": lambda fn: wall_ms(fn, reps)}
    from triton.testing import do_bench, do_bench_cudagraph

    def graph(fn):
        with torch.cuda.stream(torch.cuda.Stream()):  # capture needs a side stream
            return do_bench_cudagraph(fn, rep=100, return_mode="median")

    return {"eager": lambda fn: do_bench(fn, warmup=25, rep=100, return_mode="median"), "graph": graph}


def one_size(device: torch.device, B: int, k: int, N: int, reps: int) -> list[dict]:
    """A row per timer for (B, N) scores (`tied_scores`)."""
    score = tied_scores(B, N, k, device)
    same = torch.equal(top_k(score, k), int64_key_top_k(score, k))
    rows = []
    for timer, ms in timers(device, reps).items():
        rows.append({"N": N, "timer": timer, "same": same,
                     "float_ms": ms(lambda: score.topk(k, dim=1, sorted=False)),
                     "int64_key_ms": ms(lambda: int64_key_top_k(score, k)),
                     "top_k_ms": ms(lambda: top_k(score, k))})
        print(f"N={N:,} {timer}: {rows[-1]['top_k_ms']:.3f} ms", file=sys.stderr, flush=True)
    return rows


def report(rows: list[dict], title: str) -> None:
    from rich.console import Console
    from rich.table import Table

    t = Table(title=title, title_justify="left")
    for c in ("N", "timer", "float32 topk ms", "int64-key ms (reference)", "top_k ms", "top_k / float",
              "reference / top_k", "= reference"):
        t.add_column(c, justify="left" if c == "timer" else "right")
    for r in rows:
        t.add_row(f"{r['N']:,}", r["timer"], f"{r['float_ms']:.3f}", f"{r['int64_key_ms']:.3f}", f"{r['top_k_ms']:.3f}",
                  f"{r['top_k_ms'] / r['float_ms']:.2f}", f"{r['int64_key_ms'] / r['top_k_ms']:.2f}x", str(r["same"]))
    Console(width=None if sys.stdout.isatty() else 160).print(t)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--k", type=int, default=1024)
    ap.add_argument("--sizes", help="N per row, comma-separated (default: 32768,131072,524288 on CUDA, "
                                    "4096,16384,65536 on the CPU)")
    ap.add_argument("--reps", type=int, default=20, help="timed calls on the CPU")
    ap.add_argument("--json", type=Path, help="write the results as JSON here")
    args = ap.parse_args()
    device = torch.device(args.device)
    sizes = tuple(int(n) for n in args.sizes.split(",")) if args.sizes else \
        CUDA_SIZES if device.type == "cuda" else CPU_SIZES
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else f"cpu, {torch.get_num_threads()} threads"
    rows = [row for N in sizes for row in one_size(device, args.batch, args.k, N, args.reps)]
    report(rows, f"top-k ({name}): B={args.batch}, k={args.k}; a quarter of the candidates tied on three values "
                 f"(the k-th among them), an eighth -inf")
    write_json(args.json, {"device": name, "batch": args.batch, "k": args.k, "rows": rows})
    return 0 if all(r["same"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
