"""The build on Ray (`sidindex build --engine ray`, docs/design.md §14): `sidindex.stages` as Ray tasks.

  fragments  the catalog's Parquet row groups; each task reads its own (and knows their file rows,
             which error messages name; Ray Data's reader does not give them)
  prepare    one task per fragment: validate, SIDs (the frozen codebook is put in the object store
             once), matcher rows, exact index; returns its ads table and its SID rows
  shuffle    the driver sums the fragments' first-token counts into shard bounds, and those into
             parts (about 4 per CPU, none across a shard's bound); one task per fragment splits
             its SID rows into a table per part (num_returns = parts)
  build      one task per part builds its subtrie from every fragment's table for it; one task per
             shard of several parts combines them into the shard (`trie.partition.combine`: the
             arrays one part would give)
  finish     the driver joins the ads tables (`stages.finish_ads`); the job writes and publishes
             the shards and the ads as for the local engine

Errors: a fragment's bad row fails the build with the local engine's message (the first error a
whole-file validation meets, ranked by `InputError.rank`; ad ids are checked for repeats across
fragments once every fragment is read), a corrupt row group with the parse error naming it; a task
that dies (its worker killed) or a cluster that cannot be reached raises `EngineError`. Nothing is
published on failure. A local Ray started for a build ends with it, even when its driver is killed.
Ray is an optional extra.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

import numpy as np

from schemas.artifacts import MATCHER_PLANES
from sidindex.artifact import regular_input
from sidindex.errors import EngineError, InputError
from sidindex.ingest import check_unique_ad_ids
from sidindex.matchers.exact import ExactIndex
from sidindex.sid import Codebook
from sidindex.sid.quality import QualitySums
from sidindex.targeting import TargetingSpec
from sidindex.timing import StageClock
from sidindex.trie.kway import KWayConfig
from sidindex.trie.partition import Subtrie, combine, default_workers
from sidindex.trie.shard import Shard, default_shards, part_bounds, shard_bounds, shard_of


@dataclass(frozen=True)
class Fragment:
    """Row group `group` of the Parquet file; its first row is file row `first_row`."""

    group: int
    first_row: int


@dataclass(frozen=True)
class RayBuilt:
    """What the Ray engine hands the job: the local engine's arrays and the SID report's inputs.

    ad_id: (N,) int64; sums: the embeddings' quality sums; shape: fragments, shards, shuffle bytes,
    and each shard's SID rows and build seconds
    """

    shards: tuple[Shard, ...]
    exact: ExactIndex
    ad_id: np.ndarray
    sums: QualitySums
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


def build_on_ray(path: Path, spec: TargetingSpec, codebook: Codebook, *, kway: KWayConfig | None,
                 address: str | None = None, workers: int | None = None, retries: int = 0,
                 shards: int | None = None) -> RayBuilt:
    """Build the catalog at `path` on Ray: a local Ray on `workers` CPUs (default: every core)
    started for this build, or the cluster at `address` ("auto": the one this host belongs to).
    When this process already runs Ray, the build uses it (and neither argument). A task is
    retried `retries` times when its worker dies. shards: as `sidindex.trie.shard.build_shards`."""
    try:
        import ray
    except ImportError:
        raise EngineError("the ray engine needs Ray, an optional extra: pip install 'sidindex[ray]'") from None
    clock = StageClock()
    frags = fragments(path)
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
        clock.lap("start ray")
        return _run(ray, path, spec, codebook, kway, frags, retries, shards, clock)
    except ray.exceptions.RayError as e:
        raise EngineError(f"the ray build failed, nothing published: {_cause(e)}") from None
    finally:
        if started:
            ray.shutdown()


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


def _run(ray: ModuleType, path: Path, spec: TargetingSpec, codebook: Codebook, kway: KWayConfig | None,
         frags: list[Fragment], retries: int, shards: int | None, clock: StageClock) -> RayBuilt:
    from sidindex import stages

    level_sizes = codebook.level_sizes
    planes = MATCHER_PLANES
    bits = sum(layout.bits for layout in spec.layouts)

    source = path.resolve()  # what every task reads, wherever it runs; messages name `path`

    @ray.remote(num_returns=3, max_retries=retries)
    def prepare(f: Fragment, spec: TargetingSpec, codebook: Codebook) -> tuple[Any, Any, tuple[np.ndarray, int] | None]:
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
            return _Failed(f"{path}: row group {f.group} (from file row {f.first_row}) cannot be read as Parquet: "
                           f"{' '.join(str(e).split()).rstrip('.')}; the file is corrupt: write it again", (-1, -1, -1),
                           None), None, None
        try:
            ads, sid_rows = stages.prepare_fragment(table, f.first_row, str(path), spec, codebook)
        except InputError as e:  # reported by the driver, which ranks every fragment's error
            rank = e.rank
            return _Failed(str(e), rank, table.column("ad_id") if rank[0] > 0 else None), None, None
        return ads, sid_rows, (stages.first_tokens(sid_rows, level_sizes[0]), sid_rows.nbytes)

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
    def join(lo: int, hi: int, *subs: Subtrie) -> Shard:
        """The shard [lo, hi) of its parts' subtries, in token order (over catalog rows; values set by the driver)."""
        return shard_of(subs[0], lo, hi, None) if len(subs) == 1 else Shard(lo, hi, combine(subs, level_sizes))

    spec_ref, cb_ref = ray.put(spec), ray.put(codebook)
    prepared = [prepare.remote(f, spec_ref, cb_ref) for f in frags]
    ads = ray.get([p[0] for p in prepared])
    _raise_first_error(ads, path)
    clock.lap("prepare fragments")
    counted = ray.get([p[2] for p in prepared])
    held = np.sum([c for c, _ in counted], axis=0)
    bounds = shard_bounds(held, shards or default_shards(int(held.sum()), level_sizes[0]))
    cuts, first = part_bounds(held, bounds, 4 * int(ray.cluster_resources().get("CPU", 1)))
    q = len(cuts) - 1
    splits = [split.options(num_returns=q).remote(p[1], cuts) for p in prepared]
    splits = [s if q > 1 else [s] for s in splits]
    del prepared
    parts = [build.remote(*[s[i] for s in splits]) for i in range(q)]
    joined = [join.remote(int(lo), int(hi), *[parts[i][0] for i in range(a, b)])
              for lo, hi, a, b in zip(bounds[:-1], bounds[1:], first[:-1], first[1:])]
    built, timed = ray.get(joined), ray.get([p[1] for p in parts])
    shape = {"fragments": len(frags), "shards": len(built), "parts": q,
             "shuffle_bytes": int(sum(b for _, b in counted)), "part_sid_rows": [t[0] for t in timed],
             "part_seconds": [round(t[1], 3) for t in timed]}
    clock.lap("shuffle + shards")
    ad_id, value, exact, sums = stages.finish_ads(ads, spec)
    del ads
    out = tuple(dataclasses.replace(b, gtm=dataclasses.replace(b.gtm, ad_value=value)) for b in built)
    del splits, parts, joined, built
    clock.lap("finish")
    return RayBuilt(out, exact, ad_id, sums, clock.seconds, shape)


@dataclass(frozen=True)
class _Failed:
    """A fragment's validation error, with the fragment's ad ids when they passed their checks."""

    message: str
    rank: tuple[int, int, int]
    ad_id: Any  # pyarrow.ChunkedArray, or None


def _raise_first_error(ads: list, path: Path) -> None:
    """Raise the error a validation of the whole file would: the ad_id column's checks, then ad
    ids repeated anywhere in the file, then every other check, each ranked (column, check, row)."""
    failed = [a for a in ads if isinstance(a, _Failed)]
    first = min(failed, key=lambda f: f.rank, default=None)
    if first is None or first.rank[0] > 0:  # every fragment's ad ids passed their checks: repeats come next
        ids = [f.ad_id.to_numpy() if isinstance(f, _Failed) else f.column("ad_id").to_numpy() for f in ads]
        check_unique_ad_ids(np.concatenate(ids).astype(np.int64), str(path))
    if first is not None:
        raise InputError(first.message)


def _cause(e: Exception) -> str:
    """The last line of a Ray error (its cause; the lines before are a traceback)."""
    lines = [ln.strip() for ln in str(e).splitlines() if ln.strip()]
    return lines[-1] if lines else type(e).__name__
