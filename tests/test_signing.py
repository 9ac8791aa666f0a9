"""Signed snapshots (docs/design.md §7, `sidindex.signing`):

- A ROOT built and updated with a signing key loads, validates and serves with its trust key.
- An edit someone who can write ROOT makes and reseals (every digest, the manifest's checksum) is
  invisible to the digests; with a trust key it is refused by `validate`, `load`, the watcher
  (the old snapshot keeps serving, `last_error` says why) and the server: zeroed exact rows,
  zeroed matcher rows, and the manifest's targeting values swapped (an age-restricted ad shown to
  minors). So are an unsigned snapshot and one signed by another key.
- A job that signs never vouches for what it cannot verify: an update over a resealed base, or an
  unsigned one it was not told to adopt, publishes nothing.
- Without a key, everything is as it was: the resealed edits load.
"""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("cryptography")
from cryptography.hazmat.primitives import serialization  # noqa: E402
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey  # noqa: E402

import runtime  # noqa: E402
from schemas.artifacts import SIGNATURE_FILE  # noqa: E402
from sidindex.errors import ArtifactError, ConfigError  # noqa: E402
from sidindex.job import run_update  # noqa: E402
from sidindex.root import Root, new_snapshot_id  # noqa: E402
from sidindex.sid import save_codebook  # noqa: E402
from sidindex.signing import SigningKey, TrustKey  # noqa: E402
from sidindex.snapshot import open_snapshot  # noqa: E402
from tests.conftest import run_cli, sampled_codebook  # noqa: E402
from tests.test_changes_survive import _published  # noqa: E402
from tests.test_snapshot import array_file, reseal, rewrite_array  # noqa: E402
from tests.test_update import N_BASE, _changes, pool  # noqa: E402, F401 (fixture)


def _keys(directory: Path, name: str) -> tuple[Path, Path]:
    """(private, public) PEM files of a new Ed25519 key."""
    key = Ed25519PrivateKey.generate()
    private = directory / f"{name}.pem"
    public = directory / f"{name}.pub.pem"
    private.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                          serialization.NoEncryption()))
    public.write_bytes(key.public_key().public_bytes(serialization.Encoding.PEM,
                                                     serialization.PublicFormat.SubjectPublicKeyInfo))
    return private, public


@pytest.fixture(scope="module")
def keys(tmp_path_factory) -> dict[str, tuple[Path, Path]]:
    d = tmp_path_factory.mktemp("keys")
    return {"ours": _keys(d, "ours"), "theirs": _keys(d, "theirs")}


@pytest.fixture(scope="module")
def signed(pool, keys, tmp_path_factory) -> Path:
    """A ROOT whose full build and one update (3 ads paused) were signed with our key."""
    base = tmp_path_factory.mktemp("signed")
    pool["catalog"].head(N_BASE).write_parquet(base / "catalog.parquet")
    save_codebook(sampled_codebook(pool["catalog"].head(N_BASE)), base / "root")
    r = run_cli("build", "--catalog", base / "catalog.parquet", "--targeting", pool["targeting"], "--out",
                base / "root", "--config", pool["dir"] / "build.toml", "--sign-key", keys["ours"][0], "--json")
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["signed_by"] == TrustKey.load(keys["ours"][1]).key_id
    ids = pool["catalog"]["ad_id"].head(3).to_list()
    r = run_cli("update", base / "root", "--changes", _changes(pool, base / "0001.parquet",
                                                               [{"ad_id": a, "op": "pause"} for a in ids]),
                "--sign-key", keys["ours"][0], "--json")
    assert r.returncode == 0, r.stderr
    return base / "root"


@pytest.fixture
def root(signed, tmp_path) -> Path:
    return Path(shutil.copytree(signed, tmp_path / "root"))


def _current(root: Path) -> Path:
    return Root(root).snapshot_dir(Root(root).current_id())


def _zero_exact_rows(snap_dir: Path) -> None:
    """The exact bitmask rows of 20 ads zeroed, resealed: those ads are never served again."""
    rows = open_snapshot(snap_dir).exact.planes[0].rows.copy()
    rows[:20] = 0
    rewrite_array(snap_dir, "exact_bitmask_rows", rows)


