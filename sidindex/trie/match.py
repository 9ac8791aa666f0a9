"""The CPU matcher over a GTM index: an obviously-correct reference for the runtime and tests.

For one request at one trie node it returns the child tokens that pass:
  cd      the child exists (catalog validity: the SID prefix is real; after updates, with a live
          ad beneath it, `entry_live`)
  cd+gtm  and the child's subtree-union rows pass every matcher plane (`sidindex.matchers.plane`)
  cd+gtm+kway  and ANY of the child's k-way partitions passes every plane (the union test first).
Unions and partitions are conservative (false positives only), so an eligible prefix always passes.
"""

from __future__ import annotations

import numpy as np

from sidindex.errors import ConfigError
from sidindex.matchers.plane import PlaneQueries, pairs_pass
from sidindex.modes import Mode, parse_mode
from sidindex.request_encoding import EncodedRequests
from sidindex.trie.build import GTMIndex, expand_runs


def passing_tokens(index: GTMIndex, requests: EncodedRequests, request: int, node: int, mode: Mode | str) -> np.ndarray:
    """(k,) int16 tokens of `node`'s children that pass `mode` (a constrained one) for request
    `request` of `requests` (host arrays), ascending."""
    mode = parse_mode(mode, kway_available=index.part_offsets is not None)
    if not mode.constrained:
        raise ConfigError(f"mode {mode.value} does not walk the trie; passing tokens exist for constrained modes only")
    lo, hi = index.node_offsets[node], index.node_offsets[node + 1]
    entries = np.arange(lo, hi, dtype=np.int64)
    if index.entry_live is not None:
        entries = entries[index.entry_live[entries] != 0]
    if not mode.gtm:
        return index.csr_tokens[entries]
    ok = entries_pass(index, requests.planes, entries, np.full(len(entries), request, dtype=np.int64), mode.kway)
    return index.csr_tokens[entries][ok]


def entries_pass(index: GTMIndex, queries: tuple[PlaneQueries, ...], entries: np.ndarray, reqs: np.ndarray,
                 kway: bool, with_bound: bool = False) -> np.ndarray | tuple[np.ndarray, np.ndarray]:
    """(n,) bool: child entry entries[i] passes request reqs[i] (entries, reqs: (n,) int64) on its
    subtree-union rows of every plane and, with `kway`, on ANY of its partitions as well. With
    `with_bound`, also (n,) float32 the value bound of each passing entry (docs/design.md §16): its
    entry_value, or with `kway` the largest part_value of its passing partitions."""
    ok = np.ones(len(entries), dtype=np.bool_)
    for plane, q in zip(index.planes, queries):
        pairs_pass(plane.table, plane.index[entries], reqs, q, ok)
    bound = None
    if with_bound:
        assert index.entry_value is not None  # a bound is asked of an index with values
        bound = index.entry_value[entries]
    if kway:
        assert index.part_offsets is not None  # `kway`: a mode that tests partitions, on an index with them
        # every partition of every surviving entry, grouped by entry (each entry has at least one)
        live = np.flatnonzero(ok)
        first = index.part_offsets[entries[live]]
        count = index.part_offsets[entries[live] + 1] - first
        parts = expand_runs(first, count)
        part_ok = np.ones(len(parts), dtype=np.bool_)
        for plane, q in zip(index.planes, queries):
            assert plane.part_index is not None
            pairs_pass(plane.table, plane.part_index[parts], np.repeat(reqs[live], count), q, part_ok)
        starts = np.cumsum(count) - count
        if len(live):
            ok[live] = np.logical_or.reduceat(part_ok, starts)
            if bound is not None:
                assert index.part_value is not None
                bound[live] = np.maximum.reduceat(np.where(part_ok, index.part_value[parts], 0), starts)
    return (ok, bound) if bound is not None else ok  # (bound: with_bound's)
