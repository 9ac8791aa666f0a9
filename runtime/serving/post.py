"""Post stage: SIDs -> ads -> exact filter -> ranked ads per request (docs/design.md §3, §8).

Every live beam expands into its ads (paused and deleted rows dropped); an ad reached through
several SIDs keeps its best score and that SID; the exact filter drops every ineligible ad (Bloom
false positives stop here). RANKS: by score, value or their reciprocal-rank fusion, then ad_id, a
total order. `expand` picks the host path (`runtime.ops.expand.host`: numba over the memory maps)
or `DevicePost` (`runtime.ops.expand` on the device, no host synchronisation, so a CUDA graph
captures it after the search). A request whose beams reach more than C pairs overflows: `result`
gives None, never a wrong answer. Details: docs/runtime.md ("Post stage"), docs/kernels.md.

Legend: B requests, K beams, L SID length, N catalog rows, C the pairs capacity of a request (the
caller's; by default the most (request, ad) pairs K beams can reach, at most DEFAULT_PAIRS), T the
result rows kept per request (min(top_k, C)), A a plane's attributes, M the most values a request
has for one attribute.
"""

from __future__ import annotations

import numpy as np
import torch

from runtime.index.served import POST_ARRAYS, ServedIndex, post_bounds
from runtime.ops.expand import DEFAULT_PAIRS, MAX_PAIRS, RANKS, PostLayout, expand_beams, expand_host
from runtime.requests import device_form, host_form
from runtime.result import Retrieved
from runtime.search.beam import Beams
from schemas.artifacts import MATCHER_PLANES
from sidindex.errors import ConfigError
from sidindex.request_encoding import EncodedRequests
from sidindex.requests import MAX_REQUEST_VALUES

# the device path packs a catalog row into 31 bits of its sort keys: larger catalogs run on the host
DEVICE_ROWS = 1 << 31
# `DevicePost.send` copies a result's counts and at most this many words of its first rows (256 KiB,
# about 10 us over PCIe) behind the graph; a result with more rows copies the rest when read
SENT_WORDS = 1 << 15


def check_rank(index: ServedIndex, rank: str) -> None:
    """rank is one of RANKS; value and fused need the snapshot's ad values (ConfigError)."""
    if rank not in RANKS:
        raise ConfigError(f"rank {rank!r}: expected one of {', '.join(RANKS)}")
    if rank != "score" and index.gtm.ad_value is None:
        raise ConfigError(f"rank {rank!r}: snapshot {index.id} carries no ad values; build it from a catalog with a "
                          "`value` column")


def on_device(index: ServedIndex) -> bool:
    """The index's post stage runs on its GPU (`DevicePost`): its post arrays are there, and its
    catalog has fewer than DEVICE_ROWS rows."""
    return index.post is not None and len(index.post["ads"]) < DEVICE_ROWS


def check_top_k(top_k: int | None) -> None:
    """top_k is None (every eligible ad) or a positive number of ads per request (ConfigError)."""
    if top_k is not None and top_k < 1:
        raise ConfigError(f"top_k {top_k}: expected a positive number of ads per request")


