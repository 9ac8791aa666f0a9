"""The serving path's shortcuts over Arrow buffers say what the column validator and the
contract say, where Arrow lets them see more than the batch's values: a null list whose slot
still spans values, a list array whose child holds values of no list (a slice, or nulls in a null
list's span), a batch whose schema was seen before, several batches back to back through one
reused arena.
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pytest

import runtime
from sidindex.errors import InputError
from sidindex.matchers.attribute import Attribute
from sidindex.request_encoding import encode_requests
from sidindex.requests import requests_from
from sidindex.targeting import BITMASK, BLOOM, TargetingSpec
from tests.test_requests import check_encoding

SPEC = TargetingSpec((Attribute("country", BITMASK, values=("US", "GB")),
                      Attribute("locations", BLOOM, bits=128, hashes=2)))


def batch(locations: pa.Array, country=("US", None, "FR")) -> pa.RecordBatch:
    n = len(locations)
    return pa.record_batch({"request_id": pa.array(range(n), pa.int64()),
                            "country": pa.array((list(country) * n)[:n], pa.string()), "locations": locations})


def spanning_null(values: list, null_span: int) -> pa.Array:
    """Three lists: ["a"], a null one whose slot spans `null_span` of `values`, ["b"]."""
    offsets = pa.array([0, 1, 1 + null_span, 2 + null_span], pa.int32())
    mask = pa.array([False, True, False])
    return pa.ListArray.from_arrays(offsets, pa.array(["a", *values, "b"]), mask=mask)


def rows_of(locations: pa.Array) -> list[dict]:
    return [{"country": c, "locations": v} for c, v in zip(("US", None, "FR"), locations.to_pylist())]


def test_a_null_list_spanning_many_values_is_not_too_long():
    arr = spanning_null([f"x{i}" for i in range(100)], 100)
    assert arr.to_pylist() == [["a"], None, ["b"]]
    reqs = requests_from(batch(arr), SPEC, max_values=64)
    check_encoding(encode_requests(reqs, SPEC), rows_of(arr), SPEC)


def test_a_null_value_in_no_list_is_not_inside_a_list():
    arr = spanning_null([None], 1)  # the child's null lies in the null list's span
    assert arr.values.null_count == 1
    reqs = requests_from(batch(arr), SPEC)
    check_encoding(encode_requests(reqs, SPEC), rows_of(arr), SPEC)
    sliced = pa.array([["a", None], ["b"], ["c", "d"]]).slice(1)  # the null is in a row sliced off
    reqs = requests_from(batch(sliced), SPEC)
    check_encoding(encode_requests(reqs, SPEC), rows_of(sliced), SPEC)


def test_too_many_values_and_nulls_inside_are_still_refused():
    with pytest.raises(InputError, match="row 1: holds 65 values; at most 64"):
        requests_from(batch(pa.array([["a"], [f"x{i}" for i in range(65)], None])), SPEC)
    with pytest.raises(InputError, match="row 2: holds a null value inside its list"):
        requests_from(batch(pa.array([["a"], None, ["b", None]])), SPEC)


def test_a_schema_seen_before_is_checked_batch_by_batch():
    """The second batch of a schema takes the checks made for the first: its values are still
    its own to pass or fail."""
    good = batch(pa.array([["a"], ["b"], None]))
    requests_from(good, SPEC)
    dup = pa.record_batch({"request_id": pa.array([4, 4, 5], pa.int64()), "country": good.column(1),
                           "locations": good.column(2)})
    assert dup.schema.equals(good.schema)
    with pytest.raises(InputError, match="row 1: value 4 also appears in row 0"):
        requests_from(dup, SPEC)
    assert requests_from(good, SPEC).columns.num_rows == 3


def test_batches_through_one_arena_encode_as_alone():
    """A serving host encodes every batch into one arena and moves it in one copy: each batch's
    encoding and device form are what a batch encoded alone gives."""
    arena = np.zeros(1 << 12, dtype=np.int64)
    parts = [pa.array([["a", "b"], None, ["c"]]), pa.array([[], ["x"] * 5, ["y", "z"]]),
             spanning_null(["q"] * 3, 3)]
    for arr in parts:
        reqs = requests_from(batch(arr), SPEC)
        enc = encode_requests(reqs, SPEC, arena)
        assert enc.arena is arena
        check_encoding(enc, rows_of(arr), SPEC)
        dev, alone = runtime.to_device(enc, "cpu"), runtime.to_device(encode_requests(reqs, SPEC), "cpu")
        assert dev.stacked.layout == alone.stacked.layout
        for got, want in zip(dev.planes, alone.planes):
            assert got.most == want.most and got.rows.equal(want.rows) and got.ranges.equal(want.ranges)
        exact, exact_alone = dev.exact[1], alone.exact[1]
        assert exact is not None and exact_alone is not None
        assert exact.hashes.equal(exact_alone.hashes) and exact.hash_offsets.equal(exact_alone.hash_offsets)
