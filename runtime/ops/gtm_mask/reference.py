"""Plain torch reference of the CD+GTM mask: gathers every child entry of every beam into dense
(M, C) tensors and tests them with whole-tensor ops. Obviously correct, memory-hungry (a word group
materialises (beams, children, queries, words)), so it runs over chunks of beams. It is what the
Triton kernel is tested and benchmarked against."""

from __future__ import annotations

import torch

from sidindex.modes import Mode

NEG_INF = float("-inf")
VALUE_FLOOR = 1e-6  # bounds below it count as it: a prefix whose ads are worth 0 keeps a finite key


def value_key(score: torch.Tensor, bound: torch.Tensor, weight: float) -> torch.Tensor:
    """The value-guided search's ranking key score + weight * log(max(bound, VALUE_FLOOR)) (docs/design.md
    §16); score -inf stays -inf. score, bound: (M, V) float32."""
    return score + weight * bound.clamp(min=VALUE_FLOOR).log()


def plane_pass(rows: torch.Tensor, q, ranges: torch.Tensor, n_queries: int) -> torch.Tensor:
    """(m, C) bool: rows (m, C, W) int64 of one plane pass their requests' queries `q`
    (`PlaneQueries`): on every word group ANY query has (row & query) == query. ranges: (m, G, 2)
    int64 each row's request's query ranges; n_queries: at least the most queries one request has
    for one group (a static shape)."""
    j = torch.arange(n_queries, device=rows.device)
    ok = torch.ones(rows.shape[:2], dtype=torch.bool, device=rows.device)
    for g, (lo, hi) in enumerate(zip(q.word_offsets[:-1].tolist(), q.word_offsets[1:].tolist())):
        start, end = ranges[:, g, 0:1], ranges[:, g, 1:2]                      # (m, 1)
        qr = q.rows[(start + j).clamp(max=len(q.rows) - 1), lo:hi][:, None]     # (m, 1, Q, w)
        hit = ((rows[:, :, None, lo:hi] & qr) == qr).all(-1) & (start + j < end)[:, None, :]
        ok &= hit.any(-1)                                                      # ANY query of the group
    return ok


def _passes(index, requests, rows: list[torch.Tensor], req: torch.Tensor) -> torch.Tensor:
    """(m, C) bool: the matcher rows `rows` (per plane (m, C) int64) pass each beam's request
    `req` (m,) on every word group of every plane (`sidindex.matchers.plane`)."""
    ok = torch.ones(rows[0].shape, dtype=torch.bool, device=req.device)
    for plane, q, r in zip(index.gtm.planes, requests.planes, rows):
        ok &= plane_pass(plane.table[r], q, q.ranges[req], q.max_queries)
    return ok


def gtm_mask_reference(index, requests, depth: int, beam_request: torch.Tensor, beam_node: torch.Tensor,
                       beam_score: torch.Tensor, logp: torch.Tensor, mode: Mode, with_bound: bool = False,
                       chunk: int = 256):
    """(M, V) float32 candidate scores: beam_score + logp at the tokens of the node's children that
    pass `mode`, -inf elsewhere (and for NaN scores, and for dead beams whose score is -inf). With
    `with_bound`, also (M, V) float32 the candidates' value bounds: entry_value, or in k-way mode
    the largest part_value of the passing partitions; 0 elsewhere."""
    M, V = logp.shape
    g = index.gtm
    out = torch.full((M, V + 1), NEG_INF, dtype=torch.float32, device=logp.device)  # column V: a sink
    bound = torch.zeros((M, V + 1), dtype=torch.float32, device=logp.device) if with_bound else None
    C = index.max_children[depth]
    j = torch.arange(C, device=logp.device)
    for s in range(0, M, chunk):
        node, score, req = beam_node[s:s + chunk], beam_score[s:s + chunk], beam_request[s:s + chunk]
        lo = g.node_offsets[node]
        ok = (j < (g.node_offsets[node + 1] - lo)[:, None]) & (score > NEG_INF)[:, None]  # (m, C)
        e = torch.where(ok, lo[:, None] + j, 0)
        if g.entry_live is not None:  # an update's index: no entry without a live row beneath
            ok &= g.entry_live[e] != 0
        if mode.gtm:
            ok &= _passes(index, requests, [p.index[e].long() for p in g.planes], req)
        best = g.entry_value[e] if with_bound else None
        if mode.kway:
            p_lo = g.part_offsets[e]
            n_p = g.part_offsets[e + 1] - p_lo
            any_part = torch.zeros_like(ok)
            best = None if best is None else torch.zeros_like(best)
            for k in range(index.max_parts):
                has = ok & (k < n_p)
                p = torch.where(has, p_lo + k, 0)
                hit = has & _passes(index, requests, [pl.part_index[p].long() for pl in g.planes], req)
                any_part |= hit
                if best is not None:
                    best = torch.where(hit, torch.maximum(best, g.part_value[p]), best)
            ok = any_part
        tok = g.csr_tokens[e].long()
        val = score[:, None] + logp[s:s + chunk].gather(1, tok)
        val = torch.where(ok & ~torch.isnan(val), val, NEG_INF)
        col = torch.where(ok, tok, V)
        out[s:s + chunk].scatter_(1, col, val)
        if bound is not None and best is not None:  # both with_bound's
            bound[s:s + chunk].scatter_(1, col, torch.where(ok, best, 0.0))
    return (out[:, :V], bound[:, :V]) if bound is not None else out[:, :V]


def shared_pass_reference(index, requests, shared) -> torch.Tensor:
    """(B, R) bool: row i of the shared rows' set (`shared_rows.SharedRows`, row i of plane
    plane[i]) passes request b on every word group of its plane (`plane_pass`). What
    `prepare.shared_pass` is tested against."""
    B = requests.batch
    out = torch.zeros((B, shared.size), dtype=torch.bool, device=shared.rows.device)
    for p, (plane, q) in enumerate(zip(index.gtm.planes, requests.planes)):
        mine = (shared.plane == p).nonzero().flatten()
        table = plane.table[shared.rows[mine].long()][None].expand(B, -1, -1)  # (B, R_p, W_p)
        out[:, mine] = plane_pass(table, q, q.ranges, q.max_queries)
    return out
