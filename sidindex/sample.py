"""Synthetic but realistic catalogs, targeting specs and requests.

Embeddings come from a mixture of anisotropic Gaussians with Zipf-sized clusters; targeting is
Zipf-distributed per attribute (most ads restrict some attributes, a share restricts none); the
location vocabulary has tens of thousands of values with a heavy tail; advertisers own many ads each.
Every step is vectorised over ads (loops run over clusters or attributes only), so a 10M-ad
catalog is generated in seconds. Deterministic for a given seed.

Profiles (`PROFILES`): `default` is the catalog above, where a SID holds few ads. `skewed` is the
same catalog with a share of its ads rewritten as bulk advertisers' near-duplicate creatives
(`Bulk`, `bulk_ads`): real catalogs are skewed so, and the ads a SID holds are what the post
stage pays for per beam.
"""

from __future__ import annotations

import string
from dataclasses import dataclass
from pathlib import Path

import numba
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from sidindex.errors import ConfigError
from sidindex.matchers.attribute import Attribute
from sidindex.matchers.bloom import DEFAULT_BLOOM_BITS, DEFAULT_BLOOM_HASHES
from sidindex.targeting import BITMASK, BLOOM, TargetingSpec

_COMMON_COUNTRIES = ["US", "GB", "CA", "DE", "FR", "IN", "BR", "JP", "MX", "ES", "IT", "AU", "KR", "ID", "NL"]
_LANGUAGES = ["en", "es", "pt", "fr", "de", "it", "nl", "ru", "ja", "ko", "zh", "hi", "ar", "tr", "pl",
              "sv", "da", "no", "fi", "cs", "el", "he", "th", "vi", "id", "ms", "tl", "uk", "ro", "hu",
              "bn", "ta", "te", "mr", "ur", "fa", "sw", "af", "ca", "hr"]


@dataclass(frozen=True)
class _Restriction:
    """How ads restrict one attribute: share of restricted ads and list length distribution."""

    share: float       # probability that an ad restricts this attribute
    mean_len: float    # mean number of values of a restricted ad (geometric, >= 1)
    zipf: float        # popularity skew of the values


_RESTRICTIONS = {
    "country": _Restriction(0.7, 3.0, 1.1),
    "age": _Restriction(0.5, 2.5, 0.5),
    "gender": _Restriction(0.3, 1.0, 0.3),
    "language": _Restriction(0.4, 1.5, 1.2),
    "platform": _Restriction(0.3, 1.5, 0.6),
    "locations": _Restriction(0.6, 10.0, 1.05),
}


@dataclass(frozen=True)
class Bulk:
    """The `skewed` profile: bulk advertisers whose creatives are near-duplicates.

    A real catalog holds large advertisers' near-identical creatives (one product photo, a dozen
    captions). The codebook is frozen between trainings and the final SID level is a hash of
    `advertiser_id`, so all of one advertiser's near-duplicates share one SID per path: on a
    held-out catalog 3,000 such creatives built against an earlier codebook gave one SID holding
    all 3,000. Here round(share * n) ads, chosen at random, become bulk creatives of A =
    ceil(share * n / mean_size) new advertisers (ids after the default's), sized by a Zipf law
    (rank^-zipf, drawn multinomially), each ad its advertiser's embedding (a random catalog ad's)
    plus Gaussian noise of `noise` per dimension, so that residual k-means gives all of them one
    semantic path (per first-level path) and the hash one SID. Everything else (the other ads,
    the bulk ads' ad_id, value and targeting) is the default catalog's, drawn as it draws them.

    The largest SID grows about as (share * n)^zipf, and the 1,024 largest (both paths of the 512
    largest advertisers) hold at most 2 * share * n ads. Measured (32 dims, a 512/512/512 + 512
    codebook trained on the catalog, 2 paths; default in brackets), the largest SID holds 31 ads at
    2,000 ads (4), 83 at 20,000 (1), 836 at 1M (9) and 5,468 at 15M (120); the 1,024 largest hold
    30,867 at 1M (2,476) and 204,759 at 15M (14,604). Real catalogs measured 27,444 at 1M (largest
    477) and 298,175 at 15M.
    """

    share: float = 0.015     # of the catalog's ads, bulk creatives
    mean_size: float = 40.0  # creatives per bulk advertiser on average (sets how many advertisers)
    zipf: float = 0.7        # advertiser sizes ~ rank^-zipf
    noise: float = 1e-3      # per-dimension std of a creative around its advertiser's embedding


# the catalog profiles by name: None is the default catalog
PROFILES: dict[str, Bulk | None] = {"default": None, "skewed": Bulk()}
_BULK_STREAM = 0xB01C  # the bulk plan's own random stream: the default's draws stay as they are


