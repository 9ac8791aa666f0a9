"""Requests: a batch validated against a targeting spec (`Requests`); its encoding is
`sidindex.request_encoding`.

Requests arrive in memory (an RPC's Arrow record batch, a polars frame, dicts) or in a file;
`requests_from` takes any of them, and `read_requests` reads a file and calls it. Validation
works on the Arrow columns as they are: a few vectorised checks decide that a batch is good (its
names and types are checked once per schema: a serving host's batches share one), and only a
batch that fails them is handed to the catalog's column validator (`sidindex.ingest`),
which names the column, the row and the value, so a request in memory and one in a file are
refused with the same words.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, NoReturn

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from schemas import INT64_MAX, INT64_MIN, MAX_ABS_EMBEDDING, REQUESTS
from sidindex.errors import InputError
from sidindex.targeting import TargetingSpec

MAX_REQUEST_VALUES = 64
_NUMBERS = {float, int}  # the types of a plain embedding's values (not bool, a subclass of int)


@dataclass(frozen=True)
class Requests:
    """A validated request batch.

    source:     where it came from, named in messages (a file's path, or what the caller says)
    request_id: (B,) int64, unique
    embedding:  (B, D) float32, finite, |x| <= MAX_ABS_EMBEDDING; None when there is no embedding column
    columns:    pyarrow.Table, one column per targeting attribute in spec order, as given (a string
                column for bitmask, a list of strings for bloom; nulls mean unknown/none): those
                columns of `table`
    table:      pyarrow.Table, every column as given, extra columns included (a user's scorer reads
                them, e.g. history token ids); its embedding column, where it is already
                fixed_size_list<float32>, holds `embedding`'s values (`portable` sends it as it is)
    """

    source: str
    request_id: np.ndarray
    embedding: np.ndarray | None
    columns: pa.Table
    table: pa.Table

    @property
    def path(self) -> str:  # the name messages have always used
        return self.source

    def __len__(self) -> int:
        return len(self.request_id)

    def head(self, n: int) -> Requests:
        """The first n requests."""
        return self.rows(0, n)

    def rows(self, lo: int, hi: int) -> Requests:
        """Requests lo..hi-1 (zero-copy)."""
        return Requests(self.source, self.request_id[lo:hi], None if self.embedding is None else self.embedding[lo:hi],
                        self.columns.slice(lo, hi - lo), self.table.slice(lo, hi - lo))

    def taken(self, rows: np.ndarray) -> Requests:
        """The requests of `rows` (int64, repeats allowed), numbered 0.. in that order (a padded
        batch's copies of its last request need ids of their own)."""
        emb = None if self.embedding is None else self.embedding[rows]
        table = self.table.take(rows)
        return Requests(self.source, np.arange(len(rows), dtype=np.int64), emb, table.select(self.columns.column_names),
                        table)

    def padded(self, size: int) -> Requests:
        """The requests, then copies of the last one up to `size` (>= len(self)) rows in all,
        numbered 0..size-1 (a batch grown to a captured batch size): slices of the last row put
        together, about half of what `taken`'s gather of every column costs."""
        n = len(self)
        emb = None if self.embedding is None else self.embedding[np.minimum(np.arange(size), n - 1)]
        table = pa.concat_tables([self.table, *[self.table.slice(n - 1, 1)] * (size - n)]).combine_chunks()
        return Requests(self.source, np.arange(size, dtype=np.int64), emb, table.select(self.columns.column_names),
                        table)

    def renumbered(self) -> Requests:
        """The same requests numbered 0..B-1 (a batch of several clients' requests, whose ids may clash)."""
        return replace(self, request_id=np.arange(len(self), dtype=np.int64))


def read_requests(path: str | Path, spec: TargetingSpec, *, max_values: int = MAX_REQUEST_VALUES,
                  dim: int | None = None) -> Requests:
    """Read and validate a request file (Parquet or Arrow IPC; contract `schemas.REQUESTS`)."""
    from sidindex.ingest import open_table

    return requests_from(open_table(path, "request table"), spec, source=str(path), max_values=max_values, dim=dim)


def requests_from(data: Any, spec: TargetingSpec, *, source: str = "requests", max_values: int = MAX_REQUEST_VALUES,
                  dim: int | None = None) -> Requests:
    """Validate a request batch held in memory (contract `schemas.REQUESTS`).

    data: a pyarrow.Table or RecordBatch, a polars DataFrame, or a list of dicts (one per
          request, keys as the columns); Arrow data is used without a copy
    source: names the batch in messages ("{source}: column 'country', row 3: ...")
    max_values: the most values a request may bring for one bloom attribute
    dim: the embedding length expected (a codebook's); default the length of row 0
    Bitmask values outside the declared set are legal: they mean "unknown" (docs/design.md §3).
    An InputError names the column, the row and the value, as for a file.
    """
    if isinstance(data, list) and data:
        plain = _plain_rows(data, spec, max_values, dim, source)
        if plain is not None:
            return plain
    table = as_table(data, source)
    checks = _checks(table.schema, spec, max_values, dim, source)
    if table.num_rows == 0:
        raise InputError(f"{source}: the request table holds no rows")
    fast = checks.run(table)
    if fast is None:  # some check failed: the column validator finds which row and says so
        _refuse(table, spec, source, max_values, dim)
    request_id, embedding = fast
    return Requests(source, request_id, embedding, table.select(checks.attributes), table)


def _plain_rows(rows: list, spec: TargetingSpec, max_values: int, dim: int | None, source: str) -> Requests | None:
    """The requests of dicts (JSON's) whose values plainly pass every check, built with their
    types known, or None: anything else (a value of another type, a column the spec does not
    name, a bad value) goes the general way, which names the fault. One row's table costs about
    6 us a column this way, against 15 inferred and checked in Arrow (a front-end's requests
    come one per body).

    Builds what `requests_from` and `portable` give such rows: request_id int64, the embedding
    as fixed_size_list<float32>[D] of their values, each attribute as a string (one value) or
    list<string> column, in the order the rows first name them; a key a row leaves out is null."""
    if not all(type(r) is dict for r in rows):
        return None
    names = list(dict.fromkeys(k for r in rows for k in r))
    kinds = {a.name: a.one_request_value for a in spec.attributes}
    if any(n not in kinds and n not in ("request_id", "embedding") for n in names) or len(kinds) + 1 + (
            "embedding" in names) != len(names):
        return None  # a column the spec does not name (a user's scorer's), or an attribute left out
    ids = [r.get("request_id") for r in rows]
    if not all(type(i) is int and INT64_MIN <= i <= INT64_MAX for i in ids) or len(set(ids)) != len(ids):
        return None
    request_id = np.array(ids, dtype=np.int64)
    columns = {"request_id": pa.array(request_id)}
    embedding = None
    if "embedding" in names:
        vectors = [r.get("embedding") for r in rows]
        d = len(vectors[0]) if type(vectors[0]) is list else 0
        if d == 0 or (dim is not None and d != dim) or not all(
                type(v) is list and len(v) == d and set(map(type, v)) <= _NUMBERS for v in vectors):
            return None
        try:
            with np.errstate(over="ignore"):  # past float32's range: inf, refused below and named the general way
                embedding = np.array(vectors, dtype=np.float64).astype(np.float32)
        except OverflowError:  # an int past float64's range
            return None
        if not np.abs(embedding).max() <= MAX_ABS_EMBEDDING:
            return None
        columns["embedding"] = _vectors(embedding)
    ones = [a for a, one in kinds.items() if one]
    values = [r.get(a) for a in ones for r in rows]  # every one-value attribute's, one after another
    if not all(v is None or type(v) is str for v in values):
        return None
    strings = pa.array(values, pa.string())  # one conversion for them all (each costs about 6 us), sliced
    n = len(rows)
    columns |= {a: strings.slice(j * n, n) for j, a in enumerate(ones)}
    for name in (a for a, one in kinds.items() if not one):
        values = [r.get(name) for r in rows]
        if not all(v is None or type(v) is list and len(v) <= max_values and all(type(x) is str for x in v)
                   for v in values):
            return None
        columns[name] = pa.array(values, pa.list_(pa.string()))
    table = pa.Table.from_arrays([columns[k] for k in names], names=names)
    return Requests(source, request_id, embedding, table.select(list(kinds)), table)


def portable(requests: Requests, spec: TargetingSpec | None = None) -> pa.Table:
    """The batch as one Arrow table that `from_portable` turns back into it without validating it
    again (in another process: an HTTP front-end validates, the engine runs): request_id as int64,
    the embedding as fixed_size_list<float32>[D] of its validated values, every other column as
    given, but with `spec` (the one it was validated against) an attribute left unknown in every
    row (a null column, or lists of nothing) typed as the attribute's values are, string or
    list<string>: requests from JSON then share one schema whichever attributes they leave out,
    and the engine reads a batch of them as one stream, not one per schema (`untyped` undoes it
    before the table is validated against another spec)."""
    t = requests.table
    schema = t.schema  # each column below changes alone, so the others' types hold
    i = schema.get_field_index("request_id")
    ids = t.column(i)  # kept when it holds the ids already (dicts' rows: `_plain_rows`)
    if not (ids.type == pa.int64() and np.array_equal(ids.to_numpy(), requests.request_id)):
        t = t.set_column(i, "request_id", pa.array(requests.request_id))
    if requests.embedding is not None:
        emb = requests.embedding
        i = schema.get_field_index("embedding")
        if schema.field(i).type != pa.list_(pa.float32(), emb.shape[1]):  # else its values are the validated ones
            t = t.set_column(i, "embedding", _vectors(emb))
    for a in spec.attributes if spec is not None else ():
        i = schema.get_field_index(a.name)
        given = schema.field(i).type
        typed = pa.string() if a.one_request_value else pa.list_(pa.string())
        if null_like(given):
            t = t.set_column(i, a.name, pa.nulls(len(t), typed))
        elif not a.one_request_value and (pa.types.is_list(given) or pa.types.is_large_list(given)) and \
                null_like(given.value_type):  # lists of nothing: JSON's [] (a list view's cast is not sound)
            t = t.set_column(i, a.name, t.column(i).cast(typed))
    return t


def untyped(table: pa.Table, spec: TargetingSpec) -> pa.Table:
    """`table` (a `portable` one) with each column of an attribute of `spec` that holds no value
    in any row (nulls, or lists of nothing) as a column of type null, as JSON's null gives: an
    attribute `portable` typed as a string when it was one value a request becomes a list of
    them in another spec, and the null type passes either."""
    for a in spec.attributes:
        i = table.schema.get_field_index(a.name)
        if i < 0 or pa.types.is_null(table.schema.field(i).type):
            continue
        column, t = table.column(i), table.schema.field(i).type
        empty = (pa.types.is_list(t) or pa.types.is_large_list(t)) and \
            not (pc.sum(pc.list_value_length(column)).as_py() or 0)
        if empty or column.null_count == len(column):
            table = table.set_column(i, a.name, pa.nulls(len(table)))
    return table


def from_portable(table: pa.Table, spec: TargetingSpec, source: str) -> Requests:
    """The requests of a `portable` table validated against `spec`, as they were."""
    request_id = table.column("request_id").to_numpy()
    embedding = None
    if "embedding" in table.column_names:
        arr, values = fixed_values(table.column("embedding"))
        embedding = values.to_numpy().reshape(len(arr), arr.type.list_size)
    return Requests(source, request_id, embedding, table.select([a.name for a in spec.attributes]), table)


def fixed_values(column: pa.ChunkedArray) -> tuple[pa.FixedSizeListArray, pa.Array]:
    """A fixed_size_list<D> column as one array, and its rows' values, len * D of them (what
    `flatten` gives, without its cost: a slice's offset counts rows, not values)."""
    arr = _one_array(column)
    d = arr.type.list_size
    return arr, arr.values.slice(arr.offset * d, len(arr) * d)


def _one_array(column: pa.ChunkedArray) -> pa.Array:
    """A column as one array: its one chunk as it is, else its chunks combined."""
    return column.chunk(0) if column.num_chunks == 1 else column.combine_chunks()


def _vectors(x: np.ndarray) -> pa.FixedSizeListArray:
    """(B, D) -> a fixed_size_list<D> column of its rows."""
    return pa.FixedSizeListArray.from_arrays(pa.array(x.reshape(-1)), x.shape[1])


def as_table(data: Any, source: str) -> pa.Table:
    """A pyarrow.Table of `data` (see `requests_from`)."""
    if isinstance(data, pa.Table):
        return data
    if isinstance(data, pa.RecordBatch):
        return pa.Table.from_batches([data])
    pl = sys.modules.get("polars")  # polars is imported by whoever made a polars frame; never here
    if pl is not None and isinstance(data, pl.DataFrame):
        return data.to_arrow()
    if isinstance(data, list) and all(isinstance(r, dict) for r in data):
        # every row's keys (from_pylist would keep only the first row's): a key a row leaves out is null there
        names = dict.fromkeys(k for r in data for k in r)
        try:
            return pa.Table.from_pydict({k: [r.get(k) for r in data] for k in names})
        except (pa.ArrowInvalid, pa.ArrowTypeError, OverflowError) as e:  # rows disagree on a type; an int past 64 bits
            raise InputError(f"{source}: the requests' values do not form a table: {e}") from None
    raise InputError(f"{source}: expected requests as a pyarrow Table or RecordBatch, a polars DataFrame or a list "
                     f"of dicts, got {type(data).__name__}")


def null_like(t: pa.DataType) -> bool:
    """A column of nulls only (null values mean unknown, or no values)."""
    return pa.types.is_null(t) or pa.types.is_dictionary(t) and pa.types.is_null(t.value_type)


def _string_like(t: pa.DataType) -> bool:
    if pa.types.is_dictionary(t):
        return _string_like(t.value_type)
    return pa.types.is_string(t) or pa.types.is_large_string(t) or pa.types.is_string_view(t)


def _list_like(t: pa.DataType) -> bool:
    return pa.types.is_list(t) or pa.types.is_large_list(t) or pa.types.is_fixed_size_list(t) or \
        pa.types.is_list_view(t) or pa.types.is_large_list_view(t)


@dataclass(frozen=True)
class _Checks:
    """The checks of `ingest.Validator` for batches of one schema, vectorised: the names and types
    are checked once (`of`), and a batch's values with a few Arrow and numpy calls (`run`).

    ids:        request_id's column; unsigned: its type is unsigned (its values are checked against
                INT64_MAX)
    embedding:  the embedding's column, or None; size: its length when its type fixes it
    lists:      the columns of the bloom attributes whose lists are checked (length, null values)
    attributes: the spec's attributes' columns, in spec order
    typed:      every name and type is good (else every batch is refused, `_refuse` says why)
    """

    spec: TargetingSpec
    schema: pa.Schema
    max_values: int
    dim: int | None
    typed: bool
    ids: int = 0
    unsigned: bool = False
    embedding: int | None = None
    size: int | None = None
    lists: tuple[int, ...] = ()
    attributes: tuple[int, ...] = ()

    @classmethod
    def of(cls, schema: pa.Schema, spec: TargetingSpec, max_values: int, dim: int | None) -> _Checks:
        """The checks for `schema`, whose names are unique."""
        refused = cls(spec, schema, max_values, dim, typed=False)
        names = set(schema.names)
        rid = REQUESTS.field("request_id").name
        if rid not in names or not pa.types.is_integer(schema.field(rid).type):
            return refused
        embedding = size = None
        if "embedding" in names:
            t = schema.field("embedding").type
            if not (_list_like(t) and (pa.types.is_integer(t.value_type) or pa.types.is_floating(t.value_type))):
                return refused
            embedding = schema.get_field_index("embedding")
            if pa.types.is_fixed_size_list(t):
                size = t.list_size
                if size == 0 or (dim is not None and size != dim):
                    return refused
        lists = []
        for a in spec.attributes:
            if a.name not in names:
                return refused
            t = schema.field(a.name).type
            if null_like(t):
                continue
            if a.one_request_value:
                if not _string_like(t):
                    return refused
                continue
            if not (_list_like(t) and (_string_like(t.value_type) or null_like(t.value_type))):
                return refused
            lists.append(schema.get_field_index(a.name))
        return cls(spec, schema, max_values, dim, True, schema.get_field_index(rid),
                   pa.types.is_unsigned_integer(schema.field(rid).type), embedding, size, tuple(lists),
                   tuple(schema.get_field_index(a.name) for a in spec.attributes))

    def run(self, table: pa.Table) -> tuple[np.ndarray, np.ndarray | None] | None:
        """(request_id (B,) int64, embedding (B, D) float32 or None) when every check of
        `ingest.Validator` would pass on `table` (of this schema, B >= 1 rows), else None."""
        if not self.typed:
            return None
        col = table.column(self.ids)
        if col.null_count:
            return None
        ids = col.to_numpy()
        if self.unsigned and ids.max() > INT64_MAX:
            return None
        ids = ids.astype(np.int64, copy=False)
        # a set for a serving batch (a few microseconds), a sort for a file's millions of rows
        unique = len(set(ids.tolist())) if len(ids) <= 4096 else len(np.unique(ids))
        if unique != len(ids):
            return None
        embedding = None
        if self.embedding is not None:
            embedding = _embedding(table.column(self.embedding), self.size, self.dim)
            if embedding is None:
                return None
        for i in self.lists:
            for chunk in table.column(i).chunks:  # never combined: a file's lists may be many
                if _too_long(chunk, self.max_values):
                    return None
                # a null inside a list (null lists flatten to nothing); the child's nulls bound
                # the lists' (a slice's child holds other rows too)
                if chunk.values.null_count and pc.list_flatten(chunk).null_count:
                    return None
        return ids, embedding


_CHECKS: list[_Checks] = []  # the latest first: a serving host's batches share a schema or a few
_KEEP = 8


def _checks(schema: pa.Schema, spec: TargetingSpec, max_values: int, dim: int | None, source: str) -> _Checks:
    """The checks for batches of `schema` (made once while it comes back); a column given twice is
    refused here."""
    for c in _CHECKS:
        if c.spec is spec and c.max_values == max_values and c.dim == dim and c.schema.equals(schema):
            return c
    names = schema.names
    if len(set(names)) != len(names):
        twice = next(n for n in names if names.count(n) > 1)
        raise InputError(f"{source}: column {twice!r} appears {names.count(twice)} times; give each column once")
    checks = _Checks.of(schema, spec, max_values, dim)
    _CHECKS.insert(0, checks)
    del _CHECKS[_KEEP:]
    return checks


# the offsets' dtype of list and large_list arrays, by type id
_LIST_OFFSETS: dict[int, np.dtype] = {pa.list_(pa.null()).id: np.dtype(np.int32),
                                      pa.large_list(pa.null()).id: np.dtype(np.int64)}


def _list_offsets(arr: pa.Array) -> np.ndarray | None:
    """(n+1,) the offsets of a list or large_list array (a view of its buffer), else None."""
    width = _LIST_OFFSETS.get(arr.type.id)
    if width is None:
        return None
    return np.frombuffer(arr.buffers()[1], width, len(arr) + 1, arr.offset * width.itemsize)


def _too_long(chunk: pa.Array, max_values: int) -> bool:
    """Whether a list of `chunk` holds more than max_values values (a null list holds none)."""
    if len(chunk) == 0:
        return False
    offsets = _list_offsets(chunk)
    if offsets is not None and int((offsets[1:] - offsets[:-1]).max()) <= max_values:
        return False  # no slot spans more, null or not
    return (pc.max(pc.list_value_length(chunk)).as_py() or 0) > max_values


def _embedding(col: pa.ChunkedArray, size: int | None, dim: int | None) -> np.ndarray | None:
    """(B, D) float32 of a good embedding column (`Validator.vector`'s checks), else None; its
    type was checked (`_Checks.of`), size: its length when the type fixes it."""
    if col.null_count:
        return None
    if size is not None:
        arr, values = fixed_values(col)
        d = size
    else:
        arr = _one_array(col)
        offsets = _list_offsets(arr)
        lengths = pc.list_value_length(arr).to_numpy() if offsets is None else offsets[1:] - offsets[:-1]
        d = int(lengths[0])
        if (lengths != d).any() or d == 0 or (dim is not None and d != dim):
            return None
        values = arr.flatten()
    if values.null_count:
        return None
    with np.errstate(over="ignore"):  # a float64 past float32's range becomes inf, refused just below
        x = values.to_numpy(zero_copy_only=False).astype(np.float32, copy=False).reshape(len(arr), d)
    if not np.abs(x).max() <= MAX_ABS_EMBEDDING:  # NaN fails too
        return None
    return x


def _refuse(table: pa.Table, spec: TargetingSpec, source: str, max_values: int, dim: int | None) -> NoReturn:
    """Raise the InputError the column validator gives the batch that failed a fast check."""
    import polars as pl  # a refused batch only: the good path reads Arrow alone

    from sidindex.ingest import Validator

    try:
        df = pl.from_arrow(table)
    except Exception as e:  # an Arrow type polars cannot hold (e.g. a union): name it
        raise InputError(f"{source}: the requests cannot be read as a table: {e}") from None
    assert isinstance(df, pl.DataFrame)  # from a table
    v = Validator(source, df)
    v.unique(REQUESTS.field("request_id").name, v.int64(REQUESTS.field("request_id").name))
    if "embedding" in df.columns:
        v.vector("embedding", dim)
    for a in spec.attributes:
        if a.one_request_value:
            v.string(a.name)
        else:
            v.string_list(a.name, declared=None, max_len=max_values)
    raise InputError(f"{source}: the requests were refused by a check the validator does not name "
                     "(a bug: please report it with the batch)")
