"""Frozen residual k-means codebooks: training, and the versioned on-disk artifact.

A codebook fixes the whole SID scheme (semantic centroids, hash level size and keys, number of
paths), so assigning the same ads with the same codebook always gives the same SIDs, and adding
ads never changes existing ones (assignment is per ad, against frozen centroids).

On disk (``ROOT/codebooks/<id>/``): ``codebook.json`` (format, version, scheme, training config,
notes, and size + sha256 of every file) and ``level_<l>.npy`` (K_l, D) float32 per semantic level,
read with ``allow_pickle=False``. The id is a hash of the scheme and the centroid bytes, so the same
training gives the same id. Directories are written under a temporary name, fsynced, then renamed.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import shutil
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from sidindex.artifact import (
    CHECKSUM_KEY,
    list_files,
    open_regular,
    publish_dir,
    read_sealed,
    seal,
    verify_files,
)
from sidindex.config import SIDConfig
from sidindex.errors import ArtifactError, ConfigError
from sidindex.sid.hashing import HASH_SEED, KEY_SEPARATOR

FORMAT = "sidindex.codebook"
FORMAT_VERSION = 2  # 2: sealed manifest (1 is still read)
MANIFEST = "codebook.json"
_KEYS = {"format", "format_version", "id", "dim", "level_sizes", "hash_keys", "hash_seed", "hash_key_separator",
         "paths", "path_ratio", "config", "notes", "files"}

Progress = Callable[[str, int, int], None]


@dataclass(frozen=True)
class Codebook:
    """A frozen SID scheme.

    centroids:  per semantic level l, (K_l, D) float32
    hash_size:  size of the final, hashed level
    hash_keys:  catalog columns hashed into the final level
    paths:      first-level centroids per ad (multi-path); path_ratio optionally limits them
    config:     the training configuration; notes: what training had to adapt (shrunk levels...)
    """

    centroids: tuple[np.ndarray, ...]
    hash_size: int
    hash_keys: tuple[str, ...]
    paths: int
    path_ratio: float | None
    config: SIDConfig
    notes: tuple[str, ...] = ()

    @property
    def dim(self) -> int:
        return int(self.centroids[0].shape[1])

    @property
    def level_sizes(self) -> tuple[int, ...]:
        """Sizes of all L levels: the semantic ones, then the hash level."""
        return tuple(len(c) for c in self.centroids) + (self.hash_size,)

    @property
    def sid_length(self) -> int:
        return len(self.centroids) + 1

    @property
    def vocab_size(self) -> int:
        return max(self.level_sizes)

    def scheme(self) -> dict:
        """Everything that determines SIDs, besides the centroid values."""
        return {"dim": self.dim, "level_sizes": list(self.level_sizes), "hash_keys": list(self.hash_keys),
                "hash_seed": HASH_SEED, "hash_key_separator": KEY_SEPARATOR, "paths": self.paths,
                "path_ratio": self.path_ratio}

    @property
    def id(self) -> str:
        h = hashlib.sha256(json.dumps(self.scheme(), sort_keys=True).encode())
        for c in self.centroids:
            h.update(np.ascontiguousarray(c, dtype="<f4").tobytes())
        return "cb-" + h.hexdigest()[:16]


def train_codebook(embedding: np.ndarray, config: SIDConfig, progress: Progress | None = None) -> Codebook:
    """Train a residual k-means codebook on a seeded sample of the catalog.

    embedding: (N, D) float32 catalog embeddings
    Level l is trained on the residuals left by levels < l (nearest-centroid assignment, the same
    rule `assign_sids` uses). Deterministic on the CPU for a given config (faiss k-means is seeded).
    """
    from sidindex.sid.kmeans import nearest, train_level  # faiss: needed to train, not to load or assign

    n = len(embedding)
    rng = np.random.default_rng(config.seed)
    if n > config.train_sample:
        rows = np.sort(rng.choice(n, size=config.train_sample, replace=False))
        x = embedding[rows].astype(np.float32)
    else:
        x = np.array(embedding, dtype=np.float32)
    notes: list[str] = []
    if n > config.train_sample:
        notes.append(f"trained on a sample of {config.train_sample} of {n} ads")
    centroids = []
    for level, k in enumerate(config.levels):
        if progress:
            progress("train", level, len(config.levels))
        c, level_notes = train_level(
            x, k, niter=config.niter, seed=config.seed + level,
            min_points_per_centroid=config.min_points_per_centroid, balanced=config.balanced,
            capacity=config.capacity, balanced_iters=config.balanced_iters)
        notes += [f"level {level}: {t}" for t in level_notes]
        x -= c[nearest(x, c)]
        centroids.append(c)
    if progress:
        progress("train", len(config.levels), len(config.levels))
    paths = min(config.paths, len(centroids[0]))
    if paths < config.paths:
        notes.append(f"paths reduced from {config.paths} to {paths} (first level has {paths} centroids)")
    return Codebook(tuple(centroids), config.hash_size, tuple(config.hash_keys), paths, config.path_ratio,
                    config, tuple(notes))


def save_codebook(codebook: Codebook, root: str | Path) -> Path:
    """Write `codebook` to ``root/codebooks/<id>/`` atomically; returns that directory.

    Saving a codebook whose id already exists leaves the existing directory as it is (same id,
    same content).
    """
    from sidindex.root import TMP_PREFIX, Root

    parent = Root(root).codebooks
    parent.mkdir(parents=True, exist_ok=True)
    final = parent / codebook.id
    if final.exists():
        return final
    tmp = Path(tempfile.mkdtemp(prefix=TMP_PREFIX, dir=parent))
    try:
        for level, c in enumerate(codebook.centroids):
            np.save(tmp / f"level_{level}.npy", np.ascontiguousarray(c, dtype="<f4"), allow_pickle=False)
        manifest = {"format": FORMAT, "format_version": FORMAT_VERSION, "id": codebook.id,
                    **codebook.scheme(), "config": _config_dict(codebook.config),
                    "notes": list(codebook.notes), "files": list_files(tmp, MANIFEST)}
        (tmp / MANIFEST).write_bytes(seal(manifest))
        publish_dir(tmp, final)
    except OSError:
        shutil.rmtree(tmp, ignore_errors=True)
        if final.is_dir():  # saved meanwhile by another writer: the same id is the same content
            return final
        raise
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return final


def resolve_codebook(path: str | Path) -> Path:
    """A codebook directory from either that directory or a ROOT holding exactly one codebook."""
    from sidindex.root import Root

    path = Path(path)
    if os.path.lexists(path / MANIFEST):
        return path
    books = sorted(p for p in Root(path).codebooks.glob("cb-*") if (p / MANIFEST).is_file())
    if len(books) == 1:
        return books[0]
    if not books:
        raise ArtifactError(f"{path}: no codebook here (expected {MANIFEST}, or codebooks/<id>/ under a ROOT)")
    raise ArtifactError(f"{path}: holds {len(books)} codebooks ({', '.join(b.name for b in books)}); "
                        "pass the directory of the one to use")


def _read_manifest(mpath: Path) -> dict:
    """The codebook manifest: sealed (version 2), or version 1 (unsealed; its files carry sha256
    sums), so codebooks that fix deployed models' SIDs stay readable."""
    doc = read_sealed(mpath, FORMAT, FORMAT_VERSION, "codebook", unsealed=1)
    keys = _KEYS | ({CHECKSUM_KEY} if doc["format_version"] == FORMAT_VERSION else set())
    if set(doc) != keys:
        raise ArtifactError(f"{mpath}: keys do not match the codebook format (missing {sorted(keys - set(doc))}, "
                            f"unexpected {sorted(set(doc) - keys)})")
    if not isinstance(doc["files"], dict) or not isinstance(doc["config"], dict):
        raise ArtifactError(f"{mpath}: 'files' and 'config' must be objects")
    return doc


