"""Loading onto a device, the snapshot watcher, and `sidindex retrieve` end to end: every returned
ad is eligible by the definition (checked from the raw catalog and request lists), ranks and
scores are consistent, and bad options fail with one line."""

from __future__ import annotations

import functools
import json
import math
import shutil
import subprocess
from pathlib import Path

import numpy as np
import polars as pl
import pytest
import torch

from runtime import SnapshotWatcher, beam_search, codebook_scorer, encode_requests, load, read_requests, to_device
from sidindex.root import Root
from sidindex.targeting import load_targeting
from tests.conftest import run_cli
from tests.in_process import run_main
from tests.test_gtm import eligible
from tests.test_snapshot import array_file

CONFIG = ('[sid]\nlevels = [16, 8, 8]\nhash_size = 128\npaths = 2\nmin_points_per_centroid = 10\n'
          '[kway]\nmode = "dynamic"\nk_max = 4\n')


def cli(*args) -> subprocess.CompletedProcess:
    return run_cli(*args, timeout=600)


def build_root(sample_dir: Path, base: Path, config: str) -> Path:
    """The sample catalog built with build config `config` and published into base/root."""
    (base / "build.toml").write_text(config)
    r = cli("build", "--catalog", sample_dir / "catalog.parquet", "--targeting", sample_dir / "targeting.toml",
            "--out", base / "root", "--config", base / "build.toml", "--json")
    assert r.returncode == 0, r.stderr
    return base / "root"


@pytest.fixture(scope="module")
def root(sample_dir, tmp_path_factory) -> Path:
    return build_root(sample_dir, tmp_path_factory.mktemp("retrieve"), CONFIG)


def test_load_copies_the_index(root):
    index = load(root, "cpu")
    g = index.snapshot.gtm
    served = index.gtm.arrays()
    for name in ("node_offsets", "csr_child_nodes", "csr_tokens", "bitmask_index", "bloom_table", "part_offsets"):
        a = g.arrays()[name]
        np.testing.assert_array_equal(served[name].numpy(), a.view(np.int64) if a.dtype == np.uint64 else a)
    for name in ("depth_offsets", "leaf_ad_offsets", "leaf_ads"):  # the post stage's, left on the host
        assert getattr(index.gtm, name) is getattr(g, name)
    parent = np.repeat(np.arange(g.num_nodes), np.diff(g.node_offsets))
    np.testing.assert_array_equal(index.entry_keys.numpy(), parent * g.vocab_size + g.csr_tokens)
    assert np.all(np.diff(index.entry_keys.numpy()) > 0)
    assert index.load_info["bytes"] > 0
    assert set(index.load_info["phases"]) == {"stage", "transfer"}
    assert index.codebook is not None and index.codebook.level_sizes == index.level_sizes


def test_watcher_swaps_to_a_new_snapshot_and_refuses_a_corrupt_one(root, sample_dir, tmp_path):
    work = Path(shutil.copytree(root, tmp_path / "root"))
    watcher = SnapshotWatcher(work, "cpu")
    old = watcher.current
    assert not watcher.poll()  # nothing new
    r = cli("build", "--catalog", sample_dir / "catalog.parquet", "--targeting", sample_dir / "targeting.toml",
            "--out", work, "--config", root.parent / "build.toml", "--force", "--keep", "5", "--json")
    assert r.returncode == 0, r.stderr
    assert watcher.poll() and watcher.current.id == json.loads(r.stdout)["snapshot_id"] != old.id
    # a request that took the old index finishes on it
    reqs = to_device(encode_requests(read_requests(sample_dir / "requests.parquet", old), old.spec), "cpu")
    found = beam_search(old, reqs.slice(0, 2), codebook_scorer(old, reqs)(slice(0, 2)), (1, 4, 8, 8), "cd+gtm")
    assert found.alive.any()
    # a corrupt snapshot published (here: the first one, a file of it spoiled) is not swapped in
    good = watcher.current
    table = array_file(Root(work).snapshot_dir(old.id), "bloom_table")
    data = bytearray(table.read_bytes())
    data[-1] ^= 0xFF
    spoiled = table.with_name("spoiled")
    spoiled.write_bytes(bytes(data))
    spoiled.replace(table)  # a new file: the old index's memory maps keep the old one
    Root(work).current_file.write_text(old.id)
    assert not watcher.poll()
    assert watcher.current is good and "bloom_table.arrow" in watcher.last_error and good.id in watcher.last_error


