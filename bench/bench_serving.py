"""Serving with a model in the loop (docs/design.md §12-13): the public searcher against the benchmark's
own captured search, a real decoder's end-to-end time per mode, and Hugging Face `generate` with
and without the processor, all in one run and one table.

    python bench/bench_serving.py                                 # on a CUDA host: ~10M and ~30M SIDs
    python bench/bench_serving.py --ads 100000 --reps 3           # a quick look
    python bench/bench_serving.py --ads 20000 --reps 1 --device cpu   # a smoke run without a GPU

Index: the `bench_search` snapshot (bench_gtm catalog, 2 paths per ad, L=4, V=512, dynamic k-way),
carrying a random codebook (3 levels of 512 centroids in 64 dimensions, hash level 512) so that
the codebook scorer runs through the public path. Requests: B=16 with 64 locations each and
random embeddings, two batches; beams 1,512,1024,1024. Each figure is a median over --reps
(CUDA events on a GPU). Per size:

  codebook   `runtime.codebook_scorer`, the scorer `runtime.retrieve` uses, per mode (and the
             value-guided search in cd+gtm and cd+gtm+kway, target <= 1.1x the plain one: at
             λ = 1e-30, the bound carried through the same beams, and at λ = 1):
             graph     the search captured by this benchmark (`common.graph_search_ms`)
             Searcher  `runtime.Searcher.search`, batches alternating (inputs refreshed, outputs copied)
             eager     `runtime.beam_search`
             target: cd+gtm Searcher <= 1.1x graph
  decoder    `runtime.studies.decoder.ReferenceDecoder` (4 layers, d_model 256, 64 context tokens, KV cache
             reordered by `parent`), eager and through the Searcher (model included in the graph);
             target: cd+gtm <= 1.1x none
  generate   a randomly initialised Llama (4 layers, hidden 256) from `transformers`, 64-token prompts,
             `generate(num_beams=64, num_return_sequences=64, max_new_tokens=4)` without the processor
             and with `runtime.search.hf.SidLogitsProcessor` (cd, cd+gtm); target: cd+gtm <= 1.2x without.
             Skipped, saying so, when transformers is not installed.
Every replayed search must equal the eager one ("same"); the decoder's cached scores must equal the
model's whole-sequence log-probabilities; every SID generate returns with the processor must be a
live catalog SID ("valid").
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make `bench` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np
import pyarrow as pa
import torch

from bench.bench_gtm import LEVELS, bench_spec
from bench.common import bench_requests, build_snapshot, cuda_ms, graph_search_ms, same_beams, wall_ms
from bench.report import verdict, write_json
from runtime import Searcher, beam_search, codebook_scorer, load_index, to_device
from runtime.studies.decoder import DecoderScorer, ReferenceDecoder, context_tokens
from sidindex.config import SIDConfig
from sidindex.modes import Mode
from sidindex.request_encoding import encode_requests
from sidindex.requests import Requests, requests_from
from sidindex.sid import Codebook
from sidindex.snapshot import open_snapshot

DIM, CONTEXT, HISTORY_VOCAB = 64, 64, 1024
MODES = (Mode.NONE, Mode.CD, Mode.CD_GTM)
# the value-guided rows: 1e-30 carries the bound through the whole search but keeps the plain beams
# (the cost of the bound itself); 1 ranks by probability x value bound (other beams, other work)
VALUE_WEIGHTS = (1e-30, 1.0)


def random_codebook(seed: int = 0) -> Codebook:
    """A codebook of the bench catalog's level sizes with random centroids (the SIDs are generated,
    not assigned: the scores mean nothing, the work is the codebook scorer's)."""
    rng = np.random.default_rng(seed)
    levels = LEVELS[:-1]
    cfg = SIDConfig(levels=levels, hash_size=LEVELS[-1], paths=2)
    return Codebook(tuple(rng.standard_normal((k, DIM)).astype(np.float32) for k in levels), LEVELS[-1],
                    cfg.hash_keys, cfg.paths, None, cfg)


