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
appends a few values to lists, and an outcome's typed result is built from the response's columns when it
is first read (`value`), so ops whose results a scheduler never reads cost nothing to answer.
"""

from __future__ import annotations

import uuid
from array import array
from collections.abc import Callable
from itertools import accumulate
from typing import Any, Generic, Protocol, TypeVar

import numpy as np

from engine_client import _codec as codec
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
)
from protos.kvcache.v1 import kvcache_pb2 as pb

T = TypeVar("T")

__all__ = ["StepBatch", "StepOutcome", "StepSession"]


class StepSession(Protocol):
    """What an op may name instead of a session id."""

    session_id: str
    epoch: int

    def _apply(self, kind: str, result: Any) -> None:
        """Take the op's successful result (an AppendResult, ExtendResult, CommitResult, ...)."""


SessionRef = str | StepSession

_PENDING: Any = object()


class StepOutcome(Generic[T]):
    """One op's result once its Step has run: `value` on success, `error` (typed, not raised) otherwise."""

    __slots__ = ("_error", "_results", "_status", "_value", "index", "kind")

    def __init__(self, kind: str, index: int) -> None:
        self.kind = kind
        """"open", "append", "extend", "commit", "close" or "match"."""
        self.index = index
        """The op's position in its batch."""
        self._value: Any = _PENDING
        self._results: _ColumnResults | None = None
        """The response's columns, which `value` is built from at first read."""
        self._error: KVCacheClientError | None = None
        self._status: Any = None
        """The google.rpc.Status of a failed op, which `error` is built from at first read."""

    @property
    def error(self) -> KVCacheClientError | None:
        """The op's typed error (None: it succeeded, or has not run)."""
        if self._error is None and self._status is not None:
            self._error = error_from_status(self._status)
        return self._error

    @error.setter
    def error(self, error: KVCacheClientError | None) -> None:
        self._error, self._status = error, None

    @property
    def done(self) -> bool:
        return self.ok or self._status is not None or self._error is not None

    @property
    def ok(self) -> bool:
        return self._value is not _PENDING or (self._results is not None and self._status is None
                                               and self._error is None)

    @property
    def value(self) -> T:
        """The op's result; raises its typed error if it failed (and RuntimeError before the Step ran)."""
        error = self.error
        if error is not None:
            raise error
        if self._value is _PENDING:
            if self._results is None:
                raise RuntimeError(f"op {self.index} ({self.kind}) has not been sent: run the batch with "
                                   "client.step()")
            self._value = self._results.result(self.kind, self.index)
        return self._value  # type: ignore[no-any-return]

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


