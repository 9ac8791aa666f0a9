"""Nothing laundered, nothing reverted (docs/design.md §7, §15):

- An update trusts nothing it reads: over a base whose matcher rows were zeroed or flipped (digests
  resealed over the damage) or whose bytes were flipped (digests left), it publishes nothing.
- Changes survive full builds: a paused ad stays paused through `sidindex build --force`; with the
  export's watermark, deletes and upserts published after the export are applied again; a property
  test over change sequences and interleaved builds from exports of any age finds the served ads
  always equal to the catalog's live ones, and never a paused one.
- A build that waited while another writer published refuses; the scheduled pipeline archives a
  change file it already applied, whatever ran since, instead of sticking on it.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import polars as pl
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import runtime
from schemas.artifacts import AD_LIVE, AD_PAUSED, MANIFEST_FILE, SNAPSHOT_VERSION
from schemas.contracts import CHANGES_THROUGH_KEY
from sidindex import update
from sidindex.artifact import seal, sha256_file
from sidindex.errors import ArtifactError, InputError
from sidindex.exact import ExactIndex, ExactPlane, concat_exact
from sidindex.job import run_build, run_update
from sidindex.root import Root
from sidindex.snapshot import open_snapshot
from sidindex.snapshot.records import read_record
from sidindex.trie.cover import _restrictions_kept, unchanged_entries, uncovered
from tests.conftest import run_cli
from tests.in_process import run_entry, run_main
from tests.test_snapshot import array_file, reseal, rewrite_array
from tests.test_update import N_BASE, _changes, _upsert, built, pool  # noqa: F401 (fixtures)


def _root(built: Path, tmp_path: Path) -> Path:
    return Path(shutil.copytree(built, tmp_path / "root"))


@pytest.fixture(scope="module")
def watermarked(built, pool, tmp_path_factory) -> Path:
    """`built` rebuilt from the same catalog told it holds the change files through 0000.parquet:
    the watermark every later one is checked against (the first a ROOT is told is taken as given)."""
    root = _root(built, tmp_path_factory.mktemp("watermarked"))
    catalog = _export(pool, root.parent, pool["catalog"].head(N_BASE))
    run_build(catalog, pool["targeting"], root, config=pool["dir"] / "build.toml", codebook=root, force=True,
              changes_through="0000.parquet")
    return root


def _published(root: Path) -> tuple:
    """What a failed job must leave as it was: CURRENT, HISTORY, the snapshot directories, the journal."""
    listing = lambda d: sorted(p.name for p in d.iterdir()) if d.is_dir() else []  # noqa: E731
    return ((root / "CURRENT").read_bytes(), (root / "HISTORY").read_bytes(), listing(root / "snapshots"),
            listing(root / "changes"))


def _live(root: Path) -> set[int]:
    snap = open_snapshot(root, verify=True)
    return set(snap.ad_id[snap.row_states == AD_LIVE].tolist())


# --- an update over a corrupt base ----------------------------------------------------------------

def _sid_entry_row(snap, plane: str) -> int:
    """The row of the bloom or bitmask table under the first SID's entry (what a SID-level flip hits)."""
    g = snap.gtm
    p = next(p for p in g.planes if p.name == plane)
    return int(p.index[int(g.depth_offsets[g.sid_length]) - 1])


def _edit_table(d: Path, plane: str, edit, seal: bool = True) -> None:
    """Edit plane's table in place (its file's bytes), resealing the manifest's digests unless not `seal`."""
    snap = open_snapshot(d)
    table = next(p for p in snap.gtm.planes if p.name == plane).table
    path = array_file(d, f"{plane}_table")
    raw = bytearray(path.read_bytes())
    start = raw.find(table.tobytes())  # the column's buffer inside the Arrow file
    assert start >= 0
    rows = table.copy()
    edit(snap, rows)
    raw[start:start + rows.nbytes] = rows.tobytes()
    os.chmod(path, 0o644)
    path.write_bytes(bytes(raw))
    if seal:
        reseal(d)


def _zero_sid_row(plane):
    return lambda snap, rows: rows.__setitem__(_sid_entry_row(snap, plane), 0)


def _drop_a_needed_bitmask_bit(snap, rows):
    """Clear a bit of the first SID's bitmask row that one of its ads needs."""
    r = _sid_entry_row(snap, "bitmask")
    ad = int(snap.gtm.leaf_ads[0])
    need = snap.exact.planes[0].rows[ad]
    w = int(np.flatnonzero(need)[0])
    rows[r, w] &= ~(need[w] & (~need[w] + np.uint64(1)))  # the lowest bit the ad sets


def _zero_inner_bloom_bits(snap, rows):
    """Clear the root's first child's bloom row: its subtree's rows are no longer inside it."""
    rows[int(snap.gtm.planes[1].index[0])] = 0


def _flip_bytes(snap, rows):
    rows.view(np.uint8)[: 64] ^= 0xFF


