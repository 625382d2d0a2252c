"""`StepBatch`: the cache work of one scheduler step, sent as one `Step` call.

A scheduler fills a batch while it plans a step and sends it once with `client.step(batch)` (or
`await aclient.step(batch)`). Each method returns that op's `StepOutcome` at once; after the call every
outcome holds its result or its typed error, and one op's failure never raises or stops the others.

    batch = StepBatch()
    chat = Session.open_in(batch, client, page_size=16)      # opened by this very Step
    prefill = batch.append(chat, prompt, reserve_tokens=16)  # the request's admission, same Step
    for s in decoding:
        s.ensure_capacity(s.kv_tokens + 1, batch=batch)      # an `extend` op only when a page is needed
    for s in finished:
        batch.commit(s, s.generated)
        batch.close(s, cache=True)
    client.step(batch)
    if prefill.error is not None: ...                        # e.g. PoolExhausted: retry next step

Ops name a session by id, or by a session object (`Session`, `AsyncSession`): then its epoch is sent and
the op's result is applied to it in order (page-table deltas, context and KV counts), as the unary call
would. Opening with no id draws one here, so later ops of the same batch can name the session.

On the wire a batch is columns (`StepRequest.columns`: one packed array per field) unless it is made with
`columns=False` (one `StepOp` message per op, for services older than columns). Either way every op
behaves as the same request sent alone. With columns, neither side builds a message per op: an op method
appends a few values to lists (and copies its tokens), the clients send the request as bytes written in one
join (`StepBatch.wire`), and every outcome of the batch reads one shared answer: its columns are decoded
once, and an outcome's typed result is built from them when it is first read (`value`), so ops whose
results a scheduler never reads cost nothing to answer.
"""

from __future__ import annotations

import uuid
from array import array
from collections.abc import Callable, Sequence
from itertools import accumulate
from typing import Any, Generic, Protocol, TypeVar

import numpy as np

from engine_client import _codec as codec
from engine_client import _requests as requests
from engine_client._codec import TokensLike
from engine_client.errors import KVCacheClientError, error_from_status
from engine_client.types import (
    AppendResult,
    CloseResult,
    CommitResult,
    ExtendResult,
    MatchResult,
    OpenedSession,
    PageIds,
    ReuseReport,
    no_pages,
)
from kvcache_common.protowire import varint
from protos.kvcache.v1 import kvcache_pb2 as pb

T = TypeVar("T")

__all__ = ["StepBatch", "StepOutcome", "StepSession", "StepWire"]


class StepSession(Protocol):
    """What an op may name instead of a session id."""

    session_id: str
    epoch: int

    def _apply(self, kind: str, result: Any) -> None:
        """Take the op's successful result (an AppendResult, ExtendResult, CommitResult, ...)."""


SessionRef = str | StepSession

_PENDING: Any = object()


class _Answer:
    """The one cell every outcome of a batch shares: the Step's column results once it has run."""

    __slots__ = ("results",)

    def __init__(self) -> None:
        self.results: _ColumnResults | None = None


class StepOutcome(Generic[T]):
    """One op's result once its Step has run: `value` on success, `error` (typed, not raised) otherwise."""

    __slots__ = ("_answer", "_error", "_status", "_value", "index", "kind")

    def __init__(self, kind: str, index: int, answer: _Answer | None = None) -> None:
        self.kind = kind
        """"open", "append", "extend", "commit", "close" or "match"."""
        self.index = index
        """The op's position in its batch."""
        self._value: Any = _PENDING
        self._answer = answer or _Answer()
        """Shared with the batch: its column results, which `value` is built from at first read."""
        self._error: KVCacheClientError | None = None
        self._status: Any = None
        """A failed op's google.rpc.Status (or, in a columns answer, its position in the answer's errors),
        which `error` is built from at first read."""

    @property
    def error(self) -> KVCacheClientError | None:
        """The op's typed error (None: it succeeded, or has not run)."""
        if self._error is None and self._status is not None:
            status = self._status
            if type(status) is int:
                results = self._answer.results
                assert results is not None
                status = results.errors[status]
            self._error = error_from_status(status)
        return self._error

    @error.setter
    def error(self, error: KVCacheClientError | None) -> None:
        self._error, self._status = error, None

    @property
    def done(self) -> bool:
        return self.ok or self._status is not None or self._error is not None

    @property
    def ok(self) -> bool:
        return self._value is not _PENDING or (self._answer.results is not None and self._status is None
                                               and self._error is None)

    @property
    def value(self) -> T:
        """The op's result; raises its typed error if it failed (and RuntimeError before the Step ran)."""
        if self._status is not None or self._error is not None:
            error = self.error
            assert error is not None
            raise error
        value = self._value
        if value is _PENDING:
            results = self._answer.results
            if results is None:
                raise RuntimeError(f"op {self.index} ({self.kind}) has not been sent: run the batch with "
                                   "client.step()")
            value = self._value = results.result(self.index)
        return value  # type: ignore[no-any-return]

    def __repr__(self) -> str:
        state = "pending" if not self.done else ("ok" if self.ok else f"error {self.error!r}")
        return f"StepOutcome({self.index} {self.kind}: {state})"


