"""`sidindex explain`: its verdicts agree with the matcher and the exact filter, and the attributes it
names are exactly those the eligibility definition rejects (checked ad by ad against the raw lists)."""

from __future__ import annotations

import functools
import json
import subprocess
from pathlib import Path

import numpy as np
import polars as pl
import pyarrow as pa
import pytest
from hypothesis import given, settings

from sidindex.errors import InputError
from sidindex.exact import eligible_mask
from sidindex.explain import Explainer, request_row
from sidindex.requests import Requests
from sidindex.snapshot.snapshot import Snapshot
from sidindex.trie.match import passing_tokens
from sidindex.trie.shard import Shard
from sidindex_cli.explain import parse_sid
from tests.conftest import run_cli
from tests.in_process import run_main
from tests.test_gtm import BITMASK, MANIFEST, Scenario, build, eligible, requests_of, scenarios


def failing_attributes(spec, ad: dict, req: dict) -> tuple[str, ...]:
    """The definition (docs/design.md §3), one attribute at a time, bitmask attributes first."""
    order = [a for a in spec.attributes if a.kind == BITMASK] + [a for a in spec.attributes if a.kind != BITMASK]
    one = {a.name: None for a in spec.attributes}
    return tuple(a.name for a in order if not eligible(spec, {**one, a.name: ad[a.name]}, req))


def explainer(sc: Scenario, r: int) -> tuple[Explainer, object]:
    index, bm, bl, exact, enc = build(sc)
    snap = Snapshot(Path("."), MANIFEST, sc.spec, (Shard(0, index.level_sizes[0], index),), exact,
                    np.arange(len(sc.ads), dtype=np.int64) + 100, codebook=None)
    return Explainer(snap, requests_of(sc), r), (index, exact, enc)


@settings(max_examples=60, deadline=None)
@given(scenarios(max_ads=12))
def test_explanations_agree_with_matcher_and_definition(sc):
    L = len(sc.level_sizes)
    for r, req in enumerate(sc.requests):
        ex, (index, exact, enc) = explainer(sc, r)
        for leaf, sid in enumerate(index.leaf_sids()):
            e = ex.sid(tuple(int(t) for t in sid))
            assert len(e.steps) == L
            node = 0
            for step in e.steps:  # each step's verdict per mode is the matcher's
                for mode, ok in step.passes.items():
                    assert ok == (step.token in passing_tokens(index, enc, r, node, mode))
                lo = index.node_offsets[node]
                node = int(index.csr_child_nodes[lo + np.searchsorted(index.csr_tokens[lo:index.node_offsets[node + 1]],
                                                                      step.token)])
            ads = index.leaf_ads[index.leaf_ad_offsets[leaf]:index.leaf_ad_offsets[leaf + 1]]
            assert [a.ad_id - 100 for a in e.ads] == sorted(set(ads.tolist()))
            ok = eligible_mask(exact, enc, r, np.array([a.ad_id - 100 for a in e.ads]))
            for check, good in zip(e.ads, ok):
                assert (not check.failed) == good
                assert check.failed == failing_attributes(sc.spec, sc.ads[check.ad_id - 100], req)
            # an eligible ad under the SID means every mode reaches it (no false negative)
            if ok.any():
                assert all(e.reached.values())


def test_sid_not_in_catalog_stops_at_the_first_missing_prefix():
    from tests.test_gtm import scenario

    sc = scenario([{"country": ["CA"], "locations": ["loc1"]}], [(2, 1, 3)], [0])
    ex, _ = explainer(sc, 0)
    e = ex.sid((2, 0, 3))
    assert [s.in_catalog for s in e.steps] == [True, False] and e.ads == ()
    assert e.reached == {"cd": False, "cd+gtm": False, "cd+gtm+kway": False}
    e = ex.sid((2, 1, 0))  # only the last token leaves the catalog: every mode's verdict is there for it
    assert [s.in_catalog for s in e.steps] == [True, True, False]
    assert e.steps[-1].passes == {"cd": False, "cd+gtm": False, "cd+gtm+kway": False}
    assert e.reached == {"cd": False, "cd+gtm": False, "cd+gtm+kway": False}
    with pytest.raises(InputError, match="does not fit"):
        ex.sid((2, 1))
    with pytest.raises(InputError, match="does not fit"):
        ex.sid((3, 1, 3))
    with pytest.raises(InputError, match="not in snapshot"):
        ex.ad(5)
    assert [e.sid for e in ex.ad(100)] == [(2, 1, 3)]


def test_request_row_and_parse_sid():
    req = Requests("r.parquet", np.array([7, 9]), None, pa.table({"x": [1, 2]}), pa.table({"x": [1, 2]}))
    assert request_row(req, 9) == 1
    with pytest.raises(InputError, match="choose one by its request_id"):
        request_row(req, None)
    with pytest.raises(InputError, match="no request with request_id 8"):
        request_row(req, 8)
    assert parse_sid("12,40, 7 300") == (12, 40, 7, 300)
    with pytest.raises(InputError, match="integer tokens"):
        parse_sid("12,x")


def cli(*args) -> subprocess.CompletedProcess:
    return run_cli(*args, timeout=300)


def test_explain_cli(sample_dir, tmp_path, monkeypatch, capsys):
    """The build and the first explanation through the console script; the others through its entry
    point in this process (`run_main`: the same output, exit code and line)."""
    here = functools.partial(run_main, monkeypatch, capsys)
    (tmp_path / "build.toml").write_text('[sid]\nlevels = [16, 8, 8]\nhash_size = 128\npaths = 2\n'
                                         'min_points_per_centroid = 10\n[kway]\nmode = "dynamic"\n')
    root = tmp_path / "root"
    r = cli("build", "--catalog", sample_dir / "catalog.parquet", "--targeting", sample_dir / "targeting.toml",
            "--out", root, "--config", tmp_path / "build.toml", "--json")
    assert r.returncode == 0, r.stderr
    requests = sample_dir / "requests.parquet"
    ad_id = pl.read_parquet(sample_dir / "catalog.parquet")["ad_id"][5]
    r = cli("explain", root, "--request", requests, "--request-id", 3, "--ad", ad_id, "--json")
    assert r.returncode == 0, r.stderr
    got = json.loads(r.stdout)
    assert got["request_id"] == 3 and got["explanations"]
    for e in got["explanations"]:
        assert [a["ad_id"] for a in e["ads"]] == [ad_id]
        assert set(e["reached"]) == {"cd", "cd+gtm", "cd+gtm+kway"} and e["reached"]["cd"]
    sid = ",".join(map(str, got["explanations"][0]["sid"]))
    r = here("explain", root, "--request", requests, "--request-id", 3, "--sid", sid)
    assert r.returncode == 0, r.stderr
    assert f"SID {sid}" in r.stdout and "exact filter" in r.stdout and "k-way partitions" in r.stdout
    for args, message in [(("--sid", sid), "choose one by its request_id"),
                          (("--request-id", 3), "exactly one of --sid S and --ad A"),
                          (("--request-id", 3, "--ad", -1), "ad -1 is not in snapshot"),
                          (("--request-id", 3, "--sid", "1,2"), "does not fit this snapshot")]:
        r = here("explain", root, "--request", requests, *args)
        assert r.returncode == 2 and message in r.stderr, (args, r.stderr)
