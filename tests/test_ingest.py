"""Every ingestion failure of the catalog contract gives one error naming file, column, row, value."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import numpy as np
import polars as pl
import pyarrow as pa
import pytest

from sidindex.errors import InputError
from sidindex.ingest import MAX_ABS_EMBEDDING, read_catalog
from sidindex.requests import read_requests
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
    assert cat.columns.columns == ["advertiser_id", *[a.name for a in spec.attributes]]
    np.testing.assert_array_equal(cat.value, catalog_df["value"].to_numpy())  # validated, kept apart


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


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf"), None])
def test_non_finite_embedding(write_catalog, spec, catalog_df, bad):
    emb = np.stack(catalog_df["embedding"].to_numpy()).astype(np.float64).tolist()
    emb[13][3] = bad
    df = catalog_df.with_columns(pl.Series("embedding", emb, dtype=pl.List(pl.Float64)))
    ad = catalog_df["ad_id"][13]
    with pytest.raises(InputError,
                       match=rf"column 'embedding', row 13 \(ad_id {ad}\): element 3 is .* embeddings must be finite"):
        read(write_catalog, spec, df)


def with_embedding_value(catalog_df: pl.DataFrame, row: int, col: int, value, dtype=pl.Float64) -> pl.DataFrame:
    emb = np.stack(catalog_df["embedding"].to_numpy()).astype(np.float64).tolist()
    emb[row][col] = value
    return catalog_df.with_columns(pl.Series("embedding", emb, dtype=pl.List(dtype)))


# 1e19 is finite in float32 but overflows faiss's squared distances (a SIGABRT in k-means); 1e300
# becomes inf in the float32 cast and is reported as the value in the file, by the same message.
@pytest.mark.parametrize("bad,shown,dtype", [(1e19, "1e+19", pl.Float32), (-1e19, "-1e+19", pl.Float64),
                                             (1e300, "1e+300", pl.Float64), (2e6, "2000000.0", pl.Float64)])
def test_embedding_beyond_bound_is_refused(write_catalog, spec, catalog_df, bad, shown, dtype):
    df = with_embedding_value(catalog_df, 13, 3, bad, dtype)
    ad = catalog_df["ad_id"][13]
    with pytest.raises(InputError, match=rf"catalog.parquet: column 'embedding', row 13 \(ad_id {ad}\): element 3 "
                                         rf"is {re.escape(shown)}, beyond the allowed range \[-1e\+06, 1e\+06\] "
                                         r"\(MAX_ABS_EMBEDDING: .*Normalise or rescale the embeddings, or correct the "
                                         r"row\.$"):
        read(write_catalog, spec, df)


def test_build_refuses_huge_embedding_in_one_line(write_catalog, catalog_df, tmp_path):
    # Without the bound this build published SIDs trained on 1e19 (and larger catalogs aborted inside faiss
    # k-means with SIGABRT): now it is one line naming the row, exit 2, nothing published.
    path, spec_path = write_catalog(with_embedding_value(catalog_df, 13, 3, 1e19))
    exe = shutil.which("sidindex")
    assert exe, "the sidindex console script is not installed (pip install -e .)"
    root = tmp_path / "root"
    r = subprocess.run([exe, "build", "--catalog", str(path), "--targeting", str(spec_path), "--out", str(root)],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2, (r.returncode, r.stderr)
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in r.stderr, r.stderr
    assert "column 'embedding', row 13" in lines[0] and "beyond the allowed range" in lines[0]
    assert not (root / "CURRENT").exists()


def test_embedding_at_the_bound_is_accepted(write_catalog, spec, catalog_df):
    df = with_embedding_value(catalog_df, 0, 0, -MAX_ABS_EMBEDDING)
    assert read(write_catalog, spec, df).embedding[0, 0] == -MAX_ABS_EMBEDDING


def test_integer_embedding_beyond_bound_is_refused(write_catalog, spec, catalog_df):
    emb = [[1] * 8 for _ in range(60)]
    emb[7][5] = 2**63
    df = catalog_df.with_columns(pl.Series("embedding", emb, dtype=pl.List(pl.UInt64)))
    with pytest.raises(InputError, match=r"row 7 .*element 5 is 9223372036854775808, beyond the allowed range"):
        read(write_catalog, spec, df)


def test_wrong_length_embedding(write_catalog, spec, catalog_df):
    emb = np.stack(catalog_df["embedding"].to_numpy()).tolist()
    emb[22] = emb[22][:5]
    df = catalog_df.with_columns(pl.Series("embedding", emb, dtype=pl.List(pl.Float32)))
    with pytest.raises(InputError,
                       match=r"column 'embedding', row 22 .*has 5 values, expected 8 \(the length of row 0\)"):
        read(write_catalog, spec, df)


def test_embedding_length_checked_against_codebook_dim(write_catalog, spec, catalog_df):
    with pytest.raises(InputError, match=r"row 0 .*has 8 values, expected 16 \(the codebook's dimension\)"):
        read(write_catalog, spec, catalog_df, dim=16)


@pytest.mark.parametrize("value", [2**63, 2**64 - 1])
def test_uint64_ad_id_beyond_int64_is_refused(write_catalog, spec, catalog_df, value):
    ids = catalog_df["ad_id"].cast(pl.UInt64).to_list()
    ids[17] = value
    df = catalog_df.with_columns(pl.Series("ad_id", ids, dtype=pl.UInt64))
    with pytest.raises(InputError, match=rf"catalog.parquet: column 'ad_id', row 17: value {value} does not fit "
                                         r"int64 \(ids must be in \[-2\*\*63, 2\*\*63\)\); map the ids"):
        read(write_catalog, spec, df)


def test_uint64_ad_id_that_fits_is_accepted(write_catalog, spec, catalog_df):
    ids = catalog_df["ad_id"].cast(pl.UInt64).to_list()
    ids[17] = 2**63 - 1
    cat = read(write_catalog, spec, catalog_df.with_columns(pl.Series("ad_id", ids, dtype=pl.UInt64)))
    assert cat.ad_id.dtype == np.int64 and cat.ad_id[17] == 2**63 - 1
    np.testing.assert_array_equal(cat.ad_id[:17], catalog_df["ad_id"].to_numpy()[:17])


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
    assert req.columns.column("country").type == pa.string()
    # undeclared bitmask values are legal in requests ("unknown"); more than 64 locations is not
    df = pl.from_arrow(table)
    locs = df["locations"].to_list()
    locs[4] = [f"geo:{i}" for i in range(65)]
    df.with_columns(pl.Series("locations", locs)).write_parquet(path)
    with pytest.raises(InputError, match=r"column 'locations', row 4: holds 65 values; at most 64"):
        read_requests(path, spec)


def write_requests(tmp_path, spec, **columns) -> Path:
    df = pl.from_arrow(sample_requests(30, spec, dim=8, seed=2)).with_columns(**columns)
    path = tmp_path / "requests.parquet"
    df.write_parquet(path)
    return path


def test_request_embedding_beyond_bound_is_refused(tmp_path, spec):
    emb = [[0.5] * 8 for _ in range(30)]
    emb[6][2] = 1e19
    path = write_requests(tmp_path, spec, embedding=pl.Series(emb, dtype=pl.List(pl.Float32)))
    with pytest.raises(InputError, match=r"requests.parquet: column 'embedding', row 6: element 2 is 1e\+19, "
                                         r"beyond the allowed range"):
        read_requests(path, spec, dim=8)


def test_uint64_request_id(tmp_path, spec):
    ids = list(range(2**63 - 30, 2**63))  # all fit int64: accepted
    assert read_requests(write_requests(tmp_path, spec, request_id=pl.Series(ids, dtype=pl.UInt64)), spec
                         ).request_id[-1] == 2**63 - 1
    ids[21] = 2**63
    path = write_requests(tmp_path, spec, request_id=pl.Series(ids, dtype=pl.UInt64))
    with pytest.raises(InputError, match=r"requests.parquet: column 'request_id', row 21: value 9223372036854775808 "
                                         r"does not fit int64"):
        read_requests(path, spec)
