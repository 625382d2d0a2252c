"""The session table: every open session's slot, found by id.

`SessionTable` finds sessions (by id, checking the epoch and the owner; finding changes nothing), creates
and removes them, keeps them in least-recently-active order and renders the client's view
(`SessionInfo`). Slots of closed sessions are kept for reuse (their buffers keep their memory). It never
moves pages nor changes a state: that is `turns.Turns`' and `slot.Slots`' business. Parked sessions are also
kept in the order they were parked, so that relief demotes them before any owned session.
"""

from __future__ import annotations

import math
import uuid
from collections import OrderedDict
from collections.abc import Callable, Iterator

from cache_service.core.errors import KVCacheError, Reason
from cache_service.core.slot import IDLE, SessionSlot, Slots
from cache_service.core.types import SessionInfo, SessionState

Session = SessionSlot
POOLED_SLOTS = 1024
"""Closed sessions' slots kept for reuse."""


class SessionTable:
    """Every open session, least recently active first, with counts by state."""

    def __init__(self, slots: Slots) -> None:
        self._slots = slots
        self._by_id: OrderedDict[str, Session] = OrderedDict()
        self._opened: dict[str, Session] = {}
        """The same sessions in the order they were opened (by epoch), for stable paging."""
        self._per_identity: dict[str, int] = {}
        self._next_epoch = 1
        self._spare: list[Session] = []
        self._parked: OrderedDict[str, Session] = OrderedDict()
        """Parked sessions in the order they were parked."""

    def __len__(self) -> int:
        return len(self._by_id)

    def __iter__(self) -> Iterator[Session]:
        """Sessions, least recently active first."""
        return iter(self._by_id.values())

    def items(self) -> Iterator[tuple[str, Session]]:
        return iter(self._by_id.items())

    @property
    def num_idle(self) -> int:
        return len(self._by_id) - self._slots.num_in_turn - self._slots.num_closing

    # ------------------------------------------------------------------ lookup

    def get(self, session_id: str, epoch: int = 0) -> Session:
        """The open session `session_id`; `epoch`, when nonzero, must be its epoch (SESSION_NOT_FOUND)."""
        s = self._by_id.get(session_id)
        if s is None or (epoch and epoch != s.epoch):
            raise KVCacheError(
                Reason.SESSION_NOT_FOUND, f"session {session_id!r} not found", session_id=session_id
            )
        return s

    def find(self, session_id: str) -> Session | None:
        return self._by_id.get(session_id)

    @staticmethod
    def check_owner(s: Session, engine_id: str, identity: str | None) -> None:
        """The caller's identity must be the session's (None: an operator, not checked), and a named engine
        must be its owner; either mismatch is NOT_OWNER."""
        if identity is not None and identity != s.identity:
            raise KVCacheError(
                Reason.NOT_OWNER, f"session {s.id!r} belongs to another identity", session_id=s.id,
            )
        if s.owner and engine_id and engine_id != s.owner:
            raise KVCacheError(
                Reason.NOT_OWNER, f"session {s.id!r} belongs to another engine",
                session_id=s.id, engine_id=engine_id,
            )

    # ------------------------------------------------------------------ lifecycle

    def check_new(self, session_id: str) -> None:
        if session_id in self._by_id:
            raise KVCacheError(
                Reason.SESSION_EXISTS, f"session {session_id!r} is already open", session_id=session_id
            )

    def count(self, identity: str) -> int:
        """Sessions `identity` has open."""
        return self._per_identity.get(identity, 0)

    def check_room(self, identity: str, *, max_sessions: int, quota: int) -> None:
        """SESSION_LIMIT when the service (`max_sessions`) or `identity` (`quota`) is full; 0 means no bound."""
        if max_sessions and len(self._by_id) >= max_sessions:
            raise KVCacheError(Reason.SESSION_LIMIT, f"{len(self._by_id)} sessions are open, the most the service "
                               f"allows (--max-sessions={max_sessions}): close some first", limit=max_sessions)
        if quota and self.count(identity) >= quota:
            raise KVCacheError(Reason.SESSION_LIMIT, f"identity {identity!r} has {quota} sessions open, its quota: "
                               "close some first", limit=quota, identity=identity)

    def create(
        self, session_id: str, *, streaming: bool, cache_salt: str, owner: str, identity: str,
        timeout_seconds: float, now: float
    ) -> Session:
        """Open a session (an empty id gets a generated one) with the next epoch."""
        session_id = session_id or uuid.uuid4().hex
        self.check_new(session_id)
        s = self._spare.pop() if self._spare else SessionSlot()
        s.reset(session_id, self._next_epoch, streaming=streaming, cache_salt=cache_salt, owner=owner,
                identity=identity, timeout_seconds=timeout_seconds, now=now)
        self._next_epoch += 1
        self._by_id[session_id] = self._opened[session_id] = s
        self._per_identity[identity] = self._per_identity.get(identity, 0) + 1
        return s

    def remove(self, s: Session) -> None:
        """Forget `s` (its KV must already be released). Its slot object may be reused by a later
        `create`, so nothing may keep it."""
        self._slots.release(s)
        self._parked.pop(s.id, None)
        del self._by_id[s.id]
        del self._opened[s.id]
        left = self._per_identity[s.identity] - 1
        if left:
            self._per_identity[s.identity] = left
        else:
            del self._per_identity[s.identity]
        if len(self._spare) < POOLED_SLOTS:
            self._spare.append(s)

    def touch(self, s: Session, now: float) -> None:
        """Activity: restart the sliding timeout and move `s` to the most recently active end."""
        s.last_active = now
        self._by_id.move_to_end(s.id)

    def parked(self, s: Session) -> None:
        """`s` was just parked (`Slots.park`)."""
        self._parked[s.id] = s

    def adopted(self, s: Session) -> None:
        """`s` was just adopted (`Slots.adopt`)."""
        del self._parked[s.id]

    def parked_sessions(self) -> Iterator[Session]:
        """Parked sessions, in the order they were parked."""
        return iter(self._parked.values())

    # ------------------------------------------------------------------ selections

    def demotable(self, exclude: Session | None) -> Iterator[Session]:
        """Idle sessions holding KV (never `exclude`): parked ones first, in the order they were parked, then
        the others least recently active first, and last of all (in the same order) parents whose children
        are live (docs/design.md §15); lazily, so a caller that needs a few looks at a few. Do not demote
        while iterating a generator made before."""
        parents: list[Session] = []
        for v in self._parked.values():
            if v is not exclude and v.committed_pages > 0:
                if v.children:
                    parents.append(v)
                else:
                    yield v
        for v in self._by_id.values():
            if v is not exclude and v.state is IDLE and v.committed_pages > 0 and not v.parked:
                if v.children:
                    parents.append(v)
                else:
                    yield v
        yield from parents

    def lru(self, limit: int, keep: Callable[[Session], bool]) -> tuple[list[Session], int]:
        """The `limit` least recently active sessions that `keep` accepts, and how many it accepts in all."""
        shown: list[Session] = []
        total = 0
        for s in self._by_id.values():
            if keep(s):
                total += 1
                if len(shown) < limit:
                    shown.append(s)
        return shown, total

    def page(self, after_epoch: int, size: int, keep: Callable[[Session], bool]) -> tuple[list[Session], int, bool]:
        """Sessions in opening order after `after_epoch` that `keep` accepts: up to `size` of them, how many
        `keep` accepts in all, and whether more follow the page."""
        page: list[Session] = []
        total = 0
        more = False
        for s in self._opened.values():
            if not keep(s):
                continue
            total += 1
            if s.epoch <= after_epoch:
                continue
            if len(page) < size:
                page.append(s)
            else:
                more = True
        return page, total, more

    def timed_out(self, now: float) -> list[Session]:
        return [s for s in self._by_id.values() if s.timed_out(now)]

    # ------------------------------------------------------------------ views

    @staticmethod
    def info(s: Session, now: float) -> SessionInfo:
        return SessionInfo(
            session_id=s.id,
            epoch=s.epoch,
            state=SessionState.PARKED if s.parked else s.state,
            streaming=s.streaming,
            cache_salt=s.cache_salt,
            engine_id=s.owner,
            context_tokens=len(s.tokens) >> 2,
            kv_tokens=s.kv_tokens,
            turns=s.turns,
            num_pages=len(s.pages) >> 2,
            radix_pages=s.radix_pages,
            held_pages=s.private_pages,
            in_flight_pages=s.in_flight_pages,
            idle_seconds=max(0.0, now - s.last_active),
            timeout_seconds=s.timeout_seconds,
            demoted=s.demoted,
            close_pending=s.close_pending,
            identity=s.identity,
            former_engine_id=s.former_owner,
            parked_seconds_left=max(0.0, s.parked_until - now) if s.parked and s.parked_until != math.inf
            else None,
            parent_session_id=s.parent_id,
            child_sessions=len(s.children),
        )


def session_filter(engine_id: str, identity: str | None, former_engine_id: str, state: SessionState | None
                   ) -> Callable[[Session], bool]:
    """Which sessions a listing keeps: owner `engine_id`, `identity`, former owner `former_engine_id` and
    `state` as the info view shows it (each test skipped when its value is empty / None)."""
    def keep(s: Session) -> bool:
        return ((not engine_id or s.owner == engine_id) and (identity is None or s.identity == identity)
                and (not former_engine_id or s.former_owner == former_engine_id)
                and (state is None or (SessionState.PARKED if s.parked else s.state) is state))
    return keep
