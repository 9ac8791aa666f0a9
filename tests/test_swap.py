"""A fast snapshot swap: the fast digest (xxh3_128 by chunks) checked at every open and sealed in
the manifest, sha256 kept for `sidindex validate`, snapshots written before fast digests still
opened (on sha256), staging in parallel chunks, and one snapshot loaded onto several devices at
once (read, verified and staged once; a watcher swapping all of them together)."""

from __future__ import annotations

import json
import re
import shutil
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch
import xxhash

import runtime
import runtime.index.loader
import runtime.index.staging as staging
import sidindex.artifact as artifact
import sidindex.snapshot.snapshot as snapshot_module
from schemas.artifacts import (
    DIGEST_VERSION,
    FAST_DIGEST,
    FAST_DIGEST_CHUNK,
    SNAPSHOT_VERSION,
    shard_dir,
    snapshot_version,
)
from sidindex.artifact import fast_digest, same_file, seal
from sidindex.errors import ArtifactError, ConfigError
from sidindex.root import Root
from sidindex.snapshot import open_snapshot, write_snapshot
from sidindex.snapshot.arrays import same_memory
from sidindex.timing import StageClock
from tests.conftest import run_cli
from tests.test_retrieve import CONFIG, build_root, cli
from tests.test_snapshot import reseal, rewrite_array


@pytest.fixture(scope="module")
def root(sample_dir, tmp_path_factory) -> Path:
    return build_root(sample_dir, tmp_path_factory.mktemp("swap"), CONFIG)


@pytest.fixture
def snap_dir(root, tmp_path) -> Path:
    """A private copy of the published snapshot directory, to corrupt."""
    published = open_snapshot(root, verify=False).path
    return Path(shutil.copytree(published, tmp_path / published.name))


def _manifest(d: Path) -> dict:
    return json.loads((d / "manifest.json").read_text())


def _no_sha256(monkeypatch) -> None:
    """Make any sha256 of a file fail the test: what opening must not compute."""
    def refuse(*a, **kw):
        raise AssertionError("sha256 computed on the serving path")
    monkeypatch.setattr(artifact, "sha256_file", refuse)


def _reference_digest(data: bytes, chunk: int) -> str:
    """FAST_DIGEST as schemas/CONTRACTS.md defines it, for a reader in another language."""
    parts = b"".join(xxhash.xxh3_128(data[i:i + chunk]).digest() for i in range(0, len(data), chunk))
    return xxhash.xxh3_128(parts).hexdigest()


@pytest.mark.parametrize("size", [0, 1, FAST_DIGEST_CHUNK - 1, FAST_DIGEST_CHUNK, FAST_DIGEST_CHUNK + 1,
                                  2 * FAST_DIGEST_CHUNK + 12345])
def test_fast_digest_is_the_documented_chunked_xxh3(tmp_path, size):
    data = np.random.default_rng(size).integers(0, 256, size, dtype=np.uint8).tobytes()
    (tmp_path / "f").write_bytes(data)
    assert fast_digest(tmp_path / "f") == _reference_digest(data, FAST_DIGEST_CHUNK)


def test_digests_map_a_bounded_window_of_files_at_a_time(tmp_path, monkeypatch):
    """Files digested together stay mapped under about MAPPED_BYTES (a snapshot's files all mapped
    at once added their size to the process's peak): a next file is mapped only once the oldest
    ones closed to under the bound; each digest still the documented one, empty files included."""
    sizes = [0, 5000, FAST_DIGEST_CHUNK + 7, 3, 0, 2 * FAST_DIGEST_CHUNK, 1]
    rng = np.random.default_rng(4)
    data = [rng.integers(0, 256, n, dtype=np.uint8).tobytes() for n in sizes]
    paths = []
    for i, d in enumerate(data):
        (path := tmp_path / f"f{i}").write_bytes(d)
        paths.append(path)
    open_maps, most = set(), [0]
    real_map = artifact._map_file

    def tracked(path):
        mm = real_map(path)
        if mm is not None:
            open_maps.add(mm)
            most[0] = max(most[0], sum(len(m) for m in open_maps if not m.closed))
        return mm

    monkeypatch.setattr(artifact, "_map_file", tracked)
    monkeypatch.setattr(artifact, "MAPPED_BYTES", FAST_DIGEST_CHUNK)
    with artifact._pool() as pool:
        got = artifact._fast_digests(pool, paths)
    assert got == [_reference_digest(d, FAST_DIGEST_CHUNK) for d in data]
    assert all(m.closed for m in open_maps)
    assert most[0] <= FAST_DIGEST_CHUNK + max(sizes)  # under the bound, then one file more


