"""The Arrow Flight endpoint (`runtime.server.flight`) answers each request batch of an exchange exactly as
`Retriever.retrieve` does (in pieces of max_batch rows, with the client's request ids), names the
snapshot that served it, refuses a bad batch, too many rows and a failing scorer with one line,
goes on serving after them, and starts a batch again on a snapshot swapped in meanwhile."""

from __future__ import annotations

import threading
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.flight as flight
import pyarrow.parquet as pq
import pytest
import torch

import runtime
from runtime.scorers.factory import ScorerFactory
from runtime.server.flight import BAD_REQUEST, ERROR, RETRIEVE, FlightEndpoint, start_flight
from tests.test_retrieve import CONFIG, build_root

BEAMS = (1, 4, 8, 8)


@pytest.fixture(scope="module")
def built(sample_dir, tmp_path_factory) -> Path:
    return build_root(sample_dir, tmp_path_factory.mktemp("flight"), CONFIG)


@pytest.fixture(scope="module")
def requests(sample_dir) -> pa.Table:
    """The sample's 50 requests, their ids made the client's own (not 0..n-1)."""
    t = pq.read_table(sample_dir / "requests.parquet")
    return t.set_column(t.schema.get_field_index("request_id"), "request_id", pc.add(t["request_id"], 1000))


@pytest.fixture(scope="module")
def retriever(built) -> runtime.Retriever:
    return runtime.Retriever(runtime.SnapshotWatcher(built, "cpu"), beams=BEAMS, batch_sizes=(16,), warm=False)


@pytest.fixture
def endpoint(retriever):
    ep = start_flight(retriever, max_batch=16, max_request_rows=64)
    yield ep
    ep.shutdown()


def exchange(ep: FlightEndpoint, batches: list[pa.RecordBatch]) -> list[flight.FlightStreamChunk]:
    """The result chunks of one exchange that writes `batches` (one schema) and reads an answer
    after each."""
    client = flight.connect(f"grpc://127.0.0.1:{ep.port}")
    writer, reader = client.do_exchange(flight.FlightDescriptor.for_command(RETRIEVE))
    got = []
    with writer:
        writer.begin(batches[0].schema)
        for b in batches:
            writer.write_batch(b)
            got.append(reader.read_chunk())
        writer.done_writing()
    client.close()
    return got


def refused(ep: FlightEndpoint, batch: pa.RecordBatch, *, descriptor: bytes = RETRIEVE) -> flight.FlightError:
    """The error an exchange of `batch` ends with."""
    client = flight.connect(f"grpc://127.0.0.1:{ep.port}")
    writer, reader = client.do_exchange(flight.FlightDescriptor.for_command(descriptor))
    with pytest.raises(flight.FlightError) as e:
        with writer:
            writer.begin(batch.schema)
            writer.write_batch(batch)
            reader.read_chunk()
    client.close()
    return e.value


def batch_of(table: pa.Table) -> pa.RecordBatch:
    return table.combine_chunks().to_batches()[0]


def test_an_exchange_answers_each_batch_as_the_retriever_does(endpoint, retriever, requests):
    """Batches of 5, 12 and 40 rows (40 in pieces of 16) on one exchange: one result batch each,
    equal to `retrieve` of the same rows (whose batches of 16 cut them at the same rows), the
    snapshot in the schema metadata and each batch's app_metadata."""
    sizes = [(0, 5), (5, 17), (10, 50)]
    batches = [batch_of(requests.slice(lo, hi - lo)) for lo, hi in sizes]
    want = [retriever.retrieve(b) for b in batches]
    runs = retriever.counters.batches
    got = exchange(endpoint, batches)
    assert retriever.counters.batches - runs == 1 + 1 + 3  # 40 rows: three calls of at most 16
    snapshot = retriever.index.id
    for chunk, w in zip(got, want):
        assert chunk.app_metadata.to_pybytes() == snapshot.encode()
        assert chunk.data.schema.metadata == {b"snapshot": snapshot.encode()}
        assert pa.Table.from_batches([chunk.data]).replace_schema_metadata(None).equals(w)
    sent = batches[2]["request_id"].to_pylist()
    answered = list(dict.fromkeys(got[2].data["request_id"].to_pylist()))  # the client's ids, in request order
    assert answered == [i for i in sent if i in answered] and len(answered) > 16
    client = flight.connect(f"grpc://127.0.0.1:{endpoint.port}")
    assert [r.body.to_pybytes() for r in client.do_action("snapshot")] == [snapshot.encode()]
    assert [a.type for a in client.list_actions()] == ["snapshot"]
    with pytest.raises(flight.FlightServerError, match="action 'other': expected 'snapshot'"):
        list(client.do_action("other"))