_PARSERS: dict[str, Callable[[Any], Any]] = {
    "open": codec.opened, "append": codec.appended, "extend": codec.extended, "commit": codec.committed,
    "close": codec.closed, "match": codec.match,
}
OPEN, APPEND, EXTEND, COMMIT, CLOSE, MATCH = 1, 2, 3, 4, 5, 6
"""Op kinds on the wire (StepOp's field numbers)."""
_KIND_NAMES = ("", "open", "append", "extend", "commit", "close", "match")
_SET, _KV_TOKENS, _TIMEOUT = pb.STEP_FLAG_SET, pb.STEP_FLAG_KV_TOKENS, pb.STEP_FLAG_TIMEOUT
_COLUMNS_TAG = bytes([pb.StepRequest.DESCRIPTOR.fields_by_name["columns"].number << 3 | 2])
"""StepRequest.columns (a length-delimited field) on the wire."""
_TOKEN_IDS_TAG = bytes([pb.StepColumns.DESCRIPTOR.fields_by_name["token_ids"].number << 3 | 2])
"""StepColumns.token_ids (a length-delimited field) on the wire."""


class StepWire:
    """A StepRequest already serialized, as the clients send a batch: its bytes in `parts`, in order (the
    batch's columns, then each op's token ids as the op copied them), which the step lane writes as they are
    (one gathered send) and `data` joins once for gRPC. `message()` (and `engine_id`, `columns`) parse it
    back, for whoever inspects a call."""

    __slots__ = ("_data", "parts", "size")

    def __init__(self, *parts: bytes) -> None:
        self.parts = parts
        self.size = sum(map(len, parts))
        """The request's length in bytes."""
        self._data: bytes | None = parts[0] if len(parts) == 1 else None

    @property
    def data(self) -> bytes:
        """The request's bytes (the parts joined, once)."""
        data = self._data
        if data is None:
            data = self._data = b"".join(self.parts)
        return data

    def message(self) -> pb.StepRequest:
        return pb.StepRequest.FromString(self.data)

    @property
    def engine_id(self) -> str:
        return self.message().engine_id

    @property
    def columns(self) -> pb.StepColumns:
        return self.message().columns

    def __repr__(self) -> str:
        return f"StepWire({self.size} bytes)"


def serialize_request(request: StepWire | pb.StepRequest) -> bytes:
    """The request serializer of the clients' Step method: a StepWire's bytes, or a message serialized."""
    if isinstance(request, StepWire):
        return request.data
    return request.SerializeToString()


def step_method(channel: Any) -> Any:
    """The Step method of a channel (sync or asyncio), sending a `StepWire` as it is (a StepRequest
    message serialized): what the clients put in their stub in place of the generated one."""
    return channel.unary_unary("/kvcache.v1.KVCacheService/Step", request_serializer=serialize_request,
                               response_deserializer=pb.StepResponse.FromString, _registered_method=True)


def _sent() -> RuntimeError:
    return RuntimeError("this batch was sent already: start a new StepBatch for the next step")


def _column(typecode: str, values: dict[int, Any], n: int) -> bytes:
    """A little-endian column of `n` numbers from the ops' non-zero ones (by index)."""
    column = array(typecode, bytes(n * array(typecode).itemsize))
    for i, value in values.items():
        column[i] = value
    return column.tobytes()