def _zero_matcher_rows(snap_dir: Path) -> None:
    table = open_snapshot(snap_dir).gtm.planes[0].table.copy()
    table[:] = 0
    rewrite_array(snap_dir, "bitmask_table", table)


def _swap_ages(snap_dir: Path) -> None:
    """The targeting spec's first two age values swapped: an ad for 18-24 year olds matches 13-17."""
    def edit(m: dict) -> None:
        age = next(a for a in m["targeting"]["attribute"] if a["name"] == "age")
        age["values"][:2] = age["values"][1::-1]
    reseal(snap_dir, edit)


TAMPERS = {"exact rows": _zero_exact_rows, "matcher rows": _zero_matcher_rows, "targeting values": _swap_ages}


def _tampered_copy(root: Path, tamper) -> str:
    """The current snapshot copied under a new id with `tamper` applied and resealed (its old
    signature beside it), published as CURRENT: what an intruder who can write ROOT does."""
    new = new_snapshot_id("deadbeef")
    d = Path(shutil.copytree(_current(root), Root(root).snapshot_dir(new)))
    reseal(d, lambda m: m.__setitem__("id", new))
    tamper(d)
    (root / "CURRENT").write_text(new + "\n")
    return new


def test_a_signed_root_loads_validates_and_serves(root, keys):
    public = keys["ours"][1]
    assert (_current(root) / SIGNATURE_FILE).is_file()
    r = run_cli("validate", root, "--trust-key", public, "--json")
    assert r.returncode == 0 and json.loads(r.stdout)["signed_by"] == TrustKey.load(public).key_id, r.stderr
    r = run_cli("validate", root, "--trust-key", keys["ours"][0])  # a private key: a reader gets the public half
    assert r.returncode == 2 and "give its public half" in r.stderr, r.stderr
    index = runtime.load(root, "cpu", trust_key=public)
    assert index.id == Root(root).current_id()
    watcher = runtime.SnapshotWatcher(root, "cpu", trust_key=public)
    assert watcher.current.id == index.id and watcher.last_error is None


@pytest.mark.parametrize("tamper", TAMPERS)
def test_a_resealed_edit_is_refused_given_the_trust_key_and_invisible_without(root, keys, tamper):
    public = keys["ours"][1]
    served = runtime.SnapshotWatcher(root, "cpu", trust_key=public)
    old = served.current.id
    new = _tampered_copy(root, TAMPERS[tamper])
    # without a key: as before, the edit opens (it is self-consistent)
    assert runtime.load(root, "cpu").id == new
    # with it: validate, load, the watcher and the server refuse it, saying why
    r = run_cli("validate", root, "--trust-key", public)
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 2 and len(lines) == 1 and "is not the one key" in lines[0] and new in lines[0], r.stderr
    with pytest.raises(ArtifactError, match="is not the one key"):
        runtime.load(root, "cpu", trust_key=public)
    assert served.poll() is False and served.current.id == old
    assert served.last_error is not None and "is not the one key" in served.last_error


def test_the_server_keeps_serving_and_says_why(root, keys):
    pytest.importorskip("starlette")
    from starlette.testclient import TestClient

    from runtime.server.http import RetrievalServer

    watcher = runtime.SnapshotWatcher(root, "cpu", trust_key=keys["ours"][1])
    retriever = runtime.Retriever(watcher, beams=(1, 8, 16, 16), batch_sizes=(1,))
    server = RetrievalServer.local(watcher, retriever, max_batch=1, poll_seconds=0.05)
    old = watcher.current.id
    _tampered_copy(root, _zero_exact_rows)
    with TestClient(server.app) as client:
        for _ in range(200):
            body = client.get("/snapshot").json()
            if body["last_error"]:
                break
            time.sleep(0.05)
        assert body["id"] == old and "is not the one key" in body["last_error"]


