"""A broken model is an error, not a request without eligible ads (docs/design.md §12).

- A scorer that gives none of a request's live beams a finite logit at some step (all NaN, all
  -inf) is refused with a ScorerError naming the scorer, the request and the step: through
  `runtime.retrieve` (the Retriever and its Searcher), `beam_search` with `check_scored`, the
  sharded search and the Hugging Face processor.
- NaN or infinite logits among finite ones only take their tokens out: the result is the one of
  the same logits with -inf there.
- From the command line (`retrieve`, `simulate`) it is one line and exit 2, nothing written; the
  server answers 500 with that line and goes on serving.
"""

from __future__ import annotations

import functools
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import runtime
from runtime.ops.distribution import level_log_probs, scored_rows, unscored
from runtime.scorers.factory import ScorerFactory
from runtime.search.beam import beam_search, check_scored, scorer_name
from runtime.search.hf import SidLogitsProcessor
from sidindex.errors import ScorerError
from tests.conftest import run_cli
from tests.in_process import run_main
from tests.test_retrieve import CONFIG, build_root
from tests.test_runtime import DEVICE

BEAMS = (1, 4, 8, 8)
NAN, INF = float("nan"), float("inf")


@pytest.fixture(scope="module")
def root(sample_dir, tmp_path_factory) -> Path:
    return build_root(sample_dir, tmp_path_factory.mktemp("broken"), CONFIG)


@pytest.fixture(scope="module")
def index(root) -> runtime.ServedIndex:
    return runtime.load(root, "cpu")


@pytest.fixture(scope="module")
def reqs(index, sample_dir):
    return runtime.read_requests(sample_dir / "requests.parquet", index).head(6)


class Spoilt:
    """A factory whose scorer gives varied finite logits (a function of each beam's tokens), then
    `value` at step `step`: for every beam of the requests whose ids are in `ids` (every token of
    the level), or at the tokens of `tokens` for every beam (None: nowhere)."""

    def __init__(self, V: int, step: int = 2, value: float = NAN, ids=(), tokens=None) -> None:
        self.V, self.step, self.value, self.ids, self.tokens = V, step, value, set(ids), tokens

    def __call__(self, batch, device, level_sizes):
        rows = torch.tensor([i in self.ids for i in batch.column("request_id").to_pylist()], device=device)

        def scorer(step, tokens, parent):
            seed = 1.0 + tokens.sum(-1, keepdim=True).float() + 7 * step  # (B, K, 1)
            out = torch.sin(seed * torch.arange(1, self.V + 1, device=device) * 0.37) * 3
            if step == self.step:
                out[rows] = self.value
                if self.tokens is not None:
                    out[..., self.tokens] = self.value
            return out

        return scorer


@pytest.mark.parametrize("value", [NAN, -INF])
def test_a_request_with_no_finite_logit_at_a_step_is_refused(index, reqs, value):
    V, target = index.vocab_size, int(reqs.request_id[5])  # in the second batch of 4
    factory = ScorerFactory(Spoilt(V, value=value, ids=[target]), "tests:spoilt")
    for mode in ("none", "cd", "cd+gtm"):
        with pytest.raises(ScorerError) as e:
            runtime.retrieve(index, reqs, mode=mode, beams=BEAMS, batch_size=4, scorer=factory)
        message = str(e.value)
        assert message.startswith(f"scorer 'tests:spoilt' returned no finite logit for request {target} at step 2:")
        assert "\n" not in message
    # every request at once: the message counts them
    every = ScorerFactory(Spoilt(V, value=value, ids=reqs.request_id.tolist()), "tests:spoilt")
    with pytest.raises(ScorerError, match=rf"for request {reqs.request_id[0]} at step 2 \(4 of the batch's 4"):
        runtime.retrieve(index, reqs, beams=BEAMS, batch_size=4, scorer=every)
    # the same scorer spoiling no step serves
    fine = runtime.retrieve(index, reqs, beams=BEAMS, batch_size=4,
                            scorer=ScorerFactory(Spoilt(V, step=-1), "tests:spoilt"))
    assert len(fine.result.ad_id) > 0


