"""Codebook training and artifact, SID assignment (multi-path, hash level), stability."""

from __future__ import annotations

import dataclasses
import json

import mmh3
import numpy as np
import polars as pl
import pyarrow as pa
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sidindex.artifact import seal
from sidindex.config import SIDConfig
from sidindex.errors import ArtifactError
from sidindex.sid import (
    HASH_SEED,
    Codebook,
    assign_sids,
    hash_tokens,
    load_codebook,
    resolve_codebook,
    save_codebook,
    sid_table,
    train_codebook,
)
from tests.conftest import clustered, small_config


@pytest.fixture(scope="module")
def data():
    x = clustered(900, 6, seed=4)
    adv = pl.DataFrame({"advertiser_id": np.random.default_rng(4).integers(0, 40, len(x))})
    cb = train_codebook(x, small_config(paths=3))
    return x, adv, cb


def assign(cb, x, adv):
    return assign_sids(cb, x, hash_tokens(adv, cb.hash_keys, cb.hash_size))


# --- reference: nearest-centroid chains in float64, written independently of the kernel ---

def check_chains(cb: Codebook, x: np.ndarray, a, hash_tok: np.ndarray, rtol: float = 1e-4) -> None:
    x64 = x.astype(np.float64)
    cents = [c.astype(np.float64) for c in cb.centroids]
    d0 = np.sqrt(((x64[:, None] - cents[0][None]) ** 2).sum(-1))  # (N, K0)
    order = np.argsort(d0, axis=1, kind="stable")
    m = min(cb.paths, len(cents[0]))
    for ad in range(len(x)):
        rows = np.flatnonzero(a.ad_index == ad)
        paths = a.path[rows]
        assert list(paths) == list(range(len(paths))), "paths are numbered 0.. in order"
        toks = a.sids[rows].astype(np.int64)
        assert len(set(toks[:, 0])) == len(rows), "distinct first tokens per ad"
        assert (toks[:, -1] == hash_tok[ad]).all(), "every path shares the hash token"
        expected_paths = m
        if cb.path_ratio is not None:
            near = d0[ad, order[ad, :m]]
            expected_paths = int((near <= (1 + cb.path_ratio) * near[0] * (1 + 1e-5)).sum())
            assert len(rows) >= int((near <= (1 + cb.path_ratio) * near[0] * (1 - 1e-5)).sum())
        assert len(rows) <= expected_paths and len(rows) >= (1 if cb.path_ratio is not None else m)
        for j, t in enumerate(toks):
            # path j's first token is the j-th nearest first-level centroid (up to float ties)
            assert abs(d0[ad, t[0]] - d0[ad, order[ad, j]]) <= rtol * (1 + d0[ad, order[ad, j]])
            r = x64[ad] - cents[0][t[0]]
            for lv in range(1, len(cents)):
                d = ((r[None] - cents[lv]) ** 2).sum(-1)
                assert d[t[lv]] <= d.min() + rtol * (1 + d.min()), "each level takes its nearest centroid"
                r = r - cents[lv][t[lv]]


def test_assignment_is_a_valid_nearest_centroid_chain(data):
    x, adv, cb = data
    hash_tok = hash_tokens(adv, cb.hash_keys, cb.hash_size)
    a = assign_sids(cb, x, hash_tok)
    assert a.sids.dtype == np.int16 and a.sids.shape == (3 * len(x), 4)
    for lv, size in enumerate(cb.level_sizes):
        assert 0 <= a.sids[:, lv].min() and a.sids[:, lv].max() < size
    check_chains(cb, x, a, hash_tok)


@settings(max_examples=25, deadline=None)
@given(sizes=st.lists(st.integers(1, 12), min_size=1, max_size=4), dim=st.integers(1, 6),
       paths=st.integers(1, 4), ratio=st.one_of(st.none(), st.floats(0, 0.5)), n=st.integers(1, 60),
       seed=st.integers(0, 10_000))
def test_chains_on_random_codebooks(sizes, dim, paths, ratio, n, seed):
    rng = np.random.default_rng(seed)
    cents = tuple(rng.standard_normal((k, dim)).astype(np.float32) * (0.5 ** lv) for lv, k in enumerate(sizes))
    cb = Codebook(cents, 7, ("k",), min(paths, sizes[0]), ratio, SIDConfig(levels=tuple(sizes), hash_size=7))
    x = rng.standard_normal((n, dim)).astype(np.float32)
    hash_tok = rng.integers(0, 7, n).astype(np.int16)
    a = assign_sids(cb, x, hash_tok)
    assert np.all(np.diff(a.ad_index) >= 0)
    check_chains(cb, x, a, hash_tok)


