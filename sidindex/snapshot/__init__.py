"""Versioned snapshots of a built index: write, validate, memory-map, publish (DESIGN.md §7)."""

from sidindex.snapshot.publish import publish, resolve_snapshot
from sidindex.snapshot.snapshot import Snapshot, open_snapshot, write_snapshot

__all__ = ["Snapshot", "open_snapshot", "publish", "resolve_snapshot", "write_snapshot"]
