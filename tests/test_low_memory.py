"""Under an address-space limit (`ulimit -v`) every command ends with the one-line "out of host
memory" error and exit 2, or succeeds: never a traceback, an abort or a hang, and a ROOT is left
as it was or rightly changed (`sidindex.resources`).

- build, update, retrieve and validate through the installed script at 1 GB, where build and
  retrieve are refused before they load anything, and at 1.5 GB;
- what the limit sizes (threads, allocators; a user's own setting kept), and which errors say
  that memory ran out.
"""

from __future__ import annotations

import errno
import shutil
import subprocess
from pathlib import Path

import polars as pl
import pytest

from schemas.artifacts import AD_PAUSED
from sidindex import resources
from sidindex.errors import ArtifactError, InputError
from sidindex.resources import GiB
from sidindex.snapshot import open_snapshot
from tests.conftest import run_cli

CONFIG = "[sid]\nlevels = [16, 8, 4]\nhash_size = 64\nmin_points_per_centroid = 5\n"
LIMITS = (1_000_000, 1_500_000)  # KiB, as `ulimit -v` takes them
TIMEOUT = 120  # s; a hang fails the test (TimeoutExpired), a run takes a few seconds


@pytest.fixture(scope="module")
def built(sample_dir, tmp_path_factory) -> Path:
    """The sample catalog built without a limit: ROOT and its build config."""
    base = tmp_path_factory.mktemp("low_memory")
    (base / "build.toml").write_text(CONFIG)
    r = run_cli("build", "--catalog", sample_dir / "catalog.parquet", "--targeting", sample_dir / "targeting.toml",
                "--out", base / "root", "--config", base / "build.toml", timeout=300)
    assert r.returncode == 0, r.stderr
    return base / "root"


def limited(kib: int, *args: object) -> subprocess.CompletedProcess:
    """The installed `sidindex` with `args`, its address space limited to `kib` KiB."""
    exe = shutil.which("sidindex")
    assert exe, "the sidindex console script is not installed (pip install -e .)"
    return subprocess.run(["bash", "-c", f'ulimit -v {kib} && exec "$0" "$@"', exe, *map(str, args)],
                          capture_output=True, text=True, timeout=TIMEOUT)


def ended_cleanly(r: subprocess.CompletedProcess) -> bool:
    """Whether `r` succeeded (True) or failed with the one-line out-of-memory error (False)."""
    assert r.returncode in (0, 2), f"exit {r.returncode}: {r.stderr[-3000:]}"
    assert "Traceback" not in r.stderr, r.stderr[-3000:]
    if r.returncode == 2:
        lines = r.stderr.strip().splitlines()
        assert len(lines) == 1 and "out of host memory" in lines[0], r.stderr[-3000:]
    return r.returncode == 0


def copy_root(built: Path, tmp_path: Path) -> tuple[Path, str]:
    root = Path(shutil.copytree(built, tmp_path / "root"))
    return root, open_snapshot(root).id


def current(root: Path) -> str:
    """The published snapshot's id, after checking every byte of it."""
    return open_snapshot(root, verify=True, strong=True, cover=True).id


@pytest.mark.parametrize("kib", LIMITS)
def test_build(built, sample_dir, tmp_path, kib):
    root, before = copy_root(built, tmp_path)
    catalog = pl.read_parquet(sample_dir / "catalog.parquet").head(1000)  # a catalog of its own: a new snapshot
    catalog.write_parquet(tmp_path / "catalog.parquet")
    r = limited(kib, "build", "--catalog", tmp_path / "catalog.parquet", "--targeting",
                sample_dir / "targeting.toml", "--out", root, "--config", built.parent / "build.toml")
    if ended_cleanly(r):
        assert current(root) != before
        assert sorted(open_snapshot(root).ad_id.tolist()) == sorted(catalog["ad_id"].to_list())
    else:
        assert current(root) == before
    if kib == LIMITS[0]:  # refused before it loads its libraries
        assert r.returncode == 2 and "ulimit -v" in r.stderr


@pytest.mark.parametrize("kib", LIMITS)
def test_update(built, tmp_path, kib):
    root, before = copy_root(built, tmp_path)
    paused = open_snapshot(root).ad_id[:20].tolist()
    changes = tmp_path / "changes.parquet"
    pl.DataFrame({"ad_id": paused, "op": ["pause"] * len(paused)},
                 schema={"ad_id": pl.Int64, "op": pl.String}).write_parquet(changes)
    r = limited(kib, "update", root, "--changes", changes)
    if ended_cleanly(r):
        assert current(root) != before
        snap = open_snapshot(root)
        states = dict(zip(snap.ad_id.tolist(), snap.row_states.tolist()))
        assert {states[a] for a in paused} == {AD_PAUSED}
    else:
        assert current(root) == before


