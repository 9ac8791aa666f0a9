"""The build as stages over a catalog's fragments, on Arrow tables (docs/design.md §14).

`sidindex build --engine ray` runs them as Ray tasks (`sidindex.ray_build`); any engine that can
map a function over Arrow batches and group rows by a key can run them the same way:

  1. prepare_fragment   validate a fragment, give each ad its SIDs, encode matcher rows and exact index
  2. first_tokens       per-token counts, whose sum the driver turns into shard and part bounds
  3. split_sid_rows     one table per part (the shuffle's map side)
  4. build_part         one part's subtrie; a shard's parts combined are the shard
  5. global_arrays      the snapshot's global arrays (ad ids, values, exact index), a piece per fragment

A stage raises `InputError` naming the file row, as the local engine does; `InputError.rank`
orders two errors as a validation of the whole file would meet them. The tables' columns, and the
stages on Spark or Dask: docs/scaling.md ("Other engines").
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator

import numpy as np
import polars as pl
import pyarrow as pa

from sidindex.build import encode_ads
from sidindex.exact import ArrayPieces, exact_columns, exact_pieces
from sidindex.ingest import catalog_rows
from sidindex.sid import Codebook, assign_sids, hash_tokens
from sidindex.sid.quality import QualitySums, quality_sums
from sidindex.targeting import TargetingSpec
from sidindex.trie.kway import KWayConfig
from sidindex.trie.partition import Subtrie, ad_runs, build_subtrie, part_rows

QUALITY_KEY = b"sidindex.quality"


def prepare_fragment(table: pa.Table, first_row: int, path: str, spec: TargetingSpec, codebook: Codebook
                     ) -> tuple[pa.Table, pa.Table]:
    """Stage 1 (module docstring): (ads, sid_rows) of a fragment's catalog rows."""
    df = pl.from_arrow(table)
    assert isinstance(df, pl.DataFrame)  # from a table
    cat = catalog_rows(df, path, spec=spec, hash_keys=codebook.hash_keys, dim=codebook.dim,
                       rows=np.arange(first_row, first_row + df.height), unique=False)
    a = assign_sids(codebook, cat.embedding, hash_tokens(cat.columns, codebook.hash_keys, codebook.hash_size))
    ad_rows, exact = encode_ads(spec, cat.columns)
    sums = quality_sums(a, codebook, cat.embedding)
    value = {} if cat.value is None else {"value": cat.value}
    ads = pa.table({"ad_id": cat.ad_id, **value, **exact_columns(exact)},
                   metadata={QUALITY_KEY: json.dumps(sums.to_dict())})
    sid_rows = {"sid": _fixed(a.sids), "ad": a.ad_index + first_row}
    sid_rows |= {name: _fixed(rows[a.ad_index]) for name, rows in ad_rows.items()}
    if cat.value is not None:
        sid_rows["value"] = cat.value[a.ad_index]
    return ads, pa.table(sid_rows)


def first_tokens(sid_rows: pa.Table, vocab: int) -> np.ndarray:
    """Stage 2: (vocab,) int64 SID rows per first-level token."""
    return np.bincount(_matrix(sid_rows.column("sid"))[:, 0], minlength=vocab)


def split_sid_rows(sid_rows: pa.Table, bounds: np.ndarray) -> list[pa.Table]:
    """Stage 3: the rows whose first token lies in [bounds[q], bounds[q+1]), for each part q, in
    their (ad, path) order."""
    order, cuts = part_rows(_matrix(sid_rows.column("sid"))[:, 0], bounds)
    ordered = sid_rows.take(order)
    return [ordered.slice(lo, hi - lo) for lo, hi in zip(cuts[:-1], cuts[1:])]


def build_part(tables: list[pa.Table], level_sizes: tuple[int, ...], planes: tuple[str, ...], *,
               kway: KWayConfig | None, matcher_bits: int) -> Subtrie:
    """Stage 4: the subtrie of one part's SID rows, given as each fragment's table in fragment order."""
    t = pa.concat_tables(tables)
    ad = t.column("ad").to_numpy()
    first, local = ad_runs(ad)  # each ad's rows carry its words and value: take them from its first
    rows = {p: _matrix(t.column(p))[first] for p in planes}
    value = t.column("value").to_numpy()[first] if "value" in t.column_names else None
    return build_subtrie(_matrix(t.column("sid")), local, ad[first], rows, level_sizes, kway=kway,
                         matcher_bits=matcher_bits, ad_value=value)


def fragment_sums(ads: pa.Table) -> QualitySums:
    """The quality sums of a fragment's ads table (stage 1's)."""
    return QualitySums.from_dict(json.loads(ads.schema.metadata[QUALITY_KEY]))


def global_arrays(ads: list[pa.Table], spec: TargetingSpec) -> dict[str, ArrayPieces]:
    """Stage 5's ad side: the snapshot's global arrays (ad ids, values when the catalog has them, the
    exact index) of the fragments' ads tables, in fragment order, each in pieces of one fragment's
    rows: what one writer streams into the snapshot holding a fragment at a time."""
    n = sum(t.num_rows for t in ads)

    def column(name: str) -> Callable[[], Iterator[np.ndarray]]:
        return lambda: (t.column(name).to_numpy() for t in ads)

    value = {"ad_value": ArrayPieces((n,), column("value"))} if "value" in ads[0].column_names else {}
    return exact_pieces(spec, ads) | {"ads": ArrayPieces((n,), column("ad_id"))} | value


def _fixed(a: np.ndarray) -> pa.FixedSizeListArray:
    """(n, w) array -> fixed_size_list<w> column (no copy)."""
    return pa.FixedSizeListArray.from_arrays(pa.array(np.ascontiguousarray(a).reshape(-1)), a.shape[1])


def _matrix(col: pa.ChunkedArray | pa.FixedSizeListArray) -> np.ndarray:
    """fixed_size_list<w> column -> (n, w) array."""
    arr = col.combine_chunks() if isinstance(col, pa.ChunkedArray) else col
    if arr.offset:  # a slice: flatten() honours it, .values would not
        return arr.flatten().to_numpy().reshape(len(arr), arr.type.list_size)
    return arr.values.to_numpy()[:len(arr) * arr.type.list_size].reshape(len(arr), arr.type.list_size)