class StepBatch:
    """Ops for one `Step`, in the order they will apply. Send once; outcomes fill in place."""

    def __init__(self, engine_id: str | None = None, *, columns: bool = True) -> None:
        self.engine_id = engine_id
        """The default owner of the ops (None: the sending client's engine id)."""
        self.columns = columns
        """Send the ops as `StepRequest.columns` (else one StepOp message each)."""
        self._answer = _Answer()
        self._outcomes: list[StepOutcome[Any]] = []
        self._sessions: dict[int, StepSession] = {}
        """The ops that name a session object, by index: their results are applied to it."""
        # The columns of StepColumns: an array or list entry per op (the wire's own little-endian layout where
        # it is an array), or a dict entry per op whose value is not 0.
        self._kinds = bytearray()
        self._sids: list[str] = []
        self._counts = array("i")
        self._flags = bytearray()
        self._epochs: dict[int, int] = {}
        self._token_counts = array("I")
        self._token_words = 0
        """The token ids of all ops, counted."""
        self._tokens: list[bytes] = []
        """The token ids of the ops that carry some, in op order, packed (copied when the op was added)."""
        self._turns: dict[int, int] = {}
        self._timeouts: dict[int, float] = {}
        self._engines: dict[int, str] = {}
        self._salts: dict[int, str] = {}
        self._parents: dict[int, str] = {}
        self._reuse: dict[int, ReuseReport] = {}
        self.sent = False

    def __len__(self) -> int:
        return len(self._kinds)

    @property
    def outcomes(self) -> list[StepOutcome[Any]]:
        return list(self._outcomes)

    # ------------------------------------------------------------------ ops

    def open(self, session_id: str = "", *, streaming: bool = True, timeout_seconds: float | None = None,
             cache_salt: str = "", engine_id: str = "", session: StepSession | None = None,
             parent_session_id: str = "") -> StepOutcome[OpenedSession]:
        """Open a session in this Step. `session`, a session object not yet open, takes the result (its
        epoch); `Session.open_in` passes itself here. `parent_session_id`: the session it works for."""
        sid = (session.session_id if session is not None else session_id) or uuid.uuid4().hex
        flags = _SET if streaming else 0
        if timeout_seconds is not None:
            flags |= _TIMEOUT
        outcome: StepOutcome[OpenedSession] = self._add(OPEN, sid, 0, flags)
        i = outcome.index
        if session is not None:
            session.session_id = sid
            self._sessions[i] = session
        if timeout_seconds is not None:
            self._timeouts[i] = timeout_seconds
        if cache_salt:
            self._salts[i] = cache_salt
        if engine_id:
            self._engines[i] = engine_id
        if parent_session_id:
            self._parents[i] = parent_session_id
        return outcome

    def append(self, session: SessionRef, tokens: TokensLike, reserve_tokens: int = 0) -> StepOutcome[AppendResult]:
        return self._add(APPEND, session, reserve_tokens, 0, codec.pack_tokens(tokens))

    def extend(self, session: SessionRef, reserve_tokens: int) -> StepOutcome[ExtendResult]:
        return self._add(EXTEND, session, reserve_tokens, 0)

    def commit(self, session: SessionRef, tokens: TokensLike = b"", *, kv_tokens: int | None = None,
               turn: int = 0, reuse: ReuseReport | None = None) -> StepOutcome[CommitResult]:
        """End the session's turn; `reuse`: where its context's KV came from (`ReuseReport`)."""
        outcome: StepOutcome[CommitResult] = self._add(COMMIT, session, kv_tokens or 0,
                                                       0 if kv_tokens is None else _KV_TOKENS,
                                                       codec.pack_tokens(tokens))
        if turn:
            self._turns[outcome.index] = turn
        if reuse is not None:
            self._reuse[outcome.index] = reuse
        return outcome

    def abort(self, session: SessionRef, *, reuse: ReuseReport | None = None) -> StepOutcome[CommitResult]:
        """Roll the session's turn back (a commit with abort=true); `reuse` as for `commit`."""
        outcome: StepOutcome[CommitResult] = self._add(COMMIT, session, 0, _SET)
        if reuse is not None:
            self._reuse[outcome.index] = reuse
        return outcome

    def close(self, session: SessionRef, *, cache: bool = False, mode: str | None = None) -> StepOutcome[CloseResult]:
        """`mode`: "cache", "drop" or "keep-prefix" (docs/design.md §15); None leaves the choice to `cache`."""
        return self._add(CLOSE, session, requests.close_mode(mode), _SET if cache else 0)

    def match(self, tokens: TokensLike, cache_salt: str = "") -> StepOutcome[MatchResult]:
        outcome: StepOutcome[MatchResult] = self._add(MATCH, "", 0, 0, codec.pack_tokens(tokens))
        if cache_salt:
            self._salts[outcome.index] = cache_salt
        return outcome

    def _add(self, kind: int, session: SessionRef, count: int, flags: int, tokens: bytes = b"") -> StepOutcome[Any]:
        """Op `kind` on `session` (an id, or a session object: its epoch is sent and its result applied to
        it) with its packed `tokens`; the one place an op's entries are appended."""
        if self.sent:
            raise _sent()
        i = len(self._kinds)
        if isinstance(session, str):
            sid = session
        else:
            sid = session.session_id
            if session.epoch:
                self._epochs[i] = session.epoch
            self._sessions[i] = session
        ntok = len(tokens) >> 2
        if ntok:
            self._token_words += ntok
            self._tokens.append(tokens)
        self._token_counts.append(ntok)
        outcome: StepOutcome[Any] = StepOutcome(_KIND_NAMES[kind], i, self._answer)
        self._kinds.append(kind)
        self._sids.append(sid)
        self._counts.append(count)
        self._flags.append(flags)
        self._outcomes.append(outcome)
        return outcome

    # ------------------------------------------------------------------ many ops of a kind at once

    def open_many(self, session_ids: Sequence[str], *, streaming: bool = True) -> list[StepOutcome[OpenedSession]]:
        """`open(sid, streaming=...)` for each id, in order (each id given: "" would draw none here)."""
        return self._add_many(OPEN, session_ids, 0, _SET if streaming else 0)

    def append_many(self, sessions: Sequence[SessionRef], tokens: Sequence[TokensLike], reserve_tokens: int = 0
                    ) -> list[StepOutcome[AppendResult]]:
        """`append(session, its tokens, reserve_tokens)` for each session, in order."""
        return self._add_many(APPEND, sessions, reserve_tokens, 0, tokens)

    def extend_many(self, sessions: Sequence[SessionRef], reserve_tokens: int) -> list[StepOutcome[ExtendResult]]:
        """`extend(session, reserve_tokens)` for each session, in order: a decode step's page crossings."""
        return self._add_many(EXTEND, sessions, reserve_tokens, 0)

    def commit_many(self, sessions: Sequence[SessionRef], tokens: Sequence[TokensLike]
                    ) -> list[StepOutcome[CommitResult]]:
        """`commit(session, its generated tokens)` for each session, in order."""
        return self._add_many(COMMIT, sessions, 0, 0, tokens)

    def close_many(self, sessions: Sequence[SessionRef], *, cache: bool = False, mode: str | None = None
                   ) -> list[StepOutcome[CloseResult]]:
        """`close(session, cache=..., mode=...)` for each session, in order."""
        return self._add_many(CLOSE, sessions, requests.close_mode(mode), _SET if cache else 0)

    def _add_many(self, kind: int, sessions: Sequence[SessionRef], count: int, flags: int,
                  tokens: Sequence[TokensLike] | None = None) -> list[StepOutcome[Any]]:
        """`_add` for many ops of one kind: the same entries, appended a column at a time."""
        if self.sent:
            raise _sent()
        m = len(sessions)
        if tokens is not None and len(tokens) != m:
            raise ValueError(f"{len(tokens)} token sequences for {m} sessions")
        start = len(self._kinds)
        if all(type(s) is str for s in sessions):
            self._sids.extend(sessions)  # type: ignore[arg-type]
        else:
            for i, session in enumerate(sessions, start):
                if isinstance(session, str):
                    self._sids.append(session)
                    continue
                self._sids.append(session.session_id)
                if session.epoch:
                    self._epochs[i] = session.epoch
                self._sessions[i] = session
        if tokens is None:
            self._token_counts.frombytes(bytes(4 * m))
        else:
            packed = [codec.pack_tokens(t) for t in tokens]
            counts = [len(p) >> 2 for p in packed]
            self._token_counts.extend(counts)
            self._token_words += sum(counts)
            self._tokens.extend(p for p in packed if p)
        self._kinds += bytes((kind,)) * m
        self._counts.extend((count,) * m)
        self._flags += bytes((flags,)) * m
        name, answer = _KIND_NAMES[kind], self._answer
        outcomes: list[StepOutcome[Any]] = [StepOutcome(name, i, answer) for i in range(start, start + m)]
        self._outcomes += outcomes
        return outcomes

    @property
    def failed(self) -> list[int]:
        """After the call: the positions of the ops that were refused, in order (empty: every op went through),
        read at once from the answer instead of one `ok` per outcome."""
        results = self._answer.results
        if results is not None:
            return list(results.failed)
        return [o.index for o in self._outcomes if o.done and not o.ok]

    # ------------------------------------------------------------------ sending (used by the clients)

    def request(self, default_engine_id: str) -> pb.StepRequest:
        """The StepRequest, once; `default_engine_id` is the client's engine id, used unless the batch
        named its own."""
        if not self.columns:
            self._mark_sent()
            engine_id = default_engine_id if self.engine_id is None else self.engine_id
            return pb.StepRequest(ops=self._messages(), engine_id=engine_id)
        return self.wire(default_engine_id).message()

    def wire(self, default_engine_id: str) -> StepWire:
        """The StepRequest as the clients send it, once: serialized, without a message per op (with
        columns); every op's tokens are parts of it as the op copied them (the step lane sends them gathered,
        gRPC joins them once)."""
        if not self.columns:
            return StepWire(self.request(default_engine_id).SerializeToString())
        self._mark_sent()
        engine_id = default_engine_id if self.engine_id is None else self.engine_id
        n = len(self._kinds)
        # Every column but the token ids, serialized by protobuf; the token ids follow as one more field
        # (a message's fields may come in any order), so they are copied once, by the join below.
        cols = pb.StepColumns(kinds=bytes(self._kinds), session_ids=self._sids,
                              token_counts=self._token_counts.tobytes())
        if self._epochs:
            cols.epochs = _column("Q", self._epochs, n)
        counts = self._counts.tobytes()
        if counts.count(0) != len(counts):  # a zero byte count of the bytes: C speed, no int per op
            cols.counts = counts
        if self._flags.count(0) != n:
            cols.flags = bytes(self._flags)
        if self._turns:
            cols.turns = array("I", [self._turns.get(i, 0) for i in range(n)]).tobytes()
        if self._timeouts:
            cols.timeouts = array("d", [self._timeouts.get(i, 0.0) for i in range(n)]).tobytes()
        if self._engines:
            cols.engine_ids.extend(self._engines.get(i, "") for i in range(n))
        if self._salts:
            cols.cache_salts.extend(self._salts.get(i, "") for i in range(n))
        if self._parents:
            cols.parent_session_ids.extend(self._parents.get(i, "") for i in range(n))
        if self._reuse:
            reuse = array("I", bytes(12 * n))
            for i, r in self._reuse.items():
                reuse[3 * i: 3 * i + 3] = array("I", (r.engine_cached_tokens, r.loaded_tokens, r.computed_tokens))
            cols.reuse = reuse.tobytes()
        head = cols.SerializeToString()
        request = pb.StepRequest(engine_id=engine_id).SerializeToString()
        tokens = self._tokens
        if not tokens:
            return StepWire(b"".join((request, _COLUMNS_TAG, varint(len(head)), head)))
        size = 4 * self._token_words
        size_bytes = varint(size)
        cols_size = len(head) + 1 + len(size_bytes) + size
        return StepWire(b"".join((request, _COLUMNS_TAG, varint(cols_size), head, _TOKEN_IDS_TAG, size_bytes)),
                        *tokens)

    def _mark_sent(self) -> None:
        if self.sent:
            raise _sent()
        self.sent = True

    def _messages(self) -> list[pb.StepOp]:
        """The ops as StepOp messages (columns=False), each the request its unary call sends."""
        ops = []
        pos = 0
        for i, kind in enumerate(self._kinds):
            sid, epoch, count, flags = self._sids[i], self._epochs.get(i, 0), self._counts[i], self._flags[i]
            tokens = b""
            if self._token_counts[i]:
                tokens = self._tokens[pos]
                pos += 1
            if kind == OPEN:
                ops.append(pb.StepOp(open=requests.open_request(
                    sid, bool(flags & _SET), self._timeouts[i] if flags & _TIMEOUT else None,
                    self._salts.get(i, ""), self._engines.get(i, ""), self._parents.get(i, ""))))
            elif kind == APPEND:
                ops.append(pb.StepOp(append=requests.append_request(sid, tokens, count, epoch)))
            elif kind == EXTEND:
                ops.append(pb.StepOp(extend=requests.extend_request(sid, count, epoch)))
            elif kind == COMMIT:
                abort = bool(flags & _SET)
                ops.append(pb.StepOp(commit=requests.commit_request(
                    sid, tokens, count if flags & _KV_TOKENS else None, abort, self._turns.get(i, 0), epoch,
                    reuse=self._reuse.get(i))))
            elif kind == CLOSE:
                ops.append(pb.StepOp(close=requests.close_request(sid, bool(flags & _SET), epoch, mode=count)))
            else:
                ops.append(pb.StepOp(match=requests.match_request(tokens, self._salts.get(i, ""))))
        return ops

    def apply(self, response: pb.StepResponse) -> list[StepOutcome[Any]]:
        """Fill every outcome from the response and hand successful results to the sessions they name."""
        if response.HasField("columns"):
            self._apply_columns(response.columns)
            return list(self._outcomes)
        results = response.results
        if len(results) != len(self._kinds):
            raise RuntimeError(f"the service answered {len(results)} results for {len(self._kinds)} ops")
        sessions = self._sessions
        for i, (outcome, result) in enumerate(zip(self._outcomes, results, strict=True)):
            kind = outcome.kind
            if result.status.code:
                outcome.error = error_from_status(result.status)
                continue
            value = _PARSERS[kind](getattr(result, kind))
            outcome._value = value
            session = sessions.get(i)
            if session is not None:
                session._apply(kind, value)
        return list(self._outcomes)

    def _apply_columns(self, cols: pb.StepColumnResults) -> None:
        results = _ColumnResults(cols, self._sids, self._kinds)
        outcomes = self._outcomes
        for position, i in enumerate(results.failed):  # no Status is read before its error is
            outcomes[i]._status = position
        self._answer.results = results
        for i, session in self._sessions.items():
            outcome = outcomes[i]
            if outcome._status is None:
                session._apply(outcome.kind, outcome.value)

    def opened_instance_ids(self) -> list[str]:
        """The distinct instance ids the successful opens of the answered batch carry, in order."""
        results = self._answer.results
        if results is None:  # answered as messages (or not yet): each open's value carries its own
            ids: list[str] = []
            for outcome in self._outcomes:
                if outcome.kind == "open" and outcome.ok and outcome.value.instance_id not in ids:
                    ids.append(outcome.value.instance_id)
            return ids
        if OPEN not in self._kinds:
            return []
        if results.failed:
            failed = set(results.failed)
            if all(i in failed for i, kind in enumerate(self._kinds) if kind == OPEN):
                return []
        return [results.instance_id]


