"""An Arrow Flight endpoint over a `runtime.Retriever`, for callers that already batch (a
recommendation backend calling over gRPC); `sidindex serve` runs it beside the HTTP server.

    endpoint = start_flight(retriever, "127.0.0.1", 8815)   # serving on gRPC's threads until shutdown()
    client = pyarrow.flight.connect(f"grpc://127.0.0.1:{endpoint.port}")
    writer, reader = client.do_exchange(pyarrow.flight.FlightDescriptor.for_command(RETRIEVE))

The client writes record batches of requests (the columns `runtime.requests_from` validates) and
reads one result record batch per request batch, in order (request_id, rank, ad_id, sid, score[,
value], as `Retriever.retrieve`), the id of the snapshot that served it in the batch's app_metadata
and the first one's in the schema metadata ("snapshot"). A bad batch, or a failing scorer, ends the
exchange with a FlightServerError of one line (extra_info b"bad_request" or b"error", as the HTTP
server's 400 and 500); the endpoint goes on serving. Action "snapshot": the id served now.
"""

from __future__ import annotations

from collections.abc import Iterator

import pyarrow as pa
import pyarrow.flight as flight

from runtime.requests import requests_from
from runtime.result import concat, table_of
from runtime.serving.retriever import Retriever
from sidindex.errors import ConfigError, InputError, SidIndexError

RETRIEVE = b"retrieve"  # the command of the descriptor `do_exchange` answers
BAD_REQUEST, ERROR = b"bad_request", b"error"  # a FlightServerError's extra_info: the client's fault, or not


class FlightEndpoint(flight.FlightServerBase):
    """`do_exchange` of request batches for result batches over `retriever` (module doc); it
    listens from construction, on gRPC's threads, until `shutdown()` (which lets exchanges in
    flight finish).

    retriever: a warmed Retriever (over a SnapshotWatcher, whose swaps it follows; something else
    polls the watcher, e.g. the HTTP server); location: e.g. "grpc://127.0.0.1:0" (0: a free port,
    then `port`); max_batch: the most rows per `Retriever.run` call, which releases the retriever
    between them so that other callers' batches interleave (a configured batch size: a smaller
    last piece is padded on a GPU); max_request_rows: the most rows one request batch may hold.
    """

    def __init__(self, retriever: Retriever, location: str | flight.Location, *, max_batch: int = 16,
                 max_request_rows: int = 4096) -> None:
        if max_batch < 1 or max_request_rows < 1:
            raise ConfigError(f"max_batch {max_batch}, max_request_rows {max_request_rows}: give positive numbers of "
                              "rows")
        super().__init__(location)
        self.retriever, self.max_batch, self.max_request_rows = retriever, max_batch, max_request_rows

    def do_exchange(self, context, descriptor: flight.FlightDescriptor, reader: flight.MetadataRecordBatchReader,
                    writer: flight.MetadataRecordBatchWriter) -> None:
        """Answer each request batch `reader` brings with its result batch on `writer` (module doc)."""
        if descriptor.command != RETRIEVE:
            raise flight.FlightServerError(f"do_exchange: expected the descriptor FlightDescriptor.for_command("
                                           f"{RETRIEVE!r}), got {descriptor}", extra_info=BAD_REQUEST)
        schema: pa.Schema | None = None  # the stream's, set by the first answer
        for k, chunk in enumerate(_batches(reader)):
            try:
                table, snapshot = self.answer(chunk, f"request batch {k}")
            except InputError as e:
                raise flight.FlightServerError(_line(e), extra_info=BAD_REQUEST) from None
            except SidIndexError as e:  # a scorer that failed or gave no finite logit, a batch the index refused
                raise flight.FlightServerError(_line(e), extra_info=ERROR) from None
            except Exception as e:  # a bug: one line to the client, not the traceback pyarrow would send
                raise flight.FlightInternalError(_line(f"{type(e).__name__}: {e}")) from None
            if schema is None:
                schema = table.schema.with_metadata({"snapshot": snapshot})
                writer.begin(schema)
            elif not table.schema.equals(schema, check_metadata=False):
                raise flight.FlightUnavailableError(f"request batch {k}: snapshot {snapshot}, swapped in during this "
                                                    "exchange, answers with other columns than its first batch's; "
                                                    "open a new exchange", extra_info=ERROR)
            columns = [c.combine_chunks() for c in table.columns]
            writer.write_with_metadata(pa.RecordBatch.from_arrays(columns, schema=schema),
                                       pa.py_buffer(snapshot.encode()))

    def answer(self, batch: pa.RecordBatch, source: str) -> tuple[pa.Table, str]:
        """The result table of one request batch (rows of `table_of`, in request order, with the
        client's request ids) and the id of the snapshot that served every row of it. It runs in
        pieces of at most max_batch rows on the snapshot it was validated against; should a swap
        happen meanwhile, the batch starts again on the new snapshot (a result never mixes two,
        and an old snapshot is never warmed again). InputError: too many rows, or refused by the
        validator (`source` names the batch)."""
        n = batch.num_rows
        if n > self.max_request_rows:
            raise InputError(f"{source}: {n} rows, more than the {self.max_request_rows} a request batch may hold "
                             f"(max_request_rows); send at most {self.max_request_rows} rows per record batch")
        retriever = self.retriever
        while True:
            index = retriever.index
            reqs = requests_from(batch, index, source=source)
            parts = []
            for lo in range(0, n, self.max_batch):
                if retriever.index is not index:
                    break
                found, _ = retriever.run(reqs.rows(lo, min(n, lo + self.max_batch)), index)
                parts.append((lo, found))
            else:
                return table_of(concat(parts), reqs.request_id), index.id

    def list_actions(self, context) -> list[tuple[str, str]]:
        return [("snapshot", "the id of the snapshot served now")]

    def do_action(self, context, action: flight.Action) -> Iterator[bytes]:
        """"snapshot": the id of the snapshot served now (UTF-8)."""
        if action.type != "snapshot":
            raise flight.FlightServerError(f"action {action.type!r}: expected 'snapshot'", extra_info=BAD_REQUEST)
        yield self.retriever.index.id.encode()


def start_flight(retriever: Retriever, host: str = "127.0.0.1", port: int = 0, *, max_batch: int = 16,
                 max_request_rows: int = 4096) -> FlightEndpoint:
    """A FlightEndpoint over `retriever` listening on host:port (0: a free port, see `.port`),
    serving on gRPC's own threads at once; `endpoint.shutdown()` stops it once the exchanges in
    flight have finished (call it from outside the endpoint's own methods)."""
    return FlightEndpoint(retriever, flight.Location.for_grpc_tcp(host, port), max_batch=max_batch,
                          max_request_rows=max_request_rows)


def _batches(reader: flight.MetadataRecordBatchReader) -> Iterator[pa.RecordBatch]:
    """The record batches a client writes (chunks of app_metadata alone skipped)."""
    for chunk in reader:
        if chunk.data is not None:
            yield chunk.data


def _line(message: object) -> str:
    """An error's first line (a client's message is one line)."""
    lines = str(message).splitlines()
    return lines[0] if lines else "error"