def test_a_new_snapshot_lists_every_file_with_its_fast_digest(snap_dir):
    m = _manifest(snap_dir)
    assert m["format_version"] == SNAPSHOT_VERSION == open_snapshot(snap_dir).manifest.version
    for name, entry in m["files"].items():
        assert set(entry) == {"bytes", "sha256", FAST_DIGEST}
        assert entry[FAST_DIGEST] == _reference_digest((snap_dir / name).read_bytes(), FAST_DIGEST_CHUNK), name


def test_a_flipped_byte_anywhere_is_refused_by_the_fast_digest_alone(snap_dir, monkeypatch):
    """Each chunk of a file counts: with small chunks, a flip in the first, a middle and the last one."""
    monkeypatch.setattr(artifact, "FAST_DIGEST_CHUNK", 4096)
    reseal(snap_dir)  # the digests of 4 KiB chunks
    _no_sha256(monkeypatch)
    open_snapshot(snap_dir)
    for path in sorted(p for p in snap_dir.rglob("*") if p.is_file() and p.name != "manifest.json"):
        data = path.read_bytes()
        for pos in sorted({0, len(data) // 2, len(data) - 1}):
            path.write_bytes(data[:pos] + bytes([data[pos] ^ 0x80]) + data[pos + 1:])
            with pytest.raises(ArtifactError, match=rf"{re.escape(path.name)}: checksum mismatch \({FAST_DIGEST}\)"):
                open_snapshot(snap_dir)
        path.write_bytes(data)
    open_snapshot(snap_dir)


def test_a_tampered_fast_digest_is_refused(snap_dir):
    """The manifest is sealed: a fast digest edited in place breaks the seal; one resealed (a buggy
    writer) no longer matches its file."""
    raw = (snap_dir / "manifest.json").read_text()
    digest = _manifest(snap_dir)["files"][shard_dir(0) + "/leaf_ads.arrow"][FAST_DIGEST]
    (snap_dir / "manifest.json").write_text(raw.replace(digest, "0" * 32))
    with pytest.raises(ArtifactError, match="manifest is corrupt"):
        open_snapshot(snap_dir, verify=False)
    (snap_dir / "manifest.json").write_text(raw)
    m = _manifest(snap_dir)
    m["files"][shard_dir(0) + "/leaf_ads.arrow"][FAST_DIGEST] = "0" * 32
    (snap_dir / "manifest.json").write_bytes(seal(m))
    with pytest.raises(ArtifactError, match=rf"leaf_ads.arrow: checksum mismatch \({FAST_DIGEST}\)"):
        open_snapshot(snap_dir)


@pytest.mark.parametrize("entry, message", [
    ({"bytes": 1, "sha256": "0" * 64}, "must be {bytes, sha256, xxh3_128}"),
    ({"bytes": 1, "sha256": "0" * 64, FAST_DIGEST: "0" * 31}, "digests in hex"),
    ({"bytes": 1, "sha256": "0" * 64, FAST_DIGEST: "Z" * 32}, "digests in hex"),
])
def test_a_malformed_file_entry_is_refused(snap_dir, entry, message):
    m = _manifest(snap_dir)
    m["files"][shard_dir(0) + "/leaf_ads.arrow"] = entry
    (snap_dir / "manifest.json").write_bytes(seal(m))
    with pytest.raises(ArtifactError, match=re.escape(message)):
        open_snapshot(snap_dir, verify=False)


def test_sha256_is_checked_by_validate_off_the_serving_path(snap_dir):
    """A wrong sha256 beside a right fast digest: opening (the serving path) does not read it,
    `sidindex validate` refuses it in one line naming the file."""
    m = _manifest(snap_dir)
    m["files"][shard_dir(0) + "/leaf_ads.arrow"]["sha256"] = "0" * 64
    (snap_dir / "manifest.json").write_bytes(seal(m))
    open_snapshot(snap_dir)
    with pytest.raises(ArtifactError, match=r"leaf_ads.arrow: checksum mismatch \(sha256\)"):
        open_snapshot(snap_dir, strong=True)
    r = run_cli("validate", snap_dir, timeout=120)
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    assert len(r.stderr.strip().splitlines()) == 1 and "leaf_ads.arrow" in r.stderr, r.stderr


def as_unsharded(d: Path, version: int = DIGEST_VERSION) -> dict:
    """Rewrite the one-shard snapshot `d` as a sidindex before shards wrote it (`version`, 6 or 7):
    the shard's files at the top, one array list; its manifest JSON, sealed."""
    m = _manifest(d)
    m.pop("journal")
    (shard,) = m.pop("shards")
    for f in (d / shard_dir(0)).iterdir():
        f.rename(d / f.name)
    (d / shard_dir(0)).rmdir()
    (d / shard_dir(0)).parent.rmdir()
    m["arrays"] |= shard["arrays"]
    m["files"] = {n.removeprefix(shard_dir(0) + "/"): e for n, e in m["files"].items()}
    m["format_version"] = version
    (d / "manifest.json").write_bytes(seal(m))
    return m


def _as_older_format(d: Path) -> int:
    """Rewrite the snapshot as a sidindex before fast digests wrote it; its version."""
    m = as_unsharded(d)
    m["format_version"] = snapshot_version(m["arrays"])
    for entry in m["files"].values():
        del entry[FAST_DIGEST]
    (d / "manifest.json").write_bytes(seal(m))
    return m["format_version"]


def test_a_snapshot_written_before_fast_digests_opens_and_verifies_on_sha256(snap_dir):
    version = _as_older_format(snap_dir)
    assert version < DIGEST_VERSION
    snap = open_snapshot(snap_dir)
    assert snap.manifest.version == version and all(f.fast is None for f in snap.manifest.files.values())
    served = runtime.load(snap_dir, "cpu")
    assert served.id == snap.id
    path = snap_dir / "leaf_ads.arrow"
    data = path.read_bytes()
    path.write_bytes(data[:-1] + bytes([data[-1] ^ 1]))
    with pytest.raises(ArtifactError, match=r"leaf_ads.arrow: checksum mismatch \(sha256\)"):
        open_snapshot(snap_dir)


def test_a_snapshot_written_before_shards_opens_as_one_shard(snap_dir):
    """Version 6 (and 7) held every array at the top: read as one shard of every first-level token,
    the same index as the sharded layout of the same arrays."""
    sharded = open_snapshot(snap_dir)
    want = {n: np.array(a) for n, a in sharded.arrays().items()}
    del sharded
    as_unsharded(snap_dir)
    snap = open_snapshot(snap_dir, verify=True, cover=True)
    assert snap.manifest.version == DIGEST_VERSION and len(snap.shards) == 1
    assert (snap.shards[0].lo, snap.shards[0].hi) == (0, snap.manifest.level_sizes[0])
    assert all(np.array_equal(a, want[n]) for n, a in snap.arrays().items())


def test_a_snapshot_written_over_an_older_one_carries_fast_digests_for_the_files_it_links(snap_dir, tmp_path):
    """An update of a snapshot of the previous format links its unchanged files: their entries there
    have no fast digest, so the new manifest gets them hashed."""
    _as_older_format(snap_dir)
    old = open_snapshot(snap_dir)
    new_id = "20300101T000000000000Z-0000abcd"
    (tmp_path / "new" / new_id).mkdir(parents=True)
    m = write_snapshot(tmp_path / "new" / new_id, old.shards, old.exact, old.ad_id, old.spec, snapshot_id=new_id,
                       codebook=old.codebook, stats=old.manifest.stats, base=old)
    # every file linked, the shard's from the top of the old layout
    assert all(same_file(tmp_path / "new" / new_id / n, snap_dir / n.removeprefix(shard_dir(0) + "/"))
               for n in m.files)
    assert m.version == SNAPSHOT_VERSION and all(f.fast is not None for f in m.files.values())
    assert open_snapshot(tmp_path / "new" / new_id).manifest.files == m.files


def test_an_older_version_with_fast_digests_and_a_newer_version_are_refused(snap_dir):
    m = as_unsharded(snap_dir)
    m["format_version"] = snapshot_version(m["arrays"])  # the old version, but this format's file entries
    (snap_dir / "manifest.json").write_bytes(seal(m))
    with pytest.raises(ArtifactError, match="must be {bytes, sha256}"):
        open_snapshot(snap_dir, verify=False)
    m["format_version"] = SNAPSHOT_VERSION + 1
    (snap_dir / "manifest.json").write_bytes(seal(m))
    with pytest.raises(ArtifactError, match=f"version {SNAPSHOT_VERSION + 1}; .* upgrade sidindex"):
        open_snapshot(snap_dir, verify=False)


def test_staging_copies_every_array_in_chunks(root, monkeypatch):
    """Chunks smaller than most arrays (and arrays of 0 or 1 element): the same bytes, uint64 as int64."""
    monkeypatch.setattr(staging, "STAGE_CHUNK", 1000)
    monkeypatch.setattr(staging, "STAGE_THREADS", 3)
    arrays = open_snapshot(root).arrays() | {"empty": np.zeros(0, np.int64), "one": np.ones(1, np.int16)}
    clock = StageClock()
    staged = staging.stage_arrays(arrays, clock, pinned=False)
    assert set(clock.seconds) == {"stage"}
    for name, a in arrays.items():
        want = a.view(np.int64) if a.dtype == np.uint64 else a
        assert staged[name].numpy().dtype == want.dtype and np.array_equal(staged[name].numpy(), want), name


def test_copies_made_while_checking_get_every_array_and_are_waited_for(snap_dir, monkeypatch):
    """`open_snapshot(while_checking=)`: the copy gets the very arrays the snapshot serves, runs on
    another thread while they are checked, and is waited for; a corrupt snapshot's error wins."""
    checking = threading.Event()
    checks = snapshot_module.check_structure

    def check_structure(*args, **kw):
        checking.set()
        return checks(*args, **kw)

    monkeypatch.setattr(snapshot_module, "check_structure", check_structure)
    seen: dict[str, np.ndarray] = {}

    def copy(arrays: dict[str, np.ndarray]) -> None:
        assert threading.current_thread() is not threading.main_thread()
        assert checking.wait(10)  # the checks started while it runs: beside them, not before
        time.sleep(0.1)  # and it outlasts them: the open must wait for it
        seen.clear()
        seen.update(arrays)

    snap = open_snapshot(snap_dir, while_checking=copy)
    assert seen.keys() == snap.arrays().keys() and all(same_memory(a, snap.arrays()[n]) for n, a in seen.items())
    assert snap.open_seconds["copies"] > 0.05  # the wait is a phase of the open

    def failing(arrays: dict[str, np.ndarray]) -> None:
        time.sleep(0.1)
        seen.clear()
        raise RuntimeError("the copy failed")

    checking.clear()
    with pytest.raises(RuntimeError, match="the copy failed"):  # the snapshot passed: the copy's error
        open_snapshot(snap_dir, while_checking=failing)
    leaf_ads = snap.gtm.leaf_ads.copy()
    leaf_ads[-1] = len(snap.ad_id)  # one row past the catalog, resealed: the structure refuses it
    rewrite_array(snap_dir, "leaf_ads", leaf_ads)
    for fn in (copy, failing):
        checking.clear()
        seen["sentinel"] = np.zeros(1)
        with pytest.raises(ArtifactError, match=r"leaf_ads\.arrow: an ad row lies outside"):
            open_snapshot(snap_dir, while_checking=fn)
        assert "sentinel" not in seen  # it ran to its end before the open raised
    path = next(snap_dir.glob("**/leaf_ads.arrow"))
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 1  # an ad row, not resealed: the digest refuses it, after the copy
    path.write_bytes(bytes(data))
    checking.set()  # the digests fail before the checks
    seen["sentinel"] = np.zeros(1)
    with pytest.raises(ArtifactError, match="checksum mismatch"):
        open_snapshot(snap_dir, while_checking=copy)
    assert "sentinel" not in seen


@pytest.mark.skipif(not torch.cuda.is_available(), reason="copies to a GPU")
def test_a_gpu_load_copies_while_checking_and_gives_the_arrays_of_a_load_after_it(root, monkeypatch):
    staged: list[set[str]] = []
    stage = runtime.index.loader.stage_arrays

    def recorded(arrays, *args, **kw):
        staged.append(set(arrays))
        return stage(arrays, *args, **kw)

    monkeypatch.setattr(runtime.index.loader, "stage_arrays", recorded)
    overlapped = runtime.load(root, "cuda")
    assert staged[0] == set(overlapped.snapshot.arrays()) - {"depth_offsets"}  # every array but the host's own
    assert staged[1:] == [set()]  # nothing left to stage once the snapshot passed
    info = overlapped.load_info["while_checking"]
    assert info["bytes"] == sum(int(a.nbytes) for n, a in overlapped.snapshot.arrays().items() if n in staged[0])
    staged.clear()
    after = runtime.load_index(open_snapshot(root), "cuda")
    assert "while_checking" not in after.load_info and len(staged) == 1
    _same(overlapped, after)
    assert overlapped.post.keys() == after.post.keys()
    assert all(torch.equal(overlapped.post[n], after.post[n]) for n in after.post)


def _same(a: runtime.ServedIndex, b: runtime.ServedIndex) -> None:
    assert a.id == b.id and a.device == b.device
    for name, t in a.gtm.arrays().items():
        u = b.gtm.arrays()[name]
        if isinstance(t, torch.Tensor):
            assert torch.equal(t, u), name
        else:
            assert np.array_equal(t, u), name
    assert torch.equal(a.entry_keys, b.entry_keys)
    assert (a.max_children, a.mean_children, a.max_parts, a.leaf_start) == \
           (b.max_children, b.mean_children, b.max_parts, b.leaf_start)
    assert all(np.array_equal(x, y) for x, y in zip(a.fan_out_counts, b.fan_out_counts))


def test_the_launch_shapes_are_the_tries_fan_outs(root):
    index = runtime.load(root, "cpu")
    g = index.snapshot.gtm
    fan_out = np.diff(g.node_offsets)
    per_depth = [fan_out[g.depth_offsets[d]:g.depth_offsets[d + 1]] for d in range(g.sid_length)]
    assert index.max_children == tuple(int(f.max()) for f in per_depth)
    assert index.mean_children == tuple(int(np.ceil(f.mean())) for f in per_depth)
    assert index.max_parts == int(np.diff(g.part_offsets).max())
    assert index.leaf_start == g.depth_offsets[g.sid_length]
    for f, counts in zip(per_depth, index.fan_out_counts):
        assert counts.tolist() == np.bincount(f).tolist()
    d = 1  # the K widest nodes' children together, by sorting; K random ones, by the mean
    for k in (1, 2, 5, len(per_depth[d]), len(per_depth[d]) + 3):
        assert index.most_children(d, k) == int(np.sort(per_depth[d])[::-1][:k].sum())
        typical = -(-k * int(per_depth[d].sum()) // len(per_depth[d]))
        assert index.typical_children(d, k) == min(typical, index.most_children(d, k))


def test_several_devices_get_the_arrays_a_single_load_gives(root):
    single = runtime.load(root, "cpu")
    both = runtime.load(root, ["cpu", "cpu"])
    assert isinstance(both, list) and len(both) == 2 and both[0].snapshot is both[1].snapshot  # opened once
    for index in both:
        _same(index, single)
        assert index.load_info["devices"] == 2 and set(index.load_info["phases"]) == {"stage", "transfer"}
    from_open = runtime.load_index(open_snapshot(root), ["cpu"])
    assert isinstance(from_open, list) and len(from_open) == 1
    _same(from_open[0], single)
    with pytest.raises(ConfigError, match="one device at least"):
        runtime.load(root, [])
    with pytest.raises(ConfigError, match="one base"):
        runtime.load(root, ["cpu", "cpu"], base=[single])


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_two_gpus_get_the_arrays_a_single_load_gives(root):
    both = runtime.load(root, ["cuda:0", "cuda:1"])
    for i, index in enumerate(both):
        one = runtime.load(root, f"cuda:{i}")
        _same(index, one)
        assert all(torch.equal(index.post[n], one.post[n]) for n in one.post)


def test_a_watcher_over_several_devices_swaps_them_together(root, sample_dir, tmp_path):
    work = Path(shutil.copytree(root, tmp_path / "root"))
    watcher = runtime.SnapshotWatcher(work, ["cpu", "cpu"])
    old = watcher.indexes
    assert len(old) == 2 and watcher.current is old[0] and old[0].snapshot is old[1].snapshot
    r = cli("build", "--catalog", sample_dir / "catalog.parquet", "--targeting", sample_dir / "targeting.toml",
            "--out", work, "--config", root.parent / "build.toml", "--force", "--keep", "5", "--json")
    assert r.returncode == 0, r.stderr
    new_id = json.loads(r.stdout)["snapshot_id"]
    assert watcher.poll() and [i.id for i in watcher.indexes] == [new_id, new_id]
    assert all(i.id == old[0].id for i in old)  # requests that took the old pair finish on it
    # a corrupt snapshot published next: every device keeps serving the last good one
    r = cli("build", "--catalog", sample_dir / "catalog.parquet", "--targeting", sample_dir / "targeting.toml",
            "--out", work, "--config", root.parent / "build.toml", "--force", "--keep", "5", "--json")
    bad = Root(work).snapshot_dir(json.loads(r.stdout)["snapshot_id"]) / shard_dir(0) / "leaf_ads.arrow"
    data = bad.read_bytes()
    bad.write_bytes(data[:-1] + bytes([data[-1] ^ 1]))
    assert not watcher.poll() and [i.id for i in watcher.indexes] == [new_id, new_id]
    assert "leaf_ads.arrow: checksum mismatch" in watcher.last_error
