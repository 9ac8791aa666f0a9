"""A value fuzzer for snapshots: array *values* chosen to break arithmetic (int extremes, wrap-around
pairs, -1, 2**31, off-by-one lengths, NaN, inf and huge shapes), written as valid Arrow files with every
checksum recomputed and the manifest sealed again, so each mutation reaches the structure checks
and, past them, the loader, retrieval and explanations.

Oracle. For the arrays that hold structure (offsets, row indexes, tokens, child ids, SID -> ad
rows, shapes, the codebook) the only allowed outcomes are a clear refusal (`SidIndexError`) or
results identical to the untouched snapshot's. The arrays that hold data (matcher bits, exact rows
and hashes, ad ids and values) may take any value a build could write, so a change there may change results:
then retrieval must still run and return only ads that the mutated snapshot's own exact index
calls eligible. Never a crash (the test process would die), a hang or another exception type.
"""

from __future__ import annotations

import itertools
import json
import shutil
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import runtime
from schemas.artifacts import AD_DELETED, ARRAYS_BY_NAME, MANIFEST_FILE, UNLISTED, shard_dir
from sidindex.artifact import list_files, seal
from sidindex.errors import SidIndexError
from sidindex.exact import eligible_pairs
from sidindex.explain import Explainer
from sidindex.request_encoding import encode_requests
from sidindex.snapshot import Manifest, open_snapshot
from sidindex.snapshot.arrays import write_array
from sidindex.snapshot.snapshot import check_part
from tests.conftest import run_cli
from tests.test_snapshot import array_file, listed_arrays, reseal

SHARDS = 2  # every file of every shard is fuzzed

CONFIG = ('[sid]\nlevels = [8, 4, 4]\nhash_size = 16\npaths = 2\nmin_points_per_centroid = 4\n'
          '[kway]\nmode = "dynamic"\nk_max = 4\n')
MODES = ("cd", "cd+gtm", "cd+gtm+kway")
BEAMS = (1, 8, 64, 384)  # wider than every depth of the catalog: every eligible ad of every mode
# (entry_value is structure here: an open refuses a SID bound below one of its ads' values only through
# the k-way partitions, whose first must equal it; without k-way only the cover check would)
DATA = {"bitmask_table", "bloom_table", "exact_bitmask_rows", "exact_bloom_hashes", "ads", "ad_value", "ad_state"}
ARRAYS = ARRAYS_BY_NAME
EXTREMES = {
    "|u1": (0, 1, 2, 3, 255),
    "<i2": (-1, -(2**15), 2**15 - 1, 2**14),
    "<i4": (-1, -(2**31), 2**31 - 1, 2**30, 10**6),
    "<i8": (-1, -(2**63), 2**63 - 1, 2**31, 2**32, -(2**31), 10**12),
    "<u8": (0, 2**64 - 1, 2**63, 1),
    "<f4": (float("nan"), float("inf"), -1.0, 0.0, 3e38),
    "<f8": (float("nan"), -float("inf"), -1e-300, 0.0, 1e300),
}
WRAP_PAIRS = {"<i8": ((2**63 - 1, -2), (-2, 2**63 - 1), (2**62, -(2**62))), "<i4": ((2**31 - 1, -2), (-2, 2**31 - 1)),
              "<i2": ((2**15 - 1, -2),)}


