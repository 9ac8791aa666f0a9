"""The streaming benchmark (bench/bench_stream.py) on a tiny catalog on the CPU: the structure of
what it reports, that what it times is the work `runtime.retrieve` does, and that the decoder it
scores with (a Qwen3-layout LM with a shared-context KV cache) gives the model's own logits."""

from __future__ import annotations

import json
import math

import numpy as np
import pyarrow as pa
import pytest
import torch

import runtime
from bench import bench_stream as bs
from bench.qwen3_scorer import CONTEXT, Qwen3Decoder, Qwen3Scorer
from sidindex.modes import Mode

ADS, DIM, BEAMS = 3000, 16, (1, 4, 8, 8)


@pytest.fixture(scope="module")
def built(tmp_path_factory) -> tuple:
    """The benchmark's cache directory holding a tiny catalog and its published ROOT."""
    cache = tmp_path_factory.mktemp("bench_stream")
    return cache, bs.catalog_root(ADS, DIM, cache)


def test_one_command_reports_every_mode(built, tmp_path, capsys):
    cache, size = built
    out = tmp_path / "stream.json"
    assert bs.main(["--ads", str(ADS), "--dim", str(DIM), "--batches", "32", "--beams", ",".join(map(str, BEAMS)),
                    "--device", "cpu", "--cache", str(cache), "--json", str(out), "--decoder",
                    "--profile", "default"]) == 0  # one profile: the fixture's catalog (the default runs both)
    printed = capsys.readouterr().out
    res = json.loads(out.read_text())
    assert res["device"] == "cpu" and res["beams"] == list(BEAMS) and res["batches"] == 32
    assert res["decoder_skipped"] and "needs a CUDA device" in printed  # said, not silently dropped
    (got,) = res["sizes"]
    assert got["cached"] and got["ads"] == ADS and got["sids"] == size["sids"] > 0  # the fixture's ROOT, reused
    assert res["profiles"] == ["default"] and got["profile"] == "default"
    skew = got["ads_per_sid"]  # read from the snapshot's leaf_ad_offsets
    assert skew["sids"] == got["sids"] and 1 <= skew["p50"] <= skew["p99"] <= skew["max"]
    assert skew["beams"] == 1024 and skew["max"] <= skew["most_pairs"] <= 2 * ADS  # 2 paths per ad
    assert f"ads per SID p50 {skew['p50']:g}" in printed and f"{skew['most_pairs']:,} ads" in printed
    assert list(got["modes"]) == [m.value for m in Mode]  # the k-way partitions were built
    for mode, r in got["modes"].items():
        assert mode in printed
        assert 0 < r["p50_ms"] <= r["p90_ms"] <= r["p99_ms"] <= r["max_ms"]
        assert len(r["latencies_ms"]) == 32 and max(r["latencies_ms"]) == r["max_ms"]
        assert isinstance(r["widenings"], int) and r["widenings"] >= 0
        assert set(r["stages_ms"]) == {"validate", "encode", "search_post", "result"}
        assert all(v > 0 for v in r["stages_ms"].values())
        assert r["counters"]["batches"] == 32 and r["counters"]["requests"] == 32 * bs.BATCH
        assert r["qps"]["1"] > 0 and r["qps"]["2"] > 0 and r["callers_2"]["p99_ms"] > 0
        assert r["same_as_retrieve"] is True
    assert got["modes"]["cd+gtm"]["rows_per_request"] > 0
    assert math.isclose(got["cd+gtm_over_none_p50"], got["modes"]["cd+gtm"]["p50_ms"] / got["modes"]["none"]["p50_ms"])
    (cold,) = got["cold_start"]  # the CPU: one start, no Triton cache
    assert cold["triton_cache"] is None and cold["rows"] > 0
    assert cold["start_to_first_result_s"] > cold["imports_s"] > 0 and cold["first_batch_ms"] > 0
    assert "decoder" not in got


