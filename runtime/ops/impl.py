"""Which implementation of a device op runs: the one set of names every op and entry point takes as
`impl`, and the one rule that resolves "auto" (the CD+GTM mask and the compact layout's
bookkeeping, `runtime.ops.gtm_mask`; the exact filter, `runtime.ops.exact_filter`; the post
stage's op, `runtime.ops.expand`).
"""

from __future__ import annotations

from enum import Enum

import torch

from sidindex.errors import ConfigError


class Impl(str, Enum):
    """An op's implementation; its value is the name users write."""

    AUTO = "auto"  # TRITON on CUDA (where the op's kernels take the shapes), the op's host path elsewhere
    TRITON = "triton"  # the Triton kernels: CUDA tensors, or CPU tensors under TRITON_INTERPRET=1
    NUMBA = "numba"  # the numba matcher on CPU tensors: the mask's host path (no other op has one)
    TORCH = "torch"  # the plain torch reference, on any device

    def __str__(self) -> str:
        return self.value


def resolve_impl(impl: Impl | str, device: torch.device, *, op: str, host: Impl = Impl.TORCH) -> Impl:
    """The implementation `op` runs on `device` for `impl`: `impl` itself, or for "auto" TRITON on
    CUDA, else `host` (the op's path off the GPU: NUMBA or TORCH). NUMBA is a
    choice only for an op whose host path it is. Raises ConfigError naming the choices."""
    choices = tuple(i for i in Impl if i is not Impl.NUMBA or host is Impl.NUMBA)
    if impl not in choices:
        raise ConfigError(f"impl {impl!r} for {op}: expected one of {', '.join(choices)} "
                          f"(auto: triton on a CUDA device, {host} elsewhere)")
    impl = Impl(impl)
    if impl is not Impl.AUTO:
        return impl
    return Impl.TRITON if device.type == "cuda" else host
