"""The synthetic generator: deterministic, valid under the contracts, and shaped like real catalogs;
its default profile unchanged, its skewed profile collapsing bulk advertisers' ads into one SID."""

from __future__ import annotations

import hashlib
import json

import numpy as np
import polars as pl
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from sidindex.errors import ConfigError
from sidindex.ingest import read_catalog
from sidindex.job import run_build
from sidindex.requests import read_requests
from sidindex.sample import PROFILES, bulk_ads, sample_catalog, sample_requests, write_sample
from sidindex.snapshot import open_snapshot
from sidindex.targeting import load_targeting
from tests.conftest import run_cli


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


def exact_digest(table: pa.Table) -> str:
    """sha256 of a table's integer and string columns (values, list lengths, nulls), in order."""
    h = hashlib.sha256()
    for name in table.column_names:
        col = table.column(name).combine_chunks()
        if pa.types.is_floating(col.type) or pa.types.is_fixed_size_list(col.type):
            continue
        h.update(name.encode())
        if pa.types.is_list(col.type):
            h.update(np.asarray(col.is_null()).tobytes())
            h.update(np.asarray(col.value_lengths().fill_null(0)).astype(np.int64).tobytes())
            col = col.flatten()
        if pa.types.is_string(col.type):
            h.update(np.asarray(col.is_null()).tobytes())
            h.update("\x1f".join(col.fill_null("").to_pylist()).encode())
        else:
            h.update(np.ascontiguousarray(col.to_numpy()).tobytes())
    return h.hexdigest()


def float_figures(table: pa.Table) -> list[float]:
    """The embeddings' sum and absolute sum, the first and last rows; the values' sum, first and last."""
    emb = table.column("embedding").combine_chunks()
    e = emb.flatten().to_numpy().reshape(len(emb), -1).astype(np.float64)
    out = [e.sum(), np.abs(e).sum(), *e[0], *e[-1]]
    if "value" in table.column_names:
        v = table.column("value").to_numpy()
        out += [v.sum(), v[0], v[-1]]
    return [float(x) for x in out]


# What the generator gave before catalog profiles existed (the default's random stream must stay
# as it was): integer and string columns exactly; floats to 1e-5 (the embeddings go through a QR
# factorisation, whose last bits BLAS may round otherwise on another CPU).
CATALOG_5 = ("cc7ce34b76cf1542657e6f81035294753cadda2fefe4c7f03e95041fd5a650d0", [
    -4926.334501613397, 33113.92898121523, -1.8611598014831543, 1.3965332508087158, 2.3452417850494385,
    4.1176300048828125, -2.1126224994659424, -2.3631539344787598, -3.4113521575927734, 2.9987781047821045,
    0.05099153518676758, 3.1493115425109863, -2.7961297035217285, 4.640547752380371, -1.6678218841552734,
    -3.238435983657837, -0.07136937975883484, 2.3099944591522217, 4999.300599254042, 0.8116076018544047,
    8.44634612309878])
WRITTEN_2 = {
    "catalog": ("91b02729fa10c693e6be37535aae9896102ba003a8c5fac1a632885c1e0d13d2", [
        -226.11329280398786, 6906.231236508116, 0.38967078924179077, 0.6279307007789612, 0.5719659328460693,
        -0.5535027980804443, -1.8912807703018188, 0.8914072513580322, 1.3489525318145752, 0.26445624232292175,
        0.780132532119751, -2.4936256408691406, -0.387933611869812, -2.2543277740478516, 1.1244428157806396,
        1.642815351486206, 0.040607012808322906, 1.6381555795669556, 1228.6951692491712, 1.9503406151803084,
        1.2770740728136936]),
    "requests": ("cb08231c4fa7cef78f8a176e6140d7d498afc2f230948fb70cbe09c449288d0b", [
        -112.61111697927117, 1004.0839436873794, 0.6414568424224854, 0.5804417133331299, -0.06146063655614853,
        -0.2627197802066803, -1.4243135452270508, 0.4557068347930908, 0.38826844096183777, 0.6420601010322571,
        1.1188406944274902, 0.42527511715888977, 0.5082566738128662, -1.0522406101226807, -0.9774274826049805,
        0.5798085927963257, 0.5984665751457214, -0.0658421739935875]),
}
TARGETING_SHA256 = "8f717c42e06199528cb024f947dbbdc86e3c28cb67a8e3760119b9f580dbc1f0"


