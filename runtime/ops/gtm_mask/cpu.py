"""The CD+GTM mask on the CPU: the numba matcher of `sidindex.trie.match` run over every beam, for
hosts without a GPU. Same contract and result as the torch reference and the Triton kernel."""

from __future__ import annotations

import numba
import numpy as np
import torch

from sidindex.modes import Mode
from sidindex.trie.match import _pass_entries


def gtm_mask_cpu(index, requests, depth: int, beam_request: torch.Tensor, beam_node: torch.Tensor,
                 beam_score: torch.Tensor, logp: torch.Tensor, mode: Mode) -> torch.Tensor:
    """Same contract as `gtm_mask_reference`; CPU tensors."""
    M, V = logp.shape
    g = index.gtm
    out = torch.full((M, V), float("-inf"), dtype=torch.float32)
    empty = np.zeros(0, dtype=np.int64)
    parts = [t.numpy() for t in (g.part_offsets, g.part_bitmask_index, g.part_bloom_index)] if mode.kway \
        else [empty] * 3
    _mask(out.numpy(), logp.float().contiguous().numpy(), beam_score.numpy(), beam_node.numpy(), beam_request.numpy(),
          g.node_offsets.numpy(), g.csr_tokens.numpy(), g.bitmask_index.numpy(), g.bloom_index.numpy(),
          g.bitmask_table.numpy(), g.bloom_table.numpy(), requests.word_offsets.numpy(), requests.user_rows.numpy(),
          requests.query_rows.numpy(), requests.query_ranges.numpy(), mode.gtm, mode.kway, *parts)
    return out


@numba.njit(cache=True)
def _mask(out, logp, score, node, req, node_offsets, tokens, bm_index, bl_index, bm_table, bl_table, woff, user_rows,
          q_rows, q_ranges, gtm, kway, part_offsets, part_bm, part_bl):
    for m in range(len(node)):
        if not score[m] > -np.inf:  # a dead beam has no children
            continue
        lo, hi = node_offsets[node[m]], node_offsets[node[m] + 1]
        if gtm:
            ok = _pass_entries(lo, hi, bm_index, bl_index, bm_table, bl_table, woff, user_rows[req[m]], q_rows,
                               q_ranges[req[m]], kway, part_offsets, part_bm, part_bl)
        else:
            ok = np.ones(hi - lo, dtype=np.bool_)
        for i in range(hi - lo):
            if ok[i]:
                t = tokens[lo + i]
                v = score[m] + logp[m, t]
                out[m, t] = v if v == v else -np.inf  # NaN never passes
