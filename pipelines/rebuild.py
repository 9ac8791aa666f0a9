"""The scheduled rebuild: config file -> build -> publish -> retention -> run report; and, between
full builds, updates from change files (docs/design.md §15).

    python -m pipelines.rebuild JOB.toml              # a full build
    python -m pipelines.rebuild JOB.toml --update     # apply pending change files

JOB.toml:
    catalog   = "/data/ads/catalog.parquet"   # required
    targeting = "/data/ads/targeting.toml"    # required
    root      = "/srv/sidindex"               # required: ROOT to publish into
    config    = "/data/ads/build.toml"        # optional build config ([sid], [quality], [kway])
    codebook  = "/srv/sidindex/codebooks/cb-..."  # optional: default, ROOT's frozen codebook
    keep      = 3                             # published snapshots to keep
    force     = false
    reports   = "/srv/sidindex/reports"       # optional: default ROOT/reports
    changes   = "/data/ads/changes"           # for --update: a directory of change files
    changes_applied_through = "20261204T1200.parquet"  # optional: the newest change file the catalog
                                              # export holds (a full build applies the later ones again);
                                              # default: the export's own schema metadata of that name
    sign_key  = "/etc/sidindex/build-key.pem" # optional: sign what builds and updates publish
    trust_key = "/etc/sidindex/old.pub.pem"   # optional: what the snapshot they build on is signed by
                                              # (default: sign_key's public half)

The intended loop: a full build on schedule (every few hours) from a catalog export; between
them, `--update` every minute or so. An update run applies each pending change file of the
`changes` directory (`*.parquet`, `*.arrow`), in name order, with `sidindex update`, and moves it
into `changes/applied/` once published, so each file is applied once: a file the ROOT's journal
already holds (or that a full build's export held, by `changes_applied_through`) is archived
without being applied again, whatever ran in between (a run killed between publishing a file and
archiving it, a full build). The first file that fails stops the run and stays pending (fix or
remove it). Name files so that name order is time order (e.g. a UTC timestamp). A full build keeps
paused ads paused, and applies again the change files published after the export's
`changes_applied_through` (without it, it warns and applies none). Updates only grow matchers;
the next full build compacts them (`sidindex inspect` shows the stale entries in between).

Each run writes one JSON report (reports/<UTC time>.json, and reports/latest.json) whatever the
outcome, an unexpected exception included, prints a one-line JSON summary on stdout, and exits with
a code an orchestrator can act on:
    0  published a new snapshot        10  inputs unchanged (no pending change file), nothing published
    2  bad input, config or artifact   3   a quality gate failed (nothing published)
       (a bad job file too)
    130, 143  interrupted by SIGINT, SIGTERM (nothing published unless the report names a snapshot;
              a signal after the run's last publication is noted in signals_after_publish instead,
              and an update run stops before its next change file)
    1  anything else (a bug, a full disk); the previous snapshot stays published

Two cases print one line on stderr (and never a traceback):
- the job file cannot be loaded (missing, a directory, not UTF-8, not TOML, bad keys): there is no
  reports directory to write to; exit 2.
- the reports directory cannot be written (read-only, no permission, a file in the way): the line
  names the directory and the OS error, and stdout carries the whole report (with "report_error")
  instead of the summary. The exit code is the build's own when the build failed (2, 3 or 1), and 1
  when it published or found nothing to do: a run whose report is lost is not a clean success.
"""

from __future__ import annotations

import json
import signal
import sys
import time
import traceback
from pathlib import Path

from sidindex.artifact import replace_file
from sidindex.errors import ConfigError, SidIndexError
from sidindex.interrupts import Interrupted, interrupts_raise, noted
from sidindex.job import run_build, run_update
from sidindex.tomlio import check_keys, read_toml

UNCHANGED = 10
_KEYS = {"catalog", "targeting", "root", "config", "codebook", "keep", "force", "reports", "changes",
         "changes_applied_through", "sign_key", "trust_key"}
CHANGE_FILES = ("*.parquet", "*.arrow")
APPLIED = "applied"


def load_job(path: Path) -> dict:
    """Read and check JOB.toml; every problem with it, an unreadable file included, is a `ConfigError`."""
    doc = read_toml(path, what="job file")
    check_keys(doc, _KEYS, str(path))
    for key in ("catalog", "targeting", "root"):
        if not isinstance(doc.get(key), str):
            raise ConfigError(f"{path}: '{key}' is required (a path)")
    for key in ("config", "codebook", "reports", "changes", "changes_applied_through", "sign_key", "trust_key"):
        if not isinstance(doc.get(key, ""), str):
            raise ConfigError(f"{path}: '{key}' must be a path (a string)")
    keep = doc.get("keep", 3)
    if not isinstance(keep, int) or isinstance(keep, bool) or keep < 1:
        raise ConfigError(f"{path}: 'keep' must be an integer >= 1")
    if not isinstance(doc.get("force", False), bool):
        raise ConfigError(f"{path}: 'force' must be true or false")
    return doc


