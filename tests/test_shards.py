"""Sharded snapshots (docs/design.md §18): shards joined are the one trie of the catalog, whatever
their count and the threads that built them; a sharded snapshot retrieves exactly what one shard
does in every mode; an update rewrites only the shards it touches and links the rest; a loader
beside the base neither re-verifies nor re-joins what the base holds. The files of every shard are
fuzzed in test_snapshot_fuzz.py, and the Ray engine's shards are compared in test_scaleout.py."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import polars as pl
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import runtime
from schemas.artifacts import ARRAYS_BY_NAME, SHARDS_DIR, shard_dir
from sidindex.artifact import same_file
from sidindex.errors import ArtifactError, ConfigError
from sidindex.explain import Explainer
from sidindex.job import run_update
from sidindex.snapshot import open_snapshot
from sidindex.trie.build import build_gtm
from sidindex.trie.shard import (
    SID_ROWS_PER_SHARD,
    build_shards,
    default_shards,
    join_shards,
    part_bounds,
    shard_bounds,
)
from tests.conftest import run_cli
from tests.test_scaleout import trie_inputs
from tests.test_snapshot import reseal

CONFIG = ('[sid]\nlevels = [16, 4, 4]\nhash_size = 32\npaths = 2\nmin_points_per_centroid = 4\n'
          '[kway]\nmode = "dynamic"\nk_max = 3\n')
MODES = ("none", "cd", "cd+gtm", "cd+gtm+kway")
BEAMS = (1, 8, 64, 1024)  # wider than every depth: every eligible ad of every mode
DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])  # the kernels run on both


def _rows(g, planes=True) -> dict:
    """Every array of an index, matcher tables read through their indexes (a row per entry and
    partition): what retrieval reads, whatever the tables' order and sharing."""
    out = {n: np.asarray(a) for n, a in g.arrays().items() if "table" not in n and "index" not in n}
    for p in g.planes if planes else ():
        out[f"{p.name} rows"] = np.asarray(p.table)[p.index]
        if p.part_index is not None:
            out[f"part {p.name} rows"] = np.asarray(p.table)[p.part_index]
    return out


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(trie_inputs(), st.integers(1, 9), st.integers(1, 3))
def test_joined_shards_are_the_whole_trie(inputs, shards, workers):
    sids, ad_index, sizes, rows, value, kway = inputs
    whole = build_gtm(sids, ad_index, sizes, rows, kway=kway, ad_value=value, matcher_bits=70)
    got = build_shards(sids, ad_index, sizes, rows, shards=shards, kway=kway, ad_value=value, matcher_bits=70,
                       workers=workers)
    assert got[0].lo == 0 and got[-1].hi == sizes[0] and all(a.hi == b.lo for a, b in zip(got, got[1:]))
    assert 1 <= len(got) <= shards
    joined, want = _rows(join_shards(got)), _rows(whole)
    assert joined.keys() == want.keys()
    for name, a in want.items():
        assert joined[name].dtype == a.dtype and np.array_equal(joined[name], a), name
    for s in got:  # a shard is the trie of its own SID rows, over catalog rows
        mine = (sids[:, 0] >= s.lo) & (sids[:, 0] < s.hi)
        assert s.sid_rows == mine.sum() > 0
        own = build_gtm(sids[mine], ad_index[mine], sizes, rows, kway=kway, ad_value=value, matcher_bits=70)
        assert all(np.array_equal(np.asarray(a), np.asarray(own.arrays()[n])) for n, a in s.gtm.arrays().items())
    one = build_shards(sids, ad_index, sizes, rows, shards=shards, kway=kway, ad_value=value, matcher_bits=70)
    assert [(s.lo, s.hi) for s in one] == [(s.lo, s.hi) for s in got]  # threads change nothing
    for a, b in zip(one, got):
        assert all(np.array_equal(np.asarray(x), np.asarray(b.gtm.arrays()[n])) for n, x in a.gtm.arrays().items())


