"""The synthetic generator: deterministic, valid under the contracts, and shaped like real catalogs."""

from __future__ import annotations

import numpy as np
import polars as pl
import pyarrow.parquet as pq

from sidindex.ingest import read_catalog
from sidindex.requests import read_requests
from sidindex.sample import sample_catalog, sample_requests
from sidindex.targeting import load_targeting


def test_same_seed_same_files(tmp_path, spec):
    a = sample_catalog(500, spec, dim=8, seed=5)
    b = sample_catalog(500, spec, dim=8, seed=5)
    assert a.equals(b)
    assert not a.equals(sample_catalog(500, spec, dim=8, seed=6))


def test_sample_files_pass_validation(sample_dir):
    spec = load_targeting(sample_dir / "targeting.toml")
    cat = read_catalog(sample_dir / "catalog.parquet", spec=spec, hash_keys=("advertiser_id",))
    req = read_requests(sample_dir / "requests.parquet", spec, dim=cat.embedding.shape[1])
    assert len(cat) == 1200 and len(req) == 50
    assert len(np.unique(cat.ad_id)) == 1200


def test_targeting_is_realistic(spec):
    df = pl.from_arrow(sample_catalog(20000, spec, dim=4, seed=1))
    assert len(spec.attributes[0].values) == 250
    unrestricted = {a.name: float((df[a.name].is_null() | (df[a.name].list.len() == 0)).mean())
                    for a in spec.attributes}
    assert 0.2 < unrestricted["country"] < 0.4 and 0.3 < unrestricted["locations"] < 0.5
    all_free = np.logical_and.reduce([(df[a.name].is_null()).to_numpy() for a in spec.attributes])
    assert 0.005 < all_free.mean() < 0.1, "a share of ads restricts nothing"
    locs = df["locations"].explode().drop_nulls()
    counts = locs.value_counts(sort=True)["count"].to_numpy()
    assert locs.n_unique() > 10000, "a location vocabulary of tens of thousands"
    assert counts[0] > 50 * np.median(counts), "with a heavy head and tail"
    assert df["locations"].list.len().max() >= 100, "some ads target hundreds of locations"
    per_adv = df["advertiser_id"].value_counts()["count"]
    assert per_adv.max() >= 50 and per_adv.mean() > 5


def test_requests_cover_unknown_values_and_location_counts(tmp_path, spec):
    req = pl.from_arrow(sample_requests(2000, spec, dim=4, seed=3))
    n_locs = req["locations"].list.len()
    assert n_locs.min() == 0 and n_locs.max() == 64
    country = req["country"]
    assert 0.02 < country.is_null().mean() < 0.09
    declared = set(spec.attributes[0].values)
    undeclared = country.drop_nulls().filter(~country.drop_nulls().is_in(list(declared)))
    assert 0.005 < len(undeclared) / len(country) < 0.04
    pq.write_table(sample_requests(5, spec, dim=4, seed=3), tmp_path / "r.parquet")
    assert read_requests(tmp_path / "r.parquet", spec).embedding.shape == (5, 4)