class StepBatch:
    """Ops for one `Step`, in the order they will apply. Send once; outcomes fill in place."""

    def __init__(self, engine_id: str | None = None, *, columns: bool = True) -> None:
        self.engine_id = engine_id
        """The default owner of the ops (None: the sending client's engine id)."""
        self.columns = columns
        """Send the ops as `StepRequest.columns` (else one StepOp message each)."""
        self._outcomes: list[StepOutcome[Any]] = []
        self._sessions: list[StepSession | None] = []
        # One entry per op (the columns of StepColumns):
        self._kinds = bytearray()
        self._sids: list[str] = []
        self._epochs: list[int] = []
        self._counts: list[int] = []
        self._flags = bytearray()
        self._token_counts: list[int] = []
        self._tokens: list[bytes] = []
        self._turns: dict[int, int] = {}
        self._timeouts: dict[int, float] = {}
        self._engines: dict[int, str] = {}
        self._salts: dict[int, str] = {}
        self.sent = False

    def __len__(self) -> int:
        return len(self._kinds)

    @property
    def outcomes(self) -> list[StepOutcome[Any]]:
        return list(self._outcomes)

    # ------------------------------------------------------------------ ops

    def open(self, session_id: str = "", *, streaming: bool = True, timeout_seconds: float | None = None,
             cache_salt: str = "", engine_id: str = "", session: StepSession | None = None,
             ) -> StepOutcome[OpenedSession]:
        """Open a session in this Step. `session`, a session object not yet open, takes the result (its
        epoch); `Session.open_in` passes itself here."""
        sid = (session.session_id if session is not None else session_id) or uuid.uuid4().hex
        if session is not None:
            session.session_id = sid
        i = len(self._kinds)
        flags = _SET if streaming else 0
        if timeout_seconds is not None:
            flags |= _TIMEOUT
            self._timeouts[i] = timeout_seconds
        if cache_salt:
            self._salts[i] = cache_salt
        if engine_id:
            self._engines[i] = engine_id
        return self._add(OPEN, sid, 0, 0, flags, b"", session)

    def append(self, session: SessionRef, tokens: TokensLike, reserve_tokens: int = 0) -> StepOutcome[AppendResult]:
        sid, epoch, obj = _ref(session)
        return self._add(APPEND, sid, epoch, reserve_tokens, 0, codec.pack_tokens(tokens), obj)

    def extend(self, session: SessionRef, reserve_tokens: int) -> StepOutcome[ExtendResult]:
        if type(session) is str:
            return self._add(EXTEND, session, 0, reserve_tokens, 0, b"", None)
        sid, epoch, obj = _ref(session)
        return self._add(EXTEND, sid, epoch, reserve_tokens, 0, b"", obj)

    def commit(self, session: SessionRef, tokens: TokensLike = b"", *, kv_tokens: int | None = None,
               turn: int = 0) -> StepOutcome[CommitResult]:
        sid, epoch, obj = _ref(session)
        if turn:
            self._turns[len(self._kinds)] = turn
        return self._add(COMMIT, sid, epoch, kv_tokens or 0, 0 if kv_tokens is None else _KV_TOKENS,
                         codec.pack_tokens(tokens), obj)

    def abort(self, session: SessionRef) -> StepOutcome[CommitResult]:
        """Roll the session's turn back (a commit with abort=true)."""
        sid, epoch, obj = _ref(session)
        return self._add(COMMIT, sid, epoch, 0, _SET, b"", obj)

    def close(self, session: SessionRef, *, cache: bool = False) -> StepOutcome[CloseResult]:
        sid, epoch, obj = _ref(session)
        return self._add(CLOSE, sid, epoch, 0, _SET if cache else 0, b"", obj)

    def match(self, tokens: TokensLike, cache_salt: str = "") -> StepOutcome[MatchResult]:
        if cache_salt:
            self._salts[len(self._kinds)] = cache_salt
        return self._add(MATCH, "", 0, 0, 0, codec.pack_tokens(tokens), None)

    def _add(self, kind: int, sid: str, epoch: int, count: int, flags: int, tokens: bytes,
             session: StepSession | None) -> StepOutcome[Any]:
        if self.sent:
            raise RuntimeError("this batch was sent already: start a new StepBatch for the next step")
        outcome: StepOutcome[Any] = StepOutcome(_KIND_NAMES[kind], len(self._kinds))
        self._kinds.append(kind)
        self._sids.append(sid)
        self._epochs.append(epoch)
        self._counts.append(count)
        self._flags.append(flags)
        self._token_counts.append(len(tokens) >> 2)
        if tokens:
            self._tokens.append(tokens)
        self._outcomes.append(outcome)
        self._sessions.append(session)
        return outcome

    # ------------------------------------------------------------------ sending (used by the clients)

    def request(self, default_engine_id: str) -> pb.StepRequest:
        """The StepRequest, once; `default_engine_id` is the client's engine id, used unless the batch
        named its own."""
        if self.sent:
            raise RuntimeError("this batch was sent already: start a new StepBatch for the next step")
        self.sent = True
        engine_id = default_engine_id if self.engine_id is None else self.engine_id
        if not self.columns:
            return pb.StepRequest(ops=self._messages(), engine_id=engine_id)
        n = len(self._kinds)
        cols = pb.StepColumns(kinds=bytes(self._kinds), session_ids=self._sids,
                              token_counts=array("I", self._token_counts).tobytes(), token_ids=b"".join(self._tokens))
        if any(self._epochs):
            cols.epochs = array("Q", self._epochs).tobytes()
        if any(self._counts):
            cols.counts = array("i", self._counts).tobytes()
        if any(self._flags):
            cols.flags = bytes(self._flags)
        if self._turns:
            cols.turns = array("I", [self._turns.get(i, 0) for i in range(n)]).tobytes()
        if self._timeouts:
            cols.timeouts = array("d", [self._timeouts.get(i, 0.0) for i in range(n)]).tobytes()
        if self._engines:
            cols.engine_ids.extend(self._engines.get(i, "") for i in range(n))
        if self._salts:
            cols.cache_salts.extend(self._salts.get(i, "") for i in range(n))
        return pb.StepRequest(columns=cols, engine_id=engine_id)

    def _messages(self) -> list[pb.StepOp]:
        """The ops as StepOp messages (columns=False)."""
        ops = []
        pos = 0
        for i, kind in enumerate(self._kinds):
            sid, epoch, count, flags = self._sids[i], self._epochs[i], self._counts[i], self._flags[i]
            tokens = b""
            if self._token_counts[i]:
                tokens = self._tokens[pos]
                pos += 1
            if kind == OPEN:
                req = pb.OpenSessionRequest(session_id=sid, streaming=bool(flags & _SET),
                                            cache_salt=self._salts.get(i, ""), engine_id=self._engines.get(i, ""))
                if flags & _TIMEOUT:
                    req.timeout_seconds = self._timeouts[i]
                ops.append(pb.StepOp(open=req))
            elif kind == APPEND:
                ops.append(pb.StepOp(append=pb.AppendSessionRequest(
                    session_id=sid, packed_token_ids=tokens, reserve_tokens=count, epoch=epoch, packed_response=True)))
            elif kind == EXTEND:
                ops.append(pb.StepOp(extend=pb.ExtendSessionRequest(session_id=sid, reserve_tokens=count, epoch=epoch,
                                                                    packed_response=True)))
            elif kind == COMMIT and flags & _SET:
                ops.append(pb.StepOp(commit=pb.CommitSessionRequest(session_id=sid, abort=True, epoch=epoch)))
            elif kind == COMMIT:
                commit = pb.CommitSessionRequest(session_id=sid, packed_token_ids=tokens, turn=self._turns.get(i, 0),
                                                 epoch=epoch)
                if flags & _KV_TOKENS:
                    commit.kv_tokens = count
                ops.append(pb.StepOp(commit=commit))
            elif kind == CLOSE:
                ops.append(pb.StepOp(close=pb.CloseSessionRequest(session_id=sid, cache=bool(flags & _SET),
                                                                  epoch=epoch)))
            else:
                ops.append(pb.StepOp(match=pb.MatchPrefixRequest(packed_token_ids=tokens,
                                                                 cache_salt=self._salts.get(i, ""),
                                                                 packed_response=True)))
        return ops

    def apply(self, response: pb.StepResponse) -> list[StepOutcome[Any]]:
        """Fill every outcome from the response and hand successful results to the sessions they name."""
        if response.HasField("columns"):
            self._apply_columns(response.columns)
            return list(self._outcomes)
        results = response.results
        if len(results) != len(self._kinds):
            raise RuntimeError(f"the service answered {len(results)} results for {len(self._kinds)} ops")
        for outcome, session, result in zip(self._outcomes, self._sessions, results, strict=True):
            kind = outcome.kind
            if result.status.code:
                outcome.error = error_from_status(result.status)
                continue
            value = _PARSERS[kind](getattr(result, kind))
            outcome._value = value
            if session is not None:
                session._apply(kind, value)
        return list(self._outcomes)

    def _apply_columns(self, cols: pb.StepColumnResults) -> None:
        n = len(self._kinds)
        if len(cols.codes) != 4 * n:
            raise RuntimeError(f"the service answered {len(cols.codes) // 4} results for {n} ops")
        results = _ColumnResults(cols, self._sids, self._kinds)
        outcomes = self._outcomes
        if results.failed:
            for i, status in zip(results.failed, cols.errors, strict=True):
                outcomes[i]._status = status
        for outcome in outcomes:
            outcome._results = results
        for session, outcome in zip(self._sessions, outcomes, strict=True):
            if session is not None and outcome._status is None:
                session._apply(outcome.kind, outcome.value)


