"""A Qwen3-layout causal LM as a scorer (`bench/bench_stream.py`'s --decoder row): the model's
logits for each beam's next SID token, with one KV cache of each request's context shared by its
beams; and the factory a Retriever takes, reading each request's `history` column."""

from __future__ import annotations

import pyarrow as pa
import torch

from runtime.studies.decoder import context_tokens

CONTEXT = 64  # the decoder's context tokens per request (its `history`)


def _rotated(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding of x (N, T, H, hd) at cos, sin (1, T, hd) (the rotate-half form of
    Hugging Face's Llama family)."""
    cos, sin = cos[:, :, None], sin[:, :, None]
    half = x.shape[-1] // 2
    return x * cos + torch.cat([-x[..., half:], x[..., :half]], dim=-1) * sin


class Qwen3Scorer:
    """A `runtime.search.beam.Scorer` over a Hugging Face causal LM of the Qwen3 layout
    (`transformers.Qwen3ForCausalLM`: pre-norm layers, q/k RMS norms, rotary positions, grouped
    KV heads) for one batch. A request's sequence is its C context tokens, then the SID's tokens:
    SID token t of level d is the model id head_ids[d, t], and the logits of level d come from the
    hidden state before it through the LM head's rows of those ids alone (the search's
    distribution is over them: `runtime.search.beam.level_log_probs`).

    KV cache: the context's keys and values are computed once per request (step 0) and shared by
    all of its beams; a beam holds only its SID tokens' (gathered by `parent` each step), and a
    new position attends to both in one softmax (the shared scores and its own side by side). A
    copy of the context per beam, as `generate` or `runtime.studies.decoder.DecoderScorer` keeps, would
    hold about 120 GB at 16 requests x 1024 beams x 64 tokens for Qwen3-1.7B (bf16).

    model: the LM (eval); head: (L, V, D) the LM head's rows of head_ids; head_ids: (L, V) int64;
    context: (B, C) int64 model ids. `inputs` holds the context, so `runtime.Searcher` captures
    the model with the search in a CUDA graph.
    """

    def __init__(self, model, head: torch.Tensor, head_ids: torch.Tensor, context: torch.Tensor) -> None:
        cfg = model.config
        self.model, self.lm, self.head, self.head_ids = model, model.model, head, head_ids
        self.Hq, self.Hkv = cfg.num_attention_heads, cfg.num_key_value_heads
        self.hd = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        self.context = context.clone()  # its own: a captured search refreshes it in place
        self.inputs = {"context": self.context}
        self.shared: list | None = None  # per layer (k, v) (B, Hkv, C, hd)
        self.own: list | None = None  # per layer (k, v) (B*K, Hkv, S, hd)

    def _attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, shared, scale: float) -> torch.Tensor:
        """q: (N, T, Hq, hd) the new positions; k, v: (N, Hkv, S, hd) each sequence's own
        positions, the T new ones last (causal among them); shared: (k, v) each (B, Hkv, C, hd)
        that every position of request b's N/B sequences sees, or None. (N, T, Hq * hd)."""
        N, T, Hq, hd = q.shape
        Hkv, S = k.shape[1], k.shape[2]
        R = Hq // Hkv  # query head h reads KV head h // R
        q = q.view(N, T, Hkv, R, hd).permute(0, 2, 1, 3, 4).reshape(N, Hkv, T * R, hd)  # row t * R + r
        own = (q @ k.transpose(-1, -2)).float() * scale  # (N, Hkv, T*R, S)
        at = torch.arange(T * R, device=q.device) // R + (S - T)  # each row's own position
        own = own.masked_fill(torch.arange(S, device=q.device)[None, :] > at[:, None], float("-inf"))
        if shared is None:
            out = torch.softmax(own, dim=-1).to(v.dtype) @ v
        else:
            sk, sv = shared
            B, C = sk.shape[0], sk.shape[2]
            K = N // B
            qs = q.view(B, K, Hkv, T * R, hd).transpose(1, 2).reshape(B, Hkv, K * T * R, hd)
            scores = (qs @ sk.transpose(-1, -2)).float() * scale  # (B, Hkv, K*T*R, C)
            scores = scores.view(B, Hkv, K, T * R, C).transpose(1, 2).reshape(N, Hkv, T * R, C)
            p = torch.softmax(torch.cat([scores, own], dim=-1), dim=-1).to(v.dtype)
            ps = p[..., :C].reshape(B, K, Hkv, T * R, C).transpose(1, 2).reshape(B, Hkv, K * T * R, C)
            out = (ps @ sv).view(B, Hkv, K, T * R, hd).transpose(1, 2).reshape(N, Hkv, T * R, hd) + p[..., C:] @ v
        return out.view(N, Hkv, T, R, hd).permute(0, 2, 1, 3, 4).reshape(N, T, Hq * hd)

    def _run(self, x: torch.Tensor, start: int, shared, own):
        """New positions x (N, T, D) at start..start+T-1 through every layer: the last one's final
        hidden state (N, D), and per layer the own (k, v) with the new positions appended."""
        N, T, _ = x.shape
        cos, sin = self.lm.rotary_emb(x, torch.arange(start, start + T, device=x.device)[None])
        kept = []
        for i, layer in enumerate(self.lm.layers):
            a = layer.self_attn
            h = layer.input_layernorm(x)
            q = _rotated(a.q_norm(a.q_proj(h).view(N, T, self.Hq, self.hd)), cos, sin)
            k = _rotated(a.k_norm(a.k_proj(h).view(N, T, self.Hkv, self.hd)), cos, sin).transpose(1, 2)
            v = a.v_proj(h).view(N, T, self.Hkv, self.hd).transpose(1, 2)
            if own is not None:
                k, v = torch.cat([own[i][0], k], dim=2), torch.cat([own[i][1], v], dim=2)
            kept.append((k, v))
            x = x + a.o_proj(self._attend(q, k, v, None if shared is None else shared[i], a.scaling))
            x = x + layer.mlp(layer.post_attention_layernorm(x))
        return self.lm.norm(x[:, -1]), kept

    def _sid_embeddings(self, tokens: torch.Tensor, first_level: int) -> torch.Tensor:
        """(N, T, D) input embeddings of SID tokens (N, T) of levels first_level.. in order."""
        levels = torch.arange(first_level, first_level + tokens.shape[1], device=tokens.device)
        return self.lm.embed_tokens(self.head_ids[levels[None, :], tokens])

    @torch.no_grad()
    def __call__(self, step: int, tokens: torch.Tensor, parent: torch.Tensor | None) -> torch.Tensor:
        B, K, _ = tokens.shape
        C = self.context.shape[1]
        if step == 0 or parent is None:  # the context (once per request), then any SID prefix at once
            hidden, self.shared = self._run(self.lm.embed_tokens(self.context), 0, None, None)
            self.own = None
            if step > 0:  # a scan of arbitrary prefixes: computed afresh, its cache not kept
                hidden, _ = self._run(self._sid_embeddings(tokens.reshape(B * K, step), 0), C, self.shared, None)
            else:
                hidden = hidden[:, None].expand(B, K, -1).reshape(B * K, -1)
        else:  # the beams' own keys and values reordered by `parent`, then the newest token alone
            own = None
            if self.own is not None:
                rows = (torch.arange(B, device=parent.device)[:, None] * (self.own[0][0].shape[0] // B)
                        + parent).reshape(-1)
                own = [(k[rows], v[rows]) for k, v in self.own]
            x = self._sid_embeddings(tokens[:, :, -1].reshape(B * K, 1), step - 1)
            hidden, self.own = self._run(x, C + step - 1, self.shared, own)
        return (hidden @ self.head[step].T).float().view(B, K, -1)


class Qwen3Decoder:
    """A Qwen3 LM with its SID tokens: the last L x V ids of its vocabulary (SID token t of level
    d is id vocab - L*V + d*V + t; `history` ids lie below them), and the scorer factory a
    Retriever takes (`scorer(batch, device, level_sizes)`, each request's `history` column its
    context: the last CONTEXT ids, left-padded)."""

    def __init__(self, config: dict, level_sizes: tuple[int, ...], device: torch.device,
                 dtype: torch.dtype = torch.bfloat16, seed: int = 0) -> None:
        import transformers

        L, V = len(level_sizes), max(level_sizes)
        cfg = transformers.Qwen3Config(**config)
        if cfg.vocab_size <= L * V:
            raise ValueError(f"a vocabulary of {cfg.vocab_size} ids cannot hold {L} x {V} SID tokens and a history")
        with torch.random.fork_rng(devices=[]), torch.device(device):
            torch.manual_seed(seed)
            model = transformers.Qwen3ForCausalLM(cfg).eval()
            rotary = model.model.rotary_emb
            inv_freq = rotary.inv_freq  # float32, as a checkpoint loaded in `dtype` keeps it
            self.model = model.to(dtype)
            rotary.inv_freq = inv_freq
        self.history_vocab = cfg.vocab_size - L * V
        self.head_ids = (self.history_vocab + torch.arange(L)[:, None] * V + torch.arange(V)).to(device)
        with torch.no_grad():
            self.head = self.model.lm_head.weight[self.head_ids].contiguous()  # (L, V, D)
        self.device, self.level_sizes = device, tuple(level_sizes)

    def scorer(self, batch: pa.Table, device, level_sizes) -> Qwen3Scorer:
        history = batch.column("history").to_pylist() if "history" in batch.column_names else [None] * batch.num_rows
        return Qwen3Scorer(self.model, self.head, self.head_ids,
                           context_tokens(history, CONTEXT, self.history_vocab, self.device))
