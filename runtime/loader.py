"""Snapshots onto a device, and a watcher that swaps to newly published ones (DESIGN.md §8).

`load_index` copies the arrays the search reads (the GTM trie and matcher tables) from the
snapshot's memory maps through pinned host memory to the device; the post stage (SID -> ads,
exact filter) keeps reading the host memory maps. The snapshot was validated when it was opened
(`sidindex.snapshot.open_snapshot`), so nothing unchecked reaches a kernel.
"""

from __future__ import annotations

import threading
import warnings
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from sidindex.errors import SidIndexError
from sidindex.matchers.bloom import bloom_layout
from sidindex.snapshot import Snapshot, open_snapshot, resolve_snapshot
from sidindex.snapshot.publish import current_id
from sidindex.timing import StageClock


@dataclass(frozen=True)
class DeviceIndex:
    """The GTM index as device tensors (names as in `sidindex.trie.build.GTMIndex`).

    node_offsets (num_nodes+1,) int64; csr_child_nodes (E,) int32; csr_tokens (E,) int16;
    bitmask_index, bloom_index (E,) int32; bitmask_table (R_bm, W_bm), bloom_table (R_bl, W_bl)
    int64 (the uint64 rows' bits); entry_keys (E,) int64 = parent node * V + token, ascending (the
    entry of a (node, token) pair by binary search); part_* as in GTMIndex, or None.
    max_children[d]: the widest fan-out of a depth-d node (mean_children[d]: the mean, rounded up);
    max_parts: most partitions of an entry.
    """

    snapshot: Snapshot
    device: torch.device
    level_sizes: tuple[int, ...]
    node_offsets: torch.Tensor
    csr_child_nodes: torch.Tensor
    csr_tokens: torch.Tensor
    bitmask_index: torch.Tensor
    bloom_index: torch.Tensor
    bitmask_table: torch.Tensor
    bloom_table: torch.Tensor
    entry_keys: torch.Tensor
    bloom_word_offsets: torch.Tensor  # (A_bl+1,) int32 first word of each bloom attribute
    bloom_words: tuple[int, ...]  # the same, on the host
    max_children: tuple[int, ...]
    mean_children: tuple[int, ...]  # mean fan-out of a depth-d node, rounded up
    leaf_start: int  # node id of leaf 0
    part_offsets: torch.Tensor | None = None
    part_bitmask_index: torch.Tensor | None = None
    part_bloom_index: torch.Tensor | None = None
    max_parts: int = 0
    load_info: dict = field(default_factory=dict)  # seconds, bytes moved

    @property
    def id(self) -> str:
        return self.snapshot.id

    @property
    def vocab_size(self) -> int:
        return max(self.level_sizes)

    @property
    def sid_length(self) -> int:
        return len(self.level_sizes)


def _stage(a: np.ndarray, device: torch.device) -> torch.Tensor:
    """A host tensor holding `a` (a read-only memory map): a pinned copy, ready for DMA to a GPU, or
    the memory map itself for the CPU (no copy; nothing writes to it)."""
    a = a.view(np.int64) if a.dtype == np.uint64 else a  # torch kernels handle bits as int64
    if device.type == "cpu":
        with warnings.catch_warnings():  # torch warns that the buffer is read-only; we never write
            warnings.simplefilter("ignore", UserWarning)
            return torch.from_numpy(a)
    staged = torch.empty(a.shape, dtype=getattr(torch, str(a.dtype)), pin_memory=True)
    staged.numpy()[...] = a
    return staged


def load_index(snap: Snapshot, device: str | torch.device = "cpu") -> DeviceIndex:
    """Copy an opened snapshot's GTM index to `device` ("cpu", "cuda", "cuda:1", ...).

    `load_info` of the result: bytes moved, and seconds in total and per phase (shape: a host pass
    over the offsets; stage: reading the memory maps into pinned memory; transfer: host to device,
    and the entry keys built there).
    """
    device = torch.device(device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SidIndexError("--device cuda: no CUDA device is available here (use --device cpu)")
    clock = StageClock()
    g = snap.gtm
    V = g.vocab_size
    fan_out = np.diff(g.node_offsets)
    per_depth = [fan_out[g.depth_offsets[d]:g.depth_offsets[d + 1]] for d in range(g.sid_length)]
    max_children = tuple(int(f.max()) for f in per_depth)
    mean_children = tuple(int(-(-f.sum() // len(f))) for f in per_depth)
    max_parts = int(np.diff(g.part_offsets).max()) if g.part_offsets is not None and len(g.part_offsets) > 1 else 0
    woff = np.asarray(bloom_layout(snap.spec).word_offsets, dtype=np.int32)
    clock.lap("shape")
    names = ["node_offsets", "csr_child_nodes", "csr_tokens", "bitmask_index", "bloom_index", "bitmask_table",
             "bloom_table"]
    if g.part_offsets is not None:
        names += ["part_offsets", "part_bitmask_index", "part_bloom_index"]
    staged = {n: _stage(getattr(g, n), device) for n in names}
    clock.lap("stage")
    arrays = {n: t.to(device, non_blocking=True) for n, t in staged.items()}
    # entry e's parent is the node whose child range holds it; entries are sorted by (parent, token)
    parent = torch.repeat_interleave(torch.arange(g.num_nodes, device=device), arrays["node_offsets"].diff())
    arrays["entry_keys"] = parent * V + arrays["csr_tokens"].long()
    del parent, staged
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    clock.lap("transfer")
    info = {"bytes": sum(int(getattr(g, n).nbytes) for n in names), "seconds": sum(clock.seconds.values()),
            "phases": clock.seconds}
    return DeviceIndex(snap, device, g.level_sizes, bloom_word_offsets=torch.from_numpy(woff).to(device),
                       bloom_words=tuple(int(w) for w in woff), max_children=max_children,
                       mean_children=mean_children, leaf_start=int(g.depth_offsets[g.sid_length]),
                       max_parts=max_parts, load_info=info, **arrays)


def load(path: str | Path, device: str | torch.device = "cpu", *, verify: bool = True) -> DeviceIndex:
    """Open (validating structure, and checksums unless verify=False) and load a ROOT's current
    snapshot or a snapshot directory."""
    return load_index(open_snapshot(resolve_snapshot(path), verify=verify), device)


class SnapshotWatcher:
    """Serves the snapshot a ROOT publishes, swapping to a newer one when `poll` sees it.

    A request takes `watcher.current` once and runs to the end on it: a swap replaces the
    attribute, never the object, so the old index is freed only when its last request drops it.
    A new snapshot that fails to open or validate is not swapped in; `last_error` says why and the
    old one keeps serving.
    """

    def __init__(self, root: str | Path, device: str | torch.device = "cpu", *, verify: bool = True) -> None:
        self.root, self.device, self.verify = Path(root), torch.device(device), verify
        self.current: DeviceIndex = load(self.root, self.device, verify=verify)
        self.last_error: str | None = None
        self._lock = threading.Lock()

    def poll(self) -> bool:
        """Check CURRENT; load and swap in a newly published snapshot. True when it swapped."""
        with self._lock:
            try:
                published = current_id(self.root)
                if published is None or published == self.current.id:
                    return False
                new = load(self.root / "snapshots" / published, self.device, verify=self.verify)
            except (SidIndexError, OSError) as e:
                self.last_error = f"kept serving snapshot {self.current.id}: {e}"
                return False
            self.current, self.last_error = new, None
            return True
