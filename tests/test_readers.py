"""Readers of a ROOT (docs/design.md §7, §8).

- One validator: over crafted snapshots published as an update of the served one (sharing its
  files by hard link), a watcher polling over the served snapshot swaps exactly when
  `runtime.load` of the ROOT succeeds and exactly when `sidindex validate` exits 0 (the checks
  `validate` alone makes off the serving path, sha256 and matcher cover, hold in every case).
- Retention under readers: a reader whose snapshot is pruned while it is opened reads CURRENT again
  and opens the newer one, once; pruned again, or given the snapshot directory itself, it gets the
  "pruned" error, never a file of it reported missing. A reader racing real `--keep 1` publishes
  gets nothing else.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import polars as pl
import pytest

import runtime
import sidindex.snapshot.snapshot as snapshot_module
from schemas.artifacts import AD_DELETED, AD_LIVE, FAST_DIGEST, shard_dir
from sidindex.artifact import seal
from sidindex.errors import ArtifactError
from sidindex.job import run_build, run_update
from sidindex.root import Root
from sidindex.sid import save_codebook
from sidindex.snapshot import open_snapshot
from sidindex_cli.app import main as cli_main
from tests.conftest import sampled_codebook
from tests.test_snapshot import array_file, listed_arrays, reseal, rewrite_array

CONFIG = ('[sid]\nlevels = [8, 4, 4]\nhash_size = 16\npaths = 2\nmin_points_per_centroid = 4\n'
          '[kway]\nmode = "dynamic"\nk_max = 3\n')
N_ADS = 150
SHARDS = 3
PRUNED = "pruned by retention"


@pytest.fixture(scope="module")
def built(sample_dir, tmp_path_factory) -> dict:
    """A ROOT holding a full build, an update of it that upserts one ad (its old row deleted) and an
    update of that one pausing another ad, which shares every file but the ad states' by hard link
    (the snapshot a watcher serves, and what it swaps to); the change files of a pause and a resume."""
    base = tmp_path_factory.mktemp("readers")
    cat = pl.read_parquet(sample_dir / "catalog.parquet")
    cat.head(N_ADS).write_parquet(base / "catalog.parquet")
    (base / "build.toml").write_text(CONFIG)
    root = base / "root"
    save_codebook(sampled_codebook(cat.head(N_ADS)), root)
    full = run_build(base / "catalog.parquet", sample_dir / "targeting.toml", root, config=base / "build.toml",
                     shards=SHARDS)
    ids = cat["ad_id"].head(N_ADS).to_list()
    schema = {**cat.schema, "embedding": pl.List(pl.Float32), "op": pl.String}

    def changes(name: str, rows: list[dict]) -> Path:
        pl.DataFrame(rows, schema=schema).write_parquet(base / name)
        return base / name

    upsert = {**cat.row(N_ADS, named=True), "ad_id": ids[0], "op": "upsert"}  # row 0 deleted, a new row for ids[0]
    served = run_update(root, changes("upsert.parquet", [upsert]))
    update = run_update(root, changes("pause.parquet", [{"ad_id": ids[1], "op": "pause"}]))
    changes("resume.parquet", [{"ad_id": ids[1], "op": "resume"}])
    return {"root": root, "dir": base, "full": full["snapshot_id"], "served": served["snapshot_id"],
            "update": update["snapshot_id"]}


def _copy(built: dict, to: Path, current: str) -> Root:
    """A copy of the built ROOT, its snapshots' shared files still one inode each, CURRENT naming `current`."""
    seen: dict[int, str] = {}

    def copy(src: str, dst: str) -> None:
        ino = os.stat(src).st_ino
        if ino in seen:
            os.link(seen[ino], dst)
        else:
            shutil.copy2(src, dst)
            seen[ino] = dst

    root = Root(shutil.copytree(built["root"], to, copy_function=copy))
    root.current_file.write_text(current + "\n")
    return root


LEAF_ADS = f"{shard_dir(0)}/leaf_ads.arrow"


# --- one validator ------------------------------------------------------------------------------

def _shape(name: str, key: str, delta: int):
    """The rows or the width the manifest declares for array `name`, off by `delta`."""
    def mutate(root: Root, u: Path, b: Path) -> None:
        reseal(u, lambda m: listed_arrays(m, name)[name].__setitem__(key, listed_arrays(m, name)[name][key] + delta))
    return mutate


def _entry(name: str, key: str, value):
    """File `name`'s manifest entry with `key` set to `value` (sealed again)."""
    def mutate(root: Root, u: Path, b: Path) -> None:
        reseal(u)
        m = json.loads((u / "manifest.json").read_text())
        m["files"][name][key] = value
        (u / "manifest.json").write_bytes(seal(m))
    return mutate


def _moved_behind_link(where: str):
    """The update's directory moved (out of the ROOT, or beside its snapshots), a symbolic link in its place."""
    def mutate(root: Root, u: Path, b: Path) -> None:
        target = (root.path.parent / "elsewhere" if where == "outside" else root.path / "kept") / u.name
        target.parent.mkdir()
        u.rename(target)
        u.symlink_to(target if where == "outside" else os.path.relpath(target, u.parent))
    return mutate