def test_shard_bounds_cover_every_token_and_the_default_count_follows_the_catalog():
    held = np.array([0, 0, 5, 0, 3, 3, 0, 9, 0, 0])
    for k in range(1, 12):
        b = shard_bounds(held, k)
        assert b[0] == 0 and b[-1] == len(held) and np.all(np.diff(b) > 0) and len(b) - 1 <= k
        assert all(held[lo:hi].sum() > 0 for lo, hi in zip(b[:-1], b[1:]))  # every shard holds SID rows
    assert default_shards(10, 256) == 1 and default_shards(SID_ROWS_PER_SHARD + 1, 256) == 2
    for k in range(1, 6):  # the Ray engine's parts: inside the shards, about as many as asked
        b = shard_bounds(held, k)
        for parts in range(1, 12):
            cuts, first = part_bounds(held, b, parts)
            assert np.array_equal(cuts[first], b) and np.all(np.diff(cuts) > 0)
            assert all(held[lo:hi].sum() > 0 for lo, hi in zip(cuts[:-1], cuts[1:]))
    assert default_shards(10**12, 256) == 256  # one first-level token each at most


@pytest.fixture(scope="module")
def roots(sample_dir, tmp_path_factory):
    """The sample catalog's first 1,500 ads built twice (k-way on, values): one shard and five."""
    base = tmp_path_factory.mktemp("shards")
    pl.read_parquet(sample_dir / "catalog.parquet").head(1500).write_parquet(base / "catalog.parquet")
    (base / "build.toml").write_text(CONFIG)
    out = {}
    for shards in (1, 5):  # one codebook: the first build trains it, the second is given it
        codebook = ["--codebook", base / "root1"] if out else []
        r = run_cli("build", "--catalog", base / "catalog.parquet", "--targeting", sample_dir / "targeting.toml",
                    "--out", base / f"root{shards}", "--config", base / "build.toml", "--shards", str(shards),
                    *codebook, "--json")
        assert r.returncode == 0, r.stderr
        assert json.loads(r.stdout)["shards"] == shards
        out[shards] = base / f"root{shards}"
    return base, out


def _retrieved(root: Path, requests: Path, device: str) -> dict:
    index = runtime.load(root, device)
    reqs = runtime.read_requests(requests, index)
    out = {m: runtime.retrieve(index, reqs, mode=m, beams=BEAMS).table(reqs.request_id) for m in MODES}
    out["value-guided"] = runtime.retrieve(index, reqs, mode="cd+gtm", beams=BEAMS, value_weight=0.5).table(
        reqs.request_id)
    return out


@pytest.mark.parametrize("device", DEVICES)
def test_a_sharded_snapshot_retrieves_what_one_shard_does(roots, sample_dir, device):
    base, out = roots
    five = open_snapshot(out[5], verify=True, strong=True, cover=True)
    assert len(five.shards) == 5 and sorted(p.name for p in (five.path / SHARDS_DIR).iterdir()) == [
        Path(shard_dir(k)).name for k in range(5)]
    assert open_snapshot(out[1]).codebook.id == five.codebook.id
    requests = sample_dir / "requests.parquet"
    # each device against itself: the codebook scorer's fused step on CUDA agrees with the CPU's
    # to a few units in float32's last place (docs/kernels.md), which may reorder near-equal SIDs
    one, many = _retrieved(out[1], requests, device), _retrieved(out[5], requests, device)
    for m in one:
        assert many[m].num_rows > 0 and many[m].equals(one[m]), m
    seen: dict[str, np.ndarray] = {}
    open_snapshot(out[5], while_checking=seen.update)  # several shards: only what is not joined goes early
    assert seen.keys() == {n for n in five.arrays() if ARRAYS_BY_NAME[n].scope != "shard"} and "ads" in seen
    r = run_cli("inspect", out[5], "--json")
    info = json.loads(r.stdout)
    assert r.returncode == 0 and len(info["shards"]) == 5
    assert [s["tokens"] for s in info["shards"]] == [[s.lo, s.hi] for s in five.shards]
    assert sum(s["sid_rows"] for s in info["shards"]) == info["sid_rows"]
    assert sum(s["nodes"] - 1 for s in info["shards"]) == info["nodes"] - 1


