"""Updates between full builds (docs/design.md §15): `sidindex update` and a watching serving host.

- Inserting SIDs into a built trie gives the trie a full build of all the SIDs gives (structure,
  SID -> ad, union rows, value bounds); k-way partitions keep covering every ad (hypothesis).
- A stateful test applies random change files (all four ops, several on one ad in one file,
  targeting broadened and narrowed, new SIDs under existing and new prefixes) and full builds in
  between: after each, retrieval with beams wider than the catalog equals a fresh build of the
  changed catalog with the same codebook, in every mode, and no paused or deleted ad is returned.
- Bad change files publish nothing (one line, exit 2, through the installed script); a kill
  during an update leaves CURRENT valid; a watcher applies an ad-state update without moving the
  index, and an upsert with a full load.
"""

from __future__ import annotations

import json
import re
import shutil
import signal
import subprocess
import time
from pathlib import Path

import numpy as np
import polars as pl
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, precondition, rule

import runtime
from runtime.serving.post import expand
from schemas.artifacts import AD_DELETED, AD_LIVE, AD_PAUSED, MATCHER_PLANES, shard_dir
from sidindex.artifact import same_file
from sidindex.errors import InputError
from sidindex.job import run_build, run_update
from sidindex.sid import save_codebook
from sidindex.snapshot import open_snapshot
from sidindex.trie.build import build_gtm
from sidindex.trie.kway import KWayConfig
from sidindex.trie.patch import insert_sids, live_entries, liveness
from tests.conftest import run_cli, sampled_codebook
from tests.test_snapshot import reseal, rewrite_array

CONFIG = ('[sid]\nlevels = [8, 4, 4]\nhash_size = 16\npaths = 2\nmin_points_per_centroid = 4\n'
          '[kway]\nmode = "dynamic"\nk_max = 3\n')
MODES = ("cd", "cd+gtm", "cd+gtm+kway")
BEAMS = (1, 8, 64, 1024)  # wider than every depth of these catalogs: every eligible ad of every mode
N_BASE = 150  # ads in the first build; the rest of the sample is the pool new ads come from
SHARDS = 3  # the updated snapshots' (each compared with a fresh build of one shard)


# --- the trie patch against a full build -----------------------------------------------------------

def _sid_rows(draw, n, sizes):
    toks = [draw(st.lists(st.integers(0, s - 1), min_size=n, max_size=n)) for s in sizes]
    return np.array(toks, dtype=np.int16).T.copy()


@st.composite
def trie_cases(draw):
    sizes = (3, 2, 3, 4)  # small levels: SIDs share prefixes, and new ones land at every depth
    n_old, n_new = draw(st.integers(1, 30)), draw(st.integers(1, 20))
    sids = _sid_rows(draw, n_old + n_new, sizes)
    n_ads_old = draw(st.integers(1, n_old))
    ad_old = np.sort(np.array(draw(st.lists(st.integers(0, n_ads_old - 1), min_size=n_old, max_size=n_old))))
    ad_old[:n_ads_old] = np.arange(n_ads_old)  # every ad has a SID row; rows come by ad, as assigned
    ad_old.sort()
    n_ads_new = draw(st.integers(1, n_new))
    ad_new = np.sort(np.array(draw(st.lists(st.integers(0, n_ads_new - 1), min_size=n_new, max_size=n_new))))
    ad_new[:n_ads_new] = np.arange(n_ads_new)
    ad_new.sort()
    n_ads = n_ads_old + n_ads_new
    rows = {p: np.array(draw(st.lists(st.integers(0, 2**64 - 1), min_size=n_ads * w, max_size=n_ads * w)),
                        dtype=np.uint64).reshape(n_ads, w) for p, w in zip(MATCHER_PLANES, (1, 2))}
    value = np.array(draw(st.lists(st.sampled_from([0.0, 1e-9, 0.5, 3.0, 1e19]), min_size=n_ads, max_size=n_ads)))
    ads = np.concatenate([ad_old, ad_new + n_ads_old])
    _, keep = np.unique(np.column_stack([sids, ads]), axis=0, return_index=True)  # an ad reaches a SID once
    keep = np.sort(keep)
    return sizes, sids[keep], ads[keep], int((keep < n_old).sum()), n_ads_old, rows, value


def _entry_rows(g, e):
    return [p.table[p.index[e]] for p in g.planes]


