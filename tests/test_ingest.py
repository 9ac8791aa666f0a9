"""Every ingestion failure of the catalog contract gives one error naming file, column, row, value."""

from __future__ import annotations

import numpy as np
import polars as pl
import pytest

from sidindex.errors import InputError
from sidindex.ingest import read_catalog, read_requests
from sidindex.sample import sample_requests


def read(write_catalog, spec, df, **kw):
    path, _ = write_catalog(df)
    return read_catalog(path, spec=spec, hash_keys=("advertiser_id",), **kw)


def set_row(df: pl.DataFrame, column: str, row: int, value) -> pl.DataFrame:
    values = df[column].to_list()
    values[row] = value
    return df.with_columns(pl.Series(column, values, dtype=df[column].dtype))


def test_valid_catalog_is_converted(write_catalog, spec, catalog_df):
    cat = read(write_catalog, spec, catalog_df)
    assert cat.embedding.dtype == np.float32 and cat.embedding.shape == (60, 8)
    assert cat.ad_id.dtype == np.int64
    np.testing.assert_array_equal(cat.ad_id, catalog_df["ad_id"].to_numpy())
    assert cat.columns.columns == ["advertiser_id", *[a.name for a in spec.attributes], "value"]


def test_variable_length_list_embedding_is_accepted(write_catalog, spec, catalog_df):
    df = catalog_df.with_columns(pl.col("embedding").arr.to_list().cast(pl.List(pl.Float64)))
    cat = read(write_catalog, spec, df)
    np.testing.assert_array_equal(cat.embedding, np.stack(catalog_df["embedding"].to_numpy()).astype(np.float32))


@pytest.mark.parametrize("column", ["ad_id", "embedding", "advertiser_id", "country", "locations"])
def test_missing_column(write_catalog, spec, catalog_df, column):
    with pytest.raises(InputError, match=rf"catalog.parquet: missing column '{column}' \(columns present: "):
        read(write_catalog, spec, catalog_df.drop(column))


@pytest.mark.parametrize("column,value,expected", [
    ("ad_id", "x", "has type String, expected an integer type"),
    ("country", "US", "has type String, expected list<string>"),
    ("embedding", "x", "has type String, expected a list of float32"),
    ("advertiser_id", 1.5, "has type Float64; a hash-key column must be integer or string"),
    ("value", "high", "has type String, expected a number"),
])
def test_wrong_type(write_catalog, spec, catalog_df, column, value, expected):
    df = catalog_df.with_columns(pl.lit(value).alias(column))
    with pytest.raises(InputError, match=rf"column '{column}': {expected}"):
        read(write_catalog, spec, df)


def test_duplicate_ad_id_names_both_rows(write_catalog, spec, catalog_df):
    df = set_row(catalog_df, "ad_id", 41, catalog_df["ad_id"][7])
    dup = catalog_df["ad_id"][7]
    with pytest.raises(InputError, match=rf"catalog.parquet: column 'ad_id', row 41: value {dup} also appears "
                                         r"in row 7; ad_id must be unique$"):
        read(write_catalog, spec, df)


def test_null_ad_id(write_catalog, spec, catalog_df):
    df = set_row(catalog_df, "ad_id", 5, None)
    with pytest.raises(InputError, match=r"column 'ad_id', row 5: is null"):
        read(write_catalog, spec, df)


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf"), None, 1e300])
def test_non_finite_embedding(write_catalog, spec, catalog_df, bad):
    emb = np.stack(catalog_df["embedding"].to_numpy()).astype(np.float64).tolist()
    emb[13][3] = bad
    df = catalog_df.with_columns(pl.Series("embedding", emb, dtype=pl.List(pl.Float64)))
    ad = catalog_df["ad_id"][13]
    with pytest.raises(InputError, match=rf"column 'embedding', row 13 \(ad_id {ad}\): element 3 is .* embeddings must be finite"):
        read(write_catalog, spec, df)


