"""The build on Ray (`sidindex build --engine ray`, docs/design.md §14): `sidindex.stages` as Ray
tasks that write the snapshot's files themselves, so that the driver holds per-fragment and
per-shard sums, never an array of the catalog's length.

Tasks, in order: prepare (one per Parquet row group: validate, SIDs, matcher rows, exact index);
globals (ad ids checked across fragments, then the global arrays streamed into their files); a
shuffle by first token into parts; build (a subtrie per part); shards (each combines its parts,
writes its files and returns its manifest entry and sums); finish (the driver merges the sums, the
job writes the manifest, `check_on_ray` checks the snapshot a task per shard).

Every node must mount the ROOT at the same path. A bad row fails the build with the local engine's
message; a dead task or an unreachable cluster raises `EngineError`; nothing is published on
failure. A local Ray started for a build ends with it. Ray is an optional extra. Each task, its
errors and measured costs: docs/scaling.md ("The Ray engine", "Measured and expected").
"""

from __future__ import annotations

import contextlib
import functools
import os
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

import numpy as np

from schemas.artifacts import ARRAYS_BY_NAME, MANIFEST_FILE, MATCHER_PLANES
from sidindex import histogram
from sidindex.artifact import list_files, regular_input
from sidindex.config import QualityThresholds
from sidindex.errors import ArtifactError, EngineError, InputError, SidIndexError
from sidindex.ingest import check_unique_ad_ids
from sidindex.sid import Codebook
from sidindex.sid.quality import QualityReport, QualitySums, SidSums, quality_report
from sidindex.snapshot import snapshot
from sidindex.snapshot.arrays import write_array_pieces
from sidindex.snapshot.manifest import ArrayShape, ShardEntry
from sidindex.targeting import TargetingSpec
from sidindex.timing import StageClock
from sidindex.trie.kway import KWayConfig
from sidindex.trie.partition import Subtrie, combine, default_workers
from sidindex.trie.shard import Shard, default_shards, part_bounds, shard_bounds, shard_of
from sidindex.trie.stats import GTMStats, StatsSums


@dataclass(frozen=True)
class Fragment:
    """Row group `group` of the Parquet file; its first row is file row `first_row`."""

    group: int
    first_row: int


@dataclass(frozen=True)
class RayBuilt:
    """What the Ray engine hands the job: the snapshot's arrays, which its tasks wrote into the
    directory they were given, described for its manifest (`write_manifest`).

    shards: each shard's manifest entry, in token order; global_arrays: the global arrays' shapes;
    listed: every file written, with its listing (sizes, digests); stats, quality: merged from
    per-shard and per-fragment sums; shape: fragments, shards, shuffle bytes, and each part's SID rows
    and build seconds
    """

    shards: tuple[ShardEntry, ...]
    global_arrays: dict[str, ArrayShape]
    listed: dict[str, dict]
    stats: GTMStats
    quality: QualityReport
    seconds: dict[str, float]
    shape: dict


def fragments(path: Path) -> list[Fragment]:
    """The fragments of the Parquet catalog at `path`: its row groups."""
    import pyarrow.parquet as pq

    regular_input(path, "catalog")
    try:
        meta = pq.ParquetFile(path).metadata
    except Exception as e:  # pyarrow raises several types for a file that is not Parquet
        raise InputError(f"{path}: the ray engine reads Parquet catalogs (their row groups are its fragments) "
                         f"and cannot read this one as Parquet: {e}") from None
    if meta.num_rows == 0:
        raise InputError(f"{path}: the catalog holds no rows; nothing to index")
    starts = np.cumsum([0] + [meta.row_group(g).num_rows for g in range(meta.num_row_groups)])
    return [Fragment(g, int(starts[g])) for g in range(meta.num_row_groups) if starts[g + 1] > starts[g]]


