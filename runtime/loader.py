"""Snapshots onto a device, and a watcher that swaps to newly published ones (DESIGN.md §8).

`load_index` moves the arrays the search reads (the GTM trie and matcher tables) from the
snapshot's memory maps through pinned host memory to the device; the post stage (SID -> ads, exact
filter) keeps reading the host memory maps. The snapshot was validated when it was opened
(`sidindex.snapshot.open_snapshot`), which also loaded its codebook into memory, so nothing
unchecked reaches a kernel and nothing reads the snapshot's files by path after `load`.
"""

from __future__ import annotations

import dataclasses
import re
import threading
import warnings
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from runtime.ops.gtm_mask.planes import TableStack, stack_tables
from schemas.artifacts import MATCHER_PLANES
from sidindex.errors import ConfigError, SidIndexError
from sidindex.root import Root
from sidindex.sid import Codebook
from sidindex.snapshot import Snapshot, open_snapshot
from sidindex.snapshot.arrays import same_memory
from sidindex.targeting import TargetingSpec
from sidindex.timing import StageClock
from sidindex.trie.build import GTMIndex

# GTMIndex arrays the search does not read (kept as host memory maps); every other one moves to the device
HOST_ARRAYS = ("depth_offsets", "leaf_ad_offsets", "leaf_ads", "ad_value")
# arrays the post stage reads (SID -> ads, exact filter, ranking): on a GPU they move too (`ServedIndex.post`),
# with every exact-index array of the snapshot (`ExactIndex.arrays`: per plane its rows or hashes, and ad_state)
POST_ARRAYS = ("leaf_ad_offsets", "leaf_ads", "ad_value", "ads")
_DEVICE = re.compile(r"cpu|cuda(:[0-9]+)?")


@dataclass(frozen=True)
class ServedIndex:
    """A snapshot as served on one device.

    gtm: the snapshot's GTMIndex with the arrays the search reads as tensors on `device`
         (node_offsets (num_nodes+1,) int64; csr_child_nodes (E,) int32; csr_tokens (E,) int16;
         per plane its index (E,) int32, part_index (T,) int32 or None and table (R_p, W_p) int64,
         the uint64 rows' bits); HOST_ARRAYS stay the host memory maps. The host index is `snapshot.gtm`.
    tables: on a GPU, the planes stacked for the Triton kernel (the planes' tensors are views of
         it, so nothing is held twice); None on the CPU, whose arrays are the memory maps themselves.
    entry_keys: (E,) int64 = parent node * V + token, ascending (the entry of a (node, token) pair
         by binary search).
    max_children[d]: the widest fan-out of a depth-d node; mean_children[d]: the mean, rounded up;
    max_parts: most partitions of an entry; leaf_start: node id of leaf 0 (the kernels' launch
    shapes and the search's bounds, known on the host).
    fan_out_counts[d]: (C_d + 1,) int64 on the host, how many depth-d nodes have c children, for
         c = 0..max_children[d] (the search's candidate bound, `most_children`).
    post: on a GPU, the arrays the post stage reads (`POST_ARRAYS` present in the snapshot, by
         their contract names) as device tensors; None on the CPU, whose post stage reads the
         memory maps.
    load_info: bytes moved, and seconds in total and per phase.
    generation: an identity that an index loaded with a `base` keeps only when it shares every
         device tensor with it (an update of ad states): CUDA graphs captured on one replay on the other.
    """

    snapshot: Snapshot
    device: torch.device
    gtm: GTMIndex
    entry_keys: torch.Tensor
    max_children: tuple[int, ...]
    mean_children: tuple[int, ...]
    max_parts: int
    leaf_start: int
    fan_out_counts: tuple[np.ndarray, ...] = ()
    tables: TableStack | None = None
    post: dict[str, torch.Tensor] | None = None
    load_info: dict = field(default_factory=dict)
    generation: object = field(default_factory=object)  # shared exactly by indexes sharing every device tensor

    @property
    def id(self) -> str:
        return self.snapshot.id

    def most_children(self, depth: int, beams: int) -> int:
        """The most child entries `beams` distinct nodes of `depth` can have together: the sum of
        the `beams` largest fan-outs of that depth (the exact worst case of a search step)."""
        counts = self.fan_out_counts[depth]
        take = np.minimum(np.cumsum(counts[::-1]), beams)  # nodes taken from the widest down
        return int(np.dot(np.diff(take, prepend=0), np.arange(len(counts))[::-1]))

    @property
    def codebook(self) -> Codebook | None:
        """The codebook the snapshot carries, in memory since it was opened (the codebook scorer's)."""
        return self.snapshot.codebook

    @property
    def spec(self) -> TargetingSpec:
        return self.snapshot.spec

    @property
    def level_sizes(self) -> tuple[int, ...]:
        return self.gtm.level_sizes

    @property
    def vocab_size(self) -> int:
        return self.gtm.vocab_size

    @property
    def sid_length(self) -> int:
        return self.gtm.sid_length

    @property
    def kway(self) -> bool:
        """The snapshot has k-way partitions (mode cd+gtm+kway can run)."""
        return self.gtm.part_offsets is not None


