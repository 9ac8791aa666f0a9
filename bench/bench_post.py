"""Post-stage benchmark: SIDs -> ads, best score per ad, exact filter and ranking for one batch,
host numba path next to the numpy implementation it replaced, measured in the same run, and on a
GPU the device path (`runtime.serving.post.DevicePost`), eager and captured in a CUDA graph, next to the
op's torch reference at the same capacity, in the same run.

    python bench/bench_post.py                  # 5M ads; on a CUDA host it also times the device path
    python bench/bench_post.py --ads 200000     # CPU-sized
    python bench/bench_post.py --skew ""        # without the skewed case

Index and requests: `bench_search`'s (`common`: the `bench_gtm` catalog, generated SIDs, 2 paths
per ad, dynamic k-way; B=16 requests with 64 locations each), except that a few SIDs hold thousands
of ads (--skew: the first 20,000 ads share one SID, the next 10,000 another, ...: near-duplicate
creatives of big advertisers). Beams: a cd+gtm search with beams 1,512,1024,1024 and random logits
(fixed per step), so the beams are the ones a search returns: about 1,024 live SIDs per request;
the skewed case puts those hot SIDs among every request's beams (in the first beams' places).
Per run the median over --reps runs of one batch:
  numpy         the former `runtime.serving.post.expand` (lexsort passes), kept here as the reference
  numba         `runtime.serving.post.expand` on the host (beams already on the host)
  device        `DevicePost.run` timed with CUDA events, eager and replayed as a CUDA graph, at two
                capacities C: the default (`pairs` None: the bound, at most 65,536 pairs a
                request) and one fitted to the batch as a serving `Searcher` fits it to its
                warm-up (`fitted_pairs`, `post_room`: twice the most pairs a request reached, at
                least 1,024, a power of 2, at most the bound)
  device+copy   run (graph) + `DevicePost.result`: the one device-to-host copy and the host rows
  reference     `DevicePost` with the op's torch reference (impl "torch") at the same capacity, as a
                CUDA graph; the ratio is its time over the kernels'
and the device path's GPU time per kernel (the profiler), for the score ranking.
Every path must give the numpy reference's `Retrieved`. Targets: post <= 0.3 ms per batch at top 100
and <= 1 ms for all ads on the GPU (the graph, fitted capacity), <= 1 ms on the CPU (numba).
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import tempfile
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make `bench` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np
import torch

from bench.bench_gtm import generate
from bench.bench_snapshot import write
from bench.common import KWAY, bench_requests, captured, cuda_ms, print_profile, profile_kernels, wall_ms
from bench.report import verdict, write_json
from runtime.index.loader import load_index
from runtime.ops.expand import RRF_K
from runtime.ops.expand.host import exact_pairs
from runtime.requests import to_device
from runtime.result import Retrieved
from runtime.search.beam import Beams, beam_search
from runtime.serving.post import DevicePost, expand
from runtime.serving.searcher import fitted_pairs, post_room
from sidindex.modes import Mode
from sidindex.request_encoding import encode_requests
from sidindex.snapshot import open_snapshot
from sidindex.trie.build import expand_runs

BEAMS = (1, 512, 1024, 1024)
SKEW = "20000,10000,5000,2000"  # ads of the hot SIDs


def numpy_expand(index, requests, beams: Beams, top_k=None, stages=False, rank="score") -> Retrieved:
    """The post stage as `runtime.serving.post.expand` computed it before the numba path (the reference):
    vectorised numpy passes over all (request, ad) pairs, lexsort for dedupe and ranking."""
    snap, g = index.snapshot, index.gtm
    tokens, score, leaf = (t.cpu().numpy() for t in (beams.tokens, beams.score, beams.leaf))
    B = len(score)
    b, k = np.nonzero((leaf >= 0) & (score > -np.inf))
    lf = leaf[b, k]
    start, count = g.leaf_ad_offsets[lf], g.leaf_ad_offsets[lf + 1] - g.leaf_ad_offsets[lf]
    beam = np.repeat(np.arange(len(lf)), count)
    ad = np.asarray(g.leaf_ads[expand_runs(start, count)], dtype=np.int64)
    if snap.exact.ad_state is not None:
        live = snap.exact.live(ad)
        beam, ad = beam[live], ad[live]
    req, sc = b[beam], score[b[beam], k[beam]]
    order = np.lexsort((-sc, ad, req))
    req, ad, beam, sc = req[order], ad[order], beam[order], sc[order]
    first_of = np.ones(len(req), dtype=bool)
    first_of[1:] = (req[1:] != req[:-1]) | (ad[1:] != ad[:-1])
    req, ad, beam, sc = req[first_of], ad[first_of], beam[first_of], sc[first_of]
    generated = np.bincount(req, minlength=B)
    ok, per_stage = exact_pairs(snap.exact, requests, req, ad, B, stages)  # the one exact test, as `expand`
    req, ad, beam, sc = req[ok], ad[ok], beam[ok], sc[ok]
    ad_id = snap.ad_id[ad]
    val = None if g.ad_value is None else np.asarray(g.ad_value[ad], dtype=np.float64)
    by = {"score": (-sc,), "value": (-sc, -val) if val is not None else None}
    if rank == "fused":
        fused = 1 / (RRF_K + _ranks(req, ad_id, by["score"])) + 1 / (RRF_K + _ranks(req, ad_id, by["value"]))
        by["fused"] = (-fused,)
    order = np.lexsort((ad_id, *by[rank], req))
    req, ad, ad_id, beam, sc = req[order], ad[order], ad_id[order], beam[order], sc[order]
    val = None if val is None else val[order]
    starts = np.searchsorted(req, np.arange(B))
    place = np.arange(len(req)) - starts[req] + 1
    eligible = np.bincount(req, minlength=B)
    if top_k is not None:
        keep = place <= top_k
        req, ad, ad_id, beam, sc, place = req[keep], ad[keep], ad_id[keep], beam[keep], sc[keep], place[keep]
        val = None if val is None else val[keep]
    return Retrieved(req.astype(np.int64), place.astype(np.int64), ad, np.asarray(ad_id, dtype=np.int64),
                     tokens[b[beam], k[beam]], sc.astype(np.float32), np.bincount(b, minlength=B), generated, eligible,
                     **per_stage, value=val)


def _ranks(req, ad_id, keys):
    order = np.lexsort((ad_id, *keys, req))
    out = np.empty(len(req), dtype=np.int64)
    out[order] = np.arange(len(req)) - np.searchsorted(req[order], req[order], side="left") + 1
    return out


def same(a: Retrieved, b: Retrieved) -> bool:
    """Every field equal, dtypes included."""
    for f in dataclasses.fields(Retrieved):
        x, y = getattr(a, f.name), getattr(b, f.name)
        if isinstance(x, dict) or isinstance(y, dict):
            if not (isinstance(x, dict) and isinstance(y, dict) and x.keys() == y.keys()
                    and all(np.array_equal(x[k], y[k]) for k in x)):
                return False
        elif not ((x is None and y is None) or (x is not None and y is not None and x.dtype == y.dtype
                                                  and np.array_equal(x, y))):
            return False
    return True


def time_post(index, requests_host, requests_device, beams: Beams, *, top_k: int | None = None,
              stages: bool = False, rank: str = "score", reps: int = 20, profile: bool = False) -> dict:
    """Milliseconds per batch of the post stage by path (module doc) and whether each path gives
    the numpy reference's result. index: served on the CPU or a GPU; requests_host: the batch's host
    encoding; requests_device: its `to_device` form on the index's device; beams: a search's, on
    the index's device. Device figures per capacity under "capacities" (default, fitted)."""
    host_beams = Beams(beams.tokens.cpu(), beams.score.cpu(), beams.leaf.cpu())
    want = numpy_expand(index, requests_host, host_beams, top_k, stages, rank)
    res: dict = {"live_sids_per_request": float(want.sids.mean()),
           "ads_generated_per_request": float(want.ads_generated.mean()),
           "ads_eligible_per_request": float(want.ads_eligible.mean()),
           "numpy_ms": wall_ms(lambda: numpy_expand(index, requests_host, host_beams, top_k, stages, rank), reps),
           "numba_ms": wall_ms(lambda: expand(index, requests_host, host_beams, top_k, stages, rank), reps),
           "numba_identical": same(expand(index, requests_host, host_beams, top_k, stages, rank), want)}
    if index.post is None or not beams.score.is_cuda:
        return res
    B, K = beams.score.shape
    res["expand_ms"] = wall_ms(lambda: expand(index, requests_device, beams, top_k, stages, rank), reps)
    res["expand_identical"] = same(expand(index, requests_device, beams, top_k, stages, rank), want)
    default = DevicePost(index, B, K, top_k=top_k, rank=rank, stages=stages)
    default.result(default.run(requests_device, beams))
    assert default.last_reached is not None  # `result` sets it
    most = int(default.last_reached.max())
    res["reached_mean"], res["reached_max"] = float(default.last_reached.mean()), most
    kw = {"top_k": top_k, "rank": rank, "stages": stages}
    res["capacities"] = {"default": time_capacity(index, requests_device, beams, want, None, kw, reps, False),
                         "fitted": time_capacity(index, requests_device, beams, want,
                                                 post_room(fitted_pairs(most), False, default.bounds.most_pairs(K)), kw,
                                                 reps, profile)}
    return res