@contextlib.contextmanager
def ray_cluster(address: str | None = None, workers: int | None = None) -> Iterator[ModuleType]:
    """Ray, for the block: a local Ray on `workers` CPUs (default: every core) started for it, or
    the cluster at `address` ("auto": the one this host belongs to). When this process already runs
    Ray, the block uses it (and neither argument). Ray's own errors in the block raise `EngineError`."""
    try:
        import ray
    except ImportError:
        raise EngineError("the ray engine needs Ray, an optional extra: pip install 'sidindex[ray]'") from None
    started = not ray.is_initialized()
    if started:
        env = {"RAY_ACCEL_ENV_VAR_OVERRIDE_ON_ZERO": "0"}  # keeps Ray from warning about GPUs
        if address is None:
            # Ray gives the processes it starts a parent-death signal, but not the agents its raylet
            # starts: when the driver is killed, they see the raylet gone and wait for the GCS (dead
            # too) to take their report, 60 s by default. A local GCS is never restarted, so waiting
            # for it is pointless: 5 s, and a killed build leaves no process behind
            env["RAY_gcs_rpc_server_reconnect_timeout_s"] = "5"
        try:
            with _environment(env):
                # "local": a Ray of the build's own, never one that RAY_ADDRESS or `ray start` left running
                ray.init(address=address or "local", num_cpus=None if address else workers or default_workers(),
                         include_dashboard=False, log_to_driver=False, configure_logging=False)
        except Exception as e:  # Ray raises many types here, plain Exception among them
            ray.shutdown()
            raise EngineError(f"cannot start or reach Ray{f' at {address}' if address else ''}: {e}") from None
    try:
        yield ray
    except ray.exceptions.RayError as e:
        raise EngineError(f"the ray build failed, nothing published: {_cause(e)}") from None
    finally:
        if started:
            ray.shutdown()


def build_on_ray(path: Path, spec: TargetingSpec, codebook: Codebook, directory: Path, *,
                 kway: KWayConfig | None, quality: QualityThresholds | None = None, retries: int = 0,
                 shards: int | None = None, progress: Callable[[str, int, int], None] | None = None) -> RayBuilt:
    """Build the catalog at `path` on the Ray of `ray_cluster`, its tasks writing the snapshot's
    arrays into the new, empty `directory` (on a cluster, one every node mounts at the same path):
    this process holds only per-shard and per-fragment sums. A task is retried `retries` times
    when its worker dies. shards: as `sidindex.trie.shard.build_shards`. progress(stage, done, total)
    as fragments are prepared and shards written. A SID quality gate that fails raises
    `QualityGateError` once the arrays are written (the caller publishes nothing)."""
    import ray

    clock = StageClock()
    frags = fragments(path)
    clock.lap("fragments")
    return _run(ray, path, spec, codebook, kway, quality, directory.resolve(), frags, retries, shards, clock,
                progress or (lambda *_: None))


@contextlib.contextmanager
def _environment(values: dict[str, str]) -> Iterator[None]:
    """`values` in this process's environment, unless set already (a user's own setting wins), and
    so in that of the processes started meanwhile (a local Ray's read it when they start)."""
    added = {k: v for k, v in values.items() if k not in os.environ}
    os.environ.update(added)
    try:
        yield
    finally:
        for k in added:
            os.environ.pop(k, None)


@dataclass(frozen=True)
class _Prepared:
    """What the driver reads of a prepared fragment: (K_0,) int64 SID rows per first token, the
    bytes of its SID rows, (M,) int64 the histogram of its ads' SID rows, its quality sums."""

    first_tokens: np.ndarray
    nbytes: int
    per_ad: np.ndarray
    sums: QualitySums


@dataclass(frozen=True)
class _Written:
    """What a shard's task hands the driver: its manifest entry, its files' listing, its sums."""

    entry: ShardEntry
    listed: dict[str, dict]
    stats: StatsSums
    sids: SidSums
    peak_bytes: int  # the task's peak RSS above what its worker held before (`_reset_peak`)
    seconds: float