@pytest.mark.parametrize("kib", LIMITS)
def test_retrieve(built, sample_dir, tmp_path, kib):
    out = tmp_path / "retrieved.parquet"
    r = limited(kib, "retrieve", built, "--requests", sample_dir / "requests.parquet", "--out", out,
                "--device", "cpu")
    if ended_cleanly(r):
        assert pl.read_parquet(out).height > 0
    else:
        assert not out.exists()
    if kib == LIMITS[0]:
        assert r.returncode == 2 and "ulimit -v" in r.stderr


@pytest.mark.parametrize("kib", LIMITS)
def test_validate(built, kib):
    before = open_snapshot(built).id
    ended_cleanly(limited(kib, "validate", built))
    assert current(built) == before


def test_help_is_never_refused():
    assert limited(500_000, "--help").returncode == 0


def test_the_limit_sizes_threads_and_allocators_and_keeps_the_users_settings(monkeypatch):
    monkeypatch.setattr(resources, "address_space_limit", lambda: 3 * GiB)
    env = {"NUMBA_NUM_THREADS": "7", "MALLOC_ARENA_MAX": "4"}  # the user's own (glibc's heaps untouched)
    added = resources.fit_to_limit(env)
    threads = str(resources.limited_threads(3 * GiB))
    assert 1 <= int(threads) <= 3
    assert env["NUMBA_NUM_THREADS"] == "7" and "NUMBA_NUM_THREADS" not in added
    assert env["OPENBLAS_NUM_THREADS"] == env["POLARS_MAX_THREADS"] == env["OMP_NUM_THREADS"] == threads
    assert env["ARROW_DEFAULT_MEMORY_POOL"] == "system" and added == {k: env[k] for k in added}
    assert resources.limited_threads(GiB // 2) == 1  # never none

    monkeypatch.setattr(resources, "address_space_limit", lambda: None)
    env = {}
    assert resources.fit_to_limit(env) == {} and env == {}
    resources.check_limit("torch")  # no limit, nothing refused


def test_a_limit_below_what_the_libraries_need_is_refused(monkeypatch):
    monkeypatch.setattr(resources, "address_space_limit", lambda: 1.3 * GiB)
    monkeypatch.setattr(resources, "_cuda_torch", lambda: False)
    resources.check_limit(None)
    resources.check_limit("faiss")
    with pytest.raises(MemoryError, match=r"ulimit -v\) is 1\.30 GiB, below the 1\.40 GiB"):
        resources.check_limit("torch")
    monkeypatch.setattr(resources, "_cuda_torch", lambda: True)  # a CUDA build maps far more
    monkeypatch.setattr(resources, "address_space_limit", lambda: 3.5 * GiB)
    with pytest.raises(MemoryError, match=r"below the 4\.00 GiB"):
        resources.check_limit("torch")
    resources.check_limit("faiss")


def _raised_while(handling: BaseException, raised: BaseException) -> BaseException:
    try:
        try:
            raise handling
        except BaseException:
            raise raised  # noqa: B904 (the implicit context is the point)
    except BaseException as e:
        return e


@pytest.mark.parametrize("error, memory", [
    (MemoryError(), True),
    (RuntimeError("can't start new thread"), True),
    (ImportError("libarrow_compute.so.2600: failed to map segment from shared object"), True),
    (OSError(errno.ENOMEM, "Cannot allocate memory"), True),
    (RuntimeError("[enforce fail at alloc_cpu.cpp:127] DefaultCPUAllocator: can't allocate memory"), True),
    (_raised_while(MemoryError(), ValueError("while converting")), True),
    (_raised_while(OSError(errno.ENOMEM, "Cannot allocate memory"), ArtifactError("x.arrow: cannot be read")), True),
    (_raised_while(ValueError("Unknown error: Failed to launch worker thread"), InputError("x.parquet: bad")), True),
    (RuntimeError("CUDA error: out of memory"), True),
    (RuntimeError("boom"), False),
    (_raised_while(ValueError("Parquet magic bytes not found"), InputError("x.parquet: cannot be read")), False),
    (ImportError("No module named 'nothing_here'"), False),
    (OSError(errno.ENOENT, "No such file or directory"), False),
    (_raised_while(KeyError("x"), SystemError("returned NULL without setting an exception")), False),
])
def test_which_errors_say_memory_ran_out(error, memory):
    assert resources.is_out_of_memory(error) is memory