@pytest.mark.parametrize("how", ["unsigned", "another key"])
def test_an_unsigned_snapshot_or_another_keys_is_refused(root, keys, how):
    d = _current(root)
    if how == "unsigned":
        (d / SIGNATURE_FILE).unlink()
        message = "is not signed, and a trust key was given"
    else:
        (d / SIGNATURE_FILE).unlink()
        SigningKey.load(keys["theirs"][0]).sign(d)
        message = "not by the trusted key"
    r = run_cli("validate", root, "--trust-key", keys["ours"][1])
    assert r.returncode == 2 and message in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert run_cli("validate", root).returncode == 0  # no key: as before


def test_a_signing_update_never_vouches_for_a_base_it_cannot_verify(root, keys, pool, tmp_path):
    changes = _changes(pool, tmp_path / "0002.parquet",
                       [{"ad_id": pool["catalog"]["ad_id"][5], "op": "pause"}])
    _tampered_copy(root, _zero_exact_rows)
    before = _published(root)
    r = run_cli("update", root, "--changes", changes, "--sign-key", keys["ours"][0])
    assert r.returncode == 2 and "is not the one key" in r.stderr and _published(root) == before, r.stderr
    # an unsigned base: refused unless adopted, and a base another key signed even then
    d = _current(root)
    shutil.rmtree(d)
    (root / "CURRENT").write_text(Root(root).history()[-1] + "\n")
    (_current(root) / SIGNATURE_FILE).unlink()
    before = _published(root)
    r = run_cli("update", root, "--changes", changes, "--sign-key", keys["ours"][0])
    assert r.returncode == 2 and "is not signed" in r.stderr and _published(root) == before, r.stderr
    with pytest.raises(ArtifactError, match="its ROOT holds signed snapshots"):  # a stripped signature
        run_update(root, changes, sign_key=keys["ours"][0], adopt_unsigned=True)
    for d in Root(root).published_dirs():  # a ROOT never signed: adopted
        (d / SIGNATURE_FILE).unlink(missing_ok=True)
    report = run_update(root, changes, sign_key=keys["ours"][0], adopt_unsigned=True)
    assert report["status"] == "published" and report["signed_by"] == TrustKey.load(keys["ours"][1]).key_id
    open_snapshot(root, trust=TrustKey.load(keys["ours"][1]))
    with pytest.raises(ArtifactError, match="not by the trusted key"):
        run_update(root, _changes(pool, tmp_path / "0003.parquet", [{"ad_id": pool["catalog"]["ad_id"][6],
                                                                     "op": "pause"}]),
                   sign_key=keys["theirs"][0], adopt_unsigned=True)


def test_a_signed_build_checks_what_it_carries_forward(root, keys, pool, tmp_path):
    """A full build carries the published snapshot's paused ads and journal: a resealed edit of it
    is refused, and key rotation names the old key as the one to trust."""
    catalog = tmp_path / "catalog.parquet"
    pool["catalog"].head(N_BASE).write_parquet(catalog)
    args = ("build", "--catalog", catalog, "--targeting", pool["targeting"], "--out", root, "--config",
            pool["dir"] / "build.toml", "--force")
    r = run_cli(*args, "--sign-key", keys["theirs"][0])  # another key: the published snapshot is not its
    assert r.returncode == 2 and "not by the trusted key" in r.stderr, r.stderr
    r = run_cli(*args, "--sign-key", keys["theirs"][0], "--trust-key", keys["ours"][1], "--json")
    assert r.returncode == 0, r.stderr
    snap = open_snapshot(root, trust=TrustKey.load(keys["theirs"][1]))
    assert int((snap.row_states == 1).sum()) == 3  # the 3 paused ads carried forward
    _tampered_copy(root, _zero_exact_rows)
    before = _published(root)
    r = run_cli(*args, "--sign-key", keys["theirs"][0])
    assert r.returncode == 2 and "is not the one key" in r.stderr and _published(root) == before, r.stderr


