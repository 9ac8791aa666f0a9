"""`runtime.search.hf.SidLogitsProcessor` with Hugging Face `generate` (docs/design.md §13), on a small randomly
initialised GPT-2 built from a config (nothing is downloaded).

- Beam search with the processor returns the SIDs of sidindex's own beam search at the same width,
  whose scorer is the same model, in every mode; every SID it returns is in the catalog.
- Both normalise over a level's own tokens: on levels smaller than the vocabulary, with a scorer
  whose logits past a level's size are the model's (finite), generate and sidindex's search return
  the same SIDs with the same scores, and the exhaustive scan of `runtime.studies.simulate` scores them so.
- Greedy decoding with the processor is sidindex's search at width 1.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

transformers = pytest.importorskip("transformers")

from runtime.search.beam import beam_search  # noqa: E402
from runtime.search.hf import SidLogitsProcessor  # noqa: E402
from runtime.studies.simulate import node_scores, trie_levels  # noqa: E402
from sidindex.config import KWayConfig  # noqa: E402
from sidindex.errors import ConfigError  # noqa: E402
from sidindex.modes import Mode  # noqa: E402
from sidindex.targeting import BITMASK, Attribute, TargetingSpec  # noqa: E402
from tests.test_gtm import Scenario, scenario, scenarios  # noqa: E402
from tests.test_runtime import DEVICE, Case, searched  # noqa: E402

OFFSET, PROMPT = 3, 4  # ids 0..2 are special (pad, bos, eos); every request's prompt has 4 tokens


def model_for(case: Case, seed: int):
    torch.manual_seed(seed)
    vocab = OFFSET + case.gtm.sid_length * case.gtm.vocab_size + 5
    cfg = transformers.GPT2Config(vocab_size=vocab, n_positions=32, n_embd=32, n_layer=2, n_head=2,
                                  bos_token_id=1, eos_token_id=2, pad_token_id=0)
    return transformers.GPT2LMHeadModel(cfg).eval()


def model_scorer(model, prompts: torch.Tensor, case: Case, beyond: bool = True):
    """sidindex's scorer for the same model: its next-token logits at the level's ids (whole
    sequences recomputed: the model, not its cache, is what is compared); with `beyond`, -inf past
    the level's size, else the model's logits at the ids there too."""
    V, sizes = case.gtm.vocab_size, case.gtm.level_sizes

    @torch.no_grad()
    def scorer(step, tokens, parent):
        B, K, _ = tokens.shape
        ids = OFFSET + torch.arange(step, device=tokens.device)[None, None, :] * V + tokens
        seq = torch.cat([prompts[:, None, :].expand(B, K, -1), ids], dim=2).reshape(B * K, -1)
        logits = model(seq).logits[:, -1].float()
        out = logits[:, OFFSET + step * V:OFFSET + (step + 1) * V].clone()
        if beyond:
            out[:, sizes[step]:] = float("-inf")
        return out.view(B, K, V)

    return scorer


def generated(case: Case, out, prompts: torch.Tensor, K: int) -> list[set]:
    """Per request, the SIDs of its returned sequences whose beams never died."""
    V, L, B = case.gtm.vocab_size, case.gtm.sid_length, prompts.shape[0]
    if out.sequences.shape[1] < PROMPT + L:  # every beam of every request died: generate stopped early
        assert bool((out.sequences_scores <= -1e6).all())
        return [set() for _ in range(B)]
    seqs = out.sequences[:, PROMPT:PROMPT + L].view(B, K, L)
    keep = out.sequences_scores.view(B, K) > -1e6  # a beam that had no allowed token scores -1e9 or -inf
    sids = [set() for _ in range(B)]
    for b in range(B):
        for k in torch.nonzero(keep[b]).flatten().tolist():
            sids[b].add(tuple(int(t) - OFFSET - d * V for d, t in enumerate(seqs[b, k].tolist())))
    return sids


# nothing eligible: every beam dies in cd+gtm, and generate stops early
DEAD_END = Scenario(TargetingSpec((Attribute("b0", BITMASK, values=("v0",)),)), [{"b0": ["v0"]}], [(0, 0)], [0],
                    (1, 1), [{"b0": None}], KWayConfig(k=(1,)))


@settings(max_examples=8, deadline=None)
@given(scenarios(max_ads=10), st.integers(0, 2**16), st.integers(2, 4))
@example(DEAD_END, 0, 2)
def test_generate_with_the_processor_equals_sidindex_beam_search(sc, seed, K):
    case = Case(sc, DEVICE)  # on a GPU: the Triton mask and the device walk down the trie
    model = model_for(case, seed).to(DEVICE)
    B, L = len(sc.requests), case.gtm.sid_length
    prompts = torch.randint(OFFSET, model.config.vocab_size, (B, PROMPT),
                            generator=torch.Generator().manual_seed(seed)).to(DEVICE)
    for mode in Mode:
        proc = SidLogitsProcessor(case.index, case.req, mode, prompt_length=PROMPT, num_beams=K, token_offset=OFFSET)
        out = model.generate(prompts, attention_mask=torch.ones_like(prompts), num_beams=K, num_return_sequences=K,
                             max_new_tokens=L, min_new_tokens=L, do_sample=False, output_scores=True,
                             return_dict_in_generate=True,
                             logits_processor=transformers.LogitsProcessorList([proc]))
        found = beam_search(case.index, case.dreq, model_scorer(model, prompts, case), (1,) + (K,) * (L - 1), mode)
        got = generated(case, out, prompts, K)
        for r in range(B):
            assert got[r] == set(searched(case, found, r)), (mode, r)
            if mode.constrained:
                assert all(case.node(sid) is not None for sid in got[r])


def scored(case: Case, out, K: int) -> list[dict]:
    """Per request, {SID: score} of its returned sequences whose beams never died (generate run with
    length_penalty=0: a sequence's score is its summed log-probabilities)."""
    V, L = case.gtm.vocab_size, case.gtm.sid_length
    B = out.sequences_scores.numel() // K
    got = [{} for _ in range(B)]
    if out.sequences.shape[1] < PROMPT + L:  # every beam died: generate stopped early
        return got
    seqs, scores = out.sequences[:, PROMPT:PROMPT + L].view(B, K, L), out.sequences_scores.view(B, K)
    for b in range(B):
        for k in range(K):
            if scores[b, k] > -1e6:
                sid = tuple(int(t) - OFFSET - d * V for d, t in enumerate(seqs[b, k].tolist()))
                got[b][sid] = float(scores[b, k])
    return got


@settings(max_examples=6, deadline=None)
@given(scenarios(max_ads=10).filter(lambda sc: min(sc.level_sizes) < max(sc.level_sizes)), st.integers(0, 2**16),
       st.integers(2, 4))
@example(None, 7, 3)  # the fixed catalog below: levels of 3, 2 and 4 tokens
def test_generate_and_beam_search_share_the_level_distribution(sc, seed, K):
    if sc is None:
        ads = [{"country": ["US"], "locations": []}, {"country": None, "locations": ["loc1"]},
               {"country": None, "locations": []}]
        sc = scenario(ads, [(0, 0, 0), (0, 1, 3), (1, 0, 2), (2, 1, 1), (2, 0, 3)], [0, 1, 2, 2, 0])
    case = Case(sc, DEVICE)
    model = model_for(case, seed).to(DEVICE)
    B, L = len(sc.requests), case.gtm.sid_length
    prompts = torch.randint(OFFSET, model.config.vocab_size, (B, PROMPT),
                            generator=torch.Generator().manual_seed(seed)).to(DEVICE)
    scorer = model_scorer(model, prompts, case, beyond=False)  # finite logits past each level's size
    levels = trie_levels(case.index)
    scan = [node_scores(case.index, model_scorer(model, prompts[r:r + 1], case, beyond=False), levels).cpu()
            for r in range(B)]
    for mode in Mode:
        proc = SidLogitsProcessor(case.index, case.req, mode, prompt_length=PROMPT, num_beams=K, token_offset=OFFSET)
        out = model.generate(prompts, attention_mask=torch.ones_like(prompts), num_beams=K, num_return_sequences=K,
                             max_new_tokens=L, min_new_tokens=L, do_sample=False, length_penalty=0.0,
                             output_scores=True, return_dict_in_generate=True,
                             logits_processor=transformers.LogitsProcessorList([proc]))
        found = beam_search(case.index, case.dreq, scorer, (1,) + (K,) * (L - 1), mode)
        got = scored(case, out, K)
        for r in range(B):
            want = searched(case, found, r)
            assert got[r].keys() == want.keys(), (mode, r)
            for sid in want:
                assert got[r][sid] == pytest.approx(want[sid], rel=1e-4, abs=1e-4), (mode, r, sid)
                if mode.constrained:  # a catalog SID: the scan's score of its leaf
                    assert float(scan[r][case.node(sid)]) == pytest.approx(want[sid], rel=1e-4, abs=1e-4)


def test_greedy_decoding_is_width_one_search():
    from tests.test_gtm import scenario

    ads = [{"country": ["US"], "locations": []}, {"country": ["CA"], "locations": ["loc1"]},
           {"country": None, "locations": []}]
    case = Case(scenario(ads, [(0, 0, 0), (2, 1, 3), (1, 1, 2)], [0, 1, 2]), "cpu")
    model = model_for(case, 5)
    B, L = len(case.sc.requests), case.gtm.sid_length
    prompts = torch.randint(OFFSET, model.config.vocab_size, (B, PROMPT), generator=torch.Generator().manual_seed(1))
    proc = SidLogitsProcessor(case.index, case.req, "cd+gtm", prompt_length=PROMPT, token_offset=OFFSET)
    out = model.generate(prompts, attention_mask=torch.ones_like(prompts), max_new_tokens=L, min_new_tokens=L,
                         do_sample=False, logits_processor=transformers.LogitsProcessorList([proc]))
    found = beam_search(case.index, case.dreq, model_scorer(model, prompts, case), (1,) * L, "cd+gtm")
    for r in range(B):
        want = searched(case, found, r)
        if want:  # a request with nothing eligible has no greedy SID to compare
            sid = tuple(int(t) - OFFSET - d * case.gtm.vocab_size for d, t in enumerate(out[r, PROMPT:].tolist()))
            assert {sid} == set(want)


def test_bad_token_mappings_and_row_counts_are_refused():
    from tests.test_gtm import requests_of, scenario

    case = Case(scenario([{"country": ["US"], "locations": []}], [(0, 0, 0)], [0]), "cpu")
    with pytest.raises(ConfigError, match="exactly one of token_offset"):
        SidLogitsProcessor(case.index, case.req, prompt_length=2)
    with pytest.raises(ConfigError, match=r"\(L, V\)"):
        SidLogitsProcessor(case.index, case.req, prompt_length=2, token_ids=torch.zeros(2, 2, dtype=torch.int64))
    L, V = case.gtm.sid_length, case.gtm.vocab_size
    twice = torch.arange(L * V).view(L, V)
    twice[0, 1] = twice[0, 0]  # two SID tokens of level 0 on one model id
    with pytest.raises(ConfigError, match=r"token_ids\[0, :3\] must be distinct"):
        SidLogitsProcessor(case.index, case.req, prompt_length=2, token_ids=twice)
    # the request table itself is accepted; a prompt count that is not requests x num_beams is refused
    proc = SidLogitsProcessor(case.index, requests_of(case.sc), prompt_length=2, num_beams=2, token_offset=OFFSET)
    B = len(case.sc.requests)
    with pytest.raises(ConfigError, match=f"{B + 1} rows for {B} requests with 2 row"):
        proc(torch.zeros(B + 1, 2, dtype=torch.int64), torch.zeros(B + 1, OFFSET + L * V))