@settings(max_examples=60, deadline=None)
@given(trie_cases(), st.booleans())
def test_inserted_sids_give_the_full_builds_trie(case, kway):
    sizes, sids, ads, n_old, n_ads_old, rows, value = case
    kw = KWayConfig(mode="dynamic", k_max=2, target_fill=0.3) if kway else None
    old = build_gtm(sids[:n_old], ads[:n_old], sizes, {p: r[:n_ads_old] for p, r in rows.items()}, kway=kw,
                    ad_value=value[:n_ads_old])
    got = insert_sids(old, sids[n_old:], ads[n_old:], {p: r[n_ads_old:] for p, r in rows.items()}, value[n_ads_old:])
    want = build_gtm(sids, ads, sizes, rows, kway=kw, ad_value=value)
    for name in ("node_offsets", "csr_child_nodes", "csr_tokens", "depth_offsets", "leaf_ad_offsets", "leaf_ads",
                 "ad_value", "entry_value"):
        np.testing.assert_array_equal(getattr(got, name), getattr(want, name), err_msg=name)
    for e in range(got.num_nodes - 1):  # the same union rows (row numbers may differ)
        for a, b in zip(_entry_rows(got, e), _entry_rows(want, e)):
            np.testing.assert_array_equal(a, b)
    for p, old_p in zip(got.planes, old.planes):  # the base's rows kept, the new ones distinct among themselves
        np.testing.assert_array_equal(p.table[:len(old_p.table)], old_p.table)
        assert len(np.unique(p.table[len(old_p.table):], axis=0)) == len(p.table) - len(old_p.table)
    if kway:  # partitions: the union of an entry's is its union; the first carries its bound
        po = got.part_offsets
        assert np.all(np.diff(po) >= 1) and po[-1] == len(got.part_value)
        for e in range(got.num_nodes - 1):
            for p in got.planes:
                ored = np.bitwise_or.reduce(p.table[p.part_index[po[e]:po[e + 1]]], axis=0)
                np.testing.assert_array_equal(ored, p.table[p.index[e]])
            pv = got.part_value[po[e]:po[e + 1]]
            assert pv[0] == got.entry_value[e] and np.all(pv[1:] <= pv[:-1])


@settings(max_examples=60, deadline=None)
@given(trie_cases(), st.data())
def test_liveness_walks_up_from_every_sid_as_a_brute_force_does(case, data):
    """entry_live, stale entries and dead SIDs under random row states, against walking each SID's
    path to the root."""
    sizes, sids, ads, _, _, rows, _ = case
    g = build_gtm(sids, ads, sizes, rows)
    n_ads = int(ads.max()) + 1
    state = np.array(data.draw(st.lists(st.sampled_from([AD_LIVE, AD_PAUSED, AD_DELETED]), min_size=n_ads,
                                        max_size=n_ads)), dtype=np.uint8)
    live, stale, dead = np.zeros(g.num_nodes - 1, dtype=np.uint8), set(), 0
    for s in range(g.num_leaves):
        rows_live = state[g.leaf_ads[g.leaf_ad_offsets[s]:g.leaf_ad_offsets[s + 1]]] == AD_LIVE
        dead += not rows_live.any()
        node = int(g.depth_offsets[g.sid_length]) + s
        while node > 0:
            live[node - 1] |= rows_live.any()
            if not rows_live.all():
                stale.add(node - 1)
            node = int(np.searchsorted(g.node_offsets, node - 1, side="right")) - 1
    got_live, got_stale, got_dead = liveness(g, state)
    np.testing.assert_array_equal(got_live, live)
    np.testing.assert_array_equal(live_entries(g, state), live)
    assert (got_stale, got_dead) == (len(stale), dead)
    with pytest.raises(ValueError, match="outside"):  # states for fewer rows than the SIDs name: refused, not read
        liveness(g, state[:-1])


# --- the stateful test: random change files against fresh builds --------------------------------

@pytest.fixture(scope="module")
def pool(sample_dir, tmp_path_factory) -> dict:
    """The sample's catalog split into the first build's ads and a pool of new ones, its requests
    and build config."""
    base = tmp_path_factory.mktemp("update")
    cat = pl.read_parquet(sample_dir / "catalog.parquet")
    (base / "build.toml").write_text(CONFIG)
    pl.read_parquet(sample_dir / "requests.parquet").head(10).write_parquet(base / "requests.parquet")
    return {"dir": base, "catalog": cat, "targeting": sample_dir / "targeting.toml"}