def test_retrieve_cli_returns_only_eligible_ads(root, sample_dir, tmp_path, monkeypatch, capsys):
    """The first run and the first bad option through the console script; the others through its
    entry point in this process (`run_main`: the same exit code and lines, without the start-up)."""
    here = functools.partial(run_main, monkeypatch, capsys)
    spec = load_targeting(sample_dir / "targeting.toml")
    catalog = pl.read_parquet(sample_dir / "catalog.parquet")
    columns = ["ad_id", "value"] + [a.name for a in spec.attributes]
    ads = {row["ad_id"]: row for row in catalog.select(columns).to_dicts()}
    requests = {row["request_id"]: row for row in pl.read_parquet(sample_dir / "requests.parquet").to_dicts()}
    runs = [(mode, ()) for mode in ("cd", "cd+gtm", "cd+gtm+kway")] + [("cd+gtm+kway", ("--value-weight", 1, "--rank",
                                                                                       "value"))]
    for i, (mode, value_args) in enumerate(runs):
        out = tmp_path / f"{mode}.parquet"
        r = (cli if i == 0 else here)("retrieve", root, "--requests", sample_dir / "requests.parquet", "--out", out,
                                      "--mode", mode, "--beams", "1,16,32,32", "--top-k", 5, "--json", *value_args)
        assert r.returncode == 0, r.stderr
        summary = json.loads(r.stdout)
        got = pl.read_parquet(out)
        assert got.columns == ["request_id", "rank", "ad_id", "sid", "score", "value"]
        assert got.height == summary["rows"] > 0
        for row in got.iter_rows(named=True):  # invariant 2, from the raw lists
            assert eligible(spec, ads[row["ad_id"]], requests[row["request_id"]]), (mode, row)
            assert row["value"] == ads[row["ad_id"]]["value"]
        for _, grp in got.group_by("request_id"):
            assert grp["rank"].to_list() == list(range(1, grp.height + 1)) and grp.height <= 5
            assert np.all(np.diff(grp["value" if value_args else "score"].to_numpy()) <= 0)
            assert grp["ad_id"].n_unique() == grp.height
        assert all(len(s) == 4 for s in got["sid"].to_list())
    for args, message in [(("--mode", "bogus"), "mode must be one of"), (("--beams", "2,4,4,4"), "beams[0] must be 1"),
                          (("--beams", "1,4"), "give 4 positive beam sizes"),
                          (("--rank", "price"), "expected one of score, value, fused"),
                          (("--value-weight", 1, "--mode", "none"), "use mode cd")]:
        r = (cli if message == "mode must be one of" else here)(
            "retrieve", root, "--requests", sample_dir / "requests.parquet", "--out", tmp_path / "x.parquet", *args)
        assert r.returncode == 2 and message in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr
    if not torch.cuda.is_available():
        r = here("retrieve", root, "--requests", sample_dir / "requests.parquet", "--out", tmp_path / "x.parquet",
                 "--device", "cuda")
        assert r.returncode == 2 and "no CUDA device" in r.stderr



SCORER_MODULE = '''
import torch

def make(batch, device, level_sizes):
    """Favours token (history[0] + step) at every level: a scorer that reads an extra column."""
    first = torch.tensor([h[0] for h in batch.column("history").to_pylist()], device=device)
    def scorer(step, tokens, parent):
        B, K, _ = tokens.shape
        out = torch.zeros(B, K, max(level_sizes), device=device)
        out[torch.arange(B), :, (first + step) % level_sizes[step]] = 5.0
        return out
    return scorer

def broken(batch, device, level_sizes):
    def scorer(step, tokens, parent):
        raise RuntimeError("out of cheese")
    return scorer

def wrong_shape(batch, device, level_sizes):
    return lambda step, tokens, parent: torch.zeros(3, device=device)

def not_a_scorer(batch, device, level_sizes):
    return 42
'''


def test_scorer_factory_from_the_command_line(root, sample_dir, tmp_path, monkeypatch, capsys):
    """--scorer MODULE:FACTORY: the factory gets the batch's rows with the file's extra columns; what
    it favours is what the search returns; a broken module, factory or scorer is one line, exit 2.
    The search and the first broken scorer through the console script, started in the module's
    directory; the other failures through its entry point in this process (`run_main`)."""
    (tmp_path / "my_model.py").write_text(SCORER_MODULE)
    reqs = pl.read_parquet(sample_dir / "requests.parquet").head(20)
    reqs = reqs.with_columns(history=pl.Series([[i % 7, 1, 2] for i in range(reqs.height)]))
    reqs.write_parquet(tmp_path / "requests.parquet")
    out = tmp_path / "out.parquet"
    r = run_cli("retrieve", root, "--requests", "requests.parquet", "--out", out, "--mode", "cd", "--beams", "1,4,4,4",
                "--scorer", "my_model:make", "--json", cwd=tmp_path, timeout=600)
    assert r.returncode == 0, r.stderr
    got = pl.read_parquet(out)
    assert got.height > 0
    sizes = load(root, "cpu").level_sizes
    norm = [math.log(math.exp(5.0) + size - 1) for size in sizes]  # log-softmax over each level's tokens
    for row in got.iter_rows(named=True):  # each score is the user's model's, from the extra column
        first = int(reqs.filter(pl.col("request_id") == row["request_id"])["history"][0][0])
        want = sum((5.0 if t == (first + d) % sizes[d] else 0.0) - norm[d] for d, t in enumerate(row["sid"]))
        assert row["score"] == pytest.approx(want, abs=1e-4)
    for factory, message in [("my_model:broken", "failed at step 0: RuntimeError: out of cheese"),
                             ("my_model:wrong_shape", "returned (3,) torch.float32"),
                             ("my_model:not_a_scorer", "returned int, not a scorer"),
                             ("my_model:missing", "has no callable 'missing'"),
                             ("no_such_model:make", "cannot import 'no_such_model'"),
                             ("nonsense", "expected MODULE:FACTORY")]:
        commands = [("retrieve", "--out", tmp_path / "x.parquet")]
        if factory in ("my_model:broken", "my_model:wrong_shape"):  # simulate's exhaustive pass calls it first
            commands.append(("simulate", "--top-k", "5"))
        for command in commands:
            run = run_cli if factory == "my_model:broken" and command[0] == "retrieve" else functools.partial(
                run_main, monkeypatch, capsys)
            r = run(command[0], root, "--requests", "requests.parquet", *command[1:], "--scorer", factory,
                    cwd=tmp_path, timeout=600)
            assert r.returncode == 2 and message in r.stderr and factory in r.stderr, (command, factory, r.stderr)
            assert "Traceback" not in r.stderr and len(r.stderr.strip().splitlines()) == 1
