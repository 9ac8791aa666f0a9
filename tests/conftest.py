from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import torch

# Without a GPU the Triton kernels run in Triton's interpreter on CPU tensors; this must be set
# before triton is first imported.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import numpy as np
import polars as pl
import pytest

from sidindex.config import SIDConfig
from sidindex.sample import sample_catalog, sample_spec, write_sample
from sidindex.sid import Codebook
from sidindex.targeting import write_targeting


@pytest.fixture(scope="session")
def sample_dir(tmp_path_factory) -> Path:
    """A generated catalog (1200 ads, 16 dims), requests and targeting spec."""
    out = tmp_path_factory.mktemp("sample")
    write_sample(out, 1200, 50, dim=16, seed=3)
    return out


@pytest.fixture(scope="session")
def spec():
    return sample_spec()


@pytest.fixture
def catalog_df(spec) -> pl.DataFrame:
    """A small valid catalog as a polars frame, for tests that corrupt one thing."""
    return pl.from_arrow(sample_catalog(60, spec, dim=8, seed=11))


@pytest.fixture
def write_catalog(tmp_path, spec):
    """Write a frame as Parquet next to the sample spec; returns (catalog path, spec path)."""
    spec_path = tmp_path / "targeting.toml"
    write_targeting(spec, spec_path)

    def write(df: pl.DataFrame, name: str = "catalog.parquet") -> tuple[Path, Path]:
        path = tmp_path / name
        df.write_parquet(path)
        return path, spec_path

    return write


def small_config(**kw) -> SIDConfig:
    """Levels small enough for catalogs of a few hundred ads, fast to train."""
    base = dict(levels=(16, 8, 4), hash_size=64, niter=8, min_points_per_centroid=5, train_sample=4096)
    base.update(kw)
    return SIDConfig(**base)


def clustered(n: int, dim: int, seed: int) -> np.ndarray:
    from sidindex.sample import sample_embeddings

    return sample_embeddings(n, dim, np.random.default_rng(seed), n_clusters=6)


def run_cli(*args, timeout: float = 600, **kw) -> subprocess.CompletedProcess:
    """Run the installed `sidindex` console script, as a user would."""
    exe = shutil.which("sidindex")
    assert exe, "the sidindex console script is not installed (pip install -e .)"
    return subprocess.run([exe, *map(str, args)], capture_output=True, text=True, timeout=timeout, **kw)


def sampled_codebook(catalog: pl.DataFrame) -> Codebook:
    """A frozen codebook whose centroids are catalog embeddings (residuals of them below level 0):
    what `sidindex build` reuses, made without training (so without faiss, as on a GPU host)."""
    emb = catalog["embedding"].to_numpy().astype(np.float32)
    levels = [emb[::len(emb) // 8][:8]]
    for k in (4, 4):
        levels.append((emb[1::len(emb) // k][:k] - emb[::len(emb) // k][:k]).astype(np.float32))
    cfg = SIDConfig(levels=(8, 4, 4), hash_size=16, paths=2)
    return Codebook(tuple(levels), 16, cfg.hash_keys, cfg.paths, None, cfg)


def interpreted(n: int, gpu: int | None = None) -> int:
    """Hypothesis examples for a property test of Triton kernels: on a GPU, where the real kernels
    run (`bench/gpu_check.sh` runs these files there), n (or `gpu`, for a test whose examples each
    compile new kernel variants: seconds each); under Triton's interpreter on the CPU, where an
    example costs seconds, 30% of n (at least 2): CI's time goes to every kernel's cases, and each
    run draws new examples."""
    if torch.cuda.is_available():
        return n if gpu is None else gpu
    return max(2, round(0.3 * n))
