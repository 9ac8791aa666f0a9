"""GPU beam-search benchmark at GRACE's shape, about 10M and 30M SIDs in one run: the whole search
per mode against unconstrained search, the mask kernel, the post stage, search + post through the
public API, and where each kernel stands against the bytes it must move.

    python bench/bench_search.py                         # on a CUDA host: 5M and 15M ads (~10M, ~30M SIDs)
    python bench/bench_search.py --ads 200000 --reps 5   # a quick look
    python bench/bench_search.py --profile skewed        # one catalog profile (default: both, side by side)

Index: the `bench_gtm` catalog (GRACE-like widths: 6 bitmask words, a 256-bit 2-hash Bloom
attribute for locations) with generated SIDs, L=4, V=512, 2 paths per ad, built here with dynamic
k-way partitions (k_max 16, target fill 0.5), written as a snapshot, opened (checksums on) and
loaded onto the GPU. --profile: `default` (that catalog: SIDs hold few ads), `skewed` (the same
catalog with `sidindex sample --profile skewed`'s bulk advertisers, `sidindex.sample.Bulk`: each
bulk ad takes the semantic tokens of its advertiser's base ad, as residual k-means gives
near-duplicates, and the hash level is its advertiser's, so each bulk advertiser's ads share one
SID per path: at 15M ads the largest holds thousands) or `both` (the default: each size with each
profile, a table row per profile and mode). Per profile: ads per SID (p50, p99, max) and the most
(request, ad) pairs 1,024 beams reach (the 1,024 largest SIDs' ads; what the post stage's work is
sized by), read on the host from the snapshot's leaf_ad_offsets (`bench_build.ads_per_sid`).
Requests: B=16, 64 locations each, random logits (fixed per step, so only the search is timed).
Beams 1,512,1024,1024. Medians over --reps (CUDA events). Per mode:

  graph       the whole search (log-softmax, mask, top-k, reorder, child lookup, 4 steps) captured
              as a CUDA graph and replayed, each step's compact layout capped to the widths the
              Searcher settled on at its first batch (`runtime.search.beam.capped_widths`; printed):
              what a serving loop pays; the mask, profile and floor figures use them too
  Searcher    `runtime.Searcher.search`, the public API's captured search (outputs copied out,
              its overflow flag read)
  eager       `runtime.beam_search`, launch overhead included (uncapped)
  worst-case widths  the graph with every step's layout as wide as its widest nodes together
  dense       the same search with the dense candidate layout (every beam x token, then a
              search for each chosen (node, token)): the layout before compaction, as a graph
  mask        the mask kernel's calls alone with the inputs the search gave them (the requests'
              query tables and shared rows' tests made), each captured and replayed (its GPU
              time, no launch overhead), summed over the steps
Beside them, in the same run: `plain torch`, an unconstrained beam search in a dozen plain torch
lines (log-softmax, top-k over beams x vocabulary, reorder), as a graph; the masks' GPU time per
search from the profiler (every mask kernel: the masks, whose first step's launch also makes the
requests' query tables and shared rows' tests, and a launch of its own where one makes them;
cd+gtm against cd); the post stage (SIDs -> ads, best score, exact filter, ranking) on the GPU
and the CPU for the cd+gtm beams; search + post through `runtime.Searcher.retrieve`; and, per
step, the floor: the bytes the step must read and write over the device's copy bandwidth,
measured in the same run. Per request: its beams' offsets, its
log-probabilities at its beams' child entries, the candidates written and read back by top-k.
Once for the batch, since the requests share them and a repeated read hits the cache: each
distinct child entry's token and matcher row numbers, each distinct matcher row, and with k-way
each passing entry's partition offsets and first partition's rows. Where a step's depth has
shared rows (its few distinct union rows, tested once per request:
`runtime.ops.planes.shared_rows`), the table gives their number and the mask with every lane
testing its own rows. Every implementation (Triton, torch reference) and layout must return
identical beams, and the replays the eager search's.

Targets (issue 13): cd+gtm graph <= none graph and <= plain torch; cd+gtm mask kernel GPU time <=
1.5x cd at 30M SIDs; cd+gtm+kway graph <= 1.5 ms at 30M SIDs; post <= 0.2 ms per batch on the GPU
and <= 1 ms on the CPU; search + post through the public API <= 1.5 ms at 30M SIDs.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path
from unittest import mock

if __package__ in (None, ""):  # run as a script: make `bench` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np
import polars as pl
import torch
from pyarrow import feather

from bench.bench_build import PAIR_BEAMS, ads_per_sid
from bench.bench_gtm import bench_spec, generated_sids
from bench.bench_post import time_post
from bench.bench_snapshot import write
from bench.common import (
    KWAY,
    bench_requests,
    build_snapshot,
    captured,
    cuda_ms,
    graph_ms,
    graph_search_ms,
    print_profile,
    profile_kernels,
    same_beams,
)
from bench.report import verdict, write_json
from runtime.index.loader import load_index
from runtime.ops.gtm_mask import gtm_candidates
from runtime.ops.slots import every_entry
from runtime.requests import to_device
from runtime.search import constraint
from runtime.search.beam import beam_search
from runtime.serving.post import expand
from runtime.serving.searcher import Searcher
from sidindex.modes import Mode
from sidindex.request_encoding import encode_requests
from sidindex.sample import PROFILES, bulk_ads, sample_catalog
from sidindex.snapshot import open_snapshot

CONSTRAINED = tuple(m for m in Mode if m.constrained)
PATHS = 2  # the bench_gtm SIDs' paths per ad


def generate_skewed(n: int, out: Path) -> None:
    """`bench_gtm.generate`'s files (catalog.arrow, sids.npy, ad_index.npy) for its catalog in the
    skewed profile (the same seed): its generated SIDs, then each bulk ad's semantic tokens set to
    those of its advertiser's base ad (`sidindex.sample.bulk_ads`), per path; the hash token is
    already its advertiser's."""
    spec = bench_spec()
    table = sample_catalog(n, spec, dim=1, seed=0, profile="skewed")
    sids, ad_index = generated_sids(pl.DataFrame({"advertiser_id": table["advertiser_id"].to_numpy()}), PATHS,
                                    np.random.default_rng(0))
    bulk = PROFILES["skewed"]
    assert bulk is not None
    plan = bulk_ads(n, 0, bulk)
    per_ad = sids.reshape(n, PATHS, -1)  # (ad, path) order
    per_ad[plan.rows, :, :-1] = per_ad[plan.base_row[plan.group], :, :-1]  # the right side is gathered first
    feather.write_feather(table.select([a.name for a in spec.attributes] + ["value"]), out / "catalog.arrow",
                          compression="uncompressed")
    np.save(out / "sids.npy", sids)
    np.save(out / "ad_index.npy", ad_index)