@pytest.fixture(scope="module")
def fuzz_root(tmp_path_factory, sample_dir):
    """A small published snapshot (k-way on, SHARDS shards) with an update applied (so every array of
    the format is there: ad states, deleted rows, inserted SIDs), its requests, and the results every
    mutation is held to."""
    import polars as pl

    base = tmp_path_factory.mktemp("fuzz")
    cat = pl.read_parquet(sample_dir / "catalog.parquet")
    cat.head(160).write_parquet(base / "catalog.parquet")
    pl.read_parquet(sample_dir / "requests.parquet").head(6).write_parquet(base / "requests.parquet")
    (base / "build.toml").write_text(CONFIG)
    r = run_cli("build", "--catalog", base / "catalog.parquet", "--targeting", sample_dir / "targeting.toml",
                "--out", base / "root", "--config", base / "build.toml", "--shards", str(SHARDS), "--json")
    assert r.returncode == 0, r.stderr
    ids = cat["ad_id"].to_list()
    upserts = pl.concat([cat.slice(160, 3).with_columns(pl.Series("ad_id", ids[6:9])), cat.slice(163, 3)])
    pl.concat([pl.DataFrame({"ad_id": ids[:6], "op": ["pause"] * 3 + ["delete"] * 3}),
               upserts.with_columns(op=pl.lit("upsert"))], how="diagonal").write_parquet(base / "changes.parquet")
    r = run_cli("update", base / "root", "--changes", base / "changes.parquet", "--json")
    assert r.returncode == 0, r.stderr
    snap_dir = Path(json.loads(r.stdout)["path"])
    return snap_dir, base / "requests.parquet", outcome(snap_dir, base / "requests.parquet")


def outcome(snap_dir: Path, requests: Path) -> dict:
    """Open, load, retrieve in every mode and explain: the results a user would see, as plain data."""
    return served(open_snapshot(snap_dir, verify=True), requests)


def served(snap, requests: Path) -> dict:
    """`outcome` of an opened snapshot."""
    index = runtime.load_index(snap, "cpu")
    reqs = runtime.read_requests(requests, index)
    out = {}
    for mode in MODES:
        table = runtime.retrieve(index, reqs, mode=mode, beams=BEAMS).table(reqs.request_id)
        out[mode] = table.to_pydict()
        eligible = eligible_pairs(snap.exact, encode_requests(reqs, snap.spec),
                                  _rows(reqs.request_id, table["request_id"].to_numpy()),
                                  _rows(snap.ad_id, table["ad_id"].to_numpy(), None if snap.exact.ad_state is None
                                        else snap.exact.ad_state != AD_DELETED))
        assert eligible.all(), f"mode {mode} returned an ad its own exact index calls ineligible"
    ex = Explainer(snap, reqs, 0)
    sids = snap.gtm.leaf_sids(np.arange(min(3, snap.gtm.num_leaves)))
    out["explain"] = [ex.sid(tuple(int(t) for t in s)).to_dict() for s in sids]
    out["explain_ad"] = [e.to_dict() for e in ex.ad(int(snap.ad_id[0]))]
    return out


def _rows(keys: np.ndarray, ids: np.ndarray, among: np.ndarray | None = None) -> np.ndarray:
    """Row of each of `ids` in `keys`, unique among the rows `among` (bool; default all)."""
    rows = np.arange(len(keys)) if among is None else np.flatnonzero(among)
    order = rows[np.argsort(keys[rows])]
    return order[np.searchsorted(keys[order], ids)]


_ORIGINAL: dict[tuple[Path, str, int], np.ndarray] = {}


def current(snap_dir: Path, name: str, shard: int = 0) -> np.ndarray:
    """A writable copy of array `name` (of shard `shard`, for a shard's) of the untouched snapshot
    (each case starts from it)."""
    if (snap_dir, name, shard) not in _ORIGINAL:
        snap = open_snapshot(snap_dir, verify=False)
        arrays = snap.arrays() if ARRAYS[name].scope == "global" else snap.shards[shard].gtm.arrays()
        _ORIGINAL[snap_dir, name, shard] = np.array(arrays[name])
    return _ORIGINAL[snap_dir, name, shard].copy()