def retrieved(root: Path, requests: Path, mode: str) -> list[tuple]:
    index = runtime.load(root, "cpu", verify=False)
    reqs = runtime.read_requests(requests, index)
    t = runtime.retrieve(index, reqs, mode=mode, beams=BEAMS).table(reqs.request_id)
    return sorted(zip(t["request_id"].to_pylist(), t["ad_id"].to_pylist(), np.round(t["score"].to_numpy(), 4).tolist()))


def generated(root: Path, requests: Path, mode: str, beams=(1, 2, 3, 4)) -> list[list[tuple[int, bool]]]:
    """(ad id, row live) of the rows under each SID a narrow search generates (invariant 3: each is
    a SID of the changed catalog)."""
    index = runtime.load(root, "cpu", verify=False)
    reqs = runtime.read_requests(requests, index)
    dev = runtime.to_device(runtime.encode_requests(reqs, index.spec), "cpu")
    found = runtime.beam_search(index, dev, runtime.codebook_scorer(index, dev)(slice(0, len(reqs))), beams, mode)
    g, ids, st = index.snapshot.gtm, index.snapshot.ad_id, index.snapshot.exact.ad_state
    leaves = found.leaf[(found.leaf >= 0) & (found.score > float("-inf"))].tolist()
    rows = [g.leaf_ads[g.leaf_ad_offsets[s]:g.leaf_ad_offsets[s + 1]] for s in leaves]
    return [list(zip(ids[r].tolist(), (st[r] == AD_LIVE).tolist() if st is not None else [True] * len(r)))
            for r in rows]