@pytest.mark.parametrize("edit, seal, message", [
    (_zero_sid_row("bloom"), True, "bloom_table.arrow: a "),  # a SID's row, or an inner one sharing it
    (_zero_sid_row("bitmask"), True, "bitmask_table.arrow: a "),
    (_drop_a_needed_bitmask_bit, True, "bitmask_table.arrow: a "),
    (_zero_inner_bloom_bits, True, "bloom_table.arrow: a prefix's matcher row lacks a bit of one of its children"),
    (_flip_bytes, False, "bloom_table.arrow: checksum mismatch"),
], ids=["zeroed-bloom-resealed", "zeroed-bitmask-resealed", "bitmask-bit-resealed", "inner-bloom-resealed",
        "flipped-not-resealed"])
@pytest.mark.parametrize("op", ["upsert", "pause"])
def test_an_update_over_a_corrupt_base_publishes_nothing(built, pool, tmp_path, edit, seal, message, op, monkeypatch,
                                                         capsys):
    """The flipped bytes under a pause through the console script; the other cases through its
    entry point in this process (`run_main`: the same exit code and line)."""
    run = run_cli if (edit, op) == (_flip_bytes, "pause") else functools.partial(run_main, monkeypatch, capsys)
    root = _root(built, tmp_path)
    current = Root(root).snapshot_dir(Root(root).current_id())
    _edit_table(current, "bloom" if "bloom" in message else "bitmask", edit, seal)
    before = _published(root)
    ad = int(pool["catalog"]["ad_id"][0])
    rows = [_upsert(pool, N_BASE, 10**9)] if op == "upsert" else [{"ad_id": ad, "op": "pause"}]
    r = run("update", root, "--changes", _changes(pool, tmp_path / "c.parquet", rows))
    assert r.returncode == 2 and message in r.stderr and "corrupt" in r.stderr, r.stderr
    assert len(r.stderr.strip().splitlines()) == 1 and "Traceback" not in r.stderr
    assert _published(root) == before
    if op == "pause":  # validate refuses the base as the update did
        r = run("validate", root)
        assert r.returncode == 2 and message in r.stderr, r.stderr


def test_a_refused_update_creates_nothing(pool, tmp_path, monkeypatch, capsys):
    path = _changes(pool, tmp_path / "c.parquet", [{"ad_id": 1, "op": "pause"}])
    # the missing ROOT through the console script, the empty one through its entry point here
    for root, run in ((tmp_path / "missing" / "root", run_cli),
                      (tmp_path / "empty", functools.partial(run_main, monkeypatch, capsys))):
        (tmp_path / "empty").mkdir(exist_ok=True)
        r = run("update", root, "--changes", path)
        assert r.returncode == 2 and "no published snapshot to update" in r.stderr
    assert not (tmp_path / "missing").exists() and list((tmp_path / "empty").iterdir()) == []


# --- check records: what an update over an update's snapshot verifies ------------------------------

def _pause(pool, tmp_path: Path, i: int) -> Path:
    """A change file pausing the base catalog's ad i."""
    return _changes(pool, tmp_path / f"pause{i}.parquet", [{"ad_id": int(pool["catalog"]["ad_id"][i]), "op": "pause"}])


def test_an_update_records_its_checks_and_the_next_verifies_the_digests_alone(built, pool, tmp_path):
    root = _root(built, tmp_path)
    layout = Root(root)
    first = run_update(root, _pause(pool, tmp_path, 0))
    assert first["base_checks"] == "full"  # a full build records nothing: its base was checked whole
    assert sorted(p.name for p in layout.checked.iterdir()) == sorted([first["base"], first["snapshot_id"]])
    second = run_update(root, _pause(pool, tmp_path, 1), keep=2)
    assert second["base_checks"] == "recorded" and second["base"] == first["snapshot_id"]
    assert sorted(p.name for p in layout.checked.iterdir()) == sorted(
        p.name for p in layout.snapshots.iterdir())  # retention took the build's record with it
    snap = open_snapshot(root)  # the record names the manifest as written
    assert {"structure", "cover"} <= read_record(layout, snap.id, snap.manifest.sha256()).checks
    assert snap.manifest.sha256() == sha256_file(snap.path / MANIFEST_FILE)
    assert open_snapshot(root, verify=False, cover=True, records=True).recorded
    paused = {int(pool["catalog"]["ad_id"][i]) for i in (0, 1)}
    assert paused <= set(snap.ad_id[snap.row_states == AD_PAUSED].tolist()) and not paused & _live(root)


@pytest.mark.parametrize("edit, seal, message", [
    (_zero_sid_row("bitmask"), True, "bitmask_table.arrow: a "),
    (_zero_inner_bloom_bits, True, "bloom_table.arrow: a prefix's matcher row lacks a bit of one of its children"),
    (_flip_bytes, False, "bloom_table.arrow: checksum mismatch"),
], ids=["zeroed-bitmask-resealed", "inner-bloom-resealed", "flipped-not-resealed"])
def test_a_check_record_does_not_cover_a_base_changed_since(built, pool, tmp_path, edit, seal, message):
    """Damage after the record: resealed, the manifest is not the one recorded, so the base is
    checked in full; not resealed, its digests (always verified) find it."""
    root = _root(built, tmp_path)
    run_update(root, _pause(pool, tmp_path, 0))
    current = Root(root).snapshot_dir(Root(root).current_id())
    _edit_table(current, "bloom" if "bloom" in message else "bitmask", edit, seal)
    before = _published(root)
    with pytest.raises(ArtifactError, match=re.escape(message)):
        run_update(root, _pause(pool, tmp_path, 1))
    assert _published(root) == before