def time_capacity(index, requests_device, beams: Beams, want: Retrieved, pairs: int | None, kw: dict, reps: int,
                  profile: bool) -> dict:
    """The device path's figures at one capacity (`DevicePost`'s `pairs`; `kw`: its top_k, rank and
    stages): eager, as a CUDA graph, with `result`, and the op's torch reference as a CUDA graph."""
    B, K = beams.score.shape
    post = DevicePost(index, B, K, pinned=True, pairs=pairs, **kw)  # as Searcher's
    r: dict = {"pairs": post.layout.pairs}
    r["device_ms"] = cuda_ms(lambda: post.run(requests_device, beams), reps)
    r["device_identical"] = _same_or_overflow(post.result(post.run(requests_device, beams)), want)
    if profile:
        r["profile"] = profile_kernels(lambda: post.run(requests_device, beams))
    try:  # a failing capture means a host sync crept into the device path: report it
        replay, out = captured(lambda: post.run(requests_device, beams))
        r["graph_ms"] = cuda_ms(replay, reps)

        def replay_and_copy():
            replay()
            return post.result(out)

        r["graph_copy_ms"] = wall_ms(replay_and_copy, reps)
        r["graph_identical"] = _same_or_overflow(replay_and_copy(), want)
    except Exception as e:
        r["graph_error"] = f"{type(e).__name__}: {e}"
    try:  # the op's torch reference (`runtime.ops.expand`) at the same capacity, captured alike
        ref = DevicePost(index, B, K, pinned=True, impl="torch", pairs=pairs, **kw)
        ref_replay, ref_out = captured(lambda: ref.run(requests_device, beams))
        r["reference_graph_ms"] = cuda_ms(ref_replay, reps)
        ref_replay()
        r["reference_identical"] = _same_or_overflow(ref.result(ref_out), want)
    except Exception as e:
        r["reference_error"] = f"{type(e).__name__}: {e}"
    return r


