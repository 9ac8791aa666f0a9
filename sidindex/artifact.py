"""Helpers shared by on-disk artifacts (codebooks, snapshots): checksums, fsync, manifests.

A manifest is a small JSON document naming its format and format version; readers refuse other
formats, say plainly when a file comes from a newer writer, and never read an oversized manifest.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

from sidindex.errors import ArtifactError

MAX_MANIFEST_BYTES = 16 << 20


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def fsync_path(path: Path) -> None:
    """fsync a file or a directory (a directory's entries: creations and renames in it)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def read_manifest(path: Path, fmt: str, version: int, what: str) -> dict:
    """The JSON manifest at `path`, checked to be format `fmt` at `version`."""
    try:
        size = path.stat().st_size
    except FileNotFoundError:
        raise ArtifactError(f"{path}: missing; not a sidindex {what}") from None
    if size > MAX_MANIFEST_BYTES:
        raise ArtifactError(f"{path}: {size} bytes, too large for a {what} manifest")
    try:
        m = json.loads(path.read_bytes())
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ArtifactError(f"{path}: not valid JSON ({e})") from None
    if not isinstance(m, dict) or m.get("format") != fmt:
        raise ArtifactError(f"{path}: not a sidindex {what} manifest")
    found = m.get("format_version")
    if found != version:
        newer = isinstance(found, int) and found > version
        raise ArtifactError(f"{path}: {what} format version {found!r}; this sidindex reads version {version}"
                            + (" (written by a newer sidindex: upgrade sidindex)" if newer else ""))
    return m
