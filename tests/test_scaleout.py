"""The scale-out build (docs/design.md §14): the partitioned trie build and the Ray engine publish the
local engine's snapshot, array for array; a bad row fails a Ray build with the local engine's
message, and a killed worker fails it; neither publishes anything."""

from __future__ import annotations

import contextlib
import functools
import os
import re
import shutil
import signal
import subprocess
import time
from pathlib import Path

import numba
import numpy as np
import polars as pl
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

import runtime
from schemas.artifacts import MATCHER_PLANES
from sidindex.errors import InputError
from sidindex.job import run_build
from sidindex.sample import sample_catalog
from sidindex.sid import assign_sids, save_codebook
from sidindex.sid.quality import quality_sums, sid_quality
from sidindex.snapshot import open_snapshot
from sidindex.trie.build import build_gtm
from sidindex.trie.kway import KWayConfig
from sidindex.trie.partition import build_gtm_partitioned, token_ranges
from tests.conftest import run_cli, sampled_codebook
from tests.in_process import run_main

pytestmark = pytest.mark.xdist_group("ray")  # the module's tests on one worker: one local Ray session

# the codebook is sampled from the catalog (`sampled_codebook`), so a small catalog can leave a level on
# one code: the quality gate would refuse it, and these tests compare the engines, not the codebook
CONFIG = ('[sid]\nlevels = [8, 4, 4]\nhash_size = 16\npaths = 2\nmin_points_per_centroid = 4\n'
          '[quality]\nmin_level_codes = 1\n')
KWAY = '[kway]\nmode = "dynamic"\nk_max = 3\n'


# --- the partitioned trie build against the whole one ----------------------------------------------

@st.composite
def trie_inputs(draw):
    sizes = tuple(draw(st.lists(st.integers(1, 7), min_size=1, max_size=4)))
    n = draw(st.integers(1, 40))
    paths = draw(st.integers(1, 3))
    ad_index = np.repeat(np.arange(n, dtype=np.int64), paths)
    if draw(st.booleans()):  # ads need not come in order (a caller's own SID rows)
        ad_index = np.random.default_rng(draw(st.integers(0, 99))).permutation(ad_index)
    sids = np.array([draw(st.lists(st.integers(0, s - 1), min_size=len(ad_index), max_size=len(ad_index)))
                     for s in sizes], dtype=np.int16).T.copy()
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    # few distinct words, so unions and ads' rows repeat within and across parts
    rows = {p: rng.choice(np.array([0, 1, 6, 2**63, 2**64 - 1], dtype=np.uint64), size=(n, w))
            for p, w in zip(MATCHER_PLANES, (1, 2))}
    value = rng.choice([0.0, 1.0, 2.5, 1e19], size=n) if draw(st.booleans()) else None
    kway = KWayConfig(mode=draw(st.sampled_from(["dynamic", "static"])), k=(2, 1, 3), k_max=draw(st.integers(1, 4))) \
        if draw(st.booleans()) else None
    return sids, ad_index, sizes, rows, value, kway


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(trie_inputs(), st.integers(1, 9), st.integers(1, 3))
def test_partitioned_build_is_the_whole_build(inputs, parts, workers):
    sids, ad_index, sizes, rows, value, kway = inputs
    whole = build_gtm(sids, ad_index, sizes, rows, kway=kway, ad_value=value, matcher_bits=70)
    split = build_gtm_partitioned(sids, ad_index, sizes, rows, kway=kway, ad_value=value, matcher_bits=70,
                                  parts=parts, workers=workers)
    a, b = whole.arrays(), split.arrays()
    assert a.keys() == b.keys()
    for name in a:
        assert a[name].dtype == b[name].dtype, name
        np.testing.assert_array_equal(a[name], b[name], err_msg=name)


def test_token_ranges_balance_rows_and_skip_empty_ranges():
    held = np.array([0, 0, 5, 0, 1, 1, 0, 9, 0])
    bounds = token_ranges(held, 3)
    assert bounds[-1] == len(held) and np.all(np.diff(bounds) > 0)
    per_range = np.add.reduceat(held, bounds[:-1])
    assert np.all(per_range > 0) and per_range.sum() == held.sum()
    np.testing.assert_array_equal(token_ranges(held, 1), [0, 9])
    assert len(token_ranges(held, 50)) - 1 == 4  # at most one range per token holding rows