def test_concurrent_exchanges_each_get_their_own_rows(endpoint, retriever, requests):
    """Four clients at once (the same request ids in each): every answer is its own batch's."""
    at = requests.schema.get_field_index("request_id")
    batches = [batch_of(requests.slice(lo, 10).set_column(at, "request_id", pa.array(range(10), pa.int64())))
               for lo in (0, 10, 20, 30)]
    want = [retriever.retrieve(b) for b in batches]
    got: dict[int, pa.RecordBatch] = {}

    def call(i: int) -> None:
        [chunk] = exchange(endpoint, [batches[i]])
        got[i] = chunk.data

    threads = [threading.Thread(target=call, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert all(pa.Table.from_batches([got[i]]).replace_schema_metadata(None).equals(want[i]) for i in range(4))


def test_a_bad_batch_is_refused_in_one_line_and_serving_goes_on(endpoint, requests, capfd):
    good = batch_of(requests.slice(0, 6))
    emb = requests["embedding"].to_pylist()[:6]
    emb[3] = emb[3][:-1]
    short = batch_of(requests.slice(0, 6).set_column(requests.schema.get_field_index("embedding"), "embedding",
                                                      pa.array(emb, pa.list_(pa.float32()))))
    as_text = batch_of(requests.slice(0, 6).set_column(requests.schema.get_field_index("request_id"), "request_id",
                                                        pc.cast(requests["request_id"][:6], pa.string())))
    too_many = batch_of(requests.take(np.arange(65) % len(requests)))
    for batch, words in [(short, "request batch 0: column 'embedding', row 3"), (as_text, "column 'request_id'"),
                         (too_many, "65 rows, more than the 64 a request batch may hold (max_request_rows)")]:
        e = refused(endpoint, batch)
        assert isinstance(e, flight.FlightServerError) and e.extra_info == BAD_REQUEST
        assert words in str(e) and "\n" not in str(e), str(e)
    e = refused(endpoint, good, descriptor=b"other")
    assert e.extra_info == BAD_REQUEST and "for_command(b'retrieve')" in str(e)
    assert "Traceback" not in capfd.readouterr().err
    [chunk] = exchange(endpoint, [good])
    assert chunk.data.num_rows > 0


class Boom:
    """A user's factory whose scorer fails for a batch holding a request with `boom` set."""

    def __init__(self, V: int) -> None:
        self.V = V

    def __call__(self, batch, device, level_sizes):
        fail = any(batch.column("boom").to_pylist())

        def scorer(step, tokens, parent):
            if fail:
                raise RuntimeError("out of cheese")
            return torch.zeros(*tokens.shape[:2], self.V)

        return scorer


def test_a_failing_scorer_ends_the_exchange_in_one_line_and_serving_goes_on(built, requests):
    index = runtime.load(built, "cpu")
    retriever = runtime.Retriever(index, beams=BEAMS, batch_sizes=(16,), warm=False,
                                  scorer=ScorerFactory(Boom(max(index.level_sizes)), "tests:boom"))
    with start_flight(retriever) as ep:
        rows = requests.slice(0, 4)
        e = refused(ep, batch_of(rows.append_column("boom", pa.array([False, True, False, False]))))
        assert isinstance(e, flight.FlightServerError) and e.extra_info == ERROR
        assert "scorer 'tests:boom'" in str(e) and "out of cheese" in str(e) and "\n" not in str(e)
        [chunk] = exchange(ep, [batch_of(rows.append_column("boom", pa.array([False] * 4)))])
        assert chunk.data.num_rows > 0


class Swapping:
    """A retriever's stand-in whose index is replaced by `new` once its first piece has run, as a
    watcher's swap would."""

    def __init__(self, real: runtime.Retriever, new: runtime.ServedIndex) -> None:
        self.real, self.new, self.current = real, new, real.index
        self.ran_on: list[runtime.ServedIndex] = []

    @property
    def index(self) -> runtime.ServedIndex:
        return self.current

    def run(self, requests, index):
        self.ran_on.append(index)
        self.current = self.new
        return self.real.run(requests, index)


def test_a_swap_during_a_batch_starts_it_again_on_the_new_snapshot(built, retriever, requests):
    old, new = runtime.load(built, "cpu"), runtime.load(built, "cpu")
    real = runtime.Retriever(old, beams=BEAMS, batch_sizes=(16,), warm=False)
    swapping = Swapping(real, new)
    ep = FlightEndpoint(swapping, "grpc://127.0.0.1:0", max_batch=16)  # type: ignore[arg-type]
    try:
        batch = batch_of(requests.slice(0, 40))
        table, snapshot = ep.answer(batch, "request batch 0")
    finally:
        ep.shutdown()
    assert swapping.ran_on == [old, new, new, new] and snapshot == new.id
    assert table.equals(retriever.retrieve(batch))