def run(job_path: Path, update: bool = False) -> tuple[int, dict]:
    """Run one rebuild (with `update`, apply the pending change files instead); returns (exit
    code, report).

    Once the job file is loaded, report["reports"] is the reports directory and the report is written
    there; when that fails, report["report_error"] says why and the code follows the module docstring.
    """
    started = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    report: dict = {"job": str(job_path), "started": started}
    job: dict = {}
    try:
        job = load_job(job_path)
        report["reports"] = str(Path(job.get("reports") or Path(job["root"]) / "reports"))
        if update:
            report |= apply_pending(job, job_path)
        else:
            config, codebook = (Path(job[k]) if k in job else None for k in ("config", "codebook"))
            report |= run_build(Path(job["catalog"]), Path(job["targeting"]), Path(job["root"]),
                                keep=job.get("keep", 3), force=job.get("force", False), waiting=_waiting,
                                changes_through=job.get("changes_applied_through"), config=config, codebook=codebook,
                                sign_key=job.get("sign_key"), trust_key=job.get("trust_key"))
        code = 0 if report["status"] == "published" else UNCHANGED
    except SidIndexError as e:
        report |= {"status": "failed", "error": str(e), "error_type": type(e).__name__}
        code = e.exit_code
    except Interrupted as e:
        report |= {"status": "interrupted", "error": e.describe(), "error_type": "Interrupted",
                   **({"snapshot_id": e.published} if e.published else {})}
        code = e.exit_code
    # BaseException, not Exception: the report must say what happened whatever it was, and a Rust panic
    # in polars (pyo3's PanicException), SystemExit from a library or Ctrl-C are not Exceptions.
    except BaseException as e:  # noqa: BLE001
        report |= {"status": "failed", "error": f"{type(e).__name__}: {e}", "error_type": type(e).__name__,
                   "traceback": traceback.format_exc()}
        code = 1
    signals, _ = noted()  # came once the run had published: they stopped nothing, the success stands
    report |= {"exit_code": code, "finished": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
               **({"signals_after_publish": [signal.Signals(s).name for s in signals]} if signals else {})}
    if "reports" in report:
        directory = Path(report["reports"])
        try:
            _write_report(directory, report)
        except OSError as e:  # read-only, no permission, a file where the directory should be, disk full
            code = code if code not in (0, UNCHANGED) else 1
            report |= {"exit_code": code,
                       "report_error": f"{directory}: cannot write the run report there ({e.strerror or e})"}
    return code, report


def apply_pending(job: dict, job_path: Path) -> dict:
    """Apply the job's pending change files in name order, archiving each once published."""
    if "changes" not in job:
        raise ConfigError(f"{job_path}: 'changes' (a directory of change files) is required for an update run")
    directory = Path(job["changes"])
    if not directory.is_dir():
        raise ConfigError(f"{job_path}: 'changes' = {str(directory)!r} is not a directory")
    pending = sorted({p for pattern in CHANGE_FILES for p in directory.glob(pattern) if p.is_file()})
    applied = []
    for path in pending:  # one the published snapshot holds (a run killed before archiving it, a build) is not applied
        report = run_update(Path(job["root"]), path, keep=job.get("keep", 3), once=True, waiting=_waiting,
                            sign_key=job.get("sign_key"), trust_key=job.get("trust_key"))
        (directory / APPLIED).mkdir(exist_ok=True)
        path.replace(directory / APPLIED / path.name)
        applied.append({"file": path.name, "status": report["status"], "snapshot_id": report["snapshot_id"]})
    published = [a for a in applied if a["status"] == "published"]
    return {"status": "published" if published else "unchanged", "applied": applied,
            **({"snapshot_id": published[-1]["snapshot_id"]} if published else {})}


def _write_report(directory: Path, report: dict) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    text = json.dumps(report, indent=1, default=str)  # default=str: a stray Path or numpy scalar is no crash
    stamp = report["started"].replace(":", "").replace("-", "")
    for name in (f"{stamp}-{time.time_ns() % 10**9:09d}.json", "latest.json"):
        replace_file(directory / name, lambda tmp: tmp.write_text(text))


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    update = "--update" in argv
    rest = [a for a in argv if a != "--update"]
    if len(rest) != 1 or rest[0] in ("-h", "--help") or rest[0].startswith("-"):
        print(__doc__)
        return 0 if rest and rest[0] in ("-h", "--help") else 2
    try:
        with interrupts_raise(keep=True):
            code, report = run(Path(rest[0]), update)
    except Interrupted as e:  # while the report was written: the run's own outcome is in it, or lost
        _one_line(f"error: {e.describe('the run report may be incomplete')}")
        return e.exit_code
    if report.get("status") == "interrupted":
        _one_line(f"error: {report['error']}")
    if "report_error" in report:
        _one_line(f"error: {report['report_error']}; the report follows on stdout")
        print(json.dumps(report, default=str))  # the only copy of it
        return code
    if "reports" not in report:  # the job file itself is bad: no report anywhere but here
        _one_line(f"error: {report.get('error')}")
    print(json.dumps({k: report.get(k) for k in ("status", "snapshot_id", "exit_code", "error") if k in report},
                     default=str))
    return code


def _waiting() -> None:
    _one_line("waiting for another build or update on this ROOT ...")


def _one_line(message: str) -> None:
    print(" ".join(message.split("\n")), file=sys.stderr)


if __name__ == "__main__":
    sys.exit(main())
