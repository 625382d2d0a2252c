"""The core's session calls: request checks, finding what a call names, and handing the work to its owner.

Session calls (`open`, `append`, `extend`, `commit`, `close`) take token ids as int32 little-endian bytes
already checked (`validate.token_bytes`) and return plain tuples, so a `Step` of many ops makes no
record or array per op; the facade (`cache.KVCacheCore`) wraps them for callers that want records.
Failed calls change no client-visible state, except pressure relief: an append that needs pages may evict
radix entries and demote idle sessions before it finds the pool still too small, and lease expiry noticed
at use (below). How sessions and leases end (closes, reaping, parking, lease expiry) is lifecycle.py's.

Lease expiry at use: after the session is found, an owner whose lease is overdue is ended first (its
sessions parked); that owner's call then fails with LEASE_EXPIRED, anyone else's goes on with the parked
session (an append adopts it). Finding a session or a lease changes nothing.
"""

from __future__ import annotations

from collections.abc import Callable

from cache_service.core.capacity import check_token_cap
from cache_service.core.config import CoreConfig
from cache_service.core.errors import KVCacheError, Reason, invalid_argument
from cache_service.core.leases import Lease, LeaseTable, lease_expired
from cache_service.core.lifecycle import CACHE, DROP, KEEP_PREFIX, Lifecycle
from cache_service.core.pages import PageAllocator
from cache_service.core.radix import RadixTree
from cache_service.core.reuse import ReuseLedger, check_report
from cache_service.core.sessions import SessionTable
from cache_service.core.slot import CLOSING, IDLE, SessionSlot, Slots, change
from cache_service.core.turns import Turns
from cache_service.core.types import TokenBytes
from cache_service.core.validate import check_count, check_id, check_salt, check_seconds

_CLOSE_MODES = frozenset((CACHE, DROP, KEEP_PREFIX))