def test_the_batches_are_distinct_and_what_is_timed_is_retrieve(built):
    _, size = built
    index = runtime.load(size["root"], "cpu")
    emb = bs.catalog_embeddings(size["catalog"])
    batches = bs.request_batches(index, 6, emb)
    assert all(isinstance(b, pa.RecordBatch) and b.num_rows == bs.BATCH for b in batches)
    ids = np.concatenate([b.column("request_id").to_numpy() for b in batches])
    assert len(np.unique(ids)) == len(ids)
    emb_rows = [tuple(b.column("embedding").flatten().to_numpy()[:DIM]) for b in batches]
    assert len(set(emb_rows)) == len(batches)  # other requests, not copies of one
    assert all(b.column("locations").offset == 0 for b in batches[1:])  # buffers of its own, not a slice
    for mode in (Mode.NONE, Mode.CD_GTM_KWAY):
        row, first = bs.measure_mode(index, mode, BEAMS, batches, threads=(), check=False)
        reqs = runtime.requests_from(batches[0], index)
        want = runtime.retrieve(index, reqs, mode=mode, beams=BEAMS, batch_size=bs.BATCH).table(reqs.request_id)
        assert first.equals(want)
        assert row["counters"]["batches"] == len(batches) and "2" not in row["qps"]
    assert first.num_rows > 0  # a constrained mode finds eligible ads


def tiny_qwen3(vocab: int) -> dict:
    return dict(vocab_size=vocab, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, head_dim=8, max_position_embeddings=128, tie_word_embeddings=False)


def test_qwen3_scorer_gives_the_models_logits():
    """The cached scorer (context shared by a request's beams, beams' own keys reordered by
    `parent`) against the Hugging Face model run on each whole sequence."""
    pytest.importorskip("transformers")
    levels = (5, 5, 3)
    dec = Qwen3Decoder(tiny_qwen3(40), levels, torch.device("cpu"), dtype=torch.float32)
    model, L, V = dec.model, len(levels), max(levels)
    gen = torch.Generator().manual_seed(0)
    B, C = 3, 7
    context = torch.randint(0, dec.history_vocab, (B, C), generator=gen)

    def whole(tokens: torch.Tensor) -> torch.Tensor:  # (B, K, d) -> (B, K, V) logits of level d
        K, d = tokens.shape[1], tokens.shape[2]
        ids = dec.head_ids[torch.arange(d)[None, None, :], tokens]
        seq = torch.cat([context[:, None, :].expand(B, K, C), ids], dim=2).reshape(B * K, C + d)
        with torch.no_grad():
            logits = model(input_ids=seq).logits[:, -1]
        return logits[:, dec.head_ids[d]].view(B, K, V)

    scorer = Qwen3Scorer(model, dec.head, dec.head_ids, context)
    tokens = torch.zeros(B, 1, 0, dtype=torch.int64)
    torch.testing.assert_close(scorer(0, tokens, None), whole(tokens), rtol=1e-4, atol=1e-5)
    for step, K in ((1, 4), (2, 6)):  # beams gathered from the previous step's, then extended
        parent = torch.randint(0, tokens.shape[1], (B, K), generator=gen)
        new = torch.randint(0, levels[step - 1], (B, K, 1), generator=gen)
        tokens = torch.cat([tokens.gather(1, parent[..., None].expand(-1, -1, step - 1)), new], dim=2)
        torch.testing.assert_close(scorer(step, tokens, parent), whole(tokens), rtol=1e-4, atol=1e-5)
    fresh = Qwen3Scorer(model, dec.head, dec.head_ids, context)  # a scan of prefixes: no parent
    torch.testing.assert_close(fresh(2, tokens, None), whole(tokens), rtol=1e-4, atol=1e-5)
    assert dec.head_ids.min() >= dec.history_vocab and dec.head_ids.max() == 40 - 1 and dec.head_ids.shape == (L, V)


def test_decoder_row_runs_the_constraint_through_the_retriever(built):
    """The --decoder row's machinery with a tiny Qwen3 on the CPU (the benchmark runs the real
    size on CUDA only)."""
    pytest.importorskip("transformers")
    _, size = built
    index = runtime.load(size["root"], "cpu")
    L, V = index.sid_length, index.vocab_size
    dec = Qwen3Decoder(tiny_qwen3(L * V + 50), index.level_sizes, index.device, dtype=torch.float32)
    batches = bs.request_batches(index, 2, bs.catalog_embeddings(size["catalog"]), seed=13, history=CONTEXT,
                                 history_vocab=dec.history_vocab)
    got = bs.decoder_rows(index, dec, BEAMS, batches)
    assert set(got["modes"]) == {"none", "cd+gtm"} and got["batches"] == 2
    for r in got["modes"].values():
        assert 0 < r["p50_ms"] <= r["p90_ms"] <= r["p99_ms"] <= r["max_ms"] and isinstance(r["widenings"], int)
    assert math.isfinite(got["constraint_share"]) and got["constraint_share"] < 1
    assert got["modes"]["cd+gtm"]["rows_per_request"] > 0
