"""Seconds per named stage, so a long job can report where its time went."""

from __future__ import annotations

import time


class StageClock:
    """`lap(stage)` records the seconds since the previous lap (or since creation or `restart`)."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}
        self.restart()

    def restart(self) -> None:
        """Start the next stage now: time since the last lap belongs to no stage (e.g. waiting)."""
        self._start = time.perf_counter()

    def lap(self, stage: str) -> None:
        now = time.perf_counter()
        self.seconds[stage] = now - self._start
        self._start = now
