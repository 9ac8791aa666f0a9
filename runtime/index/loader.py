"""Snapshots onto a device, or onto several from one staged copy (docs/design.md §8).

`load_index` moves the arrays the search reads (the GTM trie and matcher tables) and, on a GPU,
those the post stage reads (SID -> ads, exact filter) from the snapshot's memory maps through pinned
host memory (`runtime.index.staging`), filled by several threads, to the device, or to several devices
from one pinned copy; the CPU serves the memory maps themselves. The snapshot was validated when it
was opened (`sidindex.snapshot.open_snapshot`), which also loaded its codebook into memory, so
nothing unchecked reaches a kernel and nothing reads the snapshot's files by path after `load`.
`load` (by path) onto GPUs copies the arrays' bytes there while the snapshot is hashed and
validated (the arrays of its one shard and the global ones; with several shards the global ones,
the join being made after the checks), and makes the index from them once it passed.
The result is a `runtime.index.served.ServedIndex` per device; `runtime.index.watcher.SnapshotWatcher` loads
each snapshot a ROOT publishes through `load`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from runtime.index.served import HOST_ARRAYS, POST_ARRAYS, ServedIndex, bound_names, post_bounds
from runtime.index.staging import ARENA, mapped, stage_arrays
from runtime.ops.planes import TableStack, order_by_first_use, stack_tables
from runtime.ops.planes.shared_rows import SharedRows, shared_rows
from schemas.artifacts import MATCHER_PLANES, plane_arrays
from sidindex.errors import ConfigError
from sidindex.signing import TrustKey
from sidindex.snapshot import Snapshot, open_snapshot
from sidindex.snapshot.arrays import same_memory
from sidindex.timing import StageClock
from sidindex.trie.build import GTMIndex

_DEVICE = re.compile(r"cpu|cuda(:[0-9]+)?")


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
    several, devices, bases = load_targets(device, base)
    out = _load(snap, devices, bases)
    return out if several else out[0]


def load_targets(device, base) -> tuple[bool, list[torch.device], list[ServedIndex | None]]:
    """(whether a list was given, the devices parsed, one base or None per device) of `load`'s
    arguments (ConfigError for a device this host lacks, or bases that do not pair with the devices)."""
    several = not isinstance(device, (str, torch.device))
    devices = [parse_device(d) for d in (device if several else [device])]
    bases = list(base) if several and base is not None else [base] * len(devices)
    if not devices or len(bases) != len(devices):
        raise ConfigError(f"load onto {len(devices)} device(s) with {len(bases)} base index(es): give one device at "
                          "least, and one base (or None) per device")
    return several, devices, bases


class _EarlyCopies:
    """A GPU load's copies made while its snapshot is hashed and validated (`open_snapshot`'s
    `while_checking`): the arrays the load moves (all but the host's own and those still the
    base's), staged once and copied to every GPU as bytes, the matcher planes straight into their
    stack (`stack_tables`); nothing reads them before the snapshot passed."""

    HOST_ONLY = frozenset(HOST_ARRAYS) - frozenset(POST_ARRAYS)  # read on the host alone

    def __init__(self, devices: list[torch.device], bases: list[ServedIndex | None]) -> None:
        self.gpus = list(dict.fromkeys(resolved_device(d) for d in devices if d.type == "cuda"))
        # a watcher's bases are one snapshot: arrays that are still its own keep their device tensors
        self.theirs = next((b.snapshot.arrays() for b in bases if b is not None), {})
        self.arrays: dict[str, np.ndarray] = {}  # what was copied
        self.copies: dict[torch.device, dict[str, torch.Tensor]] = {}  # but the planes
        self.stacks: dict[torch.device, TableStack] = {}  # the planes, when every one of them was copied
        self.clock = StageClock()

    def __call__(self, arrays: dict[str, np.ndarray]) -> None:
        todo = {n: a for n, a in arrays.items() if n not in self.HOST_ONLY
                and not (n in self.theirs and same_memory(a, self.theirs[n]))}
        kway = any(a.part_index in arrays for a in _PLANES)
        stacked = all(n in todo for a in _PLANES for n in (a.table, a.index, *([a.part_index] if kway else [])))
        self.clock.restart()
        with ARENA.lock:  # the arena is these copies' until every device has them
            staged = stage_arrays(todo, self.clock)
            for d in self.gpus:
                with torch.cuda.device(d):
                    self.copies[d] = {n: t.to(d, non_blocking=True) for n, t in staged.items()
                                      if not (stacked and n in _PLANE_NAMES)}
                    if stacked:
                        self.stacks[d] = stack_tables([staged[a.table] for a in _PLANES],
                                                      [staged[a.index] for a in _PLANES],
                                                      [staged[a.part_index] for a in _PLANES] if kway else None, d)
            for d in self.gpus:
                torch.cuda.synchronize(d)
        self.clock.lap("transfer")
        self.arrays = todo

    def on(self, device: torch.device, every: dict[str, np.ndarray]) -> tuple[dict[str, torch.Tensor],
                                                                               TableStack | None]:
        """The copies on `device` of the arrays of `every` (by contract name) that are the very
        arrays copied, and the planes' stack if every plane array is."""
        device = resolved_device(device)
        same = {n for n in self.arrays if n in every and same_memory(every[n], self.arrays[n])}
        copies = {n: t for n, t in self.copies.get(device, {}).items() if n in same}
        stack = self.stacks.get(device)
        planes = _PLANE_NAMES & every.keys()
        return copies, stack if stack is not None and planes <= same else None


_PLANES = [plane_arrays(p) for p in MATCHER_PLANES]
_PLANE_NAMES = frozenset(n for a in _PLANES for n in (a.table, a.index, a.part_index))


def resolved_device(device: torch.device) -> torch.device:
    """A bare "cuda" as the GPU it means on this thread (the current device is per thread); any
    other device as it is."""
    return torch.device("cuda", torch.cuda.current_device()) if device.type == "cuda" and device.index is None \
        else device


def _load(snap: Snapshot, devices: list[torch.device], bases: list[ServedIndex | None],
          early: _EarlyCopies | None = None) -> list[ServedIndex]:
    """`load_index` of `snap` onto `devices` (parsed), with one base or None per device: a
    complete `ServedIndex` per device, in order. early: the copies made while it was opened."""
    clock = StageClock()
    g = snap.gtm
    host = {n: getattr(g, n) for n in HOST_ARRAYS}
    served = {n: a for n, a in g.arrays().items() if n not in HOST_ARRAYS}
    every = snap.arrays()  # by contract name: `served` and the post stage's
    planes = _PLANE_NAMES & set(served)
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
    copied = {devices[i]: early.on(devices[i], every) if early is not None else ({}, None) for i in gpu}
    on_each = [set(c) | (planes if stack is not None else set()) for c, stack in copied.values()]
    moving -= on_each[0].intersection(*on_each[1:]) if on_each else set()  # on every GPU already: not staged again
    with ARENA.lock if gpu else contextlib.nullcontext():  # the arena is this load's until its copies are done
        staged = stage_arrays({n: every[n] for n in moving}, clock) if gpu else {}
        if not gpu:
            clock.lap("stage")  # the CPU serves the memory maps themselves: nothing to copy
        # per device, the index's fields: first those its copies give, every device's copies issued
        # before any device's reductions wait for them (the index is made once all are known)
        fields: list[dict] = []
        for device, base, k, pk, shares in zip(devices, bases, kept, post_kept, whole):
            early_copies, early_stack = copied.get(device, ({}, None))
            source = staged | early_copies if device.type == "cuda" else {n: mapped(a) for n, a in served.items()}
            post = None if device.type != "cuda" else {n: pk[n] if n in pk else source[n].to(device, non_blocking=True)
                                                       for n in _post_names(snap)}
            moved_bytes = sum(int(every[n].nbytes) for n in _post_names(snap) if n not in pk) if post is not None else 0
            # a base's post bounds hold while the arrays they come from are its own (else made below)
            bounds = base.post_bounds if post is not None and base is not None and bound_names(snap) <= pk.keys() \
                else None
            if shares:
                assert base is not None  # sharing every tensor: with a base
                gtm = GTMIndex.from_arrays(g.level_sizes, base.gtm.arrays() | host, MATCHER_PLANES)
                fields.append({"gtm": gtm, "post": post, "post_bounds": bounds,
                               "load_info": {"bytes": moved_bytes, "shared_with": base.id}})
                continue
            tables = base.tables if planes <= k and base is not None else None
            moved: dict[str, Any]  # by contract name: tensors on the device, or on the CPU the memory maps
            if device.type == "cuda":  # the planes into one stack, the rest as they are
                if tables is None and early_stack is not None:  # the planes were stacked while checking
                    tables = order_by_first_use(early_stack)
                elif tables is None:
                    parts = [source[a.part_index] for a in _PLANES] if g.part_offsets is not None else None
                    tables = order_by_first_use(stack_tables(
                        [source[a.table] for a in _PLANES], [source[a.index] for a in _PLANES], parts, device))
                moved = {n: source[n].to(device, non_blocking=True) for n in served if n not in k | planes}
                for i, a in enumerate(_PLANES):
                    moved |= {a.table: tables.tables[i], a.index: tables.index[i]}
                    if g.part_offsets is not None:
                        assert tables.part_index is not None  # stacked with the partitions
                        moved[a.part_index] = tables.part_index[i]
            else:
                moved = {n: source[n] for n in served if n not in k}
            if base is not None:  # (k is empty without one)
                moved = {n: base.gtm.arrays()[n] for n in k} | moved
            if base is not None and {"node_offsets", "csr_tokens"} <= k:
                entry_keys = base.entry_keys
            else:  # entry e's parent is the node whose child range holds it; entries are sorted by (parent, token)
                parent = torch.repeat_interleave(torch.arange(g.num_nodes, device=device), moved["node_offsets"].diff())
                entry_keys = parent * g.vocab_size + moved["csr_tokens"].long()
                del parent
            info: dict[str, Any] = {"bytes": sum(int(a.nbytes) for n, a in served.items() if n not in k) + moved_bytes}
            if k and base is not None:  # (k is empty without one)
                info["shared_with"] = base.id
            fields.append({"device": device, "gtm": GTMIndex.from_arrays(g.level_sizes, moved | host, MATCHER_PLANES),
                           "entry_keys": entry_keys, "leaf_start": int(g.depth_offsets[g.sid_length]),
                           "tables": tables, "post": post, "post_bounds": bounds, "load_info": info})
        for f, base, k, shares in zip(fields, bases, kept, whole):  # every device's copies issued
            if not shares:
                # the shared rows hold while the planes and offsets are the base's (an update of ad states)
                same_rows = base.shared_rows if base is not None and planes | {"node_offsets"} <= k else None
                f |= _shapes(f["gtm"], same_rows)
            if f["post"] is not None and f["post_bounds"] is None:
                f["post_bounds"] = post_bounds(f["post"], snap)
        for i in gpu:
            torch.cuda.synchronize(devices[i])
        del staged  # views of the arena, whose copies every device now has
    clock.lap("transfer")
    phases = dict(clock.seconds)
    timing = {"seconds": sum(phases.values()), "phases": phases}
    if len(devices) > 1:
        timing["devices"] = len(devices)
    if early is not None and early.arrays:  # made while the snapshot was checked: not in `seconds`
        timing["while_checking"] = {"bytes": sum(int(a.nbytes) for a in early.arrays.values()), **early.clock.seconds}
    out = []
    for f, base, shares in zip(fields, bases, whole):
        f["load_info"] |= timing
        # an index sharing every device tensor with its base keeps the base's shapes and `generation`
        if shares:
            assert base is not None
            out.append(dataclasses.replace(base, snapshot=snap, **f))
        else:
            out.append(ServedIndex(snap, **f))
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
         base: ServedIndex | Sequence[ServedIndex | None] | None = None,
         records: bool = True, trust_key: TrustKey | str | Path | None = None) -> ServedIndex | list[ServedIndex]:
    """Open (validating structure, and checksums unless verify=False) and load a ROOT's current
    snapshot or a snapshot directory onto `device`, or onto each of a list of devices (then a list
    of indexes, one per device: the snapshot is read, verified and staged once for all of them);
    `base`: an index served on `device` (one per device, or None) that the snapshot may share
    files and device tensors with (an update of it), see `open_snapshot` and `load_index`.
    On GPUs the copies run while the snapshot is hashed and checked: `load_info["while_checking"]`
    gives their bytes and phases (pin, stage, transfer), which are not in `load_info["seconds"]`.
    `records`: trust and keep the snapshot's check record in its ROOT (`open_snapshot(records=True)`,
    `sidindex.snapshot.records`): a snapshot whose build or update checked its structure has its
    digests verified instead of its structure checked again (0.3 s shorter at 30M SIDs), and a file
    the record lists as verified and unchanged since (the same inode, size, mtime and ctime) is not
    hashed again, unless `trust_key` is given; the load records what it verified. records=False
    checks the structure and hashes every file, whatever ROOT records.
    `trust_key`: an Ed25519 public key (or a PEM file of one): a snapshot it did not sign is
    refused before anything else is read (`sidindex.signing`)."""
    trust = TrustKey.of(trust_key)
    several, devices, bases = load_targets(device, base)  # before the work of opening
    # files an update shares with the served snapshot: the first base's (a watcher's bases are one snapshot)
    shared = next((b.snapshot for b in bases if b is not None), None)
    early = _EarlyCopies(devices, bases) if any(d.type == "cuda" for d in devices) else None
    snap = open_snapshot(path, verify=verify, base=shared, while_checking=early, records=records, trust=trust)
    out = _load(snap, devices, bases, early)
    return out if several else out[0]
