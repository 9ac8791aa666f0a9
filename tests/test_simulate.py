"""`sidindex simulate`: every reported count against counts made here from independent pieces (the
catalog's own SID assignment instead of the trie, the eligibility definition on raw lists, the
scorer asked one SID at a time), and recall@K = 1 when the beams exceed the catalog."""

from __future__ import annotations

import json
import math
import subprocess
from collections import defaultdict

import numpy as np
import pytest
import torch

from runtime import Searcher, codebook_scorer, encode_requests, load, read_requests, to_device
from runtime.studies.simulate import exhaustive_top_k, simulate
from sidindex.ingest import read_catalog
from sidindex.sid import assign_sids, hash_tokens, load_codebook
from sidindex.targeting import BITMASK
from tests.conftest import run_cli
from tests.in_process import run_main
from tests.test_gtm import eligible

CONFIG = ('[sid]\nlevels = [16, 8, 8]\nhash_size = 64\npaths = 2\nmin_points_per_centroid = 10\n'
          '[kway]\nmode = "static"\nk = [4, 4, 2, 2]\n')
REQUESTS = 12


def cli(*args) -> subprocess.CompletedProcess:
    return run_cli(*args, timeout=600)


@pytest.fixture(scope="module")
def study(sample_dir, tmp_path_factory):
    """A published snapshot of the sample, its index on the CPU, the first requests, and the
    catalog's SIDs from its own assignment: {SID: [catalog rows]}."""
    base = tmp_path_factory.mktemp("simulate")
    (base / "build.toml").write_text(CONFIG)
    r = cli("build", "--catalog", sample_dir / "catalog.parquet", "--targeting", sample_dir / "targeting.toml",
            "--out", base / "root", "--config", base / "build.toml", "--json")
    assert r.returncode == 0, r.stderr
    index = load(base / "root", "cpu")
    spec = index.snapshot.spec
    reqs = read_requests(sample_dir / "requests.parquet", index).head(REQUESTS)
    cb = load_codebook(base / "root")
    cat = read_catalog(sample_dir / "catalog.parquet", spec=spec, hash_keys=cb.hash_keys)
    a = assign_sids(cb, cat.embedding, hash_tokens(cat.columns, cb.hash_keys, cb.hash_size))
    ads_of = defaultdict(set)
    for row, sid in zip(a.ad_index, a.sids):
        ads_of[tuple(int(t) for t in sid)].add(int(row))
    return base, index, reqs, ads_of, cat


def stage_passes(spec, ad: dict, req: dict) -> tuple[bool, bool]:
    """(every bitmask attribute passes, every bloom attribute passes), from the definition."""
    none = {a.name: None for a in spec.attributes}
    bm = all(eligible(spec, {**none, a.name: ad[a.name]}, req) for a in spec.attributes if a.kind == BITMASK)
    bl = all(eligible(spec, {**none, a.name: ad[a.name]}, req) for a in spec.attributes if a.kind != BITMASK)
    return bm, bl


def test_rates_equal_counts_made_independently(study, sample_dir):
    base, index, reqs, ads_of, cat = study
    spec = index.snapshot.spec
    beams, k = (1, 8, 16, 16), 5
    report = simulate(index, reqs, ("cd", "cd+gtm", "cd+gtm+kway"), beams, k)
    rows = cat.columns.to_dicts()
    req_rows = reqs.columns.to_pylist()
    dreq = to_device(encode_requests(reqs, spec), "cpu")
    for m in report["modes"]:
        # the search the study's retrieval runs (its widths: the hash level's logits tie, and which
        # tied SIDs a top-k keeps depends on the slots it selects from)
        found = Searcher(beams, m["mode"]).search(index, dreq, codebook_scorer(index, dreq)(slice(0, REQUESTS)))
        gen = bm = bl = el = 0
        per_request = []
        for q in range(REQUESTS):
            sids = {tuple(found.tokens[q, j].tolist()) for j in torch.nonzero(found.alive[q]).flatten().tolist()}
            ads = set().union(*(ads_of[s] for s in sids)) if sids else set()
            flags = [stage_passes(spec, rows[a], req_rows[q]) for a in ads]
            gen += len(ads)
            bm += sum(f[0] for f in flags)
            bl += sum(f[1] for f in flags)
            per_request.append(sum(f[0] and f[1] for f in flags))
            el += per_request[-1]
        assert (m["ads_generated"], m["ads_bitmask"], m["ads_bloom"], m["ads_eligible"]) == (gen, bm, bl, el), m["mode"]
        assert m["final_rate"] == pytest.approx(el / gen) and m["bitmask_rate"] == pytest.approx(bm / gen)
        assert m["eligible_per_request_mean"] == pytest.approx(np.mean(per_request))
        assert m["eligible_per_request_p10"] == pytest.approx(np.percentile(per_request, 10))
        assert m["requests_short_of_k"] == sum(n < k for n in per_request)
        assert sum(b["requests"] for b in m["buckets"]) == REQUESTS
        assert sum(b["ads_generated"] for b in m["buckets"]) == gen
    by_mode = {m["mode"]: m for m in report["modes"]}
    assert by_mode["cd+gtm"]["final_rate"] >= by_mode["cd"]["final_rate"]


