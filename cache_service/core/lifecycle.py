"""Leases from registration to their end, and how sessions end: a close's release, the reaper, and parking.

`Lifecycle` is what `ops.Ops` (the session calls) and the facade's lease calls hand an ending to. Lease calls
end leases and park what they held (docs/design.md §11). Lease expiry happens in `reap` and at one explicit
point of each session call (`Ops.session`): an owner whose lease is overdue is ended first (its sessions
parked).

Parking: a lease's end aborts its sessions' turns in flight and parks each session (owner none, KV kept,
closed with cache=true after --parked-session-timeout). When the lease ended by TTL the engine may be
stalled rather than gone: what its aborted turns release, and the last partial page of such a session,
go to quarantine (`Turns.fence`). An engine whose lease expired hears LEASE_EXPIRED from every
session call, also for the sessions it owned that were parked or adopted since.
"""

from __future__ import annotations

import math
import uuid
from collections.abc import Callable

from cache_service.core.config import CoreConfig
from cache_service.core.errors import KVCacheError, Reason, invalid_argument
from cache_service.core.leases import Lease, LeaseTable, lease_expired
from cache_service.core.ledger import Counters
from cache_service.core.pages import PageAllocator
from cache_service.core.radix import RadixTree
from cache_service.core.sessions import SessionTable
from cache_service.core.slot import CLOSING, IDLE, IN_TURN, SessionSlot, Slots, change
from cache_service.core.turns import Turns
from cache_service.core.types import CloseMode, EngineInfo
from cache_service.core.validate import check_id, check_seconds

CACHE, DROP, KEEP_PREFIX = int(CloseMode.CACHE), int(CloseMode.DROP), int(CloseMode.KEEP_PREFIX)
"""CloseMode values as the hot path compares them."""