def judge(fuzz_root, name: str, mutate, parts: bool = True) -> str:
    """Apply `mutate(snap_dir)`, run everything a user runs, restore; returns "refused" or "served".
    parts: also hold the part-by-part check (a Ray build's) to the open's verdict."""
    snap_dir, requests, reference = fuzz_root
    saved = _untouched(snap_dir)
    try:
        mutate(snap_dir)
        try:
            snap = open_snapshot(snap_dir, verify=True)
        except SidIndexError:
            snap = None
        # what a Ray build's tasks check part by part is accepted exactly when the whole open accepts it
        assert not parts or (snap is not None) == _accepted(lambda: _check_parts(snap_dir))
        if snap is None:
            return "refused"
        try:
            got = served(snap, requests)
        except SidIndexError:
            return "refused"
        if name not in DATA:
            assert got == reference, f"a mutation of {name} changed the results without being refused"
        return "served"
    finally:
        _restore(snap_dir, saved)


_UNTOUCHED: dict[Path, dict[Path, bytes]] = {}


def _untouched(snap_dir: Path) -> dict[Path, bytes]:
    """Every file of the untouched snapshot and its bytes (read once: each case leaves it so)."""
    if snap_dir not in _UNTOUCHED:
        _UNTOUCHED[snap_dir] = {p: p.read_bytes() for p in snap_dir.rglob("*") if p.is_file()}
    return _UNTOUCHED[snap_dir]


def _restore(snap_dir: Path, saved: dict[Path, bytes]) -> None:
    """Put `saved` back: files a case added removed, and those it removed or changed (by their
    bytes, compared) written again; a file a case left as it was is not written."""
    for p in [p for p in snap_dir.rglob("*") if p.is_file() and p not in saved]:
        p.unlink()
    for p, b in saved.items():
        try:
            if p.read_bytes() == b:
                continue
        except FileNotFoundError:
            p.parent.mkdir(parents=True, exist_ok=True)
        p.write_bytes(b)


def _accepted(check) -> bool:
    try:
        check()
    except SidIndexError:
        return False
    return True


def _check_parts(snap_dir: Path) -> None:
    check_part(snap_dir, None)  # the manifest first: it says how many shards there are
    for k in range(len(Manifest.read(snap_dir).shard_list())):
        check_part(snap_dir, k)


def _set(name: str, shard: int, at: tuple[int, ...], values: tuple):
    def mutate(snap_dir: Path) -> None:
        a = current(snap_dir, name, shard)
        flat = a.reshape(-1)
        for i, v in zip(at, values):
            flat[i] = np.array(v).astype(a.dtype)
        rewrite_array(snap_dir, name, a, shard=shard)
    return mutate


def rewrite_array(snap_dir: Path, name: str, array: np.ndarray, rows: int | None = None, shard: int = 0) -> None:
    """`tests.test_snapshot.rewrite_array` (the file replaced by `array`, the manifest's rows set,
    every checksum recomputed and the manifest sealed again), with only the file it wrote hashed:
    every other file is as the manifest lists it (each case starts from the untouched snapshot,
    restored byte for byte, and each of its steps reseals), so its entry is the one hashing it again
    gives. The sealed manifest is the same; hashing every file took a sixth of a case's time."""
    path = array_file(snap_dir, name, shard)
    path.unlink()
    write_array(path.parent, ARRAYS[name], array)
    m = json.loads((snap_dir / MANIFEST_FILE).read_text())
    listed_arrays(m, name, shard)[name]["rows"] = len(array) if rows is None else rows
    written = path.relative_to(snap_dir).as_posix()
    m["files"] = list_files(snap_dir, UNLISTED, {n: e for n, e in m["files"].items() if n != written}, fast=True)
    (snap_dir / MANIFEST_FILE).write_bytes(seal(m))


