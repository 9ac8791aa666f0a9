"""Constrained SID generation with Hugging Face `generate` (DESIGN.md §13).

    from transformers import LogitsProcessorList
    from runtime.hf import SidLogitsProcessor
    proc = SidLogitsProcessor(index, requests, mode="cd+gtm", prompt_length=P, token_offset=o)
    out = model.generate(input_ids, num_beams=K, num_return_sequences=K, max_new_tokens=L,
                         do_sample=False, logits_processor=LogitsProcessorList([proc]))

Row n of a step's input_ids belongs to request n // (N / B) (generate keeps a request's beams, or
its samples, together). The model's vocabulary id of token t at SID level d is
token_offset + d * V + t, or token_ids[d, t] for any other mapping. Per step the processor reads
the tokens generated so far, walks them down the trie on the device (a binary search of the index's
entry keys per level, for all rows at once: no Python loop over beams, no host synchronisation),
and masks with the same CD+GTM mask as `runtime.search` (Triton on CUDA, the CPU path otherwise).
What it returns is the model's distribution over the level's V tokens (log-softmax over their ids),
-inf at every token the mode does not allow and at every id that is not one of the level's tokens,
EOS and special tokens included. With the same model, `generate` beam search at a fixed width
returns the SIDs of `runtime.beam_search` at that width, whose scorer gives the model's logits at
the level's ids. A row whose prefix left the catalog (or a request with nothing eligible) gets -inf
everywhere: its beam dies, as in `runtime.beam_search`.
"""

from __future__ import annotations

import torch

from runtime.loader import ServedIndex
from runtime.ops.gtm_mask import gtm_mask
from runtime.requests import to_device
from runtime.search import child_nodes
from sidindex.errors import ConfigError
from sidindex.modes import Mode, parse_mode
from sidindex.requests import EncodedRequests

NEG_INF = float("-inf")


class SidLogitsProcessor:
    """A `transformers` logits processor (a callable (input_ids, scores) -> scores).

    index: a ServedIndex; requests: their encoding (`runtime.encode_requests`), on the host or the
    index's device; prompt_length: P, the length of every prompt in input_ids; token_offset or
    token_ids: (L, V) int64 model ids of the SID tokens; num_beams: checked against the rows.
    """

    def __init__(self, index: ServedIndex, requests: EncodedRequests, mode: Mode | str = Mode.CD_GTM, *,
                 prompt_length: int, num_beams: int | None = None, token_offset: int | None = None,
                 token_ids: torch.Tensor | None = None, impl: str = "auto") -> None:
        self.index, self.mode, self.P, self.num_beams, self.impl = index, parse_mode(mode, kway_available=index.kway), \
            prompt_length, num_beams, impl
        self.requests = requests if requests.stacked is not None else to_device(requests, index.device)
        L, V = index.sid_length, index.vocab_size
        if (token_offset is None) == (token_ids is None):
            raise ConfigError("give exactly one of token_offset (SID token t of level d is token_offset + d * V + t) "
                              "or token_ids (an (L, V) table of model ids)")
        if token_ids is None:
            token_ids = token_offset + torch.arange(L)[:, None] * V + torch.arange(V)
        token_ids = torch.as_tensor(token_ids, dtype=torch.int64)
        if token_ids.shape != (L, V) or int(token_ids.min()) < 0:
            raise ConfigError(f"token_ids must be an (L, V) = ({L}, {V}) table of non-negative model token ids")
        self.token_ids = token_ids.to(index.device)
        self.inverse: torch.Tensor | None = None  # (L, model vocabulary) SID token of each id, -1 for none

    def _inverse(self, vocab: int) -> torch.Tensor:
        if self.inverse is None or self.inverse.shape[1] != vocab:
            if int(self.token_ids.max()) >= vocab:
                raise ConfigError(f"SID token ids reach {int(self.token_ids.max())}, beyond the model's {vocab} logits")
            inv = torch.full((self.index.sid_length, vocab), -1, dtype=torch.int64, device=self.index.device)
            V = self.index.vocab_size
            inv.scatter_(1, self.token_ids, torch.arange(V, device=inv.device).expand_as(self.token_ids).contiguous())
            self.inverse = inv
        return self.inverse

    def nodes(self, input_ids: torch.Tensor, vocab: int) -> torch.Tensor:
        """(N,) int64 trie node of each row's generated tokens (-1 where they left the catalog), for
        a model of `vocab` token ids."""
        inv = self._inverse(vocab)
        node = torch.zeros(input_ids.shape[0], dtype=torch.int64, device=input_ids.device)
        for d in range(input_ids.shape[1] - self.P):
            tok = inv[d][input_ids[:, self.P + d]]
            node = child_nodes(self.index, node, tok.clamp(min=0), (tok >= 0) & (node >= 0))
        return node

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        index, (N, vocab) = self.index, scores.shape
        d = input_ids.shape[1] - self.P
        B = self.requests.batch
        if N % B or (self.num_beams is not None and N != B * self.num_beams):
            raise ConfigError(f"generate passed {N} rows for {B} requests" +
                              (f" and num_beams {self.num_beams}" if self.num_beams is not None else ""))
        out = torch.full_like(scores, NEG_INF)
        if not 0 <= d < index.sid_length:  # past the SID: nothing more may be generated
            return out
        node = self.nodes(input_ids, vocab)
        size = index.level_sizes[d]
        ids = self.token_ids[d, :size]
        level = torch.full((N, index.vocab_size), NEG_INF, dtype=torch.float32, device=scores.device)
        level[:, :size] = torch.log_softmax(scores[:, ids].float(), dim=-1)
        if self.mode.constrained:
            req = torch.arange(N, device=scores.device) // (N // B)
            alive = torch.where(node >= 0, 0.0, NEG_INF).float()
            level = gtm_mask(index, self.requests, d, req, node.clamp(min=0), alive, level, self.mode, self.impl)
        out[:, ids] = level[:, :size].to(out.dtype)
        return out