def _rewrite_record(path: Path, **edit) -> None:
    doc = json.loads(path.read_text())
    path.write_bytes(seal({k: v for k, v in doc.items() if k != "checksum"} | edit))


@pytest.mark.parametrize("record", ["another sidindex", "another manifest", "another snapshot", "not sealed",
                                    "checks not named", "a fifo", "a symbolic link", "a directory"])
def test_a_record_that_does_not_match_counts_as_none(built, pool, tmp_path, record):
    root = _root(built, tmp_path)
    layout = Root(root)
    first = run_update(root, _pause(pool, tmp_path, 0))
    path = layout.checked / first["snapshot_id"]
    if record == "another sidindex":
        _rewrite_record(path, checker="sidindex 0.0.0")
    elif record == "another manifest":
        _rewrite_record(path, manifest_sha256="0" * 64)
    elif record == "checks not named":  # sealed, but no list of check names: none, never a crash
        _rewrite_record(path, checks=[["structure"], {"cover": 1}])
    elif record == "another snapshot":  # the build's record, renamed: its manifest is not this one
        os.replace(layout.checked / first["base"], path)
    elif record == "not sealed":
        path.write_bytes(path.read_bytes().replace(b'"sidindex-check-record"', b'"sidindex-check-recorD"'))
    elif record == "a fifo":  # refused at once, never waited on
        path.unlink()
        os.mkfifo(path)
    elif record == "a symbolic link":  # to a sound record: records are read without following links
        shutil.copyfile(path, tmp_path / "elsewhere")
        path.unlink()
        path.symlink_to(tmp_path / "elsewhere")
    else:
        path.unlink()
        path.mkdir()
    second = run_update(root, _pause(pool, tmp_path, 1))
    assert second["base_checks"] == "full" and second["status"] == "published"
    assert {"structure", "cover"} <= read_record(layout, second["snapshot_id"],
                                                 open_snapshot(root).manifest.sha256()).checks


def test_a_serving_load_of_a_recorded_snapshot_verifies_its_digests_alone(built, pool, tmp_path):
    """A build records its structure check; a load then verifies every digest instead of checking
    the structure again, and only then: without the record, outside its ROOT, or asked not to."""
    root = _root(built, tmp_path)
    snap = open_snapshot(root)
    assert read_record(Root(root), snap.id, snap.manifest.sha256()).checks == {"structure"}
    served = runtime.load(root, "cpu")
    assert served.snapshot.recorded and "checksums" in served.snapshot.open_seconds
    assert not any("structure" in k for k in served.snapshot.open_seconds)
    assert not runtime.load(root, "cpu", records=False).snapshot.recorded
    elsewhere = Path(shutil.copytree(snap.path, tmp_path / snap.id))  # no ROOT: nothing records it
    assert not open_snapshot(elsewhere, records=True).recorded
    assert not open_snapshot(root, records=True, cover=True).recorded  # a build checks no cover


@pytest.mark.parametrize("damage", ["resealed", "not resealed"])
def test_a_recorded_snapshot_damaged_since_is_refused_at_load(built, pool, tmp_path, damage):
    """Resealed over damage, the manifest is not the one recorded: the structure is checked and
    refuses it; not resealed, the digests (verified on record, even with verify=False) do."""
    root = _root(built, tmp_path)
    snap = open_snapshot(root)
    offsets = np.array(snap.gtm.node_offsets)
    offsets[1] = np.iinfo(np.int64).min  # a wrap-around a kernel would index with
    if damage == "resealed":
        rewrite_array(snap.path, "node_offsets", offsets)
        message = "node_offsets.arrow: child offsets must rise"
    else:
        path = array_file(snap.path, "node_offsets")
        raw = bytearray(path.read_bytes())
        at = raw.find(np.asarray(snap.gtm.node_offsets).tobytes())
        raw[at:at + offsets.nbytes] = offsets.tobytes()
        os.chmod(path, 0o644)
        path.write_bytes(bytes(raw))
        message = "node_offsets.arrow: checksum mismatch"
    with pytest.raises(ArtifactError, match=re.escape(message)):
        runtime.load(root, "cpu", verify=False)


# --- an update's result: its cover checked since its base ------------------------------------------