def test_quality_sums_merge_over_fragments(spec):
    """The SID report from fragments' sums is the whole catalog's (Chan's merge of moments)."""
    cat = pl.from_arrow(sample_catalog(500, spec, dim=16, seed=4))
    cb = sampled_codebook(cat)
    emb = cat["embedding"].to_numpy().astype(np.float32) * 3 + 100  # far from zero: the merge must not cancel
    tokens = np.zeros(len(emb), dtype=np.int16)
    whole = quality_sums(assign_sids(cb, emb, tokens), cb, emb)
    merged = None
    for lo, hi in ((0, 1), (1, 170), (170, 171), (171, 500)):
        part = quality_sums(assign_sids(cb, emb[lo:hi], tokens[lo:hi]), cb, emb[lo:hi])
        merged = part if merged is None else merged.merge(part)
    assert merged.n_ads == whole.n_ads and merged.near_second == whole.near_second
    np.testing.assert_allclose(merged.sq_error, whole.sq_error, rtol=1e-9)
    np.testing.assert_allclose(merged.mean, whole.mean, rtol=1e-12)
    np.testing.assert_allclose(merged.spread, whole.spread, rtol=1e-9)
    report = sid_quality(assign_sids(cb, emb, tokens), cb, emb)
    assert report.n_ads == 500 and report.n_sid_rows == 1000
    np.testing.assert_allclose(report.mse, whole.sq_error / 500)
    assert report.relative_mse == pytest.approx(report.mse[-1] / (whole.spread / 500))


def test_scores_are_summed_in_one_order():
    """The assignment's GEMM gives every row the same bits whatever rows share its block and
    however many threads run it (BLAS does not: it moved near-tied ads between engines)."""
    from sidindex.sid.assign import _products

    rng = np.random.default_rng(1)
    x = rng.standard_normal((3000, 33)).astype(np.float32)
    w = rng.standard_normal((33, 700)).astype(np.float32)
    bias = rng.standard_normal(700).astype(np.float32)

    def products(rows: np.ndarray, threads: int) -> tuple[np.ndarray, np.ndarray]:
        out, sq = np.empty((len(rows), 700), np.float32), np.empty(len(rows), np.float32)
        before = numba.get_num_threads()
        numba.set_num_threads(threads)
        try:
            _products(rows, w, bias, out, sq)
        finally:
            numba.set_num_threads(before)
        return out, sq

    whole, sq = products(x, numba.config.NUMBA_NUM_THREADS)
    np.testing.assert_allclose(whole, x @ w + bias, rtol=1e-4, atol=1e-4)
    for lo, hi, threads in ((0, 1, 1), (7, 2900, 1), (1, 3000, numba.config.NUMBA_NUM_THREADS), (5, 13, 1)):
        part, part_sq = products(np.ascontiguousarray(x[lo:hi]), threads)
        assert np.array_equal(part, whole[lo:hi]) and np.array_equal(part_sq, sq[lo:hi])


def test_sids_do_not_depend_on_fragments_or_threads(spec):
    """An ad's SIDs and first-level ratio are the same assigned whole or in any fragments: every
    score is summed in one order (BLAS sums by block size and thread count, and moved near-tied
    ads between the engines)."""
    cat = pl.from_arrow(sample_catalog(400, spec, dim=16, seed=8))
    cb = sampled_codebook(cat)
    rng = np.random.default_rng(3)
    emb = (rng.standard_normal((70_000, 16)) * 0.5).astype(np.float32)
    tokens = rng.integers(0, 16, len(emb)).astype(np.int16)
    whole = assign_sids(cb, emb, tokens)
    cuts = [0, 1, 9, 33_000, 33_001, 70_000]
    parts = [assign_sids(cb, emb[lo:hi], tokens[lo:hi]) for lo, hi in zip(cuts[:-1], cuts[1:])]
    np.testing.assert_array_equal(np.concatenate([p.sids for p in parts]), whole.sids)
    np.testing.assert_array_equal(np.concatenate([p.first_ratio for p in parts]), whole.first_ratio)


