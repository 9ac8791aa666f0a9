"""The decoder seam (docs/design.md §12) and the reference decoder.

- The search hands every scorer the right `parent`: each beam's tokens are its parent's plus one.
- With its KV cache reordered by `parent`, the reference decoder's accumulated search scores equal
  the same model's whole-sequence log-probabilities of the SIDs found (no cache), in every mode,
  on random catalogs, beams and contexts; its cached logits equal recomputed ones for random
  parents.
"""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from runtime.search.beam import beam_search
from runtime.studies.decoder import DecoderScorer, ReferenceDecoder, context_tokens
from sidindex.modes import Mode
from tests.test_gtm import scenarios
from tests.test_runtime import Case

SMALL = dict(context_vocab=50, context_length=6, d_model=32, layers=2, heads=2)


class Recording:
    """A scorer that checks, at every step, that beam k's tokens are those of beam parent[k] of
    the previous call plus one token."""

    def __init__(self, V: int) -> None:
        self.V, self.previous, self.calls = V, None, 0

    def __call__(self, step, tokens, parent):
        B, K, _ = tokens.shape
        assert tokens.shape[2] == step
        if step == 0:
            assert parent is None and K == 1
        else:
            assert parent.shape == (B, K) and parent.dtype == torch.int64
            assert int(parent.min()) >= 0 and int(parent.max()) < self.previous.shape[1]
            torch.testing.assert_close(tokens[:, :, :-1],
                                       self.previous.gather(1, parent[..., None].expand(-1, -1, step - 1)))
        self.previous, self.calls = tokens, self.calls + 1
        gen = torch.Generator().manual_seed(step)
        return torch.randn(B, K, self.V, generator=gen).to(tokens.device)


@settings(max_examples=15, deadline=None)
@given(scenarios(max_ads=12), st.lists(st.integers(1, 5), min_size=3, max_size=3))
def test_the_search_passes_each_beams_parent(sc, widths):
    case = Case(sc)
    L = case.gtm.sid_length
    beams = (1, *widths)[:L] + (widths[-1],) * max(0, L - 4)
    for mode in Mode:
        rec = Recording(case.gtm.vocab_size)
        beam_search(case.index, case.dreq, rec, beams, mode, "torch")
        assert rec.calls == L


@settings(max_examples=12, deadline=None)
@given(scenarios(max_ads=12), st.integers(0, 2**16), st.lists(st.integers(1, 6), min_size=3, max_size=3))
def test_cached_search_scores_equal_whole_sequence_log_probabilities(sc, seed, widths):
    case = Case(sc)
    L = case.gtm.sid_length
    beams = (1, *widths)[:L] + (widths[-1],) * max(0, L - 4)
    model = ReferenceDecoder(sc.level_sizes, seed=seed, **SMALL).eval()
    gen = torch.Generator().manual_seed(seed)
    contexts = [torch.randint(0, 99, (int(n),), generator=gen).tolist() or None
                for n in torch.randint(0, 9, (len(sc.requests),), generator=gen)]
    context = context_tokens(contexts, SMALL["context_length"], SMALL["context_vocab"], "cpu")
    for mode in Mode:
        found = beam_search(case.index, case.dreq, DecoderScorer(model, context), beams, mode, "torch")
        alive = found.alive
        if not alive.any():
            continue
        want = model.sequence_logprob(context, found.tokens)
        torch.testing.assert_close(found.score[alive], want[alive], rtol=1e-4, atol=1e-4)


def test_cached_logits_equal_recomputed_ones_for_random_parents():
    torch.manual_seed(3)
    level_sizes = (7, 5, 9, 4)
    model = ReferenceDecoder(level_sizes, **SMALL).eval()
    B = 3
    context = context_tokens([[1, 2, 3], None, list(range(40))], SMALL["context_length"], SMALL["context_vocab"], "cpu")
    cached = DecoderScorer(model, context)
    tokens = torch.zeros(B, 1, 0, dtype=torch.int64)
    parent = None
    for step, K in enumerate((1, 4, 6, 2)):
        got = cached(step, tokens, parent)
        fresh = DecoderScorer(model, context)(step, tokens, None)  # no cache: the whole prefix
        torch.testing.assert_close(got, fresh, rtol=1e-4, atol=1e-4)
        assert torch.isinf(got[..., level_sizes[step]:]).all()
        nxt = (1, 4, 6, 2)[step + 1] if step + 1 < 4 else None
        if nxt is None:
            break
        parent = torch.randint(0, K, (B, nxt))
        tok = torch.randint(0, level_sizes[step], (B, nxt, 1))
        tokens = torch.cat([tokens.gather(1, parent[..., None].expand(-1, -1, step)), tok], dim=2)