def _file_linked_to_base(root: Root, u: Path, b: Path) -> None:
    array_file(u, "leaf_ads").unlink()
    array_file(u, "leaf_ads").symlink_to(array_file(b, "leaf_ads"))


def _revived(root: Root, u: Path, b: Path) -> None:
    """The deleted row of the upserted ad live again beside its new row (a second live row of its id)."""
    state = np.array(open_snapshot(u, verify=False).exact.ad_state)
    state[state == AD_DELETED] = AD_LIVE
    rewrite_array(u, "ad_state", state)


def _entry_live_flipped(root: Root, u: Path, b: Path) -> None:
    live = np.array(open_snapshot(u, verify=False).gtm.entry_live)
    live[-1] ^= 1
    rewrite_array(u, "entry_live", live)


def _states_dropped(root: Root, u: Path, b: Path) -> None:
    """The update's ad states and liveness flags left out (a snapshot without them has every row
    live: the deleted row of the upserted ad too, a second live row of its id), all else linked."""
    def drop(m: dict) -> None:
        del m["arrays"]["ad_state"], m["lineage"]
        for shard in m["shards"]:
            del shard["arrays"]["entry_live"]
    (u / "ad_state.arrow").unlink()
    for f in u.glob("shards/*/entry_live.arrow"):
        f.unlink()
    reseal(u, drop)


def _range_moved(root: Root, u: Path, b: Path) -> None:
    """The boundary after the first shard holding two first-level tokens moved onto its last one
    (which it then holds outside its range), every file linked."""
    shards = open_snapshot(u, verify=False).shards
    k, last = next((k, int(s.gtm.csr_tokens[int(s.gtm.node_offsets[1]) - 1])) for k, s in enumerate(shards[:-1])
                   if int(s.gtm.node_offsets[1]) >= 2)

    def move(m: dict) -> None:
        m["shards"][k]["tokens"][1] = m["shards"][k + 1]["tokens"][0] = last
    reseal(u, move)


# name: (mutate(root, the update's directory, the served snapshot's directory), whether it is a sound snapshot)
CASES = {
    "the update as written": (lambda root, u, b: None, True),
    "resealed with a statistic added": (lambda root, u, b: reseal(u, lambda m: m["stats"].__setitem__("x", 1)), True),
    "snapshot directory a link out of the ROOT": (_moved_behind_link("outside"), False),
    "snapshot directory a link inside the ROOT": (_moved_behind_link("inside"), False),
    "a file a symbolic link to the base's": (_file_linked_to_base, False),
    "a linked file's rows misstated (one more)": (_shape("leaf_ads", "rows", 1), False),
    "a linked file's rows misstated (one fewer)": (_shape("leaf_ad_offsets", "rows", -1), False),
    "a linked table's rows misstated": (_shape("bitmask_table", "rows", -1), False),
    "a linked file's width misstated": (_shape("bloom_table", "width", 1), False),
    "a linked file's fast digest misstated": (_entry(LEAF_ADS, FAST_DIGEST, "0" * 32), False),
    "a linked file's size misstated": (_entry(LEAF_ADS, "bytes", 8), False),
    "a linked file missing": (lambda root, u, b: array_file(u, "leaf_ads").unlink(), False),
    "a file not listed": (lambda root, u, b: (u / "extra.arrow").write_bytes(b"x"), False),
    "level sizes out of the tokens' range": (
        lambda root, u, b: reseal(u, lambda m: m.__setitem__("level_sizes", [2, 2, 2, 2])), False),
    "level sizes one more each": (
        lambda root, u, b: reseal(u, lambda m: m.__setitem__("level_sizes", [s + 1 for s in m["level_sizes"]])), False),
    "lineage counts misstated": (lambda root, u, b: reseal(u, lambda m: m["lineage"].__setitem__("paused", 0)), False),
    "lineage changes malformed": (lambda root, u, b: reseal(u, lambda m: m["lineage"]["changes"].pop("resume")), False),
    "another codebook id": (
        lambda root, u, b: reseal(u, lambda m: m.__setitem__("codebook_id", "cb-" + "0" * 16)), False),
    "k-way partitions denied": (lambda root, u, b: reseal(u, lambda m: m.__setitem__("kway", False)), False),
    "an attribute dropped from the targeting": (
        lambda root, u, b: reseal(u, lambda m: m["targeting"]["attribute"].pop()), False),
    "a deleted row live again": (_revived, False),
    "an entry's liveness flipped": (_entry_live_flipped, False),
    "the ad states dropped": (_states_dropped, False),
    "a shard's range moved": (_range_moved, False),
}


def _validate(root: Path, monkeypatch) -> int:
    """The exit code of `sidindex validate ROOT` (the console script's entry point, in this process)."""
    monkeypatch.setattr(sys, "argv", ["sidindex", "validate", str(root)])
    try:
        cli_main()
    except SystemExit as e:
        return e.code
    return 0