def test_explanations_do_not_depend_on_the_shards(roots, sample_dir):
    """`sidindex explain`'s answers, per SID and per ad, are the one trie's."""
    _, out = roots
    one, five = open_snapshot(out[1]), open_snapshot(out[5])
    reqs = runtime.read_requests(sample_dir / "requests.parquet", runtime.load_index(one, "cpu")).head(3)
    sids = one.gtm.leaf_sids(np.arange(0, one.gtm.num_leaves, max(1, one.gtm.num_leaves // 40)))
    for r in range(len(reqs)):
        a, b = Explainer(one, reqs, r), Explainer(five, reqs, r)
        for sid in sids:
            key = tuple(int(t) for t in sid)
            assert a.sid(key).to_dict() == b.sid(key).to_dict(), key
        for ad in one.ad_id[:20]:
            assert [e.to_dict() for e in a.ad(int(ad))] == [e.to_dict() for e in b.ad(int(ad))]


def _like(pool: pl.DataFrame, row: int, ad_id: int) -> dict:
    """An upsert of a new ad with ad `row`'s data: its SIDs are that ad's, in that ad's shards."""
    return {**pool.row(row, named=True), "ad_id": ad_id, "op": "upsert"}


def test_an_update_rewrites_only_the_shards_it_touches(roots, sample_dir, tmp_path):
    base_dir, out = roots
    root = Path(shutil.copytree(out[5], tmp_path / "root"))
    base = open_snapshot(root)
    cat = pl.read_parquet(base_dir / "catalog.parquet")
    requests = sample_dir / "requests.parquet"
    index = runtime.load(root, "cpu")
    reqs = runtime.read_requests(requests, index)
    before = runtime.retrieve(index, reqs, mode="cd+gtm", beams=BEAMS).result
    row = int(before.ad_row[0])  # an ad that is served
    ad = int(base.ad_id[row])
    touched = {k for k, s in enumerate(base.shards) if np.isin(row, np.asarray(s.gtm.leaf_ads))}
    assert 1 <= len(touched) <= 2  # its SIDs' first tokens: two paths
    schema = {**cat.schema, "op": pl.String}
    pl.DataFrame([_like(cat, row, 10**12)], schema=schema).write_parquet(tmp_path / "new.parquet")
    report = run_update(root, tmp_path / "new.parquet")
    new = open_snapshot(root, verify=True, cover=True)
    assert report["new_sid_rows"] == 2
    for k in range(5):
        files = [n for n in new.manifest.files if n.startswith(shard_dir(k) + "/")]
        linked = {n for n in files if same_file(new.path / n, base.path / n)}
        if k in touched:  # its SIDs gained an ad (they are its twin's): written anew
            assert not {f"{shard_dir(k)}/leaf_ads.arrow", f"{shard_dir(k)}/leaf_ad_offsets.arrow"} & linked, k
        else:  # every file of an untouched shard is the base's (liveness flags are new: the base had none)
            assert linked == set(files) - {f"{shard_dir(k)}/entry_live.arrow"}, k
    # a serving host beside the base: what the base holds is neither re-verified nor joined again
    served = open_snapshot(root, base=base)
    for k in range(5):
        ours = served.shards[k].gtm.arrays()
        same = all(ours[n] is a for n, a in base.shards[k].gtm.arrays().items() if n != "ad_value")
        assert same == (k not in touched), k
    index = runtime.load(root, "cpu")
    got = runtime.retrieve(index, reqs, mode="cd+gtm", beams=BEAMS).result
    # the new ad is served to exactly the requests its twin is
    assert set(got.request[got.ad_id == 10**12]) == set(got.request[got.ad_id == ad]) == set(
        before.request[before.ad_id == ad])

    # an update of ad states alone: the states and the touched shards' liveness flags, nothing else
    pl.DataFrame([{"ad_id": ad, "op": "pause"}, {"ad_id": 10**12, "op": "pause"}],  # both: their SIDs go dead
                 schema=schema).write_parquet(tmp_path / "pause.parquet")
    before = open_snapshot(root)
    assert before.joined() is None and before.gtm is before.joined()  # joined when first read, as a server does
    run_update(root, tmp_path / "pause.parquet")
    after = open_snapshot(root, base=before)
    changed = {n for n in after.manifest.files if not same_file(after.path / n, before.path / n)}
    dead = {k for k in range(5)
            if not np.array_equal(after.shards[k].gtm.entry_live, before.shards[k].gtm.entry_live)}
    assert dead and dead <= touched  # a shard none of their SIDs is in keeps its flags
    assert changed == {"ad_state.arrow"} | {f"{shard_dir(k)}/entry_live.arrow" for k in dead}
    kept = {n for n, a in after.gtm.arrays().items() if a is before.gtm.arrays()[n]}
    assert kept == set(after.gtm.arrays()) - {"entry_live"}  # the join too: the loader keeps their device copies
    index = runtime.load(root, "cpu")
    got = runtime.retrieve(index, reqs, mode="cd+gtm", beams=BEAMS).result
    assert not np.isin([ad, 10**12], got.ad_id).any()


# --- one catalog over several devices, CPU devices standing in ------------------------------------

@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("devices", [2, 3, 5])
@pytest.mark.parametrize("mode, value_weight", [("cd", 0.0), ("cd+gtm", 0.0), ("cd+gtm+kway", 0.0), ("cd+gtm", 0.7)])
def test_a_search_over_several_devices_is_the_search_on_one(roots, sample_dir, devices, mode, value_weight, device):
    """Shards in groups on several devices (one CPU or GPU standing in for each), each with its own
    scorer, merged per step: the same beams, scores and order as one device holding every shard,
    and the same ads under them."""
    _, out = roots
    snap = open_snapshot(out[5])
    whole = runtime.load_index(snap, device)
    parts = runtime.load_sharded(snap, [device] * devices)
    assert len(parts) == devices and sum(p.gtm.num_leaves for p in parts) == whole.gtm.num_leaves
    reqs = runtime.read_requests(sample_dir / "requests.parquet", whole).head(24)
    host = runtime.encode_requests(reqs, whole.spec)
    beams = (1, 8, 32, 48)  # narrow: beams are cut where scores tie (the hash level's are equal)
    dev = [runtime.to_device(host, p.device) for p in parts]
    one = runtime.to_device(host, whole.device)
    want = runtime.beam_search(whole, one, runtime.codebook_scorer(whole, one)(slice(0, len(reqs))), beams, mode,
                               value_weight=value_weight)
    got = runtime.sharded_beam_search(parts, dev, [runtime.codebook_scorer(p, d)(slice(0, len(reqs)))
                                                   for p, d in zip(parts, dev)], beams, mode, value_weight=value_weight)
    tokens, score, device, leaf = got.ranked()
    alive = want.score > float("-inf")
    assert torch.equal(score > float("-inf"), alive) and len(set(device[alive].tolist())) > 1  # several served
    assert torch.equal(score[alive], want.score[alive]) and torch.equal(tokens[alive], want.tokens[alive])
    assert torch.equal(leaf >= 0, want.leaf >= 0)
    for r, c in zip(*torch.nonzero(want.leaf >= 0, as_tuple=True)):  # a SID's ads: its device's leaf, catalog rows
        g, ours, theirs = int(device[r, c]), int(leaf[r, c]), int(want.leaf[r, c])
        assert np.array_equal(_leaf_ads(parts[g].gtm, ours), _leaf_ads(whole.gtm, theirs))


def _leaf_ads(g, leaf: int) -> np.ndarray:
    """(n,) int64 catalog rows of an index's leaf, wherever the index is held."""
    offsets, ads = (torch.as_tensor(g.leaf_ad_offsets).cpu(), torch.as_tensor(g.leaf_ads).cpu())
    return ads[int(offsets[leaf]):int(offsets[leaf + 1])].numpy().astype(np.int64)


def test_a_search_over_several_devices_refuses_what_it_cannot_merge(roots, sample_dir):
    _, out = roots
    snap = open_snapshot(out[5])
    parts = runtime.load_sharded(snap, ["cpu", "cpu"])
    reqs = runtime.read_requests(sample_dir / "requests.parquet", parts[0]).head(2)
    dev = [runtime.to_device(runtime.encode_requests(reqs, p.spec), p.device) for p in parts]
    scorers = [runtime.codebook_scorer(p, d)(slice(0, 2)) for p, d in zip(parts, dev)]
    with pytest.raises(ConfigError, match="masks each device's own shards"):
        runtime.sharded_beam_search(parts, dev, scorers, (1, 4, 4, 4), "none")
    with pytest.raises(ConfigError, match="one scorer per device"):
        runtime.sharded_beam_search(parts, dev, scorers[:1], (1, 4, 4, 4))
    with pytest.raises(ConfigError, match="one snapshot"):
        other = runtime.load_sharded(open_snapshot(out[1]), ["cpu"])
        runtime.sharded_beam_search([parts[0], other[0]], dev, scorers, (1, 4, 4, 4))


def test_shards_whose_join_int32_cannot_number_are_refused(roots, tmp_path):
    """Each shard's table may fit int32 while their join's would not: refused before anything is
    read, as the join would wrap its row indexes (its node count is bounded alike)."""
    _, out = roots
    published = open_snapshot(out[5]).path
    snap_dir = Path(shutil.copytree(published, tmp_path / published.name))

    def grow(m: dict) -> None:
        for shard in m["shards"][:2]:
            shard["arrays"]["bitmask_table"]["rows"] = 2**30 + 1

    reseal(snap_dir, grow)
    with pytest.raises(ArtifactError, match="bitmask table rows together, more than the 2,147,483,647 one index"):
        open_snapshot(snap_dir, verify=False)