def test_path_ratio_keeps_only_near_second_centroids(data):
    x, adv, cb = data
    strict = dataclasses.replace(cb, path_ratio=0.05)
    hash_tok = hash_tokens(adv, cb.hash_keys, cb.hash_size)
    a = assign_sids(strict, x, hash_tok)
    check_chains(strict, x, a, hash_tok)
    per_ad = np.bincount(a.ad_index, minlength=len(x))
    assert per_ad.min() == 1 and per_ad.max() > 1
    # an ad has a 2nd path exactly when its 2nd centroid is within 5% of the 1st
    np.testing.assert_array_equal(per_ad >= 2, a.first_ratio <= 1.05)


def test_same_codebook_same_sids_and_adding_ads_changes_nothing(data):
    x, adv, cb = data
    full = assign(cb, x, adv)
    again = assign(cb, x, adv)
    np.testing.assert_array_equal(full.sids, again.sids)
    # the first 500 ads alone, and all ads in reverse order, get the same SIDs per ad
    part = assign(cb, x[:500], adv[:500])
    keep = full.ad_index < 500
    np.testing.assert_array_equal(part.sids, full.sids[keep])
    rev = assign(cb, x[::-1].copy(), adv.reverse())
    back = len(x) - 1 - rev.ad_index
    order = np.lexsort((rev.path, back))
    np.testing.assert_array_equal(rev.sids[order], full.sids)


def test_hash_level_is_mmh3_of_the_keys():
    df = pl.DataFrame({"advertiser_id": [7, 123456789012, 7, -3], "campaign": ["a", "b", "é", "a"]})
    tok = hash_tokens(df, ("advertiser_id",), 512)
    assert tok.dtype == np.int16
    assert list(tok) == [mmh3.hash(str(v), HASH_SEED, signed=False) % 512 for v in df["advertiser_id"]]
    tok2 = hash_tokens(df, ("advertiser_id", "campaign"), 97)
    assert list(tok2) == [mmh3.hash(f"{a}\x1f{c}".encode(), HASH_SEED, signed=False) % 97
                          for a, c in df.iter_rows()]


def test_training_is_deterministic(data):
    x, _, cb = data
    again = train_codebook(x, small_config(paths=3))
    assert again.id == cb.id
    for a, b in zip(cb.centroids, again.centroids):
        assert a.tobytes() == b.tobytes()
    balanced = small_config(balanced=True)
    assert train_codebook(x, balanced).id == train_codebook(x, balanced).id


def test_codebook_round_trips_bit_exactly(tmp_path, data):
    _, _, cb = data
    path = save_codebook(cb, tmp_path)
    assert path == tmp_path / "codebooks" / cb.id
    back = load_codebook(path)
    assert back.id == cb.id and back.level_sizes == cb.level_sizes and back.config == cb.config
    assert back.paths == cb.paths and back.hash_keys == cb.hash_keys and back.notes == cb.notes
    for a, b in zip(cb.centroids, back.centroids):
        assert a.tobytes() == b.tobytes()
    assert save_codebook(cb, tmp_path) == path  # idempotent
    assert resolve_codebook(tmp_path) == path
    assert not list((tmp_path / "codebooks").glob(".tmp-*"))


def test_corrupt_codebooks_are_refused(tmp_path, data):
    _, _, cb = data
    path = save_codebook(cb, tmp_path)
    level = path / "level_1.npy"
    raw = bytearray(level.read_bytes())
    raw[-3] ^= 0x10
    level.write_bytes(bytes(raw))
    with pytest.raises(ArtifactError, match=r"level_1.npy: checksum mismatch"):
        load_codebook(path)
    level.write_bytes(bytes(raw[:-8]))
    with pytest.raises(ArtifactError, match=r"level_1.npy: \d+ bytes, the manifest says \d+ \(truncated"):
        load_codebook(path)


