"""A snapshot as served on one device (`ServedIndex`), and the bounds its post stage needs
(`PostBounds`), docs/design.md §8. `runtime.index.loader` makes them; the search, the post stage and the
serving objects read them.

Legend: N catalog rows, S SIDs, E trie entries (child edges), V vocabulary.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property

import numpy as np
import torch

from runtime.ops.planes import TableStack
from runtime.ops.planes.shared_rows import SharedRows
from schemas.artifacts import plane_arrays
from sidindex.sid.codebook import Codebook
from sidindex.snapshot import Snapshot
from sidindex.targeting import TargetingSpec
from sidindex.trie.build import GTMIndex

# GTMIndex arrays the search does not read (kept as host memory maps); every other one moves to the device
HOST_ARRAYS = ("depth_offsets", "leaf_ad_offsets", "leaf_ads", "ad_value")
# arrays the post stage reads (SID -> ads, exact filter, ranking): on a GPU they move too (`ServedIndex.post`),
# with every exact-index array of the snapshot (`ExactIndex.arrays`: per plane its rows or hashes, and ad_state)
POST_ARRAYS = ("leaf_ad_offsets", "leaf_ads", "ad_value", "ads")


@dataclass(frozen=True)
class PostBounds:
    """What the device post stage (`runtime.serving.post.DevicePost`) needs of an index beyond its arrays,
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
            assert p.hash_offsets is not None
            runs = arrays[plane_arrays(p.name).exact_hash_offsets].view(len(p.hash_offsets), len(ads) + 1).diff(dim=1)
            most = runs.amax(dim=1).tolist() if runs.numel() else [0] * len(runs)
            steps[p.name] = tuple(int(m).bit_length() for m in most)
    order = torch.empty_like(ads)
    order[torch.argsort(ads)] = torch.arange(len(ads), device=ads.device)
    return PostBounds(counts, steps, order)


def bound_names(snap: Snapshot) -> set[str]:
    """The post arrays of `snap` its `PostBounds` is made from, by contract name."""
    return set(_BOUND_ARRAYS) | {plane_arrays(p.name).exact_hash_offsets for p in snap.exact.planes if p.rows is None}


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
         search tests once per request before its first step (`ops.planes.shared_rows`, one
         set for every depth), or None where they are many; () on the CPU.
    post: on a GPU, the arrays the post stage reads (`POST_ARRAYS` present in the snapshot, by
         their contract names) as device tensors; None on the CPU, whose post stage reads the
         memory maps.
    post_bounds: on a GPU, what the device post stage's shapes and keys need (`PostBounds`), made
         with `post`; None on the CPU.
    load_info: bytes moved, and seconds in total and per phase (`runtime.load_index`); from
         `runtime.load` onto a GPU also "while_checking", the copies made while it was opened.
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

    # what the snapshot and its trie hold, read once per index (cached_property writes the instance
    # dict, which a frozen dataclass allows): a batch reads them at every step
    @cached_property
    def id(self) -> str:
        return self.snapshot.id

    @cached_property
    def codebook(self) -> Codebook | None:
        """The codebook the snapshot carries, in memory since it was opened (the codebook scorer's)."""
        return self.snapshot.codebook

    @cached_property
    def spec(self) -> TargetingSpec:
        return self.snapshot.spec

    @cached_property
    def level_sizes(self) -> tuple[int, ...]:
        return self.gtm.level_sizes

    @cached_property
    def vocab_size(self) -> int:
        return self.gtm.vocab_size

    @cached_property
    def sid_length(self) -> int:
        return self.gtm.sid_length

    @cached_property
    def kway(self) -> bool:
        """The snapshot has k-way partitions (mode cd+gtm+kway can run)."""
        return self.gtm.part_offsets is not None

    @cached_property
    def _most_children(self) -> dict[tuple[int, int], int]:
        return {}  # by (depth, beams): an eager search asks at every step of every batch

    def most_children(self, depth: int, beams: int) -> int:
        """The most child entries `beams` distinct nodes of `depth` can have together: the sum of
        the `beams` largest fan-outs of that depth (the exact worst case of a search step)."""
        key = (depth, beams)
        if key not in self._most_children:
            self._most_children[key] = largest_sum(self.fan_out_counts[depth], beams)
        return self._most_children[key]

    def typical_children(self, depth: int, beams: int) -> int:
        """The child entries `beams` nodes of `depth` drawn at random have together, rounded up:
        `beams` x the depth's mean fan-out, at most `most_children` (a search step's typical
        width, where `most_children` is its worst case)."""
        counts = self.fan_out_counts[depth]
        entries = int(np.dot(counts, np.arange(len(counts))))
        typical = -(-beams * entries // max(int(counts.sum()), 1))
        return min(typical, self.most_children(depth, beams))


def largest_sum(counts: np.ndarray, k: int) -> int:
    """The sum of the k largest of a multiset given as counts (C + 1,) int64, counts[c] = how many
    of its members equal c (a histogram: no sort of the members)."""
    take = np.minimum(np.cumsum(counts[::-1]), k)  # members taken from the largest value down
    return int(np.dot(np.diff(take, prepend=0), np.arange(len(counts))[::-1]))

