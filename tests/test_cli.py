"""The CLI end to end, as a user runs it: sample -> sid train -> sid assign, errors, gates, help."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import numpy as np
import polars as pl
import pyarrow.parquet as pq
import pytest

from sidindex.sid import load_codebook
from tests.conftest import run_cli


def run(*args) -> subprocess.CompletedProcess:
    return run_cli(*args, timeout=300)


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    base = tmp_path_factory.mktemp("cli")
    r = run("sample", "--out", base / "data", "--ads", 800, "--requests", 20, "--dim", 12, "--json")
    assert r.returncode == 0, r.stderr
    (base / "build.toml").write_text("[sid]\nlevels = [16, 8, 8]\nhash_size = 128\npaths = 2\n"
                                     "min_points_per_centroid = 10\n")
    r = run("sid", "train", "--catalog", base / "data" / "catalog.parquet", "--targeting",
            base / "data" / "targeting.toml", "--config", base / "build.toml", "--out", base / "root", "--json")
    assert r.returncode == 0, r.stderr
    return base, json.loads(r.stdout)


def test_sample_train_assign(trained):
    base, summary = trained
    assert summary["level_sizes"] == [16, 8, 8, 128] and summary["ads"] == 800
    assert Path(summary["path"]) == base / "root" / "codebooks" / summary["codebook_id"]
    out = base / "sids.parquet"
    r = run("sid", "assign", "--catalog", base / "data" / "catalog.parquet", "--codebook", base / "root",
            "--targeting", base / "data" / "targeting.toml", "--out", out, "--report", base / "q.json", "--json")
    assert r.returncode == 0, r.stderr
    result = json.loads(r.stdout)
    table = pq.read_table(out)
    assert table.column_names == ["ad_id", "path", "sid"] and table.num_rows == result["sid_rows"] == 1600
    ads = pl.read_parquet(base / "data" / "catalog.parquet")["ad_id"]
    assert set(table["ad_id"].to_pylist()) == set(ads.to_list())
    report = json.loads((base / "q.json").read_text())
    assert report == result["quality"] and report["n_ads"] == 800
    # assigning again with the frozen codebook gives the same bytes of SIDs
    r = run("sid", "assign", "--catalog", base / "data" / "catalog.parquet", "--codebook",
            summary["path"], "--out", base / "again.parquet")
    assert r.returncode == 0, r.stderr
    assert "SID quality" in r.stdout and "perplexity" in r.stdout
    assert pq.read_table(base / "again.parquet").equals(table)
    assert load_codebook(summary["path"]).id == summary["codebook_id"]


def _corrupt(df: pl.DataFrame, case: str) -> pl.DataFrame:
    rows = list(range(df.height))
    if case == "missing column":
        return df.drop("age")
    if case == "wrong type":
        return df.with_columns(pl.col("ad_id").cast(pl.String))
    if case == "duplicate ad_id":
        return df.with_columns(pl.Series("ad_id", [df["ad_id"][0] if i == 9 else v for i, v in zip(rows, df["ad_id"])]))
    if case in ("NaN embedding", "short embedding"):
        emb = np.stack(df["embedding"].to_numpy()).tolist()
        emb[9] = emb[9][:-1] if case == "short embedding" else [float("nan")] * len(emb[9])
        return df.with_columns(pl.Series("embedding", emb, dtype=pl.List(pl.Float32)))
    if case == "undeclared value":
        platform = [["wap"] if i == 9 else v for i, v in zip(rows, df["platform"].to_list())]
        return df.with_columns(pl.Series("platform", platform))
    if case == "empty catalog":
        return df.head(0)
    raise AssertionError(case)


@pytest.mark.parametrize("case,expected", [
    ("missing column", "missing column 'age'"),
    ("wrong type", "column 'ad_id': has type String, expected an integer type"),
    ("duplicate ad_id", "column 'ad_id', row 9: value"),
    ("NaN embedding", "column 'embedding', row 9"),
    ("short embedding", "column 'embedding', row 9"),
    ("undeclared value", "column 'platform', row 9"),
    ("empty catalog", "the catalog holds no rows"),
])
def test_bad_input_exits_non_zero_with_one_line_and_writes_nothing(trained, case, expected):
    base, summary = trained
    bad = base / f"bad-{case.replace(' ', '_')}.parquet"
    _corrupt(pl.read_parquet(base / "data" / "catalog.parquet"), case).write_parquet(bad)
    out = base / f"out-{case.replace(' ', '_')}.parquet"
    r = run("sid", "assign", "--catalog", bad, "--codebook", summary["path"], "--targeting",
            base / "data" / "targeting.toml", "--out", out)
    assert r.returncode == 2
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"error: {bad}: ") and expected in lines[0], r.stderr
    assert not out.exists()


def test_quality_gate_fails_the_job(trained):
    base, summary = trained
    (base / "strict.toml").write_text("[quality]\nmin_level_perplexity = 1000\n")
    out = base / "gated.parquet"
    r = run("sid", "assign", "--catalog", base / "data" / "catalog.parquet", "--codebook", summary["path"],
            "--config", base / "strict.toml", "--out", out, "--report", base / "gated.json")
    assert r.returncode == 3
    assert r.stderr.startswith("error: SID quality gate failed: level 0 perplexity")
    assert len(r.stderr.strip().splitlines()) == 1
    assert not out.exists() and json.loads((base / "gated.json").read_text())["failures"]


def test_bad_config_and_missing_codebook(trained, tmp_path):
    base, _ = trained
    (tmp_path / "c.toml").write_text("[sid]\npaths = 0\n")
    r = run("sid", "train", "--catalog", base / "data" / "catalog.parquet", "--config", tmp_path / "c.toml",
            "--out", tmp_path / "root")
    assert r.returncode == 2
    assert r.stderr.strip() == f"error: {tmp_path / 'c.toml'}: [sid] paths: expected an integer in 1..8, got 0"
    assert not (tmp_path / "root").exists()
    r = run("sid", "assign", "--catalog", base / "data" / "catalog.parquet", "--codebook", tmp_path,
            "--out", tmp_path / "o.parquet")
    assert r.returncode == 2 and "no codebook here" in r.stderr


@pytest.mark.parametrize("cmd", [[], ["sample"], ["sid"], ["sid", "train"], ["sid", "assign"]])
def test_help(cmd):
    r = run(*cmd, "--help")
    assert r.returncode == 0 and "Usage" in r.stdout


@pytest.mark.parametrize("args, message", [
    (["build", "--bogus-flag"], "No such option: --bogus-flag"),
    (["frobnicate"], "No such command 'frobnicate'"),
    (["retrieve", "x", "--requests", "r", "--out", "o", "--top-k", "0"], "Invalid value for '--top-k'"),
    (["sample", "--out", "d", "--ads", "many"], "Invalid value for '--ads'"),
    (["build", "--catalog", "c.parquet"], "Missing option"),
    (["validate"], "Missing argument"),
])
def test_usage_errors_are_one_line_and_exit_2(args, message):
    """The installed console script, not only the typer app: typer no longer installs click, and an
    error path that imported it turned every usage error into a traceback."""
    r = run(*args)
    assert r.returncode == 2, (r.returncode, r.stderr)
    assert "Traceback" not in r.stderr + r.stdout
    assert len(r.stderr.strip().splitlines()) == 1 and message in r.stderr, r.stderr


def test_no_arguments_prints_help_and_exits_2():
    r = run()
    assert r.returncode == 2 and "Usage" in r.stdout and "Traceback" not in r.stderr


@pytest.mark.parametrize("cmd", [["build"], ["inspect"], ["validate"], ["explain"], ["retrieve"], ["simulate"]])
def test_every_command_has_help(cmd):
    r = run(*cmd, "--help")
    assert r.returncode == 0 and "Usage" in r.stdout