def load_codebook(path: str | Path, *, verify: bool = True) -> Codebook:
    """Read a codebook directory (or a ROOT with one codebook), checking its manifest, its files
    (listed, regular, sizes; with `verify` their sha256), shapes and its content id."""
    path = resolve_codebook(path)
    mpath = path / MANIFEST
    m = _read_manifest(mpath)
    try:
        sizes = [int(s) for s in m["level_sizes"]]
        dim = int(m["dim"])
        if m["hash_seed"] != HASH_SEED or m["hash_key_separator"] != KEY_SEPARATOR:
            raise ArtifactError(f"{mpath}: hash seed or key format differs from this sidindex's")
        listed = {n: {"bytes": e["bytes"], "sha256": e["sha256"]} for n, e in m["files"].items()}
        verify_files(path, listed, MANIFEST, checksums=verify)
        fields: dict[str, Any] = {k: tuple(v) if isinstance(v, list) else v for k, v in m["config"].items()}
        config = SIDConfig(**fields)
        centroids = []
        for level, k in enumerate(sizes[:-1]):
            c = _read_centroids(path / f"level_{level}.npy", k, dim)
            if not np.isfinite(c).all():
                raise ArtifactError(f"{path / f'level_{level}.npy'}: holds non-finite centroids")
            centroids.append(c)
        cb = Codebook(tuple(centroids), sizes[-1], tuple(m["hash_keys"]), int(m["paths"]),
                      m["path_ratio"], config, tuple(m["notes"]))
    except (KeyError, TypeError, ValueError, ConfigError, OSError) as e:
        raise ArtifactError(f"{mpath}: malformed or incomplete codebook ({type(e).__name__}: {e})") from None
    if cb.id != m["id"]:
        raise ArtifactError(f"{mpath}: content does not match its id {m['id']!r}")
    return cb


def _read_centroids(path: Path, k: int, dim: int) -> np.ndarray:
    """(k, dim) float32 centroids from a .npy file whose header says exactly that, checked before
    any data is read (a header may claim any shape) and against the file's size."""
    with os.fdopen(open_regular(path), "rb") as f:
        try:
            read_header = {(1, 0): np.lib.format.read_array_header_1_0,
                           (2, 0): np.lib.format.read_array_header_2_0}.get(np.lib.format.read_magic(f))
            if read_header is None:
                raise ValueError("unknown .npy format version")
            shape, fortran, dtype = read_header(f)  # bounded: numpy refuses oversized headers
        except ValueError as e:  # not .npy (an .npz, a text file, a bad header)
            raise ArtifactError(f"{path}: not a valid array file ({e})") from None
        if dtype != np.dtype("<f4") or fortran or shape != (k, dim):
            raise ArtifactError(f"{path}: holds {dtype}{shape}, expected float32({k}, {dim})")
        if os.fstat(f.fileno()).st_size != f.tell() + k * dim * 4:
            raise ArtifactError(f"{path}: its size does not fit float32({k}, {dim}) (truncated?)")
        return np.fromfile(f, dtype="<f4", count=k * dim).reshape(k, dim)


def _config_dict(config: SIDConfig) -> dict:
    return {k: list(v) if isinstance(v, tuple) else v for k, v in dataclasses.asdict(config).items()}