def test_exhaustive_top_k_equals_scoring_every_sid_alone(study):
    base, index, reqs, ads_of, cat = study
    spec = index.snapshot.spec
    rows, req_rows = cat.columns.to_dicts(), reqs.columns.to_pylist()
    k = 7
    got, best_value = exhaustive_top_k(index, reqs, k)
    dreq = to_device(encode_requests(reqs, spec), "cpu")
    for q in range(3):
        scorer = codebook_scorer(index, dreq)(slice(q, q + 1))
        best = {}
        for sid, ads in ads_of.items():
            s = sum(float(torch.log_softmax(scorer(d, torch.tensor([[list(sid[:d])]], dtype=torch.int64))[0, 0],
                                            -1)[sid[d]])
                    for d in range(len(sid)))
            for a in ads:
                best[a] = max(best.get(a, -math.inf), s)
        ok = [a for a in best if eligible(spec, rows[a], req_rows[q])]
        want = sorted(ok, key=lambda a: (-best[a], int(cat.ad_id[a])))[:k]
        assert [best[a] for a in got[q]] == pytest.approx([best[a] for a in want], rel=1e-4, abs=1e-4)
        assert set(got[q]) == set(want) or len(set(best[a] for a in want)) < len(want)  # ties only
        values = sorted((cat.value[a] for a in range(len(rows)) if eligible(spec, rows[a], req_rows[q])), reverse=True)
        assert best_value[q] == pytest.approx(sum(values[:k]))  # value@K's denominator


def test_recall_and_value_are_one_when_beams_exceed_the_catalog(study):
    base, index, reqs, ads_of, cat = study
    report = simulate(index, reqs, ("cd", "cd+gtm", "cd+gtm+kway"), (1, 10_000, 10_000, 10_000), 10,
                      value_weights=(2.0,))
    for m in report["modes"]:
        assert m["recall_at_10"] == 1.0, m["mode"]
        assert m["requests_whose_beams_all_died"] == m["requests_without_eligible_ads_in_catalog"] == 0
        # every eligible ad is returned: the 10 most valuable too, whatever the weight
        assert m["value_at_10"] == pytest.approx(1.0) and m["value_by_weight"][0]["value_at_10"] == pytest.approx(1.0)


def test_simulate_cli(study, sample_dir, tmp_path, monkeypatch, capsys):
    """The study through the console script; the bad options through its entry point in this
    process (`run_main`: the same exit code and line)."""
    base, *_ = study
    r = cli("simulate", base / "root", "--requests", sample_dir / "requests.parquet", "--beams", "1,8,16,16",
            "--top-k", 5, "--max-requests", 6, "--json", "--plot", tmp_path / "study.png", "--value-weights", "1,4")
    assert r.returncode == 0, r.stderr
    report = json.loads(r.stdout)
    assert [m["mode"] for m in report["modes"]] == ["cd", "cd+gtm", "cd+gtm+kway"] and report["requests"] == 6
    for m in report["modes"]:
        assert [w["weight"] for w in m["value_by_weight"]] == [1.0, 4.0]
        assert all(0 <= v <= 1 for v in [m["value_at_5"]] + [w["value_at_5"] for w in m["value_by_weight"]])
    assert (tmp_path / "study.png").read_bytes()[:4] == b"\x89PNG"
    r = run_main(monkeypatch, capsys, "simulate", base / "root", "--requests", sample_dir / "requests.parquet",
                 "--modes", "cd,bogus")
    assert r.returncode == 2 and "mode must be one of" in r.stderr
    r = run_main(monkeypatch, capsys, "simulate", base / "root", "--requests", sample_dir / "requests.parquet",
                 "--value-weights", "1,x")
    assert r.returncode == 2 and "--value-weights '1,x'" in r.stderr and len(r.stderr.strip().splitlines()) == 1