def test_default_profile_is_unchanged(tmp_path, spec):
    for table in (sample_catalog(3000, spec, dim=8, seed=5), sample_catalog(3000, spec, dim=8, seed=5,
                                                                           profile="default")):
        assert exact_digest(table) == CATALOG_5[0]
        np.testing.assert_allclose(float_figures(table), CATALOG_5[1], rtol=1e-5)
    paths = write_sample(tmp_path, 700, 90, dim=8, seed=2)
    for kind, (digest, figures) in WRITTEN_2.items():
        table = pq.read_table(paths[kind])
        assert exact_digest(table) == digest, kind
        np.testing.assert_allclose(float_figures(table), figures, rtol=1e-5, err_msg=kind)
    assert hashlib.sha256(paths["targeting"].read_bytes()).hexdigest() == TARGETING_SHA256


def frame(table: pa.Table) -> pl.DataFrame:
    df = pl.from_arrow(table)
    assert isinstance(df, pl.DataFrame)
    return df


def embeddings(table: pa.Table) -> np.ndarray:
    col = table.column("embedding").combine_chunks()
    return col.flatten().to_numpy().reshape(len(col), -1)


def test_skewed_profile_rewrites_only_bulk_ads(spec):
    n, seed = 5000, 5
    default_table = sample_catalog(n, spec, dim=8, seed=seed)
    skewed_table = sample_catalog(n, spec, dim=8, seed=seed, profile="skewed")
    default, skewed = frame(default_table), frame(skewed_table)
    bulk = PROFILES["skewed"]
    assert bulk is not None
    plan = bulk_ads(n, seed, bulk)
    assert len(plan.rows) == round(bulk.share * n) and len(np.unique(plan.rows)) == len(plan.rows)
    assert skewed.drop("embedding", "advertiser_id").equals(default.drop("embedding", "advertiser_id"))  # targeting too
    others = np.setdiff1d(np.arange(n), plan.rows)
    assert skewed[others].equals(default[others])
    adv = skewed["advertiser_id"].to_numpy()
    assert not np.isin(adv[plan.rows], default["advertiser_id"].to_numpy()).any()  # advertisers of their own
    assert np.array_equal(adv[plan.rows] - adv[plan.rows].min(), plan.group - plan.group.min())
    emb, base = embeddings(skewed_table), embeddings(default_table)[plan.base_row]
    assert np.abs(emb[plan.rows] - base[plan.group]).max() < 10 * bulk.noise  # near-duplicates of one ad
    with pytest.raises(ConfigError, match="unknown catalog profile 'zipf'; expected one of default, skewed"):
        sample_catalog(10, spec, profile="zipf")


def test_sample_profile_through_the_cli(tmp_path):
    out = tmp_path / "skewed"
    r = run_cli("sample", "--out", out, "--ads", 2000, "--requests", 20, "--dim", 8, "--profile", "skewed", "--json")
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["profile"] == "skewed"
    adv = pq.read_table(out / "catalog.parquet").column("advertiser_id").to_numpy()
    assert np.unique(adv, return_counts=True)[1].max() >= 20  # a bulk advertiser's near-duplicates
    bad = run_cli("sample", "--out", tmp_path / "bad", "--profile", "zipf")
    assert bad.returncode == 2 and len(bad.stderr.strip().splitlines()) == 1, bad.stderr
    assert "unknown catalog profile 'zipf'" in bad.stderr and not (tmp_path / "bad").exists()


def test_help_states_the_skewed_profiles_parameters():
    from sidindex_cli.build import sample

    bulk = PROFILES["skewed"]
    assert bulk is not None and sample.__doc__ is not None
    said = " ".join(sample.__doc__.split())
    assert f"{bulk.share:.1%} of the ads" in said and f"{bulk.mean_size:g} creatives each" in said
    assert f"exponent {bulk.zipf:g}" in said and f"noise of {bulk.noise:g} per dimension" in said


def largest_sid(tmp_path, profile: str, n: int, seed: int) -> int:
    """The most ads one SID holds in a snapshot built from `write_sample`'s catalog (the built-in
    SID defaults: levels shrink to what the catalog can train)."""
    write_sample(tmp_path / profile, n, 10, dim=16, seed=seed, profile=profile)
    root = tmp_path / profile / "root"
    run_build(tmp_path / profile / "catalog.parquet", tmp_path / profile / "targeting.toml", root)
    return int(np.diff(open_snapshot(root, verify=False).gtm.leaf_ad_offsets).max())


def test_skewed_catalog_puts_a_bulk_advertiser_in_one_sid(tmp_path):
    """Built end to end (the codebook trained on the same catalog), a bulk advertiser's
    near-duplicates share one SID, far above the default catalog's largest."""
    n, seed = 3000, 3
    bulk = PROFILES["skewed"]
    assert bulk is not None
    biggest = int(np.bincount(bulk_ads(n, seed, bulk).group).max())
    default, skewed = largest_sid(tmp_path, "default", n, seed), largest_sid(tmp_path, "skewed", n, seed)
    assert skewed >= biggest >= 15  # all of its ads in one SID
    assert skewed >= 5 * default, (skewed, default)
