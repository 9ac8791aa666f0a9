"""Apply a change file's net effect to an index: an opened snapshot, a full build's result, or an
earlier update's (docs/design.md §15).

    pause / resume / delete   the rows' `ad_state` only; the trie and matchers stay as they are
    upsert                    the ad's old row (if any) is deleted; its new data becomes a new row
                              at the end of the ad table, its SIDs assigned with the frozen
                              codebook and inserted into the shards their first tokens fall in
                              (`sidindex.trie.patch`), its rows appended to the exact index

Rows are never renumbered, so every array an update leaves alone is the base snapshot's own (the
same object; a shard no new SID falls in keeps its trie), and the writer links its file instead of
writing it again. A deleted row stays in the
ad table and under its SIDs, never served, until the next full build drops it.
"""

from __future__ import annotations

import dataclasses
from typing import Protocol

import numpy as np
import polars as pl

from schemas.artifacts import AD_DELETED, AD_LIVE, AD_PAUSED
from sidindex.build import BuiltIndex, encode_ads
from sidindex.changes import Changes, named_rows
from sidindex.errors import InputError
from sidindex.exact import ExactIndex, concat_exact
from sidindex.sid import Codebook, assign_sids, hash_tokens
from sidindex.timing import StageClock
from sidindex.trie.patch import insert_sids, liveness
from sidindex.trie.shard import Shard

_UNNAMED = 255  # no row state: an id the change file does not name


class Indexed(Protocol):
    """What changes apply to: `sidindex.snapshot.Snapshot`, or a build's or an update's `BuiltIndex`
    (read-only, as both are frozen), with its ad ids (`build_index`'s own result has none)."""

    @property
    def exact(self) -> ExactIndex: ...

    @property
    def ad_id(self) -> np.ndarray | None: ...

    @property
    def shards(self) -> tuple[Shard, ...]: ...


def _ad_ids(index: Indexed) -> np.ndarray:
    """The index's (N,) int64 ad ids."""
    if index.ad_id is None:
        raise ValueError("changes apply to an index with its ad ids; build_index's result needs the catalog's")
    return index.ad_id


def ad_rows(index: Indexed) -> tuple[np.ndarray, np.ndarray]:
    """The index's (N,) int64 ad ids and (N,) uint8 their rows' states (what a change file is
    read against: `sidindex.changes.read_changes`)."""
    ad_id = _ad_ids(index)
    return ad_id, index.exact.states(len(ad_id))


def apply_changes(snap: Indexed, changes: Changes, codebook: Codebook) -> BuiltIndex:
    """The index's arrays with `changes` applied (read by `sidindex.changes.read_changes` against
    this index): `exact` with its ad_state set, `ad_id` (N',) int64, and what the update's lineage
    counts of them."""
    clock = StageClock()
    ad_id = _ad_ids(snap)
    state = snap.exact.states(len(ad_id)).copy()
    # each id named (removed, paused, resumed: disjoint) mapped to its new state, probing the rows the
    # file names (found as it was read); rows an id may name: its only one that is not deleted
    named = (changes.removed, changes.paused, changes.resumed)
    ids = np.concatenate(named)
    rows = changes.named if changes.named is not None else named_rows(ad_id, ids)
    new = pl.Series(ad_id[rows]).replace_strict(
        ids, np.repeat(np.array([AD_DELETED, AD_PAUSED, AD_LIVE], dtype=np.uint8), [len(x) for x in named]),
        default=_UNNAMED, return_dtype=pl.UInt8).to_numpy()
    hit = (new != _UNNAMED) & (state[rows] != AD_DELETED)
    state[rows[hit]] = new[hit]
    clock.lap("ad states")
    shards, exact, sid_rows = snap.shards, snap.exact, 0
    values = shards[0].gtm.ad_value
    added = changes.added
    if added is not None:
        if (added.value is None) != (values is None):
            raise InputError(f"{changes.path}: upserts {'lack' if added.value is None else 'carry'} ad values and "
                             f"the snapshot {'does' if added.value is None else 'does not'}")
        tokens = hash_tokens(added.columns, codebook.hash_keys, codebook.hash_size)
        sids = assign_sids(codebook, added.embedding, tokens)
        clock.lap("assign SIDs")
        ad_rows, new_exact = encode_ads(snap.exact.spec, added.columns)
        clock.lap("encode")
        n = len(ad_id)
        shards = _insert(shards, sids.sids, sids.ad_index + n, n, ad_rows, added.value)
        clock.lap("insert SIDs")
        exact = concat_exact([exact, new_exact])
        ad_id = np.concatenate([ad_id, added.ad_id])
        state = np.concatenate([state, np.where(changes.added_paused, AD_PAUSED, AD_LIVE).astype(np.uint8)])
        sid_rows = len(sids.sids)
        clock.lap("exact index")
    exact = ExactIndex(exact.spec, exact.planes, state)
    out, stale, dead_sids = [], 0, 0
    for shard in shards:
        g = shard.gtm
        live, s, d = liveness(g, state)
        if g.entry_live is not None and np.array_equal(live, g.entry_live):
            live = g.entry_live  # unchanged: the base's file and device tensor serve on
        out.append(dataclasses.replace(shard, gtm=dataclasses.replace(g, entry_live=live)))
        stale, dead_sids = stale + s, dead_sids + d
    clock.lap("stale entries")
    return BuiltIndex(tuple(out), exact, clock.seconds, ad_id=ad_id, new_sid_rows=sid_rows, stale_entries=stale,
                      dead_sids=dead_sids)


def _insert(shards: tuple[Shard, ...], sids: np.ndarray, ad_index: np.ndarray, first_new: int,
            ad_rows: dict[str, np.ndarray], ad_value: np.ndarray | None) -> tuple[Shard, ...]:
    """The shards with SID rows sids (Q, L) int16 of ads ad_index (Q,) int64 inserted, each row into
    the shard its first token falls in; a shard none falls in keeps its own arrays (the same
    objects). ad_rows, ad_value: the new ads' (`insert_sids`), new ad u being catalog row
    first_new + u."""
    lo = np.array([s.lo for s in shards])
    which = np.searchsorted(lo, sids[:, 0], side="right") - 1
    values = None if ad_value is None else np.concatenate([shards[0].gtm.ad_value, ad_value])
    out = []
    for k, shard in enumerate(shards):
        rows = np.flatnonzero(which == k)
        if len(rows) == 0:  # its own arrays stay the base's; the catalog's values grew
            out.append(dataclasses.replace(shard, gtm=dataclasses.replace(shard.gtm, ad_value=values)))
            continue
        first = int(ad_index[rows].min())  # insert_sids numbers the new ads from its first row's
        rows_k = {p: r[first - first_new:] for p, r in ad_rows.items()}
        value_k = None if ad_value is None else ad_value[first - first_new:]
        g = insert_sids(shard.gtm, sids[rows], ad_index[rows], rows_k, value_k)
        out.append(dataclasses.replace(shard, gtm=dataclasses.replace(g, ad_value=values)))
    return tuple(out)
