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
