"""Constrained beam search over SIDs (docs/design.md §8).

Step d scores the previous step's beams, turns the logits into log-probabilities over the level's
`level_sizes[d]` tokens (`level_log_probs`, as `runtime.search.hf` and `runtime.studies.simulate`
do), masks the tokens the mode does not allow, and keeps each request's top candidates by
accumulated score. Everything stays on the device with shapes fixed by the beam sizes, so the loop
never waits on the host and can be captured in a CUDA graph.

beams[0] is the root (1); beams[d] (d >= 1) are kept after step d-1. Candidates rank in one order
(score, then the beam they extend, then token: `ops.order.top_k`), so every path keeps the same
beams for the same candidate scores (across devices a score's last bit may differ). A beam with
no allowed candidate dies; there is no fallback to unconstrained decoding. A step at which the
scorer gives a request's live beams no finite logit is recorded in `Beams.unscored` and refused
by `check_scored`. With `value_weight` λ > 0 the beams kept are the best by
score + λ log(max(v, 1e-6)) (§16). Details: docs/runtime.md ("Beam search"), docs/kernels.md.
"""

from __future__ import annotations

import math
import numbers
import os
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch

from runtime.index.served import ServedIndex
from runtime.ops.distribution import level_log_probs, unscored
from runtime.ops.impl import Impl
from runtime.ops.order import top_k
from runtime.scorers.codebook import CodebookScorer
from runtime.search.constraint import Constraint
from sidindex.errors import ConfigError, ScorerError
from sidindex.modes import Mode, parse_mode
from sidindex.request_encoding import EncodedRequests

DEFAULT_BEAMS = (1, 512, 1024, 1024)
NEG_INF = float("-inf")
# Bytes a candidate (one beam x token pair of a step) costs: the scorer's logits, their log-softmax
# and the masked scores (float32 each), its int64 ranking key (`ops.order.top_k`) and a float32
# temporary that computes it, and top-k's working copy (an int64 key and an int64 index, as a sort
# needs). An estimate of the widest step, not a bound.
CANDIDATE_BYTES = 4 + 4 + 4 + 8 + 4 + 8 + 8
VALUE_BYTES = 4 + 4  # the value-guided search's key, and the torch and CPU paths' bound beside it
MAX_VALUE_WEIGHT = 1e6  # far past any useful weight; a larger one overflows the float32 keys


class Scorer(Protocol):
    """The decoder seam (docs/design.md §12): logits for every beam of one step.

    step: 0..L-1; tokens: (B, K, step) int64 the tokens of each request's K beams so far (K = 1 at
    step 0); parent: (B, K) int64, the beam of the previous call (an index into request b's
    previous K beams) that beam k extends, or None when there are no previous beams to reuse (step
    0, and every call of the exhaustive scan in `runtime.studies.simulate`): a decoder with a KV cache
    reorders its cache with `parent` and runs only the new token, and computes from `tokens` when
    `parent` is None. Both are the scorer's own copies (`logits_of`): writing into them changes
    nothing the search keeps. Returns (B, K, V) float logits, of which the level's first
    `level_sizes[step]` are the distribution: the search log-softmaxes over them alone
    (`level_log_probs`), so a logit beyond the level's size is never read (-inf there or any
    other value), and dead beams may get any logits. A NaN or infinite logit counts as -inf (its
    token is never chosen); a step at which none of a request's live beams gets a finite logit is
    a broken model, refused (`check_scored`). `runtime.CodebookScorer` is the built-in
    one, `runtime.studies.decoder.DecoderScorer` a transformer with a KV cache. A scorer that also exposes
    `inputs`, a dict of the tensors it reads (refreshed in place per batch), can be captured with
    the whole search in a CUDA graph (`runtime.Searcher`). A scorer may be asked for a batch's
    search more than once (a `Searcher` searches a batch again wider when it overflows), each
    time from step 0. A scorer that ignores both arguments:

        def uniform(step: int, tokens: torch.Tensor, parent: torch.Tensor | None) -> torch.Tensor:
            return torch.zeros(*tokens.shape[:2], index.vocab_size, device=tokens.device)
    """

    def __call__(self, step: int, tokens: torch.Tensor, parent: torch.Tensor | None, /) -> torch.Tensor: ...


