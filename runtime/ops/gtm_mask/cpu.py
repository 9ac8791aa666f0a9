"""The CD+GTM mask on the CPU: the numba matcher of `sidindex.trie.match` run over every beam, for
hosts without a GPU. Same contract and result as the torch reference and the Triton kernel."""

from __future__ import annotations

import numba
import numpy as np
import torch

from sidindex.trie.match import _pass_entries

MODES = {"cd": 0, "cd+gtm": 1, "cd+gtm+kway": 2}


def gtm_mask_cpu(index, requests, depth: int, beam_request: torch.Tensor, beam_node: torch.Tensor,
                 beam_score: torch.Tensor, logp: torch.Tensor, mode: str) -> torch.Tensor:
    """Same contract as `gtm_mask_reference`; CPU tensors."""
    M, V = logp.shape
    out = torch.full((M, V), float("-inf"), dtype=torch.float32)
    kway = mode == "cd+gtm+kway"
    empty = np.zeros(0, dtype=np.int64)
    parts = [t.numpy() for t in (index.part_offsets, index.part_bitmask_index, index.part_bloom_index)] if kway \
        else [empty] * 3
    _mask(out.numpy(), logp.float().contiguous().numpy(), beam_score.numpy(), beam_node.numpy(), beam_request.numpy(),
          index.node_offsets.numpy(), index.csr_tokens.numpy(), index.bitmask_index.numpy(), index.bloom_index.numpy(),
          index.bitmask_table.numpy(), index.bloom_table.numpy(), np.asarray(index.bloom_words, dtype=np.int64),
          requests.user_rows.numpy(), requests.query_rows.numpy(), requests.query_ranges.numpy(), MODES[mode], *parts)
    return out


@numba.njit(cache=True)
def _mask(out, logp, score, node, req, node_offsets, tokens, bm_index, bl_index, bm_table, bl_table, woff, user_rows,
          q_rows, q_ranges, mode, part_offsets, part_bm, part_bl):
    for m in range(len(node)):
        if not score[m] > -np.inf:  # a dead beam has no children
            continue
        lo, hi = node_offsets[node[m]], node_offsets[node[m] + 1]
        if mode == 0:
            ok = np.ones(hi - lo, dtype=np.bool_)
        else:
            ok = _pass_entries(lo, hi, bm_index, bl_index, bm_table, bl_table, woff, user_rows[req[m]], q_rows,
                               q_ranges[req[m]], mode == 2, part_offsets, part_bm, part_bl)
        for i in range(hi - lo):
            if ok[i]:
                t = tokens[lo + i]
                v = score[m] + logp[m, t]
                out[m, t] = v if v == v else -np.inf  # NaN never passes