class Ops:
    def __init__(self, config: CoreConfig, clock: Callable[[], float], pages: PageAllocator, radix: RadixTree,
                 slots: Slots, turns: Turns, sessions: SessionTable, leases: LeaseTable, lifecycle: Lifecycle
                 ) -> None:
        self.config = config
        self._clock = clock
        self._pages = pages
        self._radix = radix
        self._slots = slots
        self._turns = turns
        self._sessions = sessions
        self._by_id = sessions._by_id
        self._leases = leases
        self._life = lifecycle
        self._cap = config.max_session_tokens
        self.reuse = ReuseLedger()
        """What engines report at their commits (reuse.py)."""

    # ------------------------------------------------------------------ sessions

    def match(self, tokens: bytes, cache_salt: str) -> tuple[int, bytes]:
        """Read-only: (leading tokens cached under `cache_salt`, their pages as int32 LE). No LRU touch."""
        check_salt(cache_salt)
        ps = self.config.page_size
        n = (len(tokens) >> 2) // ps * ps
        match = self._radix.match(cache_salt, tokens[: n * 4], lock=False, touch=False)
        return match.num_pages * ps, match.pages

    def open(self, session_id: str, streaming: bool, timeout_seconds: float | None, cache_salt: str,
             engine_id: str, identity: str, quota: int, parent_session_id: str = "") -> tuple[str, int, float]:
        now = self._clock()
        if session_id:
            check_id(session_id, "session_id")
        if parent_session_id:
            check_id(parent_session_id, "parent_session_id")
            if parent_session_id == session_id:
                raise invalid_argument("parent_session_id", f"session {session_id!r} cannot be its own parent")
        if cache_salt:
            check_salt(cache_salt)
        if timeout_seconds is None:
            timeout_seconds = self.config.session_timeout_seconds
        else:
            check_seconds(timeout_seconds, "timeout_seconds")
        lease = self._life.live_lease(engine_id, now, identity) if engine_id else None
        if session_id:
            self._sessions.check_new(session_id)
        parent = self._parent(parent_session_id, session_id, cache_salt, identity) if parent_session_id else None
        self._sessions.check_room(identity, max_sessions=self.config.max_sessions, quota=quota)
        s = self._sessions.create(session_id, streaming=streaming, cache_salt=cache_salt, owner=engine_id,
                                  identity=identity, timeout_seconds=timeout_seconds, now=now)
        if parent is not None:
            self._slots.link(s, parent)
        if lease is not None:
            lease.sessions.add(s.id)
        changes = self._slots.changes
        if changes is not None:
            changes.append(change("opened", s))
        return s.id, s.epoch, timeout_seconds

    def _parent(self, parent_id: str, session_id: str, cache_salt: str, identity: str) -> SessionSlot:
        """The open session a new session `session_id` names as its parent (docs/design.md §15): it must exist
        (SESSION_NOT_FOUND), belong to the same identity and cache salt (NOT_OWNER), and not have the new
        session among its ancestors (INVALID_ARGUMENT); every refusal names the field parent_session_id."""
        p = self._by_id.get(parent_id)
        if p is None:
            raise KVCacheError(Reason.SESSION_NOT_FOUND, f"parent session {parent_id!r} not found",
                               session_id=parent_id, field="parent_session_id")
        if p.identity != identity:
            raise KVCacheError(Reason.NOT_OWNER, f"parent session {parent_id!r} belongs to another identity",
                               session_id=parent_id, field="parent_session_id")
        if p.cache_salt != cache_salt:
            raise KVCacheError(Reason.NOT_OWNER, f"parent session {parent_id!r} has another cache_salt: a tree "
                               "lives in one tenant's cache", session_id=parent_id, field="parent_session_id")
        up: SessionSlot | None = p
        while up is not None:
            if up.id == session_id:
                raise invalid_argument("parent_session_id", f"{parent_id!r} descends from {session_id!r}: a cycle")
            up = up.parent
        return p

    def append(self, session_id: str, tokens: TokenBytes, reserve_tokens: int, epoch: int, engine_id: str,
               identity: str | None) -> tuple[SessionSlot, tuple[int, int, int, int, bytes, int, int]]:
        """Start a turn (see `KVCacheCore.append`); returns the slot and `Turns.begin`'s outcome."""
        now = self._clock()
        if reserve_tokens < 0:
            check_count(reserve_tokens, "reserve_tokens")
        s = self.session(session_id, epoch, engine_id, identity, now, True)
        if self._pages.quarantine:
            self._life.release_quarantine(now)
        if s.state is not IDLE:
            if s.state is CLOSING:
                raise KVCacheError(Reason.SESSION_CLOSING, f"session {session_id!r} is closing",
                                   session_id=session_id)
            raise KVCacheError(Reason.SESSION_BUSY, f"session {session_id!r} already has turn {s.turns + 1} in flight",
                               session_id=session_id)
        adopter: Lease | None = None
        if s.parked and engine_id:
            adopter = self._life.live_lease(engine_id, now, identity)
            if adopter.identity != s.identity:
                raise KVCacheError(Reason.NOT_OWNER, f"engine {engine_id!r} belongs to another identity than "
                                   f"session {session_id!r}", session_id=session_id, engine_id=engine_id)
        context = s.committed_tokens + (len(tokens) >> 2)
        if context == 0:
            raise KVCacheError(Reason.INVALID_TOKENS, "token_ids is empty and the session has no context yet",
                               field="token_ids")
        if self._cap:
            check_token_cap(self._cap, session_id, context + reserve_tokens,
                            f"context {context} + reserve {reserve_tokens}")
        outcome = self._turns.begin(s, tokens, reserve_tokens)
        if s.parked:
            self._slots.adopt(s, engine_id if adopter is not None else "")
            self._sessions.adopted(s)
            if adopter is not None:
                adopter.sessions.add(s.id)
        s.last_active = now
        self._by_id.move_to_end(session_id)
        return s, outcome

    def extend(self, session_id: str, reserve_tokens: int, epoch: int, engine_id: str, identity: str | None
               ) -> tuple[SessionSlot, tuple[int, int, bytes, int]]:
        now = self._clock()
        if reserve_tokens < 0:
            check_count(reserve_tokens, "reserve_tokens")
        s = self.session(session_id, epoch, engine_id, identity, now, False)
        if s.state is IDLE:
            self.check_turn(s, 0)
        if self._pages.quarantine:
            self._life.release_quarantine(now)
        if self._cap and reserve_tokens:
            capacity = (len(s.pages) >> 2) * self.config.page_size
            check_token_cap(self._cap, session_id, capacity + reserve_tokens,
                            f"capacity {capacity} + reserve {reserve_tokens} slots")
        outcome = self._turns.extend(s, reserve_tokens)
        s.last_active = now
        self._by_id.move_to_end(session_id)
        return s, outcome

    def commit(self, session_id: str, generated: TokenBytes, kv_tokens: int | None, abort: bool, turn: int, epoch: int,
               engine_id: str, identity: str | None, reuse: tuple[int, int, int] | None = None
               ) -> tuple[str, int, int, int, bool]:
        """End the turn in flight; returns (session id, context tokens, kv tokens, pages, closed). `reuse`: the
        engine's report on the turn's context (reuse.py), added to its figures once the commit is done."""
        now = self._clock()
        s = self.session(session_id, epoch, engine_id, identity, now, False)
        if s.state is IDLE or turn:
            self.check_turn(s, turn)
        if abort:
            if generated:
                raise invalid_argument("token_ids", "must be empty when abort is set")
            if kv_tokens is not None:
                raise invalid_argument("kv_tokens", "must be unset when abort is set")
        if reuse is not None:
            check_report(reuse, s.turn_context_tokens)
        if abort:
            self._turns.abort(s)
        else:
            self._turns.commit(s, generated, self._kv_after_commit(s, len(generated) >> 2, kv_tokens))
        if reuse is not None:
            self.reuse.record(s.owner or engine_id, s.turn_cached_tokens, reuse)
        s.last_active = now
        self._by_id.move_to_end(session_id)
        closed = s.state is CLOSING
        if closed:
            self._life.finish_close(s, s.close_mode)  # the counts below are then what the close left: none
        else:
            self._slots.transition(s, IDLE)
        return s.id, s.committed_tokens, s.kv_tokens, s.committed_pages, closed

    def close(self, session_id: str, cache: bool, epoch: int, engine_id: str, identity: str | None, mode: int = 0
              ) -> tuple[str, bool, int]:
        """Close now (returns (id, True, tokens cached)), or at the turn's end (id, False, 0). `mode` is a
        CloseMode; 0 (unspecified) takes `cache`'s meaning: cache=True caches, cache=False frees the private
        KV (keep-prefix for a top-level session, drop for a child: docs/design.md §15)."""
        if mode and mode not in _CLOSE_MODES:
            raise invalid_argument("mode", f"{mode} is not a CloseMode (1 cache, 2 drop, 3 keep-prefix)")
        s = self.session(session_id, epoch, engine_id, identity, self._clock(), False)
        if not mode:
            mode = CACHE if cache else DROP if s.parent_id else KEEP_PREFIX
        if s.state is not IDLE:
            s.close_mode = mode
            self._slots.transition(s, CLOSING)
            return s.id, False, 0
        return s.id, True, self._life.finish_close(s, mode)

    def session(self, session_id: str, epoch: int, engine_id: str, identity: str | None, now: float,
                appending: bool) -> SessionSlot:
        """The session a mutating call names. Its owner's lease, when overdue, is ended here first (its
        sessions parked): that owner's call gets LEASE_EXPIRED, anyone else's goes on with the parked session.
        A caller naming an engine whose lease has expired hears LEASE_EXPIRED for a session it no longer
        finds or owns: that is why. Another engine of the session's identity gets NOT_OWNER, or SESSION_BUSY
        when `appending` to a session whose turn is in flight (an engine that lost a race to adopt it)."""
        s = self._by_id.get(session_id)
        if s is None or (epoch and epoch != s.epoch):
            if engine_id and self._leases.has_expired(engine_id):
                raise lease_expired(engine_id)
            raise KVCacheError(Reason.SESSION_NOT_FOUND, f"session {session_id!r} not found", session_id=session_id)
        owner = s.owner
        if owner:
            lease = self._leases.owner_of(owner)
            if not lease.held and now >= lease.expires_at:
                self._life.end_lease(lease, expired=True, now=now)
                if engine_id == owner:
                    raise lease_expired(engine_id)
                owner = ""
        if identity is not None and identity != s.identity:
            self._sessions.check_owner(s, engine_id, identity)
        if engine_id and engine_id != owner and self._leases.has_expired(engine_id):
            if s.former_owner != engine_id:
                raise lease_expired(engine_id)
            raise KVCacheError(
                Reason.LEASE_EXPIRED, f"the lease of engine {engine_id!r} has expired; session {session_id!r} "
                f"was parked at its end" + (f" and engine {owner!r} has adopted it" if owner else "")
                + ": register again", engine_id=engine_id, session_id=session_id)
        if owner and engine_id and engine_id != owner:
            if appending and s.state is not IDLE:
                raise KVCacheError(Reason.SESSION_BUSY, f"session {session_id!r} already has turn {s.turns + 1} "
                                   f"in flight (engine {owner!r} owns it)", session_id=session_id)
            self._sessions.check_owner(s, engine_id, identity)
        return s

    def check_turn(self, s: SessionSlot, turn: int) -> None:
        if s.state is IDLE:
            raise KVCacheError(Reason.NO_TURN_IN_FLIGHT, f"session {s.id!r} has no turn in flight", session_id=s.id)
        if turn and turn != s.turns + 1:
            raise KVCacheError(Reason.NO_TURN_IN_FLIGHT,
                               f"turn {turn} of session {s.id!r} is not in flight (turn {s.turns + 1} is)",
                               session_id=s.id)

    def _kv_after_commit(self, s: SessionSlot, generated: int, kv_tokens: int | None) -> int:
        """Check a commit against the token cap and return the session's KV token count after it."""
        new_total = s.turn_context_tokens + generated
        if self._cap:
            check_token_cap(self._cap, s.id, new_total, f"committing {generated} generated tokens")
        capacity = (len(s.pages) >> 2) * self.config.page_size
        if kv_tokens is None:
            return min(s.turn_context_tokens + max(generated - 1, 0), capacity)
        hi = min(new_total, capacity)
        if not s.turn_cached_tokens <= kv_tokens <= hi:
            raise invalid_argument("kv_tokens", f"{kv_tokens} is outside [{s.turn_cached_tokens}, {hi}] "
                                   "(the turn's cached tokens .. context with its reserved capacity)")
        return kv_tokens