def _positions(n: int) -> list[int]:
    """Both ends, where offsets and bounds are checked, and the middle (each case costs a full open
    and retrieve: more interior positions would test the same checks again)."""
    return sorted({p % n for p in (0, 1, n // 2, n - 2, n - 1)}) if n else []


def _files():
    """(array name, shard) of every array file of the fuzzed snapshot: a shard's array in each shard."""
    for name, spec in ARRAYS.items():
        for k in range(SHARDS if spec.scope == "shard" else 1):
            yield name, k


def _cases(fuzz_root, files):
    """(array name, label, mutate) of every extreme value and wrap-around pair at each sampled
    position, and each wrong length, of the arrays of `files` ((name, shard) from `_files`)."""
    snap_dir = fuzz_root[0]
    for name, k in files:
        spec = ARRAYS[name]
        n = current(snap_dir, name, k).size
        for pos, v in itertools.product(_positions(n), EXTREMES[spec.dtype]):
            yield name, f"{name}@{k}[{pos}] = {v}", _set(name, k, (pos,), (v,))
        for pos, pair in itertools.product(_positions(n - 1), WRAP_PAIRS.get(spec.dtype, ())):
            yield name, f"{name}@{k}[{pos}:{pos + 2}] = {pair}", _set(name, k, (pos, pos + 1), pair)
        yield name, f"{name}@{k}: one row more", \
            lambda d, name=name, k=k: rewrite_array(d, name, _grow(current(d, name, k)), shard=k)
        yield name, f"{name}@{k}: one row less", \
            lambda d, name=name, k=k: rewrite_array(d, name, current(d, name, k)[:-1], shard=k)
        yield name, f"{name}@{k}: empty", lambda d, name=name, k=k: rewrite_array(d, name, current(d, name, k)[:0],
                                                                                  shard=k)
        for rows in (2**31, 2**40, 2**40 + 1):
            yield name, f"{name}@{k}: the manifest says {rows} rows", \
                lambda d, name=name, k=k, rows=rows: rewrite_array(d, name, current(d, name, k), rows=rows, shard=k)


def _grow(a: np.ndarray) -> np.ndarray:
    return np.concatenate([a, a[-1:]])


FUZZ_PIECES = 3  # the cases in pieces that test workers share, each piece whole files


@pytest.mark.parametrize("piece", range(FUZZ_PIECES))
def test_value_fuzzer_every_array_and_relation(fuzz_root, piece):
    files = list(_files())[piece::FUZZ_PIECES]
    outcomes = {"refused": 0, "served": 0}
    by_file: dict[str, set[str]] = {}
    for i, (name, label, mutate) in enumerate(_cases(fuzz_root, files)):
        verdict = judge(fuzz_root, name, mutate, parts=i % 3 == 0)  # a third of them, spread over every file
        outcomes[verdict] += 1
        by_file.setdefault(label.split("[")[0].split(":")[0], set()).add(verdict)
    assert sum(outcomes.values()) > 400, outcomes
    if piece == 0:  # the pieces together: over 1,500 cases (listing them mutates nothing)
        assert sum(1 for _ in _cases(fuzz_root, _files())) > 1500
    for name, k in files:  # a structure array whose every extreme value is served would check nothing
        assert "refused" in by_file[f"{name}@{k}"], (name, k)


def _codebook_level(snap_dir: Path) -> Path:
    return next(snap_dir.glob("codebooks/*/level_1.npy"))


def _poison_centroid(value: float):
    def mutate(snap_dir: Path) -> None:
        path = _codebook_level(snap_dir)
        c = np.load(path)
        c[0, 0] = value
        path.unlink()
        np.save(path, c)
        cb = path.parent / "codebook.json"
        from sidindex.artifact import list_files, seal

        m = json.loads(cb.read_text())
        m["files"] = list_files(path.parent, "codebook.json")
        cb.write_bytes(seal(m))
        reseal(snap_dir)
    return mutate


@pytest.mark.parametrize("mutate", [
    _poison_centroid(float("nan")), _poison_centroid(float("inf")), _poison_centroid(3e38), _poison_centroid(0.0),
    lambda d: reseal(d, lambda m: m.__setitem__("level_sizes", [s + 1 for s in m["level_sizes"]])),
    lambda d: reseal(d, lambda m: m.__setitem__("level_sizes", m["level_sizes"][:-1])),
    lambda d: reseal(d, lambda m: m.__setitem__("level_sizes", [2**15 + 1] * 4)),
    lambda d: reseal(d, lambda m: m.__setitem__("codebook_id", "cb-0000000000000000")),
    lambda d: reseal(d, lambda m: m.__setitem__("kway", False)),
    lambda d: reseal(d, lambda m: m["targeting"]["attribute"].pop()),
    lambda d: shutil.rmtree(next(d.glob("codebooks/*"))),
    # the shard list: a shard listed twice, one left out, ranges that overlap, leave a gap, run past the
    # vocabulary or backwards, two shards' entries swapped, a shard's array list emptied
    lambda d: reseal(d, lambda m: m.__setitem__("shards", m["shards"] + m["shards"][-1:])),
    lambda d: reseal(d, lambda m: m.__setitem__("shards", m["shards"][:-1])),
    lambda d: reseal(d, lambda m: m.__setitem__("shards", m["shards"][1:])),
    lambda d: reseal(d, lambda m: m["shards"][1]["tokens"].__setitem__(0, m["shards"][1]["tokens"][0] - 1)),
    lambda d: reseal(d, lambda m: m["shards"][1]["tokens"].__setitem__(0, m["shards"][1]["tokens"][0] + 1)),
    lambda d: reseal(d, lambda m: m["shards"][-1]["tokens"].__setitem__(1, m["shards"][-1]["tokens"][1] + 1)),
    lambda d: reseal(d, lambda m: m["shards"][0]["tokens"].reverse()),
    lambda d: reseal(d, lambda m: m["shards"][0]["tokens"].__setitem__(1, 2**70)),
    lambda d: reseal(d, lambda m: m["shards"][0]["tokens"].__setitem__(1, "1")),
    lambda d: reseal(d, lambda m: m.__setitem__("shards", m["shards"][::-1])),
    lambda d: reseal(d, lambda m: m.__setitem__("shards", [])),
    lambda d: reseal(d, lambda m: m.__setitem__("shards", {})),
    lambda d: reseal(d, lambda m: m["shards"][0].__setitem__("arrays", {})),
    lambda d: reseal(d, lambda m: m["shards"][0].__setitem__("extra", 1)),
    lambda d: reseal(d, lambda m: m["shards"][0]["arrays"].__setitem__("ads", m["arrays"]["ads"])),
    lambda d: reseal(d, lambda m: m["arrays"].__setitem__("leaf_ads", m["shards"][0]["arrays"]["leaf_ads"])),
    # the shards' files swapped (each shard's arrays are another's, sealed as they are)
    lambda d: (d.joinpath(shard_dir(0)).rename(d / "swap"), d.joinpath(shard_dir(1)).rename(d / shard_dir(0)),
               (d / "swap").rename(d / shard_dir(1)), reseal(d, lambda m: m.__setitem__("shards", [
                   {**m["shards"][0], "arrays": m["shards"][1]["arrays"]},
                   {**m["shards"][1], "arrays": m["shards"][0]["arrays"]}]))),
    lambda d: shutil.rmtree(d / shard_dir(1)),
])
def test_manifest_and_codebook_values_are_refused(fuzz_root, mutate):
    assert judge(fuzz_root, "manifest", mutate) == "refused"


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                   HealthCheck.too_slow])
@given(data=st.data())
def test_random_extreme_values_in_random_places(fuzz_root, data):
    """Several arrays mutated at once at random positions with values drawn from the extremes."""
    snap_dir = fuzz_root[0]
    files = data.draw(st.lists(st.sampled_from(sorted(_files())), min_size=1, max_size=3, unique=True))
    names = [name for name, _ in files]
    steps = []
    for name, k in files:
        n = current(snap_dir, name, k).size
        if n == 0:
            continue
        pos = data.draw(st.integers(0, n - 1))
        value = data.draw(st.sampled_from(EXTREMES[ARRAYS[name].dtype]))
        steps.append(_set(name, k, (pos,), (value,)))
    label = "+".join(names) if not set(names) & DATA else next(iter(DATA & set(names)))
    judge(fuzz_root, label, lambda d: [s(d) for s in steps])
