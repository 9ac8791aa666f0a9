"""Benchmark helpers a reported figure depends on: the SID benchmark compares against faiss RQ
only after unpacking its bit-packed codes; the search benchmark's floor counts what a step reads;
the request walk counts a module each time another one calls into it; an A/B benchmark runs
another checkout's code, or refuses a --baseline that holds none."""

import argparse
from pathlib import Path

import faiss
import numpy as np
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from bench.bench_search import read_once
from bench.bench_sid import unpack_rq_codes
from bench.request_walk import walk
from runtime.ops.slots import slots_of
from sidindex.modes import parse_mode
from sidindex.sample import sample_spec
from tests.test_gtm import scenarios
from tests.test_runtime import Case


def test_unpacked_faiss_codes_reconstruct_like_faiss():
    rng = np.random.default_rng(0)
    x = rng.standard_normal((2000, 6)).astype(np.float32)
    levels, nbits = 3, 5  # 15 bits: codes straddle byte boundaries
    rq = faiss.ResidualQuantizer(6, levels, nbits)
    rq.train(x)
    codes = rq.compute_codes(x[:300])
    tokens = unpack_rq_codes(codes, nbits, levels)
    assert tokens.shape == (300, levels) and tokens.min() >= 0 and tokens.max() < 1 << nbits
    books = faiss.vector_to_array(rq.codebooks).reshape(levels, 1 << nbits, 6)
    recon = sum(books[lv][tokens[:, lv]] for lv in range(levels))
    np.testing.assert_allclose(recon, rq.decode(codes), rtol=0, atol=1e-6)


@settings(max_examples=25, deadline=None)
@given(scenarios(max_ads=15), st.integers(0, 2**32 - 1))
def test_the_floor_counts_what_the_batch_reads_once(sc, seed):
    """`bench_search.read_once` against a walk over every request's beams: the distinct child
    entries, the distinct rows they index, and a passing entry's first partition's rows."""
    case = Case(sc)
    g, gen = case.gtm, np.random.default_rng(seed)
    depth = int(gen.integers(0, g.sid_length))
    nodes = np.arange(g.depth_offsets[depth], g.depth_offsets[depth + 1])
    B, K = len(sc.requests), min(3, len(nodes))  # a request's beams sit at distinct nodes
    node = torch.tensor(np.stack([gen.choice(nodes, K, replace=False) for _ in range(B)]), dtype=torch.int64)
    score = torch.tensor(np.where(gen.random((B, K)) < 0.2, -np.inf, 0.0), dtype=torch.float32)
    slots = slots_of(case.index, node, score, case.index.most_children(depth, K))
    entries = {e for b in range(B) for k in range(K) if score[b, k] > -np.inf
               for e in range(g.node_offsets[node[b, k]], g.node_offsets[node[b, k] + 1])}
    n, rows = read_once(case.index, slots)
    assert n == len(entries)
    assert rows == [len({int(p.index[e]) for e in entries}) for p in g.planes]
    passing = torch.tensor(gen.random((B, slots.width)) < 0.5)
    chosen = {int(slots.first[b, k]) + c for b in range(B) for k in range(K)  # child c of beam k: slot start + c
              for c in range(int(slots.count[b, k])) if passing[b, slots.start[b, k] + c]}
    n, rows = read_once(case.index, slots, passing)
    assert n == len(chosen)
    if g.part_offsets is not None:
        assert rows == [len({int(p.part_index[g.part_offsets[x]]) for x in chosen}) for p in g.planes]


def test_the_walk_counts_a_module_each_time_another_calls_into_it():
    # calls from outside the project, one after another into one module: one visit
    assert walk(lambda: (parse_mode("cd"), parse_mode("none"))) == ["sidindex.modes"]
    # the sample spec's attributes, then the spec that holds them, which calls back into them (a
    # dataclass's generated methods count as its class's module): each module entered from another
    assert walk(sample_spec) == ["sidindex.sample", "sidindex.matchers.attribute", "sidindex.targeting",
                                 "sidindex.matchers.attribute"]


def test_a_baseline_without_a_checkouts_packages_is_refused_before_anything_runs(tmp_path, capsys, monkeypatch):
    """--baseline DIR of the A/B benchmarks: a folder holding checkouts rather than one (as
    .baseline/REV/ are kept) would put no package first on the path, and the "baseline" would
    run this checkout's code; it is refused in one line naming what it holds."""
    import pytest

    from bench import bench_engine, bench_frontend, profile_server
    from bench.report import PACKAGES, checkout

    (tmp_path / "abc1234" / "runtime").mkdir(parents=True)
    (tmp_path / "abc1234" / "runtime" / "__init__.py").touch()
    (tmp_path / "abc1234" / "sidindex").mkdir()
    (tmp_path / "abc1234" / "sidindex" / "__init__.py").touch()
    assert checkout(str(tmp_path / "abc1234")) == tmp_path / "abc1234"
    repo = Path(profile_server.__file__).resolve().parents[1]
    monkeypatch.chdir(repo)
    for this in (str(repo), ".", ""):  # this checkout itself is no baseline, however it is named
        with pytest.raises(argparse.ArgumentTypeError, match="is this checkout"):
            checkout(this)
    for main in (bench_engine.main, bench_frontend.main, profile_server.main):
        with pytest.raises(SystemExit) as exit_:
            main(["--baseline", str(tmp_path)])
        assert exit_.value.code == 2
        err = capsys.readouterr().err.strip().splitlines()[-1]
        assert f"{tmp_path} holds no runtime/ or sidindex/ package" in err and str(tmp_path / "abc1234") in err
        assert " ".join(PACKAGES) in err


def test_the_curve_takes_numbers_of_connections_of_at_least_one():
    """profile_server --curve: each point one wrk run; wrk refuses 0 connections only after the
    profiled run's figures were taken, so a bad point is refused before anything runs."""
    import pytest

    from bench.profile_server import connection_counts

    assert connection_counts("64, 256,,512") == [64, 256, 512]
    for bad in ("0", "64,-5", "x", "", ","):
        with pytest.raises(argparse.ArgumentTypeError, match="each at least 1"):
            connection_counts(bad)