class Updates(RuleBasedStateMachine):
    """The model: every ad's data (a catalog frame) and the paused ids, changed op by op in file order."""

    pool: dict = {}
    applied = 0  # updates published, over every run

    @initialize()
    def first_build(self):
        self.dir = Path(self.pool["dir"]) / f"run{time.perf_counter_ns()}"
        self.dir.mkdir()
        cat = self.pool["catalog"]
        self.ads = cat.head(N_BASE)
        self.fresh = cat.tail(len(cat) - N_BASE)  # new ads come from here
        self.paused: set[int] = set()
        self.root = self.dir / "root"
        self.n, self.since_build = 0, 0
        self._build(self.root, codebook=None, shards=SHARDS)

    def _served(self) -> pl.DataFrame:
        return self.ads.filter(~pl.col("ad_id").is_in(pl.Series(sorted(self.paused), dtype=pl.Int64).implode()))

    def _build(self, root: Path, codebook: Path | None, shards: int):
        path = self.dir / f"catalog{self.n}.parquet"
        self._served().write_parquet(path)
        self.n += 1
        return run_build(path, self.pool["targeting"], root, config=self.pool["dir"] / "build.toml", codebook=codebook,
                         force=True, shards=shards)

    @rule(data=st.data())
    def update(self, data):
        """A change file of 1-12 random ops, several of them possibly on one ad, applied in order."""
        rows, rng = [], np.random.default_rng(data.draw(st.integers(0, 2**32 - 1)))
        for _ in range(data.draw(st.integers(1, 12))):
            op = data.draw(st.sampled_from(["pause", "resume", "delete", "upsert", "upsert", "new"]))
            ids = self.ads["ad_id"].to_list()
            if op in ("pause", "resume", "delete") and len(ids) > 5:
                ad = int(rng.choice(ids))
                rows.append({"ad_id": ad, "op": op})
                if op == "delete":
                    self.ads = self.ads.filter(pl.col("ad_id") != ad)
                    self.paused.discard(ad)
                elif op == "pause":
                    self.paused.add(ad)
                else:
                    self.paused.discard(ad)
            elif op in ("upsert", "new") and len(self.fresh):
                donor = self.fresh.head(1)  # new data: another ad's embedding and targeting
                self.fresh = self.fresh.tail(len(self.fresh) - 1)
                ad = int(rng.choice(ids)) if op == "upsert" else int(donor["ad_id"][0])
                how = data.draw(st.sampled_from(["donor", "unrestricted", "narrow"]))
                if how == "unrestricted":  # broadened: null lists target everyone
                    donor = donor.with_columns(pl.lit(None, dtype=pl.List(pl.String)).alias("locations"),
                                               pl.lit(None, dtype=pl.List(pl.String)).alias("country"))
                elif how == "narrow":
                    donor = donor.with_columns(pl.lit(["US"], dtype=pl.List(pl.String)).alias("country"))
                donor = donor.with_columns(pl.lit(ad, dtype=pl.Int64).alias("ad_id"))
                rows.append({**donor.row(0, named=True), "op": "upsert"})
                self.ads = pl.concat([self.ads.filter(pl.col("ad_id") != ad), donor])
        if not rows:
            return
        path = self.dir / f"changes{self.n}.parquet"
        self.n += 1
        pl.DataFrame(rows, schema={**self.ads.schema, "op": pl.String}).write_parquet(path)
        report = run_update(self.root, path)
        assert report["status"] == "published"
        Updates.applied += 1
        self.since_build += 1
        self.retrieval_equals_a_fresh_build()

    @precondition(lambda self: self.since_build >= 2)
    @rule()
    def full_build(self):
        """A scheduled full build compacts: no paused or deleted rows, nothing stale."""
        report = self._build(self.root, codebook=self.root, shards=SHARDS)
        snap = open_snapshot(self.root)
        assert snap.manifest.lineage is None and snap.exact.ad_state is None and report["status"] == "published"
        self.ads = self._served()  # the catalog a full build reads holds the ads to serve
        self.paused, self.since_build = set(), 0

    def retrieval_equals_a_fresh_build(self):
        fresh = self.dir / f"fresh{self.n}"
        self._build(fresh, codebook=self.root, shards=1)  # the updated shards serve what one trie does
        requests = self.pool["dir"] / "requests.parquet"
        served = set(self.ads["ad_id"].to_list()) - self.paused
        for mode in MODES:
            got = retrieved(self.root, requests, mode)
            assert got == retrieved(fresh, requests, mode), mode
            assert {ad for _, ad, _ in got} <= served  # never a paused or deleted ad
            for leaf_ads in generated(self.root, requests, mode):  # narrow beams: only SIDs with a live ad
                assert any(ad in served and live for ad, live in leaf_ads), mode
        shutil.rmtree(fresh)
        snap = open_snapshot(self.root, verify=True)
        if snap.manifest.lineage:
            lin, g, st = snap.manifest.lineage, snap.gtm, snap.exact.ad_state
            assert lin.paused == len(self.paused)
            stale, dead = set(), 0  # brute force: walk up from every SID holding a row that is not live
            for s in range(g.num_leaves):
                rows = st[g.leaf_ads[g.leaf_ad_offsets[s]:g.leaf_ad_offsets[s + 1]]]
                dead += bool((rows != AD_LIVE).all())
                node = int(g.depth_offsets[g.sid_length]) + s
                while node > 0 and (rows != AD_LIVE).any():
                    stale.add(node - 1)
                    node = int(np.searchsorted(g.node_offsets, node - 1, side="right")) - 1
            assert (lin.stale_entries, lin.dead_sids) == (len(stale), dead)


def test_random_updates_equal_fresh_builds(pool):
    Updates.pool = pool
    run = Updates.TestCase()
    run.settings = settings(max_examples=4, stateful_step_count=6, deadline=None,
                            suppress_health_check=list(HealthCheck))
    run.runTest()
    assert Updates.applied >= 8  # the runs did update


# --- the CLI: bad change files, kills, the watcher ----------------------------------------------------

@pytest.fixture(scope="module")
def built(pool, tmp_path_factory) -> Path:
    base = tmp_path_factory.mktemp("built")
    pool["catalog"].head(N_BASE).write_parquet(base / "catalog.parquet")
    save_codebook(sampled_codebook(pool["catalog"].head(N_BASE)), base / "root")
    r = run_cli("build", "--catalog", base / "catalog.parquet", "--targeting", pool["targeting"], "--out",
                base / "root", "--config", pool["dir"] / "build.toml", "--json")
    assert r.returncode == 0, r.stderr
    return base / "root"


def _changes(pool, path: Path, rows: list[dict]) -> Path:
    schema = {**pool["catalog"].schema, "embedding": pl.List(pl.Float32), "op": pl.String}  # any length
    pl.DataFrame(rows, schema=schema).write_parquet(path)
    return path


def _upsert(pool, i: int, ad_id: int, **edit) -> dict:
    return {**pool["catalog"].row(i, named=True), "ad_id": ad_id, "op": "upsert", **edit}


