"""A serving process's cold start (docs/design.md §7, §17).

- `import runtime` leaves out what only building needs (training, the quality report).
- A snapshot whose checks are on record loads without hashing its files again: the check record
  lists each file verified with its stat then (`sidindex.snapshot.records`). A file edited in place
  (its size and mtime kept), or replaced, is hashed again and refused with the usual message; a
  record of another snapshot or of a manifest since rewritten is ignored; `records=False`, `strong`
  and a trust key hash every file.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

import runtime
from schemas.artifacts import MANIFEST_FILE
from sidindex.artifact import seal
from sidindex.errors import ArtifactError
from sidindex.job import run_build
from sidindex.root import Root
from sidindex.snapshot import open_snapshot
from sidindex.snapshot import records as records_module
from sidindex.snapshot import snapshot as snapshot_module

ROOT = Path(__file__).resolve().parents[1]
CONFIG = "[sid]\nlevels = [8, 8]\nhash_size = 16\npaths = 1\nmin_points_per_centroid = 10\n"
# what only building needs: a serving host never imports it
OFFLINE = ("faiss", "sidindex.sid.kmeans", "sidindex.sid.quality", "sidindex.build", "sidindex.job")


def test_import_runtime_leaves_the_offline_packages_out():
    code = f"import runtime, sys; print(sorted(m for m in {OFFLINE!r} if m in sys.modules))"
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "[]"


def test_a_front_end_process_imports_no_torch():
    """`serve --workers N`'s front-ends parse and validate: they start without torch (nor the
    offline packages), which the engine process alone loads."""
    pytest.importorskip("zmq")
    pytest.importorskip("starlette")
    code = ("import runtime.server.frontend, runtime.server.link, sys; "
            f"print(sorted(m for m in ('torch', 'triton', *{OFFLINE!r}) if m in sys.modules))")
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "[]"


@pytest.fixture(scope="module")
def built(sample_dir, tmp_path_factory) -> Path:
    """A ROOT whose build recorded every file it checked (nothing counts as too recent to list)."""
    base = tmp_path_factory.mktemp("cold")
    (base / "build.toml").write_text(CONFIG)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(records_module, "SETTLED_NS", 0)
        run_build(sample_dir / "catalog.parquet", sample_dir / "targeting.toml", base / "root",
                  config=base / "build.toml")
    return base / "root"


@pytest.fixture
def root(built, tmp_path, monkeypatch) -> Path:
    """A copy of `built` (new files: its record lists other inodes), every file listed once verified."""
    monkeypatch.setattr(records_module, "SETTLED_NS", 0)
    copy = Path(shutil.copytree(built, tmp_path / "root"))
    # an edit in the copy's last clock tick could keep a coarse ctime: what SETTLED_NS guards against
    time.sleep(0.02)
    return copy


@pytest.fixture
def hashed(monkeypatch) -> list[set[str]]:
    """The files each open hashes (appended per call of the digest check)."""
    calls: list[set[str]] = []
    verify = snapshot_module.verify_checksums

    def counting(directory, listed, *, trusted=frozenset(), **kw):
        calls.append(set(listed) - set(trusted))
        return verify(directory, listed, trusted=trusted, **kw)

    monkeypatch.setattr(snapshot_module, "verify_checksums", counting)
    return calls


def _hashed_by(calls: list[set[str]], load: Callable[[], object]) -> set[str]:
    """The files `load()` hashed."""
    calls.clear()
    load()
    return set().union(*calls)


def _current(root: Path) -> Path:
    layout = Root(root)
    return layout.snapshot_dir(layout.current_id())


def _files(snap_dir: Path) -> set[str]:
    return set(json.loads((snap_dir / MANIFEST_FILE).read_text())["files"])


def test_a_build_records_its_files_and_a_load_hashes_none(built, hashed):
    snap = open_snapshot(built, verify=False)
    record = json.loads((Root(built).checked / snap.id).read_text())
    assert record["checks"] == ["structure"] and set(record["files"]) == _files(snap.path)
    assert _hashed_by(hashed, lambda: runtime.load(built, "cpu")) == set()
    assert runtime.load(built, "cpu").snapshot.recorded  # and its structure was not checked again


def test_a_load_records_what_it_hashed_and_the_next_hashes_nothing(root, hashed):
    files = _files(_current(root))
    assert _hashed_by(hashed, lambda: runtime.load(root, "cpu")) == files  # the record names other inodes
    assert _hashed_by(hashed, lambda: runtime.load(root, "cpu")) == set()
    assert _hashed_by(hashed, lambda: runtime.load(root, "cpu", verify=False)) == set()
    # asked not to trust records, or for every sha256, or given a trust key: every file
    assert _hashed_by(hashed, lambda: runtime.load(root, "cpu", records=False)) == files
    assert _hashed_by(hashed, lambda: open_snapshot(root, strong=True, records=True)) == files


def test_an_update_hashes_every_file_of_its_base(root, hashed, tmp_path):
    """Its checks on record are not made again, but its bytes go into the new snapshot under fresh
    digests: damage no stat shows would be sealed in, so no record stands in for a digest."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from sidindex.job import run_update

    files = _files(_current(root))
    runtime.load(root, "cpu")  # records every file
    changes = tmp_path / "pause.parquet"
    ad = int(np.asarray(open_snapshot(root, verify=False).arrays()["ads"])[0])
    pq.write_table(pa.table({"ad_id": pa.array([ad], pa.int64()), "op": ["pause"]}), changes)
    assert files <= _hashed_by(hashed, lambda: run_update(root, changes))