def expand(index: ServedIndex, requests: EncodedRequests, beams: Beams, top_k: int | None = None,
           stages: bool = False, rank: str = "score") -> Retrieved:
    """The eligible ads under the searched SIDs, ranked per request by `rank` (RANKS); `top_k`
    caps each request; `stages` also counts the ads passing each stage (a matcher plane's
    attributes) on its own.

    requests: the batch in either form (`runtime.requests.device_form`, `host_form`). Beams on a
    GPU with the index's post arrays there (`ServedIndex.post`) run `DevicePost`: at the default
    capacity, once more at the pairs the requests reached when one overflowed it, and past
    MAX_PAIRS on the host. Elsewhere the host path runs. Same result either way.
    """
    check_rank(index, rank)
    check_top_k(top_k)  # both paths refuse what one would: the host's loop would keep nothing
    host = host_form(requests)
    if beams.score.is_cuda and on_device(index):
        requests = device_form(requests, beams.score.device)
        post = DevicePost(index, *beams.score.shape, top_k=top_k, rank=rank, stages=stages)
        found = post.result(post.run(requests, beams))
        if found is not None:
            return found
        assert post.last_reached is not None  # `result` sets it
        most = int(post.last_reached.max())  # a request reached more pairs than the default capacity
        if most <= MAX_PAIRS:  # again, sized to them
            post = DevicePost(index, *beams.score.shape, top_k=top_k, rank=rank, stages=stages, pairs=most)
            found = post.result(post.run(requests, beams))
            assert found is not None  # every request's pairs fit
            return found
        if host is None:  # a staging's views: a caller of `DevicePost` gives the batch's own encoding
            raise ConfigError(f"a request reached {most:,} (request, ad) pairs, more than the device post stage "
                              f"holds ({MAX_PAIRS:,}): pass the requests' own encoding, for the host post stage")
    return Retrieved(**expand_host(index.snapshot, requests if host is None else host, beams, top_k, stages, rank))


# --- the device path ------------------------------------------------------------------------------

def post_tensors(index: ServedIndex, device: str | torch.device = "cpu") -> dict[str, torch.Tensor]:
    """The post stage's arrays of the index's snapshot as tensors on `device`, by contract name, as
    `ServedIndex.post` holds them on a GPU (uint64 bits as int64): for `DevicePost` on CPU
    tensors (tests) or any device."""
    snap = index.snapshot
    out = {}
    for n, a in snap.arrays().items():
        if n in POST_ARRAYS or n in snap.exact.arrays():
            a = a.view(np.int64) if a.dtype == np.uint64 else a
            out[n] = torch.from_numpy(np.array(a)).to(device)
    return out


