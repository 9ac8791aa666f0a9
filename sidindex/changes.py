"""Change files for updates between full builds (docs/design.md §15, contract `schemas.CHANGES`).

`read_changes` validates a whole file before anything is applied, then folds its rows, in file
order, into their net effect on the snapshot they apply to:
  - an ad's last `upsert` or `delete` decides its data: the snapshot's row leaves (`removed`) and,
    after an upsert, the data of that last upsert joins (`added`);
  - its last `pause` or `resume` after that decides its state. An upsert keeps an ad's state (a
    paused ad edited stays paused); a delete resets it (an ad upserted after its delete is new).
`delete`, `pause` and `resume` need an ad that exists at that point of the file: live or paused in
the snapshot and not deleted since, or upserted earlier in the file. Vectorised with polars window
expressions over (ad_id, file order); no loop over rows.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import polars as pl

from schemas import CHANGE_OPS
from schemas.artifacts import AD_DELETED, AD_PAUSED
from sidindex.errors import InputError
from sidindex.ingest import Catalog, catalog_rows, int64_column, read_table
from sidindex.targeting import TargetingSpec


@dataclass(frozen=True)
class Changes:
    """The net effect of a change file on a snapshot.

    counts:  rows of the file per op (CHANGE_OPS)
    removed: (k,) int64 ids of the snapshot's ads whose row leaves (deleted, or upserted anew)
    added:   the data of each ad upserted, once per ad (its last upsert), in order of that row
    added_paused: (u,) bool each added ad starts paused
    paused, resumed: (p,), (r,) int64 ids of the snapshot's ads, kept, that end paused / live
    named:   (m,) int64 ascending, the rows of the index read against whose ids the file names
             (`named_rows`), or None when not known
    """

    path: str
    counts: dict[str, int]
    removed: np.ndarray
    added: Catalog | None
    added_paused: np.ndarray
    paused: np.ndarray
    resumed: np.ndarray
    named: np.ndarray | None = None

    @classmethod
    def pausing(cls, ids: np.ndarray, path: str) -> Changes:
        """Pausing the ads `ids` (n,) int64 and nothing else (a full build keeping paused ads paused)."""
        none = np.zeros(0, dtype=np.int64)
        return cls(path, dict.fromkeys(CHANGE_OPS, 0) | {"pause": len(ids)}, none, None, np.zeros(0, dtype=bool),
                   np.asarray(ids, dtype=np.int64), none)

    @property
    def empty(self) -> bool:
        return not any(self.counts.values())


def named_rows(ad_id: np.ndarray, ids: np.ndarray) -> np.ndarray:
    """(m,) int64 ascending: the rows of ad_id (N,) int64 holding one of ids (k,) int64. The few
    ids are hashed and the millions of rows probed once, not the other way round."""
    return np.flatnonzero(pl.Series(ad_id).is_in(pl.Series(ids).implode()).to_numpy())


def read_changes(path: str, spec: TargetingSpec, *, hash_keys: tuple[str, ...], dim: int, values: bool,
                 ad_id: np.ndarray, state: np.ndarray, replay: bool = False) -> Changes:
    """Read and validate a change file against a snapshot.

    hash_keys, dim: the codebook's (upsert rows are validated as catalog rows with them)
    values: the snapshot carries ad values (upsert rows then need a `value`; without, none may)
    ad_id, state: (N,) int64 the snapshot's ad ids and (N,) uint8 their rows' states
    replay: the file was applied once already and is applied again over a newer catalog export (a
            full build's, `sidindex.job`): a delete, pause or resume naming an ad the export no
            longer holds is dropped (the catalog removed the ad itself), not refused
    """
    df = read_table(path, "change file")
    for name in ("ad_id", "op"):
        if name not in df.columns:
            raise InputError(f"{path}: missing column {name!r} (a change file has ad_id, op and the catalog's columns)")
    if df.height == 0:  # nothing changed: nothing to publish
        none = np.zeros(0, dtype=np.int64)
        return Changes(path, dict.fromkeys(CHANGE_OPS, 0), none, None, np.zeros(0, dtype=bool), none, none)
    ids = int64_column(df, path, "ad_id")
    if not isinstance(df.get_column("op").dtype, (pl.String, pl.Categorical, pl.Enum, pl.Null)):
        raise InputError(f"{path}: column 'op' has type {df.get_column('op').dtype}, expected string")
    if not values and "value" in df.columns:
        raise InputError(f"{path}: has a 'value' column, but the snapshot carries no ad values; drop the column, or "
                         "build the snapshot from a catalog with values")
    ops = df.get_column("op").cast(pl.String)
    bad = ops.is_null() | ~ops.is_in(list(CHANGE_OPS))
    if bad.any():
        row = int(bad.arg_true()[0])
        raise InputError(f"{path}: column 'op', row {row}: value {ops[row]!r} is not an op (expected one of "
                         f"{', '.join(CHANGE_OPS)})")
    counts = {op: int((ops == op).sum()) for op in CHANGE_OPS}
    upserts = np.flatnonzero((ops == "upsert").to_numpy())
    added = None
    if len(upserts):  # every upsert row, superseded or not, is a catalog row
        if values and "value" not in df.columns:
            raise InputError(f"{path}: missing column 'value' (the snapshot carries ad values, so every upsert "
                             "needs one)")
        added = catalog_rows(df[upserts], path, spec=spec, hash_keys=hash_keys, dim=dim, rows=upserts, unique=False)

    # 1. per row: the last upsert/delete before it (within its ad, in file order), so whether its ad
    # exists there; delete, pause and resume need one that does
    rows = pl.DataFrame({"ad_id": ids, "op": ops, "pos": np.arange(df.height, dtype=np.int64)})
    data_op = pl.when(pl.col("op").is_in(["upsert", "delete"])).then(pl.col("op"))
    named = named_rows(ad_id, ids)
    named_id, named_state = ad_id[named], state[named]
    known, paused = named_id[named_state != AD_DELETED], named_id[named_state == AD_PAUSED]
    rows = rows.with_columns(before=data_op.shift(1).forward_fill().over("ad_id"),
                             in_base=pl.col("ad_id").is_in(pl.Series(known).implode()))
    exists = (pl.col("before") == "upsert").fill_null(False) | (pl.col("before").is_null() & pl.col("in_base"))
    needs_ad = pl.col("op").is_in(["delete", "pause", "resume"]) & ~exists
    if replay:
        rows = rows.filter(~needs_ad)
    orphan = rows.filter(needs_ad)
    if orphan.height:
        first = orphan.row(0, named=True)
        raise InputError(f"{path}: column 'ad_id', row {first['pos']}: {first['op']} names ad {first['ad_id']}, which "
                         "is not in the snapshot (or was deleted earlier in the file)")

    # 2. per ad: its last upsert/delete, and its last pause/resume after its last delete
    last_delete = pl.col("pos").filter(pl.col("op") == "delete").max().over("ad_id")
    rows = rows.with_columns(after_delete=last_delete.is_null() | (pl.col("pos") > last_delete))
    per_ad = rows.group_by("ad_id", maintain_order=True).agg(
        data=data_op.drop_nulls().last(),
        upsert_pos=pl.col("pos").filter(pl.col("op") == "upsert").last(),
        deleted=(pl.col("op") == "delete").any(),
        state=pl.col("op").filter(pl.col("op").is_in(["pause", "resume"]) & pl.col("after_delete")).last(),
        in_base=pl.col("in_base").first(),
    )
    base_paused = pl.col("ad_id").is_in(pl.Series(paused).implode())
    # an ad ends paused by its last pause/resume, else as it was unless a delete reset it
    ends_paused = (pl.when(pl.col("state").is_not_null()).then(pl.col("state") == "pause")
                   .otherwise(~pl.col("deleted") & base_paused))
    per_ad = per_ad.with_columns(ends_paused=ends_paused)
    up = per_ad.filter(pl.col("data") == "upsert").sort("upsert_pos")
    kept = per_ad.filter(pl.col("data").is_null())
    changed = kept.filter(pl.col("state").is_not_null())
    if up.height == 0:  # every ad upserted was deleted again later in the file
        added = None
    if added is not None:
        at = np.searchsorted(upserts, up.get_column("upsert_pos").to_numpy())
        added = Catalog(added.path, added.ad_id[at], added.embedding[at], added.columns[at],
                        None if added.value is None else added.value[at])

    def as_ids(frame: pl.DataFrame) -> np.ndarray:
        return frame.get_column("ad_id").to_numpy().astype(np.int64)

    return Changes(
        path=path, counts=counts,
        removed=as_ids(per_ad.filter(pl.col("data").is_not_null() & pl.col("in_base"))),
        added=added, added_paused=up.get_column("ends_paused").to_numpy().astype(bool),
        paused=as_ids(changed.filter(pl.col("ends_paused"))), resumed=as_ids(changed.filter(~pl.col("ends_paused"))),
        named=named)