@pytest.fixture(scope="module")
def since(built, pool, tmp_path_factory) -> tuple:
    """(base, new): a built snapshot, opened with its cover checked, and an update of it that
    inserted SIDs: new ads, and existing ads with new data (their rows deleted, new ones added)."""
    tmp = tmp_path_factory.mktemp("since")
    root = Path(shutil.copytree(built, tmp / "root"))
    base_dir = Root(root).snapshot_dir(Root(root).current_id())
    ids = open_snapshot(root).ad_id
    rows = ([_upsert(pool, N_BASE + i, 10**9 + i) for i in range(12)]
            + [_upsert(pool, N_BASE + 20 + i, int(ids[i])) for i in range(6)])
    assert run_update(root, _changes(pool, tmp / "c.parquet", rows))["new_sid_rows"] > 0
    return open_snapshot(base_dir, cover=True), open_snapshot(root)


def _copied(snap) -> tuple:
    """The snapshot's one shard's trie and its exact index, every array a writable copy."""
    g = snap.shards[0].gtm
    planes = tuple(dataclasses.replace(p, table=np.array(p.table), index=np.array(p.index)) for p in g.planes)
    g = dataclasses.replace(g, planes=planes, leaf_ads=np.array(g.leaf_ads), entry_value=np.array(g.entry_value),
                            ad_value=np.array(g.ad_value))
    exact = dataclasses.replace(snap.exact, planes=tuple(
        dataclasses.replace(e, rows=None if e.rows is None else np.array(e.rows)) for e in snap.exact.planes))
    return g, exact


def _damage(g, exact, n_base: int, changed: np.ndarray, kind: str, rng: np.random.Generator) -> None:
    """One structure-keeping damage of `kind`: a matcher row's index or bit, a SID's ads, a SID's
    bound, a kept ad's exact row or value; at an entry the update changed or any (by coin)."""
    E, first = g.num_nodes - 1, int(g.depth_offsets[g.sid_length]) - 1
    sids = changed[changed >= first]
    entry = int(rng.choice(changed) if rng.random() < 0.5 else rng.integers(0, E))
    sid = int(rng.choice(sids) if rng.random() < 0.5 else rng.integers(first, E)) - first
    p = g.planes[rng.integers(0, len(g.planes))]
    if kind == "index":
        p.index[entry] = rng.integers(0, len(p.table))
    elif kind == "bit":
        row = p.index[entry] if rng.random() < 0.5 else rng.integers(0, len(p.table))
        p.table[row, rng.integers(0, p.table.shape[1])] ^= np.uint64(1) << np.uint64(rng.integers(0, 64))
    elif kind == "ads":  # one ad of the SID swapped for another it lacks, kept ascending and distinct
        lo, hi = g.leaf_ad_offsets[sid], g.leaf_ad_offsets[sid + 1]
        other = rng.integers(0, len(g.ad_value))
        if other not in g.leaf_ads[lo:hi]:
            g.leaf_ads[lo + rng.integers(0, hi - lo)] = other
            g.leaf_ads[lo:hi] = np.sort(g.leaf_ads[lo:hi])
    elif kind == "bound":
        g.entry_value[first + sid] = 0.0 if rng.random() < 0.5 else g.entry_value[first + sid] / 2
    elif kind == "exact":
        rows = next(e.rows for e in exact.planes if e.rows is not None)
        rows[rng.integers(0, n_base), rng.integers(0, rows.shape[1])] ^= np.uint64(1) << np.uint64(rng.integers(0, 64))
    else:
        g.ad_value[rng.integers(0, n_base)] += 1.0


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_a_cover_checked_since_the_base_gives_the_whole_checks_verdict(since, data):
    """Whatever structure-keeping damage an update's result holds, at an entry it changed or any
    other, checking only the relations it did not keep from its base gives the verdict a check of
    every relation gives."""
    base, new = since
    held = (base.shards[0].gtm, base.exact)
    g, exact = _copied(new)
    kept = unchanged_entries(g, exact, *held)
    assert kept is not None and 0 < (~kept[0]).sum() < len(kept[0]) // 2  # most of the base is kept
    changed = np.flatnonzero(~kept[0])
    kinds = data.draw(st.lists(st.sampled_from(["index", "bit", "ads", "bound", "exact", "value"]), max_size=3))
    rng = np.random.default_rng(data.draw(st.integers(0, 2**32 - 1)))  # where: uniform, not shrunk to 0
    for kind in kinds:
        _damage(g, exact, len(base.ad_id), changed, kind, rng)
    assert uncovered(g, exact, held) == uncovered(g, exact)


def test_a_values_planes_restrictions_are_kept_though_its_offsets_shift(since):
    """A values plane is attribute-major: an update's new ads shift every later attribute's hash
    offsets, yet which ads are restricted where (all the cover reads of them) is kept, so the check
    since a base still skips what it kept; an ad's restriction flipped is not kept."""
    spec = since[0].spec
    rng = np.random.default_rng(5)

    def part(n: int) -> ExactIndex:  # 3 attributes, some runs empty (the ad unrestricted there)
        offsets = np.zeros((3, n + 1), dtype=np.int64)
        np.cumsum(rng.integers(0, 3, size=(3, n)), axis=1, out=offsets[:, 1:])
        return ExactIndex(spec, (ExactPlane("bloom", hash_offsets=offsets,
                                            hashes=np.arange(int(offsets[:, -1].max()), dtype=np.uint64)),))

    old, new = part(40), part(7)
    base = concat_exact([old]).planes[0].hash_offsets
    grown = concat_exact([old, new]).planes[0].hash_offsets
    assert not np.array_equal(grown[1:, :41], base[1:])  # the later attributes' offsets moved
    assert _restrictions_kept(grown, base)
    a = int(np.flatnonzero(np.diff(grown[2, :41]) > 0)[0])  # an ad restricted on the last attribute
    flipped = grown.copy()
    flipped[2, a + 1] = flipped[2, a]  # its run emptied: unrestricted there now
    assert not _restrictions_kept(flipped, base)
    assert not _restrictions_kept(base, grown)  # a result with fewer ads than its base keeps nothing