@dataclass(frozen=True)
class Beams:
    """tokens: (B, K, L) int64 SIDs; score: (B, K) float32 accumulated log-probability (-inf: dead),
    beams ranked per request by it (by the value-guided key with a value weight), equal ones by the
    search's fixed tie rule (module doc), so the order is the same on every device; leaf: (B, K)
    int64 leaf index of the SID (-1 when it is not a catalog SID, which only mode "none" produces,
    or the beam is dead)."""

    tokens: torch.Tensor
    score: torch.Tensor
    leaf: torch.Tensor
    # (L,) bool on the device: step d had more candidates than the width `beam_search`'s `widths`
    # capped it to, so the beams are not exact (the first such step is the one to widen: later
    # steps searched from inexact beams); None when no step's width was capped
    overflow: torch.Tensor | None = None
    # (B, L) bool on the device: request b had live beams entering step d and the scorer gave none
    # of them a finite logit among the level's tokens (`check_scored` refuses the search); None
    # when not recorded (or already checked)
    unscored: torch.Tensor | None = None

    @property
    def alive(self) -> torch.Tensor:
        return self.score > NEG_INF


def parse_beams(text: str | tuple[int, ...] | list[int], sid_length: int) -> tuple[int, ...]:
    """'1,512,1024,1024' -> (1, 512, 1024, 1024), checked against the SID length."""
    try:
        beams = tuple(int(b) for b in (text.replace(",", " ").split() if isinstance(text, str) else text))
    except ValueError:
        raise ConfigError(f"beams {text!r}: expected integers separated by commas, e.g. 1,512,1024,1024") from None
    if len(beams) != sid_length or any(b < 1 for b in beams):
        raise ConfigError(f"beams {text!r}: give {sid_length} positive beam sizes, one per SID position")
    if beams[0] != 1:
        raise ConfigError(f"beams {text!r}: the first step starts from the root, so beams[0] must be 1")
    return beams


def step_beams(beams: tuple[int, ...], vocab_size: int) -> tuple[int, ...]:
    """Beams entering each step: one root beam, then at most beams[d], and never more than the
    previous step's candidates."""
    out = [1]
    for b in beams[1:]:
        out.append(min(b, out[-1] * vocab_size))
    return tuple(out)


def search_bytes(beams: tuple[int, ...], batch: int, vocab_size: int, value: bool = False) -> int:
    """About the bytes the widest step of a search (value-guided with `value`) allocates: batch x K
    x V candidates."""
    return batch * max(step_beams(beams, vocab_size)) * vocab_size * (CANDIDATE_BYTES + VALUE_BYTES * value)


