"""The engine of `sidindex serve` as its HTTP front sees it (docs/design.md §19): `EngineApi`, which
the engine in the front's own process (`runtime.server.engine.Engine`) and the link to an engine process
(`runtime.server.link.EngineClient`) both provide, and what crosses it. Nothing here imports torch: a
front-end process needs only this, the link and the request validator."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import pyarrow as pa
import pyarrow.compute as pc

from sidindex.errors import InputError
from sidindex.requests import Requests
from sidindex.targeting import TargetingSpec

END_OF_STREAM = b"\xff\xff\xff\xff\x00\x00\x00\x00"  # an Arrow IPC stream's last message


@dataclass(frozen=True)
class Target:
    """What a request is validated against: the snapshot served, its targeting spec and its
    codebook's embedding length (None: no codebook)."""

    snapshot: str
    spec: TargetingSpec
    dim: int | None


def joinable(schemas: list[pa.Schema]) -> bool:
    """Whether tables of these schemas join as one batch unchanged: the same columns in the same
    order, each of one type where known (a permissive concatenation would turn int into double,
    losing digits past 2^53, or string into binary, before a user's scorer sees them; a column of
    nulls, or of lists of nulls, takes the others' type where that type is a list's). The one rule
    for a front-end's message (`runtime.server.link`) and the engine's batch
    (`runtime.server.batcher`)."""
    first = schemas[0]
    if all(s.equals(first) for s in schemas[1:]):  # the common case: one schema
        return True
    if any(s.names != first.names for s in schemas):
        return False
    try:
        joined = pa.unify_schemas(schemas, promote_options="permissive")
    except (pa.ArrowInvalid, pa.ArrowTypeError, pa.ArrowNotImplementedError):
        return False
    return all(_unknown(t) or t.equals(joined.field(i).type) for s in schemas for i, t in enumerate(s.types))


def _unknown(t: pa.DataType) -> bool:
    """A type that says nothing of a column's values: nulls, or lists of them (what JSON's null
    and [] give)."""
    if pa.types.is_list(t) or pa.types.is_large_list(t):
        return pa.types.is_null(t.value_type)
    return pa.types.is_null(t)


def arrow_stream(table: pa.Table) -> pa.Buffer:
    """`table` as one Arrow IPC stream (an HTTP answer in Arrow)."""
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, table.schema) as w:
        w.write_table(table)
    return sink.getvalue()


def one_batch(table: pa.Table) -> pa.RecordBatch:
    """`table`'s rows as one record batch, dictionary columns decoded (what `batch_message` sends)."""
    if any(pa.types.is_dictionary(t) for t in table.schema.types):
        table = pa.table([pc.cast(c, c.type.value_type) if pa.types.is_dictionary(c.type) else c
                          for c in table.columns], names=table.column_names)
    batches = table.combine_chunks().to_batches()
    return batches[0] if batches else pa.RecordBatch.from_pylist([], schema=table.schema)


def batch_message(table: pa.Table) -> tuple[pa.Buffer, pa.Buffer]:
    """`table` as two Arrow IPC messages, its schema's and one record batch's (`one_batch`): a
    request or an answer as it crosses the link. Record batch messages of one schema read
    together as one stream (`read_batch_messages`), so the engine reads a batch's requests in one
    call, not one per request."""
    batch = one_batch(table)
    return batch.schema.serialize(), batch.serialize()


def read_batch_messages(schema, batches: list, what: str) -> pa.Table:
    """The table of record batch messages (bytes or buffers) of one schema's message
    (`batch_message`), read as one stream: a chunk each; InputError naming `what` if they do not read."""
    return read_stream(b"".join([schema, *batches, END_OF_STREAM]), what)


def read_stream(buffer, what: str) -> pa.Table:
    """The table of an Arrow IPC stream (bytes or a buffer); InputError naming `what` if it is not one."""
    try:
        return pa.ipc.open_stream(pa.py_buffer(buffer)).read_all()
    except (pa.ArrowInvalid, OSError) as e:
        raise InputError(f"{what}: not an Arrow IPC stream: {e}") from None


def resolve(future, outcome) -> None:
    """`future` (an asyncio.Future) takes `outcome`, an exception or a result, unless it is done
    (its caller left, or a drain answered it)."""
    if future.done():
        return
    if isinstance(outcome, BaseException):
        future.set_exception(outcome)
    else:
        future.set_result(outcome)


class Refused(Exception):
    """A request answered with an HTTP `status` and one line, counted as `outcome`; no batch ran
    it (or ran all of it). retry_after: seconds, for a 503 a client may retry."""

    def __init__(self, status: int, outcome: str, message: str, retry_after: int | None = None) -> None:
        super().__init__(message)
        self.status, self.outcome, self.retry_after = status, outcome, retry_after


def stopping() -> Refused:
    """The 503 of a request a stopping server does not run."""
    return Refused(503, "stopping", "the server is stopping; send the request to another replica")


class EngineApi(Protocol):
    async def start(self) -> None:
        """Start serving, in the running event loop of the HTTP front."""

    async def target(self) -> Target:
        """What the next request is validated against."""

    async def answer(self, requests: Requests, target: Target, timeout: float | None) -> tuple[pa.Table, str]:
        """The result table of requests validated against `target` (request_id, rank, ad_id, sid,
        score[, value]: the client's ids) and the id of the snapshot that served every row of it.
        Refused: a full queue (503), no answer within `timeout` seconds (504). InputError: a
        request the snapshot swapped in since refuses; SidIndexError: a batch that failed."""

    async def status(self) -> dict:
        """ready, why (when not), and the snapshot served: id, format, counts, since,
        age_seconds, last_error, counters."""

    def stop(self) -> None:
        """Stop serving (the HTTP front's lifespan ends)."""
