"""The scheduled rebuild job: exit codes an orchestrator can act on, and a report for every run."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from sidindex.snapshot import open_snapshot, resolve_snapshot


def rebuild(job: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pipelines.rebuild", str(job)], capture_output=True, text=True,
                          timeout=300)


def test_rebuild_publishes_then_reports_unchanged_then_fails_cleanly(sample_dir, tmp_path):
    (tmp_path / "build.toml").write_text("[sid]\nlevels = [16, 8, 8]\nhash_size = 128\nmin_points_per_centroid = 10\n")
    root = tmp_path / "root"
    job = tmp_path / "job.toml"
    job.write_text(f'catalog = "{sample_dir / "catalog.parquet"}"\ntargeting = "{sample_dir / "targeting.toml"}"\n'
                   f'root = "{root}"\nconfig = "{tmp_path / "build.toml"}"\nkeep = 2\n')
    r = rebuild(job)
    assert r.returncode == 0, r.stderr
    first = json.loads((root / "reports" / "latest.json").read_text())
    assert first["status"] == "published" and first["exit_code"] == 0
    assert open_snapshot(resolve_snapshot(root)).id == first["snapshot_id"]

    r = rebuild(job)
    assert r.returncode == 10, r.stderr
    assert json.loads((root / "reports" / "latest.json").read_text())["status"] == "unchanged"

    job.write_text(job.read_text().replace(str(sample_dir / "catalog.parquet"), str(tmp_path / "missing.parquet")))
    r = rebuild(job)
    failed = json.loads((root / "reports" / "latest.json").read_text())
    assert r.returncode == 2 and failed["status"] == "failed" and "missing.parquet" in failed["error"]
    assert open_snapshot(resolve_snapshot(root)).id == first["snapshot_id"]  # still published
    assert len(list((root / "reports").glob("2*.json"))) == 3


def test_bad_job_file_exits_2(tmp_path):
    job = tmp_path / "job.toml"
    job.write_text('catalog = "x.parquet"\ntypo = 1\n')
    r = rebuild(job)
    assert r.returncode == 2 and "typo" in r.stdout
