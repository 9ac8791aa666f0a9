"""Plain torch reference of the CD+GTM mask: gathers every child entry of every beam into dense
(M, C) tensors and tests them with whole-tensor ops. Obviously correct, memory-hungry (a word group
materialises (beams, children, queries, words)), so it runs over chunks of beams. It is what the
Triton kernel is tested and benchmarked against."""

from __future__ import annotations

import torch

from sidindex.modes import Mode

NEG_INF = float("-inf")


def _passes(index, requests, rows: list[torch.Tensor], req: torch.Tensor) -> torch.Tensor:
    """(m, C) bool: the matcher rows `rows` (per plane (m, C) int64) pass each beam's request
    `req` (m,) on every word group of every plane (`sidindex.matchers.plane`)."""
    ok = torch.ones(rows[0].shape, dtype=torch.bool, device=req.device)
    for plane, q, r in zip(index.gtm.planes, requests.planes, rows):
        table = plane.table[r]                                              # (m, C, W)
        j = torch.arange(q.max_queries, device=req.device)
        for g, (lo, hi) in enumerate(zip(q.word_offsets[:-1], q.word_offsets[1:])):
            ranges = q.ranges[req, g]                                       # (m, 2)
            q_idx = (ranges[:, :1] + j).clamp(max=len(q.rows) - 1)          # (m, Qmax)
            qr = q.rows[q_idx, lo:hi][:, None]                              # (m, 1, Qmax, w)
            tr = table[..., None, lo:hi]                                    # (m, C, 1, w)
            hit = ((tr & qr) == qr).all(dim=-1) & (j < (ranges[:, 1] - ranges[:, 0])[:, None])[:, None, :]
            ok &= hit.any(dim=-1)                                           # ANY query of the group
    return ok


def gtm_mask_reference(index, requests, depth: int, beam_request: torch.Tensor, beam_node: torch.Tensor,
                       beam_score: torch.Tensor, logp: torch.Tensor, mode: Mode, chunk: int = 256) -> torch.Tensor:
    """(M, V) float32 candidate scores: beam_score + logp at the tokens of the node's children that
    pass `mode`, -inf elsewhere (and for NaN scores, and for dead beams whose score is -inf)."""
    M, V = logp.shape
    g = index.gtm
    out = torch.full((M, V + 1), NEG_INF, dtype=torch.float32, device=logp.device)  # column V: a sink
    C = index.max_children[depth]
    j = torch.arange(C, device=logp.device)
    for s in range(0, M, chunk):
        node, score, req = beam_node[s:s + chunk], beam_score[s:s + chunk], beam_request[s:s + chunk]
        lo = g.node_offsets[node]
        ok = (j < (g.node_offsets[node + 1] - lo)[:, None]) & (score > NEG_INF)[:, None]  # (m, C)
        e = torch.where(ok, lo[:, None] + j, 0)
        if mode.gtm:
            ok &= _passes(index, requests, [p.index[e].long() for p in g.planes], req)
        if mode.kway:
            p_lo = g.part_offsets[e]
            n_p = g.part_offsets[e + 1] - p_lo
            any_part = torch.zeros_like(ok)
            for k in range(index.max_parts):
                has = ok & (k < n_p)
                p = torch.where(has, p_lo + k, 0)
                any_part |= has & _passes(index, requests, [pl.part_index[p].long() for pl in g.planes], req)
            ok = any_part
        tok = g.csr_tokens[e].long()
        val = score[:, None] + logp[s:s + chunk].gather(1, tok)
        val = torch.where(ok & ~torch.isnan(val), val, NEG_INF)
        out[s:s + chunk].scatter_(1, torch.where(ok, tok, V), val)
    return out[:, :V]