def two_batches(B: int, seed: int = 3) -> Requests:
    """2B requests: two batches of `bench_requests`, with random embeddings."""
    a, b = bench_requests(B, 64, seed), bench_requests(B, 64, seed + 1)
    emb = np.random.default_rng(seed).standard_normal((2 * B, DIM)).astype(np.float32)
    table = pa.concat_tables([a.table, b.table]).drop_columns(["request_id"]).append_column(
        "request_id", pa.array(np.arange(2 * B, dtype=np.int64))).append_column(
        "embedding", pa.FixedSizeListArray.from_arrays(pa.array(emb.reshape(-1)), DIM))
    return requests_from(table, bench_spec(), source="bench")


def timer(device: torch.device):
    """ms(fn, reps): the median of fn() over reps (CUDA events on a GPU, the wall clock on the CPU)."""
    return cuda_ms if device.type == "cuda" else wall_ms


def served(index, batch, scorer, beams, mode: Mode, reps: int, value_weight: float = 0.0) -> tuple[dict, list]:
    """Two alternating batches (`batch[i]`, scored by `scorer(i)`, a fresh scorer each call) searched
    eagerly and through one `runtime.Searcher`: ms of each ("eager": batch 0 alone; "Searcher": a
    serving loop's batch, its scorer made and searched), whether it captured, whether every replay
    equals the eager search ("same"); and the eager results."""
    ms = timer(index.device)
    eager = [beam_search(index, batch[i], scorer(i), beams, mode, value_weight=value_weight) for i in (0, 1)]
    searcher, turn = Searcher(beams, mode, value_weight=value_weight), [0]
    ok = all(same_beams(searcher.search(index, batch[i], scorer(i)), eager[i]) for i in (0, 1, 0, 1))

    def serve():
        i = turn[0] = 1 - turn[0]
        return searcher.search(index, batch[i], scorer(i))

    return {"Searcher": ms(serve, reps),
            "eager": ms(lambda: beam_search(index, batch[0], scorer(0), beams, mode, value_weight=value_weight), reps),
            "captured": searcher.eager_reason is None, "same": ok}, eager


def codebook_rows(index, dreq, beams, B: int, reps: int) -> list[dict]:
    """Per mode: the codebook scorer's search as this bench's graph, through the Searcher, eager;
    then the constrained modes with partitions and the value-guided search (each of VALUE_WEIGHTS)."""
    scorer_for = codebook_scorer(index, dreq)
    batch = [dreq.slice(0, B), dreq.slice(B, 2 * B)]

    def scorer(i: int):
        return scorer_for(slice(i * B, (i + 1) * B))

    runs = [(m, 0.0) for m in MODES + ((Mode.CD_GTM_KWAY,) if index.kway else ())]
    if index.gtm.entry_value is not None:
        runs += [(m, w) for m in (Mode.CD_GTM,) + ((Mode.CD_GTM_KWAY,) if index.kway else ()) for w in VALUE_WEIGHTS]
    out = []
    for mode, w in runs:
        r, _ = served(index, batch, scorer, beams, mode, reps, w)
        r = {"scorer": "codebook", "mode": mode.value + (f" value λ={w:g}" if w else ""), **r}
        if index.device.type == "cuda":
            r["graph"], graph_same = graph_search_ms(index, batch[0], scorer(0), beams, mode, reps, w)
            r["same"] &= graph_same
        out.append(r)
    return out


def decoder_rows(index, dreq, beams, B: int, reps: int) -> list[dict]:
    """Per mode: the reference decoder's search, eager and through the Searcher; the cached scores
    against whole-sequence log-probabilities."""
    dev = index.device
    model = ReferenceDecoder(index.level_sizes, HISTORY_VOCAB, CONTEXT).to(dev).eval()
    gen = torch.Generator().manual_seed(0)
    ctx = [context_tokens(torch.randint(0, HISTORY_VOCAB, (B, CONTEXT), generator=gen).tolist(), CONTEXT,
                          HISTORY_VOCAB, dev) for _ in (0, 1)]
    batch = [dreq.slice(0, B), dreq.slice(B, 2 * B)]
    out = []
    for mode in MODES:
        r, eager = served(index, batch, lambda i: DecoderScorer(model, ctx[i]), beams, mode, reps)
        want = model.sequence_logprob(ctx[0], eager[0].tokens)
        alive = eager[0].alive
        out.append({"scorer": "decoder", "mode": mode.value, **r,
                    "score_error": float((eager[0].score[alive] - want[alive]).abs().max()),
                    "live": float(alive.sum(1).float().mean())})
    return out