def _run(ray: ModuleType, path: Path, spec: TargetingSpec, codebook: Codebook, kway: KWayConfig | None,
         thresholds: QualityThresholds | None, directory: Path, frags: list[Fragment], retries: int,
         shards: int | None, clock: StageClock, progress: Callable[[str, int, int], None]) -> RayBuilt:
    from sidindex import stages

    level_sizes = codebook.level_sizes
    planes = MATCHER_PLANES
    plane_bits = tuple(layout.bits for layout in spec.layouts)
    bits = sum(plane_bits)

    source = path.resolve()  # what every task reads, wherever it runs; messages name `path`

    @ray.remote(num_returns=3, max_retries=retries)
    def prepare(f: Fragment, spec: TargetingSpec, codebook: Codebook) -> tuple[Any, Any, _Prepared | _Failed]:
        import numba
        import pyarrow.parquet as pq

        # the task's CPUs, not the node's: numba (and the SID assignment's pool) would start a
        # thread per core of the node in every task, and a buffer each
        cpus = int(ray.get_runtime_context().get_assigned_resources().get("CPU", 1))
        numba.set_num_threads(max(1, min(cpus, numba.config.NUMBA_NUM_THREADS)))  # type: ignore[attr-defined]
        try:
            table = pq.ParquetFile(source).read_row_group(f.group)
            # pyarrow leaves what it decoded unchecked (a string's UTF-8 above all), and polars takes
            # it as valid: a corrupt page would make the worker panic or crash instead of naming it
            table.validate(full=True)
        except Exception as e:  # a corrupt row group; ranked first, as the local engine fails reading
            failed = _Failed(f"{path}: row group {f.group} (from file row {f.first_row}) cannot be read as Parquet: "
                             f"{' '.join(str(e).split()).rstrip('.')}; the file is corrupt: write it again",
                             (-1, -1, -1), None)
            return failed, None, failed
        try:
            ads, sid_rows = stages.prepare_fragment(table, f.first_row, str(path), spec, codebook)
        except InputError as e:  # reported by the driver, which ranks every fragment's error
            rank = e.rank
            failed = _Failed(str(e), rank, table.column("ad_id") if rank[0] > 0 else None)
            return failed, None, failed
        per_ad = histogram.histogram(np.bincount(sid_rows.column("ad").to_numpy() - f.first_row,
                                                 minlength=ads.num_rows))
        return ads, sid_rows, _Prepared(stages.first_tokens(sid_rows, level_sizes[0]), sid_rows.nbytes, per_ad,
                                        stages.fragment_sums(ads))

    @ray.remote(max_retries=retries)
    def check_ads(*ads: Any) -> str | None:
        """The catalog's first error (`_first_error`), None when it has none."""
        return _first_error(list(ads), path)

    @ray.remote(max_retries=retries)
    def write_globals(error: str | None, *ads: Any) -> tuple[dict[str, ArrayShape], dict[str, dict],
                                                             tuple[int, float]] | None:
        """The global arrays written (None when the catalog was refused): their shapes, listing,
        and the task's peak RSS (above what its worker held before) and seconds."""
        if error is not None:
            return None
        t = time.perf_counter()
        held = _reset_peak()
        arrays = stages.global_arrays(list(ads), spec)
        _reachable(directory)
        for name, a in arrays.items():  # a fragment at a time: the task never holds an array whole
            write_array_pieces(directory, ARRAYS_BY_NAME[name], a.shape, a.pieces())
        listed = list_files(directory, MANIFEST_FILE, fast=True, only=[ARRAYS_BY_NAME[n].file for n in arrays])
        return ({n: ArrayShape(a.shape[0], a.shape[1] if len(a.shape) == 2 else None) for n, a in arrays.items()},
                listed, (_peak_bytes() - held, time.perf_counter() - t))

    @ray.remote(max_retries=retries)
    def split(sid_rows: Any, bounds: np.ndarray) -> Any:  # pyarrow tables
        parts = stages.split_sid_rows(sid_rows, bounds)
        return parts if len(parts) > 1 else parts[0]  # one return value is not unpacked

    @ray.remote(num_returns=2, max_retries=retries)
    def build(*tables: Any) -> tuple[Subtrie, tuple[int, float]]:
        t = time.perf_counter()
        sub = stages.build_part(list(tables), level_sizes, planes, kway=kway, matcher_bits=bits)
        return sub, (sum(x.num_rows for x in tables), time.perf_counter() - t)

    @ray.remote(max_retries=retries)
    def write_shard(k: int, lo: int, hi: int, error: str | None, *subs: Subtrie) -> _Written | None:
        """Shard k, [lo, hi), of its parts' subtries, in token order, written once the catalog passed
        its checks (None when it was refused: nothing is written)."""
        if error is not None:
            return None
        t, held = time.perf_counter(), _reset_peak()
        shard = shard_of(subs[0], lo, hi, None) if len(subs) == 1 else Shard(lo, hi, combine(subs, level_sizes))
        del subs
        _reachable(directory)
        entry, _ = snapshot.write_shard(directory, k, shard)
        g = shard.gtm
        return _Written(entry, snapshot.list_shard(directory, k), StatsSums.of(g, plane_bits),
                        SidSums.of(g.leaf_sids(), np.diff(g.leaf_ad_offsets), level_sizes), _peak_bytes() - held,
                        time.perf_counter() - t)

    spec_ref, cb_ref = ray.put(spec), ray.put(codebook)
    prepared = [prepare.remote(f, spec_ref, cb_ref) for f in frags]
    checked = check_ads.remote(*[p[0] for p in prepared])  # every fragment's error ranked, ids across them
    written_globals = write_globals.remote(checked, *[p[0] for p in prepared])
    counted = _gathered(ray, [p[2] for p in prepared], "prepare fragments", progress)
    if any(isinstance(c, _Failed) for c in counted):
        error = ray.get(checked)
        assert isinstance(error, str)
        raise InputError(error)
    clock.lap("prepare fragments")
    held = np.sum([c.first_tokens for c in counted], axis=0)
    bounds = shard_bounds(held, shards or default_shards(int(held.sum()), level_sizes[0]))
    cuts, first = part_bounds(held, bounds, 4 * int(ray.cluster_resources().get("CPU", 1)))
    q = len(cuts) - 1
    splits = [split.options(num_returns=q).remote(p[1], cuts) for p in prepared]
    splits = [s if q > 1 else [s] for s in splits]
    del prepared
    parts = [build.remote(*[s[i] for s in splits]) for i in range(q)]
    del splits
    shard_tasks = [write_shard.remote(k, int(lo), int(hi), checked, *[parts[i][0] for i in range(a, b)])
                   for k, (lo, hi, a, b) in enumerate(zip(bounds[:-1], bounds[1:], first[:-1], first[1:]))]
    try:
        return _finish(ray, checked, written_globals, shard_tasks, parts, counted, frags, q, codebook, thresholds,
                       clock, progress)
    except Exception:
        # the staging directory is removed on the way out: not while a task may still write into it (an
        # interrupt does not wait; what a task writes after it is removed with the next publish's temporaries)
        with contextlib.suppress(Exception):
            ray.wait([written_globals, *shard_tasks], num_returns=1 + len(shard_tasks))
        raise