# --- the Ray engine against the local one -----------------------------------------------------------

@pytest.fixture(scope="module")
def ray_session():
    """One local Ray (2 CPUs) for the module; a build started inside it uses it."""
    ray = pytest.importorskip("ray")
    os.environ.setdefault("RAY_ACCEL_ENV_VAR_OVERRIDE_ON_ZERO", "0")
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, configure_logging=False)
    yield
    ray.shutdown()


def _job(tmp: Path, table: pa.Table, spec_path: Path, kway: bool, row_group: int) -> dict:
    """Catalog (Parquet, `row_group` rows per group: the Ray engine's fragments), config and a
    frozen codebook sampled from the catalog, for two ROOTs."""
    tmp.mkdir(parents=True, exist_ok=True)
    pq.write_table(table, tmp / "catalog.parquet", row_group_size=row_group)
    (tmp / "build.toml").write_text(CONFIG + (KWAY if kway else ""))
    save_codebook(sampled_codebook(pl.from_arrow(table)), tmp / "cb")
    return {"catalog": tmp / "catalog.parquet", "targeting": spec_path, "config": tmp / "build.toml",
            "codebook": tmp / "cb"}


def _build(job: dict, root: Path, engine: str, **kw) -> dict:
    return run_build(job["catalog"], job["targeting"], root, config=job["config"], codebook=job["codebook"],
                     engine=engine, **kw)


def _same_snapshot(a: Path, b: Path) -> None:
    sa, sb = open_snapshot(a), open_snapshot(b)
    assert sa.manifest.files == sb.manifest.files  # every shard's files and the global ones, byte for byte
    assert sa.manifest.shards == sb.manifest.shards
    x, y = sa.arrays(), sb.arrays()
    assert x.keys() == y.keys()
    for name in x:
        assert x[name].dtype == y[name].dtype, name
        np.testing.assert_array_equal(x[name], y[name], err_msg=name)
    assert sa.manifest.stats == sb.manifest.stats
    qa, qb = sa.manifest.quality, sb.manifest.quality
    for key in qa:  # the embedding sums add up per fragment: float64 rounding only
        if key in ("mse", "relative_mse"):
            np.testing.assert_allclose(qa[key], qb[key], rtol=1e-9)
        else:
            assert qa[key] == qb[key], key


@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                 HealthCheck.function_scoped_fixture])
@given(n=st.integers(30, 400), seed=st.integers(0, 2**16), kway=st.booleans(), value=st.booleans(),
       row_group=st.integers(7, 150), shards=st.sampled_from([None, 1, 3, 8]))
@example(n=393, seed=35, kway=False, value=False, row_group=7, shards=None)  # a level on one code
def test_ray_engine_publishes_the_local_engines_snapshot(ray_session, spec, write_catalog, tmp_path_factory, n,
                                                         seed, kway, value, row_group, shards):
    _, spec_path = write_catalog(pl.DataFrame({"x": [0]}))
    table = sample_catalog(n, spec, dim=16, seed=seed)
    if not value:
        table = table.drop_columns(["value"])
    tmp = tmp_path_factory.mktemp("engines")
    job = _job(tmp, table, spec_path, kway, row_group)
    assert _build(job, tmp / "local", "local", shards=shards, workers=2)["status"] == "published"
    report = _build(job, tmp / "ray", "ray", shards=shards)
    assert report["status"] == "published" and report["engine"] == "ray"
    assert report["shards"] == report["ray"]["shards"] <= (shards or 1)
    _same_snapshot(tmp / "local", tmp / "ray")
    assert _build(job, tmp / "ray", "ray", shards=shards)["status"] == "unchanged"  # same inputs: nothing new