def parse_device(device: str | torch.device) -> torch.device:
    """'cpu', 'cuda' or 'cuda:N' as a torch device that exists on this host (ConfigError otherwise)."""
    text = str(device)
    if not _DEVICE.fullmatch(text):
        raise ConfigError(f"device {text!r} is not supported; use cpu, cuda or cuda:N (N the index of a GPU)")
    dev = torch.device(text)
    if dev.type == "cuda":
        n = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if n == 0:
            raise ConfigError(f"device {text!r}: no CUDA device is available on this host; use cpu")
        if (dev.index or 0) >= n:
            raise ConfigError(f"device {text!r}: this host has {n} CUDA device(s), cuda:0 to cuda:{n - 1}")
    return dev


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


def load_index(snap: Snapshot, device: str | torch.device = "cpu", *, base: ServedIndex | None = None) -> ServedIndex:
    """Move an opened snapshot's GTM index to `device` ("cpu", "cuda", "cuda:1", ...).

    base: an index already served on `device` (the snapshot an update started from): an array that
    is still its own (the same memory, as `open_snapshot(..., base=)` maps it) keeps its device
    tensor and is not moved again (the matcher planes, stacked on a GPU, move together). When none
    changed (an update of ad states only), the result shares every tensor, and its `generation`.
    `load_info` of the result: bytes moved, and seconds in total and per phase (shape: a host pass
    over the offsets; stage: reading the memory maps into pinned memory; transfer: host to device,
    and the entry keys built there).
    """
    device = parse_device(device)
    clock = StageClock()
    g = snap.gtm
    host = {n: getattr(g, n) for n in HOST_ARRAYS}
    served = {n: a for n, a in g.arrays().items() if n not in HOST_ARRAYS}
    kept = _kept(served, g.level_sizes, base, device)  # names whose device tensor is the base's
    if base is not None and kept == set(served):
        gtm = GTMIndex.from_arrays(g.level_sizes, base.gtm.arrays() | host, MATCHER_PLANES)
        post, moved_bytes = _post_arrays(snap, device, base)
        clock.lap("shared")
        return dataclasses.replace(base, snapshot=snap, gtm=gtm, post=post, load_info={
            "bytes": moved_bytes, "seconds": sum(clock.seconds.values()), "phases": clock.seconds,
            "shared_with": base.id})
    fan_out = np.diff(g.node_offsets)
    per_depth = [fan_out[g.depth_offsets[d]:g.depth_offsets[d + 1]] for d in range(g.sid_length)]
    max_children = tuple(int(f.max()) for f in per_depth)
    mean_children = tuple(int(-(-f.sum() // len(f))) for f in per_depth)
    fan_out_counts = tuple(np.bincount(f) for f in per_depth)
    max_parts = int(np.diff(g.part_offsets).max()) if g.part_offsets is not None and len(g.part_offsets) > 1 else 0
    clock.lap("shape")
    planes = {n for p in MATCHER_PLANES for n in (f"{p}_table", f"{p}_index", f"part_{p}_index")} & set(served)
    if device.type == "cuda" and not planes <= kept:
        kept -= planes  # one stack for all planes: restaged together
    staged = {n: _stage(a, device) for n, a in served.items() if n not in kept}
    clock.lap("stage")
    tables = base.tables if planes <= kept and base is not None else None
    if device.type == "cuda":  # the planes into one stack, the rest as they are
        if tables is None:
            parts = [staged.pop(f"part_{p}_index") for p in MATCHER_PLANES] if g.part_offsets is not None else None
            tables = stack_tables([staged.pop(f"{p}_table") for p in MATCHER_PLANES],
                                  [staged.pop(f"{p}_index") for p in MATCHER_PLANES], parts, device)
        moved = {n: t.to(device, non_blocking=True) for n, t in staged.items()}
        for i, p in enumerate(MATCHER_PLANES):
            moved |= {f"{p}_table": tables.tables[i], f"{p}_index": tables.index[i]}
            if g.part_offsets is not None:
                moved[f"part_{p}_index"] = tables.part_index[i]
    else:
        moved = staged
    moved = {n: base.gtm.arrays()[n] for n in kept} | moved
    if base is not None and {"node_offsets", "csr_tokens"} <= kept:
        entry_keys = base.entry_keys
    else:  # entry e's parent is the node whose child range holds it; entries are sorted by (parent, token)
        parent = torch.repeat_interleave(torch.arange(g.num_nodes, device=device), moved["node_offsets"].diff())
        entry_keys = parent * g.vocab_size + moved["csr_tokens"].long()
        del parent
    del staged
    post, post_bytes = _post_arrays(snap, device, base)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    clock.lap("transfer")
    info = {"bytes": sum(int(a.nbytes) for n, a in served.items() if n not in kept) + post_bytes,
            "seconds": sum(clock.seconds.values()), "phases": clock.seconds}
    if kept:
        info["shared_with"] = base.id
    gtm = GTMIndex.from_arrays(g.level_sizes, moved | host, MATCHER_PLANES)
    return ServedIndex(snap, device, gtm, entry_keys, max_children, mean_children, max_parts,
                       int(g.depth_offsets[g.sid_length]), fan_out_counts, tables, post, info)


def _post_arrays(snap: Snapshot, device: torch.device, base: ServedIndex | None
                 ) -> tuple[dict[str, torch.Tensor] | None, int]:
    """The post stage's arrays (`POST_ARRAYS`, the exact index) on a GPU, by contract name, and the
    bytes moved; an array that is the base's own (`same_memory`) keeps the base's tensor. None on the CPU."""
    if device.type != "cuda":
        return None, 0
    arrays = {n: a for n, a in snap.arrays().items() if n in POST_ARRAYS or n in snap.exact.arrays()}
    theirs = base.snapshot.arrays() if base is not None and base.post is not None and base.device == device else {}
    out, moved = {}, 0
    for n, a in arrays.items():
        if n in theirs and same_memory(a, theirs[n]):
            out[n] = base.post[n]
        else:
            out[n] = _stage(a, device).to(device, non_blocking=True)
            moved += int(a.nbytes)
    return out, moved


def _kept(served: dict[str, np.ndarray], snap_level_sizes: tuple[int, ...], base: ServedIndex | None,
          device: torch.device) -> set[str]:
    """The arrays of `served` that are `base`'s own (`same_memory`) on the same device,
    when both indexes have the same arrays (but an update's new liveness flags) and level sizes
    (else none: entry keys and launch shapes follow them)."""
    if base is None or base.device != device:
        return set()
    theirs = {n: a for n, a in base.snapshot.gtm.arrays().items() if n not in HOST_ARRAYS}
    if theirs.keys() - served.keys() or served.keys() - theirs.keys() - {"entry_live"} \
            or base.level_sizes != snap_level_sizes:  # only an update's liveness flags may be new
        return set()
    return {n for n, a in served.items() if n in theirs and same_memory(a, theirs[n])}


def load(path: str | Path, device: str | torch.device = "cpu", *, verify: bool = True,
         base: ServedIndex | None = None) -> ServedIndex:
    """Open (validating structure, and checksums unless verify=False) and load a ROOT's current
    snapshot or a snapshot directory; `base`: an index served on `device` that the snapshot may
    share files and device tensors with (an update of it), see `open_snapshot` and `load_index`."""
    device = parse_device(device)  # before the work of opening
    return load_index(open_snapshot(path, verify=verify, base=None if base is None else base.snapshot), device,
                      base=base)


class SnapshotWatcher:
    """Serves the snapshot a ROOT publishes, swapping to a newer one when `poll` sees it.

    A request takes `watcher.current` once and runs to the end on it: a swap replaces the
    attribute, never the object, so the old index is freed only when its last request drops it.
    Whatever a new snapshot holds, the old one keeps serving unless the new one loaded completely;
    `last_error` then says why it did not. An update of the served snapshot (`sidindex update`)
    shares its unchanged files: they are neither hashed nor mapped again, and when only ad states
    changed nothing moves to the device and a `Searcher` keeps replaying its graphs.
    """

    def __init__(self, root: str | Path, device: str | torch.device = "cpu", *, verify: bool = True) -> None:
        self.root, self.device, self.verify = Root(root), parse_device(device), verify
        self.current: ServedIndex = load(self.root.path, self.device, verify=verify)
        self.last_error: str | None = None
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
            # an update of the served snapshot shares its checked files and device arrays
            new = load(self.root.snapshot_dir(published), self.device, verify=self.verify, base=self.current)
        except Exception as e:  # a serving process must outlive any snapshot (a bad file, a bug in a reader)
            why = e if isinstance(e, SidIndexError) else f"{type(e).__name__} while polling {self.root.path}: {e}"
            self.last_error = f"kept serving snapshot {self.current.id}: {why}"
            self._refused = published
            return False
        else:
            self.current, self.last_error = new, None
            return True
        finally:
            self._lock.release()
