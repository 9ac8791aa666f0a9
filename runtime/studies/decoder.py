"""A reference generative retriever: a small causal transformer over a request's context tokens
followed by SID tokens, with a KV cache reordered by the search's `parent` (docs/design.md §12).

It is the worked example of plugging a model into the search (`runtime.search.beam.Scorer`): a serving
team's decoder has the same shape. The sequence of a request is its C context tokens (e.g. the
user's history, ids in [0, context_vocab)) then the SID's tokens; SID token t of level d is
embedded as d * V + t, and the logits of level d come from the hidden state before it, through
that level's head, -inf beyond the level's size. Weights are random (seeded): the model scores,
it is not trained.

`DecoderScorer` runs the context once (step 0), then one new position per step for every beam,
its cache gathered by `parent` first; `sequence_logprob` scores whole SIDs without a cache, which
the search's accumulated scores equal (tests compare them). `reference_scorer` is the factory the
command line takes: `sidindex retrieve ... --scorer runtime.studies.decoder:reference_scorer`.

Legend: B requests, K beams, C context tokens, L SID length, V vocabulary (max level size),
H heads, D model width.
"""

from __future__ import annotations

import functools

import torch
from torch import nn
from torch.nn import functional as F


class _Layer(nn.Module):
    """Pre-norm self-attention and MLP."""

    def __init__(self, d_model: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.norm1, self.norm2 = nn.LayerNorm(d_model), nn.LayerNorm(d_model)
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.out = nn.Linear(d_model, d_model)
        self.mlp = nn.Sequential(nn.Linear(d_model, 4 * d_model), nn.GELU(), nn.Linear(4 * d_model, d_model))

    def forward(self, x: torch.Tensor, past: tuple[torch.Tensor, torch.Tensor] | None):
        """x: (N, T, D) new positions; past: (k, v) each (N, H, T0, D/H) or None. Returns the new
        hidden states and the keys and values of all T0 + T positions."""
        N, T, D = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(N, T, 3, self.heads, D // self.heads).permute(2, 0, 3, 1, 4)
        if past is not None:
            k, v = torch.cat([past[0], k], dim=2), torch.cat([past[1], v], dim=2)
        T0 = k.shape[2] - T
        # causal over the new positions; every new position sees the whole past
        mask = torch.ones(T, T0 + T, dtype=torch.bool, device=x.device).tril(diagonal=T0)
        a = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        x = x + self.out(a.transpose(1, 2).reshape(N, T, D))
        return x + self.mlp(self.norm2(x)), (k, v)


class ReferenceDecoder(nn.Module):
    """The model. level_sizes: the index's (L values); context_vocab: ids of context tokens;
    context_length: the most context tokens a request brings."""

    beyond: torch.Tensor  # (L, V) a buffer: -inf beyond each level's size

    def __init__(self, level_sizes: tuple[int, ...], context_vocab: int = 1024, context_length: int = 64,
                 d_model: int = 256, layers: int = 4, heads: int = 4, seed: int = 0) -> None:
        super().__init__()
        with torch.random.fork_rng(devices=[]):  # seeded weights without reseeding the caller's generator
            torch.manual_seed(seed)
            self._build(level_sizes, context_vocab, context_length, d_model, layers, heads)

    def _build(self, level_sizes, context_vocab, context_length, d_model, layers, heads) -> None:
        self.level_sizes, self.V = tuple(level_sizes), max(level_sizes)
        L = len(level_sizes)
        self.context = nn.Embedding(context_vocab, d_model)
        self.sid = nn.Embedding(L * self.V, d_model)
        self.position = nn.Embedding(context_length + L, d_model)
        self.layers = nn.ModuleList(_Layer(d_model, heads) for _ in range(layers))
        self.norm = nn.LayerNorm(d_model)
        self.heads = nn.ModuleList(nn.Linear(d_model, self.V) for _ in range(L))
        # -inf beyond each level's size, added to that level's logits
        beyond = torch.zeros(L, self.V)
        for d, size in enumerate(level_sizes):
            beyond[d, size:] = float("-inf")
        self.register_buffer("beyond", beyond, persistent=False)

    def _embed_sid(self, tokens: torch.Tensor, first_level: int) -> torch.Tensor:
        """(N, T, D) embeddings of SID tokens (N, T) int64 of levels first_level.. in order."""
        level = torch.arange(first_level, first_level + tokens.shape[1], device=tokens.device)
        return self.sid(level * self.V + tokens)

    def run(self, x: torch.Tensor, start: int, cache: list | None):
        """Hidden state of the last of the new positions x (N, T, D) at positions start..start+T-1,
        and the updated cache (one (k, v) per layer)."""
        x = x + self.position(torch.arange(start, start + x.shape[1], device=x.device))
        new = []
        for i, layer in enumerate(self.layers):
            x, kv = layer(x, None if cache is None else cache[i])
            new.append(kv)
        return self.norm(x[:, -1]), new

    def logits(self, hidden: torch.Tensor, level: int) -> torch.Tensor:
        """(N, V) float32 logits of `level` from hidden states (N, D)."""
        return (self.heads[level](hidden) + self.beyond[level]).float()

    @torch.no_grad()
    def sequence_logprob(self, context: torch.Tensor, sids: torch.Tensor) -> torch.Tensor:
        """(B, N) float32 log-probability of each SID sids (B, N, L) int64 after its request's
        context (B, C) int64, from whole sequences without a cache (full vocabulary softmax)."""
        B, N, L = sids.shape
        ctx = context[:, None, :].expand(B, N, -1).reshape(B * N, -1)
        seq = sids.reshape(B * N, L)
        total = torch.zeros(B * N, dtype=torch.float32, device=sids.device)
        for d in range(L):
            x = torch.cat([self.context(ctx), self._embed_sid(seq[:, :d], 0)], dim=1)
            hidden, _ = self.run(x, 0, None)
            total += torch.log_softmax(self.logits(hidden, d), -1).gather(1, seq[:, d:d + 1])[:, 0]
        return total.view(B, N)


class DecoderScorer:
    """A `runtime.search.beam.Scorer` for one batch: the decoder with its KV cache.

    context: (B, C) int64 each request's context tokens. Per call, a cache of (B*K, H, T, D/H) keys
    and values per layer, T = C + step; with `parent` it is gathered to the new beams and one
    position is run per beam; without, the whole prefix is run (step 0: the context alone).
    """

    def __init__(self, model: ReferenceDecoder, context: torch.Tensor) -> None:
        self.model, self.context = model, context.clone()  # its own: a captured search refreshes it in place
        self.inputs = {"context": self.context}  # what `runtime.Searcher` copies each batch into
        self.cache: list | None = None

    @torch.no_grad()
    def __call__(self, step: int, tokens: torch.Tensor, parent: torch.Tensor | None) -> torch.Tensor:
        m = self.model
        B, K, _ = tokens.shape
        C = self.context.shape[1]
        if parent is None or self.cache is None:  # the whole prefix: context, then the tokens so far
            ctx = self.context[:, None, :].expand(B, K, C).reshape(B * K, C)
            x = torch.cat([m.context(ctx), m._embed_sid(tokens.reshape(B * K, step), 0)], dim=1)
            hidden, cache = m.run(x, 0, None)
            # the next call extends these beams only in a search (step 0); a scan of arbitrary
            # prefixes (parent None later on) starts afresh, so its large cache is not kept
            self.cache = cache if step == 0 else None
        else:  # reorder the cache to the new beams, then run only the newest token
            k_prev = self.cache[0][0].shape[0] // B
            rows = (torch.arange(B, device=parent.device)[:, None] * k_prev + parent).reshape(-1)
            cache = [(k[rows], v[rows]) for k, v in self.cache]
            x = m._embed_sid(tokens[:, :, -1].reshape(B * K, 1), step - 1)
            hidden, self.cache = m.run(x, C + step - 1, cache)
        return m.logits(hidden, step).view(B, K, m.V)


def context_tokens(values: list[list[int] | None], length: int, vocab: int, device) -> torch.Tensor:
    """(B, length) int64 context tokens from per-request lists (None: empty): the last `length`
    ids of each, left-padded with 0, every id taken modulo `vocab`."""
    out = torch.zeros(len(values), length, dtype=torch.int64)
    for b, v in enumerate(values):
        v = [int(t) % vocab for t in (v or [])][-length:]
        if v:
            out[b, length - len(v):] = torch.tensor(v, dtype=torch.int64)
    return out.to(device)



@functools.lru_cache(maxsize=4)
def _reference_model(level_sizes: tuple[int, ...], device: str) -> ReferenceDecoder:
    return ReferenceDecoder(level_sizes).to(device).eval()


def reference_scorer(batch, device: torch.device, level_sizes: tuple[int, ...]) -> DecoderScorer:
    """A scorer factory (`--scorer runtime.studies.decoder:reference_scorer`): the reference decoder at its
    default size (random weights, seed 0) over each request's `history` column (a list of integer
    ids, the last 64 used; no column or a null: an empty context). batch: a pyarrow.Table of the
    batch's request rows."""
    model = _reference_model(tuple(level_sizes), str(device))
    history = batch.column("history").to_pylist() if "history" in batch.column_names else [None] * batch.num_rows
    C = model.position.num_embeddings - len(level_sizes)
    return DecoderScorer(model, context_tokens(history, C, model.context.num_embeddings, device))