def test_newer_foreign_or_edited_manifests_are_refused(tmp_path, data):
    _, _, cb = data
    path = save_codebook(cb, tmp_path)
    manifest = json.loads((path / "codebook.json").read_text())
    (path / "codebook.json").write_bytes(seal({**manifest, "format_version": 99}))
    with pytest.raises(ArtifactError, match=r"format version 99; this sidindex reads version 2 \(written by a newer"):
        load_codebook(path)
    (path / "codebook.json").write_bytes(seal({**manifest, "level_sizes": [16, 8, 5, 64]}))
    with pytest.raises(ArtifactError, match=r"level_2.npy: holds float32\(4, 6\), expected float32\(5, 6\)"):
        load_codebook(path)
    (path / "codebook.json").write_text(json.dumps({**manifest, "paths": 1}, indent=1, sort_keys=True) + "\n")
    with pytest.raises(ArtifactError, match="codebook manifest is corrupt"):  # edited without its checksum
        load_codebook(path)
    (path / "codebook.json").write_text("{not json")
    with pytest.raises(ArtifactError, match="not valid codebook manifest JSON"):
        load_codebook(path)


def test_version_1_codebooks_stay_readable(tmp_path, data):
    """Codebooks fix a deployed model's SIDs: those written before manifests were sealed still load."""
    _, _, cb = data
    path = save_codebook(cb, tmp_path)
    manifest = json.loads((path / "codebook.json").read_text())
    del manifest["checksum"]
    (path / "codebook.json").write_text(json.dumps({**manifest, "format_version": 1}, indent=2))
    assert load_codebook(path).id == cb.id


def test_root_with_several_codebooks_asks_which(tmp_path, data):
    x, _, cb = data
    save_codebook(cb, tmp_path)
    other = train_codebook(x, small_config(seed=99))
    save_codebook(other, tmp_path)
    with pytest.raises(ArtifactError, match=r"holds 2 codebooks .*pass the directory"):
        resolve_codebook(tmp_path)


@pytest.mark.parametrize("make", [
    lambda rng: rng.standard_normal((1, 5)),                                  # one ad
    lambda rng: rng.standard_normal((7, 5)),                                  # fewer ads than centroids
    lambda rng: np.repeat(rng.standard_normal((3, 5)), 200, axis=0),          # heavy duplicates
    lambda rng: np.zeros((300, 5)),                                           # all identical
])
def test_degenerate_catalogs_build_with_notes(make):
    x = make(np.random.default_rng(0)).astype(np.float32)
    cb = train_codebook(x, small_config(balanced=True))
    assert cb.notes and all(1 <= k for k in cb.level_sizes)
    adv = pl.DataFrame({"advertiser_id": np.arange(len(x))})
    a = assign(cb, x, adv)
    assert len(a.sids) >= len(x)
    for lv, size in enumerate(cb.level_sizes):
        assert a.sids[:, lv].max() < size


def test_sid_table_follows_the_contract(data):
    x, adv, cb = data
    a = assign(cb, x, adv)
    ad_id = np.arange(len(x), dtype=np.int64) * 10 + 1
    t = sid_table(a, ad_id)
    assert t.schema.field("ad_id").type == pa.int64()
    assert t.schema.field("path").type == pa.int8()
    assert t.schema.field("sid").type == pa.list_(pa.int16(), 4)
    assert t.num_rows == len(a.sids)
    np.testing.assert_array_equal(t["ad_id"].to_numpy(), ad_id[a.ad_index])
    np.testing.assert_array_equal(np.stack(t["sid"].to_numpy(zero_copy_only=False)), a.sids)


def _plant(path, name: str, raw: bytes) -> None:
    """Replace a codebook file and reseal its manifest, as a buggy or malicious writer would."""
    from sidindex.artifact import list_files

    (path / name).write_bytes(raw)
    m = json.loads((path / "codebook.json").read_text())
    m["files"] = list_files(path, "codebook.json")
    (path / "codebook.json").write_bytes(seal(m))


