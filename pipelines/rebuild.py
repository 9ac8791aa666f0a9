"""The scheduled rebuild: config file -> build -> publish -> retention -> run report.

    python -m pipelines.rebuild JOB.toml

JOB.toml:
    catalog   = "/data/ads/catalog.parquet"   # required
    targeting = "/data/ads/targeting.toml"    # required
    root      = "/srv/sidindex"               # required: ROOT to publish into
    config    = "/data/ads/build.toml"        # optional build config ([sid], [quality], [kway])
    codebook  = "/srv/sidindex/codebooks/cb-..."  # optional: default, ROOT's frozen codebook
    keep      = 3                             # published snapshots to keep
    force     = false
    reports   = "/srv/sidindex/reports"       # optional: default ROOT/reports

Each run writes one JSON report (reports/<UTC time>.json, and reports/latest.json) whatever the
outcome, and exits with a code an orchestrator can act on:
    0  published a new snapshot        10  inputs unchanged, nothing published
    2  bad input, config or artifact   3   a quality gate failed (nothing published)
    1  anything else (a bug, a full disk); the previous snapshot stays published
"""

from __future__ import annotations

import json
import sys
import time
import traceback
from pathlib import Path

from sidindex.errors import ConfigError, SidIndexError
from sidindex.job import run_build
from sidindex.tomlio import check_keys, read_toml

UNCHANGED = 10
_KEYS = {"catalog", "targeting", "root", "config", "codebook", "keep", "force", "reports"}


def load_job(path: Path) -> dict:
    doc = read_toml(path)
    check_keys(doc, _KEYS, str(path))
    for key in ("catalog", "targeting", "root"):
        if not isinstance(doc.get(key), str):
            raise ConfigError(f"{path}: '{key}' is required (a path)")
    if not isinstance(doc.get("keep", 3), int) or doc.get("keep", 3) < 1:
        raise ConfigError(f"{path}: 'keep' must be an integer >= 1")
    if not isinstance(doc.get("force", False), bool):
        raise ConfigError(f"{path}: 'force' must be true or false")
    return doc


def run(job_path: Path) -> tuple[int, dict]:
    """Run one rebuild; returns (exit code, report)."""
    started = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    report: dict = {"job": str(job_path), "started": started}
    job: dict = {}
    try:
        job = load_job(job_path)
        opt = {k: Path(job[k]) for k in ("config", "codebook") if k in job}
        report |= run_build(Path(job["catalog"]), Path(job["targeting"]), Path(job["root"]), keep=job.get("keep", 3),
                            force=job.get("force", False), **opt)
        code = 0 if report["status"] == "published" else UNCHANGED
    except SidIndexError as e:
        report |= {"status": "failed", "error": str(e), "error_type": type(e).__name__}
        code = e.exit_code
    except Exception as e:  # noqa: BLE001 - the report must say what happened, whatever it was
        report |= {"status": "failed", "error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()}
        code = 1
    report |= {"exit_code": code, "finished": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    if "root" in job:
        _write_report(Path(job.get("reports") or Path(job["root"]) / "reports"), report)
    return code, report


def _write_report(directory: Path, report: dict) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    text = json.dumps(report, indent=1)
    stamp = report["started"].replace(":", "").replace("-", "")
    for name in (f"{stamp}-{time.time_ns() % 10**9:09d}.json", "latest.json"):
        tmp = directory / f".{name}.tmp"
        tmp.write_text(text)
        tmp.replace(directory / name)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1 or argv[0] in ("-h", "--help"):
        print(__doc__)
        return 0 if argv and argv[0] in ("-h", "--help") else 2
    code, report = run(Path(argv[0]))
    print(json.dumps({k: report.get(k) for k in ("status", "snapshot_id", "exit_code", "error") if k in report}))
    return code


if __name__ == "__main__":
    sys.exit(main())
