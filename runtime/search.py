"""Constrained beam search over SIDs (DESIGN.md §8).

Step d (0..L-1) starts from the beams of the previous step (one root beam per request at step 0):
the scorer gives logits for every beam, log-softmax turns them into log-probabilities, the mask
keeps beam_score + logp only at the tokens the mode allows, and top-k over each request's
(beams x V) candidates picks the next beams. Everything stays on the device and every shape is
fixed by the beam sizes, so the loop never waits on the host and can be captured in a CUDA graph.

Beam sizes: beams[0] is the root (1); beams[d] (d >= 1) beams are kept after step d-1, and
beams[-1] after the last step. A beam whose candidates are all disallowed dies: the top-k may
still pick its -inf slots when too few candidates survive, but they are marked dead and never
extended, so a request whose beams all die returns fewer (or zero) SIDs. There is no fallback to
unconstrained decoding. Scores are accumulated log-probabilities.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from runtime.loader import DeviceIndex
from runtime.ops.gtm_mask import gtm_mask
from runtime.requests import DeviceRequests
from sidindex.errors import ConfigError

MODES = ("none", "cd", "cd+gtm", "cd+gtm+kway")
DEFAULT_BEAMS = (1, 512, 1024, 1024)
NEG_INF = float("-inf")

# scorer(step, prefix) -> logits: prefix (B, K, step) int64 tokens so far -> (B, K, V) float logits
Scorer = Callable[[int, torch.Tensor], torch.Tensor]


@dataclass(frozen=True)
class Beams:
    """tokens: (B, K, L) int64 SIDs; score: (B, K) float32 accumulated log-probability (-inf: dead),
    sorted descending per request; leaf: (B, K) int64 leaf index of the SID (-1 when it is not a
    catalog SID, which only mode "none" produces, or the beam is dead)."""

    tokens: torch.Tensor
    score: torch.Tensor
    leaf: torch.Tensor

    @property
    def alive(self) -> torch.Tensor:
        return self.score > NEG_INF


def parse_beams(text: str | tuple[int, ...] | list[int], sid_length: int) -> tuple[int, ...]:
    """'1,512,1024,1024' -> (1, 512, 1024, 1024), checked against the SID length."""
    try:
        beams = tuple(int(b) for b in (text.replace(",", " ").split() if isinstance(text, str) else text))
    except ValueError:
        raise ConfigError(f"--beams {text!r}: expected integers separated by commas, e.g. 1,512,1024,1024") from None
    if len(beams) != sid_length or any(b < 1 for b in beams):
        raise ConfigError(f"--beams {text!r}: give {sid_length} positive beam sizes, one per SID position")
    if beams[0] != 1:
        raise ConfigError(f"--beams {text!r}: the first step starts from the root, so beams[0] must be 1")
    return beams


def beam_search(index: DeviceIndex, requests: DeviceRequests, scorer: Scorer, beams: tuple[int, ...] = DEFAULT_BEAMS,
                mode: str = "cd+gtm", impl: str = "auto") -> Beams:
    """Search SIDs for a batch of requests. impl: the mask implementation ("auto", "triton", "numba", "torch")."""
    if mode not in MODES:
        raise ConfigError(f"mode must be one of {', '.join(MODES)}; got {mode!r}")
    beams = parse_beams(beams, index.sid_length)
    B, V, L, dev = requests.batch, index.vocab_size, index.sid_length, index.device
    node = torch.zeros(B, 1, dtype=torch.int64, device=dev)
    score = torch.zeros(B, 1, dtype=torch.float32, device=dev)
    tokens = torch.zeros(B, 1, 0, dtype=torch.int64, device=dev)
    req = torch.arange(B, device=dev)
    for d in range(L):
        K = node.shape[1]
        logp = torch.log_softmax(scorer(d, tokens).float(), dim=-1).reshape(B * K, V)
        if mode == "none":  # any in-vocabulary token of this level
            cand = score.reshape(-1, 1) + logp
            cand = torch.where(torch.isnan(cand), NEG_INF, cand)
            cand[:, index.level_sizes[d]:] = NEG_INF
        else:
            # dead beams (-inf) sit at node -1; they read the root's offsets and pass nothing
            cand = gtm_mask(index, requests, d, req.repeat_interleave(K), node.reshape(-1).clamp(min=0),
                            score.reshape(-1), logp, mode, impl)
        k_next = min(beams[d + 1] if d + 1 < L else beams[-1], K * V)
        # only the last step's order matters (the result is ranked); unsorted top-k is cheaper
        score, flat = cand.reshape(B, K * V).topk(k_next, dim=1, sorted=d == L - 1)
        parent, tok = flat // V, flat % V
        tok = torch.where(score > NEG_INF, tok, 0)  # a dead slot's token is arbitrary: keep it in every level's range
        tokens = torch.cat([tokens.gather(1, parent[..., None].expand(-1, -1, d)), tok[..., None]], dim=2)
        node = _child(index, node.gather(1, parent), tok, score > NEG_INF)
    leaf = torch.where(node >= 0, node - index.leaf_start, -1)
    return Beams(tokens, score, leaf)


def _child(index: DeviceIndex, node: torch.Tensor, tok: torch.Tensor, alive: torch.Tensor) -> torch.Tensor:
    """The trie node reached from `node` by `tok` (same shape), -1 where there is none (or the beam
    is dead): binary search of (node, token) in the sorted entry keys."""
    key = node * index.vocab_size + tok
    e = torch.searchsorted(index.entry_keys, key).clamp(max=len(index.entry_keys) - 1)
    found = alive & (node >= 0) & (index.entry_keys[e] == key)
    return torch.where(found, index.csr_child_nodes[e].long(), -1)
