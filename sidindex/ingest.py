"""Catalog ingestion: read with polars, validate against `schemas`, normalise.

One validator (`Validator`) converts, checks and returns arrays the rest of the pipeline can rely on
(`Catalog`; requests' batches too, through `sidindex.requests`). Every failure is an `InputError`
naming the file, the column, a row (0-based, as in a data frame) and the offending value.
Legend: N ads, B requests, D embedding dims.

Bounds checked here so that later stages cannot fail obscurely: ids must fit int64 (a uint64 id above
2**63 - 1 is refused, not wrapped), and every embedding element (catalog and requests) must be finite
with an absolute value of at most `MAX_ABS_EMBEDDING` (1e6).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import polars as pl
import pyarrow as pa

from schemas import CATALOG, INT64_MAX, INT64_MIN, MAX_ABS_EMBEDDING
from schemas.artifacts import MAX_AD_VALUE
from sidindex.artifact import regular_input
from sidindex.errors import InputError
from sidindex.targeting import TargetingSpec


@dataclass(frozen=True)
class Catalog:
    """A validated catalog.

    ad_id:     (N,) int64, unique
    embedding: (N, D) float32, finite, |x| <= MAX_ABS_EMBEDDING
    columns:   the hash-key and targeting columns, validated, in file row order
    value:     (N,) float64 each ad's `value`, in [0, MAX_AD_VALUE]; None when the catalog has none
    """

    path: str
    ad_id: np.ndarray
    embedding: np.ndarray
    columns: pl.DataFrame
    value: np.ndarray | None = None

    def __len__(self) -> int:
        return len(self.ad_id)


def _form(path: str | Path, what: str) -> tuple[Path, str]:
    """(path, "parquet" | "ipc file" | "ipc stream") of the regular file at `path`, by its magic bytes."""
    path = regular_input(path, what)
    try:
        with path.open("rb") as f:
            head = f.read(6)
    except OSError as e:  # no permission, an I/O error
        raise InputError(f"{path}: the {what} cannot be read ({e.strerror or e})") from None
    return path, "parquet" if head[:4] == b"PAR1" else "ipc file" if head == b"ARROW1" else "ipc stream"


@contextlib.contextmanager
def _readable(path: Path) -> Iterator[None]:
    """Within: an error reading the table at `path` is an InputError naming it (polars and pyarrow
    raise many types for corrupt input), except memory running out, which is no fault of the file."""
    try:
        yield
    except MemoryError:
        raise
    except Exception as e:
        raise InputError(f"{path}: cannot be read as Parquet or Arrow IPC: {e}") from None


def read_table(path: str | Path, what: str) -> pl.DataFrame:
    """Read the Parquet or Arrow IPC (file or stream) table at `path`, chosen by its magic bytes;
    `what` names it in messages ("catalog")."""
    path, form = _form(path, what)
    with _readable(path):
        if form == "parquet":
            return pl.read_parquet(path)
        return pl.read_ipc(path) if form == "ipc file" else pl.read_ipc_stream(path)


def open_table(path: str | Path, what: str) -> pa.Table:
    """The Parquet or Arrow IPC table at `path` as a pyarrow.Table (memory-mapped where the form
    allows), chosen by its magic bytes; `what` names it in messages ("request table")."""
    import pyarrow.ipc as ipc
    import pyarrow.parquet as pq

    path, form = _form(path, what)
    with _readable(path):
        if form == "parquet":
            return pq.read_table(path)
        with pa.memory_map(str(path)) as source:
            return (ipc.open_file if form == "ipc file" else ipc.open_stream)(source).read_all()


def table_metadata(path: str | Path, what: str) -> dict[str, str]:
    """The key-value metadata of the schema of the table at `path` (as `read_table` reads it),
    decoded as UTF-8; no rows are read."""
    import pyarrow.parquet as pq

    path, form = _form(path, what)
    with _readable(path):
        if form == "parquet":
            schema = pq.read_schema(path)
        else:
            with pa.memory_map(str(path)) as source:
                schema = (pa.ipc.open_file if form == "ipc file" else pa.ipc.open_stream)(source).schema
    return {k.decode("utf-8", "replace"): v.decode("utf-8", "replace") for k, v in (schema.metadata or {}).items()}


def read_catalog(
    path: str | Path,
    *,
    spec: TargetingSpec | None = None,
    hash_keys: tuple[str, ...] = (),
    dim: int | None = None,
) -> Catalog:
    """Read and validate a catalog (contract `schemas.CATALOG`).

    spec:      when given, every targeting attribute column is required and checked
    hash_keys: columns that must be present, integer or string, and non-null
    dim:       expected embedding length (e.g. a codebook's); default: the length of row 0
    """
    df = read_table(path, "catalog")
    if df.height == 0:
        raise InputError(f"{path}: the catalog holds no rows; nothing to index")
    return catalog_rows(df, str(path), spec=spec, hash_keys=hash_keys, dim=dim)


def catalog_rows(df: pl.DataFrame, path: str, *, spec: TargetingSpec | None = None, hash_keys: tuple[str, ...] = (),
                 dim: int | None = None, rows: np.ndarray | None = None, unique: bool = True) -> Catalog:
    """Validate catalog rows `df` read from `path` (as `read_catalog`); errors name row `rows[i]`
    of the file for row i of `df` (default: i), and `unique=False` lets an ad_id repeat (a change
    file may upsert an ad twice)."""
    v = Validator(path, df, rows)
    ad_id = v.int64(CATALOG.field("ad_id").name)
    if unique:
        v.unique(CATALOG.field("ad_id").name, ad_id)
    v.ad_id = ad_id
    embedding = v.vector("embedding", dim)
    keep: list[pl.Series] = []
    for key in hash_keys:
        keep.append(v.hash_key(key))
    if spec is not None:
        for a in spec.attributes:
            keep.append(v.string_list(a.name, declared=a.values or None, declared_in=spec.source))
    value = v.value("value").to_numpy() if "value" in df.columns and "value" not in hash_keys else None
    return Catalog(path, ad_id, embedding, pl.DataFrame(keep), value)


def check_unique_ad_ids(ad_id: np.ndarray, path: str) -> None:
    """Refuse a repeated id in a whole catalog's ad_id (N,) int64 as `read_catalog` does: for an
    engine that validates a catalog's fragments apart (unique=False), once all are read."""
    Validator(path, pl.DataFrame()).unique(CATALOG.field("ad_id").name, ad_id)


def int64_column(df: pl.DataFrame, path: str, name: str) -> np.ndarray:
    """(rows,) int64 the integer column `name` of `df` (read from `path`): no nulls, every value
    within int64, or an InputError naming the row."""
    return Validator(path, df).int64(name)


class Validator:
    """Column checks for one table; each returns the converted column or raises `InputError`."""

    def __init__(self, path: str, df: pl.DataFrame, rows: np.ndarray | None = None) -> None:
        self.path = path
        self.df = df
        self.rows = rows  # the file's row of each row of df, when df is a selection of the file's
        self.ad_id: np.ndarray | None = None
        self.checked = -1  # columns checked so far, for `InputError.rank`

    def fail(self, column: str, row: int | None, message: str, step: int = 0) -> InputError:
        """The error of the check `step` (within its column's checks, in order) failing at `row`."""
        where = f"{self.path}: column {column!r}"
        file_row = -1
        if row is not None:
            file_row = row if self.rows is None else int(self.rows[row])
            where += f", row {file_row}"
            if self.ad_id is not None:
                where += f" (ad_id {self.ad_id[row]})"
        error = InputError(f"{where}: {message}")
        # which error a whole-file validation reports first: column, check, then row (an engine
        # validating fragments apart picks the same one)
        error.rank = (self.checked, step, file_row)
        return error

    def column(self, name: str) -> pl.Series:
        self.checked += 1
        if name not in self.df.columns:
            shown = ", ".join(repr(c) for c in self.df.columns[:12])
            more = f", ... {len(self.df.columns) - 12} more" if len(self.df.columns) > 12 else ""
            error = InputError(f"{self.path}: missing column {name!r} (columns present: {shown}{more})")
            error.rank = (self.checked, -1, -1)
            raise error
        return self.df.get_column(name)

    def no_nulls(self, s: pl.Series) -> None:
        if s.null_count():
            row = int(s.is_null().arg_true()[0])
            raise self.fail(s.name, row, "is null; this column must have a value in every row", step=1)

    def int64(self, name: str) -> np.ndarray:
        """(rows,) int64. Any integer type is accepted when every value fits int64 (e.g. uint64 ids
        below 2**63); a value outside it is refused rather than wrapped or left to a failing cast."""
        s = self.column(name)
        if not s.dtype.is_integer():
            raise self.fail(name, None, f"has type {s.dtype}, expected an integer type (int64)")
        self.no_nulls(s)
        # Compare only on the side that can overflow: a negative literal does not fit a uint64 column.
        outside = []
        hi, lo = s.max(), s.min()  # ints, None for an empty column (nothing outside)
        if isinstance(hi, int) and hi > INT64_MAX:
            outside.append(int((s > INT64_MAX).arg_true()[0]))
        if isinstance(lo, int) and lo < INT64_MIN:
            outside.append(int((s < INT64_MIN).arg_true()[0]))
        if outside:
            row = min(outside)
            raise self.fail(name, row, f"value {s[row]} does not fit int64 (ids must be in [-2**63, 2**63)); "
                                       "map the ids into that range or correct the row", step=2)
        return s.cast(pl.Int64).to_numpy()

    def value(self, name: str) -> pl.Series:
        """An ad's value: float64, finite and >= 0 in every row (its bounds rank prefixes)."""
        s = self.column(name)
        if not s.dtype.is_numeric():
            raise self.fail(name, None, f"has type {s.dtype}, expected a number (float64)")
        self.no_nulls(s)
        s = s.cast(pl.Float64)
        bad = ~(s.is_finite() & (s >= 0) & (s <= MAX_AD_VALUE))
        if bad.any():
            row = int(bad.arg_true()[0])
            raise self.fail(name, row, f"value {s[row]} is not a number in [0, {MAX_AD_VALUE:g}] (an ad's expected "
                                       "eCPM; give 0 for an ad of unknown value)", step=2)
        return s

    def unique(self, name: str, values: np.ndarray) -> None:
        """Refuse a repeated value, naming the later row of the first repeat."""
        order = np.argsort(values, kind="stable")
        dup = np.flatnonzero(values[order][1:] == values[order][:-1])
        if len(dup):
            first, second = sorted((int(order[dup[0]]), int(order[dup[0] + 1])))
            raise self.fail(name, second, f"value {values[second]} also appears in row {first}; "
                                          f"{name} must be unique", step=3)

    def hash_key(self, name: str) -> pl.Series:
        s = self.column(name)
        if not (s.dtype.is_integer() or s.dtype in (pl.String, pl.Categorical)):
            raise self.fail(name, None, f"has type {s.dtype}; a hash-key column must be integer or string")
        self.no_nulls(s)
        return s

    def string(self, name: str) -> pl.Series:
        s = self.column(name)
        if s.dtype == pl.Null:
            return s.cast(pl.String)
        if s.dtype not in (pl.String, pl.Categorical):
            raise self.fail(name, None, f"has type {s.dtype}, expected string")
        return s.cast(pl.String)

    def string_list(self, name: str, *, declared: tuple[str, ...] | None, declared_in: str = "",
                    max_len: int | None = None) -> pl.Series:
        s = self.column(name)
        if s.dtype == pl.Null:
            return s.cast(pl.List(pl.String))
        if not (isinstance(s.dtype, pl.List) and s.dtype.inner in (pl.String, pl.Categorical, pl.Null)):
            raise self.fail(name, None, f"has type {s.dtype}, expected list<string> "
                                        "(null or an empty list means unrestricted)")
        s = s.cast(pl.List(pl.String))
        if max_len is not None:
            too_long = (s.list.len() > max_len).fill_null(False)
            if too_long.any():
                row = int(too_long.arg_true()[0])
                raise self.fail(name, row, f"holds {s[row].len()} values; at most {max_len} are allowed", step=2)
        flat = pl.DataFrame({"row": pl.int_range(0, len(s), eager=True, dtype=pl.Int64), name: s}).explode(name)
        # Null/empty lists explode to a null element too; only a null *inside* a real list is malformed.
        inner_null = flat.filter(pl.col(name).is_null()).join(
            pl.DataFrame({"row": (s.list.len() > 0).fill_null(False).arg_true().cast(pl.Int64)}), on="row")
        if inner_null.height:
            raise self.fail(name, int(inner_null["row"].to_numpy().min()), "holds a null value inside its list; "
                                                                "use an empty list or null for unrestricted", step=3)
        if declared is not None:
            bad = flat.filter(pl.col(name).is_not_null() & ~pl.col(name).is_in(list(declared)))
            if bad.height:
                row = int(bad["row"][0])
                value = bad[name][0]
                shown = ", ".join(repr(x) for x in sorted(declared)[:4])
                more = f", ... {len(declared) - 4} more" if len(declared) > 4 else ""
                raise self.fail(name, row, f"value {value!r} is not declared in {declared_in} "
                                           f"(declared: {shown}{more}). Declare it or correct the row.", step=4)
        return s

    def vector(self, name: str, dim: int | None) -> np.ndarray:
        """(rows, D) float32, every element finite and within +-MAX_ABS_EMBEDDING.

        D is `dim` when given, else the length of row 0. The bound is checked on the float32 values, and
        a value reported is the one in the file: a float64 1e300 that becomes inf in float32 is named as
        1e+300 beyond the bound, not as inf.
        """
        s = self.column(name)
        dt = s.dtype
        if not (isinstance(dt, (pl.List, pl.Array)) and dt.inner.is_numeric()):
            raise self.fail(name, None, f"has type {dt}, expected a list of float32")
        self.no_nulls(s)
        lengths = s.list.len().to_numpy() if isinstance(dt, pl.List) else np.full(len(s), dt.size)
        expected = dim if dim is not None else int(lengths[0])
        origin = "the codebook's dimension" if dim is not None else "the length of row 0"
        if expected == 0:
            raise self.fail(name, 0, "is empty; embeddings need at least one value", step=2)
        wrong = np.flatnonzero(lengths != expected)
        if len(wrong):
            row = int(wrong[0])
            raise self.fail(name, row, f"has {lengths[row]} values, expected {expected} ({origin})", step=3)
        flat = s.explode() if isinstance(dt, pl.List) else s.arr.explode()
        x = flat.cast(pl.Float32).to_numpy().reshape(len(s), expected)
        # One pass catches NaN (every comparison is False), inf, and values beyond the bound.
        bad = ~(np.abs(x) <= MAX_ABS_EMBEDDING).all(axis=1)
        if bad.any():
            row = int(np.flatnonzero(bad)[0])
            col = int(np.flatnonzero(~(np.abs(x[row]) <= MAX_ABS_EMBEDDING))[0])
            # The value as in the file, in its own dtype (so a float32 1e19 prints as 1e+19).
            value = flat.slice(row * expected + col, 1).to_numpy()[0]
            if not np.isfinite(float(value)):  # a null element reads as NaN
                raise self.fail(name, row, f"element {col} is {x[row, col]} (null, NaN or inf); "
                                           "embeddings must be finite", step=4)
            raise self.fail(name, row, f"element {col} is {value!s}, beyond the allowed range "
                                       f"[-{MAX_ABS_EMBEDDING:g}, {MAX_ABS_EMBEDDING:g}] (MAX_ABS_EMBEDDING: larger "
                                       "values overflow float32 distance arithmetic). Normalise or rescale the "
                                       "embeddings, or correct the row.", step=4)
        return np.ascontiguousarray(x, dtype=np.float32)