def _record_maker(cls: type[T]) -> Callable[..., T]:
    """A constructor of `cls`, a frozen slotted dataclass, at the cost of a plain class's (a frozen
    dataclass's own `__init__` stores each field through `object.__setattr__`, ~4x dearer): the fields,
    in order, are stored on an instance of a twin class with the same slots, which then becomes a `cls`.
    The result is a `cls` like any other (equal, hashed, printed and frozen the same)."""
    names: tuple[str, ...] = cls.__slots__  # type: ignore[attr-defined]
    twin = type(f"_{cls.__name__}Fields", (), {"__slots__": names})
    args = ", ".join(names)
    stores = "".join(f"    record.{name} = {name}\n" for name in names)
    namespace: dict[str, Any] = {"twin": twin, "cls": cls}
    exec(f"def make({args}):\n    record = twin()\n{stores}    record.__class__ = cls\n    return record\n",
         namespace)
    make: Callable[..., T] = namespace["make"]
    return make


_opened = _record_maker(OpenedSession)
_appended = _record_maker(AppendResult)
_extended = _record_maker(ExtendResult)
_committed = _record_maker(CommitResult)
_closed = _record_maker(CloseResult)
_matched = _record_maker(MatchResult)

class _ColumnResults:
    """A StepColumnResults answer, shared by the outcomes of its batch. Its columns are read from the message
    once (each read of a bytes field copies all of it), when the first result is asked for; each op's typed
    result is built when its outcome's value is first read. Page ids come from one int32 array of the whole
    answer: each result's `page_ids` is its own slice of it."""

    __slots__ = ("_cached", "_capacity", "_closed", "_cols", "_context", "_ends", "_epochs", "_hits", "_kinds", "_kv",
                 "_num_pages", "_offsets", "_opened", "_pages", "_sids", "_tier", "_timeouts", "_turns", "_windows",
                 "errors", "failed", "instance_id")

    def __init__(self, cols: pb.StepColumnResults, sids: list[str], kinds: bytearray) -> None:
        n = len(kinds)
        codes = cols.codes
        if len(codes) != 4 * n:
            raise RuntimeError(f"the service answered {len(codes) // 4} results for {n} ops")
        self._cols = cols
        self._sids = sids
        self._kinds = kinds
        num_errors = len(cols.errors)
        if not num_errors and codes.count(0) == len(codes):
            self.failed: list[int] = []
        else:
            self.failed = np.flatnonzero(np.frombuffer(codes, "<i4")).tolist()
        if len(self.failed) != num_errors:
            raise RuntimeError(f"the service answered {num_errors} errors for {len(self.failed)} failed ops")
        self.errors = cols.errors
        """The failed ops' statuses, in op order (read one by one: each read makes a message wrapper)."""
        self.instance_id = cols.instance_id
        self._pages: PageIds | None = None
        self._opened: dict[int, str] | None = None

    def _decode(self) -> PageIds:
        """Every column, read from the message once; returns the page ids."""
        cols, n = self._cols, len(self._kinds)

        def numbers(data: bytes, typecode: str) -> array[Any]:
            return array(typecode, data or bytes(n * array(typecode).itemsize))

        self._epochs = numbers(cols.epochs, "Q")
        self._turns = numbers(cols.turns, "I")
        self._cached = numbers(cols.cached_tokens, "I")
        self._context = numbers(cols.context_tokens, "I")
        self._capacity = numbers(cols.capacity_tokens, "I")
        self._offsets = numbers(cols.page_offsets, "I")
        self._num_pages = numbers(cols.num_pages, "I")
        self._hits = numbers(cols.prefix_hit_tokens, "I")
        self._kv = numbers(cols.kv_tokens, "I")
        self._timeouts = numbers(cols.timeouts, "d")
        self._tier = numbers(cols.tier_tokens, "I")  # empty when the service has no tier
        self._closed = cols.closed or bytes(n)
        self._ends = [0, *accumulate(array("I", cols.page_counts))]
        pages: PageIds = np.frombuffer(cols.page_ids, "<i4").astype(np.int32)  # a copy: writable, owned here
        self._pages = pages
        window = cols.window_page_ids  # empty unless the pool keeps window rows apart
        if window and len(window) != len(cols.page_ids):
            raise RuntimeError(f"the service answered {len(window) // 4} window page ids for {pages.size} page ids")
        self._windows: PageIds | None = np.frombuffer(window, "<i4").astype(np.int32) if window else None
        return pages

    def _window(self, i: int) -> PageIds:
        """Op `i`'s window page ids (empty without a window pool)."""
        windows = self._windows
        if windows is None:
            return no_pages()
        ends = self._ends
        return windows[ends[i]:ends[i + 1]]

    def result(self, i: int) -> Any:
        pages = self._pages
        if pages is None:
            pages = self._decode()
        kind = self._kinds[i]
        if kind == EXTEND:
            ends = self._ends
            return _extended(self._sids[i], self._epochs[i], self._turns[i], self._capacity[i], self._offsets[i],
                             pages[ends[i]:ends[i + 1]], self._num_pages[i], self._window(i))
        if kind == APPEND:
            ends = self._ends
            return _appended(self._sids[i], self._epochs[i], self._turns[i], self._cached[i], self._context[i],
                             self._capacity[i], self._offsets[i], pages[ends[i]:ends[i + 1]], self._num_pages[i],
                             self._hits[i], self._tier[i], self._window(i))
        if kind == COMMIT:
            return _committed(self._sids[i], self._context[i], self._kv[i], self._num_pages[i], bool(self._closed[i]))
        if kind == CLOSE:
            return _closed(self._sids[i], bool(self._closed[i]), self._cached[i])
        if kind == OPEN:
            opened = self._opened
            if opened is None:
                failed = set(self.failed)
                opens = [j for j, k in enumerate(self._kinds) if k == OPEN and j not in failed]
                ids = self._cols.opened_ids
                if len(ids) != len(opens):
                    raise RuntimeError(f"the service answered {len(ids)} opened ids for {len(opens)} opens")
                opened = self._opened = dict(zip(opens, ids, strict=True))
            return _opened(opened[i], self._epochs[i], self._timeouts[i], self.instance_id)
        ends = self._ends
        return _matched(self._cached[i], pages[ends[i]:ends[i + 1]], self._tier[i], self._window(i))