def _same_or_overflow(got: Retrieved | None, want: Retrieved) -> bool | None:
    """`same`, or None where the batch overflowed the capacity (a result not given, never a wrong one)."""
    return None if got is None else same(got, want)


def skew(inputs: Path, hot: tuple[int, ...]) -> list[tuple[int, ...]]:
    """Rewrite the SIDs `generate` wrote so that hot[h] ads share one SID each (their first path:
    the first hot[0] ads the SID of ad 0's first path, the next hot[1] that of the next one's, ...;
    their second paths stay); returns the hot SIDs."""
    sids = np.load(inputs / "sids.npy")  # (ads x 2, L) in (ad, path) order
    at, out = 0, []
    for n in hot:
        sid = sids[2 * at].copy()
        sids[2 * at:2 * (at + n):2] = sid
        out.append(tuple(int(t) for t in sid))
        at += n
    np.save(inputs / "sids.npy", sids)
    return out


def leaf_of(gtm, sid: tuple[int, ...]) -> int:
    """The leaf number of a catalog SID (a walk down the host trie)."""
    node = 0
    for t in sid:
        lo, hi = gtm.node_offsets[node], gtm.node_offsets[node + 1]
        e = lo + int(np.searchsorted(gtm.csr_tokens[lo:hi], t))
        assert e < hi and gtm.csr_tokens[e] == t, f"SID {sid} is not in the catalog"
        node = int(gtm.csr_child_nodes[e])
    return node - int(gtm.depth_offsets[len(sid)])