@pytest.mark.parametrize("rows, message", [
    (lambda ids, pool: [{"ad_id": ids[0], "op": "stop"}], "row 0: value 'stop' is not an op"),
    (lambda ids, pool: [{"ad_id": ids[0], "op": None}], "row 0: value None is not an op"),
    (lambda ids, pool: [{"ad_id": 1, "op": "pause"}], "row 0: pause names ad 1, which is not in the snapshot"),
    (lambda ids, pool: [{"ad_id": ids[0], "op": "delete"}, {"ad_id": ids[0], "op": "resume"}],
     "row 1: resume names ad"),
    (lambda ids, pool: [{"ad_id": ids[0], "op": "pause"}, _upsert(pool, 0, 7, embedding=[float("nan")] * 16)],
     "column 'embedding', row 1 (ad_id 7): element 0 is nan"),
    (lambda ids, pool: [_upsert(pool, 0, 7, country=["Atlantis"])], "column 'country', row 0 (ad_id 7): value "
                                                                    "'Atlantis' is not declared"),
    (lambda ids, pool: [_upsert(pool, 0, 7, value=-1.0)], "column 'value', row 0 (ad_id 7): value -1.0"),
    (lambda ids, pool: [_upsert(pool, 0, 7, embedding=[1.0] * 3)], "has 3 values, expected 16"),
    (lambda ids, pool: [{"ad_id": 2**63 - 1, "op": "delete"}], "is not in the snapshot"),
])
def test_bad_change_files_publish_nothing(built, pool, tmp_path, rows, message):
    before = open_snapshot(built).id
    ids = pool["catalog"]["ad_id"].head(N_BASE).to_list()
    path = _changes(pool, tmp_path / "changes.parquet", rows(ids, pool))
    with pytest.raises(InputError, match=re.escape(message)):
        run_update(built, path)
    assert open_snapshot(built).id == before


def test_bad_change_file_through_the_console_script(built, pool, tmp_path):
    before = open_snapshot(built).id
    path = _changes(pool, tmp_path / "changes.parquet", [_upsert(pool, 0, 7, embedding=[1.0] * 3)])
    r = run_cli("update", built, "--changes", path)
    assert r.returncode == 2 and "column 'embedding', row 0 (ad_id 7): has 3 values, expected 16" in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1 and "Traceback" not in r.stderr
    assert open_snapshot(built).id == before


def test_an_ad_upserted_then_deleted_in_one_file(built, pool, tmp_path):
    root = Path(shutil.copytree(built, tmp_path / "root"))
    ad = int(open_snapshot(root).ad_id[0])
    report = run_update(root, _changes(pool, tmp_path / "c.parquet", [
        _upsert(pool, N_BASE, 10**9), {"ad_id": 10**9, "op": "delete"},  # new, then gone
        _upsert(pool, N_BASE + 1, ad), {"ad_id": ad, "op": "delete"}]))  # edited, then gone
    snap = open_snapshot(root, verify=True)
    assert report["new_sid_rows"] == 0 and 10**9 not in snap.ad_id
    assert snap.exact.ad_state[snap.ad_id == ad].tolist() == [AD_DELETED]


def test_change_file_without_columns_or_rows(built, pool, tmp_path):
    before = open_snapshot(built).id
    pl.DataFrame({"ad_id": [1]}).write_parquet(tmp_path / "no_op.parquet")
    r = run_cli("update", built, "--changes", tmp_path / "no_op.parquet")
    assert r.returncode == 2 and "missing column 'op'" in r.stderr, r.stderr
    r = run_cli("update", built, "--changes", tmp_path / "missing.parquet")
    assert r.returncode == 2 and "file not found" in r.stderr
    r = run_cli("update", tmp_path / "no_root", "--changes", tmp_path / "no_op.parquet")
    assert r.returncode == 2 and "no published snapshot to update" in r.stderr and len(r.stderr.splitlines()) == 1
    _changes(pool, tmp_path / "empty.parquet", [])
    r = run_cli("update", built, "--changes", tmp_path / "empty.parquet", "--json")
    assert r.returncode == 0 and json.loads(r.stdout)["status"] == "unchanged"
    assert open_snapshot(built).id == before


