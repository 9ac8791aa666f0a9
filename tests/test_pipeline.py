"""The scheduled rebuild job: exit codes an orchestrator can act on, and a report for every run."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from pipelines import rebuild as rebuild_module
from sidindex.snapshot import open_snapshot


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
    assert open_snapshot(root).id == first["snapshot_id"]

    r = rebuild(job)
    assert r.returncode == 10, r.stderr
    assert json.loads((root / "reports" / "latest.json").read_text())["status"] == "unchanged"

    job.write_text(job.read_text().replace(str(sample_dir / "catalog.parquet"), str(tmp_path / "missing.parquet")))
    r = rebuild(job)
    failed = json.loads((root / "reports" / "latest.json").read_text())
    assert r.returncode == 2 and failed["status"] == "failed" and "missing.parquet" in failed["error"]
    assert open_snapshot(root).id == first["snapshot_id"]  # still published
    assert len(list((root / "reports").glob("2*.json"))) == 3


def test_update_runs_apply_pending_change_files_in_order_once(sample_dir, tmp_path):
    import polars as pl

    (tmp_path / "build.toml").write_text("[sid]\nlevels = [16, 8, 8]\nhash_size = 128\nmin_points_per_centroid = 10\n")
    root, changes = tmp_path / "root", tmp_path / "changes"
    changes.mkdir()
    job = tmp_path / "job.toml"
    job.write_text(f'catalog = "{sample_dir / "catalog.parquet"}"\ntargeting = "{sample_dir / "targeting.toml"}"\n'
                   f'root = "{root}"\nconfig = "{tmp_path / "build.toml"}"\nchanges = "{changes}"\n')
    assert rebuild(job).returncode == 0
    ad = int(pl.read_parquet(sample_dir / "catalog.parquet")["ad_id"][0])
    pl.DataFrame({"ad_id": [ad], "op": ["pause"]}).write_parquet(changes / "0001.parquet")
    pl.DataFrame({"ad_id": [ad], "op": ["resume"]}).write_parquet(changes / "0002.parquet")
    r = subprocess.run([sys.executable, "-m", "pipelines.rebuild", str(job), "--update"], capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    report = json.loads((root / "reports" / "latest.json").read_text())
    assert [a["file"] for a in report["applied"]] == ["0001.parquet", "0002.parquet"]
    snap = open_snapshot(root)
    assert snap.id == report["snapshot_id"] and snap.manifest.updates == 2 and snap.manifest.lineage.paused == 0
    assert sorted(p.name for p in (changes / "applied").iterdir()) == ["0001.parquet", "0002.parquet"]
    (changes / "0002.parquet").write_bytes((changes / "applied" / "0002.parquet").read_bytes())  # killed before
    r = subprocess.run([sys.executable, "-m", "pipelines.rebuild", str(job), "--update"], capture_output=True,
                       text=True, timeout=300)  # archiving: published already, so archived, not applied again
    assert r.returncode == 10 and not (changes / "0002.parquet").exists() and open_snapshot(root).id == snap.id
    pl.DataFrame({"ad_id": [1], "op": ["delete"]}).write_parquet(changes / "0003.parquet")  # an unknown ad
    r = subprocess.run([sys.executable, "-m", "pipelines.rebuild", str(job), "--update"], capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 2 and (changes / "0003.parquet").exists() and open_snapshot(root).id == snap.id


def test_bad_job_file_exits_2(tmp_path):
    job = tmp_path / "job.toml"
    job.write_text('catalog = "x.parquet"\ntypo = 1\n')
    r = rebuild(job)
    assert r.returncode == 2 and "typo" in r.stdout


def write_job(tmp_path: Path, **keys: str) -> Path:
    keys = {"catalog": str(tmp_path / "missing.parquet"), "targeting": str(tmp_path / "targeting.toml"),
            "root": str(tmp_path / "root"), **keys}
    job = tmp_path / "job.toml"
    job.write_text("".join(f"{k} = {json.dumps(v)}\n" for k, v in keys.items()))
    return job


def one_line(stderr: str) -> str:
    assert "Traceback" not in stderr, stderr
    lines = stderr.strip().splitlines()
    assert len(lines) == 1, stderr
    return lines[0]


@pytest.mark.parametrize("case", ["directory", "bad utf-8", "bad toml", "missing"])
def test_unreadable_job_file_exits_2_in_one_line(tmp_path, case):
    job = tmp_path / "job.toml"
    if case == "directory":
        job.mkdir()
    elif case == "bad utf-8":
        job.write_bytes(b'catalog = "caf\xe9.parquet"\n')
    elif case == "bad toml":
        job.write_text("catalog = \n")
    r = rebuild(job)
    assert r.returncode == 2, (r.stdout, r.stderr)
    line = one_line(r.stderr)
    assert line.startswith(f"error: {job}: ")
    assert json.loads(r.stdout)["exit_code"] == 2


def test_unwritable_reports_directory_keeps_the_builds_exit_code(tmp_path):
    # Tests run as root, which ignores permission bits: a path under a regular file fails for root too.
    (tmp_path / "afile").write_text("not a directory")
    reports = tmp_path / "afile" / "reports"
    r = rebuild(write_job(tmp_path, reports=str(reports)))  # no inputs: the build fails with 2
    assert r.returncode == 2, (r.stdout, r.stderr)
    line = one_line(r.stderr)
    assert str(reports) in line and "cannot write the run report" in line and "Not a directory" in line
    report = json.loads(r.stdout)  # the whole report, since it is nowhere else
    assert report["status"] == "failed" and "file not found" in report["error"] and report["exit_code"] == 2
    assert report["report_error"] in line


@pytest.mark.parametrize("in_the_way", ["file is the directory", "file above it"])
def test_report_that_cannot_be_written_turns_a_publish_into_exit_1(tmp_path, monkeypatch, capsys, in_the_way):
    (tmp_path / "afile").write_text("")
    reports = tmp_path / "afile" / ("reports" if in_the_way == "file above it" else "")
    monkeypatch.setattr(rebuild_module, "run_build", lambda *a, **kw: {"status": "published", "snapshot_id": "s1"})
    code = rebuild_module.main([str(write_job(tmp_path, reports=str(reports)))])
    out, err = capsys.readouterr()
    assert code == 1
    assert str(reports) in one_line(err)
    report = json.loads(out)
    assert report["status"] == "published" and report["snapshot_id"] == "s1" and report["exit_code"] == 1


class _Panic(BaseException):
    """Like pyo3's PanicException (a Rust panic in polars): not an Exception."""


def test_unexpected_failure_is_reported(tmp_path, monkeypatch, capsys):
    def build(*a, **kw):
        raise _Panic("index out of bounds")

    monkeypatch.setattr(rebuild_module, "run_build", build)
    assert rebuild_module.main([str(write_job(tmp_path))]) == 1
    out, err = capsys.readouterr()
    assert err == ""
    report = json.loads((tmp_path / "root" / "reports" / "latest.json").read_text())
    assert report["status"] == "failed" and report["exit_code"] == 1 and report["error_type"] == "_Panic"
    assert "index out of bounds" in report["error"] and "Traceback" in report["traceback"]
    assert json.loads(out)["error"] == report["error"]