def with_hot(beams: Beams, gtm, hot: list[tuple[int, ...]]) -> Beams:
    """The beams with the hot SIDs in every request's first places (their scores kept), and any
    other beam on a hot SID dead: beams on distinct SIDs."""
    tokens, score, leaf = beams.tokens.clone(), beams.score.clone(), beams.leaf.clone()
    leaves = torch.tensor([leaf_of(gtm, s) for s in hot], device=leaf.device)
    again = torch.isin(leaf, leaves)
    score[again], leaf[again] = float("-inf"), -1
    h = len(hot)
    tokens[:, :h] = torch.tensor(hot, device=tokens.device)
    leaf[:, :h] = leaves
    score[:, :h] = beams.score[:, :h].clamp(min=-1e30)  # live
    return Beams(tokens, score, leaf)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--ads", type=int, default=5_000_000)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--locations", type=int, default=64)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--skew", default=SKEW, help="ads of each hot SID, comma-separated ('': no skewed case)")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--json", help="write the results as JSON here")
    args = ap.parse_args()
    dev = torch.device(args.device)
    hot_sizes = tuple(int(x) for x in args.skew.split(",") if x)
    res: dict = {"ads": args.ads, "batch": args.batch, "beams": list(BEAMS), "locations": args.locations,
                 "skew": list(hot_sizes), "device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu"}
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        print(f"building {args.ads:,} ads ...", file=sys.stderr, flush=True)
        generate(args.ads, 2, tmp)
        hot = skew(tmp, hot_sizes) if hot_sizes else []
        build = write(tmp, tmp / "snapshot", kway=KWAY)
        snap = open_snapshot(build["path"], verify=True)
        index = load_index(snap, dev)
        host = encode_requests(bench_requests(args.batch, args.locations), snap.spec)
        dreq = to_device(host, dev)
        gen = torch.Generator(device=dev).manual_seed(0)
        k, logits = 1, []
        for d in range(index.sid_length):  # random logits per step, as bench_search
            logits.append(torch.randn(args.batch, k, index.vocab_size, device=dev, generator=gen) * 2)
            k = min(BEAMS[d + 1] if d + 1 < len(BEAMS) else BEAMS[-1], k * index.vocab_size)
        beams = beam_search(index, dreq, lambda step, tokens, parent: logits[step], BEAMS, Mode.CD_GTM)
        runs = {"score": time_post(index, host, dreq, beams, reps=args.reps, profile=True)}
        if index.gtm.ad_value is not None:
            runs["fused"] = time_post(index, host, dreq, beams, rank="fused", reps=args.reps)
        runs["score, top 100, stages"] = time_post(index, host, dreq, beams, top_k=100, stages=True, reps=args.reps)
        if hot:
            skewed = with_hot(beams, snap.gtm, hot)
            runs["skewed: score, top 100"] = time_post(index, host, dreq, skewed, top_k=100, reps=args.reps,
                                                       profile=True)
            runs["skewed: score"] = time_post(index, host, dreq, skewed, reps=args.reps)
            if index.gtm.ad_value is not None:
                runs["skewed: fused"] = time_post(index, host, dreq, skewed, rank="fused", reps=args.reps)
        res["runs"] = runs
    r0 = runs["score"]
    print(f"\n{res['device']}: {args.ads:,} ads, B={args.batch}, beams {','.join(map(str, BEAMS))} (cd+gtm), "
          f"{r0['live_sids_per_request']:.0f} live SIDs, {r0['ads_generated_per_request']:.0f} ads generated and "
          f"{r0['ads_eligible_per_request']:.0f} eligible per request (means); skewed: hot SIDs of "
          f"{', '.join(map(str, hot_sizes)) or 'none'} ads")
    print("\n| run | pairs reached, mean / max | numpy ms (reference) | numba ms | capacity C | device ms, eager "
          "| device ms, CUDA graph | graph + result() ms | torch reference ms, CUDA graph | reference / device "
          "| identical |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for name, r in runs.items():
        reached = f"{r['reached_mean']:.0f} / {r['reached_max']}" if "reached_max" in r else "-"
        for cap in r.get("capacities", {"-": {}}).values():
            dev_ms = f"{cap['device_ms']:.3f}" if "device_ms" in cap else "-"
            graph = f"{cap['graph_ms']:.3f}" if "graph_ms" in cap else cap.get("graph_error", "-")[:40]
            copy = f"{cap['graph_copy_ms']:.3f}" if "graph_copy_ms" in cap else "-"
            ref = f"{cap['reference_graph_ms']:.3f}" if "reference_graph_ms" in cap else \
                cap.get("reference_error", "-")[:40]
            ratio = f"{cap['reference_graph_ms'] / cap['graph_ms']:.1f}x" if "graph_ms" in cap and \
                "reference_graph_ms" in cap else "-"
            flags = [v for key, v in {**r, **cap}.items() if key.endswith("identical")]
            same_all = "overflow" if any(v is None for v in flags) else all(flags)
            print(f"| {name} | {reached} | {r['numpy_ms']:.3f} | {r['numba_ms']:.3f} | {cap.get('pairs', '-')} | "
                  f"{dev_ms} | {graph} | {copy} | {ref} | {ratio} | {same_all} |")
    print("\n" + verdict(r0['numba_ms'] <= 1, f"host post <= 1 ms per batch: {r0['numba_ms']:.3f} ms "
          f"(numba, score ranking)"))
    for name, r in runs.items():
        prof = r.get("capacities", {}).get("fitted", {}).get("profile", [])
        print_profile(prof, f"the device post stage ({name}, fitted capacity), per batch,")
    for name, limit in (("score, top 100, stages", 0.3), ("score", 1.0), ("skewed: score, top 100", 0.3),
                        ("skewed: score", 1.0)):
        fit = runs.get(name, {}).get("capacities", {}).get("fitted", {})
        if "graph_ms" in fit:
            print(verdict(fit['graph_ms'] <= limit, f"device post ({name}) <= {limit} ms per batch: "
                  f"{fit['graph_ms']:.3f} ms (CUDA graph, capacity {fit['pairs']:,}), {fit['device_ms']:.3f} ms eager"))
    write_json(args.json, res)
    return 0


if __name__ == "__main__":
    sys.exit(main())
