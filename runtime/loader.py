"""Snapshots onto a device, and a watcher that swaps to newly published ones (DESIGN.md §8).

`load_index` moves the arrays the search reads (the GTM trie and matcher tables) and, on a GPU,
those the post stage reads (SID -> ads, exact filter) from the snapshot's memory maps through pinned
host memory, filled by several threads, to the device, or to several devices from one pinned copy;
the CPU serves the memory maps themselves. The snapshot was validated when it was opened
(`sidindex.snapshot.open_snapshot`), which also loaded its codebook into memory, so nothing
unchecked reaches a kernel and nothing reads the snapshot's files by path after `load`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import re
import threading
import warnings
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from runtime.ops.gtm_mask.planes import TableStack, stack_tables
from runtime.ops.gtm_mask.shared_rows import SharedRows, shared_rows
from schemas.artifacts import MATCHER_PLANES
from sidindex.artifact import THREADS
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
class PostBounds:
    """What the device post stage (`runtime.post.DevicePost`) needs of an index beyond its arrays,
    made from the post arrays where they are (`post_bounds`; the loader does it once per load).

    leaf_counts: (A + 1,) int64 on the host, how many leaves hold a ads (the most ads k distinct
        leaves hold together, `most_pairs`, bounds a request's (request, ad) pairs: its beams are
        distinct SIDs)
    steps: per `values` plane (by name), per attribute, the binary-search steps over an ad's hashes
        (the bit length of the most hashes an ad has)
    ad_order: (N,) int64 on the arrays' device, each catalog row's place in ascending ad_id order
        (ties broken by ad_id become part of one int64 sort key)
    """

    leaf_counts: np.ndarray
    steps: dict[str, tuple[int, ...]]
    ad_order: torch.Tensor

    def most_pairs(self, beams: int) -> int:
        return largest_sum(self.leaf_counts, beams)


# the post arrays `PostBounds` is made from (with every values plane's hash offsets)
_BOUND_ARRAYS = ("leaf_ad_offsets", "ads")


def post_bounds(arrays: dict[str, torch.Tensor], snap: Snapshot) -> PostBounds:
    """The `PostBounds` of post arrays (by contract name, on any device) of snapshot `snap`: a
    histogram, a few maxima and a sort on their device, a few numbers copied to the host."""
    counts = torch.bincount(arrays["leaf_ad_offsets"].diff()).cpu().numpy()  # no sort of S leaves
    ads, steps = arrays["ads"], {}
    for p in snap.exact.planes:
        if p.rows is None:  # a values plane: hash offsets (A*(N+1),), per attribute the ads' runs
            runs = arrays[f"exact_{p.name}_hash_offsets"].view(len(p.hash_offsets), len(ads) + 1).diff(dim=1)
            most = runs.amax(dim=1).tolist() if runs.numel() else [0] * len(runs)
            steps[p.name] = tuple(int(m).bit_length() for m in most)
    order = torch.empty_like(ads)
    order[torch.argsort(ads)] = torch.arange(len(ads), device=ads.device)
    return PostBounds(counts, steps, order)


def _bound_names(snap: Snapshot) -> set[str]:
    return set(_BOUND_ARRAYS) | {f"exact_{p.name}_hash_offsets" for p in snap.exact.planes if p.rows is None}


@dataclass(frozen=True)
class ServedIndex:
    """A snapshot as served on one device.

    gtm: the snapshot's GTMIndex with the arrays the search reads as tensors on `device`
         (node_offsets (num_nodes+1,) int64; csr_child_nodes (E,) int32; csr_tokens (E,) int16;
         per plane its index (E,) int32, part_index (T,) int32 or None and table (R_p, W_p) int64,
         the uint64 rows' bits); HOST_ARRAYS stay the host memory maps. The host index is `snapshot.gtm`.
    tables: on a GPU, the planes stacked for the Triton kernel (the planes' tensors are views of
         it, so nothing is held twice), each plane's rows renumbered in the order the entries, then
         the partitions, first use them (`planes.first_use_order`: a beam's children read rows side
         by side), so a device plane's row numbers are not the host index's; None on the CPU, whose
         arrays are the memory maps themselves.
    entry_keys: (E,) int64 = parent node * V + token, ascending (the entry of a (node, token) pair
         by binary search).
    max_children[d]: the widest fan-out of a depth-d node; mean_children[d]: the mean, rounded up;
    max_parts: most partitions of an entry; leaf_start: node id of leaf 0 (the kernels' launch
    shapes and the search's bounds, known on the host).
    fan_out_counts[d]: (C_d + 1,) int64 on the host, how many depth-d nodes have c children, for
         c = 0..max_children[d] (the search's candidate bound, `most_children`).
    shared_rows[d]: on a GPU, the few distinct matcher rows of depth d's child entries, which a
         search tests once per request before its first step (`ops.gtm_mask.shared_rows`, one
         set for every depth), or None where they are many; () on the CPU.
    post: on a GPU, the arrays the post stage reads (`POST_ARRAYS` present in the snapshot, by
         their contract names) as device tensors; None on the CPU, whose post stage reads the
         memory maps.
    post_bounds: on a GPU, what the device post stage's shapes and keys need (`PostBounds`), made
         with `post`; None on the CPU.
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
    shared_rows: tuple[SharedRows | None, ...] = ()
    post: dict[str, torch.Tensor] | None = None
    post_bounds: PostBounds | None = None
    load_info: dict = field(default_factory=dict)
    generation: object = field(default_factory=object)  # shared exactly by indexes sharing every device tensor

    @property
    def id(self) -> str:
        return self.snapshot.id

    def most_children(self, depth: int, beams: int) -> int:
        """The most child entries `beams` distinct nodes of `depth` can have together: the sum of
        the `beams` largest fan-outs of that depth (the exact worst case of a search step)."""
        return largest_sum(self.fan_out_counts[depth], beams)

    def typical_children(self, depth: int, beams: int) -> int:
        """The child entries `beams` nodes of `depth` drawn at random have together, rounded up:
        `beams` x the depth's mean fan-out, at most `most_children` (a search step's typical
        width, where `most_children` is its worst case)."""
        counts = self.fan_out_counts[depth]
        entries = int(np.dot(counts, np.arange(len(counts))))
        typical = -(-beams * entries // max(int(counts.sum()), 1))
        return min(typical, self.most_children(depth, beams))

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


def largest_sum(counts: np.ndarray, k: int) -> int:
    """The sum of the k largest of a multiset given as counts (C + 1,) int64, counts[c] = how many
    of its members equal c (a histogram: no sort of the members)."""
    take = np.minimum(np.cumsum(counts[::-1]), k)  # members taken from the largest value down
    return int(np.dot(np.diff(take, prepend=0), np.arange(len(counts))[::-1]))


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


# Staging copies a memory map into pinned memory in chunks of this many bytes on THREADS threads
# (numpy's copy releases the GIL): one thread copies about 1 GB/s out of a cold map, faulting its
# pages in one by one. The bench sets 1 to measure the single-threaded copy as a reference.
STAGE_CHUNK = 1 << 24
STAGE_THREADS = THREADS


def _host(a: np.ndarray) -> np.ndarray:
    return a.view(np.int64) if a.dtype == np.uint64 else a  # torch kernels handle bits as int64


class _Arena:
    """One pinned host buffer that every load of the process stages through, kept between loads:
    pinning memory costs about 0.6 s per GB on the H200 host (3.6 s of a 5.7 GB snapshot's load,
    against 0.13 s to copy into it), so a swap reuses the memory the previous load pinned. It grows
    (by a quarter more than asked, for a catalog that grows) when a snapshot needs more; `lock` is
    held from staging until every device's copy is done. `free_staging` gives it back."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.buffer: torch.Tensor | None = None

    def take(self, nbytes: int) -> torch.Tensor:
        """(nbytes,) uint8 pinned host memory (the caller holds `lock`)."""
        if self.buffer is None or len(self.buffer) < nbytes:
            self.buffer = None  # the old one first: the host keeps one
            self.buffer = torch.empty(nbytes + nbytes // 4, dtype=torch.uint8, pin_memory=True)
        return self.buffer[:nbytes]


_ARENA = _Arena()
_ALIGN = 64  # bytes: every staged array starts on a cache line


def free_staging() -> None:
    """Give back the pinned staging memory loads keep between swaps (the next load pins anew)."""
    with _ARENA.lock:
        _ARENA.buffer = None


def stage_arrays(arrays: dict[str, np.ndarray], clock: StageClock, *, pinned: bool = True) -> dict[str, torch.Tensor]:
    """Host tensors holding `arrays` (read-only memory maps), for DMA to GPUs: views of the pinned
    staging arena (`_Arena`; the caller holds its lock until the copies are done), or fresh
    unpinned tensors when `pinned` is False (needs no CUDA: the bench's host-copy figure), lap
    "pin", then filled by STAGE_THREADS threads copying STAGE_CHUNK-byte pieces, lap "stage"."""
    arrays = {n: _host(a) for n, a in arrays.items()}
    if pinned:
        starts = np.cumsum([0] + [-(-a.nbytes // _ALIGN) * _ALIGN for a in arrays.values()]).tolist()
        arena = _ARENA.take(starts[-1])
        out = {n: arena[lo:lo + a.nbytes].view(getattr(torch, str(a.dtype))).view(a.shape)
               for (n, a), lo in zip(arrays.items(), starts)}
        clock.lap("pin")
    else:
        out = {n: torch.empty(a.shape, dtype=getattr(torch, str(a.dtype))) for n, a in arrays.items()}
    pieces = []
    for n, a in arrays.items():
        src, dst = a.reshape(-1).view(np.uint8), out[n].numpy().reshape(-1).view(np.uint8)
        pieces += [(dst[lo:lo + STAGE_CHUNK], src[lo:lo + STAGE_CHUNK]) for lo in range(0, len(src), STAGE_CHUNK)]
    with ThreadPoolExecutor(STAGE_THREADS) as pool:
        for _ in pool.map(lambda piece: np.copyto(*piece), pieces):
            pass
    clock.lap("stage")
    return out


def _mapped(a: np.ndarray) -> torch.Tensor:
    """The memory map itself as a CPU tensor (no copy; nothing writes to it)."""
    with warnings.catch_warnings():  # torch warns that the buffer is read-only; we never write
        warnings.simplefilter("ignore", UserWarning)
        return torch.from_numpy(_host(a))


def load_index(snap: Snapshot, device: str | torch.device | Sequence[str | torch.device] = "cpu", *,
               base: ServedIndex | Sequence[ServedIndex | None] | None = None) -> ServedIndex | list[ServedIndex]:
    """Move an opened snapshot's GTM index to `device` ("cpu", "cuda", "cuda:1", ...), or to each
    of a list of devices (then a list of indexes, one per device, in order).

    base: an index already served on `device` (the snapshot an update started from), or one per
    device (None where there is none): an array that is still its own (the same memory, as
    `open_snapshot(..., base=)` maps it) keeps its device tensor and is not moved again (the
    matcher planes, stacked on a GPU, move together). When none changed (an update of ad states
    only), the result shares every tensor, and its `generation`.
    Several devices share one pinned copy of every array any GPU needs, which is then copied to
    every GPU at once.
    `load_info` of each result: bytes moved to its device, and seconds in total and per phase (pin:
    allocating pinned memory; stage: copying the memory maps into it, in parallel; transfer: host
    to every device, then on each device the entry keys, the launch shapes (fan-outs per depth) and
    the post stage's bounds); with several devices the phases are the shared pass's, and `devices`
    says how many took part.
    """
    several, devices, bases = _targets(device, base)
    out = _load(snap, devices, bases)
    return out if several else out[0]


def _targets(device, base) -> tuple[bool, list[torch.device], list[ServedIndex | None]]:
    """(whether a list was given, the devices parsed, one base or None per device) of `load`'s arguments."""
    several = not isinstance(device, (str, torch.device))
    devices = [parse_device(d) for d in (device if several else [device])]
    bases = list(base) if several and base is not None else [base] * len(devices)
    if not devices or len(bases) != len(devices):
        raise ConfigError(f"load onto {len(devices)} device(s) with {len(bases)} base index(es): give one device at "
                          "least, and one base (or None) per device")
    return several, devices, bases


def _load(snap: Snapshot, devices: list[torch.device], bases: list[ServedIndex | None]) -> list[ServedIndex]:
    clock = StageClock()
    g = snap.gtm
    host = {n: getattr(g, n) for n in HOST_ARRAYS}
    served = {n: a for n, a in g.arrays().items() if n not in HOST_ARRAYS}
    every = snap.arrays()  # by contract name: `served` and the post stage's
    planes = {n for p in MATCHER_PLANES for n in (f"{p}_table", f"{p}_index", f"part_{p}_index")} & set(served)
    kept, post_kept = [], []  # per device: the names whose device tensor is its base's
    for device, base in zip(devices, bases):
        k = _kept(served, g.level_sizes, base, device)  # names whose device tensor is the base's
        if device.type == "cuda" and not planes <= k:
            k -= planes  # one stack for all planes: restaged together
        kept.append(k)
        post_kept.append(_post_kept(snap, device, base))
    whole = [base is not None and k == set(served) for base, k in zip(bases, kept)]  # shares every tensor
    gpu = [i for i, d in enumerate(devices) if d.type == "cuda"]
    moving = {n for i in gpu for n in (set(served) - kept[i]) | (set(_post_names(snap)) - post_kept[i].keys())}
    with _ARENA.lock if gpu else contextlib.nullcontext():  # the arena is this load's until its copies are done
        staged = stage_arrays({n: every[n] for n in moving}, clock) if gpu else {}
        if not gpu:
            clock.lap("stage")  # the CPU serves the memory maps themselves: nothing to copy
        out = []
        for device, base, k, pk, shares in zip(devices, bases, kept, post_kept, whole):
            source = staged if device.type == "cuda" else {n: _mapped(a) for n, a in served.items()}
            post = None if device.type != "cuda" else {n: pk[n] if n in pk else source[n].to(device, non_blocking=True)
                                                       for n in _post_names(snap)}
            moved_bytes = sum(int(every[n].nbytes) for n in _post_names(snap) if n not in pk) if post is not None else 0
            # a base's post bounds hold while the arrays they come from are its own (else made below)
            bounds = base.post_bounds if post is not None and base is not None and _bound_names(snap) <= pk.keys() \
                else None
            if shares:
                gtm = GTMIndex.from_arrays(g.level_sizes, base.gtm.arrays() | host, MATCHER_PLANES)
                out.append(dataclasses.replace(base, snapshot=snap, gtm=gtm, post=post, post_bounds=bounds,
                                               load_info={"bytes": moved_bytes, "shared_with": base.id}))
                continue
            tables = base.tables if planes <= k and base is not None else None
            if device.type == "cuda":  # the planes into one stack, the rest as they are
                if tables is None:
                    parts = [source[f"part_{p}_index"] for p in MATCHER_PLANES] if g.part_offsets is not None else None
                    tables = stack_tables([source[f"{p}_table"] for p in MATCHER_PLANES],
                                          [source[f"{p}_index"] for p in MATCHER_PLANES], parts, device,
                                          by_first_use=True)
                moved = {n: source[n].to(device, non_blocking=True) for n in served if n not in k | planes}
                for i, p in enumerate(MATCHER_PLANES):
                    moved |= {f"{p}_table": tables.tables[i], f"{p}_index": tables.index[i]}
                    if g.part_offsets is not None:
                        moved[f"part_{p}_index"] = tables.part_index[i]
            else:
                moved = {n: source[n] for n in served if n not in k}
            moved = {n: base.gtm.arrays()[n] for n in k} | moved
            if base is not None and {"node_offsets", "csr_tokens"} <= k:
                entry_keys = base.entry_keys
            else:  # entry e's parent is the node whose child range holds it; entries are sorted by (parent, token)
                parent = torch.repeat_interleave(torch.arange(g.num_nodes, device=device), moved["node_offsets"].diff())
                entry_keys = parent * g.vocab_size + moved["csr_tokens"].long()
                del parent
            info = {"bytes": sum(int(a.nbytes) for n, a in served.items() if n not in k) + moved_bytes}
            if k:
                info["shared_with"] = base.id
            gtm = GTMIndex.from_arrays(g.level_sizes, moved | host, MATCHER_PLANES)
            out.append(ServedIndex(snap, device, gtm, entry_keys, (), (), 0, int(g.depth_offsets[g.sid_length]),
                                   tables=tables, post=post, post_bounds=bounds, load_info=info))  # shapes below
        for i, (index, base, k, shares) in enumerate(zip(out, bases, kept, whole)):  # every device's copies issued
            # the shared rows hold while the planes and offsets are the base's (an update of ad states)
            same_rows = base is not None and planes | {"node_offsets"} <= k
            shape = {} if shares else _shapes(index.gtm, base.shared_rows if same_rows else None)
            if index.post is not None and index.post_bounds is None:
                shape["post_bounds"] = post_bounds(index.post, snap)
            out[i] = dataclasses.replace(index, **shape)
        for i in gpu:
            torch.cuda.synchronize(devices[i])
        del staged  # views of the arena, whose copies every device now has
    clock.lap("transfer")
    phases = dict(clock.seconds)
    for index in out:
        index.load_info.update({"seconds": sum(phases.values()), "phases": phases}
                               | ({"devices": len(devices)} if len(devices) > 1 else {}))
    return out


def _shapes(gtm: GTMIndex, shared: tuple[SharedRows | None, ...] | None = None) -> dict:
    """The launch shapes and search bounds of a served trie (`ServedIndex` fields), from its device
    arrays where they are: fan-outs per depth reduced there, a few numbers to the host. shared: the
    depths' shared rows when they are known (else found here, on a GPU)."""
    fan_out, do = gtm.node_offsets.diff(), gtm.depth_offsets
    per_depth = [fan_out[int(do[d]):int(do[d + 1])] for d in range(gtm.sid_length)]
    most = torch.stack([f.max() for f in per_depth]).tolist()
    total = torch.stack([f.sum() for f in per_depth]).tolist()
    parts = gtm.part_offsets
    return {"max_children": tuple(int(m) for m in most),
            "mean_children": tuple(int(-(-t // max(len(f), 1))) for t, f in zip(total, per_depth)),
            "max_parts": int(parts.diff().max()) if parts is not None and len(parts) > 1 else 0,
            "fan_out_counts": tuple(torch.bincount(f, minlength=m + 1).cpu().numpy() for f, m in zip(per_depth, most)),
            "shared_rows": shared if shared is not None else shared_rows(gtm) if fan_out.is_cuda else ()}


def _post_names(snap: Snapshot) -> list[str]:
    """The arrays the post stage reads on a GPU (`POST_ARRAYS` present, the exact index), by contract name."""
    return [n for n in snap.arrays() if n in POST_ARRAYS or n in snap.exact.arrays()]


def _post_kept(snap: Snapshot, device: torch.device, base: ServedIndex | None) -> dict[str, torch.Tensor]:
    """The post stage's device tensors of `base` that `snap` keeps (its array is the base's own,
    `same_memory`), by name; empty on the CPU, whose post stage reads the memory maps."""
    if device.type != "cuda" or base is None or base.post is None or base.device != device:
        return {}
    theirs, ours = base.snapshot.arrays(), snap.arrays()
    return {n: base.post[n] for n in _post_names(snap) if n in theirs and same_memory(ours[n], theirs[n])}


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


def load(path: str | Path, device: str | torch.device | Sequence[str | torch.device] = "cpu", *, verify: bool = True,
         base: ServedIndex | Sequence[ServedIndex | None] | None = None) -> ServedIndex | list[ServedIndex]:
    """Open (validating structure, and checksums unless verify=False) and load a ROOT's current
    snapshot or a snapshot directory onto `device`, or onto each of a list of devices (then a list
    of indexes, one per device: the snapshot is read, verified and staged once for all of them);
    `base`: an index served on `device` (one per device, or None) that the snapshot may share
    files and device tensors with (an update of it), see `open_snapshot` and `load_index`."""
    several, devices, bases = _targets(device, base)  # before the work of opening
    # files an update shares with the served snapshot: the first base's (a watcher's bases are one snapshot)
    shared = next((b.snapshot for b in bases if b is not None), None)
    out = _load(open_snapshot(path, verify=verify, base=shared), devices, bases)
    return out if several else out[0]


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
    changed nothing moves to the device and a `Searcher` keeps replaying its graphs.
    """

    def __init__(self, root: str | Path, device: str | torch.device | Sequence[str | torch.device] = "cpu", *,
                 verify: bool = True) -> None:
        _, devices, _ = _targets(device, None)
        self.root, self.devices, self.verify = Root(root), tuple(devices), verify
        self.device = devices[0]
        self.indexes: tuple[ServedIndex, ...] = tuple(load(self.root.path, devices, verify=verify))
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
            new = tuple(load(self.root.path, list(self.devices), verify=self.verify, base=list(self.indexes)))
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