@pytest.mark.parametrize("content, message", [
    (b"not a key", "not a PEM key"),
    (None, "not an Ed25519 private key"),
])
def test_a_bad_key_file_is_one_line(root, pool, tmp_path, content, message):
    key = tmp_path / "key.pem"
    if content is None:  # a public key where the private one belongs
        key.write_bytes(Ed25519PrivateKey.generate().public_key().public_bytes(
            serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo))
    else:
        key.write_bytes(content)
    with pytest.raises(ConfigError, match=message):
        SigningKey.load(key)
    changes = _changes(pool, tmp_path / "0002.parquet", [{"ad_id": pool["catalog"]["ad_id"][5], "op": "pause"}])
    before = _published(root)
    r = run_cli("update", root, "--changes", changes, "--sign-key", key)
    assert r.returncode == 2 and message in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert _published(root) == before


def test_signature_covers_the_bytes_of_the_manifest_only_as_signed(root, keys):
    """Flipping one byte of the signature, or of the manifest's bytes (the digest check is no
    part of this), is refused."""
    d = _current(root)
    trust = TrustKey.load(keys["ours"][1])
    trust.verify(d)
    sig = json.loads((d / SIGNATURE_FILE).read_text())
    bad = np.frombuffer(bytes.fromhex(sig["signature"]), dtype=np.uint8).copy()
    bad[0] ^= 1
    sig["signature"] = bad.tobytes().hex()
    from sidindex.artifact import seal

    (d / SIGNATURE_FILE).write_bytes(seal({k: v for k, v in sig.items() if k != "checksum"}))
    with pytest.raises(ArtifactError, match="is not the one key"):
        trust.verify(d)


def test_retrieve_and_serve_take_the_trust_key(root, keys, pool, tmp_path):
    """`retrieve` skips the digests unless given a key: then the signature vouches for the manifest
    and the digests for the bytes, so a flipped byte (not resealed) is refused too; `serve` refuses
    to start on a snapshot the key did not sign."""
    args = ("retrieve", root, "--requests", pool["dir"] / "requests.parquet", "--out", tmp_path / "out.parquet",
            "--beams", "1,4,8,8")
    assert run_cli(*args, "--trust-key", keys["ours"][1]).returncode == 0
    path = array_file(_current(root), "leaf_ads")
    data = bytearray(path.read_bytes())
    data[-1] ^= 1
    path.chmod(0o644)
    path.write_bytes(bytes(data))
    r = run_cli(*args, "--trust-key", keys["ours"][1])
    assert r.returncode == 2 and "checksum mismatch" in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr
    _tampered_copy(root, _swap_ages)
    r = run_cli("serve", root, "--trust-key", keys["ours"][1], "--port", "0", timeout=120)
    assert r.returncode == 2 and "is not the one key" in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr


def test_a_signing_build_reuses_only_the_codebook_the_signature_vouches_for(root, keys, pool, tmp_path):
    from tests.conftest import sampled_codebook as sampled

    catalog = tmp_path / "catalog.parquet"
    pool["catalog"].head(N_BASE).write_parquet(catalog)
    (old,) = (root / "codebooks").iterdir()
    shutil.rmtree(old)
    save_codebook(sampled(pool["catalog"].slice(N_BASE, N_BASE)), root)  # the attacker's, same shape
    before = _published(root)
    r = run_cli("build", "--catalog", catalog, "--targeting", pool["targeting"], "--out", root, "--config",
                pool["dir"] / "build.toml", "--force", "--sign-key", keys["ours"][0])
    assert r.returncode == 2 and "which the signed published snapshot carries" in r.stderr, r.stderr
    assert _published(root) == before


def test_keys_rotate_sign_with_the_new_trust_the_old(root, keys, pool, tmp_path):
    """Signing with a new key and trusting the old one: the first update's base is the old key's,
    the next one's its own; both pass."""
    for k in (5, 6):
        report = run_update(root, _changes(pool, tmp_path / f"{k:04d}.parquet",
                                           [{"ad_id": pool["catalog"]["ad_id"][k], "op": "pause"}]),
                            sign_key=keys["theirs"][0], trust_key=keys["ours"][1])
        assert report["signed_by"] == TrustKey.load(keys["theirs"][1]).key_id
    open_snapshot(root, trust=TrustKey.load(keys["theirs"][1]))