class _ColumnResults:
    """A StepColumnResults answer, read op by op when an outcome's value is first asked for."""

    __slots__ = ("_arrays", "_cols", "_kinds", "_opened", "_page_ends", "_sids", "failed", "instance_id")

    def __init__(self, cols: pb.StepColumnResults, sids: list[str], kinds: bytearray) -> None:
        self._cols = cols
        self._sids = sids
        self._kinds = kinds
        codes = array("i", cols.codes)
        self.failed = [i for i, code in enumerate(codes) if code] if any(codes) else []
        if len(self.failed) != len(cols.errors):
            raise RuntimeError(f"the service answered {len(cols.errors)} errors for {len(self.failed)} failed ops")
        self._page_ends: list[int] | None = None
        self._opened: dict[int, str] | None = None
        self._arrays: dict[str, array[Any]] = {}
        self.instance_id = cols.instance_id

    def _num(self, name: str, i: int, typecode: str = "I") -> Any:
        col = self._arrays.get(name)
        if col is None:
            col = self._arrays[name] = array(typecode, getattr(self._cols, name))
        return col[i]

    def _pages(self, i: int) -> PageIds:
        if self._page_ends is None:
            self._page_ends = list(accumulate(array("I", self._cols.page_counts)))
        end = self._page_ends[i]
        start = self._page_ends[i - 1] if i else 0
        pages: PageIds = np.frombuffer(self._cols.page_ids, "<i4", end - start, 4 * start).astype(np.int32)
        return pages

    def result(self, kind: str, i: int) -> Any:
        num = self._num
        sid = self._sids[i]
        if kind == "extend":
            return ExtendResult(sid, num("epochs", i, "Q"), num("turns", i), num("capacity_tokens", i),
                                num("page_offsets", i), self._pages(i), num("num_pages", i))
        if kind == "append":
            return AppendResult(sid, num("epochs", i, "Q"), num("turns", i), num("cached_tokens", i),
                                num("context_tokens", i), num("capacity_tokens", i), num("page_offsets", i),
                                self._pages(i), num("num_pages", i), num("prefix_hit_tokens", i))
        if kind == "commit":
            return CommitResult(sid, num("context_tokens", i), num("kv_tokens", i), num("num_pages", i),
                                bool(self._cols.closed[i]))
        if kind == "close":
            return CloseResult(sid, bool(self._cols.closed[i]), num("cached_tokens", i))
        if kind == "open":
            if self._opened is None:
                failed = set(self.failed)
                opens = [j for j, k in enumerate(self._kinds) if k == OPEN and j not in failed]
                self._opened = dict(zip(opens, self._cols.opened_ids, strict=True))
            return OpenedSession(self._opened[i], num("epochs", i, "Q"), num("timeouts", i, "d"), self.instance_id)
        return MatchResult(num("cached_tokens", i), self._pages(i))


def _ref(session: SessionRef) -> tuple[str, int, StepSession | None]:
    if isinstance(session, str):
        return session, 0, None
    return session.session_id, session.epoch, session