def test_ray_engine_says_its_progress(ray_session, spec, write_catalog, tmp_path):
    """Fragments prepared and shards written are counted up to their totals, once each."""
    _, spec_path = write_catalog(pl.DataFrame({"x": [0]}))
    job = _job(tmp_path, sample_catalog(90, spec, dim=16, seed=3), spec_path, False, 20)
    seen: list[tuple[str, int, int]] = []
    _build(job, tmp_path / "root", "ray", shards=3, progress=lambda *a: seen.append(a))
    for stage, total in (("prepare fragments", 5), ("write shards", 3)):
        assert [d for s, d, t in seen if s == stage and t == total] == list(range(total + 1)), seen


def test_ray_engine_retrieves_what_the_local_engine_does(ray_session, sample_dir, tmp_path):
    table = pq.read_table(sample_dir / "catalog.parquet")
    job = _job(tmp_path, table, sample_dir / "targeting.toml", True, 100)
    _build(job, tmp_path / "local", "local")
    _build(job, tmp_path / "ray", "ray")
    out = []
    for root in (tmp_path / "local", tmp_path / "ray"):
        index = runtime.load(root, "cpu", verify=False)
        reqs = runtime.read_requests(sample_dir / "requests.parquet", index)
        out.append([runtime.retrieve(index, reqs, mode=m, beams=(1, 16, 64, 128)).table(reqs.request_id)
                    for m in ("cd", "cd+gtm", "cd+gtm+kway")])
    for a, b in zip(*out):
        assert a.num_rows > 0 and a.equals(b)


def _bad(table: pa.Table, edits: list[tuple[int, str, object]]) -> pa.Table:
    df = pl.from_arrow(table)
    df = df.with_columns(pl.col("embedding").cast(pl.List(pl.Float32)))  # rows of any length
    for row, column, value in edits:
        df = df.with_columns(pl.when(pl.int_range(pl.len()) == row).then(pl.lit(value, dtype=df.schema[column]))
                             .otherwise(pl.col(column)).alias(column))
    return df.to_arrow()


BAD = {  # fragments of 20 rows: each case puts errors in different fragments
    "an id repeated across fragments": lambda t: _bad(t, [(75, "ad_id", t["ad_id"][12].as_py())]),
    "an earlier column's error in a later fragment": lambda t: _bad(t, [(21, "country", ["XX"]),
                                                                        (90, "embedding", [float("nan")] * 16)]),
    "an earlier check of one column in a later fragment": lambda t: _bad(t, [(5, "country", ["XX"]),
                                                                             (64, "country", ["US", None])]),
    "the lowest row of one check": lambda t: _bad(t, [(99, "value", -1.0), (41, "value", float("inf"))]),
    "an id repeated after another column's error": lambda t: _bad(t, [(3, "age", ["9-10"]),
                                                                      (30, "ad_id", t["ad_id"][90].as_py())]),
    "a null id": lambda t: _bad(t, [(50, "ad_id", None), (2, "age", ["9-10"])]),
    "a missing column": lambda t: t.drop_columns(["platform"]),
    "a wrong embedding length in a later fragment": lambda t: _bad(t, [(7, "value", -2.0),
                                                                       (88, "embedding", [0.5] * 15)]),
}


@pytest.mark.parametrize("case", list(BAD))
def test_a_bad_row_fails_the_ray_build_with_the_local_message(ray_session, spec, write_catalog, tmp_path, case):
    _, spec_path = write_catalog(pl.DataFrame({"x": [0]}))
    good = sample_catalog(120, spec, dim=16, seed=2)
    job = _job(tmp_path, good, spec_path, False, 20)
    pq.write_table(BAD[case](good), job["catalog"], row_group_size=20)
    messages = []
    for engine in ("local", "ray"):
        with pytest.raises(InputError) as e:
            _build(job, tmp_path / engine, engine)
        messages.append(str(e.value))
        assert not (tmp_path / engine / "CURRENT").exists()
    assert messages[0] == messages[1]
    assert re.search(r"column '\w+'(, row \d+)?", messages[0]), messages[0]