def check_profile(profile: str) -> Bulk | None:
    """The `Bulk` of a profile name (None for `default`); a ConfigError for an unknown name."""
    if profile not in PROFILES:
        raise ConfigError(f"unknown catalog profile {profile!r}; expected one of {', '.join(PROFILES)}")
    return PROFILES[profile]


@dataclass(frozen=True)
class BulkAds:
    """Which ads of an n-ad catalog are bulk creatives (`Bulk`), and whose.

    rows:     (K,) int64 catalog rows, distinct, in random order
    group:    (K,) int64 each row's bulk advertiser in [0, A)
    base_row: (A,) int64 per advertiser the catalog row whose (default) embedding it takes, distinct
    """

    rows: np.ndarray
    group: np.ndarray
    base_row: np.ndarray


def bulk_ads(n: int, seed: int, bulk: Bulk) -> BulkAds:
    """The bulk plan of the n-ad catalog of `seed` (what `sample_catalog` rewrites), from a
    random stream of its own: the same for any dim, spec or caller."""
    rng = np.random.default_rng([seed, _BULK_STREAM])
    k = min(n, int(round(bulk.share * n)))
    a = max(1, int(np.ceil(k / bulk.mean_size))) if k else 0
    rows = rng.choice(n, size=k, replace=False).astype(np.int64)
    sizes = rng.multinomial(k, zipf_weights(a, bulk.zipf)) if a else np.zeros(0, np.int64)
    group = np.repeat(np.arange(a, dtype=np.int64), sizes)
    base_row = rng.choice(n, size=a, replace=False).astype(np.int64)
    return BulkAds(rows, group, base_row)


def sample_spec(n_countries: int = 250, bloom_bits: int = DEFAULT_BLOOM_BITS) -> TargetingSpec:
    """The sample targeting spec: five bitmask attributes and one bloom attribute (locations)."""
    letters = string.ascii_uppercase
    others = [a + b for a in letters for b in letters if a + b not in _COMMON_COUNTRIES and a + b != "ZZ"]
    rng = np.random.default_rng(7)
    countries = _COMMON_COUNTRIES + list(rng.permutation(others)[: n_countries - len(_COMMON_COUNTRIES)])
    return TargetingSpec((
        Attribute("country", BITMASK, values=tuple(str(c) for c in countries)),
        Attribute("age", BITMASK, values=("13-17", "18-24", "25-34", "35-44", "45-54", "55-64", "65+")),
        Attribute("gender", BITMASK, values=("female", "male", "other")),
        Attribute("language", BITMASK, values=tuple(_LANGUAGES)),
        Attribute("platform", BITMASK, values=("android", "ios", "web", "ctv", "desktop")),
        Attribute("locations", BLOOM, bits=bloom_bits, hashes=DEFAULT_BLOOM_HASHES),
    ))


def location_vocabulary(n: int = 40000) -> np.ndarray:
    """(n,) object array of location strings, most popular first."""
    return np.array([f"geo:{i:05d}" for i in range(n)], dtype=object)


def zipf_weights(n: int, s: float) -> np.ndarray:
    w = 1.0 / np.arange(1, n + 1) ** s
    return w / w.sum()


