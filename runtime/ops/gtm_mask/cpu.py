"""The CD+GTM mask on the CPU: the matcher of `sidindex.trie.match` over every beam's child
entries at once, for hosts without a GPU. Same contract and result as the torch reference and the
Triton kernel."""

from __future__ import annotations

import dataclasses

import numpy as np
import torch

from sidindex.modes import Mode
from sidindex.trie.build import expand_runs
from sidindex.trie.match import entries_pass


def gtm_mask_cpu(index, requests, depth: int, beam_request: torch.Tensor, beam_node: torch.Tensor,
                 beam_score: torch.Tensor, logp: torch.Tensor, mode: Mode, with_bound: bool = False):
    """Same contract as `gtm_mask_reference`; CPU tensors."""
    M, V = logp.shape
    g = index.snapshot.gtm  # the host index: the same arrays as index.gtm's, as numpy
    score, node, req = beam_score.numpy(), beam_node.numpy(), beam_request.numpy()
    # 1. every child entry of every live beam
    beam = np.flatnonzero(score > -np.inf)  # a dead beam has no children
    first = g.node_offsets[node[beam]]
    count = g.node_offsets[node[beam] + 1] - first
    beam = np.repeat(beam, count)
    entries = expand_runs(first, count)
    if g.entry_live is not None:  # an update's index: no entry without a live row beneath
        live = g.entry_live[entries] != 0
        beam, entries = beam[live], entries[live]
    # 2. the matchers, and the survivors' value bounds
    if mode.gtm:
        queries = tuple(dataclasses.replace(q, rows=q.rows.numpy().view(np.uint64), ranges=q.ranges.numpy())
                        for q in requests.planes)
        ok = entries_pass(g, queries, entries, req[beam], mode.kway, with_bound)
        if with_bound:
            ok, best = ok
            best = best[ok]
        beam, entries = beam[ok], entries[ok]
    elif with_bound:  # cd: every child entry, its union's bound
        best = g.entry_value[entries]
    # 3. survivors score beam_score + logp at their token; NaN never passes
    tok = g.csr_tokens[entries].astype(np.int64)
    lp = logp.float().numpy()
    val = score[beam] + lp[beam, tok]
    out = torch.full((M, V), float("-inf"), dtype=torch.float32)
    out.numpy()[beam, tok] = np.where(np.isnan(val), -np.inf, val)
    if not with_bound:
        return out
    bound = torch.zeros((M, V), dtype=torch.float32)
    bound.numpy()[beam, tok] = best
    return out, bound
