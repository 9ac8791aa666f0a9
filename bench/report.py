"""The tail every benchmark's report shares: a target's line, PASS or MISS, and the figures as JSON
(--json PATH). No heavy imports: the benchmarks that run without torch use it too."""

from __future__ import annotations

import json
from pathlib import Path


def verdict(ok: bool, text: str) -> str:
    """'PASS  text' when the target `text` names was met, else 'MISS  text'."""
    return f"{'PASS' if ok else 'MISS'}  {text}"


def write_json(path: str | Path | None, figures) -> None:
    """`figures` as JSON at `path` (the --json argument), when one was given; values JSON cannot
    hold (paths, numpy scalars) as their str."""
    if path:
        Path(path).write_text(json.dumps(figures, indent=1, default=str))


def against(label: str, mine: dict, theirs: dict, figures: dict[str, str]) -> str:
    """The line comparing this checkout's median run with a baseline's (`label`): for each key of
    `figures` (a run's figure, and the words it is printed with) their ratio, or "-" where the
    baseline's is 0 (a short run's CPU can be 0 clock ticks)."""
    ratios = (f"{mine[k] / theirs[k]:.2f}x" if theirs[k] else "-" for k in figures)
    return f"this checkout / {label}: " + ", ".join(f"{r} {words}" for r, words in zip(ratios, figures.values()))


PACKAGES = ("runtime", "sidindex", "sidindex_cli", "schemas", "pipelines")  # what a baseline checkout holds


def checkout(path: str) -> Path:
    """An argparse type for --baseline DIR: DIR, when it holds another checkout's packages (`git
    archive REV runtime sidindex sidindex_cli schemas pipelines | tar x -C DIR`); otherwise
    argparse's error. A folder without them would put nothing first on the path, and the
    "baseline" would silently run this checkout's code."""
    import argparse

    folder = Path(path)
    if folder.resolve() == Path(__file__).resolve().parents[1]:
        raise argparse.ArgumentTypeError(f"{path!r} is this checkout: give another checkout's packages")
    missing = [p for p in PACKAGES[:2] if not (folder / p / "__init__.py").is_file()]
    if missing:
        inside = sorted(str(d) for d in folder.glob("*/runtime/__init__.py"))
        hint = f" (it holds checkouts: {', '.join(str(Path(d).parents[1]) for d in inside)})" if inside else ""
        raise argparse.ArgumentTypeError(
            f"{path} holds no {' or '.join(p + '/' for p in missing)} package{hint}: give a folder that "
            f"`git archive REV {' '.join(PACKAGES)} | tar x -C DIR` filled")
    return folder


def host_speed(reps: int = 5) -> float:
    """ms one core of this host takes for a fixed pure-Python workload (dict updates, the best of
    `reps`): a guide to how the interpreter-bound parts of a server compare between two hosts
    (lent GPU hosts of one kind are not known to be alike). It moves with the host's load (17-26
    ms on the 2-core VM): take it before and after a run."""
    import time

    best = float("inf")
    for _ in range(reps):
        t, d = time.perf_counter(), {}
        for i in range(200_000):
            k = i & 1023
            d[k] = d.get(k, 0) + i
        best = min(best, time.perf_counter() - t)
    return best * 1e3