def test_update_links_what_it_does_not_change_and_inspect_shows_staleness(built, pool, tmp_path):
    root = Path(shutil.copytree(built, tmp_path / "root"))
    base = open_snapshot(root)
    ids = base.ad_id[:3].tolist()
    path = _changes(pool, tmp_path / "c.parquet", [{"ad_id": ids[0], "op": "pause"}, {"ad_id": ids[1], "op": "delete"}])
    r = run_cli("update", root, "--changes", path, "--json")
    assert r.returncode == 0, r.stderr
    new = open_snapshot(root, verify=True)
    changed = {n for n in new.manifest.files if not same_file(new.path / n, base.path / n)}
    # everything else is the base's file; a catalog this small is one shard
    assert changed == {"ad_state.arrow", f"{shard_dir(0)}/entry_live.arrow"}
    r = run_cli("inspect", root, "--json")
    shown = json.loads(r.stdout)
    assert shown["updates_since_full_build"] == 1 and shown["paused_ads"] == 1 and shown["deleted_rows"] == 1
    assert shown["stale_entries"] > 0 and shown["full_build"] == base.id
    r = run_cli("validate", root)
    assert r.returncode == 0, r.stderr
    duckdb = pytest.importorskip("duckdb")  # the state file is plain Arrow, like every other (dev extra)
    import pyarrow as pa

    states = pa.ipc.open_file(pa.memory_map(str(new.path / "ad_state.arrow"))).read_all()  # noqa: F841 (by name)
    assert duckdb.sql("select ad_state, count(*) from states group by 1 order by 1").fetchall() == [
        (0, len(new.ad_id) - 2), (1, 1), (2, 1)]


def test_sigkill_during_update_leaves_current_valid(built, pool, tmp_path):
    root = Path(shutil.copytree(built, tmp_path / "root"))
    ids = open_snapshot(root).ad_id[:20].tolist()
    path = _changes(pool, tmp_path / "c.parquet", [{"ad_id": i, "op": "pause"} for i in ids[:10]] +
                    [_upsert(pool, N_BASE + j, 10**9 + j) for j in range(10)])
    args = [shutil.which("sidindex"), "update", str(root), "--changes", str(path)]
    t0 = time.perf_counter()
    subprocess.run(args, capture_output=True, check=True, timeout=300)
    full = time.perf_counter() - t0
    for delay in np.linspace(0.4, 1.0, 3) * full:  # from start-up to the CURRENT swap
        p = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        time.sleep(delay)
        p.send_signal(signal.SIGKILL)
        p.wait()
        open_snapshot(root, verify=True)  # CURRENT names a complete snapshot
    r = run_cli("update", root, "--changes", path)
    assert r.returncode == 0, r.stderr
    assert not list((root / "snapshots").glob(".tmp-*"))


def test_watcher_applies_a_pause_without_moving_the_index(built, pool, tmp_path):
    root = Path(shutil.copytree(built, tmp_path / "root"))
    watcher = runtime.SnapshotWatcher(root, "cpu")
    reqs = runtime.read_requests(pool["dir"] / "requests.parquet", watcher.current)
    before = runtime.retrieve(watcher.current, reqs, beams=BEAMS).result
    target = int(np.bincount(before.ad_row).argmax())  # an ad that is returned, then paused
    ad = int(watcher.current.snapshot.ad_id[target])
    run_update(root, _changes(pool, tmp_path / "pause.parquet", [{"ad_id": ad, "op": "pause"}]))
    old = watcher.current
    assert watcher.poll() and watcher.current.id != old.id  # only the new liveness flags move
    assert watcher.current.load_info["bytes"] == watcher.current.snapshot.gtm.entry_live.nbytes
    after = runtime.retrieve(watcher.current, reqs, beams=BEAMS).result
    assert ad not in after.ad_id and len(after.ad_id) < len(before.ad_id)
    # deleting the paused ad leaves every entry as live as it was: nothing moves, the same device arrays serve
    old = watcher.current
    run_update(root, _changes(pool, tmp_path / "delete.parquet", [{"ad_id": ad, "op": "delete"}]))
    assert watcher.poll() and watcher.current.id != old.id
    assert watcher.current.load_info["bytes"] == 0 and watcher.current.generation is old.generation
    run_update(root, _changes(pool, tmp_path / "back.parquet", [_upsert(pool, target, ad)]))  # its own data again
    assert watcher.poll()
    # an upsert changes the trie: loaded in full, and the new ad is served
    new = _upsert(pool, N_BASE, 10**9, country=None, locations=None, age=None, gender=None, language=None,
                  platform=None)
    run_update(root, _changes(pool, tmp_path / "new.parquet", [new]))
    assert watcher.poll() and watcher.current.load_info["bytes"] > 0
    after = runtime.retrieve(watcher.current, reqs, beams=BEAMS).result
    assert ad in after.ad_id and 10**9 in after.ad_id  # the deleted ad upserted again (its own data), the new one
    assert watcher.current.snapshot.exact.ad_state[watcher.current.snapshot.ad_id == ad].tolist()[-1] == AD_LIVE