def generate_rows(index, dreq, B: int, reps: int, num_beams: int) -> list[dict]:
    """`generate` at num_beams without the processor and with it (cd, cd+gtm)."""
    try:
        import transformers
    except ImportError:
        print("transformers is not installed: generate rows skipped (pip install 'sidindex[hf]')", file=sys.stderr)
        return []
    from runtime.search.hf import SidLogitsProcessor

    dev, ms = index.device, timer(index.device)
    L, V = index.sid_length, index.vocab_size
    offset = 3 + HISTORY_VOCAB  # ids 0..2 special (pad, bos, eos), then history tokens, then SID tokens
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=offset + L * V, hidden_size=256, intermediate_size=1024,
                                   num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=4,
                                   max_position_embeddings=CONTEXT + L + 8, pad_token_id=0, bos_token_id=1,
                                   eos_token_id=2)
    model = transformers.LlamaForCausalLM(cfg).to(dev).eval()
    prompts = torch.randint(3, offset, (B, CONTEXT), generator=torch.Generator().manual_seed(1)).to(dev)
    kw = dict(num_beams=num_beams, num_return_sequences=num_beams, max_new_tokens=L, min_new_tokens=L,
              do_sample=False, output_scores=True, return_dict_in_generate=True,
              attention_mask=torch.ones_like(prompts))
    requests = dreq.slice(0, B)
    variants = []
    for mode in (None, Mode.CD, Mode.CD_GTM):
        procs = [] if mode is None else [SidLogitsProcessor(index, requests, mode, prompt_length=CONTEXT,
                                                            num_beams=num_beams, token_offset=offset)]

        def run(procs=procs):
            with torch.no_grad():
                return model.generate(prompts, logits_processor=transformers.LogitsProcessorList(procs), **kw)

        variants.append((mode, procs, run))
    outputs = [run() for _, _, run in variants]  # compiles the mask kernels
    times = [[] for _ in variants]
    for _ in range(reps):  # interleaved: generate's host overhead drifts with the machine's load
        for t, (_, _, run) in zip(times, variants):
            t.append(ms(run, 1, warmup=0))
    out = []
    for (mode, procs, _), got, t in zip(variants, outputs, times):
        r = {"scorer": "HF generate", "mode": "no processor" if mode is None else mode.value,
             "eager": statistics.median(t)}
        if mode is not None:  # every kept sequence is a SID of the catalog
            seqs, keep = got.sequences, got.sequences_scores > -1e6
            r["live"] = float(keep.sum()) / B
            r["valid"] = bool(seqs.shape[1] == CONTEXT + L
                              and (procs[0].nodes(seqs, cfg.vocab_size)[keep] >= 0).all())
        out.append(r)
    return out