def _flip_middle_byte(path: Path) -> None:
    raw = bytearray(path.read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    path.write_bytes(bytes(raw))


@pytest.mark.parametrize("how", ["edited in place", "replaced"])
def test_a_file_changed_since_its_record_is_hashed_and_refused(root, hashed, how):
    runtime.load(root, "cpu")  # records every file
    snap_dir = _current(root)
    path = snap_dir / "ads.arrow"
    before = path.stat()
    if how == "edited in place":  # same inode, same size, its mtime put back: the ctime still moved
        os.chmod(path, 0o644)
        with open(path, "r+b") as f:
            f.seek(before.st_size // 2)
            byte = f.read(1)
            f.seek(before.st_size // 2)
            f.write(bytes([byte[0] ^ 0xFF]))
    else:
        tmp = path.with_name("ads.tmp")
        shutil.copyfile(path, tmp)
        _flip_middle_byte(tmp)
        os.replace(tmp, path)
    os.utime(path, ns=(before.st_atime_ns, before.st_mtime_ns))
    assert path.stat().st_size == before.st_size and path.stat().st_mtime_ns == before.st_mtime_ns
    with pytest.raises(ArtifactError) as e:
        _hashed_by(hashed, lambda: runtime.load(root, "cpu"))
    assert str(e.value) == f"{path}: checksum mismatch (xxh3_128); the file is corrupt"
    assert set().union(*hashed) == {"ads.arrow"}  # the files unchanged since were not hashed


def test_a_file_replaced_by_the_same_bytes_is_hashed_once(root, hashed):
    runtime.load(root, "cpu")
    path = _current(root) / "ads.arrow"
    shutil.copyfile(path, path.with_name("ads.tmp"))
    os.replace(path.with_name("ads.tmp"), path)
    assert _hashed_by(hashed, lambda: runtime.load(root, "cpu")) == {"ads.arrow"}
    assert _hashed_by(hashed, lambda: runtime.load(root, "cpu")) == set()


def _rewrite(path: Path, **edit) -> None:
    doc = json.loads(path.read_text())
    path.write_bytes(seal({k: v for k, v in doc.items() if k != "checksum"} | edit))


@pytest.mark.parametrize("record", ["another snapshot", "another manifest", "a manifest rewritten since"])
def test_a_record_of_another_snapshot_or_manifest_is_ignored(root, hashed, record):
    runtime.load(root, "cpu")
    snap_dir = _current(root)
    path = Root(root).checked / snap_dir.name
    if record == "another snapshot":
        _rewrite(path, snapshot="20000101T000000000000Z-00000000")
    elif record == "another manifest":
        _rewrite(path, manifest_sha256="0" * 64)
    else:  # resealed with another creation time: the files are the same, the manifest is not the one recorded
        os.chmod(snap_dir / MANIFEST_FILE, 0o644)
        _rewrite(snap_dir / MANIFEST_FILE, created="2000-01-01T00:00:00Z")
    loaded = []
    assert _hashed_by(hashed, lambda: loaded.append(runtime.load(root, "cpu"))) == _files(snap_dir)
    assert not loaded[0].snapshot.recorded  # its structure was checked again too
    # that load recorded what it checked, for the manifest it read
    assert _hashed_by(hashed, lambda: loaded.append(runtime.load(root, "cpu"))) == set()
    assert loaded[1].snapshot.recorded


def test_a_trust_key_hashes_every_file(root, hashed, tmp_path):
    pytest.importorskip("cryptography")
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    from sidindex.signing import SigningKey

    pem = tmp_path / "key.pem"
    pem.write_bytes(Ed25519PrivateKey.generate().private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()))
    signer = SigningKey.load(pem)
    snap_dir = _current(root)
    signer.sign(snap_dir)
    runtime.load(root, "cpu")  # records every file
    files = _files(snap_dir)
    # whoever can rewrite ROOT can rewrite its records: only the digests tie the bytes to the signed manifest
    assert _hashed_by(hashed, lambda: runtime.load(root, "cpu", trust_key=signer.trust)) == files