def test_crafted_centroid_files_are_refused_before_any_data_is_read(tmp_path, data):
    """A .npy header may claim any shape: it is checked against the manifest and the file's size
    first (no MemoryError, no attribute error on an .npz)."""
    import io

    _, _, cb = data
    path = save_codebook(cb, tmp_path)
    dim = cb.dim
    header = io.BytesIO()
    np.lib.format.write_array_header_1_0(header, {"descr": "<f4", "fortran_order": False, "shape": (10**13, dim)})
    _plant(path, "level_1.npy", header.getvalue())  # magic and header, no data
    with pytest.raises(ArtifactError, match=r"level_1.npy: holds float32\(10000000000000, "):
        load_codebook(path)
    zipped = io.BytesIO()
    np.savez(zipped, c=cb.centroids[1])
    _plant(path, "level_1.npy", zipped.getvalue())
    with pytest.raises(ArtifactError, match="level_1.npy: not a valid array file"):
        load_codebook(path)
    buf = io.BytesIO()
    np.save(buf, cb.centroids[1])
    _plant(path, "level_1.npy", buf.getvalue()[:-4])
    with pytest.raises(ArtifactError, match="level_1.npy: its size does not fit"):
        load_codebook(path)


# --- the BLAS GEMM with certified choices gives the fixed order's SIDs, bit for bit ---

