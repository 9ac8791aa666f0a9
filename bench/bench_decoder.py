"""A real decoder in the loop: end-to-end search time with the reference decoder (KV cache reordered
by `parent`) per mode, against unconstrained decoding with the same model, in the same run.

    python bench/bench_decoder.py                    # on a CUDA host; 2M ads
    python bench/bench_decoder.py --ads 200000 --reps 3

Index: the `bench_search` snapshot (bench_gtm catalog, L=4, V=512, dynamic k-way). Model:
`runtime.decoder.ReferenceDecoder` (4 layers, d_model 256, 64 context tokens of random history).
Requests: B=16 with 64 locations each; beams 1,512,1024,1024. Each figure is the median over
--reps, CUDA events, of `runtime.beam_search` (eager) and of `runtime.Searcher.search` (the whole
search, model included, replayed from a CUDA graph after its first batch; results must equal the
eager ones). Target: cd+gtm <= 1.1x none (the mask costs at most a tenth of what the model does).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make `bench` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch

from bench.bench_search import bench_requests, build_snapshot, cuda_ms
from runtime.decoder import DecoderScorer, ReferenceDecoder, context_tokens
from runtime.loader import load_index
from runtime.requests import to_device
from runtime.search import beam_search
from runtime.serving import Searcher
from sidindex.modes import Mode
from sidindex.requests import encode_requests
from sidindex.snapshot import open_snapshot


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--ads", type=int, default=2_000_000)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--beams", default="1,512,1024,1024")
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--json", help="write the results as JSON here")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("bench_decoder needs a CUDA device", file=sys.stderr)
        return 2
    dev = torch.device("cuda")
    beams = tuple(int(b) for b in args.beams.split(","))
    res: dict = {"ads": args.ads, "batch": args.batch, "beams": list(beams), "gpu": torch.cuda.get_device_name(dev)}
    with tempfile.TemporaryDirectory() as tmp:
        print(f"building {args.ads:,} ads ...", file=sys.stderr, flush=True)
        build = build_snapshot(args.ads, Path(tmp))
        index = load_index(open_snapshot(build["path"], verify=False), dev)
        dreq = to_device(encode_requests(bench_requests(args.batch, 64), index.spec), dev)
        model = ReferenceDecoder(index.level_sizes).to(dev).eval()
        gen = torch.Generator().manual_seed(0)
        history = torch.randint(0, 1024, (args.batch, 64), generator=gen).tolist()
        context = context_tokens(history, 64, 1024, dev)
        rows = {}
        for mode in (Mode.NONE, Mode.CD, Mode.CD_GTM):
            def run(mode=mode):
                return beam_search(index, dreq, DecoderScorer(model, context), beams, mode)

            found = run()
            want = model.sequence_logprob(context, found.tokens)  # the cache's scores, recomputed whole
            alive = found.alive
            searcher = Searcher(beams, mode)
            same = True
            for _ in range(2):  # the capture's own replay, then a replay with new scorer inputs
                replayed = searcher.search(index, dreq, DecoderScorer(model, context))
                same &= bool(torch.equal(replayed.tokens, found.tokens) and torch.equal(replayed.score, found.score))
            rows[mode.value] = {"ms": cuda_ms(run, args.reps),
                                "graph_ms": cuda_ms(lambda: searcher.search(index, dreq, DecoderScorer(model, context)),
                                                    args.reps),
                                "graph_identical": same and searcher.eager_reason is None,
                                "max_score_error": float((found.score[alive] - want[alive]).abs().max()),
                                "live_sids_per_request": float(alive.sum(1).float().mean())}
            print(f"{mode.value}: {rows[mode.value]}", file=sys.stderr, flush=True)
        res["modes"] = rows
    base = rows["none"]["ms"]
    print(f"\n{res['gpu']}: {args.ads:,} ads ({build['sids']:,} SIDs), B={args.batch}, beams {args.beams}, reference "
          "decoder (4 layers, d_model 256, 64 context tokens), eager through runtime.beam_search")
    print("\n| mode | search ms, eager | / none | search ms, Searcher (graph) | graph = eager | live SIDs / request "
          "| max cached - whole-sequence score |")
    print("|---|---|---|---|---|---|---|")
    for mode, r in rows.items():
        print(f"| {mode} | {r['ms']:.2f} | {r['ms'] / base:.3f}x | {r['graph_ms']:.2f} | {r['graph_identical']} | "
              f"{r['live_sids_per_request']:.0f} | {r['max_score_error']:.1e} |")
    ratio = rows["cd+gtm"]["ms"] / base
    print(f"\n{'PASS' if ratio <= 1.1 else 'MISS'}  cd+gtm <= 1.1x none with the reference decoder: {ratio:.3f}x")
    if args.json:
        Path(args.json).write_text(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