def test_beam_search_records_it_and_check_scored_refuses(index, reqs):
    """The search itself never waits for the device: it records, `check_scored` reads."""
    V = index.vocab_size
    dev = runtime.to_device(runtime.encode_requests(reqs, index.spec), index.device)
    scorer = Spoilt(V, step=1, ids=[int(reqs.request_id[2])])(reqs.table, index.device, index.level_sizes)
    found = beam_search(index, dev, scorer, BEAMS, "cd+gtm")
    assert found.unscored is not None and found.unscored.shape == (len(reqs), index.sid_length)
    assert found.unscored.nonzero().tolist() == [[2, 1]]
    with pytest.raises(ScorerError, match=r"scorer '.*scorer' returned no finite logit for the batch's request 2 "
                                          r"\(counting from 0\) at step 1"):
        check_scored(found.unscored, scorer_name(scorer))
    with pytest.raises(ScorerError, match="for request 17 at step 1"):
        check_scored(found.unscored, "scorer 'x'", np.array([0, 0, 17, 0, 0, 0]))
    check_scored(found.unscored, "scorer 'x'", np.array([0, 0]))  # rows past the ids (padding) are not checked
    fine = beam_search(index, dev, Spoilt(V, step=-1)(reqs.table, index.device, index.level_sizes), BEAMS)
    assert fine.unscored is not None and not fine.unscored.any()
    check_scored(fine.unscored, "scorer 'x'")


class Captured:
    """A scorer a CUDA graph captures (its `inputs` refreshed per batch): finite logits, NaN at
    step 2 for every beam of the rows `spoil` (B,) marks."""

    def __init__(self, spoil: torch.Tensor, V: int) -> None:
        self.spoil, self.V = spoil.clone(), V
        self.inputs = {"spoil": self.spoil}

    def __call__(self, step, tokens, parent):
        seed = 1.0 + tokens.sum(-1, keepdim=True).float() + 7 * step
        out = torch.sin(seed * torch.arange(1, self.V + 1, device=tokens.device) * 0.37) * 3
        return torch.where(self.spoil[:, None, None], NAN, out) if step == 2 else out


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_a_replayed_search_refuses_it_with_no_wait_per_step(root, sample_dir):
    """On a GPU the search is captured and replayed: the flag is read with the batch's results."""
    index = runtime.load(root, "cuda")
    reqs = runtime.read_requests(sample_dir / "requests.parquet", index).head(6)
    target = int(reqs.request_id[5])

    def factory(batch, device, level_sizes):
        ids = batch.column("request_id").to_pylist()
        return Captured(torch.tensor([i == target for i in ids], device=device), index.vocab_size)

    retriever = runtime.Retriever(index, beams=BEAMS, batch_sizes=(4,), scorer=ScorerFactory(factory, "tests:captured"),
                                  warm=False)
    first = retriever.retrieve(reqs.table.slice(0, 4))
    with pytest.raises(ScorerError, match=f"'tests:captured' returned no finite logit for request {target} at step 2"):
        retriever.retrieve(reqs.table.slice(4, 2))  # padded to 4, replayed
    searcher = next(iter(retriever._warmed.values())).searcher
    assert searcher.eager_reason is None  # captured, not searched eagerly
    assert retriever.retrieve(reqs.table.slice(0, 4)).equals(first)


@pytest.mark.parametrize("value", [NAN, INF])
def test_a_partly_non_finite_row_is_that_row_with_minus_inf_there(index, reqs, value):
    V = index.vocab_size
    tokens = [0, 3, 5]
    got = runtime.retrieve(index, reqs, beams=BEAMS, scorer=ScorerFactory(Spoilt(V, value=value, tokens=tokens), "a"))
    want = runtime.retrieve(index, reqs, beams=BEAMS, scorer=ScorerFactory(Spoilt(V, value=-INF, tokens=tokens), "b"))
    a, b = got.table(reqs.request_id), want.table(reqs.request_id)
    assert a.num_rows > 0 and a.equals(b)
    assert not {t for sid in a.column("sid").to_pylist() for t in sid[2:3]} & set(tokens)  # never chosen at step 2
    logits = torch.tensor([[1.0, value, 2.0, -INF]])
    expected = level_log_probs(torch.tensor([[1.0, -INF, 2.0, -INF]]), 4)
    assert torch.equal(level_log_probs(logits, 4), expected)


