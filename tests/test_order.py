"""One order (docs/design.md §8): candidates of equal score keep the same beams in the same order on
every path, on random small catalogs and scorers whose logits tie (all equal, equal within the
hash level as the codebook scorer's, or drawn from three values).

- Beam search returns identical tokens, scores and leaves, in the same order, with the torch,
  numba (without a GPU) and Triton (under TRITON_INTERPRET=1 without a GPU) masks, the dense and
  compact layouts, and capped widths that do not overflow; value-guided search too.
- That order is the documented one: score, then the rank of the beam a candidate extends, then
  its token (a brute force that sorts each step's candidates stably, in float32 as the search adds).
- The post stage ranks those beams identically on the host and the device path (its torch
  reference and its kernels).
- `ops.order.top_k` ranks as a stable sort by score descending does, and bit for bit as the int64
  key's top-k over all candidates it replaced (`int64_key_top_k`), on adversarial scores: two or three
  values (ties straddling the k-th place), -0.0 beside 0.0, -inf (rows with fewer than k finite
  scores), float32 extremes and subnormals; on a GPU the CPU's result, inside a CUDA graph too.
- On a GPU, the CPU and CUDA searches keep the same beams in the same order (scores to the last
  bit of a log-softmax), and their post stages the same rows.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from runtime.ops.order import TIE_LIMIT, ordered, position_keys, top_k
from runtime.search.beam import beam_search
from runtime.serving.post import RANKS, expand
from sidindex.modes import Mode
from tests.conftest import interpreted
from tests.test_gtm import scenarios
from tests.test_post import IMPLS as POST_IMPLS
from tests.test_post import device_result, same
from tests.test_runtime import DEVICE, GPU, Case
from tests.test_value import VALUES

KINDS = ("uniform", "hash", "few")
FIELDS = ("tokens", "score", "leaf")


class TiedScorer:
    """Logits that depend only on the prefix and tie: "uniform" (all 0), "hash" (random below the
    last level, 0 at it: equal within the hash level, as `runtime.CodebookScorer`'s) or "few"
    (each -1, 0 or 1); -inf past each level's size, so the distribution is the level's whichever
    way a search normalises."""

    def __init__(self, sizes: tuple[int, ...], seed: int, kind: str) -> None:
        gen = torch.Generator().manual_seed(seed)
        self.sizes, self.V, L = sizes, max(sizes), len(sizes)
        table = torch.randn(L, 257, self.V, generator=gen) * 3
        if kind == "uniform":
            table.zero_()
        elif kind == "hash":
            table[L - 1] = 0
        else:
            table = torch.randint(-1, 2, table.shape, generator=gen).float()
        for d, size in enumerate(sizes):
            table[d, :, size:] = float("-inf")
        self.table = table

    def __call__(self, step: int, prefix: torch.Tensor, parent: torch.Tensor | None = None) -> torch.Tensor:
        weights = torch.tensor([31, 7, 3], dtype=torch.int64, device=prefix.device)[:prefix.shape[-1]]
        return self.table.to(prefix.device)[step][((prefix * weights).sum(-1) + prefix.shape[-1]) % 257]

    def log_probs(self, prefix: tuple[int, ...]) -> np.ndarray:
        """(V,) float32 log-probabilities after `prefix`, as the search computes them."""
        logits = self(len(prefix), torch.tensor([[list(prefix)]], dtype=torch.int64))
        size = self.sizes[len(prefix)]
        return torch.log_softmax(logits[..., :size], -1)[0, 0].numpy()


def beams_of(case: Case) -> tuple[int, ...]:
    return (1, 2, 3, 3)[:case.gtm.sid_length]


def paths(mode: Mode) -> list[tuple[str, str]]:
    """(impl, layout) of every path the test device runs for `mode` (mode none: one; numba on the CPU)."""
    if not mode.constrained:
        return [("torch", "dense")]
    impls = ("torch", "triton") if GPU else ("torch", "numba", "triton")
    return [(impl, layout) for impl in impls for layout in ("compact", "dense")]


def assert_same(a, b, what) -> None:
    for f in FIELDS:
        assert torch.equal(getattr(a, f).cpu(), getattr(b, f).cpu()), (what, f)


def ranked_brute_force(case: Case, r: int, scorer: TiedScorer, beams: tuple[int, ...], mode: Mode) -> list:
    """[(SID, score)] of request r's live final beams, ranked: per step every allowed child of every
    beam, enumerated by beam (ranked) then token, scored in float32, sorted stably by score."""
    live = [((), np.float32(0.0))]
    L = case.gtm.sid_length
    for d in range(L):
        cand = []
        for prefix, score in live:
            logp = scorer.log_probs(prefix)
            for t in case.allowed(r, prefix, mode):
                s = np.float32(score + logp[t])
                if not math.isnan(s) and s > -np.inf:
                    cand.append((prefix + (t,), s))
        cand.sort(key=lambda c: -c[1])
        live = cand[:beams[d + 1] if d + 1 < L else beams[-1]]
    return live


def ranked(found, r: int) -> list:
    alive = found.alive[r].cpu()
    return [(tuple(found.tokens[r, k].tolist()), np.float32(found.score[r, k])) for k in range(len(alive))
            if alive[k]]


TIED_SEARCHES = st.tuples(scenarios(max_ads=12), st.integers(0, 2**32 - 1), st.sampled_from(KINDS), st.integers(1, 3))


@settings(max_examples=20, deadline=None)
@given(TIED_SEARCHES)
def test_tied_logits_give_one_order_on_every_path(drawn):
    """The torch (and on the CPU numba) masks' paths."""
    _one_order(*drawn, kernels=False)


@settings(max_examples=interpreted(10, gpu=8), deadline=None)  # apart: under the interpreter an example costs seconds
@given(TIED_SEARCHES)
def test_tied_logits_give_the_kernels_one_order(drawn):
    """The Triton masks' paths, against the torch mask's compact path and the brute force."""
    _one_order(*drawn, kernels=True)


def _one_order(sc, seed, kind, cap, kernels: bool) -> None:
    case = Case(sc, DEVICE)  # on a GPU: the Triton kernels themselves
    host = case if DEVICE == "cpu" else Case(sc, "cpu")  # the brute force's float32 sums are the CPU's
    scorer, beams = TiedScorer(sc.level_sizes, seed, kind), beams_of(case)
    for mode in Mode:
        chosen = [(impl, layout) for impl, layout in paths(mode) if (impl == "triton") == kernels]
        if kernels:
            if not chosen:
                continue
            chosen.insert(0, ("torch", "compact"))  # what the kernels' beams must equal
        first = None
        for impl, layout in chosen:
            found = beam_search(case.index, case.dreq, scorer, beams, mode, impl, layout=layout)
            first = found if first is None else first
            assert_same(found, first, (mode, impl, layout))
            if layout == "compact":  # capped widths: the same beams wherever no step overflowed
                capped = beam_search(case.index, case.dreq, scorer, beams, mode, impl,
                                     widths=(cap,) * case.gtm.sid_length)
                if capped.overflow is None or not capped.overflow.any():
                    assert_same(capped, first, (mode, impl, "capped", cap))
        on_host = first if host is case else beam_search(host.index, host.dreq, scorer, beams, mode, "torch")
        for r in range(len(sc.requests)):
            assert ranked(on_host, r) == ranked_brute_force(host, r, scorer, beams, mode), (mode, r)


@settings(max_examples=interpreted(10), deadline=None)
@given(scenarios(max_ads=12), st.data(), st.integers(0, 2**32 - 1), st.sampled_from(KINDS),
       st.sampled_from([0.5, 1.0, 4.0]))
def test_value_guided_ties_give_one_order_on_every_path(sc, data, seed, kind, weight):
    sc = dataclasses.replace(sc, values=data.draw(st.lists(VALUES, min_size=len(sc.ads), max_size=len(sc.ads))))
    case = Case(sc, DEVICE)
    scorer, beams = TiedScorer(sc.level_sizes, seed, kind), beams_of(case)
    for mode in (Mode.CD, Mode.CD_GTM, Mode.CD_GTM_KWAY):
        first = None
        for impl, layout in paths(mode):
            found = beam_search(case.index, case.dreq, scorer, beams, mode, impl, value_weight=weight, layout=layout)
            first = found if first is None else first
            assert_same(found, first, (mode, impl, layout))


POST_DRAWS = st.tuples(scenarios(max_ads=12), st.data(), st.integers(0, 2**32 - 1), st.sampled_from(KINDS))


@settings(max_examples=10, deadline=None)
@given(POST_DRAWS)
def test_the_post_stage_ranks_tied_beams_alike_on_host_and_device(drawn):
    """The device path's torch reference."""
    _post_ranks_alike(*drawn, impls=tuple(i for i in POST_IMPLS if i != "triton"))


@settings(max_examples=interpreted(10), deadline=None)  # apart: under the interpreter an example costs seconds
@given(POST_DRAWS)
def test_the_post_kernels_rank_tied_beams_alike_on_host_and_device(drawn):
    _post_ranks_alike(*drawn, impls=("triton",))


def _post_ranks_alike(sc, data, seed, kind, impls: tuple[str, ...]) -> None:
    if data.draw(st.booleans()):
        sc = dataclasses.replace(sc, values=data.draw(st.lists(VALUES, min_size=len(sc.ads), max_size=len(sc.ads))))
    case = Case(sc, "cpu")  # the host path's beams; `device_post` moves them to the kernels' device
    scorer = TiedScorer(sc.level_sizes, seed, kind)
    for mode in Mode:
        found = beam_search(case.index, case.dreq, scorer, beams_of(case), mode, "torch")
        for rank in RANKS if sc.values is not None else ("score",):
            host = expand(case.index, case.req, found, None, False, rank)
            for impl in impls:
                same(host, device_result(case, found, impl, rank=rank))


@settings(max_examples=200, deadline=None)
@given(st.lists(st.sampled_from([0.0, -0.0, -1.0, -1.5, 2.0, float("-inf")]), min_size=1, max_size=40), st.data())
def test_top_k_ranks_as_a_stable_sort_by_score(values, data):
    k = data.draw(st.integers(1, len(values)))
    got = top_k(torch.tensor([values], dtype=torch.float32), k, data.draw(st.booleans()))[0].tolist()
    assert got == sorted(range(len(values)), key=lambda i: -values[i])[:k]  # stable: ties to the lower position


def int64_key_top_k(score: torch.Tensor, k: int) -> torch.Tensor:
    """The reference: `top_k` as it was, one int64 key per candidate (the score's `ordered` bits x 2^32
    + 2^32 - 1 - position) top-k'd over all N. score (B, N) float32 -> (B, k) int64."""
    key = ordered(score).mul_(TIE_LIMIT)
    key += torch.arange(TIE_LIMIT - 1, TIE_LIMIT - 1 - score.shape[1], -1, device=score.device)
    return key.topk(k, dim=1, sorted=True).indices


F32 = np.finfo(np.float32)
EXTREMES = [0.0, -0.0, float("-inf"), float("inf"), 1.0, -1.0, float(F32.max), float(-F32.max),
            float(F32.tiny), float(-F32.tiny), float(F32.smallest_subnormal), float(-F32.smallest_subnormal),
            float(np.nextafter(np.float32(1), np.float32(2))), float(F32.smallest_subnormal * 2)]
FLOATS = st.floats(width=32, allow_nan=False)


@st.composite
def scores(draw, max_b: int = 4, max_n: int = 80) -> np.ndarray:
    """(B, N) float32 scores from a small palette (two or three values: ties wherever the cut falls,
    extremes, ±0.0, -inf) or from any float32s mixed with it."""
    B, N = draw(st.integers(1, max_b)), draw(st.integers(1, max_n))
    palette = draw(st.lists(st.sampled_from(EXTREMES) | FLOATS, min_size=1, max_size=3))
    pick = st.sampled_from(palette)
    cell = draw(st.sampled_from([pick, pick | FLOATS, pick | st.sampled_from(EXTREMES)]))
    return np.array(draw(st.lists(st.lists(cell, min_size=N, max_size=N), min_size=B, max_size=B)), dtype=np.float32)


def stable_sort(row: list[float], k: int) -> list[int]:
    return sorted(range(len(row)), key=lambda i: -row[i])[:k]  # -0.0 == 0.0; stable: ties to the lower position


@settings(max_examples=150, deadline=None)
@given(scores(), st.data())
def test_top_k_is_the_int64_key_top_k_bit_for_bit(values, data):
    N = values.shape[1]
    k = data.draw(st.sampled_from([1, N, data.draw(st.integers(1, N))]))
    score = torch.from_numpy(values)
    got = top_k(score, k, float_first=data.draw(st.booleans()))  # either selection: below and from FLOAT_FIRST
    assert got.dtype == torch.int64 and got.shape == (values.shape[0], k)
    assert torch.equal(got, int64_key_top_k(score, k))
    assert got.tolist() == [stable_sort(row, k) for row in values.tolist()]


@settings(max_examples=50, deadline=None)
@given(st.integers(1, 3), st.integers(1, 300), st.data())
def test_top_k_keeps_the_lowest_ties_straddling_the_cut(B, N, data):
    """A few scores above one value that fills the rest of the row (-inf or ±0.0 among them), the cut
    anywhere inside the ties; a non-contiguous view, as the search's reshapes may give."""
    tie = data.draw(st.sampled_from([0.0, -0.0, float("-inf"), -2.5]))
    values = np.full((B, N), tie, dtype=np.float32)
    values[:, 1::2] = -tie if tie == 0 else tie
    above = data.draw(st.lists(st.integers(0, N - 1), max_size=N))
    values[:, above] = data.draw(st.sampled_from([1.0, float(F32.max), float(F32.smallest_subnormal)]))
    buffer = torch.full((B, 2 * N), float("nan"))  # NaN between the scores: never read
    buffer[:, ::2] = torch.from_numpy(values)
    score = buffer[:, ::2]
    k = data.draw(st.integers(1, N))
    assert torch.equal(top_k(score, k, data.draw(st.booleans())), int64_key_top_k(score.contiguous(), k))


@pytest.mark.parametrize("float_first", [False, True])
def test_top_k_edge_shapes(float_first):
    one = torch.tensor([[float("-inf")], [0.0], [-0.0]])
    assert top_k(one, 1, float_first).tolist() == [[0], [0], [0]]
    empty = top_k(torch.zeros(3, 5), 0, float_first)
    assert empty.shape == (3, 0) and empty.dtype == torch.int64
    assert top_k(torch.zeros(0, 5), 2, float_first).shape == (0, 2)
    with pytest.raises(RuntimeError):
        top_k(torch.zeros(2, 3), 4, float_first)  # k > N: as torch.topk
    with pytest.raises(ValueError, match="at most"):
        top_k(torch.zeros(1, 1).expand(1, TIE_LIMIT + 1), 1, float_first)


@pytest.mark.skipif(not GPU, reason="needs a CUDA device")
@settings(max_examples=30, deadline=None)
@given(st.integers(1, 16), st.sampled_from([1000, 4099, 65536, 200_003]), st.data())
def test_top_k_on_cuda_is_the_cpus_inside_a_cuda_graph(B, N, data):
    """Widths where CUDA's top-k takes its other paths, scores from three values plus -inf and -0.0
    (most of the row ties), k from 1 to 2048; eager and replayed from a CUDA graph."""
    gen = torch.Generator().manual_seed(data.draw(st.integers(0, 2**32 - 1)))
    palette = torch.tensor([-1.0, 0.0, -0.0, float("-inf"), 3.0])
    values = palette[torch.randint(0, 5, (B, N), generator=gen)]
    other = torch.rand(B, N, generator=gen) < data.draw(st.sampled_from([0.0, 0.01, 0.5]))
    values[other] = float(torch.randn(1, generator=gen))  # one more value, anywhere
    k = min(N, data.draw(st.sampled_from([1, 7, 1024, 2048])))
    want = int64_key_top_k(values, k)
    assert torch.equal(top_k(values, k), want)
    score = values.cuda()
    assert torch.equal(top_k(score, k).cpu(), want)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        top_k(score, k)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = top_k(score, k)
    score.copy_(values.flip(1).cuda())
    graph.replay()
    assert torch.equal(out.cpu(), int64_key_top_k(values.flip(1), k))


@pytest.mark.skipif(not GPU, reason="needs a CUDA device")
@settings(max_examples=25, deadline=None)
@given(scenarios(max_ads=15), st.integers(0, 2**32 - 1), st.sampled_from(("uniform", "hash")), st.integers(1, 3))
def test_cpu_and_cuda_keep_the_same_tied_beams(sc, seed, kind, cap):
    """Uniform levels give bit-equal log-probabilities on both devices, so ties are ties on both:
    the beams, their order and the post stage's rows must be identical (scores to the last bit
    of a log-softmax)."""
    cpu, gpu = Case(sc, "cpu"), Case(sc, "cuda")
    scorer = TiedScorer(sc.level_sizes, seed, kind)
    beams = beams_of(cpu)
    for mode in Mode:
        want = beam_search(cpu.index, cpu.dreq, scorer, beams, mode, "numba" if mode.constrained else "torch")
        for impl, layout in [("triton", "compact"), ("triton", "dense"), ("torch", "compact")]:
            got = beam_search(gpu.index, gpu.dreq, scorer, beams, mode, impl, layout=layout)
            assert torch.equal(got.tokens.cpu(), want.tokens) and torch.equal(got.leaf.cpu(), want.leaf), (mode, impl)
            assert torch.allclose(got.score.cpu(), want.score, rtol=1e-6, atol=1e-6), (mode, impl)
            capped = beam_search(gpu.index, gpu.dreq, scorer, beams, mode, impl, widths=(cap,) * len(beams))
            if capped.overflow is None or not capped.overflow.any():
                assert torch.equal(capped.tokens.cpu(), want.tokens), (mode, impl, cap)
        host = expand(cpu.index, cpu.req, want)
        device = expand(gpu.index, gpu.dreq, beam_search(gpu.index, gpu.dreq, scorer, beams, mode))
        for f in ("request", "rank", "ad_row", "sid"):
            assert np.array_equal(getattr(host, f), getattr(device, f)), (mode, f)


@settings(max_examples=40, deadline=None)
@given(scores(), st.booleans(), st.integers(0, 2**32 - 1), st.data())
def test_the_keys_kernel_is_the_torch_keys_bit_for_bit(values, with_pos, seed, data):
    """`position_keys` as one Triton kernel (on a GPU, else under TRITON_INTERPRET=1) equals its torch
    ops on adversarial floats (±0.0 one key, ±inf, subnormals, the float32 extremes), at each
    column's index or at given positions (anywhere below 2^32), on a strided view too, and rows
    longer than a program's block."""
    rng = np.random.default_rng(seed)
    if data.draw(st.booleans()):  # past one block of the kernel: the palette's values tiled
        values = np.resize(values, (values.shape[0], 2_500)).astype(np.float32)
    score = torch.from_numpy(values)
    pos = torch.from_numpy(rng.integers(0, 2**32, values.shape, dtype=np.int64)) if with_pos else None
    want = position_keys(score, pos, impl="torch")
    dev = score.to(DEVICE)
    got = position_keys(dev, None if pos is None else pos.to(DEVICE), impl="triton")
    assert got.dtype == torch.int64 and torch.equal(got.cpu(), want)
    strided = torch.from_numpy(np.ascontiguousarray(values.T)).to(DEVICE).T  # (B, N) with strides (1, B)
    assert torch.equal(position_keys(strided, None if pos is None else pos.to(DEVICE), impl="triton").cpu(), want)
