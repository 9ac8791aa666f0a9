"""Requests in memory and from files: one validation, one encoding.

The encoding is compared with a brute-force reference written here from the contract (mmh3 per
value, bits set one at a time), over random batches in every form a serving host holds them in;
a bad batch in memory is refused with the words a file with the same rows gets.
"""

from __future__ import annotations

import dataclasses

import mmh3
import numpy as np
import polars as pl
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import runtime
from sidindex.errors import InputError
from sidindex.exact import EXACT_SEED
from sidindex.matchers.bloom import BLOOM_SEED
from sidindex.request_encoding import encode_requests
from sidindex.requests import read_requests, requests_from
from sidindex.sample import sample_requests
from sidindex.targeting import BITMASK, BLOOM, Attribute, TargetingSpec

SPEC = TargetingSpec((Attribute("country", BITMASK, values=("US", "GB", "é中")),
                      Attribute("age", BITMASK, values=tuple(f"a{i}" for i in range(70))),
                      Attribute("locations", BLOOM, bits=128, hashes=3),
                      Attribute("apps", BLOOM, bits=64, hashes=1)))


def reference(columns: list[dict], spec: TargetingSpec):
    """(bitmask rows (B, W), per request per bloom attribute its query rows as a list, per bloom
    attribute (offsets, hashes)) from the contract, one value at a time."""
    bm, bl = spec.bitmask_layout, spec.bloom_layout
    B = len(columns)
    rows = np.zeros((B, bm.words), dtype=np.uint64)
    for b, r in enumerate(columns):
        for a, (name, values) in enumerate(zip(bm.names, bm.values)):
            v = r.get(name)
            bit = bm.offsets[a] + (values.index(v) if v in values else len(values))
            rows[b, bit // 64] |= np.uint64(1) << np.uint64(bit % 64)
    queries, exact = [], []
    for a, name in enumerate(bl.names):
        lo, hi = bl.word_offsets[a], bl.word_offsets[a + 1]
        per, offsets, hashes = [], [0], []
        for r in columns:
            vals = r.get(name) or []
            qs = []
            for v in vals:
                q = np.zeros(bl.words, dtype=np.uint64)
                for i in range(bl.hashes[a]):
                    bit = lo * 64 + mmh3.hash(v, BLOOM_SEED + i, signed=False) % bl.attribute_bits[a]
                    q[bit // 64] |= np.uint64(1) << np.uint64(bit % 64)
                qs.append(q)
            if not vals:
                q = np.zeros(bl.words, dtype=np.uint64)
                q[lo:hi] = np.uint64(2**64 - 1)
                qs.append(q)
            per.append(qs)
            hashes += sorted(mmh3.hash64(v, EXACT_SEED, signed=False)[0] for v in vals)
            offsets.append(len(hashes))
        queries.append(per)
        exact.append((np.array(offsets), np.array(hashes, dtype=np.uint64)))
    return rows, queries, exact


def check_encoding(enc, columns: list[dict], spec: TargetingSpec, embedding=None) -> None:
    rows, queries, exact = reference(columns, spec)
    bm_plane, bl_plane = enc.planes
    assert bm_plane.single and bm_plane.ranges.shape == (len(columns), 1, 2)
    got = np.stack([bm_plane.rows[s:e][0] for s, e in bm_plane.ranges[:, 0]])
    np.testing.assert_array_equal(got, rows)
    for a, per in enumerate(queries):
        for b, qs in enumerate(per):
            s, e = bl_plane.ranges[b, a]
            np.testing.assert_array_equal(bl_plane.rows[s:e], np.array(qs).reshape(-1, spec.bloom_layout.words))
    offs = enc.exact[1].hash_offsets
    for a, (o, h) in enumerate(exact):
        got_h = np.concatenate([enc.exact[1].hashes[offs[a, b]:offs[a, b + 1]] for b in range(len(columns))])
        np.testing.assert_array_equal(np.diff(offs[a]), np.diff(o))
        np.testing.assert_array_equal(got_h, h)
    if embedding is not None:
        np.testing.assert_array_equal(enc.embedding, embedding)


text = st.text(alphabet=st.characters(codec="utf-8"), max_size=12)
bitmask_value = st.one_of(st.none(), st.sampled_from(["US", "GB", "é中", "a0", "a69", "a35", "", "XX", "a70"]))
request_rows = st.lists(st.fixed_dictionaries({
    "country": bitmask_value, "age": bitmask_value,
    "locations": st.one_of(st.none(), st.lists(text, max_size=9)),
    "apps": st.one_of(st.none(), st.lists(st.sampled_from(["a", "b", "\x00", "🙂" * 5, "x" * 40]), max_size=4)),
}), min_size=1, max_size=20)


def as_form(rows: list[dict], form: str, slice_at: int):
    """The rows in one of the forms a host holds requests in (ids and a 2-d embedding added)."""
    rows = [{"request_id": i * 7 - 3, **r, "embedding": [float(i), -0.5]} for i, r in enumerate(rows)]
    pad = [{"request_id": 10_000 + i, "country": "US", "age": None, "locations": ["p"], "apps": [],
            "embedding": [0.0, 0.0]} for i in range(slice_at)]
    table = pa.Table.from_pylist(pad + rows)
    table = table.slice(slice_at)  # a slice: offsets into buffers that hold other rows
    if form == "table":
        return table
    if form == "batches":  # several chunks
        return pa.Table.from_batches(table.to_batches(max_chunksize=3)) if len(table) > 3 else table
    if form == "record batch":
        return table.combine_chunks().to_batches()[0] if len(table) else table
    if form == "large and dictionary":
        i = table.schema.get_field_index("country")
        table = table.set_column(i, "country", table.column("country").dictionary_encode())
        return table.cast(pa.schema([
            f.with_type(pa.large_string()) if f.name == "age" else
            f.with_type(pa.large_list(pa.large_string())) if f.name == "locations" else f for f in table.schema]))
    if form == "polars":
        return pl.from_arrow(table)
    assert form == "dicts"
    return table.to_pylist()


FORMS = ("table", "batches", "record batch", "large and dictionary", "polars", "dicts")


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(rows=request_rows, form=st.sampled_from(FORMS), slice_at=st.integers(0, 3))
def test_encoding_equals_the_contract_in_every_form(rows, form, slice_at):
    data = as_form(rows, form, slice_at)
    reqs = requests_from(data, SPEC)
    np.testing.assert_array_equal(reqs.request_id, [i * 7 - 3 for i in range(len(rows))])
    emb = np.array([[float(i), -0.5] for i in range(len(rows))], dtype=np.float32)
    check_encoding(encode_requests(reqs, SPEC), rows, SPEC, emb)
    # a reused arena gives the same encoding (and the same arena is written again)
    arena = np.full(1 << 12, 7, dtype=np.int64)
    enc = encode_requests(reqs, SPEC, arena)
    check_encoding(enc, rows, SPEC, emb)
    assert enc.arena is arena or len(arena) < 64


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(rows=request_rows, form=st.sampled_from(FORMS), slice_at=st.integers(0, 3), more=st.integers(0, 9))
def test_a_padded_batch_is_its_requests_then_its_last_repeated(rows, form, slice_at, more):
    """`Requests.padded` (a batch grown to a captured size) holds what gathering the rows
    0..n-1, n-1, n-1, ... gives, column by column and type by type, numbered anew, and encodes
    as the contract says for those rows."""
    reqs = requests_from(as_form(rows, form, slice_at), SPEC)
    n, size = len(reqs), len(reqs) + more
    want = reqs.taken(np.minimum(np.arange(size), n - 1))
    got = reqs.padded(size)
    np.testing.assert_array_equal(got.request_id, np.arange(size))
    np.testing.assert_array_equal(got.embedding, want.embedding)
    assert got.table.equals(want.table) and got.table.schema.equals(want.table.schema)
    assert got.columns.equals(want.columns) and got.columns.column_names == reqs.columns.column_names
    check_encoding(encode_requests(got, SPEC), rows + [rows[-1]] * more, SPEC, want.embedding)


@settings(max_examples=30, deadline=None)
@given(rows=request_rows, lo=st.integers(0, 5))
def test_the_device_form_is_one_copy_that_equals_the_arrays(rows, lo):
    """to_device of an encoding views one copy of its arena; the tensors hold the arrays' values
    and the query stack is what stacking the planes one by one gives."""
    enc = encode_requests(requests_from(as_form(rows, "table", 0), SPEC), SPEC)
    lo = min(lo, len(rows) - 1)
    part = enc.slice(lo, len(rows))
    dev = runtime.to_device(part, "cpu")
    one_by_one = runtime.to_device(dataclasses.replace(part, arena=None), "cpu")
    for got, want in zip(dev.planes, part.planes):
        np.testing.assert_array_equal(got.rows.numpy().view(np.uint64), want.rows)
        np.testing.assert_array_equal(got.ranges.numpy(), want.ranges)
    assert dev.stacked.layout == one_by_one.stacked.layout
    for got, want in zip(dev.planes, one_by_one.planes):
        for b in range(part.batch):
            for g in range(got.ranges.shape[1]):
                s, e = got.ranges[b, g].tolist()
                s2, e2 = want.ranges[b, g].tolist()
                assert torch.equal(got.rows[s:e], want.rows[s2:e2])
    words = dev.stacked.words
    for p, plane in enumerate(dev.planes):  # the stack's words hold the planes' rows where base says
        base = int(dev.stacked.base[p])
        assert torch.equal(words[base:base + plane.rows.numel()].view(plane.rows.shape), plane.rows)
    for got, want in zip(dev.exact, part.exact):
        assert (got is None) == (want is None)
        if got is not None:
            np.testing.assert_array_equal(got.hash_offsets.numpy(), want.hash_offsets)
            np.testing.assert_array_equal(got.hashes.numpy().view(np.uint64), want.hashes)
    np.testing.assert_array_equal(dev.embedding.numpy(), part.embedding)
    assert dev.stacked.words.untyped_storage().data_ptr() == torch.from_numpy(enc.arena).untyped_storage().data_ptr()


def test_sample_requests_encode_as_the_contract_says():
    from sidindex.targeting import load_targeting

    spec = load_targeting("data_samples/targeting.toml")
    table = sample_requests(40, spec, dim=8, seed=5)
    check_encoding(encode_requests(requests_from(table, spec), spec), table.to_pylist(), spec)


# Each bad batch: a mutation of 30 good sample requests, and the words its error must hold.
BAD = [
    ("missing column", lambda t: t.drop_columns(["country"]), "missing column 'country'"),
    ("id type", lambda t: t.set_column(0, "request_id", pa.array([str(i) for i in range(30)])),
     "column 'request_id': has type"),
    ("null id", lambda t: t.set_column(0, "request_id", pa.array([None] + list(range(1, 30)), pa.int64())),
     "column 'request_id', row 0: is null"),
    ("uint64 beyond int64", lambda t: t.set_column(0, "request_id", pa.array(
        list(range(2**63 - 29, 2**63)) + [2**63], pa.uint64())),
     "row 29: value 9223372036854775808 does not fit int64"),
    ("int64 extremes repeated", lambda t: t.set_column(0, "request_id", pa.array(
        [-2**63, 2**63 - 1] * 15, pa.int64())), "row 2: value -9223372036854775808 also appears in row 0"),
    ("duplicate id", lambda t: t.set_column(0, "request_id", pa.array([5] * 30, pa.int64())),
     "column 'request_id', row 1: value 5 also appears in row 0"),
    ("bitmask type", lambda t: t.set_column(1, "country", pa.array(list(range(30)))), "column 'country': has type"),
    ("bloom type", lambda t: t.set_column(t.schema.get_field_index("locations"), "locations",
                                          pa.array(["x"] * 30)), "column 'locations': has type"),
    ("too many values", lambda t: _set(t, "locations", 4, [f"geo:{i}" for i in range(65)]),
     "column 'locations', row 4: holds 65 values; at most 64"),
    ("null inside a list", lambda t: _set(t, "locations", 9, ["geo:00001", None]),
     "column 'locations', row 9: holds a null value inside its list"),
    ("NaN", lambda t: _emb(t, 6, 2, float("nan")), "column 'embedding', row 6: element 2 is nan"),
    ("1e19", lambda t: _emb(t, 6, 2, 1e19), "column 'embedding', row 6: element 2 is 1e+19, beyond the allowed"),
    ("-inf", lambda t: _emb(t, 3, 0, float("-inf")), "column 'embedding', row 3: element 0 is -inf"),
    ("short embedding", lambda t: t.set_column(t.schema.get_field_index("embedding"), "embedding", pa.array(
        [[0.5] * 8] * 7 + [[0.5] * 7] + [[0.5] * 8] * 22)), "column 'embedding', row 7: has 7 values, expected 8"),
    ("null embedding", lambda t: t.set_column(t.schema.get_field_index("embedding"), "embedding", pa.array(
        [[0.5] * 8] * 11 + [None] + [[0.5] * 8] * 18)), "column 'embedding', row 11: is null"),
    ("null element", lambda t: t.set_column(t.schema.get_field_index("embedding"), "embedding", pa.array(
        [[0.5] * 8] * 2 + [[0.5] * 7 + [None]] + [[0.5] * 8] * 27)), "column 'embedding', row 2: element 7"),
    ("embedding type", lambda t: t.set_column(t.schema.get_field_index("embedding"), "embedding",
                                              pa.array(["x"] * 30)), "column 'embedding': has type"),
]


def _set(t: pa.Table, name: str, row: int, value) -> pa.Table:
    rows = t.column(name).to_pylist()
    rows[row] = value
    return t.set_column(t.schema.get_field_index(name), name, pa.array(rows, t.schema.field(name).type))


def _emb(t: pa.Table, row: int, col: int, value: float) -> pa.Table:
    rows = [[float(x) for x in r] for r in t.column("embedding").to_pylist()]
    rows[row][col] = value
    return t.set_column(t.schema.get_field_index("embedding"), "embedding", pa.array(rows, pa.list_(pa.float64())))


@pytest.mark.parametrize("case", BAD, ids=[c[0] for c in BAD])
def test_a_bad_batch_in_memory_is_refused_as_its_file_is(case, spec, tmp_path):
    _, mutate, words = case
    table = mutate(sample_requests(30, spec, dim=8, seed=2))
    path = tmp_path / "requests.parquet"
    pq.write_table(table, path)
    with pytest.raises(InputError) as from_file:
        read_requests(path, spec, dim=8)
    forms = [table, table.to_batches()[0] if table.num_rows else table, pl.from_arrow(table)]
    for data in forms:
        with pytest.raises(InputError) as in_memory:
            requests_from(data, spec, source="batch 12", dim=8)
        assert words in str(in_memory.value)
        assert str(in_memory.value) == str(from_file.value).replace(str(path), "batch 12")
    assert "\n" not in str(from_file.value)


def test_refusals_of_what_is_not_a_batch(spec):
    with pytest.raises(InputError, match="requests: the request table holds no rows"):
        requests_from([], spec)
    with pytest.raises(InputError, match="expected requests as a pyarrow Table or RecordBatch, a polars DataFrame or "
                                         "a list of dicts, got str"):
        requests_from("requests.parquet", spec)
    twice = pa.table([pa.array([1]), pa.array(["US"]), pa.array(["GB"])], names=["request_id", "country", "country"])
    with pytest.raises(InputError, match=r"rq: column 'country' appears 2 times; give each column once"):
        requests_from(twice, spec, source="rq")
    with pytest.raises(InputError, match=r"rq: the requests' values do not form a table"):
        requests_from([{"request_id": 1, "country": "US"}, {"request_id": 2, "country": 3}], spec, source="rq")


def test_dicts_keep_every_rows_keys(spec):
    """A key that only a later dict carries is a column (null where a row leaves it out), not
    dropped: a request's locations are never lost because the first request had none."""
    rows = sample_requests(6, spec, dim=8, seed=3).to_pylist()
    sparse = [{k: v for k, v in r.items() if k not in ("locations", "country") or i % 2} for i, r in enumerate(rows)]
    got = requests_from(sparse, spec, dim=8)
    full = [r | {k: None for k in ("locations", "country") if k not in r} for r in sparse]
    want = requests_from(pa.Table.from_pylist(full), spec, dim=8)
    assert got.columns.select(want.columns.column_names).equals(want.columns)
    assert got.columns.column("locations").to_pylist()[1::2] == [r["locations"] for r in rows[1::2]]
    enc_got, enc_want = encode_requests(got, spec), encode_requests(want, spec)
    for a, b in zip(enc_got.planes, enc_want.planes):
        assert np.array_equal(a.rows, b.rows) and np.array_equal(a.ranges, b.ranges)


def test_every_form_runs_one_compiled_kernel():
    """The encoder's kernels see one type whatever form a batch comes in, so a warm-up compiles
    every kernel a batch will run (a new form would otherwise compile for seconds mid-stream)."""
    from sidindex.request_encoding import _bitmask_attribute, _bloom_attribute, _query_rows

    rows = [{"country": "US", "age": None, "locations": ["a", "b"], "apps": None},
            {"country": None, "age": "a1", "locations": None, "apps": ["x"]}]
    for form in FORMS:
        for slice_at in (0, 2):
            encode_requests(requests_from(as_form(rows, form, slice_at), SPEC), SPEC)
    all_null = pa.table({"request_id": [1, 2], "country": pa.nulls(2), "age": pa.nulls(2), "locations": pa.nulls(2),
                         "apps": pa.nulls(2, pa.list_(pa.null()))})
    encode_requests(requests_from(all_null, SPEC), SPEC)  # what a warm-up's columns look like
    assert [len(k.signatures) for k in (_bitmask_attribute, _bloom_attribute, _query_rows)] == [1, 1, 1]


def _wild(values):
    """A value a JSON body or a caller's dict may hold where `values` belong, or one that breaks
    arithmetic or a type: int64's extremes and past them, bools, NaN, 1e39, None, strings, lists."""
    return st.one_of(values, st.sampled_from([None, True, 0, -1, 2**63, -2**63 - 1, 1.5, float("nan"), "1", [], ["x"]]))


_number = st.one_of(st.floats(-2e6, 2e6, width=64), st.integers(-2 * 10**6, 2 * 10**6),
                    st.sampled_from([1e6, -1e6, 1e39, -1e39, 1e19, float("inf"), float("nan"), True, None, 2**63,
                                     10**400]))
_dict_rows = st.lists(st.fixed_dictionaries(
    {"request_id": _wild(st.integers(-2**63, 2**63 - 1)),
     "country": _wild(st.sampled_from(["US", "", "é中", "XX"])),
     "age": _wild(st.sampled_from(["a0", "a69"])),
     "locations": _wild(st.lists(st.one_of(text, st.none(), st.integers()), max_size=4)),
     "apps": _wild(st.lists(st.sampled_from(["a", "\x00"]), max_size=3)),
     "embedding": _wild(st.lists(_number, min_size=0, max_size=4))},
    optional={"extra": st.integers()}), min_size=1, max_size=5)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(rows=_dict_rows, dim=st.sampled_from([None, 3]),
       drop=st.sets(st.sampled_from(["country", "embedding", "request_id"])), plain=st.booleans())
def test_dicts_are_validated_as_their_table_is(rows, dim, drop, plain):
    """Dicts (a JSON body's) go a faster way when their values plainly pass (`_plain_rows`): it
    accepts what the general way accepts, with the same ids, embedding and portable table, and
    leaves everything else to it, so the refusal names the same column, row and value."""
    from sidindex import requests as rq

    if plain:  # good rows, the drawn values mixed in now and then, so that both outcomes are drawn often
        keep = sorted(drop)  # the keys whose drawn values stay
        rows = [{"request_id": i * 3 - 2**62, "country": "US", "age": None, "locations": ["x"] * (i % 3), "apps": None,
                 "embedding": [0.5, -1, 1e6][:dim or 3]} | {k: v for k, v in r.items() if k in keep and i == 0}
                for i, r in enumerate(rows)]
    else:
        rows = [{k: v for k, v in r.items() if k not in drop or i % 2} for i, r in enumerate(rows)]
    limit = 3  # the most values a bloom attribute brings, small enough to be passed
    try:
        got = requests_from(rows, SPEC, max_values=limit, dim=dim)
    except InputError as e:
        got = e
    with pytest.MonkeyPatch.context() as m:  # the general way alone
        m.setattr(rq, "_plain_rows", lambda *a: None)
        try:
            want = requests_from(rows, SPEC, max_values=limit, dim=dim)
        except InputError as e:
            want = e
    if isinstance(want, InputError):
        assert isinstance(got, InputError) and str(got) == str(want)
        return
    assert not isinstance(got, InputError), got
    assert np.array_equal(got.request_id, want.request_id) and got.request_id.dtype == np.int64
    assert (got.embedding is None) == (want.embedding is None)
    if got.embedding is not None:
        assert got.embedding.dtype == np.float32 and got.embedding.tobytes() == want.embedding.tobytes()
    assert rq.portable(got, SPEC).equals(rq.portable(want, SPEC))
    enc_got, enc_want = encode_requests(got, SPEC), encode_requests(want, SPEC)
    for a, b in zip(enc_got.planes, enc_want.planes):
        assert np.array_equal(a.rows, b.rows) and np.array_equal(a.ranges, b.ranges)


def test_a_plain_json_request_takes_the_faster_way(spec):
    """The sample requests as a JSON body carries them are all plain: no Arrow inference."""
    from sidindex import requests as rq

    rows = sample_requests(5, spec, dim=8, seed=4).to_pylist()
    got = rq._plain_rows(rows, spec, rq.MAX_REQUEST_VALUES, 8, "body")
    assert got is not None and rq.portable(got, spec) is got.table
    assert got.table.schema.field("embedding").type == pa.list_(pa.float32(), 8)
