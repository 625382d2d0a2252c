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
"""

from __future__ import annotations

import uuid
from collections.abc import Callable
from typing import Any, Generic, Protocol, TypeVar

from engine_client import _codec as codec
from engine_client._codec import TokensLike
from engine_client.errors import KVCacheClientError, error_from_status
from engine_client.types import AppendResult, CloseResult, CommitResult, ExtendResult, MatchResult, OpenedSession
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

    __slots__ = ("_value", "error", "index", "kind")

    def __init__(self, kind: str, index: int) -> None:
        self.kind = kind
        """"open", "append", "extend", "commit", "close" or "match"."""
        self.index = index
        """The op's position in its batch."""
        self._value: Any = _PENDING
        self.error: KVCacheClientError | None = None

    @property
    def done(self) -> bool:
        return self._value is not _PENDING or self.error is not None

    @property
    def ok(self) -> bool:
        return self._value is not _PENDING

    @property
    def value(self) -> T:
        """The op's result; raises its typed error if it failed (and RuntimeError before the Step ran)."""
        if self.error is not None:
            raise self.error
        if self._value is _PENDING:
            raise RuntimeError(f"op {self.index} ({self.kind}) has not been sent: run the batch with client.step()")
        return self._value  # type: ignore[no-any-return]

    def __repr__(self) -> str:
        state = "pending" if not self.done else ("ok" if self.ok else f"error {self.error!r}")
        return f"StepOutcome({self.index} {self.kind}: {state})"


_PARSERS: dict[str, Callable[[Any], Any]] = {
    "open": codec.opened, "append": codec.appended, "extend": codec.extended, "commit": codec.committed,
    "close": codec.closed, "match": codec.match,
}


class StepBatch:
    """Ops for one `Step`, in the order they will apply. Send once; outcomes fill in place."""

    def __init__(self, engine_id: str | None = None) -> None:
        self.engine_id = engine_id
        """The default owner of the ops (None: the sending client's engine id)."""
        self._ops: list[pb.StepOp] = []
        self._outcomes: list[StepOutcome[Any]] = []
        self._sessions: list[StepSession | None] = []
        self.sent = False

    def __len__(self) -> int:
        return len(self._ops)

    @property
    def outcomes(self) -> list[StepOutcome[Any]]:
        return list(self._outcomes)

    # ------------------------------------------------------------------ ops

    def open(self, session_id: str = "", *, streaming: bool = True, timeout_seconds: float | None = None,
             cache_salt: str = "", engine_id: str = "", session: StepSession | None = None,
             ) -> StepOutcome[OpenedSession]:
        """Open a session in this Step. `session`, a session object not yet open, takes the result (its
        epoch); `Session.open_in` passes itself here."""
        sid = session.session_id if session is not None else session_id
        req = pb.OpenSessionRequest(session_id=sid or uuid.uuid4().hex, streaming=streaming,
                                    cache_salt=cache_salt, engine_id=engine_id)
        if timeout_seconds is not None:
            req.timeout_seconds = timeout_seconds
        if session is not None:
            session.session_id = req.session_id
        return self._add("open", pb.StepOp(open=req), session)

    def append(self, session: SessionRef, tokens: TokensLike, reserve_tokens: int = 0) -> StepOutcome[AppendResult]:
        sid, epoch, obj = _ref(session)
        req = pb.AppendSessionRequest(session_id=sid, packed_token_ids=codec.pack_tokens(tokens),
                                      reserve_tokens=reserve_tokens, epoch=epoch, packed_response=True)
        return self._add("append", pb.StepOp(append=req), obj)

    def extend(self, session: SessionRef, reserve_tokens: int) -> StepOutcome[ExtendResult]:
        sid, epoch, obj = _ref(session)
        req = pb.ExtendSessionRequest(session_id=sid, reserve_tokens=reserve_tokens, epoch=epoch,
                                      packed_response=True)
        return self._add("extend", pb.StepOp(extend=req), obj)

    def commit(self, session: SessionRef, tokens: TokensLike = b"", *, kv_tokens: int | None = None,
               turn: int = 0) -> StepOutcome[CommitResult]:
        sid, epoch, obj = _ref(session)
        req = pb.CommitSessionRequest(session_id=sid, packed_token_ids=codec.pack_tokens(tokens), turn=turn,
                                      epoch=epoch)
        if kv_tokens is not None:
            req.kv_tokens = kv_tokens
        return self._add("commit", pb.StepOp(commit=req), obj)

    def abort(self, session: SessionRef) -> StepOutcome[CommitResult]:
        """Roll the session's turn back (a commit with abort=true)."""
        sid, epoch, obj = _ref(session)
        return self._add("commit", pb.StepOp(commit=pb.CommitSessionRequest(session_id=sid, abort=True, epoch=epoch)),
                         obj)

    def close(self, session: SessionRef, *, cache: bool = False) -> StepOutcome[CloseResult]:
        sid, epoch, obj = _ref(session)
        return self._add("close", pb.StepOp(close=pb.CloseSessionRequest(session_id=sid, cache=cache, epoch=epoch)),
                         obj)

    def match(self, tokens: TokensLike, cache_salt: str = "") -> StepOutcome[MatchResult]:
        req = pb.MatchPrefixRequest(packed_token_ids=codec.pack_tokens(tokens), cache_salt=cache_salt,
                                    packed_response=True)
        return self._add("match", pb.StepOp(match=req), None)

    def _add(self, kind: str, op: pb.StepOp, session: StepSession | None) -> StepOutcome[Any]:
        if self.sent:
            raise RuntimeError("this batch was sent already: start a new StepBatch for the next step")
        outcome: StepOutcome[Any] = StepOutcome(kind, len(self._ops))
        self._ops.append(op)
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
        return pb.StepRequest(ops=self._ops, engine_id=engine_id)

    def apply(self, response: pb.StepResponse) -> list[StepOutcome[Any]]:
        """Fill every outcome from the response and hand successful results to the sessions they name."""
        results = response.results
        if len(results) != len(self._ops):
            raise RuntimeError(f"the service answered {len(results)} results for {len(self._ops)} ops")
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


def _ref(session: SessionRef) -> tuple[str, int, StepSession | None]:
    if isinstance(session, str):
        return session, 0, None
    return session.session_id, session.epoch, session
