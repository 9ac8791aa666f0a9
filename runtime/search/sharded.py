"""One catalog over several devices (docs/design.md §18, docs/scaling.md): each device holds a
contiguous group of a snapshot's shards, and the beam search runs on all of them at once, its
beams merged after every step into exactly the beams of the search on one device.

A beam lives on the device whose shards hold its first token, and its children stay there, so a
device's decoder (its own scorer) extends only its own beams. Step d, on every device: the logits
of its beams, the mask of its shards' trie (the dense layout: beam x token, `Constraint.mask`),
and its own top-k by the search's key (`ops.order.top_k`). The devices' top-k are then merged by
a key every device computes alike: the score's order bits above the candidate's position in the
one-device layout (its beam's rank among all the devices' beams x V + token), so the merged top-k
is the one-device search's, ties included; each device keeps the winners that extend its beams,
in that order. What crosses devices per step is B x k keys (int64) and their device and slot.

Legend: G devices, B requests, K beams a device holds entering a step (padded alike), k beams kept,
V tokens per level, L SID length.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from runtime.index.loader import load_index
from runtime.index.served import ServedIndex
from runtime.ops.distribution import scored_rows
from runtime.ops.impl import Impl
from runtime.ops.order import TIE_LIMIT, ordered, top_k
from runtime.search.beam import (
    DEFAULT_BEAMS,
    NEG_INF,
    Beams,
    Scorer,
    check_value_weight,
    log_probs_of,
    parse_beams,
)
from runtime.search.constraint import Constraint
from sidindex.errors import ConfigError
from sidindex.modes import Mode, parse_mode
from sidindex.request_encoding import EncodedRequests
from sidindex.snapshot import Snapshot


def load_sharded(snap: Snapshot, devices: Sequence[str | torch.device]) -> list[ServedIndex]:
    """The snapshot's shards in len(devices) contiguous groups of about equal SID rows (fewer when
    it has fewer shards), each group's trie loaded onto its device: one index per group, in token
    order. Every device holds the global arrays (the ad table and the exact index)."""
    if not devices:
        raise ConfigError("load onto one device at least")
    rows = np.cumsum([s.sid_rows for s in snap.shards])
    group = np.minimum(len(devices) * (rows - 1) // rows[-1], len(devices) - 1)  # by the shard's last row
    out = []
    for g, device in enumerate(devices):
        mine = tuple(s for s, k in zip(snap.shards, group) if k == g)
        if mine:
            part = dataclasses.replace(snap, shards=mine, beside=None)
            index = load_index(part, device)
            assert isinstance(index, ServedIndex)  # one device: one index
            out.append(index)
    return out


@dataclass(frozen=True)
class ShardedBeams:
    """A search's beams over several devices, one `Beams` per device (k slots each: the device's
    beams first, ranked, then dead ones; `leaf` in that device's index), and rank: per device
    (B, k) int64 each beam's rank among all the devices' beams (k for a dead slot)."""

    beams: tuple[Beams, ...]
    rank: tuple[torch.Tensor, ...]
    # (B, L) bool on the first device: request b had live beams entering step d, on any device, and
    # no device's scorer gave one of them a finite logit (`runtime.search.beam.check_scored` refuses it)
    unscored: torch.Tensor | None = None

    def ranked(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """(tokens (B, k, L) int64, score (B, k) float32, device (B, k) int64, leaf (B, k) int64 in
        that device's index) of every beam in rank order, on the first device's: what the
        one-device search returns (device and leaf -1, score -inf, where fewer beams are alive)."""
        first = self.beams[0].score
        B, k = first.shape
        L = self.beams[0].tokens.shape[2]
        tokens = torch.zeros(B, k + 1, L, dtype=torch.int64, device=first.device)
        score = torch.full((B, k + 1), NEG_INF, dtype=torch.float32, device=first.device)
        device = torch.full((B, k + 1), -1, dtype=torch.int64, device=first.device)
        leaf = device.clone()
        for g, (b, r) in enumerate(zip(self.beams, self.rank)):
            r = r.to(first.device)  # a dead slot's rank is k: the spare column
            tokens.scatter_(1, r[..., None].expand(-1, -1, L), b.tokens.to(first.device))
            score.scatter_(1, r, b.score.to(first.device))
            device.scatter_(1, r, torch.where(r < k, g, -1))
            leaf.scatter_(1, r, b.leaf.to(first.device))
        return tokens[:, :k], score[:, :k], device[:, :k], leaf[:, :k]


@torch.no_grad()
def sharded_beam_search(indexes: Sequence[ServedIndex], requests: Sequence[EncodedRequests],
                        scorers: Sequence[Scorer], beams: tuple[int, ...] | str = DEFAULT_BEAMS,
                        mode: Mode | str = Mode.CD_GTM, impl: Impl | str = Impl.AUTO,
                        value_weight: float = 0.0) -> ShardedBeams:
    """`runtime.beam_search` of one batch over the devices of `indexes` (`load_sharded`: disjoint
    groups of one snapshot's shards, in token order), with each device's encoding of the batch and
    its own scorer: the same beams, scores and order as the search on one device holding every
    shard (module doc). A constrained mode only: a device searches its own shards. Steps at which
    the scorers gave a request's live beams no finite logit are recorded in `ShardedBeams.unscored`
    (no host synchronisation): pass it to `runtime.search.beam.check_scored`."""
    if not indexes or not (len(indexes) == len(requests) == len(scorers)):
        raise ConfigError("give one index, one encoding of the batch and one scorer per device")
    first = indexes[0]
    if any(ix.snapshot.id != first.snapshot.id for ix in indexes):
        raise ConfigError("the indexes of a search over several devices hold shards of one snapshot")
    mode = parse_mode(mode, kway_available=all(ix.kway for ix in indexes))
    if not mode.constrained:
        raise ConfigError("a search over several devices masks each device's own shards: use mode cd, cd+gtm or "
                          "cd+gtm+kway")
    beams = parse_beams(beams, first.sid_length)
    for ix in indexes:
        check_value_weight(ix, mode, value_weight)
    cons = [Constraint(ix, r, mode, impl, compact=False) for ix, r in zip(indexes, requests)]
    B, V, L, home = cons[0].batch, first.vocab_size, first.sid_length, first.device
    # per device: node, score, rank (B, K), tokens (B, K, d), parent (B, K) or None
    state: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]] = []
    for ix in indexes:
        zero = torch.zeros(B, 1, dtype=torch.int64, device=ix.device)
        state.append((zero, torch.zeros(B, 1, device=ix.device), zero, zero[..., None][..., :0], None))
    unscored = []  # per step, (B,) bool on the first device
    for d in range(L):
        K = state[0][0].shape[1]
        k = min(beams[d + 1] if d + 1 < L else beams[-1], K * V)
        local, keys = [], []
        live = scored = torch.zeros(B, dtype=torch.bool, device=home)  # over every device's beams
        for ix, con, scorer, (node, score, rank, tokens, parent) in zip(indexes, cons, scorers, state):
            with _on(ix.device):  # a Triton kernel launches on the current device
                logp = log_probs_of(scorer, d, tokens, parent, ix.level_sizes[d]).reshape(B * K, V)
                mine = score > NEG_INF
                live = live | mine.any(dim=1).to(home)
                scored = scored | (mine & scored_rows(logp).reshape(B, K)).any(dim=1).to(home)
                req = torch.arange(B, device=ix.device).repeat_interleave(K)
                cand = con.mask(d, req, node.reshape(-1), score.reshape(-1), logp, value_weight)
                by = None
                if value_weight > 0:  # ranked by the value-guided key (`ops.gtm_mask.reference.value_key`)
                    cand, by = cand
                cand = cand.reshape(B, K * V)
                by = cand if by is None else by.reshape(B, K * V)
                flat = top_k(by, k)  # this device's k best, in the one order
                position = rank.gather(1, flat // V) * V + flat % V  # in the one-device layout
                key = ordered(by.gather(1, flat)) * TIE_LIMIT + (TIE_LIMIT - 1 - position)
                local.append((flat, cand.gather(1, flat)))
                keys.append(key.to(home))
        # --- the merge: every device's k best, the k best of them ---
        won = torch.cat(keys, dim=1).topk(k, dim=1, sorted=True).indices  # (B, k) device x k + slot
        nxt: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]] = []
        for g, (ix, con, (flat, cand), (node, _, _, tokens, _)) in enumerate(zip(indexes, cons, local, state)):
            mine = (won // k == g).to(ix.device)
            order = torch.argsort((~mine).to(torch.int8), dim=1, stable=True)  # its winners first, by rank
            slot = (won.to(ix.device) % k).gather(1, order)
            kept = mine.gather(1, order)
            chosen = flat.gather(1, slot)
            new_score = torch.where(kept, cand.gather(1, slot), NEG_INF)
            alive = new_score > NEG_INF
            parent, tok = chosen // V, torch.where(alive, chosen % V, 0)
            tokens = torch.cat([tokens.gather(1, parent[..., None].expand(-1, -1, d)), tok[..., None]], dim=2)
            node = con.child(node.gather(1, parent), tok, alive)
            nxt.append((node, new_score, torch.where(alive, order, k), tokens, parent))
        state = nxt
        unscored.append(live & ~scored)
    out, ranks = [], []
    for ix, (node, score, rank, tokens, _) in zip(indexes, state):
        alive = score > NEG_INF
        leaf = torch.where(alive & (node >= 0), node - ix.leaf_start, -1)
        out.append(Beams(torch.where(alive[..., None], tokens, 0), score, leaf))
        ranks.append(torch.where(alive, rank, rank.shape[1]))
    return ShardedBeams(tuple(out), tuple(ranks), torch.stack(unscored, dim=1))


def _on(device: torch.device):
    """A context making `device` the current CUDA device (where Triton launches), else nothing."""
    return torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()
