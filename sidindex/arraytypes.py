"""The static type of an array in a record that lives on the host or on a device.

`GTMIndex`, `MatcherPlane`, `PlaneQueries`, `ExactQueries` and `EncodedRequests` hold numpy arrays
on the host; `runtime` moves them to a device as torch tensors in the same records (a served
GTMIndex keeps some arrays on the host beside the tensors). This package never imports torch, so
the one type both satisfy statically is Any; the docstrings give each array's shape and dtype.
"""

from __future__ import annotations

from typing import Any, TypeAlias

HostOrDevice: TypeAlias = Any  # np.ndarray on the host, torch.Tensor once on a device