def build_profile(n: int, profile: str, out: Path) -> dict:
    """`bench.common.build_snapshot` of n ads in a catalog profile: seconds per stage, its path."""
    if profile == "default":
        return build_snapshot(n, out)
    t = time.perf_counter()
    generate_skewed(n, out)
    return {"generate": time.perf_counter() - t, **write(out, out / "snapshot", kway=KWAY)}


def same_rows(a, b) -> bool:
    """Two post-stage results (`runtime.result.Retrieved`) hold the same rows."""
    return all(np.array_equal(getattr(a, f), getattr(b, f)) for f in ("request", "rank", "ad_id", "sid", "score",
                                                                         "sids", "ads_generated", "ads_eligible"))


def plain_search(logits: list[torch.Tensor], beams: tuple[int, ...]):
    """Unconstrained beam search in plain torch: (B, K) scores and (B, K, L) tokens."""
    B, V = logits[0].shape[0], logits[0].shape[-1]
    score = torch.zeros(B, 1, device=logits[0].device)
    tokens = torch.zeros(B, 1, 0, dtype=torch.int64, device=score.device)
    for d, lg in enumerate(logits):
        cand = score[..., None] + torch.log_softmax(lg, dim=-1)
        k = min(beams[d + 1] if d + 1 < len(beams) else beams[-1], cand.shape[1] * V)
        score, flat = cand.reshape(B, -1).topk(k, dim=1, sorted=d == len(logits) - 1)
        tokens = torch.cat([tokens.gather(1, (flat // V)[..., None].expand(-1, -1, d)), (flat % V)[..., None]], 2)
    return score, tokens


def recorded_masks(index, dreq, scorer, beams, mode, widths=None) -> list[tuple]:
    """The arguments of every candidate-mask call one search (capped to `widths`) makes (the
    search, traced once: the search takes no hook, so its constraint's call is wrapped while it runs)."""
    calls = []

    def record(*args):
        calls.append(tuple(a.clone() if isinstance(a, torch.Tensor) else a for a in args))
        return gtm_candidates(*args)

    with mock.patch.object(constraint, "gtm_candidates", record):
        beam_search(index, dreq, scorer, beams, mode, "triton", widths=widths)
    return calls


def mask_call(c, impl: str = "triton", **shape):
    """Replay a recorded candidate-mask call (index, requests, depth, slots, node, score, logp, mode,
    impl, value_weight, prepare): with `shape` (`gtm_mask_triton`'s keywords) the mask alone, else
    as the search made it (the first step making the requests' tables and shared rows' tests too)."""
    if shape:
        from runtime.ops.gtm_mask.kernel import gtm_mask_triton

        return gtm_mask_triton(c[0], c[1], c[2], c[4], c[4], c[5], c[6], c[7], slots=c[3], **shape)
    return gtm_candidates(*c[:8], impl=impl, prepare=c[10] if len(c) > 10 else None)


def copy_bandwidth(dev) -> float:
    """Bytes per second a device-to-device copy of 2 GiB moves, counting bytes read and written."""
    a = torch.empty(1 << (29 if dev.type == "cuda" else 24), dtype=torch.float32, device=dev)
    b = torch.empty_like(a)
    a.normal_()
    ms = cuda_ms(lambda: b.copy_(a), 10)
    return 2 * a.nbytes / (ms / 1e3)


def read_once(index, slots, passing: torch.Tensor | None = None) -> tuple[int, list[int]]:
    """What a step's batch reads from the trie, each item once: the number of distinct child
    entries in the layout `slots` (of every request's beams; with `passing`, (B, W) bool, only the
    slots it marks), and per matcher plane the distinct rows they index (with `passing`, the rows
    of their first partitions). The batch's requests share these (at step 1 every request reads
    every depth-1 entry), and a repeated read hits the cache, so memory serves each once."""
    _, e, used = every_entry(slots)
    distinct = torch.unique(e[used if passing is None else used & passing])
    g = index.gtm
    if passing is None:
        rows = [p.index[distinct] for p in g.planes]
    else:
        rows = [p.part_index[g.part_offsets[distinct]] for p in g.planes]
    return len(distinct), [len(torch.unique(r.long())) for r in rows]


def floor_rows(index, calls_by_mode: dict, bandwidth: float, reps: int) -> list[dict]:
    """Per mode and step: the bytes the step must move (module doc), the floor they give at
    `bandwidth`, the mask kernel's time and the fraction of the floor it reaches."""
    planes = index.gtm.planes

    def trie_bytes(n_entries: int, rows: list[int], offsets: int) -> int:  # offsets, row numbers, rows
        return n_entries * (offsets + 4 * len(planes)) + sum(r * 8 * p.table.shape[1] for r, p in zip(rows, planes))

    out = []
    for mode, calls in calls_by_mode.items():
        for d, c in enumerate(calls):
            slots, score = c[3], c[5]
            B, W = slots.start.shape[0], slots.width
            beams, entries = int((score > float("-inf")).sum()), int(slots.total.sum())
            distinct, rows = read_once(index, slots)
            # per request: its beams' offsets, its log-probabilities at its entries, its candidates
            # written and read back by top-k; once for the batch: the entries' tokens
            nbytes = beams * 16 + entries * 4 + B * W * 4 * 2 + distinct * 2
            if mode.gtm:
                nbytes += trie_bytes(distinct, rows, 0)
            if mode.kway:  # an entry passing its union reads one partition at least
                passing = gtm_candidates(*c[:7], Mode.CD_GTM).isfinite()
                nbytes += trie_bytes(*read_once(index, slots, passing), 16)
            ms = graph_ms(lambda c=c: mask_call(c), reps)
            # the reference: every group tested query by query (no query tables)
            by_query = graph_ms(lambda c=c: mask_call(c, tabled=False), reps) if mode.gtm else ms
            # and every lane testing its own rows, where the depth has shared rows
            shared = index.shared_rows[d] if mode.gtm and index.shared_rows else None
            own = graph_ms(lambda c=c: mask_call(c, shared=False), reps) if shared is not None else ms
            floor_ms = nbytes / bandwidth * 1e3
            out.append({"mode": mode.value, "step": d, "beams": beams, "entries": entries, "distinct_entries": distinct,
                        "distinct_rows": rows, "width": W, "MB": nbytes / 1e6, "floor_us": floor_ms * 1e3,
                        "mask_us": ms * 1e3, "by_query_us": by_query * 1e3, "own_rows_us": own * 1e3,
                        "shared_rows": 0 if shared is None else shared.count,
                        "of_floor": floor_ms / ms if ms else 0.0})
    return out


def sweep_shapes(calls: list[tuple], reps: int) -> dict:
    """Mask ms per step for compact launch shapes (BLOCK, num_warps, queries per round), then for
    the queries streamed before a query table's lookups (unions, k-way partitions; `by query`: no
    tables) at the default shape."""
    from runtime.ops.gtm_mask.kernel import compact_shape, packs, table_leads

    shapes = [(32, 1, 4), (64, 1, 4), (64, 2, 4), (64, 2, 8), (128, 2, 4), (128, 4, 2), (128, 4, 4), (128, 4, 8),
              (256, 2, 4), (256, 2, 8), (256, 4, 4), (256, 8, 4), (512, 4, 8), (1024, 4, 8)]
    leads = [(0, 0), (2, 0), (8, 0), (32, 0), (8, 2), (8, 8), "by query"]
    out = {}
    for d, c in enumerate(calls):
        shared = c[0].shared_rows[d] if c[0].shared_rows else None
        lay, lanes = c[1].stacked.layout, c[3].start.shape[0] * c[3].width
        can = packs(c[7], shared, lay, lanes, True)  # then each shape both packed and not
        packed = packs(c[7], shared, lay, lanes)
        chosen, lead = compact_shape(d, c[7], packed, shared is not None), table_leads(d)
        out[f"step {d}"] = [
            {"shape": (*s, "packed" if p else "not packed") if can else s, "default": s == chosen and p == packed,
             "ms": graph_ms(lambda s=s, p=p, c=c: mask_call(c, shape=s[:2], qstep=s[2], pack=p), reps)}
            for s in shapes for p in ((True, False) if can else (False,))]
        out[f"step {d} leads"] = [
            {"shape": v, "default": v == lead, "ms": graph_ms(
                lambda v=v, c=c: mask_call(c, tabled=False) if v == "by query" else mask_call(c, leads=v), reps)}
            for v in leads if c[7].kway or v == "by query" or v[1] == 0]
    return out


# the kernels of a search's masks: the mask, and the query tables and shared rows' tests made before it
MASK_KERNELS = ("_gtm_mask_kernel", "_prepare_kernel")


def mask_kernel_us(profile: list[dict]) -> float:
    return sum(p["us"] for p in profile if p["kernel"].startswith(MASK_KERNELS))


def one_size(n: int, profile: str, args, beams: tuple[int, ...], dev) -> dict:
    # "profile" is the kernel profiler's table (as in bench_post), so the catalog's is "catalog_profile"
    res: dict = {"ads": n, "catalog_profile": profile}
    name = f"{n:,} ads ({profile})"
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        if args.keep:  # the snapshot stays for other benchmarks (bench_swap --built: the default's ads-N)
            tmp = Path(args.keep) / (f"ads-{n}" + ("" if profile == "default" else f"-{profile}"))
            tmp.mkdir(parents=True, exist_ok=False)
        print(f"building {name} ...", file=sys.stderr, flush=True)
        res["build"] = build_profile(n, profile, tmp)
        if args.keep:
            (tmp / "build.json").write_text(json.dumps(res["build"]))
        t = time.perf_counter()
        snap = open_snapshot(res["build"]["path"], verify=True)
        res["open_s"] = time.perf_counter() - t
        res["ads_per_sid"] = ads_per_sid(snap, PAIR_BEAMS)
        index = load_index(snap, dev)
        res["load"] = index.load_info
        host_req = encode_requests(bench_requests(args.batch, args.locations), snap.spec)
        dreq = to_device(host_req, dev)
        V, B = index.vocab_size, args.batch
        gen = torch.Generator(device=dev).manual_seed(0)
        k, logits = 1, []
        for d in range(index.sid_length):  # random logits per step, fixed so only the search is timed
            logits.append(torch.randn(B, k, V, device=dev, generator=gen) * 2)
            k = min(beams[d + 1] if d + 1 < len(beams) else beams[-1], k * V)

        def scorer(step, tokens, parent):
            return logits[step]

        class Fixed:  # the same logits from a scorer with per-batch inputs (refreshed, unused: the
            # figure is the Searcher's own cost; a real scorer's compute is its own)
            inputs = {"embedding": torch.zeros(B, 64, device=dev)}

            def __call__(self, step, tokens, parent):
                return logits[step]

        res["bandwidth_GBs"] = copy_bandwidth(dev) / 1e9
        replay, _ = captured(lambda: plain_search(logits, beams))
        res["plain_torch_ms"] = cuda_ms(replay, args.reps)
        rows, calls_by_mode, widths_by_mode = {}, {}, {}
        for mode in Mode:
            r = rows[mode.value] = {}
            print(f"{name}, {mode}", file=sys.stderr, flush=True)
            searcher = Searcher(beams, mode)
            got = searcher.search(index, dreq, Fixed())  # a step the batch overflows is widened here, once
            widths = widths_by_mode[mode] = searcher.widths(index)  # what its graphs replay from now on
            r["widths"] = widths
            r["graph_ms"], r["graph_same"] = graph_search_ms(index, dreq, scorer, beams, mode, args.reps, widths=widths)
            r["searcher_ms"] = cuda_ms(lambda searcher=searcher: searcher.search(index, dreq, Fixed()), args.reps)
            r["eager_ms"] = cuda_ms(lambda mode=mode: beam_search(index, dreq, scorer, beams, mode), args.reps)
            fast = beam_search(index, dreq, scorer, beams, mode, "triton")
            r["live_sids_per_request"] = float(fast.alive.sum(1).float().mean())
            r["identical"] = same_beams(got, fast) and searcher.eager_reason is None and r["graph_same"]
            r["widened"] = searcher.widened  # searches the Searcher ran again wider, all at the first batch
            if mode.constrained:
                r["worst_case_graph_ms"], worst_same = graph_search_ms(index, dreq, scorer, beams, mode, args.reps)
                r["dense_graph_ms"], dense_same = graph_search_ms(index, dreq, scorer, beams, mode, args.reps,
                                                                   layout="dense")
                slow = beam_search(index, dreq, scorer, beams, mode, "torch")  # the plain-torch mask, once
                dense = beam_search(index, dreq, scorer, beams, mode, "triton", layout="dense")
                r["identical"] &= same_beams(fast, slow) and same_beams(fast, dense) and dense_same and worst_same
                calls = calls_by_mode[mode] = recorded_masks(index, dreq, scorer, beams, mode, widths)
                r["mask_per_step_ms"] = [graph_ms(lambda c=c: mask_call(c), args.reps) for c in calls]
                r["mask_ms"] = sum(r["mask_per_step_ms"])
            if mode is Mode.CD_GTM:
                try:  # a failing post stage is reported, and the search figures kept
                    res["post"] = time_post(index, host_req, dreq, fast, reps=args.reps)  # as bench_post
                    # search + post through the public API, captured together: ranked ads on the host
                    r["retrieve_ms"] = cuda_ms(
                        lambda searcher=searcher: searcher.retrieve(index, host_req, Fixed()), args.reps)
                    res["post"]["retrieve_identical"] = same_rows(
                        searcher.retrieve(index, host_req, Fixed()), expand(index, host_req, fast))
                except Exception as e:
                    res["post"] = {"error": f"{type(e).__name__}: {e}"}
        res["modes"] = rows
        res["profile"] = {m.value: profile_kernels(lambda m=m: beam_search(index, dreq, scorer, beams, m, "triton",
                                                                           widths=widths_by_mode[m]))
                          if dev.type == "cuda" else []
                          for m in CONSTRAINED}
        res["floor"] = floor_rows(index, calls_by_mode, res["bandwidth_GBs"] * 1e9, args.reps)
        if args.sweep:
            res["sweep"] = {m.value: sweep_shapes(calls_by_mode[m], args.reps) for m in (Mode.CD_GTM, Mode.CD_GTM_KWAY)}
    return res


def skew_line(res: dict) -> str:
    """A result's ads per SID and the most (request, ad) pairs 1,024 beams reach, in words."""
    a = res["ads_per_sid"]
    return (f"ads per SID p50 {a['p50']:g}, p99 {a['p99']:g}, max {a['max']:,}; the {a['beams']:,} largest SIDs hold "
            f"{a['most_pairs']:,} ads (the most (request, ad) pairs {a['beams']:,} beams reach)")


def report(results: list[dict], B: int, args) -> None:
    """One size's results, a profile each: a line per profile, the modes' table (a row per profile
    and mode), then each profile's details."""
    for res in results:
        b = res["build"]
        print(f"\n## {res['ads']:,} ads ({res['catalog_profile']}): {b['sids']:,} SIDs, {b['nodes']:,} nodes; B={B}, "
              f"beams {args.beams}, {args.locations} request locations; copy bandwidth {res['bandwidth_GBs']:.0f} GB/s")
        print(skew_line(res))
        print(f"load onto the GPU: {res['load']['bytes'] / 1e9:.2f} GB in {res['load']['seconds']:.2f} s; "
              f"open with checksums {res['open_s']:.2f} s")
    print("\n| profile | mode | graph ms | / none | / plain torch | Searcher ms | eager ms | "
          "worst-case widths graph ms | dense layout graph ms | mask ms | identical | live SIDs / request |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for res in results:
        rows, cat = res["modes"], res["catalog_profile"]
        none = rows["none"]["graph_ms"]
        print(f"| {cat} | plain torch (unconstrained) | {res['plain_torch_ms']:.3f} | "
              f"{res['plain_torch_ms'] / none:.2f} | 1.00 | - | - | - | - | - | - | - |")
        for mode, r in rows.items():
            worst, dense, mask = (f"{r[k]:.3f}" if k in r else "-" for k in ("worst_case_graph_ms", "dense_graph_ms",
                                                                              "mask_ms"))
            print(f"| {cat} | {mode} | {r['graph_ms']:.3f} | {r['graph_ms'] / none:.2f} "
                  f"| {r['graph_ms'] / res['plain_torch_ms']:.2f} | {r['searcher_ms']:.3f} | {r['eager_ms']:.3f} "
                  f"| {worst} | {dense} | {mask} | {r['identical']} | {r['live_sids_per_request']:.0f} |")
    for res in results:
        details(res)


def details(res: dict) -> None:
    """One result's per-mode widths, kernel profile, floor per step, sweep and post stage."""
    rows = res["modes"]
    print(f"\n### {res['ads']:,} ads ({res['catalog_profile']})")
    print("compact layout widths per step (the Searcher's after its first batch; - the worst case), and the "
          "first batch's searches again wider: " + "; ".join(
              f"{m} {', '.join('-' if w is None else f'{w:,}' for w in r['widths'])} ({r['widened']})"
              for m, r in rows.items() if r.get("widths")))
    print("\nmask kernel GPU time per search (profiler): " + ", ".join(
        f"{m} {mask_kernel_us(p):.0f} us" for m, p in res["profile"].items()))
    print_profile(res["profile"]["cd+gtm"], "a cd+gtm search, per search,")
    print("\nper step against the floor (bytes the step must move / copy bandwidth):")
    print("| mode | step | live beams | child entries | distinct entries | distinct rows per plane | "
          "slots / request | MB | floor us | mask kernel us | floor / kernel | query by query us | "
          "shared rows | each lane its own rows us |\n"
          "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for f in res["floor"]:
        print(f"| {f['mode']} | {f['step']} | {f['beams']:,} | {f['entries']:,} | {f['distinct_entries']:,} | "
              f"{' / '.join(f'{r:,}' for r in f['distinct_rows'])} | {f['width']:,} | {f['MB']:.1f} | "
              f"{f['floor_us']:.1f} | {f['mask_us']:.1f} | {f['of_floor']:.2f} | {f['by_query_us']:.1f} | "
              f"{f['shared_rows']:,} | {f['own_rows_us']:.1f} |")
    for mode, steps in res.get("sweep", {}).items():
        print(f"\n{mode} mask ms per step by launch shape (BLOCK, warps, queries per round), then by queries "
              "streamed before the table lookups (unions, partitions); * the default:")
        for key, variants in steps.items():
            best = min(variants, key=lambda v: v["ms"])
            print(f"  {key}: " + "  ".join(f"{v['shape']}{'*' if v['default'] else ''} {v['ms']:.3f}"
                                           for v in variants) + f"  | best {best['shape']}")
    if "post" in res:
        print("\npost stage (cd+gtm beams):")
        for k, v in res["post"].items():
            if k != "profile":
                print(f"  {k}: {v:.3f}" if isinstance(v, float) else f"  {k}: {v}")
        print_profile(res["post"].get("profile", []), "the device post stage (kernels), per batch")


def verdicts(results: list[dict]) -> None:
    print()
    for res in results:
        rows, tag = res["modes"], f"{res['build']['sids']:,} SIDs ({res['catalog_profile']})"
        g, none, plain = rows["cd+gtm"]["graph_ms"], rows["none"]["graph_ms"], res["plain_torch_ms"]
        print(verdict(g <= min(none, plain), f"{tag}: cd+gtm graph {g:.3f} ms <= none {none:.3f} "
              f"and plain torch {plain:.3f}"))
        print(verdict(all(r['identical'] for r in rows.values()), f"{tag}: identical beams in every "
              "mode, implementation, layout and replay"))
        if "post" in res and "graph_ms" in res["post"]:
            p = res["post"]
            print(verdict(p['graph_ms'] <= 0.2, f"{tag}: post on the GPU {p['graph_ms']:.3f} ms <= 0.2 "
                  f"(graph; its torch reference {p.get('reference_graph_ms', float('nan')):.3f})"))
        if "retrieve_ms" in rows["cd+gtm"]:
            rt = rows["cd+gtm"]["retrieve_ms"]
            print(verdict(rt <= 1.5, f"{tag}: search + post through runtime.Searcher "
                  f"{rt:.3f} ms <= 1.5"))
    for cat in dict.fromkeys(r["catalog_profile"] for r in results):  # the largest size's, per profile
        big = max((r for r in results if r["catalog_profile"] == cat), key=lambda r: r["ads"])
        cd, gtm = (mask_kernel_us(big["profile"][m]) for m in ("cd", "cd+gtm"))
        tag = f"{big['build']['sids']:,} SIDs ({cat})"
        if cd:
            print(verdict(gtm <= 1.5 * cd, f"{tag}: cd+gtm mask kernel {gtm:.0f} us <= 1.5x cd "
                  f"{cd:.0f} us ({gtm / cd:.2f}x)"))
        kw = big["modes"]["cd+gtm+kway"]["graph_ms"]
        print(verdict(kw <= 1.5, f"{tag}: cd+gtm+kway graph {kw:.3f} ms <= 1.5"))
        if "post" in big and "numba_ms" in big["post"]:
            print(verdict(big['post']['numba_ms'] <= 1, f"{tag}: post on the CPU "
                  f"{big['post']['numba_ms']:.3f} ms <= 1"))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--ads", type=int, nargs="+", default=[5_000_000, 15_000_000])
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--beams", default="1,512,1024,1024")
    ap.add_argument("--locations", type=int, default=64)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--sweep", action="store_true", help="also time the mask kernel's launch shapes")
    ap.add_argument("--json", help="write the results as JSON here")
    ap.add_argument("--keep", help="build into DIR/ads-N (the skewed profile: DIR/ads-N-skewed) and keep it "
                                   "(bench_swap --built DIR reuses the default's)")
    ap.add_argument("--profile", choices=(*PROFILES, "both"), default="both",
                    help="the catalog's profile: default, skewed (bulk advertisers' near-duplicates, some SIDs "
                         "holding thousands of ads: sidindex.sample.Bulk) or both, side by side")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("no CUDA device: a smoke run on the CPU (wall-clock times, no graphs, no kernel profile)",
              file=sys.stderr)
    beams = tuple(int(b) for b in args.beams.split(","))
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    profiles = tuple(PROFILES) if args.profile == "both" else (args.profile,)
    results = []
    for n in args.ads:
        for profile in profiles:
            res = one_size(n, profile, args, beams, dev)
            res["gpu"] = torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu"
            results.append(res)
            write_json(args.json, results)
        report(results[-len(profiles):], args.batch, args)
    verdicts(results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