def test_ray_engine_cli_errors_are_one_line(sample_dir, tmp_path, monkeypatch, capsys):
    """The first through the console script; the others through its entry point in this process
    (`run_main`: the same exit code and line; each is refused before a Ray starts)."""
    here = functools.partial(run_main, monkeypatch, capsys)
    args = ("build", "--catalog", sample_dir / "catalog.parquet", "--targeting", sample_dir / "targeting.toml")
    r = run_cli(*args, "--out", tmp_path / "root", "--engine", "ray")
    assert r.returncode == 2 and "holds no frozen codebook" in r.stderr and len(r.stderr.strip().splitlines()) == 1
    pl.read_parquet(sample_dir / "catalog.parquet").write_ipc(tmp_path / "catalog.arrow")
    save_codebook(sampled_codebook(pl.read_parquet(sample_dir / "catalog.parquet")), tmp_path / "root")
    r = here("build", "--catalog", tmp_path / "catalog.arrow", "--targeting", sample_dir / "targeting.toml",
             "--out", tmp_path / "root", "--engine", "ray")
    assert r.returncode == 2 and "reads Parquet catalogs" in r.stderr and len(r.stderr.strip().splitlines()) == 1
    r = here(*args, "--out", tmp_path / "root", "--engine", "spark")
    assert r.returncode == 2 and "unknown build engine 'spark'" in r.stderr
    r = here(*args, "--out", tmp_path / "root", "--ray-address", "auto")
    assert r.returncode == 2 and "applies to the ray engine only" in r.stderr
    r = here(*args, "--out", tmp_path / "root", "--engine", "ray", "--ray-address", "auto", "--workers", "2")
    assert r.returncode == 2 and "brings its own CPUs" in r.stderr
    assert not (tmp_path / "root" / "CURRENT").exists()


def _ray_tasks(name: str, pids: list[int]) -> list[int]:
    """Those of `pids` (the processes of a build the test started: never another job's) that are
    Ray workers running the task `name` (Ray titles them ray::<name>)."""
    out = []
    for pid in pids:
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if f.read().startswith(f"ray::{name}".encode()):
                    out.append(pid)
        except OSError:
            pass
    return out


@pytest.mark.parametrize("task", ["prepare", "write_shard"])  # the globals' task is too short to be caught surely
def test_a_killed_worker_fails_the_build_and_publishes_nothing(spec, write_catalog, tmp_path, task):
    """SIGKILL a worker of the build while it prepares a fragment, or while it writes a shard into the
    snapshot's staging directory (the other writers still running): the console script exits 2 with
    one line, and nothing is left."""
    _, spec_path = write_catalog(pl.DataFrame({"x": [0]}))
    job = _job(tmp_path, sample_catalog(200_000, spec, dim=16, seed=5), spec_path, False, 100_000)
    for _ in range(3):  # a task that ran between two looks at a loaded machine's processes: build again
        shutil.rmtree(tmp_path / "root", ignore_errors=True)
        build = subprocess.Popen([shutil.which("sidindex"), "build", "--catalog", job["catalog"], "--targeting",
                                  job["targeting"], "--config", job["config"], "--codebook", job["codebook"], "--out",
                                  tmp_path / "root", "--engine", "ray", "--workers", "2"],
                                 stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
        killed, deadline, pids, listed = [], time.monotonic() + 240, [], 0.0
        while not killed and build.poll() is None and time.monotonic() < deadline:
            # the build's session (its own workers only), listed by a walk of /proc now and then: between
            # walks, only the workers' titles are read, so a short task is not missed on a loaded machine
            if time.monotonic() - listed > 0.05:
                pids, listed = list(_in_session(build.pid)), time.monotonic()
            for pid in _ray_tasks(task, pids):
                os.kill(pid, signal.SIGKILL)
                killed.append(pid)
            time.sleep(0.001)
        _, err = build.communicate(timeout=300)
        if killed:
            break
        assert build.returncode == 0, err  # missed, not failed: the build that was not disturbed published
    assert killed, f"no worker was seen running {task} in three builds"
    assert build.returncode == 2, err
    assert err.startswith("error: the ray build failed, nothing published") and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "root" / "CURRENT").exists()
    snapshots = tmp_path / "root" / "snapshots"
    assert not snapshots.exists() or not list(snapshots.iterdir())  # no staging directory left either


