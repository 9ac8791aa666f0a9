"""The codebook scorer's fused step (`runtime.ops.codebook`): the Triton kernel (on a GPU, else
under TRITON_INTERPRET=1 on CPU tensors) gives the distribution its torch reference gives,
`level_log_probs` of the scorer's logits, within float32 rounding; the same tokens are -inf and
the same rows NaN (a row with no finite logit), also for embeddings that overflow the logits; and a
beam's row is the same bit for bit whatever other beams share its batch, as the serving path's
batch independence needs (a check that bites on a GPU: the interpreter runs a program in numpy).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from runtime.ops.codebook import CodebookTables, codebook_log_probs, codebook_log_probs_reference
from runtime.ops.distribution import level_log_probs
from runtime.scorers.codebook import CodebookScorer
from runtime.search.beam import log_probs_of
from tests.test_runtime import DEVICE, GPU

EXAMPLES = 40 if GPU else 12  # each draws a few launches; the interpreter runs a program in numpy


@st.composite
def codebooks(draw):
    """(tables on DEVICE, embeddings (B, D) float32, temperature, step, prefixes (B, K, step), size)."""
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    S, D = draw(st.integers(1, 3)), draw(st.sampled_from((1, 2, 3, 7, 9, 64, 65, 130)))  # past a 64-wide tile
    levels = [draw(st.integers(1, 40)) for _ in range(S)]
    hash_size = draw(st.integers(1, 40))
    V = max(*levels, hash_size) + draw(st.sampled_from((0, 0, 3)))  # a logit width past every level
    scale = draw(st.sampled_from((1.0, 1e3, 1e19, 3e38)))  # 1e19 and 3e38 overflow some logits to inf
    cents = [torch.from_numpy((rng.standard_normal((n, D)) * draw(st.sampled_from((1.0, scale)))).astype(np.float32))
             for n in levels]
    B, K = draw(st.integers(1, 5)), draw(st.integers(1, 6))
    step = draw(st.integers(0, S))
    x = (rng.standard_normal((B, D)) * scale).astype(np.float32)
    if draw(st.booleans()):
        x[rng.integers(0, B), rng.integers(0, D)] = draw(st.sampled_from((np.nan, np.inf, -np.inf, -1.0, 0.0)))
    prefix = np.stack([rng.integers(0, levels[p], (B, K)) for p in range(step)], axis=2) if step else \
        np.zeros((B, K, 0), np.int64)
    if draw(st.booleans()):  # a strided view, as a search's gathers may give
        prefix = np.ascontiguousarray(prefix.transpose(2, 0, 1)).transpose(1, 2, 0)
    size = draw(st.sampled_from((V, (levels + [hash_size])[step], 1 + V // 2)))
    tables = CodebookTables.of([c.to(DEVICE) for c in cents], (*levels, hash_size), V)
    return (tables, torch.from_numpy(x).to(DEVICE), draw(st.sampled_from((1.0, 0.37, 3.0))), step,
            torch.from_numpy(prefix).to(DEVICE), size)


@settings(max_examples=EXAMPLES, deadline=None)
@given(codebooks())
def test_the_kernel_gives_the_references_distribution(case):
    tables, x, temperature, step, prefix, size = case
    got = codebook_log_probs(tables, x, temperature, step, prefix, size, impl="triton").cpu()
    want = codebook_log_probs_reference(tables, x, temperature, step, prefix, size).cpu()
    assert got.shape == want.shape == (*prefix.shape[:2], tables.V) and got.dtype == torch.float32
    assert torch.equal(got.isnan(), want.isnan()) and torch.equal(got == -np.inf, want == -np.inf)
    finite = want.isfinite()
    torch.testing.assert_close(got[finite], want[finite], rtol=1e-6, atol=1e-5)
    # a beam's row alone, and in a batch of other beams, bit for bit
    B, K = prefix.shape[:2]
    b, k = B - 1, K // 2
    alone = codebook_log_probs(tables, x[b:], temperature, step, prefix[b:, k:k + 1], size, impl="triton").cpu()
    assert torch.equal(alone[0, 0].nan_to_num(), got[b, k].nan_to_num())


@pytest.mark.parametrize("hash_size", [5, 9_000])
def test_wide_levels_take_fewer_beams_a_program_or_the_reference(hash_size):
    """A level of 700 tokens holds 8 beams a program (a row of 1,024 lanes), not 16; past 8,192
    tokens a row does not fit a program and the reference runs: either way the distribution."""
    from runtime.ops.codebook.kernel import fits

    rng = np.random.default_rng(5)
    cents = [torch.from_numpy(rng.standard_normal((n, 5)).astype(np.float32)).to(DEVICE) for n in (700, 3)]
    V = max(700, hash_size)
    tables = CodebookTables.of(cents, (700, 3, hash_size), V)
    assert fits(tables) == (hash_size < 8_192)
    x = torch.from_numpy(rng.standard_normal((2, 5)).astype(np.float32)).to(DEVICE)
    prefix = torch.from_numpy(rng.integers(0, 3, (2, 11, 1))).to(DEVICE)  # 22 beams: a partly filled block
    for step, p in ((0, prefix[..., :0]), (1, prefix)):
        size = (700, 3)[step]
        got = codebook_log_probs(tables, x, 1.0, step, p, size, impl="triton").cpu()
        want = codebook_log_probs_reference(tables, x, 1.0, step, p, size).cpu()
        assert torch.equal(got == -np.inf, want == -np.inf)
        torch.testing.assert_close(got[want.isfinite()], want[want.isfinite()], rtol=1e-6, atol=1e-5)


def test_the_search_takes_the_codebook_scorers_own_log_probs(monkeypatch):
    """`log_probs_of` asks the built-in codebook scorer for its log-probabilities (its fused step),
    and log-softmaxes any other scorer's logits, a subclass's too: one distribution."""
    from sidindex.config import SIDConfig
    from sidindex.sid.codebook import Codebook

    rng = np.random.default_rng(3)
    cents = (rng.standard_normal((6, 4)).astype(np.float32), rng.standard_normal((5, 4)).astype(np.float32))
    scorer = CodebookScorer(Codebook(cents, 7, ("advertiser_id",), 1, None, SIDConfig()),
                            torch.from_numpy(rng.standard_normal((2, 4)).astype(np.float32)).to(DEVICE))
    calls = []

    class Logits:  # the same scorer without its fused step
        def __call__(self, step, tokens, parent):
            calls.append(step)
            return scorer(step, tokens, parent)

    class Shifted(CodebookScorer):  # a subclass whose logits are its own
        def __call__(self, step, prefix, parent=None):
            return super().__call__(step, prefix, parent) * 2

    fused_steps = []
    own = CodebookScorer.log_probs
    monkeypatch.setattr(CodebookScorer, "log_probs", lambda *a: fused_steps.append(a[1]) or own(*a))
    shifted = Shifted.__new__(Shifted)
    shifted.__dict__.update(scorer.__dict__)
    prefix = torch.tensor([[[1, 3], [4, 0]], [[0, 0], [2, 2]]], device=DEVICE)
    for step, size in ((0, 6), (1, 5), (2, 7)):
        fused = log_probs_of(scorer, step, prefix[..., :step], None, size)
        assert fused_steps == [step]
        plain = log_probs_of(Logits(), step, prefix[..., :step], None, size)
        assert calls[-1] == step
        assert torch.equal(plain, level_log_probs(scorer(step, prefix[..., :step]), size))
        torch.testing.assert_close(fused, plain, rtol=1e-6, atol=1e-6)
        got = log_probs_of(shifted, step, prefix[..., :step], None, size)
        assert fused_steps == [step] and torch.equal(got, level_log_probs(shifted(step, prefix[..., :step]), size))
        fused_steps.clear()