def sample_embeddings(n: int, dim: int, rng: np.random.Generator, n_clusters: int | None = None) -> np.ndarray:
    """(n, dim) float32 embeddings from a hierarchical mixture of anisotropic Gaussians.

    Topics (spread 1 per dim) hold clusters (offsets 0.5), which hold points with a randomly
    rotated, decaying spectrum (about 2 / sqrt(i) on axis i); cluster sizes are Zipf. The
    within-cluster spread is comparable to the quantisation error of a 512^3 codebook, so SIDs do
    not collapse onto clusters (real embeddings are not a few tight blobs): at 1M ads x 64 dims
    about 40% of ads share their three semantic tokens with another ad, 2% their whole SID
    (bench/bench_sid.py).
    """
    n_clusters = n_clusters or max(4, min(4096, n // 400))
    n_topics = max(2, int(np.sqrt(n_clusters)))
    topics = rng.standard_normal((n_topics, dim)).astype(np.float32)
    centres = (topics[rng.integers(0, n_topics, n_clusters)]
               + 0.5 * rng.standard_normal((n_clusters, dim)).astype(np.float32))
    cluster = rng.choice(n_clusters, size=n, p=zipf_weights(n_clusters, 0.8))
    order = np.argsort(cluster, kind="stable")
    bounds = np.searchsorted(cluster[order], np.arange(n_clusters + 1))
    x = np.empty((n, dim), dtype=np.float32)
    spectrum = (1.0 / np.sqrt(np.arange(1, dim + 1))).astype(np.float32)
    for c in range(n_clusters):  # per cluster: a random rotation of a decaying spectrum
        rows = order[bounds[c]: bounds[c + 1]]
        if not len(rows):
            continue
        q, _ = np.linalg.qr(rng.standard_normal((dim, dim)))
        scale = spectrum * np.float32(np.exp(rng.normal(np.log(2.0), 0.3)))
        z = rng.standard_normal((len(rows), dim)).astype(np.float32) * scale
        x[rows] = centres[c] + z @ q.astype(np.float32)
    return x


def _restricted_lists(n: int, vocab_size: int, r: _Restriction, rng: np.random.Generator,
                      heavy_tail: bool = False) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Targeting lists for n ads over values 0..vocab_size-1.

    Returns (offsets (n+1,) int64, values (T,) int64, valid (n,) bool), where valid=False marks an
    unrestricted ad (null list).
    """
    restricted = rng.random(n) < r.share
    if heavy_tail:  # lognormal lengths: most ads a handful, a few hundreds
        lengths = np.ceil(rng.lognormal(np.log(r.mean_len) - 0.5, 1.0, n)).astype(np.int64)
    else:
        lengths = rng.geometric(1.0 / r.mean_len, n).astype(np.int64)
    lengths = np.where(restricted, np.minimum(lengths, vocab_size), 0)
    offsets, values = _distinct_draws(lengths, vocab_size, zipf_weights(vocab_size, r.zipf), rng)
    return offsets, values, restricted


def _distinct_draws(lengths: np.ndarray, vocab_size: int, p: np.ndarray,
                    rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """Per row i, up to lengths[i] distinct values drawn with popularity p (2x oversampled, first
    occurrences kept in draw order). Returns (offsets (n+1,) int64, values (T,) int64)."""
    draws_per_row = 2 * lengths + 2
    draw_offsets = np.zeros(len(lengths) + 1, dtype=np.int64)
    np.cumsum(draws_per_row, out=draw_offsets[1:])
    cdf = np.cumsum(p)
    draws = np.minimum(np.searchsorted(cdf, rng.random(int(draw_offsets[-1])) * cdf[-1]), vocab_size - 1)
    offsets = np.zeros(len(lengths) + 1, dtype=np.int64)
    values = np.empty(int(lengths.sum()), dtype=np.int64)
    used = _first_distinct(draws, draw_offsets, lengths.astype(np.int64), vocab_size, values, offsets)
    return offsets, values[:used]


@numba.njit(cache=True)
def _first_distinct(draws: np.ndarray, draw_offsets: np.ndarray, lengths: np.ndarray, vocab_size: int,
                    values: np.ndarray, offsets: np.ndarray) -> int:
    seen = np.full(vocab_size, -1, dtype=np.int64)  # row that last took each value
    k = 0
    for r in range(len(lengths)):
        offsets[r] = k
        taken = 0
        for i in range(draw_offsets[r], draw_offsets[r + 1]):
            if taken == lengths[r]:
                break
            v = draws[i]
            if seen[v] != r:
                seen[v] = r
                values[k] = v
                k += 1
                taken += 1
    offsets[len(lengths)] = k
    return k


def _list_array(offsets: np.ndarray, codes: np.ndarray, valid: np.ndarray, vocab: np.ndarray) -> pa.Array:
    # strings are materialised by Arrow from a dictionary, never as Python objects per value
    values = pa.DictionaryArray.from_arrays(pa.array(codes.astype(np.int32)), pa.array(list(vocab), type=pa.string()))
    return pa.ListArray.from_arrays(pa.array(offsets.astype(np.int32)), values.cast(pa.string()), mask=pa.array(~valid))


def sample_catalog(n: int, spec: TargetingSpec, *, dim: int = 64, seed: int = 0,
                   n_locations: int = 40000, profile: str = "default") -> pa.Table:
    """A catalog table of `n` ads following `schemas.CATALOG` for `spec`.

    profile: a name in `PROFILES`: "default", or "skewed" (the default catalog with a share of its
             ads rewritten as bulk advertisers' near-duplicate creatives, `Bulk`: some SIDs then
             hold hundreds to thousands of ads)
    """
    bulk = check_profile(profile)
    rng = np.random.default_rng(seed)
    ad_id = 1 + rng.choice(2**53 - 1, size=n, replace=False)  # unique, in random order
    emb = sample_embeddings(n, dim, rng)
    n_adv = max(1, n // 25)
    advertiser = 100000 + rng.choice(n_adv, size=n, p=zipf_weights(n_adv, 0.9)).astype(np.int64)
    if bulk is not None:
        _make_bulk(emb, advertiser, bulk_ads(n, seed, bulk), bulk, np.random.default_rng([seed, _BULK_STREAM, 1]),
                   first_id=100000 + n_adv)
    cols: dict[str, pa.Array] = {
        "ad_id": pa.array(ad_id),
        "advertiser_id": pa.array(advertiser),
        "embedding": pa.FixedSizeListArray.from_arrays(pa.array(emb.reshape(-1)), dim),
        "value": pa.array(rng.lognormal(0.0, 1.0, n)),
    }
    locations = location_vocabulary(n_locations)
    for a in spec.attributes:
        r = _RESTRICTIONS.get(a.name, _Restriction(0.5, 2.0, 1.0))
        vocab = np.array(a.values, dtype=object) if a.kind == BITMASK else locations
        offsets, codes, valid = _restricted_lists(n, len(vocab), r, rng, heavy_tail=a.kind == BLOOM)
        cols[a.name] = _list_array(offsets, codes, valid, vocab)
    return pa.table(cols)


def _make_bulk(emb: np.ndarray, advertiser: np.ndarray, plan: BulkAds, bulk: Bulk, rng: np.random.Generator,
               first_id: int) -> None:
    """Rewrite the plan's rows in place: emb (N, D) float32 to their advertiser's embedding plus
    noise, advertiser (N,) int64 to first_id + their bulk advertiser."""
    base = emb[plan.base_row]  # a copy, taken before any row is rewritten
    noise = rng.standard_normal((len(plan.rows), emb.shape[1])).astype(np.float32) * np.float32(bulk.noise)
    emb[plan.rows] = base[plan.group] + noise
    advertiser[plan.rows] = first_id + plan.group


def sample_requests(n: int, spec: TargetingSpec, *, dim: int = 64, seed: int = 1,
                    n_locations: int = 40000, max_values: int = 64,
                    catalog_embedding: np.ndarray | None = None) -> pa.Table:
    """A request table of `n` requests following `schemas.REQUESTS`.

    Bitmask values are Zipf-drawn; 5% are null and 2% an undeclared value (both mean "unknown").
    Each request has 0..max_values locations. Embeddings lie near catalog embeddings when given.
    """
    rng = np.random.default_rng(seed)
    cols: dict[str, pa.Array] = {"request_id": pa.array(np.arange(1, n + 1, dtype=np.int64))}
    locations = location_vocabulary(n_locations)
    for a in spec.attributes:
        r = _RESTRICTIONS.get(a.name, _Restriction(0.5, 2.0, 1.0))
        if a.kind == BITMASK:
            vals = np.array(a.values, dtype=object)[rng.choice(len(a.values), n, p=zipf_weights(len(a.values), r.zipf))]
            u = rng.random(n)
            vals[u < 0.02] = "ZZ" if a.name == "country" else "unknown-value"
            cols[a.name] = pa.array(vals.tolist(), mask=u > 0.95, type=pa.string())
        else:
            lengths = rng.integers(0, max_values + 1, n)
            offsets, codes = _distinct_draws(lengths, len(locations), zipf_weights(len(locations), r.zipf), rng)
            cols[a.name] = _list_array(offsets, codes, np.ones(n, bool), locations)
    if catalog_embedding is not None and len(catalog_embedding):
        base = catalog_embedding[rng.integers(0, len(catalog_embedding), n)]
        emb = base + rng.normal(0, 0.1, base.shape).astype(np.float32)
    else:
        emb = sample_embeddings(n, dim, rng)
    cols["embedding"] = pa.FixedSizeListArray.from_arrays(pa.array(emb.astype(np.float32).reshape(-1)), emb.shape[1])
    return pa.table(cols)


def write_sample(out: str | Path, n_ads: int, n_requests: int, *, dim: int = 64, seed: int = 0,
                 profile: str = "default") -> dict[str, Path]:
    """Write catalog.parquet, requests.parquet and targeting.toml under `out`; returns their paths.
    profile: the catalog's (`sample_catalog`, `PROFILES`); the requests lie near its ads either way."""
    from sidindex.targeting import write_targeting

    check_profile(profile)  # before anything is written
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    spec = sample_spec()
    catalog = sample_catalog(n_ads, spec, dim=dim, seed=seed, profile=profile)
    emb = catalog.column("embedding").combine_chunks().flatten().to_numpy().reshape(n_ads, dim)
    requests = sample_requests(n_requests, spec, dim=dim, seed=seed + 1, catalog_embedding=emb)
    paths = {"catalog": out / "catalog.parquet", "requests": out / "requests.parquet",
             "targeting": out / "targeting.toml"}
    pq.write_table(catalog, paths["catalog"])
    pq.write_table(requests, paths["requests"])
    write_targeting(spec, paths["targeting"])
    return paths