def plain_fixed_order(cb: Codebook, x: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """tokens, kept, first_ratio of every ad by the fixed order, in plain numpy float32 (written
    apart from the kernels): every sum term by term from k = 0 (||c||^2, 2 c.c', then
    ||c||^2 + x_k (-2 c_k)); the top first-level centroids by (score, index); below, base plus
    2 c_p.c over the path's centroids in path order, the first lowest."""
    cat = np.concatenate(cb.centroids).astype(np.float32)
    offs = np.concatenate([[0], np.cumsum([len(c) for c in cb.centroids])])
    norms = np.zeros(len(cat), np.float32)
    cross2 = np.zeros((len(cat), len(cat)), np.float32)
    for k in range(cat.shape[1]):
        norms = norms + cat[:, k] * cat[:, k]
        cross2 = cross2 + cat[:, k:k + 1] * (np.float32(2) * cat[:, k])[None, :]
    minus2 = np.float32(-2) * cat.T
    base = np.broadcast_to(norms, (len(x), len(cat))).copy()
    xnorm = np.zeros(len(x), np.float32)
    for k in range(x.shape[1]):
        base = base + x[:, k:k + 1] * minus2[k][None, :]
        xnorm = xnorm + x[:, k] * x[:, k]
    m, levels = cb.paths, len(cb.centroids)
    top = min(max(m, 2), len(cb.centroids[0]))
    tokens, kept = np.zeros((len(x), m, levels), np.int16), np.zeros((len(x), m), bool)
    first_ratio = np.zeros(len(x), np.float32)
    for i in range(len(x)):
        b0 = base[i, :offs[1]]
        order = np.lexsort((np.arange(len(b0)), b0))[:top]
        dist = [np.sqrt(max(float(xnorm[i] + b0[t]), 0.0)) for t in order]
        if top < 2:
            first_ratio[i] = np.inf
        else:
            first_ratio[i] = dist[1] / dist[0] if dist[0] > 0 else (1.0 if dist[1] == 0 else np.inf)
        for j in range(m):
            kept[i, j] = j < top and (cb.path_ratio is None or j == 0 or dist[j] <= (1.0 + cb.path_ratio) * dist[0])
            if not kept[i, j]:
                continue
            tokens[i, j, 0] = order[j]
            for lv in range(1, levels):
                lo, hi = offs[lv], offs[lv + 1]
                score = base[i, lo:hi]
                for p in range(lv):
                    score = score + cross2[offs[p] + tokens[i, j, p], lo:hi]
                tokens[i, j, lv] = np.argmin(score)
    return tokens, kept, first_ratio


def fixed_order(tables, x: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """tokens, kept, first_ratio of every ad from the fixed-order kernels."""
    from sidindex.sid.assign import _fixed_block

    n, m = len(x), tables.paths
    tokens = np.zeros((n, m, len(tables.offs) - 1), dtype=np.int16)
    kept, ratio = np.empty((n, m), dtype=np.bool_), np.empty(n, dtype=np.float32)
    _fixed_block(tables, np.ascontiguousarray(x, dtype=np.float32), tokens, kept, ratio)
    return tokens, kept, ratio


def assert_same_choices(got, want, where=None) -> None:
    (tok, kept, ratio), (tok_w, kept_w, ratio_w) = got, want
    rows = np.ones(len(kept), dtype=bool) if where is None else where
    np.testing.assert_array_equal(kept[rows], kept_w[rows])
    np.testing.assert_array_equal(ratio[rows].view(np.int32), ratio_w[rows].view(np.int32))  # bits
    np.testing.assert_array_equal(tok[rows][kept[rows]], tok_w[rows][kept_w[rows]])


def tied_codebook(rng, sizes, dim, paths, ratio, scale, repeats):
    """Random centroids, some repeated (exact ties in every order); ads on centroids, on midpoints
    of two centroids, at the origin and random, all times `scale`."""
    cents = []
    for lv, k in enumerate(sizes):
        c = rng.standard_normal((k, dim)) * (0.5 ** lv)
        if repeats and k > 1:
            c[rng.integers(0, k, k // 2)] = c[rng.integers(0, k)]
        cents.append((c * scale).astype(np.float32))
    cb = Codebook(tuple(cents), 7, ("k",), min(paths, sizes[0]), ratio, SIDConfig(levels=tuple(sizes), hash_size=7))
    c0 = cents[0].astype(np.float64)
    pick = rng.integers(0, len(c0), (40, 2))
    x = np.concatenate([c0[pick[:10, 0]],  # on a first-level centroid
                        (c0[pick[10:, 0]] + c0[pick[10:, 1]]) / 2,  # midway between two
                        np.zeros((3, dim)),
                        rng.standard_normal((60, dim)) * scale])
    return cb, np.clip(x, -1e6, 1e6).astype(np.float32)


@settings(max_examples=40, deadline=None)
@given(sizes=st.lists(st.integers(1, 40), min_size=1, max_size=4), dim=st.integers(1, 70),
       paths=st.integers(1, 4), ratio=st.one_of(st.none(), st.floats(0, 0.5)),
       scale=st.sampled_from([1e-40, 1e-30, 1e-20, 1e-3, 1.0, 1e4, 1e6]), repeats=st.booleans(),
       seed=st.integers(0, 10_000))
def test_blas_assignment_equals_the_fixed_order(sizes, dim, paths, ratio, scale, repeats, seed):
    """Ties, midpoints, zero, subnormal embeddings (1e-40) and scores (1e-20, 1e-30) and 1e6-sized
    ones: the BLAS path certifies what it can and hands the rest to the fixed order, and both give
    the plain reference's bits."""
    from sidindex.sid.assign import _assign, _Tables

    cb, x = tied_codebook(np.random.default_rng(seed), sizes, dim, paths, ratio, scale, repeats)
    tables = _Tables.of(cb)
    want = plain_fixed_order(cb, x)
    assert_same_choices(fixed_order(tables, x), want)
    assert_same_choices(_assign(tables, x), want)


def test_blocks_and_threads_give_the_reference_bits(monkeypatch):
    """Several blocks of 1,024 ads on one thread and on every thread, two paths and a path ratio:
    the plain reference's bits, with most ads certified on BLAS's scores (else the fast path is
    idle and the fixed order does all the work)."""
    import numba

    import sidindex.sid.assign as assign_module

    x = clustered(2 * assign_module.BLOCK + 300, 16, seed=9)
    cb = dataclasses.replace(train_codebook(x, small_config(levels=(32, 16, 8), paths=2)), path_ratio=0.2)
    tables = assign_module._Tables.of(cb)
    want = plain_fixed_order(cb, x)
    fixed = assign_module._fixed_block
    redone = []
    monkeypatch.setattr(assign_module, "_fixed_block",
                        lambda t, rows, *out: (redone.append(len(rows)), fixed(t, rows, *out)))
    before = numba.get_num_threads()
    for threads in (1, before):
        numba.set_num_threads(threads)
        try:
            assert_same_choices(assign_module._assign(tables, x), want)
        finally:
            numba.set_num_threads(before)
    assert sum(redone) < 0.1 * 2 * len(x)


def test_certified_choices_hold_for_any_blas_within_the_bound():
    """BLAS scores as far from the fixed order's as the bound allows (each order within `err` of
    the exact sum), adversarially (the fixed order's choices made worse, every rival better) or at
    random, on ads midway between first-level centroids (near ties) and clustered ones: where
    `_certify` is sure its choices are the fixed order's; and it is sure of most ads."""
    from sidindex.sid.assign import UNIT, _certify, _products, _Scratch, _Tables

    rng = np.random.default_rng(11)
    x = clustered(3000, 24, seed=5)
    cb = train_codebook(x, small_config(levels=(32, 16, 8), paths=2))
    c0 = cb.centroids[0]
    pairs = rng.integers(0, len(c0), (600, 2))
    x = np.concatenate([x, (c0[pairs[:, 0]] + c0[pairs[:, 1]]) / 2]).astype(np.float32)
    tables = _Tables.of(cb)
    want = fixed_order(tables, x)
    fixed, xnorm = np.empty((len(x), tables.total), np.float32), np.empty(len(x), np.float32)
    _products(x, tables.minus2, tables.norms, fixed, xnorm)
    d, levels = x.shape[1], len(cb.centroids)
    gamma = (d + 1) * UNIT / (1 - (d + 1) * UNIT)
    err = np.empty_like(fixed, dtype=np.float64)  # each score's level's bound
    for lv, (lo, hi) in enumerate(zip(tables.offs[:-1], tables.offs[1:])):
        scale = tables.bounds[lv, 0] + np.sqrt((x.astype(np.float64) ** 2).sum(1)) * tables.bounds[lv, 1]
        err[:, lo:hi] = (gamma * scale + lv * UNIT * (scale + lv * tables.bounds[lv, 2]))[:, None]
    first = np.zeros_like(fixed, dtype=bool)  # each ad's fixed-order choices at every level
    tok, kept, _ = want
    for lv in range(levels):
        for j in range(tables.paths):
            rows = np.flatnonzero(kept[:, j])
            first[rows, tables.offs[lv] + tok[rows, j, lv]] = True
    for name, sign in [("adversarial", np.where(first, 1.0, -1.0)),
                       ("random", rng.choice([-1.0, 1.0], fixed.shape)),
                       ("uniform", rng.uniform(-1, 1, fixed.shape))]:
        xw = (fixed.astype(np.float64) + 2 * sign * err - tables.norms).astype(np.float32)
        scratch = _Scratch.of(tables, len(x))
        got = (np.zeros_like(tok), np.zeros_like(kept), np.zeros(len(x), np.float32))
        sure = np.zeros(len(x), dtype=bool)
        _certify(xw, x, tables.rows, tables.norms, tables.cross2, tables.offs, tables.bounds, tables.paths,
                 tables.ratio, scratch.score, scratch.lanes, scratch.best, scratch.arg, scratch.margins, *got, sure)
        assert sure.mean() > 0.7, name
        assert_same_choices(got, want, where=sure)


def test_exact_ties_go_to_the_lowest_centroid():
    """Every centroid repeated K/2 places on: each tie is exact in every summation order, and the
    lower index wins it at every level; the second path's first token is the repeat of the first's
    (the next in (distance, index) order). No ad is certain on BLAS's scores here: this is the
    fixed order's rule, reached through both entries."""
    from sidindex.sid.assign import _assign, _Tables

    rng = np.random.default_rng(2)
    half = (24, 12, 6)
    cents = tuple(np.tile(rng.standard_normal((k, 10)).astype(np.float32) * 0.5 ** lv, (2, 1))
                  for lv, k in enumerate(half))
    cb = Codebook(cents, 7, ("k",), 2, None, SIDConfig(levels=tuple(2 * k for k in half), hash_size=7))
    x = rng.standard_normal((2000, 10)).astype(np.float32)
    tables = _Tables.of(cb)
    for tokens, kept, _ in (_assign(tables, x), fixed_order(tables, x)):
        assert kept.all()
        np.testing.assert_array_equal(tokens[:, 1, 0], tokens[:, 0, 0] + half[0])
        assert (tokens[:, 0] < np.array(half)).all() and (tokens[:, 1, 1:] < np.array(half[1:])).all()


def test_an_interrupted_assignment_stops_at_the_running_blocks(monkeypatch):
    """Ctrl-C (here, the progress callback raising) ends the assignment after the blocks already
    queued (at most 4 per worker), not after every block of the catalog."""
    import numba

    import sidindex.sid.assign as assign_module

    blocks = 8 * numba.get_num_threads() + 8
    x = clustered(blocks * assign_module.BLOCK, 8, seed=3)
    cb = train_codebook(x[:2000], small_config())
    ran = []
    kernel = assign_module._certify
    monkeypatch.setattr(assign_module, "_certify", lambda *a: (ran.append(1), kernel(*a)))

    def progress(stage, done, total):
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        assign_sids(cb, x, np.zeros(len(x), np.int16), progress)
    assert 1 <= len(ran) <= 4 * numba.get_num_threads() < blocks
