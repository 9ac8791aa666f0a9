"""A pytest plugin for `bench/gpu_check.sh`: each test's outcome and seconds, and each failure's
report, appended to $OUT/tests.tsv and $OUT/failures.txt as they arrive, so that a run the host's
time limit cuts short still says what failed and what took the time (xdist reports only at the end).
"""

from __future__ import annotations

import os
from pathlib import Path


def _out() -> Path:
    out = Path(os.environ.get("OUT") or "bench_out")
    out.mkdir(parents=True, exist_ok=True)
    return out


_worker = False


def pytest_configure(config) -> None:
    global _worker
    _worker = hasattr(config, "workerinput")  # xdist's controller gets every worker's reports


def pytest_runtest_logreport(report) -> None:
    if _worker or (report.when != "call" and not report.failed):
        return
    out = _out()
    with open(out / "tests.tsv", "a") as f:
        f.write(f"{report.nodeid}\t{report.when}\t{report.outcome}\t{report.duration:.2f}\n")
    if report.failed:
        with open(out / "failures.txt", "a") as f:
            f.write(f"==== {report.nodeid} ({report.when})\n{report.longreprtext}\n\n")
