"""The search owns its tensors (docs/design.md §12): a scorer that writes into its `tokens` or `parent`
arguments (after reading them) gets exactly the results of the same scorer that does not, through
`runtime.beam_search`, a `runtime.Searcher` (captured in a CUDA graph on a GPU), `runtime.retrieve`,
the exhaustive scan of `sidindex simulate`, and `sidindex retrieve --scorer`."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest
import torch

import runtime
from runtime.scorers.factory import ScorerFactory
from runtime.studies.simulate import node_scores, trie_levels
from sidindex.errors import ScorerError
from tests.conftest import run_cli
from tests.test_retrieve import build_root

CONFIG = '[sid]\nlevels = [16, 8, 8]\nhash_size = 64\npaths = 2\nmin_points_per_centroid = 10\n'
BEAMS = (1, 8, 16, 16)

# Logits that depend on every token of a beam and on the request: a beam whose kept tokens were
# changed would score (and extend) differently. `inputs` lets a Searcher capture it.
MODULE = '''
import torch


class Hashed:
    def __init__(self, seed, V):
        self.seed, self.V = seed, V
        self.inputs = {"seed": self.seed}

    def __call__(self, step, tokens, parent):
        B, K, _ = tokens.shape
        weight = torch.arange(1, step + 1, device=tokens.device) * 7919
        h = (tokens * weight).sum(-1, keepdim=True).float()
        v = torch.arange(self.V, device=tokens.device).float()
        out = torch.sin(h * 0.37 + v * 1.3 + self.seed[:, None, None]) * 4
        self.spoil(tokens, parent)
        return out

    def spoil(self, tokens, parent):
        pass


class Zeroes(Hashed):
    def spoil(self, tokens, parent):
        tokens.zero_()
        if parent is not None:
            parent.fill_(0)


class Adds(Hashed):
    def spoil(self, tokens, parent):
        tokens.add_(1)
        if parent is not None:
            parent.add_(1)


def _factory(kind):
    def make(batch, device, level_sizes):
        seed = torch.tensor(batch.column("request_id").to_numpy(), dtype=torch.float32, device=device)
        return kind(seed, max(level_sizes))
    return make


plain, zeroes, adds = _factory(Hashed), _factory(Zeroes), _factory(Adds)
'''

KINDS = ("zeroes", "adds")
DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


@pytest.fixture(scope="module")
def work(sample_dir, tmp_path_factory) -> Path:
    """A built ROOT beside the scorer module (scorers.py) and 6 requests."""
    root = build_root(sample_dir, tmp_path_factory.mktemp("isolation"), CONFIG)
    (root.parent / "scorers.py").write_text(MODULE)
    pq.write_table(pq.read_table(sample_dir / "requests.parquet").slice(0, 6), root.parent / "requests.parquet")
    return root.parent


@pytest.fixture(scope="module")
def scorers(work):
    spec = importlib.util.spec_from_file_location("isolation_scorers", work / "scorers.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _scorer(scorers, kind: str, index, reqs):
    """rows -> a scorer of `kind` ('plain' or one of KINDS) for those requests."""
    return runtime.factory_scorer(ScorerFactory(getattr(scorers, kind), kind), index, reqs)


@pytest.mark.parametrize("device", DEVICES)
def test_beam_search_and_searcher_keep_their_beams(work, scorers, device):
    index = runtime.load(work / "root", device)
    reqs = runtime.read_requests(work / "requests.parquet", index)
    dev = runtime.to_device(runtime.encode_requests(reqs, index.spec), index.device)
    searcher = {kind: runtime.Searcher(BEAMS) for kind in ("plain", *KINDS)}
    found = {}
    for kind in ("plain", *KINDS):
        make = _scorer(scorers, kind, index, reqs)
        for lo in (0, 3):  # a second batch of the size replays a captured Searcher
            rows = slice(lo, lo + 3)
            found[kind, "eager", lo] = runtime.beam_search(index, dev.slice(lo, lo + 3), make(rows), BEAMS)
            found[kind, "searcher", lo] = searcher[kind].search(index, dev.slice(lo, lo + 3), make(rows))
    for kind in KINDS:
        for key in ("eager", "searcher"):
            for lo in (0, 3):
                want, got = found["plain", key, lo], found[kind, key, lo]
                assert torch.equal(want.tokens, got.tokens) and torch.equal(want.leaf, got.leaf), (kind, key, lo)
                assert torch.equal(want.score, got.score), (kind, key, lo)
    assert bool(found["plain", "eager", 0].alive.any())


def test_retrieve_and_the_exhaustive_scan_are_unchanged(work, scorers):
    index = runtime.load(work / "root", "cpu")
    reqs = runtime.read_requests(work / "requests.parquet", index)

    def results(kind):
        levels = trie_levels(index)
        make = _scorer(scorers, kind, index, reqs)
        factory = ScorerFactory(getattr(scorers, kind), kind)
        r = runtime.retrieve(index, reqs, beams=BEAMS, batch_size=4, scorer=factory).result
        # two requests' scans read the same trie paths
        return (r.request, r.ad_id, r.sid, r.score, r.rank), [node_scores(index, make(slice(q, q + 1)), levels)
                                                               for q in (0, 1)]

    (want, scan) = results("plain")
    assert len(want[1])
    for kind in KINDS:
        got, got_scan = results(kind)
        for a, b in zip(want, got):
            np.testing.assert_array_equal(a, b, err_msg=kind)
        assert all(torch.equal(a, b) for a, b in zip(scan, got_scan)), kind


def test_retrieve_cli_is_unchanged(work):
    def rows(kind):
        out = work / f"{kind}.parquet"
        r = run_cli("retrieve", work / "root", "--requests", "requests.parquet", "--out", out, "--device", "cpu",
                    "--beams", ",".join(map(str, BEAMS)), "--scorer", f"scorers:{kind}", cwd=work, timeout=300)
        assert r.returncode == 0, r.stderr
        return pq.read_table(out)

    want = rows("plain")
    assert want.num_rows
    for kind in KINDS:
        assert rows(kind).equals(want), kind


def test_a_plain_factory_function_is_a_scorer(work, scorers):
    """retrieve and the Retriever take a factory function as they take its ScorerFactory; what is
    neither is refused with one line."""
    index = runtime.load(work / "root", "cpu")
    reqs = runtime.read_requests(work / "requests.parquet", index)
    factory = ScorerFactory(scorers.plain, "plain")
    want = runtime.retrieve(index, reqs, beams=BEAMS, batch_size=4, scorer=factory).result
    got = runtime.retrieve(index, reqs, beams=BEAMS, batch_size=4, scorer=scorers.plain).result
    for name in ("request", "ad_id", "sid", "score", "rank"):
        np.testing.assert_array_equal(getattr(got, name), getattr(want, name), err_msg=name)
    with pytest.raises(ScorerError, match="scorer: expected 'MODULE:FACTORY', a factory function or "
                                          "a ScorerFactory, got int"):
        runtime.Retriever(index, beams=BEAMS, scorer=3)