def test_wrong_length_embedding(write_catalog, spec, catalog_df):
    emb = np.stack(catalog_df["embedding"].to_numpy()).tolist()
    emb[22] = emb[22][:5]
    df = catalog_df.with_columns(pl.Series("embedding", emb, dtype=pl.List(pl.Float32)))
    with pytest.raises(InputError, match=r"column 'embedding', row 22 .*has 5 values, expected 8 \(the length of row 0\)"):
        read(write_catalog, spec, df)


def test_embedding_length_checked_against_codebook_dim(write_catalog, spec, catalog_df):
    with pytest.raises(InputError, match=r"row 0 .*has 8 values, expected 16 \(the codebook's dimension\)"):
        read(write_catalog, spec, catalog_df, dim=16)


def test_undeclared_targeting_value(write_catalog, spec, catalog_df):
    df = set_row(catalog_df, "country", 33, ["US", "UK"])
    path, spec_path = write_catalog(df)
    from sidindex.targeting import load_targeting

    with pytest.raises(InputError) as e:
        read_catalog(path, spec=load_targeting(spec_path), hash_keys=("advertiser_id",))
    msg = str(e.value)
    assert msg.startswith(f"{path}: column 'country', row 33 (ad_id {catalog_df['ad_id'][33]}): value 'UK' "
                          f"is not declared in {spec_path} (declared: ")
    assert msg.endswith("... 246 more). Declare it or correct the row.")


def test_null_inside_a_list_is_refused_but_null_list_is_unrestricted(write_catalog, spec, catalog_df):
    ok = set_row(set_row(catalog_df, "country", 3, None), "age", 4, [])
    read(write_catalog, spec, ok)
    bad = set_row(catalog_df, "locations", 9, ["geo:00001", None])
    with pytest.raises(InputError, match=r"column 'locations', row 9 .*null value inside its list"):
        read(write_catalog, spec, bad)


def test_null_hash_key(write_catalog, spec, catalog_df):
    with pytest.raises(InputError, match=r"column 'advertiser_id', row 2 .*is null"):
        read(write_catalog, spec, set_row(catalog_df, "advertiser_id", 2, None))


def test_empty_catalog(write_catalog, spec, catalog_df):
    with pytest.raises(InputError, match=r"catalog.parquet: the catalog holds no rows"):
        read(write_catalog, spec, catalog_df.head(0))


def test_unreadable_and_missing_files(tmp_path, spec):
    junk = tmp_path / "junk.parquet"
    junk.write_bytes(b"PAR1 this is not parquet")
    with pytest.raises(InputError, match=r"junk.parquet: cannot be read as Parquet or Arrow IPC"):
        read_catalog(junk, spec=spec)
    with pytest.raises(InputError, match=r"nope.parquet: file not found"):
        read_catalog(tmp_path / "nope.parquet")


def test_arrow_ipc_catalog(tmp_path, spec, catalog_df):
    path = tmp_path / "catalog.arrow"
    catalog_df.write_ipc(path)
    assert len(read_catalog(path, spec=spec, hash_keys=("advertiser_id",))) == 60


def test_requests_validate(tmp_path, spec):
    import pyarrow.parquet as pq

    table = sample_requests(30, spec, dim=8, seed=2)
    path = tmp_path / "requests.parquet"
    pq.write_table(table, path)
    req = read_requests(path, spec, dim=8)
    assert req.embedding.shape == (30, 8) and len(req) == 30
    assert req.columns["country"].dtype == pl.String
    # undeclared bitmask values are legal in requests ("unknown"); more than 64 locations is not
    df = pl.from_arrow(table)
    locs = df["locations"].to_list()
    locs[4] = [f"geo:{i}" for i in range(65)]
    df.with_columns(pl.Series("locations", locs)).write_parquet(path)
    with pytest.raises(InputError, match=r"column 'locations', row 4: holds 65 values; at most 64"):
        read_requests(path, spec)