def _finish(ray: ModuleType, checked: Any, written_globals: Any, shard_tasks: list, parts: list, counted: list,
            frags: list[Fragment], q: int, codebook: Codebook, thresholds: QualityThresholds | None,
            clock: StageClock, progress: Callable[[str, int, int], None]) -> RayBuilt:
    """`_run` once every task that writes is submitted: their results gathered and merged."""
    if (error := ray.get(checked)) is not None:  # repeated ad ids: every fragment had to be read to see them
        # the shard tasks write nothing (they are given the error), so nothing is cancelled: Ray 2's
        # cancel of a task whose arguments are being resolved can abort the driver
        raise InputError(error)
    globals_out = ray.get(written_globals)  # the globals are written while the shards are
    assert globals_out is not None  # (the catalog passed)
    written, timed = _gathered(ray, shard_tasks, "write shards", progress), ray.get([p[1] for p in parts])
    clock.lap("shuffle + write shards")
    global_arrays, listed, (globals_peak, globals_seconds) = globals_out
    for w in written:
        listed |= w.listed
    per_ad = functools.reduce(histogram.merged, [c.per_ad for c in counted])
    sums = functools.reduce(QualitySums.merge, [c.sums for c in counted])
    report = quality_report(functools.reduce(SidSums.merge, [w.sids for w in written]), per_ad, sums, codebook,
                            thresholds)
    stats = functools.reduce(StatsSums.merge, [w.stats for w in written]).stats(per_ad)
    shape = {"fragments": len(frags), "shards": len(written), "parts": q,
             "shuffle_bytes": int(sum(c.nbytes for c in counted)), "part_sid_rows": [t[0] for t in timed],
             "part_seconds": [round(t[1], 3) for t in timed], "shard_sid_rows": [w.entry.arrays["leaf_ads"].rows
                                                                                  for w in written],
             "shard_peak_bytes": [w.peak_bytes for w in written],
             "shard_seconds": [round(w.seconds, 3) for w in written], "globals_peak_bytes": globals_peak,
             "globals_seconds": round(globals_seconds, 3)}
    clock.lap("quality + stats")
    return RayBuilt(tuple(w.entry for w in written), global_arrays, listed, stats, report, clock.seconds, shape)