def test_an_update_whose_rows_do_not_cover_its_ads_publishes_nothing(built, pool, tmp_path, monkeypatch):
    """The check before an update publishes sees a union row the update wrote without an ad's bits
    (a writer's fault: only its base's relations are taken as kept)."""
    root = _root(built, tmp_path)
    real = update.insert_sids

    def dropping(g, *args, **kw):
        out = real(g, *args, **kw)
        out.planes[0].table[len(g.planes[0].table):] = 0  # every row the update added to the bitmask table
        return out

    monkeypatch.setattr(update, "insert_sids", dropping)
    before = _published(root)
    with pytest.raises(ArtifactError, match="bitmask_table.arrow: a .* lacks a bit"):
        run_update(root, _changes(pool, tmp_path / "c.parquet", [_upsert(pool, N_BASE, 10**9)]))
    assert _published(root) == before


# --- pauses, deletes and upserts through full builds ------------------------------------------------

def _export(pool, tmp_path: Path, ads: pl.DataFrame, name: str = "catalog.parquet") -> Path:
    path = tmp_path / name
    ads.write_parquet(path)
    return path


def _build(pool, root: Path, catalog: Path, *extra, run=run_cli) -> dict:
    """`sidindex build --json` through `run` (the console script, or `run_main`'s entry point here)."""
    r = run("build", "--catalog", catalog, "--targeting", pool["targeting"], "--out", root, "--config",
                pool["dir"] / "build.toml", "--force", "--json", *extra)
    assert r.returncode == 0, r.stderr
    return {**json.loads(r.stdout), "stderr": r.stderr}


def test_a_paused_ad_stays_paused_through_a_full_build(built, pool, tmp_path, monkeypatch, capsys):
    """The first build through the console script (its note on stderr as a user sees it); the
    other commands through its entry point in this process."""
    here = functools.partial(run_main, monkeypatch, capsys)
    root = _root(built, tmp_path)
    ads = pool["catalog"].head(N_BASE)
    paused = ads["ad_id"].head(3).to_list()
    run_update(root, _changes(pool, tmp_path / "0001.parquet", [{"ad_id": a, "op": "pause"} for a in paused]))
    report = _build(pool, root, _export(pool, tmp_path, ads))  # the export knows nothing of pauses
    assert report["carried"] == {"paused": 3, "replayed": []}
    assert "were not re-applied" in report["stderr"]  # no watermark: said on stderr
    snap = open_snapshot(root, verify=True)
    assert snap.manifest.lineage is None and snap.manifest.version == SNAPSHOT_VERSION
    assert set(snap.ad_id[snap.row_states == AD_PAUSED].tolist()) == set(paused)
    assert _live(root) == set(ads["ad_id"].to_list()) - set(paused)
    assert here("validate", root).returncode == 0
    assert json.loads(here("inspect", root, "--json").stdout)["paused_ads"] == 3
    # a resume ends the pause; the next build keeps it ended
    run_update(root, _changes(pool, tmp_path / "0002.parquet", [{"ad_id": paused[0], "op": "resume"}]))
    _build(pool, root, _export(pool, tmp_path, ads), run=here)
    assert _live(root) == set(ads["ad_id"].to_list()) - set(paused[1:])