def test_a_row_with_no_finite_logit_is_nan_throughout_and_no_other_row_holds_one():
    """What `scored_rows` reads from a row's first entry alone, on every device."""
    rows = torch.tensor([[NAN, NAN, NAN, 0.0], [-INF, -INF, -INF, 0.0], [INF, NAN, -INF, 0.0],
                         [-INF, NAN, 1.0, NAN], [-3e38, 3e38, 0.0, 0.0], [0.0, 0.0, 0.0, NAN],
                         [NAN, -INF, INF, NAN]])
    devices = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
    for device in devices:
        for size in (4, 3):
            logp = level_log_probs(rows.to(device), size)
            no_finite = ~rows[:, :size].isfinite().any(dim=1).to(device)  # the 4th column counts at size 4
            assert torch.equal(logp[:, :size].isnan().all(dim=1), no_finite)
            assert not logp[~no_finite].isnan().any() and no_finite.sum() == (4 if size == 3 else 1)
            assert torch.equal(scored_rows(logp), ~no_finite)


@settings(max_examples=30, deadline=None)
@given(st.integers(0, 6), st.integers(0, 70), st.integers(1, 9), st.integers(0, 2**32 - 1))
def test_the_scored_check_kernel_is_its_reference(B, K, V, seed):
    """`unscored` as one Triton kernel (on a GPU, else under TRITON_INTERPRET=1) equals its torch ops:
    requests whose beams are all dead, all live and NaN, mixed, and beams dead with NaN rows (which
    do not count)."""
    rng = np.random.default_rng(seed)
    score = rng.choice(np.array([-INF, 0.0, -1.5, 3.0], np.float32), (B, K), p=rng.dirichlet(np.ones(4)))
    logp = rng.standard_normal((B, K, V)).astype(np.float32)
    logp[rng.random((B, K)) < rng.random()] = NAN  # rows without a finite logit: NaN throughout
    score, logp = torch.from_numpy(score), torch.from_numpy(logp)
    want = unscored(logp, score, impl="torch")
    got = unscored(logp.to(DEVICE), score.to(DEVICE), impl="triton")
    assert got.dtype == torch.bool and torch.equal(got.cpu(), want)


def test_the_sharded_search_records_it(index, reqs):
    snap = index.snapshot
    indexes = runtime.load_sharded(snap, ["cpu", "cpu"])
    host = runtime.encode_requests(reqs, index.spec)
    spoilt = Spoilt(index.vocab_size, step=2, ids=[int(reqs.request_id[4])])
    found = runtime.sharded_beam_search(indexes, [runtime.to_device(host, ix.device) for ix in indexes],
                                        [spoilt(reqs.table, ix.device, ix.level_sizes) for ix in indexes],
                                        BEAMS, "cd+gtm")
    assert found.unscored is not None and found.unscored.nonzero().tolist() == [[4, 2]]
    with pytest.raises(ScorerError, match=f"request {reqs.request_id[4]} at step 2"):
        check_scored(found.unscored, "scorer 'x'", reqs.request_id)


def test_the_hf_processor_records_it_and_check_refuses(index, reqs):
    L, V, P = index.sid_length, index.vocab_size, 2
    proc = SidLogitsProcessor(index, reqs, "none", prompt_length=P, num_beams=1, token_offset=0)
    vocab = L * V
    ids = torch.zeros(len(reqs), P, dtype=torch.int64)
    scores = torch.zeros(len(reqs), vocab)
    proc(ids, scores)
    scores[3] = NAN
    ids = torch.cat([ids, torch.zeros(len(reqs), 1, dtype=torch.int64)], dim=1)
    out = proc(ids, scores)  # step 1: request 3's row is dead (DEAD at the level's ids), no wait
    assert (out[3] <= -1e29).all() and torch.isfinite(out[2]).any()
    with pytest.raises(ScorerError, match=f"generate's model returned no finite logit for request "
                                          f"{reqs.request_id[3]} at step 1"):
        proc.check(reqs.request_id)
    proc(ids[:, :P], torch.zeros(len(reqs), vocab))  # a new generate starts afresh
    proc.check()