def _corrupt_row_group(path: Path, group: int, how: str) -> None:
    """Damage row group `group` of the Parquet file at `path` in place, its footer left whole."""
    meta = pq.ParquetFile(path).metadata.row_group(group)
    chunks = {meta.column(i).path_in_schema: meta.column(i) for i in range(meta.num_columns)}
    data = bytearray(path.read_bytes())
    if how == "a page that does not decompress":
        c = chunks["embedding.list.element"]
        data[c.data_page_offset + 8:c.data_page_offset + c.total_compressed_size] = bytes(c.total_compressed_size - 8)
    else:  # a string that is not UTF-8: the file is written uncompressed, plain, so a value's bytes are found
        c = chunks["country.list.element"]
        chunk = bytes(data[c.data_page_offset:c.data_page_offset + c.total_compressed_size])
        value = re.search(rb"\x02\x00\x00\x00[A-Z]{2}", chunk)  # a length-prefixed 2-letter code
        data[c.data_page_offset + value.start() + 4] = 0xFF
    path.write_bytes(data)


@pytest.mark.parametrize("how", ["a page that does not decompress", "a string that is not UTF-8"])
def test_a_corrupt_row_group_fails_the_ray_build_with_the_parse_error(ray_session, spec, write_catalog, tmp_path,
                                                                      how):
    """Never a worker's panic or death in its place, however the tasks race: the same line each time."""
    _, spec_path = write_catalog(pl.DataFrame({"x": [0]}))
    good = sample_catalog(120, spec, dim=16, seed=2)
    job = _job(tmp_path, good, spec_path, False, 20)
    plain = {"compression": "none", "use_dictionary": False} if "UTF-8" in how else {}
    pq.write_table(good, job["catalog"], row_group_size=20, **plain)
    _corrupt_row_group(job["catalog"], 2, how)
    with pytest.raises(InputError):
        _build(job, tmp_path / "local", "local")
    messages = set()
    for _ in range(3):
        with pytest.raises(InputError) as e:
            _build(job, tmp_path / "ray", "ray")
        messages.add(str(e.value))
    assert len(messages) == 1, messages
    message = messages.pop()
    assert message.startswith(f"{job['catalog']}: row group 2 (from file row 40) cannot be read as Parquet: ")
    assert "\n" not in message and not (tmp_path / "ray" / "CURRENT").exists()


def _in_session(session: int) -> dict[int, int]:
    """{pid: parent pid} of the live processes of session `session` (a process the test started, and
    what it started)."""
    out = {}
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/stat") as f:
                state, ppid, _, sid = f.read().rsplit(")", 1)[1].split()[:4]
        except OSError:
            continue
        if int(sid) == session and state != "Z":
            out[int(pid)] = int(ppid)
    return out


def test_a_killed_build_driver_leaves_no_ray_process(sample_dir, tmp_path):
    """SIGKILL the driver of a local Ray once Ray runs: every process of its session ends soon after."""
    catalog = pl.read_parquet(sample_dir / "catalog.parquet")
    save_codebook(sampled_codebook(catalog), tmp_path / "cb")
    driver = subprocess.Popen([shutil.which("sidindex"), "build", "--catalog", sample_dir / "catalog.parquet",
                               "--targeting", sample_dir / "targeting.toml", "--codebook", tmp_path / "cb",
                               "--out", tmp_path / "root", "--engine", "ray", "--workers", "1"],
                              start_new_session=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 120
        # Ray runs once the raylet has started its own (agents, workers): the driver's grandchildren
        while (sum(ppid != driver.pid for pid, ppid in _in_session(driver.pid).items() if pid != driver.pid) < 2
               and driver.poll() is None and time.monotonic() < deadline):
            time.sleep(0.05)
        assert driver.poll() is None, "the build ended before Ray was seen running"
        driver.kill()
        driver.wait()
        deadline = time.monotonic() + 45
        while _in_session(driver.pid) and time.monotonic() < deadline:
            time.sleep(0.5)
        left = _in_session(driver.pid)
        assert not left, [Path(f"/proc/{pid}/cmdline").read_bytes()[:120] for pid in left]
    finally:
        for pid in _in_session(driver.pid):  # only the processes this test started
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)