def test_changes_after_the_export_are_applied_again_with_its_watermark(watermarked, pool, tmp_path, monkeypatch,
                                                                        capsys):
    """The first build and the first refusal through the console script; the other commands
    through its entry point in this process (`run_main`: the same report, exit code and line)."""
    here = functools.partial(run_main, monkeypatch, capsys)
    root = _root(watermarked, tmp_path)
    ads = pool["catalog"].head(N_BASE)
    ids = ads["ad_id"].to_list()
    old = _export(pool, tmp_path, ads, "export-old.parquet")  # taken before every change file below
    run_update(root, _changes(pool, tmp_path / "0001.parquet", [{"ad_id": ids[0], "op": "delete"}]))
    run_update(root, _changes(pool, tmp_path / "0002.parquet", [_upsert(pool, N_BASE, 10**9),
                                                                 {"ad_id": ids[1], "op": "delete"}]))
    want = set(ids[2:]) | {10**9}
    report = _build(pool, root, old, "--changes-applied-through", "0000.parquet")
    assert report["carried"]["replayed"] == ["0001.parquet", "0002.parquet"] and report["warnings"] == []
    assert _live(root) == want
    # an export holding 0001 (ids[0] gone from it): only 0002 is applied again, and 0001 leaves the journal
    newer = _export(pool, tmp_path, ads.filter(pl.col("ad_id") != ids[0]), "export-new.parquet")
    report = _build(pool, root, newer, "--changes-applied-through", "0001.parquet", run=here)
    assert report["carried"]["replayed"] == ["0002.parquet"] and _live(root) == want
    journal = open_snapshot(root).manifest.journal
    assert journal is not None and journal.through == "0001.parquet"
    assert [r.name for r in journal.entries] == ["0002.parquet"]
    assert [p.name.partition(".")[0] for p in (root / "changes").iterdir()] == [journal.entries[0].update]
    r = run_cli("build", "--catalog", newer, "--targeting", pool["targeting"], "--out", root,
                "--changes-applied-through", "a/b.parquet")
    assert r.returncode == 2 and "does not name a change file" in r.stderr
    # the watermark carried by the export itself: the same as the option, and refused when they disagree
    import pyarrow.parquet as pq

    table = pq.read_table(newer)
    pq.write_table(table.replace_schema_metadata({**(table.schema.metadata or {}),
                                                  CHANGES_THROUGH_KEY: "0001.parquet"}), newer)
    report = _build(pool, root, newer, run=here)
    assert report["carried"]["replayed"] == ["0002.parquet"] and report["warnings"] == [] and _live(root) == want
    r = here("build", "--catalog", newer, "--targeting", pool["targeting"], "--out", root,
             "--changes-applied-through", "0002.parquet")
    assert r.returncode == 2 and "the build was told '0002.parquet'" in r.stderr, r.stderr
    entry = journal.entries[0]  # a journal file changed since its update published it
    journaled = Root(root).entry_dir(entry.update, entry.sha256) / entry.name
    os.chmod(journaled, 0o644)
    pl.read_parquet(journaled).with_columns(pl.lit("pause").alias("op")).write_parquet(journaled)
    before = _published(root)
    r = here("build", "--catalog", newer, "--targeting", pool["targeting"], "--out", root, "--config",
             pool["dir"] / "build.toml", "--force", "--changes-applied-through", "0001.parquet")
    assert r.returncode == 2 and "so the journal was changed" in r.stderr and _published(root) == before, r.stderr


def test_the_ray_engine_carries_changes_forward_as_the_local_one_does(built, pool, tmp_path, monkeypatch, capsys):
    """Pauses carried and change files re-applied over the snapshot the Ray tasks wrote: the local
    engine's snapshot, file for file. The Ray build through the console script (its local Ray ends
    with the process); the local one through its entry point in this process."""
    pytest.importorskip("ray")
    from tests.test_scaleout import _same_snapshot

    ads = pool["catalog"].head(N_BASE)
    ids = ads["ad_id"].to_list()
    old = _export(pool, tmp_path, ads, "export.parquet")
    roots = [Path(shutil.copytree(built, tmp_path / engine)) for engine in ("local", "ray")]
    for root in roots:
        run_update(root, _changes(pool, tmp_path / "0001.parquet", [{"ad_id": ids[0], "op": "pause"},
                                                                    {"ad_id": ids[1], "op": "delete"}]))
        run_update(root, _changes(pool, tmp_path / "0002.parquet", [_upsert(pool, N_BASE, 10**9)]))
    local = _build(pool, roots[0], old, "--changes-applied-through", "0001.parquet",
                   run=functools.partial(run_main, monkeypatch, capsys))
    ray = _build(pool, roots[1], old, "--changes-applied-through", "0001.parquet", "--engine", "ray", "--workers", "2")
    assert local["carried"] == ray["carried"] == {"paused": 1, "replayed": ["0002.parquet"]}
    _same_snapshot(roots[0], roots[1])
    assert _live(roots[1]) == set(ids[1:]) | {10**9}  # the export holds 0001: its delete is not the truth
    assert not [p for p in (roots[1] / "snapshots").iterdir() if p.name.startswith(".")]  # nothing staged is left


# rounds of 1-3 change files (pause/resume/delete an existing ad, upsert a new one or one deleted
# before), each round
# ending in a full build from an export `lag` change files old, told its watermark (an export older
# than the last build's is refused)
CHANGE = st.tuples(st.sampled_from(["pause", "resume", "delete", "new", "revive"]), st.integers(0, 10**6))
ROUNDS = st.lists(st.tuples(st.lists(CHANGE, min_size=1, max_size=3), st.integers(0, 3)), min_size=1, max_size=3)