@pytest.mark.parametrize("case", list(CASES))
def test_the_watcher_validate_and_load_agree(built, tmp_path, monkeypatch, case):
    mutate, valid = CASES[case]
    root = _copy(built, tmp_path / "root", built["served"])
    watcher = runtime.SnapshotWatcher(root.path, "cpu")
    u, b = root.snapshot_dir(built["update"]), root.snapshot_dir(built["served"])
    mutate(root, u, b)
    root.current_file.write_text(built["update"] + "\n")
    swapped = watcher.poll()
    try:
        runtime.load(root.path, "cpu")
        loaded = True
    except ArtifactError:
        loaded = False
    code = _validate(root.path, monkeypatch)
    assert (swapped, loaded, code == 0) == (valid, valid, valid), (watcher.last_error, code)
    assert code in (0, 2)
    if valid:  # through the shared files: only the new ad states were checked and moved
        assert watcher.current.load_info["shared_with"] == built["served"]


# --- retention under readers -----------------------------------------------------------------------

def _prune_while_opening(monkeypatch, root: Root, newer: list[str], *, whole: bool = False) -> None:
    """The first calls of opening's file check each publish the next id of `newer` and prune the
    snapshot being opened first: its Arrow files deleted, its directory still there (retention's
    rmtree midway), or with `whole` the directory gone."""
    check, todo = snapshot_module.verify_files, list(newer)

    def publish_and_prune(directory: Path, *args, **kwargs):
        if todo:
            root.current_file.write_text(todo.pop(0) + "\n")
            if whole:
                shutil.rmtree(directory)
            for f in directory.rglob("*.arrow"):
                f.unlink()
        return check(directory, *args, **kwargs)

    monkeypatch.setattr(snapshot_module, "verify_files", publish_and_prune)


def _open_root(root: Root) -> str:
    return open_snapshot(root.path).id


def _load_root(root: Root) -> str:
    return runtime.load(root.path, "cpu").id


@pytest.mark.parametrize("read", [_open_root, _load_root])
def test_a_reader_pruned_mid_open_opens_the_newer_snapshot(built, tmp_path, monkeypatch, read):
    root = _copy(built, tmp_path / "root", built["full"])
    _prune_while_opening(monkeypatch, root, [built["served"]])
    assert read(root) == built["served"]
    assert root.snapshot_dir(built["full"]).is_dir()  # found with files missing, not gone: CURRENT said it


@pytest.mark.parametrize("read", [_open_root, _load_root])
def test_a_reader_pruned_twice_is_told_so(built, tmp_path, monkeypatch, read):
    root = _copy(built, tmp_path / "root", built["full"])
    _prune_while_opening(monkeypatch, root, [built["served"], built["update"]])
    with pytest.raises(ArtifactError, match=PRUNED) as e:
        read(root)
    assert "missing" not in str(e.value) and built["served"] in str(e.value)


def test_a_snapshot_directory_deleted_under_its_reader_is_pruned(built, tmp_path, monkeypatch):
    root = _copy(built, tmp_path / "root", built["full"])
    _prune_while_opening(monkeypatch, root, [built["served"]], whole=True)
    with pytest.raises(ArtifactError, match=PRUNED):
        open_snapshot(root.snapshot_dir(built["full"]))


def test_a_watcher_pruned_mid_poll_swaps_to_the_newer_snapshot_or_says_pruned(built, tmp_path, monkeypatch):
    root = _copy(built, tmp_path / "root", built["full"])
    watcher = runtime.SnapshotWatcher(root.path, "cpu")
    root.current_file.write_text(built["served"] + "\n")
    _prune_while_opening(monkeypatch, root, [built["update"]])
    assert watcher.poll() and watcher.current.id == built["update"]
    root = _copy(built, tmp_path / "again", built["full"])
    watcher = runtime.SnapshotWatcher(root.path, "cpu")
    root.current_file.write_text(built["served"] + "\n")
    _prune_while_opening(monkeypatch, root, [built["update"], built["full"]])
    assert not watcher.poll() and watcher.current.id == built["full"] and PRUNED in watcher.last_error


PUBLISHER = """
import sys
from sidindex.job import run_update
root, pause, resume, n = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
for i in range(n):
    run_update(root, pause if i % 2 else resume, keep=1)
"""


def test_readers_racing_keep_1_publishes_load_or_are_told_pruned(built, tmp_path):
    root = _copy(built, tmp_path / "root", built["update"])
    publisher = subprocess.Popen([sys.executable, "-c", PUBLISHER, str(root.path), str(built["dir"] / "pause.parquet"),
                                  str(built["dir"] / "resume.parquet"), "8"], stderr=subprocess.PIPE, text=True)
    loaded, pruned, deadline = set(), 0, time.monotonic() + 60
    try:
        while publisher.poll() is None and time.monotonic() < deadline:
            try:
                loaded.add(runtime.load(root.path, "cpu").id)
            except ArtifactError as e:
                assert PRUNED in str(e), e
                pruned += 1
    finally:
        publisher.kill()
        _, err = publisher.communicate()
    assert publisher.returncode == 0, err
    assert len(loaded) > 1, (loaded, pruned)  # loads interleaved with the publishes
