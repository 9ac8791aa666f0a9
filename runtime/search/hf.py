"""Constrained SID generation with Hugging Face `generate` (docs/design.md §13).

    proc = SidLogitsProcessor(index, requests, mode="cd+gtm", prompt_length=P, num_beams=K, token_offset=o)
    out = model.generate(input_ids, num_beams=K, num_return_sequences=K, max_new_tokens=L,
                         do_sample=False, logits_processor=LogitsProcessorList([proc]))

Each step walks every row's generated tokens down the trie on the device, through the
`runtime.search.constraint.Constraint` that `runtime.beam_search` uses (no Python loop over beams,
no host synchronisation), and returns the model's log-probabilities over the level's tokens, -inf
at every token the mode does not allow, EOS and special tokens included. So `generate` beam search
returns the SIDs and scores of `runtime.beam_search` at the same width. A row with no allowed token
gets DEAD and keeps a SID's shape; a step at which the model gives a request no finite logit is
recorded on the device and refused by `check()`. Row mapping, token ids, dead rows and scores in
full: docs/runtime.md ("Hugging Face generate").
"""

from __future__ import annotations

import torch

from runtime.index.served import ServedIndex
from runtime.ops.distribution import level_log_probs, scored_rows
from runtime.search.beam import check_scored
from runtime.search.constraint import Constraint
from sidindex.errors import ConfigError
from sidindex.modes import Mode, parse_mode
from sidindex.request_encoding import EncodedRequests, encode_requests
from sidindex.requests import Requests

NEG_INF = float("-inf")
DEAD = -1e30  # a row with no allowed token: any SID token, at a score no live beam reaches


class SidLogitsProcessor:
    """A `transformers` logits processor (a callable (input_ids, scores) -> scores).

    index: a ServedIndex; requests: the request table (`runtime.read_requests`) or its encoding
    (`runtime.encode_requests`, on the host or the index's device); prompt_length: P, the length of
    every prompt in input_ids; num_beams: the rows generate keeps per request (num_beams for beam
    search, num_return_sequences for sampling, 1 for greedy); token_offset or token_ids: (L, V)
    int64 model ids of the SID tokens, distinct within a level (-1 beyond a level's size).
    """

    def __init__(self, index: ServedIndex, requests: Requests | EncodedRequests, mode: Mode | str = Mode.CD_GTM, *,
                 prompt_length: int, num_beams: int = 1, token_offset: int | None = None,
                 token_ids: torch.Tensor | None = None, impl: str = "auto") -> None:
        self.index, self.mode, self.P, self.num_beams, self.impl = index, parse_mode(mode, kway_available=index.kway), \
            prompt_length, num_beams, impl
        if isinstance(requests, Requests):
            requests = encode_requests(requests, index.spec)
        # the walk and the mask of `runtime.beam_search`, the batch's tables made once
        self.constraint = Constraint(index, requests, self.mode, impl, compact=False)
        L, V = index.sid_length, index.vocab_size
        if (token_offset is None) == (token_ids is None):
            raise ConfigError("give exactly one of token_offset (SID token t of level d is token_offset + d * V + t) "
                              "or token_ids (an (L, V) table of model ids)")
        if token_offset is not None:  # (then token_ids is None)
            token_ids = token_offset + torch.arange(L)[:, None] * V + torch.arange(V)
        token_ids = torch.as_tensor(token_ids, dtype=torch.int64).cpu()
        if token_ids.shape != (L, V):
            raise ConfigError(f"token_ids must be an (L, V) = ({L}, {V}) table of model token ids")
        for d, size in enumerate(index.level_sizes):
            ids = token_ids[d, :size]
            if int(ids.min()) < 0 or len(ids.unique()) != size:
                raise ConfigError(f"token_ids[{d}, :{size}] must be distinct non-negative model token ids")
        self.token_ids = token_ids.clamp(min=0).to(index.device)  # ids beyond a level's size are never read
        self.inverse: torch.Tensor | None = None  # (L, model vocabulary) SID token of each id, -1 for none
        # per step of the last generate, (B,) bool on the device: the request had live rows and the
        # model gave none of them a finite logit at the level's ids (read by `check`)
        self.unscored: dict[int, torch.Tensor] = {}

    def _inverse(self, vocab: int) -> torch.Tensor:
        if self.inverse is None or self.inverse.shape[1] != vocab:
            if int(self.token_ids.max()) >= vocab:
                raise ConfigError(f"SID token ids reach {int(self.token_ids.max())}, beyond the model's {vocab} logits")
            inv = torch.full((self.index.sid_length, vocab), -1, dtype=torch.int64, device=self.index.device)
            for d, size in enumerate(self.index.level_sizes):
                inv[d, self.token_ids[d, :size]] = torch.arange(size, device=inv.device)
            self.inverse = inv
        return self.inverse

    def nodes(self, input_ids: torch.Tensor, vocab: int) -> torch.Tensor:
        """(N,) int64 trie node of each row's generated tokens (-1 where they left the catalog), for
        a model of `vocab` token ids."""
        inv = self._inverse(vocab)
        generated = input_ids[:, self.P:]
        levels = torch.arange(generated.shape[1], device=input_ids.device)
        return self.constraint.walk(inv[levels, generated])  # SID tokens, -1 for any other id

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.Tensor:
        index, (N, vocab) = self.index, scores.shape
        d = input_ids.shape[1] - self.P
        B = self.constraint.batch
        if N != B * self.num_beams:
            raise ConfigError(f"generate passed {N} rows for {B} requests with {self.num_beams} row(s) each: give one "
                              "prompt per request, and num_beams as the rows generate keeps per request")
        out = torch.full_like(scores, NEG_INF)
        if not 0 <= d < index.sid_length:  # past the SID: nothing more may be generated
            return out
        node = self.nodes(input_ids, vocab)
        size = index.level_sizes[d]
        ids = self.token_ids[d, :size]
        level = level_log_probs(scores[:, self.token_ids[d]], size)  # (N, V): the ids past `size` are never read
        live = node >= 0 if self.mode.constrained else torch.ones(N, dtype=torch.bool, device=scores.device)
        if d == 0:  # a new generate
            self.unscored = {}
        scored = (live & scored_rows(level)).reshape(B, -1).any(dim=1)
        self.unscored[d] = live.reshape(B, -1).any(dim=1) & ~scored
        if self.mode.constrained:
            req = torch.arange(N, device=scores.device) // self.num_beams
            alive = torch.where(live, 0.0, NEG_INF).float()
            level = self.constraint.mask(d, req, node, alive, level)
        level = level[:, :size]
        stuck = ~torch.isfinite(level).any(dim=1, keepdim=True)  # no allowed token: a dead row
        out[:, ids] = torch.where(stuck, DEAD, level).to(out.dtype)
        return out

    def check(self, request_id=None) -> None:
        """Refuse the last generate if at some step the model gave none of a request's live rows a
        finite logit at the level's ids (a ScorerError naming the request, by `request_id` (B,) or
        its place, and the step; `runtime.search.beam.check_scored`). One copy to the host: call it once
        generate has returned."""
        if self.unscored:
            steps = [self.unscored[d] for d in sorted(self.unscored)]
            check_scored(torch.stack(steps, dim=1), "generate's model", request_id)