@settings(max_examples=6, deadline=None, suppress_health_check=list(HealthCheck))
@given(rounds=ROUNDS)
def test_no_interleaving_of_changes_and_builds_serves_a_paused_ad(watermarked, pool, tmp_path_factory, rounds):
    tmp = tmp_path_factory.mktemp("interleaved")
    root = _root(watermarked, tmp)
    fresh = pool["catalog"].tail(len(pool["catalog"]) - N_BASE)
    catalog = [pool["catalog"].head(N_BASE)]  # the catalog after each change file (pauses are not in it)
    paused: set[int] = set()
    deleted: list[int] = []
    names = ["0000.parquet"]  # change file names; catalog[k] holds every change up to names[k]
    through = 0  # the newest export a build read

    def check():
        live = _live(root)
        assert not live & paused  # never a paused ad
        assert live == set(catalog[-1]["ad_id"].to_list()) - paused  # nor a deleted one, nor one lost

    for changes, lag in rounds:
        for op, pick in changes:
            now = catalog[-1]
            ids = now["ad_id"].to_list()
            if op in ("new", "revive"):
                ad = deleted.pop(pick % len(deleted)) if op == "revive" and deleted else 10**9 + len(names)
                rows = [_upsert(pool, N_BASE + pick % len(fresh), ad)]
                new = fresh.slice(pick % len(fresh), 1).with_columns(pl.lit(ad, dtype=pl.Int64).alias("ad_id"))
                now = pl.concat([now, new])
            else:
                ad = ids[pick % len(ids)]
                rows = [{"ad_id": ad, "op": op}]
                if op == "delete":
                    now = now.filter(pl.col("ad_id") != ad)
                    paused.discard(ad)
                    deleted.append(ad)
                elif op == "pause":
                    paused.add(ad)
                else:
                    paused.discard(ad)
            names.append(f"{len(names):04d}.parquet")
            run_update(root, _changes(pool, tmp / names[-1], rows))
            catalog.append(now)
            check()
        k = max(0, len(catalog) - 1 - lag)
        export = _export(pool, tmp, catalog[k], f"export{len(names)}.parquet")
        build = functools.partial(run_build, export, pool["targeting"], root, config=pool["dir"] / "build.toml",
                                  codebook=root, force=True, changes_through=names[k])
        if k < through:
            before = _published(root)
            with pytest.raises(InputError, match="building from it would revert the changes in between"):
                build()
            assert _published(root) == before
        else:
            report = build()
            assert report["carried"]["replayed"] == names[k + 1:]
            through = k
        check()


# --- racing writers and the scheduled pipeline ------------------------------------------------------

HOLDER = """
import sys, time
from pathlib import Path
import sidindex.job as job
real = job.apply_changes
def held(*a, **k):  # holds the ROOT's lock until the test says go
    Path(sys.argv[3]).touch()
    while not Path(sys.argv[4]).exists():
        time.sleep(0.02)
    return real(*a, **k)
job.apply_changes = held
job.run_update(Path(sys.argv[1]), Path(sys.argv[2]))
"""


def _wait_for(path: Path, timeout: float = 60) -> None:
    t0 = time.monotonic()
    while not path.exists():
        assert time.monotonic() - t0 < timeout, f"{path} never appeared"
        time.sleep(0.02)


