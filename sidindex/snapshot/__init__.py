"""Versioned snapshots of a built index: write, validate, memory-map (docs/design.md §7); publishing
and retention are `sidindex.root.Root`'s."""

from sidindex.snapshot.manifest import Manifest
from sidindex.snapshot.snapshot import Snapshot, open_snapshot, read_states, write_snapshot

__all__ = ["Manifest", "Snapshot", "open_snapshot", "read_states", "write_snapshot"]