def _gathered(ray: ModuleType, refs: list, stage: str, progress: Callable[[str, int, int], None]) -> list:
    """ray.get(refs), saying progress(stage, done, len(refs)) as they finish."""
    pending, done = list(refs), 0
    progress(stage, 0, len(refs))
    while pending:
        ready, pending = ray.wait(pending, num_returns=1)
        done += len(ready)
        progress(stage, done, len(refs))
    return ray.get(refs)


def check_on_ray(directory: Path) -> None:
    """Check the snapshot `directory` as `open_snapshot(directory, verify=True)` does, a task per
    part (`sidindex.snapshot.snapshot.check_part`), on the Ray of `ray_cluster`: this process maps
    none of its arrays."""
    import ray

    from sidindex.snapshot import Manifest

    directory = directory.resolve()  # what every task reads, wherever it runs (a worker's own cwd is not ours)

    @ray.remote
    def check(part: int | None) -> str | None:
        try:
            _reachable(directory)
            snapshot.check_part(directory, part)
        except SidIndexError as e:
            return str(e)
        return None

    shards = len(Manifest.read(directory).shard_list())
    errors = [e for e in ray.get([check.remote(part) for part in [None, *range(shards)]]) if e is not None]
    if errors:
        raise ArtifactError(errors[0])


def _reset_peak() -> int:
    """Start this process's peak resident memory anew at what it holds now, which is returned
    (Linux; elsewhere 0, and the peak stays the process's): a worker reused across tasks keeps what
    its earlier tasks left, so a task's own memory is its peak above that."""
    with contextlib.suppress(OSError, ValueError, IndexError, KeyError):
        Path("/proc/self/clear_refs").write_text("5")
        return _status_bytes("VmRSS:")
    return 0


def _peak_bytes() -> int:
    """This process's peak resident memory since `_reset_peak` (object store pages it read included)."""
    with contextlib.suppress(OSError, ValueError, IndexError, KeyError):
        return _status_bytes("VmHWM:")
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _status_bytes(key: str) -> int:
    """A memory figure of /proc/self/status (KeyError when it has none)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key):
            return int(line.split()[1]) * 1024
    raise KeyError(key)


def _reachable(directory: Path) -> None:
    """Refuse a task that does not see the snapshot's directory (a node that does not mount the ROOT)."""
    if not directory.is_dir():
        raise EngineError(f"{directory}: not found on a node of the Ray cluster; the ray engine's tasks write and "
                          "check the snapshot in the ROOT, which every node must mount at the same path")


@dataclass(frozen=True)
class _Failed:
    """A fragment's validation error, with the fragment's ad ids when they passed their checks."""

    message: str
    rank: tuple[int, int, int]
    ad_id: Any  # pyarrow.ChunkedArray, or None


def _first_error(ads: list, path: Path) -> str | None:
    """The error a validation of the whole file would raise, None when there is none: the ad_id
    column's checks, then ad ids repeated anywhere in the file, then every other check, each ranked
    (column, check, row)."""
    failed = [a for a in ads if isinstance(a, _Failed)]
    first = min(failed, key=lambda f: f.rank, default=None)
    if first is None or first.rank[0] > 0:  # every fragment's ad ids passed their checks: repeats come next
        ids = [f.ad_id.to_numpy() if isinstance(f, _Failed) else f.column("ad_id").to_numpy() for f in ads]
        try:
            check_unique_ad_ids(np.concatenate(ids).astype(np.int64), str(path))
        except InputError as e:
            return str(e)
    return None if first is None else first.message


def _cause(e: Exception) -> str:
    """The last line of a Ray error (its cause; the lines before are a traceback)."""
    lines = [ln.strip() for ln in str(e).splitlines() if ln.strip()]
    return lines[-1] if lines else type(e).__name__