def free_bytes(device: torch.device) -> int:
    """Bytes a search can still allocate on `device`: free device memory plus what torch's caching
    allocator holds unused (CUDA); MemAvailable of /proc/meminfo, else the free pages (the CPU)."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return free + torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def check_fits(beams: tuple[int, ...], batch: int, vocab_size: int, device: torch.device, value: bool = False) -> None:
    """Refuse a search whose widest step would not fit the memory free on `device`, before it
    allocates anything, saying which beams (or batch) would."""
    need, free = search_bytes(beams, batch, vocab_size, value), free_bytes(device)
    if need <= free:
        return

    def uniform(width: int) -> tuple[int, ...]:
        return (1,) + (width,) * (len(beams) - 1)

    lo, hi = 0, max(beams)  # the widest uniform beams that fit, by bisection: lo fits (or is 0), hi does not
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if search_bytes(uniform(mid), batch, vocab_size, value) <= free else (lo, mid)
    advice = f"beams up to {','.join(map(str, uniform(lo)))} fit" if lo and len(beams) > 1 else ""
    per_batch = free // (need // batch)
    if 1 <= per_batch < batch:
        fewer = f"batches of at most {per_batch} request{'s' if per_batch > 1 else ''}"
        advice += f" (or {fewer})" if advice else f"{fewer} fit"
    raise ConfigError(f"beams {','.join(map(str, beams))} need about {_size(need)} for {batch} requests at once; "
                      f"about {_size(free)} are free on {device}; {advice or 'free memory first'}")


def _size(n: int) -> str:
    for unit, scale in (("TiB", 1 << 40), ("GiB", 1 << 30), ("MiB", 1 << 20)):
        if n >= scale:
            return f"{n / scale:,.0f} {unit}" if n >= 10 * scale else f"{n / scale:.1f} {unit}"
    return f"{n:,} bytes"


LAYOUTS = ("compact", "dense")


@torch.no_grad()  # a scorer module's logits carry no autograd graph through the search
def beam_search(index: ServedIndex, requests: EncodedRequests, scorer: Scorer,
                beams: tuple[int, ...] | str = DEFAULT_BEAMS, mode: Mode | str = Mode.CD_GTM,
                impl: Impl | str = Impl.AUTO, value_weight: float = 0.0, layout: str = "compact",
                widths: tuple[int | None, ...] | None = None) -> Beams:
    """Search SIDs for a batch of requests.

    requests: their encoding, best already on the index's device (`runtime.requests.to_device`; a
    host encoding is moved first). impl: the mask implementation, an `ops.impl.Impl` ("auto",
    "triton", "numba", "torch"). value_weight: λ >= 0 of the value-guided search (module
    doc); 0, the default, searches by log-probability alone. layout: how a constrained step lays
    out its candidates for top-k: "compact" (`ops.slots`: the beams' child entries only,
    the default) or "dense" (every beam x token, then a search for each chosen (node, token): the
    reference). widths: per step, the most slots the compact layout gives a request's candidates
    (None: the step's worst case, `ServedIndex.most_children`, the default for every step; a
    width is raised to the step's beams to keep and lowered to its worst case; the dense layout
    and mode none ignore them); a capped step that needs more sets `Beams.overflow`, and the
    beams are then not exact (`capped_widths`; `runtime.Searcher` searches again wider). Dead
    beams come back with score -inf, token 0 at every position and leaf -1. A search whose widest
    step would not fit the free memory is refused (ConfigError) before it allocates. A step at
    which the scorer gave some request's live beams no finite logit sets `Beams.unscored`, which
    this function does not read (that would wait for the device): pass the result to
    `check_scored` where it comes back to the host.
    """
    mode = parse_mode(mode, kway_available=index.kway)
    beams = parse_beams(beams, index.sid_length)
    check_value_weight(index, mode, value_weight)
    if layout not in LAYOUTS:
        raise ConfigError(f"layout {layout!r}: expected one of {', '.join(LAYOUTS)}")
    if widths is not None and (len(widths) != len(beams) or
                               any(w is not None and (not isinstance(w, numbers.Integral) or w < 1) for w in widths)):
        raise ConfigError(f"widths {widths!r}: give {len(beams)}, one per step, each a positive number of slots "
                          "or None (the step's worst case)")
    compact = mode.constrained and layout == "compact"
    constraint = Constraint(index, requests, mode, impl, compact)  # the walk and the mask of every step
    B, V, L, dev = constraint.batch, index.vocab_size, index.sid_length, index.device
    if not (dev.type == "cuda" and torch.cuda.is_current_stream_capturing()):  # a capture replays a checked search
        check_fits(beams, B, V, dev, value_weight > 0)
    node = torch.zeros(B, 1, dtype=torch.int64, device=dev)
    score = torch.zeros(B, 1, dtype=torch.float32, device=dev)
    tokens = torch.zeros(B, 1, 0, dtype=torch.int64, device=dev)
    req = torch.arange(B, device=dev)
    parent = overflow = None
    unscored_steps = []  # per step, (B,) bool on the device: read once, by `check_scored`
    for d in range(L):
        K = node.shape[1]
        logp = log_probs_of(scorer, d, tokens, parent, index.level_sizes[d]).reshape(B * K, V)
        unscored_steps.append(unscored(logp.reshape(B, K, V), score))
        k_next = min(beams[d + 1] if d + 1 < L else beams[-1], K * V)
        key = None
        if compact:  # slots of the beams' child entries; padded so top-k always has k_next of them
            most = max(index.most_children(d, K), k_next)
            width = None if widths is None else widths[d]
            slots = constraint.slots(node, score, most if width is None else max(min(width, most), k_next))
            if slots.width < most:  # top-k selects among fewer slots; a request with more child entries overflows
                if overflow is None:
                    overflow = torch.zeros(L, dtype=torch.bool, device=dev)
                overflow[d] = (slots.total > slots.width).any()
            cand = constraint.candidates(d, slots, node.reshape(-1), score.reshape(-1), logp, value_weight)
        elif mode.constrained:
            cand = constraint.mask(d, req.repeat_interleave(K), node.reshape(-1), score.reshape(-1), logp,
                                   value_weight)
        else:  # any token of this level (logp is -inf beyond it)
            cand = score.reshape(-1, 1) + logp
            cand = torch.where(torch.isnan(cand), NEG_INF, cand)
        if value_weight > 0:  # the kernel's value-guided key (`ops.gtm_mask.reference.value_key`)
            cand, key = cand
        cand = cand.reshape(B, -1)
        # candidates lie by beam (ranked), then token, in both layouts: ties fall to the lower position
        flat = top_k(cand if key is None else key.reshape(B, -1), k_next)
        score = cand.gather(1, flat)
        if compact:  # a slot names its beam and child entry
            parent, tok, node, tokens = constraint.chosen(slots, flat, score, tokens)
            continue
        alive = score > NEG_INF
        parent, tok = flat // V, flat % V
        tok = torch.where(alive, tok, 0)  # a dead slot's token is arbitrary: keep it in every level's range
        tokens = torch.cat([tokens.gather(1, parent[..., None].expand(-1, -1, d)), tok[..., None]], dim=2)
        node = constraint.child(node.gather(1, parent), tok, alive)
    alive = score > NEG_INF
    leaf = torch.where(alive & (node >= 0), node - index.leaf_start, -1)
    return Beams(torch.where(alive[..., None], tokens, 0), score, leaf, overflow, torch.stack(unscored_steps, dim=1))


def check_scored(unscored: torch.Tensor | np.ndarray | None, what: str, request_id=None) -> None:
    """Refuse a search in which the scorer gave some request's live beams no finite logit at a
    step: a ScorerError naming the scorer, the request and the step (the earliest step, then the
    first request). A broken model (NaN weights, an overflow) would otherwise pass for requests
    without eligible ads.

    unscored: `Beams.unscored` (B, L) bool on any device (or its numpy copy), copied to the host
    here: call it where the batch's results come back anyway (None: nothing to check); what: the scorer as the message
    names it (`scorer_name`); request_id: (n,) the batch's first n requests' ids, which the message
    names (rows beyond n, a padded batch's copies, are not checked); None: rows are named by their
    place in the batch."""
    if unscored is None:
        return
    bad = unscored if isinstance(unscored, np.ndarray) else unscored.cpu().numpy()
    if request_id is not None:
        bad = bad[:len(request_id)]
    if not bad.any():
        return
    d, b = (int(i) for i in np.argwhere(bad.T)[0])  # the earliest step, then the first request
    who = f"request {request_id[b]}" if request_id is not None else f"the batch's request {b} (counting from 0)"
    n = int(bad.any(axis=1).sum())
    also = f" ({n} of the batch's {len(bad)} requests got none at some step)" if n > 1 else ""
    e = ScorerError(f"{what} returned no finite logit for {who} at step {d}{also}: every logit of its beams at the "
                    "level's tokens was NaN or infinite, a broken model rather than a request without eligible "
                    "ads; check the model's weights and its inputs for this request")
    e.row, e.request_id = b, (request_id[b] if request_id is not None else None)
    raise e


def scorer_name(scorer: object) -> str:
    """"scorer 'MODULE:FACTORY'" for a user's factory's scorer (`runtime.scorers.factory`'s checked scorers
    carry it as `spec`), else the scorer's qualified name or type, as messages name it."""
    spec = getattr(scorer, "spec", None)
    if not isinstance(spec, str):
        name = getattr(scorer, "__qualname__", None)
        spec = name if isinstance(name, str) else type(scorer).__name__
    return f"scorer {spec!r}"


def logits_of(scorer: Scorer, step: int, tokens: torch.Tensor, parent: torch.Tensor | None) -> torch.Tensor:
    """scorer(step, tokens, parent), given copies of tokens (B, K, step) int64 and parent (B, K)
    int64 (or None): the search keeps the originals, which a scorer writing into its arguments
    must not change. Device copies, so neither a host wait nor a break in a captured graph; at
    most B x K x (step + 1) x 8 bytes a step."""
    return scorer(step, tokens.clone(), None if parent is None else parent.clone())


def log_probs_of(scorer: Scorer, step: int, tokens: torch.Tensor, parent: torch.Tensor | None,
                 size: int) -> torch.Tensor:
    """(B, K, V) float32 the step's log-probabilities over the level's first `size` tokens:
    `level_log_probs` of the scorer's logits (`logits_of`); the built-in `runtime.CodebookScorer`
    computes the same distribution in one fused kernel (`CodebookScorer.log_probs`)."""
    if type(scorer) is CodebookScorer:  # a subclass may give logits of its own
        return scorer.log_probs(step, tokens, parent, size)
    return level_log_probs(logits_of(scorer, step, tokens, parent), size)


def capped_widths(index: ServedIndex, beams: tuple[int, ...] | str,
                  slack: float | tuple[float, ...]) -> tuple[int | None, ...]:
    """`beam_search`'s widths: per step d, slack (or slack[d], one per step) x the candidates its
    beams' nodes have together when drawn at random (`ServedIndex.typical_children`), None where
    that reaches the worst case. Top-k's time grows with the width it selects from, and a step's
    worst case (its widest nodes together) can be twelve times the typical one. A slack of 0:
    None. A slack that is not a finite number >= 0 is a ConfigError."""
    L = index.sid_length
    slack = tuple(slack) if isinstance(slack, Iterable) else (slack,) * L
    check_slack(slack, L)
    out = []
    for d, K in enumerate(step_beams(parse_beams(beams, L), index.vocab_size)):
        cap = rounded_width(math.ceil(slack[d] * index.typical_children(d, K)))
        out.append(cap if 0 < cap < index.most_children(d, K) else None)
    return tuple(out)


def rounded_width(n: int) -> int:
    """n from 64 up rounded up to a multiple of 16 and of 1/16 of its power of 2 (at most 1/16
    wider): few widths, so snapshots and restarts meet shapes a warm Triton cache already holds
    (Triton specialises a size on its divisibility by 16). Smaller widths are few anyway."""
    if n < 64:
        return n
    step = max(16, 1 << (n.bit_length() - 5))
    return -(-n // step) * step


def check_slack(slack: tuple[float, ...], steps: int) -> None:
    """One finite slack >= 0 per step (ConfigError otherwise)."""
    if len(slack) != steps or not all(isinstance(s, numbers.Real) and 0 <= s < math.inf for s in slack):
        raise ConfigError(f"slack {slack!r}: expected a finite number >= 0 (times a step's typical candidates; "
                          f"0: every step's worst case), or {steps} of them, one per step")


def check_value_weight(index: ServedIndex, mode: Mode, value_weight: float) -> None:
    """A value weight is a λ in [0, MAX_VALUE_WEIGHT]; above 0 it needs the trie (a constrained
    mode) and a snapshot with ad values (ConfigError otherwise)."""
    if not 0 <= value_weight <= MAX_VALUE_WEIGHT:  # NaN too
        raise ConfigError(f"value weight {value_weight!r}: expected a number in [0, {MAX_VALUE_WEIGHT:g}] "
                          "(0: rank by log-probability)")
    if value_weight > 0 and not mode.constrained:
        raise ConfigError("value-guided search reads value bounds from the trie: use mode cd, cd+gtm or cd+gtm+kway")
    if value_weight > 0 and index.gtm.entry_value is None:
        raise ConfigError(f"snapshot {index.id} carries no ad values: build it from a catalog with a `value` column "
                          "to search by value")
