"""Snapshots: exact round trip, every byte covered (a flipped bit anywhere, manifest and codebook
included, is refused), a strict sealed manifest, crafted files (FIFOs, links, /dev/zero) refused at
once, structure that arithmetic cannot fool, Arrow files that standard tools read, a fuzzed reader
that never crashes, SIGKILL during build/publish, concurrent builds, and bad input through the CLI
leaving the published snapshot untouched. Value fuzzing with resealed checksums is in
test_snapshot_fuzz.py; publishing and retention in test_root.py."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import threading
import time
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from schemas.artifacts import ARRAYS_BY_NAME, READ_VERSIONS, SNAPSHOT_ARRAYS, SNAPSHOT_VERSION, UNLISTED, shard_dir
from sidindex import artifact
from sidindex.artifact import list_files, seal
from sidindex.build import build_index
from sidindex.errors import ArtifactError
from sidindex.ingest import read_catalog
from sidindex.sid import assign_sids, hash_tokens, load_codebook
from sidindex.snapshot import open_snapshot
from sidindex.snapshot import snapshot as snapshot_module
from sidindex.snapshot.arrays import write_array, write_array_pieces
from sidindex.targeting import load_targeting
from tests.conftest import run_cli
from tests.in_process import run_main

CONFIG = "[sid]\nlevels = [16, 8, 8]\nhash_size = 128\npaths = 2\nmin_points_per_centroid = 10\n"
KWAY_CONFIG = CONFIG + '[kway]\nmode = "static"\nk = [4, 4, 2, 2]\n'


def cli(*args, timeout: float = 300, **kw) -> subprocess.CompletedProcess:
    return run_cli(*args, timeout=timeout, **kw)


def build_args(sample: Path, root: Path, config: Path, *extra) -> list:
    return ["build", "--catalog", sample / "catalog.parquet", "--targeting", sample / "targeting.toml",
            "--out", root, "--config", config, "--json", *extra]


@pytest.fixture(scope="module")
def built(sample_dir, tmp_path_factory):
    """A ROOT with one published snapshot (k-way on), built through the CLI."""
    base = tmp_path_factory.mktemp("snap")
    (base / "build.toml").write_text(KWAY_CONFIG)
    r = cli(*build_args(sample_dir, base / "root", base / "build.toml"))
    assert r.returncode == 0, r.stderr
    return base, json.loads(r.stdout)


@pytest.fixture
def snap_dir(built, tmp_path) -> Path:
    """A private copy of the published snapshot directory, to corrupt."""
    base, report = built
    return Path(shutil.copytree(report["path"], tmp_path / report["snapshot_id"]))


def test_round_trip_equals_in_memory_build(built, sample_dir):
    base, report = built
    assert report["status"] == "published"
    snap = open_snapshot(base / "root")
    assert snap.id == report["snapshot_id"] and snap.path == Path(report["path"])
    spec = load_targeting(sample_dir / "targeting.toml")
    cb = load_codebook(base / "root")
    cat = read_catalog(sample_dir / "catalog.parquet", spec=spec, hash_keys=cb.hash_keys)
    a = assign_sids(cb, cat.embedding, hash_tokens(cat.columns, cb.hash_keys, cb.hash_size))
    from sidindex.config import load_config

    ref = build_index(spec, cat.columns, a.sids, a.ad_index, cb.level_sizes, kway=load_config(base / "build.toml").kway,
                      ad_value=cat.value)
    for name in ("node_offsets", "csr_child_nodes", "csr_tokens", "bitmask_index", "bloom_index", "bitmask_table",
                 "bloom_table", "depth_offsets", "leaf_ad_offsets", "leaf_ads", "part_offsets", "part_bitmask_index",
                 "part_bloom_index", "ad_value", "entry_value", "part_value"):
        got, want = snap.gtm.arrays()[name], ref.gtm.arrays()[name]
        assert got.dtype == want.dtype and np.array_equal(got, want), name
        assert not got.flags.writeable, name  # read-only maps: nothing can modify a published file
    assert snap.exact.arrays().keys() == ref.exact.arrays().keys() == {
        a.name for a in SNAPSHOT_ARRAYS if a.name.startswith("exact_")}
    for name, want in ref.exact.arrays().items():
        assert np.array_equal(snap.exact.arrays()[name], want), name
    assert np.array_equal(snap.ad_id, cat.ad_id)
    assert snap.spec == spec and snap.manifest.codebook_id == cb.id
    assert load_codebook(snap.path).id == cb.id and snap.codebook.id == cb.id  # the snapshot carries its codebook


def test_unchanged_inputs_publish_nothing_unless_forced(built, sample_dir, tmp_path):
    base, report = built
    root = Path(shutil.copytree(base / "root", tmp_path / "root"))
    r = cli(*build_args(sample_dir, root, base / "build.toml"))
    assert r.returncode == 0, r.stderr
    again = json.loads(r.stdout)
    assert again["status"] == "unchanged" and again["snapshot_id"] == report["snapshot_id"]
    assert again["codebook"] == "reused"
    r = cli(*build_args(sample_dir, root, base / "build.toml", "--force", "--keep", "1"))
    forced = json.loads(r.stdout)
    assert forced["status"] == "published" and forced["snapshot_id"] != report["snapshot_id"]
    assert (root / "CURRENT").read_text().strip() == forced["snapshot_id"]
    assert sorted(p.name for p in (root / "snapshots").iterdir()) == [forced["snapshot_id"]]  # retention


def _files(d: Path) -> list[Path]:
    """Every file of a snapshot, manifest and carried codebook included."""
    return sorted(p for p in d.rglob("*") if p.is_file())


def test_every_flipped_byte_and_truncation_anywhere_is_refused(snap_dir):
    rng = np.random.default_rng(0)
    files = _files(snap_dir)
    names = {str(p.relative_to(snap_dir)) for p in files}
    full_build = [a for a in SNAPSHOT_ARRAYS if a.group != "updated"]  # k-way on: every array but an update's
    assert len([n for n in names if n.endswith(".arrow")]) == len(full_build)
    assert "manifest.json" in names and {n for n in names if n.startswith("codebooks/")}  # all of them covered
    for path in files:
        data = path.read_bytes()
        for pos in {0, len(data) - 1, *rng.integers(0, len(data), 3).tolist()}:
            path.write_bytes(data[:pos] + bytes([data[pos] ^ 0x01]) + data[pos + 1:])  # one bit
            with pytest.raises(ArtifactError, match=re.escape(path.name)):
                open_snapshot(snap_dir)
        for cut in (0, len(data) // 2, len(data) - 1):
            path.write_bytes(data[:cut])
            with pytest.raises(ArtifactError, match=re.escape(path.name)):
                open_snapshot(snap_dir)
        path.write_bytes(data)
    open_snapshot(snap_dir)  # restored: opens again


@pytest.mark.parametrize("side_by_side", [True, False])
def test_a_damaged_file_is_named_by_its_checksum_whatever_its_structure_shows(snap_dir, monkeypatch, side_by_side):
    """Digests are checked beside the structure checks (or before them, a benchmark's reference):
    damage that also breaks the structure is reported as the damaged file's checksum mismatch."""
    monkeypatch.setattr(snapshot_module, "CHECKS_SIDE_BY_SIDE", side_by_side)
    path = array_file(snap_dir, "node_offsets")
    offsets = open_snapshot(snap_dir).gtm.node_offsets
    data = bytearray(path.read_bytes())
    at = bytes(data).index(offsets[1:].tobytes())  # node 0's end: a wrap-around the structure checks refuse
    data[at:at + 8] = np.int64(-2**63).tobytes()
    path.write_bytes(bytes(data))
    with pytest.raises(ArtifactError, match=re.escape(f"{path}: checksum mismatch")):
        open_snapshot(snap_dir)
    with pytest.raises(ArtifactError, match="node_offsets"):  # what the structure check alone finds
        open_snapshot(snap_dir, verify=False)


def test_an_interrupted_open_stops_the_digests_beside_it(snap_dir, monkeypatch):
    """Ctrl-C during the structure checks ends the digests running beside them at their next
    chunk, not once every file is hashed, and is what the open raises."""
    hashed, started = [], threading.Event()
    real = artifact._chunk_digest

    def slow(mm, start):
        started.set()
        time.sleep(0.05)
        hashed.append(start)
        return real(mm, start)

    def interrupted(*args, **kwargs):
        started.wait(10)
        raise KeyboardInterrupt

    monkeypatch.setattr(artifact, "_chunk_digest", slow)
    monkeypatch.setattr(artifact, "THREADS", 1)
    monkeypatch.setattr(snapshot_module, "_checked", interrupted)
    assert len(_files(snap_dir)) > 10
    with pytest.raises(KeyboardInterrupt):
        open_snapshot(snap_dir)
    assert 1 <= len(hashed) <= 2  # the chunk hashing when the interrupt came, and at most one queued before


def reseal(snap_dir: Path, edit=None) -> None:
    """Edit the manifest and seal it again with every file's checksum recomputed, as a buggy or
    malicious writer would: the edit reaches the checks behind the checksums."""
    m = json.loads((snap_dir / "manifest.json").read_text())
    if edit:
        edit(m)
    m["files"] = list_files(snap_dir, UNLISTED, fast=True)
    (snap_dir / "manifest.json").write_bytes(seal(m))


def array_file(snap_dir: Path, name: str, shard: int = 0) -> Path:
    """The file of array `name` (of shard `shard` for a shard's array)."""
    spec = ARRAYS_BY_NAME[name]
    return snap_dir / spec.file if spec.scope == "global" else snap_dir / shard_dir(shard) / spec.file


def listed_arrays(m: dict, name: str, shard: int = 0) -> dict:
    """The manifest's array list (a dict of the manifest JSON `m`) that holds array `name`."""
    return m["arrays"] if ARRAYS_BY_NAME[name].scope == "global" else m["shards"][shard]["arrays"]


def rewrite_array(snap_dir: Path, name: str, array: np.ndarray, rows: int | None = None, shard: int = 0) -> None:
    """Replace an array's file with `array` (the manifest's rows follow unless `rows` is given) and reseal."""
    path = array_file(snap_dir, name, shard)
    path.unlink()
    write_array(path.parent, ARRAYS_BY_NAME[name], array)
    reseal(snap_dir, lambda m: listed_arrays(m, name, shard)[name].__setitem__("rows", len(array) if rows is None
                                                                                 else rows))


def test_rewriting_helpers_reach_the_structure_checks(snap_dir):
    rewrite_array(snap_dir, "leaf_ads", open_snapshot(snap_dir).gtm.leaf_ads.copy())  # same values: still opens
    open_snapshot(snap_dir, verify=True)


def _dup_key(snap_dir: Path) -> None:
    raw = (snap_dir / "manifest.json").read_text()
    key = f' "format_version": {SNAPSHOT_VERSION},\n'
    (snap_dir / "manifest.json").write_text(raw.replace(key, key + key))


def _nested(snap_dir: Path) -> None:
    (snap_dir / "manifest.json").write_text("[" * 100_000 + "]" * 100_000)


@pytest.mark.parametrize("corrupt, message", [
    (lambda d: reseal(d, lambda m: m.__setitem__("build_confg", m.pop("build_config"))), "unexpected .'build_confg'"),
    (lambda d: reseal(d, lambda m: m.pop("codebook_id")), "missing .'codebook_id'"),
    (lambda d: reseal(d, lambda m: m.__setitem__("id", "20200101T000000000000Z-00000000")), "does not name this"),
    (lambda d: reseal(d, lambda m: m.__setitem__("format_version", 99)), "newer sidindex"),
    (lambda d: reseal(d, lambda m: m.__setitem__("format_version", 1)), "rebuild the snapshot"),
    (lambda d: reseal(d, lambda m: m.__setitem__("format_version", 2)), "rebuild the snapshot"),
    (lambda d: reseal(d, lambda m: m.__setitem__("format_version", 3)), "version 3 disagrees with its arrays"),
    (lambda d: reseal(d, lambda m: m.__setitem__("format_version", 5)), "version 5 disagrees with its arrays"),
    (lambda d: reseal(d, lambda m: m.__setitem__("lineage", {})), "lineage comes with the ad_state array"),
    (lambda d: reseal(d, lambda m: m.__setitem__("format_version", True)),
     f"version 'True'; this sidindex reads version {', '.join(map(str, READ_VERSIONS[:-1]))} or {READ_VERSIONS[-1]}$"),
    (lambda d: reseal(d, lambda m: m.__setitem__("format", "something")), "not a sidindex snapshot"),
    (lambda d: reseal(d, lambda m: m["shards"][0]["arrays"]["leaf_ads"].__setitem__("rows", 10**15)), "expected rows"),
    (lambda d: reseal(d, lambda m: m["shards"][0]["arrays"]["csr_tokens"].__setitem__("rows", 7)), "does not fit"),
    (lambda d: reseal(d, lambda m: m["arrays"]["ads"].__setitem__("rows", 7)), "does not fit"),
    (lambda d: reseal(d, lambda m: m.__setitem__("level_sizes", m["level_sizes"][:1] + [m["level_sizes"][1] + 1]
                                                 + m["level_sizes"][2:])), "disagree with the carried codebook"),
    (lambda d: reseal(d, lambda m: m.__setitem__("level_sizes", [m["level_sizes"][0] + 1] + m["level_sizes"][1:])),
     "shards cover the first-level tokens up to"),
    (lambda d: reseal(d, lambda m: m["counts"].__setitem__("ads", 5)), "counts"),
    (lambda d: reseal(d, lambda m: m.__setitem__("kway", 1)), "'kway' must be bool"),
    (lambda d: reseal(d, lambda m: m.__setitem__("codebook_id", 7)), "'codebook_id' must be string | null"),
    (lambda d: reseal(d, lambda m: m.__setitem__("stats", [])), "'stats' must be object"),
    (_dup_key, "appears twice"),
    (_nested, "nested too deeply"),
    (lambda d: (d / "manifest.json").write_bytes(b"\xff\xfe{}"), "not valid snapshot manifest JSON"),
    (lambda d: (d / "manifest.json").write_bytes((d / "manifest.json").read_bytes().replace(b"\n", b"\r\n", 1)),
     "corrupt"),
    (lambda d: (d / "extra.arrow").write_bytes(b"x"), "extra.arrow: not listed"),
    (lambda d: (d / "codebooks" / "stray.npy").write_bytes(b"x"), "stray.npy: not listed"),
    (lambda d: (d / "/".join("n" * 8)).mkdir(parents=True), "nested deeper"),
])
def test_manifest_is_sealed_and_strict(snap_dir, corrupt, message):
    corrupt(snap_dir)
    with pytest.raises(ArtifactError, match=message):
        open_snapshot(snap_dir, verify=False)


def _fifo(path: Path) -> None:
    path.unlink()
    os.mkfifo(path)


def _link(path: Path, target: Path) -> None:
    path.unlink()
    path.symlink_to(target)


@pytest.mark.parametrize("corrupt, message", [
    (lambda d, out: _fifo(d / "manifest.json"), "FIFO"),
    (lambda d, out: _fifo(d / shard_dir(0) / "leaf_ads.arrow"), "leaf_ads.arrow"),
    (lambda d, out: _fifo(d / "ads.arrow"), "ads.arrow"),
    (lambda d, out: _link(d / "manifest.json", Path("/dev/zero")), "symbolic link"),
    (lambda d, out: (shutil.copy(d / shard_dir(0) / "leaf_ads.arrow", out), _link(d / shard_dir(0) / "leaf_ads.arrow",
                                                                                  out)), "symbolic link"),
    (lambda d, out: _fifo(d.parents[1] / "CURRENT"), "FIFO"),
    (lambda d, out: _link(d.parents[1] / "CURRENT", Path("/dev/zero")), "symbolic link"),
    (lambda d, out: (d.parents[1] / "CURRENT").write_bytes(b"\xff\xfe\n"), "does not name a snapshot"),
    (lambda d, out: (d.parents[1] / "CURRENT").write_bytes(b"9" * 10**7), "more than"),
])
def test_crafted_files_are_refused_at_once_by_every_reader(built, tmp_path, corrupt, message):
    """FIFOs, links out of the snapshot, /dev/zero, bad UTF-8: refused within a second, never waited on."""
    base, report = built
    root = Path(shutil.copytree(base / "root", tmp_path / "root"))
    corrupt(root / "snapshots" / report["snapshot_id"], tmp_path / "outside.arrow")
    t0 = time.perf_counter()
    with pytest.raises(ArtifactError, match=message):
        open_snapshot(root)
    assert time.perf_counter() - t0 < 1.0
    for cmd in ("validate", "inspect"):
        r = cli(cmd, root, timeout=20)
        assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
        assert len(r.stderr.strip().splitlines()) == 1 and message.split()[0] in r.stderr, r.stderr


def test_old_bin_snapshot_is_refused_with_a_rebuild_message(snap_dir):
    (snap_dir / "manifest.json").write_text(json.dumps({"format": "sidindex.snapshot", "format_version": 1,
                                                         "files": {"leaf_ads.bin": {}}}, indent=1, sort_keys=True))
    with pytest.raises(ArtifactError, match="rebuild the snapshot"):
        open_snapshot(snap_dir)


@pytest.mark.parametrize("name, change", [
    ("node_offsets", lambda a: a.__setitem__(3, a[-1] + 10)),
    ("node_offsets", lambda a: a.__setitem__(-1, a[-1] - 1)),
    ("node_offsets", lambda a: a.__setitem__(slice(5, 7), (2**63 - 1, -2))),  # np.diff wraps to a positive step
    ("leaf_ad_offsets", lambda a: a.__setitem__(2, a[1])),
    ("leaf_ad_offsets", lambda a: a.__setitem__(slice(3, 5), (2**63 - 1, -2))),
    ("leaf_ads", lambda a: a.__setitem__(0, 10**9)),
    ("bitmask_index", lambda a: a.__setitem__(5, -1)),
    ("bloom_index", lambda a: a.__setitem__(-1, 2**31 - 1)),
    ("csr_tokens", lambda a: a.__setitem__(0, 5000)),
    ("csr_child_nodes", lambda a: a.__setitem__(1, 0)),
    ("depth_offsets", lambda a: a.__setitem__(2, a[3] + 1)),
    ("part_offsets", lambda a: a.__setitem__(4, a[3])),
    ("part_offsets", lambda a: a.__setitem__(slice(4, 6), (2**63 - 1, -2))),
    ("part_bloom_index", lambda a: a.__setitem__(0, 10**6)),
    ("exact_bloom_hash_offsets", lambda a: a.__setitem__(7, 10**9)),
    ("exact_bloom_hash_offsets", lambda a: a.__setitem__(slice(7, 9), (2**63 - 1, -2))),
    ("exact_bloom_hashes", lambda a: a.__setitem__(slice(None), np.sort(a)[::-1])),
    ("ads", lambda a: a.__setitem__(slice(None), 0)),
])
def test_out_of_range_structure_is_refused_even_with_valid_checksums(snap_dir, name, change):
    snap = open_snapshot(snap_dir)
    a = np.array(snap.arrays()[name])
    change(a)
    del snap
    rewrite_array(snap_dir, name, a)
    with pytest.raises(ArtifactError, match=f"{name}.arrow"):
        open_snapshot(snap_dir, verify=True)


def test_arrow_files_are_read_by_pyarrow_polars_and_duckdb(snap_dir):
    """Every array file is plain Arrow IPC: tools that know nothing of sidindex read the same values."""
    import duckdb
    import polars as pl
    import pyarrow as pa

    snap = open_snapshot(snap_dir)
    arrays = snap.arrays()
    for spec in SNAPSHOT_ARRAYS:
        if spec.group == "updated":  # an update's (`test_update` reads them)
            continue
        want = arrays[spec.name]
        arrow_table = pa.ipc.open_file(pa.memory_map(str(array_file(snap_dir, spec.name)))).read_all()
        col = arrow_table.column(spec.column_name)
        got = np.asarray(col.to_pylist(), dtype=spec.dtype)
        np.testing.assert_array_equal(got, want, err_msg=spec.file)
        frame = pl.read_ipc(array_file(snap_dir, spec.name))
        assert frame.columns == [spec.column_name] and frame.height == len(want)
        np.testing.assert_array_equal(np.asarray(frame[spec.column_name].to_list(), dtype=spec.dtype), want)
        (count,), = duckdb.sql(f'select count("{spec.column_name}") from arrow_table').fetchall()
        assert count == len(want), spec.file


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_fuzzed_reader_without_checksums_never_crashes_or_lets_bad_offsets_through(snap_dir, data):
    files = sorted(snap_dir.glob("*.arrow"))
    saved = {p: p.read_bytes() for p in files}
    try:
        for _ in range(data.draw(st.integers(1, 4))):
            path = data.draw(st.sampled_from(files))
            raw = bytearray(path.read_bytes())
            pos = data.draw(st.integers(0, len(raw) - 1))
            raw[pos] = data.draw(st.integers(0, 255))
            path.write_bytes(bytes(raw))
        try:
            snap = open_snapshot(snap_dir, verify=False)
        except ArtifactError:
            return
        g = snap.gtm  # it opened: every index a kernel follows must be in range
        E = len(g.csr_tokens)
        assert g.node_offsets.min() >= 0 and g.node_offsets.max() <= E
        assert np.all(g.node_offsets[1:] >= g.node_offsets[:-1])
        for p in g.planes:
            assert p.index.max() < len(p.table) and p.index.min() >= 0
            assert p.part_index.max() < len(p.table) and p.part_index.min() >= 0
        assert np.all(g.leaf_ad_offsets[1:] > g.leaf_ad_offsets[:-1]) and g.leaf_ad_offsets[-1] == len(g.leaf_ads)
        assert g.leaf_ads.min() >= 0 and g.leaf_ads.max() < len(snap.ad_id)
        assert g.part_offsets[-1] == len(g.planes[0].part_index) == len(g.planes[1].part_index)
        assert g.csr_tokens.min() >= 0 and g.csr_tokens.max() < max(g.level_sizes)
    finally:
        for p, b in saved.items():
            p.write_bytes(b)


def _published_is_valid(root: Path) -> str:
    return open_snapshot(root, verify=True).id


def test_sigkill_during_build_leaves_a_valid_published_snapshot(built, sample_dir, tmp_path):
    base, report = built
    root = Path(shutil.copytree(base / "root", tmp_path / "root"))
    args = [shutil.which("sidindex"),
            *map(str, build_args(sample_dir, root, base / "build.toml", "--force", "--keep", "2"))]
    t0 = time.perf_counter()
    subprocess.run(args, capture_output=True, check=True, timeout=300)
    full = time.perf_counter() - t0
    seen = set()
    for delay in np.linspace(0.3, 1.0, 6) * full:  # from interpreter start-up to the last rename
        p = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        time.sleep(delay)
        p.send_signal(signal.SIGKILL)
        p.wait()
        seen.add(_published_is_valid(root))
    r = cli(*build_args(sample_dir, root, base / "build.toml", "--force", "--keep", "2"))  # a later build cleans up
    assert r.returncode == 0, r.stderr
    assert _published_is_valid(root) == json.loads(r.stdout)["snapshot_id"]
    assert not list((root / "snapshots").glob(".tmp-*"))


def test_concurrent_builds_serialise(built, sample_dir, tmp_path):
    base, _ = built
    root = Path(shutil.copytree(base / "root", tmp_path / "root"))
    args = [shutil.which("sidindex"),
            *map(str, build_args(sample_dir, root, base / "build.toml", "--force", "--keep", "5"))]
    procs = [subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for _ in range(2)]
    outs = [p.communicate(timeout=300) for p in procs]
    assert all(p.returncode == 0 for p in procs), [o[1] for o in outs]
    ids = {json.loads(o[0])["snapshot_id"] for o in outs}
    assert len(ids) == 2 and _published_is_valid(root) in ids
    for i in ids:
        open_snapshot(root / "snapshots" / i)


@pytest.mark.parametrize("corrupt, message", [
    (lambda df: df.drop("country"), "country"),
    (lambda df: df.with_columns(df["ad_id"].set(df["ad_id"].is_first_distinct().not_(), 0)), "ad_id"),
])
def test_bad_catalog_through_cli_leaves_published_snapshot_untouched(built, sample_dir, tmp_path, corrupt, message):
    import polars as pl

    base, report = built
    root = Path(shutil.copytree(base / "root", tmp_path / "root"))
    before = {p.relative_to(root): p.read_bytes() for p in root.rglob("*") if p.is_file() and p.name != ".lock"}
    df = pl.read_parquet(sample_dir / "catalog.parquet")
    if message == "ad_id":
        df = df.with_columns(pl.Series("ad_id", np.r_[df["ad_id"][1], df["ad_id"][1:].to_numpy()]))
    else:
        df = corrupt(df)
    df.write_parquet(tmp_path / "bad.parquet")
    r = cli("build", "--catalog", tmp_path / "bad.parquet", "--targeting", sample_dir / "targeting.toml",
            "--out", root, "--config", base / "build.toml", "--force")
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1 and message in r.stderr, r.stderr
    after = {p.relative_to(root): p.read_bytes() for p in root.rglob("*") if p.is_file() and p.name != ".lock"}
    assert after == before


def test_validate_and_inspect_cli(built, snap_dir, tmp_path, monkeypatch, capsys):
    """validate through the console script; inspect through its entry point in this process
    (`run_main`: the same report)."""
    base, report = built
    r = cli("validate", base / "root", "--json")
    assert r.returncode == 0 and json.loads(r.stdout)["snapshot_id"] == report["snapshot_id"]
    r = run_main(monkeypatch, capsys, "inspect", base / "root", "--json")
    info = json.loads(r.stdout)
    assert r.returncode == 0 and info["kway"] and len(info["positions"]) == 4
    assert sum(p["entries"] for p in info["positions"]) == info["nodes"] - 1
    (shard,) = info["shards"]  # a small catalog is one shard of every first-level token
    assert shard["tokens"] == [0, 16] and shard["sid_rows"] == info["sid_rows"] and shard["nodes"] == info["nodes"]
    assert shard["bytes"] == sum(f.stat().st_size for f in (Path(report["path"]) / shard_dir(0)).iterdir())
    r = run_main(monkeypatch, capsys, "inspect", base / "root", "--plot", tmp_path / "fill.png")
    assert r.returncode == 0, r.stderr
    assert (tmp_path / "fill.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    leaf_ads = array_file(snap_dir, "leaf_ads")
    leaf_ads.write_bytes(leaf_ads.read_bytes()[:-3])
    r = cli("validate", snap_dir)
    assert r.returncode == 2 and "leaf_ads.arrow" in r.stderr and len(r.stderr.strip().splitlines()) == 1
    assert os.path.exists(snap_dir / "manifest.json")


def resident_kb(path: Path) -> int:
    """KB of `path`'s pages mapped into this process (Rss of its mappings in /proc/self/smaps)."""
    total, inside = 0, False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()
        if head and "-" in head[0] and len(head) >= 5:  # a mapping's first line
            inside = line.endswith(str(path))
        elif inside and line.startswith("Rss:"):
            total += int(head[1])
    return total


@pytest.mark.skipif(not Path("/proc/self/smaps").exists(), reason="needs Linux /proc")
def test_prefault_maps_every_page_and_reports_phases(built):
    base, report = built
    path = Path(report["path"])
    table = array_file(path, "bloom_table").resolve()
    lazy = open_snapshot(path, verify=False)
    assert set(lazy.open_seconds) == {"manifest", "files", "map", "structure"}
    # validation reads the index arrays, never the tables: of a table only the Arrow schema and footer
    # (the first and last page, with the kernel's fault-around of up to 16 pages each) are mapped
    assert resident_kb(table) <= 2 * 64
    eager = open_snapshot(path, verify=True, prefault=True)
    assert set(eager.open_seconds) == {"manifest", "files", "map", "checksums + structure", "prefault"}
    assert resident_kb(table) * 1024 >= table.stat().st_size - 4096
    np.testing.assert_array_equal(eager.gtm.planes[1].table, lazy.gtm.planes[1].table)


def test_a_compressed_array_file_is_refused(snap_dir):
    """A compressed file would decode onto the heap (its size unbounded by the file's) instead of
    being mapped: refused, even with every checksum right."""
    import pyarrow as pa

    spec = ARRAYS_BY_NAME["exact_bloom_hashes"]
    values = open_snapshot(snap_dir).arrays()[spec.name].copy()
    (snap_dir / spec.file).unlink()
    table = pa.table({spec.column_name: pa.array(values)})
    with pa.OSFile(str(snap_dir / spec.file), "wb") as sink, \
            pa.ipc.new_file(sink, table.schema, options=pa.ipc.IpcWriteOptions(compression="zstd")) as writer:
        writer.write_table(table)
    reseal(snap_dir)
    with pytest.raises(ArtifactError, match="exact_bloom_hashes.arrow: its values are not stored plainly"):
        open_snapshot(snap_dir)


def test_a_catalog_behind_a_symbolic_link_builds(sample_dir, tmp_path):
    """Links are refused inside artifacts, not in a user's inputs (a link to the latest export)."""
    (tmp_path / "build.toml").write_text(CONFIG)
    (tmp_path / "latest.parquet").symlink_to(sample_dir / "catalog.parquet")
    r = cli("build", "--catalog", tmp_path / "latest.parquet", "--targeting", sample_dir / "targeting.toml",
            "--out", tmp_path / "root", "--config", tmp_path / "build.toml", "--json")
    assert r.returncode == 0, r.stderr
    assert open_snapshot(tmp_path / "root").id == json.loads(r.stdout)["snapshot_id"]


def test_an_empty_array_is_written_and_mapped(tmp_path):
    """A spec without bloom attributes, or ads all unrestricted on them, has empty exact hashes:
    the file still holds its one record batch."""
    from sidindex.snapshot.arrays import map_array, write_array

    spec = ARRAYS_BY_NAME["exact_bloom_hashes"]
    write_array(tmp_path, spec, np.zeros(0, dtype=np.uint64))
    assert map_array(tmp_path, spec, (0,)).shape == (0,)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(name=st.sampled_from(sorted(ARRAYS_BY_NAME)), rows=st.integers(0, 3000), width=st.integers(1, 3),
       cuts=st.lists(st.integers(0, 3000), max_size=6), seed=st.integers(0, 2**16))
def test_an_array_written_in_pieces_is_the_array_written_whole(tmp_path, name, rows, width, cuts, seed):
    """What a Ray task streams from its fragments is byte for byte what the local engine writes."""
    spec = ARRAYS_BY_NAME[name]
    shape = (rows,) if spec.width is None else (rows, width)
    rng = np.random.default_rng(seed)
    a = rng.integers(0, 256, size=int(np.prod(shape)) * np.dtype(spec.dtype).itemsize, dtype=np.uint8)
    a = a.view(spec.dtype).reshape(shape)
    whole, pieces = tmp_path / f"whole{seed}", tmp_path / f"pieces{seed}"
    whole.mkdir(exist_ok=True)
    pieces.mkdir(exist_ok=True)
    write_array(whole, spec, a)
    bounds = [0, *sorted(c for c in cuts if c <= rows), rows]
    write_array_pieces(pieces, spec, shape, (a[lo:hi] for lo, hi in zip(bounds[:-1], bounds[1:])))
    assert (pieces / spec.file).read_bytes() == (whole / spec.file).read_bytes()
    with pytest.raises(ValueError, match="pieces"):  # pieces that do not fill the array are refused
        write_array_pieces(pieces, spec, shape, [a[:-1], a[:0]] if rows else [np.zeros(width, dtype=spec.dtype)])