SCORER_MODULE = '''
import torch

def nan_at_step_2(batch, device, level_sizes):
    """Finite logits, then NaN for every beam of the third request at step 2."""
    def scorer(step, tokens, parent):
        out = torch.zeros(*tokens.shape[:2], max(level_sizes), device=device)
        if step == 2:
            out[2:3] = float("nan")
        return out
    return scorer
'''


def test_the_command_line_refuses_it_in_one_line(root, sample_dir, tmp_path, monkeypatch, capsys):
    """retrieve through the console script; simulate through its entry point in this process
    (`run_main`: the same exit code and line)."""
    (tmp_path / "broken_model.py").write_text(SCORER_MODULE)
    table = pq.read_table(sample_dir / "requests.parquet").slice(0, 4)
    pq.write_table(table, tmp_path / "requests.parquet")
    third = table.column("request_id")[2].as_py()
    out = tmp_path / "out.parquet"
    for command, run in ((("retrieve", "--out", out), run_cli),
                         (("simulate", "--top-k", "5", "--modes", "cd+gtm"), functools.partial(run_main, monkeypatch,
                                                                                                capsys))):
        r = run(command[0], root, "--requests", "requests.parquet", *command[1:], "--beams", "1,4,4,4",
                "--scorer", "broken_model:nan_at_step_2", cwd=tmp_path)
        assert r.returncode == 2, (command, r.stderr)
        assert len(r.stderr.strip().splitlines()) == 1 and "Traceback" not in r.stderr, r.stderr
        assert "'broken_model:nan_at_step_2' returned no finite logit" in r.stderr, r.stderr
        assert f"for request {third} at step 2" in r.stderr, r.stderr
    assert not out.exists() and not (tmp_path / "out.parquet.tmp").exists()


class NanWhen:
    """A factory whose scorer gives NaN everywhere for the requests with `nan` set."""

    def __init__(self, V: int) -> None:
        self.V = V

    def __call__(self, batch, device, level_sizes):
        flags = batch.column("nan").to_pylist() if "nan" in batch.column_names else []
        broken = torch.tensor([bool(f) for f in flags] + [False] * (batch.num_rows - len(flags)))

        def scorer(step, tokens, parent):
            logits = torch.zeros((*tokens.shape[:2], self.V))
            logits[broken[:len(logits)]] = NAN
            return logits

        return scorer


def test_the_server_answers_500_and_goes_on_serving(root, sample_dir):
    pytest.importorskip("starlette")
    pytest.importorskip("httpx")
    from starlette.testclient import TestClient

    from runtime.server.http import RetrievalServer

    rows = pq.read_table(sample_dir / "requests.parquet").slice(0, 2).to_pylist()
    watcher = runtime.SnapshotWatcher(root, "cpu")
    factory = ScorerFactory(NanWhen(watcher.current.vocab_size), "tests:nan_when")
    retriever = runtime.Retriever(watcher, beams=BEAMS, batch_sizes=(1, 4), scorer=factory)
    # no deadline: a cold first search compiles the host path's kernels, slow on a loaded test host
    server = RetrievalServer.local(watcher, retriever, max_batch=4, poll_seconds=60.0, timeout_ms=None)
    with TestClient(server.app) as client:
        r = client.post("/retrieve", json={"requests": [rows[1] | {"nan": False}, rows[0] | {"nan": True}]})
        error = r.json()["error"]
        assert r.status_code == 500 and "\n" not in error
        # the client's own id, though the server numbers a batch's requests afresh
        assert error.startswith(f"scorer 'tests:nan_when' returned no finite logit for request "
                                f"{rows[0]['request_id']} at step 0"), error
        assert client.post("/retrieve", json={"requests": [rows[1] | {"nan": False}]}).status_code == 200
        assert 'sidindex_requests_total{outcome="error"} 1.0' in client.get("/metrics").text
