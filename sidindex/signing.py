"""Signed snapshots (docs/design.md §7): an Ed25519 signature over a snapshot's manifest.

Digests tie every byte of a snapshot to its manifest, and the manifest's checksum ties it to
itself, so they find corruption; someone who can write ROOT can edit a file and reseal every
digest. A signature made with a key kept off the serving hosts cannot be resealed: given a trust
key, a reader refuses a snapshot that is unsigned, signed by another key, or whose manifest is not
the signed one. The manifest lists every file's sha256 and the journal of change files an update
chain applied (`sidindex.snapshot.manifest.JournalRecord`), so one signature covers all of them.

    <snapshot>/manifest.sig   sealed JSON: key id, algorithm, signature (hex) of manifest.json's bytes

Keys are PEM files as `openssl genpkey -algorithm ed25519` writes them (the private key) and
`openssl pkey -pubout` (the public key, all a reader is given). The `cryptography` package is an
optional extra (`sidindex[sign]`).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING, Any

from schemas.artifacts import MANIFEST_FILE, SIGNATURE_FILE
from sidindex.artifact import read_bounded, read_sealed, seal
from sidindex.errors import ArtifactError, ConfigError

if TYPE_CHECKING:
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

SIGNATURE_FORMAT = "sidindex-signature"
SIGNATURE_VERSION = 1
ALGORITHM = "ed25519"
_KEY_BYTES = 1 << 14  # a PEM key is a few hundred bytes


def _crypto() -> ModuleType:
    """cryptography's serialization module (an optional extra), imported when a key is first used."""
    try:
        from cryptography.hazmat.primitives import serialization
    except ImportError:
        raise ConfigError("signing and verifying snapshots needs the cryptography package: pip install "
                          "'sidindex[sign]'") from None
    return serialization


def _key_id(public: Ed25519PublicKey) -> str:
    """16 hex digits naming a public key: the sha256 of its raw bytes, cut."""
    from cryptography.hazmat.primitives.serialization import Encoding, PublicFormat

    return hashlib.sha256(public.public_bytes(Encoding.Raw, PublicFormat.Raw)).hexdigest()[:16]


def _read_key(path: Path, private: bool) -> Any:
    """The Ed25519 key in the PEM file `path`: the private key (`private`), else the public one;
    ConfigError naming the file otherwise."""
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

    serialization = _crypto()
    what = "signing key" if private else "trust key"
    try:
        data = read_bounded(Path(path), _KEY_BYTES)
    except ArtifactError as e:
        raise ConfigError(f"{e} (the {what})") from None
    try:
        key = serialization.load_pem_private_key(data, password=None) if b"PRIVATE KEY" in data \
            else serialization.load_pem_public_key(data)
    except TypeError:  # a private key under a passphrase
        raise ConfigError(f"{path}: an encrypted private key (the {what}); give one without a passphrase, kept "
                          "where only the job that signs can read it") from None
    except ValueError:
        raise ConfigError(f"{path}: not a PEM key (the {what}: an Ed25519 key as `openssl genpkey -algorithm "
                          "ed25519` writes it, or its public half)") from None
    if not private and isinstance(key, Ed25519PrivateKey):
        raise ConfigError(f"{path}: a private key (the {what}); give its public half, `openssl pkey -in KEY -pubout`: "
                          "a host that only checks signatures needs no key that can make them")
    if not isinstance(key, Ed25519PrivateKey if private else Ed25519PublicKey):
        hint = ("an Ed25519 private key, as `openssl genpkey -algorithm ed25519` writes one" if private else
                "an Ed25519 public key, as `openssl pkey -pubout` writes one")
        raise ConfigError(f"{path}: not {hint} (the {what})")
    return key


@dataclass(frozen=True)
class SigningKey:
    """An Ed25519 private key: what `sidindex build` and `update` sign published snapshots with."""

    path: Path
    key: Ed25519PrivateKey

    @classmethod
    def load(cls, path: str | Path) -> SigningKey:
        return cls(Path(path), _read_key(Path(path), private=True))

    @property
    def trust(self) -> TrustKey:
        """The public half: what a job that signs checks the snapshot it builds on with."""
        return TrustKey(self.path, self.key.public_key())

    def sign(self, directory: Path) -> None:
        """Write `directory`'s SIGNATURE_FILE: the signature of its manifest.json as it is now."""
        signature = self.key.sign((directory / MANIFEST_FILE).read_bytes())
        doc = {"format": SIGNATURE_FORMAT, "format_version": SIGNATURE_VERSION, "algorithm": ALGORITHM,
               "key_id": self.trust.key_id, "signature": signature.hex()}
        (directory / SIGNATURE_FILE).write_bytes(seal(doc))


@dataclass(frozen=True)
class TrustKey:
    """An Ed25519 public key that readers accept snapshots signed by."""

    path: Path
    key: Ed25519PublicKey

    @classmethod
    def load(cls, path: str | Path) -> TrustKey:
        return cls(Path(path), _read_key(Path(path), private=False))

    @staticmethod
    def pick(directory: Path, keys: tuple[TrustKey, ...]) -> TrustKey:
        """Of `keys` (at least one), the one `directory`'s signature names (unverified: `verify`
        decides), else the first."""
        try:
            named = read_sealed(directory / SIGNATURE_FILE, SIGNATURE_FORMAT, SIGNATURE_VERSION, "signature")
        except ArtifactError:
            return keys[0]
        return next((k for k in keys if k.key_id == named.get("key_id")), keys[0])

    @classmethod
    def of(cls, key: TrustKey | str | Path | None) -> TrustKey | None:
        """A trust key from what an API takes: a key, a path to one, or None (no signature asked for)."""
        if key is None or isinstance(key, TrustKey):
            return key
        return cls.load(key)

    @property
    def key_id(self) -> str:
        return _key_id(self.key)

    def verify(self, directory: Path, manifest: bytes | None = None) -> None:
        """Refuse `directory` unless its SIGNATURE_FILE is this key's signature of `manifest` (the
        bytes of its manifest.json, read again when None): ArtifactError naming what failed."""
        from cryptography.exceptions import InvalidSignature

        path = directory / SIGNATURE_FILE
        try:
            doc = read_sealed(path, SIGNATURE_FORMAT, SIGNATURE_VERSION, "signature")
        except ArtifactError as e:
            if not path.parent.is_dir() or path.exists() or path.is_symlink():
                raise ArtifactError(f"{e}; a trust key was given, so the snapshot is refused") from None
            raise ArtifactError(f"{directory}: the snapshot is not signed, and a trust key was given ({self.path}, "
                                f"key {self.key_id}); refused") from None
        if doc.get("algorithm") != ALGORITHM or not isinstance(doc.get("signature"), str) \
                or not isinstance(doc.get("key_id"), str):
            raise ArtifactError(f"{path}: not a signature this sidindex reads (algorithm {ALGORITHM}, a key id and a "
                                "signature expected)")
        if doc["key_id"] != self.key_id:
            raise ArtifactError(f"{directory}: signed by key {doc['key_id']}, not by the trusted key {self.key_id} "
                                f"({self.path}); refused")
        try:
            signature = bytes.fromhex(doc["signature"])
            self.key.verify(signature, manifest if manifest is not None else (directory / MANIFEST_FILE).read_bytes())
        except (ValueError, InvalidSignature):
            raise ArtifactError(f"{directory}: its manifest is not the one key {self.key_id} signed (changed or "
                                "resealed after signing); refused") from None
        except OSError as e:
            raise ArtifactError(f"{directory / MANIFEST_FILE}: cannot be read ({e.strerror})") from None