@pytest.mark.parametrize("edit, message", [
    (lambda m: m.__setitem__("level_sizes", m["level_sizes"][:1] + [2, 2, 2]),  # checked in full
     "outside its level's vocabulary"),
    (lambda m: m["lineage"].__setitem__("paused", 0), "lineage counts 0 paused"),
    (lambda m: m["lineage"]["changes"].pop("resume"), "lineage: changes must map each op"),
])
def test_watcher_checks_an_update_in_full_when_its_manifest_says_otherwise(built, pool, tmp_path, edit, message):
    root = Path(shutil.copytree(built, tmp_path / "root"))
    watcher = runtime.SnapshotWatcher(root, "cpu")
    served = watcher.current.id
    run_update(root, _changes(pool, tmp_path / "p.parquet", [{"ad_id": int(watcher.current.snapshot.ad_id[0]),
                                                                "op": "pause"}]))
    reseal(open_snapshot(root).path, edit)
    assert not watcher.poll() and watcher.current.id == served and message in watcher.last_error


def test_watcher_refuses_a_state_update_that_brings_a_deleted_row_back(built, pool, tmp_path):
    root = Path(shutil.copytree(built, tmp_path / "root"))
    ad = int(open_snapshot(root).ad_id[0])
    run_update(root, _changes(pool, tmp_path / "u.parquet", [_upsert(pool, N_BASE, ad)]))  # row 0 deleted
    watcher = runtime.SnapshotWatcher(root, "cpu")
    served = watcher.current.id
    run_update(root, _changes(pool, tmp_path / "p.parquet", [{"ad_id": ad, "op": "pause"}]))
    state = np.array(open_snapshot(root).exact.ad_state)
    state[0] = AD_LIVE  # a second live row of the ad's id, written as if by a buggy writer
    rewrite_array(open_snapshot(root).path, "ad_state", state)
    assert not watcher.poll() and watcher.current.id == served and "must be unique" in watcher.last_error


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
def test_searcher_keeps_replaying_its_graphs_across_a_pause(built, pool, tmp_path):
    root = Path(shutil.copytree(built, tmp_path / "root"))
    watcher = runtime.SnapshotWatcher(root, "cuda")
    searcher = runtime.Searcher(BEAMS)

    def served():
        index = watcher.current
        reqs = runtime.read_requests(pool["dir"] / "requests.parquet", index)
        host = runtime.encode_requests(reqs, index.spec)
        dev = runtime.to_device(host, index.device)
        scorer = runtime.codebook_scorer(index, dev)(slice(0, len(reqs)))
        return expand(index, host, searcher.search(index, dev, scorer))

    before = served()
    ad = int(before.ad_id[0])
    run_update(root, _changes(pool, tmp_path / "pause.parquet", [{"ad_id": ad, "op": "pause"}]))
    assert watcher.poll()
    paused = served()  # the liveness flags moved: captured again
    keep = before.ad_id != ad
    np.testing.assert_array_equal(paused.ad_id, before.ad_id[keep])
    np.testing.assert_array_equal(paused.score, before.score[keep])
    graphs, paused_id = dict(searcher._graphs), watcher.current.snapshot.id
    run_update(root, _changes(pool, tmp_path / "delete.parquet", [{"ad_id": ad, "op": "delete"}]))
    assert watcher.poll()
    info = watcher.current.load_info  # the search's arrays all kept: only the post stage's row states moved
    assert info["shared_with"] == paused_id and info["bytes"] == watcher.current.snapshot.exact.ad_state.nbytes
    after = served()
    assert searcher._graphs == graphs  # the same device arrays: replayed, not captured again
    np.testing.assert_array_equal(after.ad_id, paused.ad_id)
    np.testing.assert_array_equal(after.score, paused.score)