def test_a_build_that_waited_while_another_writer_published_refuses(built, pool, tmp_path):
    root = _root(built, tmp_path)
    change = _changes(pool, tmp_path / "0001.parquet", [{"ad_id": int(pool["catalog"]["ad_id"][0]), "op": "delete"}])
    export = _export(pool, tmp_path, pool["catalog"].head(N_BASE))
    held, go = tmp_path / "held", tmp_path / "go"
    update = subprocess.Popen([sys.executable, "-c", HOLDER, str(root), str(change), str(held), str(go)],
                              stderr=subprocess.PIPE, text=True)
    _wait_for(held)  # the update holds the lock
    build = subprocess.Popen([shutil.which("sidindex"), "build", "--catalog", str(export), "--targeting",
                              str(pool["targeting"]), "--out", str(root), "--config", str(pool["dir"] / "build.toml"),
                              "--force"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    t0 = time.monotonic()
    while "waiting" not in (build.stderr.readline() if build.poll() is None else "waiting"):
        assert time.monotonic() - t0 < 60
    go.touch()
    assert update.wait(timeout=120) == 0, update.stderr.read()
    published = Root(root).current_id()
    _, err = build.communicate(timeout=300)
    assert build.returncode == 2, err
    assert f"an update was published while this build waited for the ROOT (CURRENT is now {published})" in err, err
    assert Root(root).current_id() == published  # the update stands


def test_the_pipeline_archives_a_change_file_a_build_already_holds(built, pool, tmp_path, monkeypatch, capsys):
    """The first run through `python -m pipelines.rebuild`; the others through its main in this
    process (`run_entry`: the same exit code and report)."""
    from pipelines import rebuild

    root = _root(built, tmp_path)
    changes = tmp_path / "changes"
    changes.mkdir()
    ids = pool["catalog"]["ad_id"].head(N_BASE).to_list()
    export = _export(pool, tmp_path, pool["catalog"].head(N_BASE))
    job = tmp_path / "job.toml"

    def write_job(**extra):
        keys = {"catalog": export, "targeting": pool["targeting"], "root": root, "config": pool["dir"] / "build.toml",
                "changes": changes, **extra}
        job.write_text("".join(f'{k} = "{v}"\n' for k, v in keys.items()))

    runs = []

    def pipeline(*args):
        runs.append(args)
        if len(runs) == 1:
            return subprocess.run([sys.executable, "-m", "pipelines.rebuild", str(job), *args], capture_output=True,
                                  text=True, timeout=300)
        return run_entry(monkeypatch, capsys, rebuild.main, ["rebuild", str(job), *args])

    # 0001 published by an update that was killed before it archived the file, then a full build
    _changes(pool, changes / "0001.parquet", [{"ad_id": ids[0], "op": "delete"}])
    run_update(root, changes / "0001.parquet")
    for n, extra in enumerate(({}, {"changes_applied_through": "0001.parquet"})):  # without a watermark, with one
        write_job(**extra)
        assert pipeline().returncode == 0
        later = f"{n + 2:04d}.parquet"
        _changes(pool, changes / later, [{"ad_id": ids[n + 1], "op": "pause"}])
        r = pipeline("--update")
        assert r.returncode == 0, r.stderr
        report = json.loads((root / "reports" / "latest.json").read_text())
        applied = {a["file"]: a["status"] for a in report["applied"]}
        assert applied == {"0001.parquet": "already applied", later: "published"}
        assert sorted(p.name for p in changes.iterdir()) == ["applied"] and ids[n + 1] not in _live(root)
        (changes / "applied" / "0001.parquet").replace(changes / "0001.parquet")  # pending again


LOCKER = """
import sys
from pathlib import Path
from sidindex.root import Root
with Root(sys.argv[1]).lock():
    Path(sys.argv[2]).touch()
    sys.stdin.read()  # until the test closes it
"""


@pytest.mark.parametrize("signum, code", [("SIGINT", 130), ("SIGTERM", 143)])
def test_an_interrupted_pipeline_run_exits_128_plus_the_signal_and_publishes_nothing(built, pool, tmp_path, signum,
                                                                                       code):
    import signal

    root = _root(built, tmp_path)
    job = tmp_path / "job.toml"
    keys = {"catalog": _export(pool, tmp_path, pool["catalog"].head(N_BASE)), "targeting": pool["targeting"],
            "root": root, "config": pool["dir"] / "build.toml", "force": "true"}
    job.write_text("".join(f'{k} = "{v}"\n' if k != "force" else f"{k} = {v}\n" for k, v in keys.items()))
    before = _published(root)
    locked = tmp_path / "locked"
    locker = subprocess.Popen([sys.executable, "-c", LOCKER, str(root), str(locked)], stdin=subprocess.PIPE)
    try:
        _wait_for(locked)
        run = subprocess.Popen([sys.executable, "-m", "pipelines.rebuild", str(job)], stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True)
        waiting = run.stderr.readline()  # past start-up, waiting on the ROOT's lock
        assert "waiting for another build or update on this ROOT" in waiting, waiting
        run.send_signal(getattr(signal, signum))
        out, err = run.communicate(timeout=60)
    finally:
        locker.stdin.close()
        locker.wait(timeout=60)
    assert run.returncode == code and f"interrupted by {signum}; nothing published" in err, err
    assert "Traceback" not in err and json.loads(out)["status"] == "interrupted"
    assert json.loads((root / "reports" / "latest.json").read_text())["exit_code"] == code
    assert _published(root)[:3] == before[:3]


def test_a_later_change_file_with_an_earlier_ones_bytes_is_applied(built, pool, tmp_path):
    """pause, resume, then pause again in a file with the first one's bytes: the journal matches a
    file by name and bytes, so the third is applied, not taken for the first."""
    root = _root(built, tmp_path)
    ad = int(pool["catalog"]["ad_id"][0])
    first = _changes(pool, tmp_path / "0001.parquet", [{"ad_id": ad, "op": "pause"}])
    run_update(root, first, once=True)
    run_update(root, _changes(pool, tmp_path / "0002.parquet", [{"ad_id": ad, "op": "resume"}]), once=True)
    third = tmp_path / "0003.parquet"
    shutil.copyfile(first, third)
    assert run_update(root, third, once=True)["status"] == "published" and ad not in _live(root)
    assert run_update(root, first, once=True)["status"] == "already applied"


def test_an_unreadable_current_is_refused_not_built_over(built, pool, tmp_path, monkeypatch, capsys):
    root = _root(built, tmp_path)
    (root / "CURRENT").write_bytes(b"\xff\xfe garbage")
    before = _published(root)
    r = run_cli("build", "--catalog", _export(pool, tmp_path, pool["catalog"].head(N_BASE)), "--targeting",
                pool["targeting"], "--out", root, "--config", pool["dir"] / "build.toml", "--force")
    assert r.returncode == 2 and "does not name a snapshot" in r.stderr and "Restore CURRENT" in r.stderr, r.stderr
    r = run_main(monkeypatch, capsys, "update", root, "--changes",  # the update through the entry point here
                 _changes(pool, tmp_path / "c.parquet", [{"ad_id": 1, "op": "pause"}]))
    assert r.returncode == 2 and "does not name a snapshot" in r.stderr, r.stderr
    assert _published(root) == before