class Lifecycle:
    """Ends sessions (closes, reaping, parking) and leases (expiry, re-registration, unregistering)."""

    def __init__(self, config: CoreConfig, clock: Callable[[], float], sessions: SessionTable, leases: LeaseTable,
                 slots: Slots, turns: Turns, radix: RadixTree, pages: PageAllocator, counters: Counters) -> None:
        self.config = config
        self._clock = clock
        self._sessions = sessions
        self._leases = leases
        self._slots = slots
        self._turns = turns
        self._radix = radix
        self._pages = pages
        self._c = counters

    # ------------------------------------------------------------------ sessions

    def finish_close(self, s: SessionSlot, mode: int, reason: str = "client") -> int:
        """Release the session's KV as `mode` (a CloseMode) says and forget it; `reason` (events.CLOSE_REASONS)
        is why, for its event. Returns the context tokens now cached (mode cache).

        What a drop leaves in the radix (a streaming session's first-turn prompt), and what a child's cache
        leaves, is a closed session's leftover: evicted before anything else until a match hits it again."""
        cache = mode == CACHE
        self._slots.orphan(s)  # its children lose its guard before its KV moves
        node = self._turns.drop_kv(s, cache=cache)
        if node is not None and (mode == DROP or (cache and s.parent_id)):
            self._radix.classes.mark_leftover(node)
        cached = self._turns.cached_tokens(s) if cache else 0
        self._c.session_tokens -= s.committed_tokens
        self._sessions.remove(s)
        changes = self._slots.changes
        if changes is not None:
            changes.append(change("closed", s, reason))
        if s.owner:
            lease = self._leases.find(s.owner)
            if lease is not None:
                lease.sessions.discard(s.id)
        return cached

    def reap_session(self, s: SessionSlot, *, count: bool = True, reason: str = "timeout") -> None:
        """Close `s` now, aborting its turn if one is in flight; its committed KV goes to the radix
        (unless a deferred close asked otherwise). `reason`: why (events.CLOSE_REASONS)."""
        mode = s.close_mode if s.state is CLOSING else CACHE
        if s.state is not IDLE:
            self._turns.abort(s)
        if count and s.parked:
            self._c.expired_parked_sessions += 1
        if s.parked and reason == "timeout":
            reason = "parked_timeout"
        self.finish_close(s, mode, reason)
        self._c.reaped_sessions += count

    def park_sessions(self, session_ids: tuple[str, ...], now: float, *, fence: bool) -> tuple[str, ...]:
        """Their engine's lease has ended: abort each session's turn in flight and park it (a session whose
        close was deferred closes now, as it asked; one with nothing committed closes too: there is nothing
        to continue). `fence`: the engine may still be running (call inside `quarantining`), see
        `Turns.fence`. Parks least recently active first (relief demotes parked sessions in that order).
        Returns the ids parked."""
        sessions = [self._sessions.get(sid) for sid in session_ids]
        sessions.sort(key=_last_active)
        timeout = self.config.parked_session_timeout_seconds
        parked: list[str] = []
        for s in sessions:
            if s.state is CLOSING or s.committed_tokens == 0:
                self.reap_session(s, count=False, reason="lease_ended")
                continue
            in_turn = s.state is IN_TURN
            if in_turn:
                self._turns.abort(s)
                self._slots.transition(s, IDLE)
            own = s.last_active + s.timeout_seconds if s.timeout_seconds else math.inf
            until = now + timeout if timeout else own
            if fence and in_turn:
                self._turns.fence(s)
            self._slots.park(s, until)
            self._sessions.parked(s)
            parked.append(s.id)
        return tuple(parked)

    def release_quarantine(self, now: float) -> None:
        due = self._pages.next_release()
        if due is not None and due <= now:
            self._pages.release_due(now)
    def reap(self) -> tuple[tuple[str, ...], tuple[str, ...]]:
        now = self._clock()
        self._pages.release_due(now)
        reaped: list[str] = []
        engines: list[str] = []
        for lease in self._leases.due(now):
            engines.append(lease.engine_id)
            self.end_lease(lease, expired=True, now=now)
        for s in self._sessions.timed_out(now):
            if s.state is not IDLE and s.owner:
                continue  # its owner's lease is live (expired ones were handled above)
            sid = s.id
            if s.state is not IDLE and self.config.quarantine_seconds:
                with self._pages.quarantining(now + self.config.quarantine_seconds):
                    self.reap_session(s)  # whoever started the turn may still be writing it
            else:
                self.reap_session(s)
            reaped.append(sid)
        return tuple(reaped), tuple(engines)

    def register(self, engine_id: str, ttl_seconds: float, identity: str | None, held: bool) -> EngineInfo:
        now = self._clock()
        if engine_id:
            check_id(engine_id, "engine_id")
        check_seconds(ttl_seconds, "ttl_seconds")
        ceiling = self.config.max_lease_ttl_seconds
        if ceiling and ttl_seconds > ceiling:
            raise invalid_argument("ttl_seconds", f"{ttl_seconds} is above --max-lease-ttl={ceiling}")
        engine_id = engine_id or f"engine-{uuid.uuid4().hex[:12]}"
        owner = identity if identity is not None else ""
        old = self._leases.find(engine_id)
        if old is not None:
            check_lease_owner(old, identity)
            owner = old.identity if identity is None else owner
            if old.expired(now):
                self.end_lease(old, expired=True, now=now)  # a stalled incarnation may still write
            else:
                self.park_sessions(self._leases.end(old, expired=False), now, fence=False)
        lease = self._leases.add(engine_id, ttl_seconds or self.config.lease_ttl_seconds, now, identity=owner,
                                 held=held)
        return lease.info(now)

    def live_lease(self, engine_id: str, now: float, identity: str | None) -> Lease:
        lease = self._leases.get(engine_id)
        check_lease_owner(lease, identity)
        if lease.expired(now):
            self.end_lease(lease, expired=True, now=now)
            raise lease_expired(engine_id)
        return lease

    def end_lease(self, lease: Lease, *, expired: bool, now: float) -> tuple[str, ...]:
        """End `lease` and park its sessions (turns in flight aborted). Returns the ids parked (a session with
        nothing committed, or whose close was deferred, closes instead).

        An expired lease's engine may be stalled rather than gone, and still write its pages: what its
        sessions' aborted turns release (and the last partial page each was writing) is quarantined for
        --quarantine-seconds instead of going straight to the free list.
        """
        held = self._leases.end(lease, expired=expired)
        if expired and self.config.quarantine_seconds:
            with self._pages.quarantining(now + self.config.quarantine_seconds):
                parked = self.park_sessions(held, now, fence=True)
        else:
            parked = self.park_sessions(held, now, fence=False)
        if expired:
            self._c.expired_leases += 1
        return parked


def check_lease_owner(lease: Lease, identity: str | None) -> None:
    if identity is not None and identity != lease.identity:
        raise KVCacheError(Reason.NOT_OWNER, f"engine {lease.engine_id!r} belongs to another identity",
                           engine_id=lease.engine_id)


def _last_active(s: SessionSlot) -> float:
    return s.last_active
