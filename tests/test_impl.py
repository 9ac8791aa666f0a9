"""One resolver for every op's `impl` (`runtime.ops.impl`): "auto" is Triton on CUDA and the op's host
path elsewhere; an unknown value, or numba for an op without a numba path, is refused with a
ConfigError naming the choices, before anything runs."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings

from runtime.ops.impl import Impl, resolve_impl
from runtime.search.beam import beam_search
from sidindex.errors import ConfigError
from sidindex.modes import Mode
from tests.test_gtm import scenarios
from tests.test_runtime import Case

CPU, CUDA = torch.device("cpu"), torch.device("cuda")


def test_auto_is_triton_on_cuda_and_the_host_path_elsewhere():
    assert resolve_impl("auto", CUDA, op="an op") is Impl.TRITON
    assert resolve_impl("auto", CPU, op="an op") is Impl.TORCH
    assert resolve_impl(Impl.AUTO, CPU, op="an op", host=Impl.NUMBA) is Impl.NUMBA


@pytest.mark.parametrize("device", [CPU, CUDA])
def test_a_named_impl_is_kept_on_any_device(device):
    for name in ("triton", "torch"):
        assert resolve_impl(name, device, op="an op") is Impl(name)
    assert resolve_impl("numba", device, op="an op", host=Impl.NUMBA) is Impl.NUMBA


@pytest.mark.parametrize("impl", ["trition", "AUTO", "", None])
def test_an_unknown_impl_is_refused(impl):
    with pytest.raises(ConfigError, match=r"impl .* for the mask: expected one of auto, triton, numba, torch "
                                          r"\(auto: triton on a CUDA device, numba elsewhere\)"):
        resolve_impl(impl, CPU, op="the mask", host=Impl.NUMBA)


def test_numba_is_refused_where_the_op_has_no_numba_path():
    with pytest.raises(ConfigError, match=r"impl 'numba' for the exact filter: expected one of auto, triton, torch "
                                          r"\(auto: triton on a CUDA device, torch elsewhere\)"):
        resolve_impl("numba", CPU, op="the exact filter")


@settings(max_examples=3, deadline=None)
@given(scenarios())
def test_the_search_refuses_an_unknown_impl_before_it_runs(sc):
    case = Case(sc, "cpu")

    def scorer(step, tokens, parent):
        raise AssertionError("the search ran")

    beams = (1,) + (4,) * (case.index.sid_length - 1)
    for mode in Mode:
        with pytest.raises(ConfigError, match="impl 'trition' for the CD[+]GTM mask: expected one of auto, triton, "
                                              "numba, torch"):
            beam_search(case.index, case.dreq, scorer, beams, mode, impl="trition")


def test_the_post_stage_refuses_an_unknown_impl_before_it_runs():
    from types import SimpleNamespace

    from runtime.ops.expand import expand_beams

    layout = SimpleNamespace(batch=1, pairs=1)
    with pytest.raises(ConfigError, match=r"impl 'trition' for the post stage: expected one of auto, triton, torch "
                                          r"\(auto: triton on a CUDA device, torch elsewhere\)"):
        expand_beams(layout, {}, None, {}, None, SimpleNamespace(score=torch.zeros(1, 1)), 0, impl="trition")