def fmt(x, spec: str = ".3f") -> str:
    return "-" if x is None else format(x, spec)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--ads", default="5000000,15000000", help="catalog sizes, comma-separated (2 SIDs per ad)")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--beams", default="1,512,1024,1024")
    ap.add_argument("--num-beams", type=int, default=64, help="generate's beam width")
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--json", help="write the results as JSON here")
    args = ap.parse_args()
    dev = torch.device(args.device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        print("bench_serving needs a CUDA device (or --device cpu for a smoke run)", file=sys.stderr)
        return 2
    beams, B = tuple(int(b) for b in args.beams.split(",")), args.batch
    res: dict = {"batch": B, "beams": list(beams), "device": torch.cuda.get_device_name(dev) if dev.type == "cuda"
                 else "cpu", "sizes": []}
    for n in (int(a) for a in args.ads.split(",")):
        with tempfile.TemporaryDirectory() as tmp:
            print(f"building {n:,} ads ...", file=sys.stderr, flush=True)
            build = build_snapshot(n, Path(tmp), codebook=random_codebook())
            index = load_index(open_snapshot(build["path"], verify=False), dev)
            dreq = to_device(encode_requests(two_batches(B), index.spec), dev)
            size = {"ads": n, "sids": build["sids"], "rows": []}
            for part in (codebook_rows(index, dreq, beams, B, args.reps),
                         decoder_rows(index, dreq, beams, B, args.reps),
                         generate_rows(index, dreq, B, args.reps, args.num_beams)):
                for r in part:
                    print(f"{n:,} ads: {r}", file=sys.stderr, flush=True)
                size["rows"] += part
            res["sizes"].append(size)
            del index, dreq
            if dev.type == "cuda":
                torch.cuda.empty_cache()
    print(f"\n{res['device']}: B={B}, beams {args.beams}; generate at num_beams {args.num_beams}; ms, median of "
          f"{args.reps} (generate's variants interleaved)")
    print("\n| SIDs | scorer | mode | bench graph | runtime.Searcher | Searcher / graph | eager | / none (same path) "
          "| replay = eager | live SIDs / request |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    checks = []
    for size in res["sizes"]:
        rows = size["rows"]
        for r in rows:
            base = next(x for x in rows if x["scorer"] == r["scorer"] and x["mode"] in ("none", "no processor"))
            path = "Searcher" if r.get("captured") else "eager"
            rel = r.get(path, r["eager"]) / base.get(path, base["eager"])
            q = r["Searcher"] / r["graph"] if "graph" in r else None
            ok = r.get("same", r.get("valid"))
            print(f"| {size['sids']:,} | {r['scorer']} | {r['mode']} | {fmt(r.get('graph'))} "
                  f"| {fmt(r.get('Searcher'))} | {fmt(q, '.2f')} | {fmt(r['eager'])} "
                  f"| {rel:.3f}x {'' if path == 'eager' else '(Searcher)'} "
                  f"| {'-' if ok is None else ok} | {fmt(r.get('live'), '.0f')} |")
            if " value " in r["mode"] and "graph" in r:  # the cost of carrying the bound
                plain = next(x for x in rows if x["scorer"] == r["scorer"] and x["mode"] == r["mode"].split()[0])
                q = r["graph"] / plain["graph"]
                checks.append((q <= 1.1, f"{size['sids']:,} SIDs: value-guided {r['mode']} <= 1.1x the plain search "
                                         f"(graph): {q:.3f}x"))
            if r["mode"] == "cd+gtm":
                if r["scorer"] == "codebook" and q is not None:
                    checks.append((q <= 1.1, f"{size['sids']:,} SIDs: codebook cd+gtm through runtime.Searcher "
                                             f"within 10% of the bench's graph: {q:.3f}x"))
                if r["scorer"] == "decoder":
                    checks.append((rel <= 1.1, f"{size['sids']:,} SIDs: reference decoder cd+gtm <= 1.1x none: "
                                               f"{rel:.3f}x"))
                if r["scorer"] == "HF generate":
                    checks.append((rel <= 1.2, f"{size['sids']:,} SIDs: generate with the processor (cd+gtm) <= 1.2x "
                                               f"without: {rel:.3f}x"))
        err = max((r["score_error"] for r in rows if "score_error" in r), default=0.0)
        checks.append((err < 1e-3, f"{size['sids']:,} SIDs: decoder cached scores = whole-sequence log-probs "
                                   f"(max error {err:.1e})"))
        checks.append((all(r.get("same", r.get("valid", True)) for r in rows),
                       f"{size['sids']:,} SIDs: every replay equals eager, every generated SID is in the catalog"))
    print()
    for ok, text in checks:
        print(verdict(ok, text))
    write_json(args.json, res)
    return 0


if __name__ == "__main__":
    sys.exit(main())
