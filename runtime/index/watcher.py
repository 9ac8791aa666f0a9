"""`SnapshotWatcher`: serves the snapshot a ROOT publishes, swapping to a newer one when it appears
(docs/design.md §8). Each snapshot is loaded through `runtime.index.loader.load`, so a swap accepts exactly what
a load of the ROOT accepts.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

from runtime.index import loader
from runtime.index.served import ServedIndex
from sidindex.errors import SidIndexError
from sidindex.root import Root
from sidindex.signing import TrustKey


class SnapshotWatcher:
    """Serves the snapshot a ROOT publishes on one device or several, swapping to a newer one when
    `poll` sees it.

    A request takes `watcher.current` (with several devices, `watcher.indexes`, one per device in
    order) once and runs to the end on it: a swap replaces the attribute, never the object, so the
    old index is freed only when its last request drops it. With several devices the new snapshot is
    read, verified and staged once, and every device swaps together, only once each one loaded it.
    Whatever a new snapshot holds, the old one keeps serving unless the new one loaded completely;
    `last_error` then says why it did not. A new snapshot is accepted exactly when `load` of the
    ROOT accepts it, through the same checks (`sidindex validate` adds every sha256 and the matchers'
    cover, which a swap does not pay for). An update of the served snapshot (`sidindex update`)
    shares its unchanged files: they are neither hashed nor mapped again, and when only ad states
    changed nothing moves to the device and a `Searcher` keeps replaying its graphs. Given
    `trust_key`, a snapshot that key did not sign is refused as a corrupt one is (`runtime.load`).
    """

    def __init__(self, root: str | Path, device: str | torch.device | Sequence[str | torch.device] = "cpu", *,
                 verify: bool = True, trust_key: TrustKey | str | Path | None = None) -> None:
        _, devices, _ = loader.load_targets(device, None)
        self.root, self.devices, self.verify = Root(root), tuple(devices), verify
        self.trust = TrustKey.of(trust_key)
        self.device = devices[0]
        indexes = loader.load(self.root.path, devices, verify=verify, trust_key=self.trust)
        assert isinstance(indexes, list)  # one per device of the list
        self.indexes: tuple[ServedIndex, ...] = tuple(indexes)
        self.last_error: str | None = None
        # called with a newly loaded snapshot's indexes before it is swapped in (a `runtime.Retriever`
        # warms it there); one that raises keeps the old snapshot serving, as a failed load does
        self.before_swap: list[Callable[[tuple[ServedIndex, ...]], None]] = []
        self._refused: str | None = None  # the published id that failed: not loaded again until CURRENT moves
        self._lock = threading.Lock()

    def poll(self) -> bool:
        """Check CURRENT; load and swap in a newly published snapshot. True when it swapped.

        Never raises, and never waits for another poll: one already running makes this one return
        False at once. A published snapshot that failed to load is not read again until CURRENT
        names another one (a broken snapshot would otherwise be hashed in full at every poll).
        """
        if not self._lock.acquire(blocking=False):
            return False
        published = None
        try:
            published = self.root.current_id()
            if published != self._refused:
                self._refused = None  # CURRENT moved: whatever it names next is tried
            if published is None or published in (self.current.id, self._refused):
                return False
            # the ROOT, opened as `load` and `sidindex validate` open it (CURRENT read again, once
            # more if retention prunes it meanwhile); an update of the served snapshot shares its
            # checked files and device arrays
            loaded = loader.load(self.root.path, list(self.devices), verify=self.verify, base=list(self.indexes),
                                 trust_key=self.trust)
            assert isinstance(loaded, list)  # one per device of the list
            new = tuple(loaded)
            for hook in self.before_swap:
                hook(new)
        except Exception as e:  # a serving process must outlive any snapshot (a bad file, a bug in a reader)
            why = e if isinstance(e, SidIndexError) else f"{type(e).__name__} while polling {self.root.path}: {e}"
            self.last_error = f"kept serving snapshot {self.current.id}: {why}"
            self._refused = published
            return False
        else:
            self.indexes, self.last_error = new, None
            return True
        finally:
            self._lock.release()

    @property
    def current(self) -> ServedIndex:
        """The index served on the (first) device."""
        return self.indexes[0]
