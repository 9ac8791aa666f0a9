"""What a search works out for its requests before the masks that read it: the query tables of the
tabled groups (`tables`) and each shared row's test (`shared_rows`: the few distinct union rows of
the depths near the root), for every request of the batch, in one launch.

Both are short chains of dependent loads over little data (at 30M SIDs, 16 requests' tables and
depths 0 and 1 with 2 distinct rows each), so a launch of its own costs its chain's time on a cold
cache: 7.5 us for the tables and about 4 us per depth's rows on the H200, against 141 us for a
search's masks. So a search in the compact layout makes them in its first step's mask launch
(`plan`, then `gtm_mask.kernel.gtm_mask_triton`'s `prepare`): programs past the mask's run
`kernel.prepare_block` beside it, and that step's lanes test their own rows query by query
(its depth's union rows near the root pass at their first queries). Elsewhere (the dense layout,
Hugging Face's processor) `prepared` launches them alone. The shared rows are tested query by
query too: they cannot wait for tables made in the same launch. This module plans on the host;
the kernel (`kernel`) and Triton load at the first launch.

Legend: B requests, T tabled groups, J mask words, CH chunks (`tables`), R shared rows.
"""

from __future__ import annotations

import dataclasses

import torch

from runtime.ops.planes import NIBBLES, QueryStack, stack_tables
from runtime.ops.planes.shared_rows import SharedRows


@dataclasses.dataclass(frozen=True)
class Plan:
    """The preparation of a batch: its QueryStack with the outputs allocated (`tables`, `passed`;
    written by the launch that carries the plan) and the shared rows to test (None: none)."""

    stacked: QueryStack
    shared: SharedRows | None


def plan(stacked: QueryStack, tables: bool = True, shared: SharedRows | None = None) -> Plan:
    """The preparation of the requests of `stacked` (a QueryStack on a device, or CPU tensors under
    the interpreter): tables (B, T, J, CH, 16) int64 of the layout's tabled groups (`tables`; None
    when not asked for or none is tabled; chunks past a group's words are 0) and passed (B, R)
    int8, 1 where the set's shared row i (of any depth of `shared`) passes request b on every group
    of its plane (None without shared rows)."""
    lay = stacked.layout
    tabled = lay.tabled if tables else []
    B = stacked.ranges.shape[0]
    dev = stacked.words.device
    out = None
    if tabled:
        J, CH = lay.table_words, lay.table_chunks
        ragged = any(lay.group_words[g] * NIBBLES < CH for g in tabled)  # else every entry is written
        out = (torch.zeros if ragged else torch.empty)((B, len(tabled), J, CH, 16), dtype=torch.int64, device=dev)
    passed = None if shared is None else torch.empty((B, shared.size), dtype=torch.int8, device=dev)
    ready = dataclasses.replace(stacked, tables=out, passed=passed, passed_rows=None if shared is None else shared.rows)
    return Plan(ready, shared)


def _launch(p: Plan, stack) -> None:
    """Make `p`'s outputs in a launch of their own (`kernel`: Triton loads at the first)."""
    from runtime.ops.prepare.kernel import launch

    launch(p.stacked, p.shared, stack)


def prepare(stacked: QueryStack, tables: bool = True, shared: SharedRows | None = None, stack=None) -> QueryStack:
    """`stacked` with its query tables and its test of the shared rows made (`plan`), in one launch.
    stack: the index's `planes.TableStack` the rows are of (needed with shared)."""
    p = plan(stacked, tables, shared)
    _launch(p, stack if stack is not None else stacked)
    return p.stacked


def query_tables(stacked: QueryStack) -> torch.Tensor | None:
    """(B, T, J, CH, 16) int64 the query tables of the layout's tabled groups, or None when no
    group is tabled (`prepare` without shared rows)."""
    return prepare(stacked).tables


def index_stack(index, stacked: QueryStack):
    """The `planes.TableStack` the kernels read `index`'s planes through: the served one, or for an
    index served on the CPU (the interpreter's tests) one stacked here, per call."""
    if index.tables is not None:
        return index.tables
    planes = index.gtm.planes
    return stack_tables([p.table for p in planes], [p.index for p in planes],
                        [p.part_index for p in planes] if index.gtm.part_offsets is not None else None,
                        stacked.words.device)


def shared_pass(index, requests, shared: SharedRows, stack=None) -> torch.Tensor:
    """(B, R) int8: 1 where row i of the shared rows' set passes request b on every word group of
    its plane, else 0. requests: EncodedRequests on the index's device; stack: `index_stack`'s,
    where the caller has it (on the CPU it is stacked per call)."""
    stack = stack if stack is not None else index_stack(index, requests.stacked)
    passed = prepare(requests.stacked, False, shared, stack).passed
    assert passed is not None  # made with the shared rows
    return passed


def planned(requests, index) -> tuple:
    """(requests, plan): `EncodedRequests` on `index`'s device whose QueryStack holds the outputs
    of `plan` (their query tables and, where the index has shared rows, each one's test), not yet
    made, and that plan, for a mask launch to make them (`gtm_mask.kernel.gtm_mask_triton`'s `prepare`)
    before any mask reads them."""
    shared = next((s for s in index.shared_rows if s is not None), None)
    p = plan(requests.stacked, True, shared)
    return dataclasses.replace(requests, stacked=p.stacked), p


def prepared(requests, index):
    """`EncodedRequests` on `index`'s device with what the mask kernels read made for them, in one
    launch of its own (`planned`). A mask of those requests on that index then launches neither."""
    ready, p = planned(requests, index)
    _launch(p, index_stack(index, ready.stacked))
    return ready


def passed_for(stacked: QueryStack, shared: SharedRows) -> torch.Tensor | None:
    """The requests' prepared test of `shared`'s set (`prepared`), or None where it was made for
    another set or not at all."""
    return stacked.passed if stacked.passed_rows is shared.rows and stacked.passed is not None else None