class DevicePost:
    """The post stage on the device (`runtime.ops.expand`: Triton kernels around the exact filter's),
    for a batch of `batch` requests x `beams` beams.

    Every shape is fixed here: C = `pairs`, the (request, ad) pairs a request may reach (its
    capacity), T = min(top_k, C) result rows per request; the torch reference also takes M =
    `max_values` request values per attribute (the bound `sidindex.requests.requests_from`
    enforces; the kernels loop to each request's own). The kernels' work grows with the pairs the
    beams reach, their memory with C: about 80 bytes a slot for the score ranking (B x C x 80;
    value and fused need a few more), and the rows, B x T x 8F bytes. `pairs` None: the most pairs
    `beams` distinct leaves hold (`runtime.index.served.PostBounds.most_pairs`, the worst case, which never
    overflows), at most DEFAULT_PAIRS (65,536): `bounds_pairs`. A serving host chooses C from its
    traffic: `last_reached` holds each request's reached pairs after every `result`.

    `run` makes no host synchronisation, so it can be captured in a CUDA graph after the search;
    `result` copies the buffer's counts, then only the result rows in use, to the host (with
    `pinned`, through pinned memory the stage keeps: for a stage read batch after batch, as
    `runtime.Searcher`'s; a one-off stage would pay more to pin it than it saves). When a request's
    beams reached more than C pairs (an overflow), `result` returns None for the whole batch: run
    it again with a larger `pairs` (at least `last_reached.max()`), or on the host (`expand`).

        post = DevicePost(index, 16, 1024, top_k=100, pairs=8192)
        buffer = post.run(requests_on_device, beams)   # capturable
        retrieved = post.result(buffer)                # None: post.last_reached.max() > 8192

    arrays: the post arrays (`ServedIndex.post`, the default; `post_tensors` builds them anywhere).
    impl: `runtime.ops.expand`'s ("auto": its Triton kernels on a GPU, the torch reference elsewhere).
    The buffer's layout: `layout` (`runtime.ops.expand.PostLayout`).
    """

    def __init__(self, index: ServedIndex, batch: int, beams: int, *, top_k: int | None = None, rank: str = "score",
                 stages: bool = False, max_values: int = MAX_REQUEST_VALUES,
                 arrays: dict[str, torch.Tensor] | None = None, pinned: bool = False, impl: str = "auto",
                 pairs: int | None = None) -> None:
        check_rank(index, rank)
        post = index.post if arrays is None else arrays
        if post is None:
            raise ConfigError(f"snapshot {index.id} is served on {index.device}, whose post stage runs on the host; "
                              "the device post stage needs an index loaded onto a GPU (or pass its arrays)")
        self.arrays = post
        if len(self.arrays["ads"]) >= DEVICE_ROWS:
            raise ConfigError(f"snapshot {index.id} has {len(self.arrays['ads']):,} catalog rows; the device post "
                              f"stage serves fewer than {DEVICE_ROWS:,}: run the post stage on the host "
                              "(`expand` does)")
        check_top_k(top_k)
        if pairs is not None and not 1 <= pairs <= MAX_PAIRS:
            raise ConfigError(f"pairs {pairs}: expected a capacity of 1 to {MAX_PAIRS:,} (request, ad) pairs per "
                              "request")
        if rank != "score" and "ad_value" not in self.arrays:
            raise ConfigError(f"rank {rank!r}: the post arrays given for snapshot {index.id} carry no ad values")
        self.index, self.rank, self.max_values, self.impl = index, rank, max_values, impl
        bounds = index.post_bounds if arrays is None else post_bounds(arrays, index.snapshot)
        assert bounds is not None  # the loader makes them with the index's post arrays
        self.bounds = bounds
        # the capacity `pairs` None gives: the bound, at most DEFAULT_PAIRS (a stage holding no more
        # than this answers a batch past it on the host, or at a capacity sized to its reached pairs)
        self.bounds_pairs = max(1, min(self.bounds.most_pairs(beams), DEFAULT_PAIRS))
        if pairs is None:
            pairs = self.bounds_pairs
        self.layout = PostLayout(batch, beams, pairs, pairs if top_k is None else min(top_k, pairs),
                                 index.sid_length, rank, stages, "ad_value" in self.arrays)
        self.pinned = pinned
        self._host: torch.Tensor | None = None  # with `pinned`: `result`'s copies land here
        self._sent = 0  # words of the last `run`'s buffer `send` queued to `_host` (0: none)
        self._stream: torch.cuda.Stream | None = None  # `result`'s copies behind an event
        # (B,) int64 each request's reached pairs in the last `result`'s batch (None before one)
        self.last_reached: np.ndarray | None = None

    def check(self, requests: EncodedRequests) -> None:
        """Refuse a batch with more values per attribute than the stage was sized for (ConfigError),
        from the bound the host knows (`PlaneQueries.most`): no sync."""
        for q in requests.planes:
            if not q.single and q.max_queries > self.max_values:
                raise ConfigError(f"{requests.source}: a request has {q.max_queries} values for one attribute; the "
                                  f"device post stage was sized for {self.max_values} (read the requests with "
                                  "that bound, or pass max_values)")

    def run(self, requests: EncodedRequests, beams: Beams) -> torch.Tensor:
        """The post stage of one batch into one int64 buffer (`result` reads it); no host sync.

        requests: the batch on the device (`runtime.requests.to_device`, exact queries included);
        beams: tokens (B, K, L) int64, score (B, K) float32, leaf (B, K) int64 on the device.
        """
        self.check(requests)
        return expand_beams(self.layout, self.arrays, self.bounds.ad_order, self.bounds.steps, requests, beams,
                            self.max_values, self.impl)

    def send(self, buffer: torch.Tensor) -> None:
        """Queue the copy of a `run`'s counts and first result rows (at most SENT_WORDS words of them)
        to the stage's pinned memory, behind the run on its stream, with no wait: `result` then waits
        once and reads them there, copying only rows past them (with `pinned`, on a GPU)."""
        if not (buffer.is_cuda and self.pinned):
            return
        lay = self.layout
        head = len(lay.counts) * lay.batch
        n = min(len(buffer), head + min(lay.batch * lay.kept * lay.row_words, SENT_WORDS))
        host = self._pinned(len(buffer))
        host[:n].copy_(buffer[:n], non_blocking=True)
        self._sent = n
        self._copies(buffer.device)  # made with the pinned memory rather than at a batch

    def _copies(self, device: torch.device) -> torch.cuda.Stream:
        """The stream `result` copies rows on behind a batch's event (made once)."""
        if self._stream is None:
            self._stream = torch.cuda.Stream(device)
        return self._stream

    def _pinned(self, n: int) -> torch.Tensor:
        if self._host is None or len(self._host) < n:
            self._host = torch.empty(n, dtype=torch.int64, pin_memory=True)
        return self._host

    def _fetch(self, buffer: torch.Tensor, lo: int, hi: int, ready: torch.cuda.Event | None) -> np.ndarray:
        """buffer[lo:hi] on the host: with `pinned`, from a GPU through the stage's pinned memory
        (overwritten by the next call), the part `send` queued copied already; the rest copied on
        the current stream, or with `ready` on a stream of the stage's own behind that event."""
        if not (buffer.is_cuda and self.pinned):
            return buffer[lo:hi].cpu().numpy()
        host = self._pinned(len(buffer))
        stream = torch.cuda.current_stream(buffer.device)
        if hi > self._sent:
            if ready is not None:
                stream = self._copies(buffer.device)
                stream.wait_event(ready)
            start = max(lo, self._sent)
            with torch.cuda.stream(stream):
                host[start:hi].copy_(buffer[start:hi], non_blocking=True)
            stream.synchronize()
        elif ready is not None:
            ready.synchronize()
        else:
            stream.synchronize()
        return host[lo:hi].numpy()

    def result(self, buffer: torch.Tensor, ready: torch.cuda.Event | None = None) -> Retrieved | None:
        """The `Retrieved` of a `run`'s buffer: its counts, then the rows in use, to the host; None
        when a request overflowed (reached more than `layout.pairs` pairs: its rows were not
        computed). Either way `last_reached` holds the batch's reached pairs per request.
        ready: an event recorded behind the run and `send` (its stream may hold later work, another
        batch's): `result` waits for it alone, not for the stream."""
        lay = self.layout
        B, T, F = lay.batch, lay.kept, lay.row_words
        head = len(lay.counts) * B
        counts = dict(zip(lay.counts, self._fetch(buffer, 0, head, ready).reshape(-1, B).copy()))
        self.last_reached = counts["reached"]
        if (counts["reached"] > lay.pairs).any():
            self._sent = 0
            return None
        n = np.minimum(counts["eligible"], T)  # rows per request
        total = int(n.sum())
        # one copy (the pinned buffer serves the next call); the fields are views of it: copying
        # each strided column on its own costs five times as much
        rows = self._fetch(buffer, head, head + total * F, ready).reshape(total, F).copy()
        self._sent = 0  # the next run's buffer is another's
        parts, at = {}, 0
        for name, width in lay.fields:
            parts[name] = rows[:, at:at + width] if name == "sid" else rows[:, at]
            at += width
        req = np.repeat(np.arange(B, dtype=np.int64), n)
        rank = np.arange(total, dtype=np.int64) - np.repeat(np.cumsum(n) - n, n) + 1
        per_stage = {"ads_per_stage": {p: counts[f"stage_{p}"] for p in MATCHER_PLANES}} if lay.stages else {}
        return Retrieved(req, rank, parts["ad_row"], parts["ad_id"], parts["sid"],
                         parts["score"].astype(np.int32).view(np.float32), counts["sids"], counts["generated"],
                         counts["eligible"], **per_stage,
                         value=parts["value"].view(np.float64) if lay.has_value else None)
