"""The constraint of one batch on one index: which SIDs its requests may generate, step by step
(docs/design.md §8, §13).

`beam_search` (and through it `runtime.Searcher` and `runtime.Retriever`) and the Hugging Face
processor (`runtime.search.hf`) ask one `Constraint` the same two things at each step: where a beam is
in the trie (the walk from the root by its tokens, or one step down from its parent's node), and
which of its children the mode lets through, scored (the CD+GTM mask of `ops.gtm_mask`, per token
or in the compact layout of `ops.slots`). The batch's device form and the preparation
the mask kernels read (query tables, the shared rows' tests) are made once, here.

Legend: B requests, K beams per request, M = B x K beams, V tokens per level.
"""

from __future__ import annotations

import torch

from runtime.index.served import ServedIndex
from runtime.ops.gtm_mask import gtm_candidates, gtm_mask, mask_impl
from runtime.ops.impl import Impl
from runtime.ops.prepare import planned, prepared
from runtime.ops.slots import Slots, decode, slots_of
from runtime.requests import device_form
from sidindex.modes import Mode
from sidindex.request_encoding import EncodedRequests


class Constraint:
    """What a batch may generate on an index under a mode.

    index: the served index; requests: the batch's encoding (its device form, or the host form,
    moved once); mode: a parsed Mode the index can serve; impl: the mask implementation (an
    `Impl`, resolved here once, `ops.gtm_mask.mask_impl`: an unknown one is refused before any
    work); compact: the searches lay candidates out compactly (`slots`), which prepares the first
    step's launch (`prepare.planned`) rather than the whole batch's tables up front
    (`prepare.prepared`).
    """

    def __init__(self, index: ServedIndex, requests: EncodedRequests, mode: Mode, impl: Impl | str = Impl.AUTO,
                 compact: bool = True) -> None:
        self.index, self.mode, self.impl = index, mode, mask_impl(impl, index.device)
        requests = device_form(requests, index.device)
        self.kernels = self.impl is Impl.TRITON  # the compact layout's own kernels too
        self.plan = None  # the query tables and shared rows' tests, made in the first step's mask launch
        if self.kernels and mode.gtm and compact:
            requests, self.plan = planned(requests, index)
        elif self.kernels and mode.gtm:
            requests = prepared(requests, index)
        self.requests = requests

    @property
    def batch(self) -> int:
        return self.requests.batch

    # -- the walk --------------------------------------------------------------------------

    def child(self, node: torch.Tensor, tok: torch.Tensor, alive: torch.Tensor) -> torch.Tensor:
        """The trie node reached from `node` by `tok` (same shapes, int64), -1 where there is none
        (or `alive` is False, or node is -1): a binary search of (node, token) in the sorted entry
        keys."""
        index = self.index
        key = node * index.vocab_size + tok
        e = torch.searchsorted(index.entry_keys, key).clamp(max=len(index.entry_keys) - 1)
        found = alive & (node >= 0) & (index.entry_keys[e] == key)
        return torch.where(found, index.gtm.csr_child_nodes[e].long(), -1)

    def walk(self, tokens: torch.Tensor) -> torch.Tensor:
        """(N,) int64 the trie node of each row of tokens (N, d) int64 (SID tokens of levels
        0..d-1, -1 for one that is not a SID token), -1 where the row left the catalog."""
        node = torch.zeros(tokens.shape[0], dtype=torch.int64, device=tokens.device)
        for d in range(tokens.shape[1]):
            tok = tokens[:, d]
            node = self.child(node, tok.clamp(min=0), (tok >= 0) & (node >= 0))
        return node

    # -- the mask --------------------------------------------------------------------------

    def mask(self, depth: int, beam_request: torch.Tensor, beam_node: torch.Tensor, beam_score: torch.Tensor,
             logp: torch.Tensor, value_weight: float = 0.0):
        """(M, V) float32 each beam's candidates, beam_score + logp at the tokens of its node's
        children that pass, -inf elsewhere (with value_weight > 0, also the value-guided key:
        `ops.gtm_mask.gtm_mask`). beam_request, beam_node: (M,) int64 (node -1: a dead beam, which
        reads the root and passes nothing); beam_score: (M,) float32; logp: (M, V) float32."""
        return gtm_mask(self.index, self.requests, depth, beam_request, beam_node.clamp(min=0), beam_score, logp,
                        self.mode, self.impl, value_weight=value_weight)

    def slots(self, node: torch.Tensor, score: torch.Tensor, width: int) -> Slots:
        """The compact layout of the beams' child entries: node, score (B, K), at most `width`
        slots a request (`ops.slots.slots_of`)."""
        return slots_of(self.index, node, score, width, self.kernels)

    def candidates(self, depth: int, slots: Slots, beam_node: torch.Tensor, beam_score: torch.Tensor,
                   logp: torch.Tensor, value_weight: float = 0.0):
        """(B, W) float32 the candidates of `slots` (`ops.gtm_mask.gtm_candidates`); beam_node,
        beam_score: (M,); logp: (M, V)."""
        return gtm_candidates(self.index, self.requests, depth, slots, beam_node, beam_score, logp, self.mode,
                              self.impl, value_weight, self.plan if depth == 0 else None)

    def chosen(self, slots: Slots, flat: torch.Tensor, score: torch.Tensor, tokens: torch.Tensor):
        """(parent beam, token, child node, tokens so far) of the slots `flat` (B, k) a step kept
        (`ops.slots.decode`)."""
        return decode(self.index, slots, flat, score, tokens, self.kernels)
