"""`KVCacheCore`: the facade the rpc layer calls. It validates a request, finds what it names, and hands
the work to the module that owns it:

    pages.py       the page allocator (free list)
    radix.py       the radix prefix cache (eviction order in eviction.py)
    sessions.py    the session table: lookup with epoch and owner checks, state counts, the info view
    turns.py       append / commit / abort, caching KV into the radix, dropping it
    capacity.py    the relief plan (evict, demote) computed before anything changes
    leases.py      engine leases and what an expiry releases
    accounting.py  counters, stats() and check_invariants()
    validate.py    input checks

Failed calls change no client-visible state. The one exception is pressure relief: an append that needs
pages may evict radix entries and demote idle sessions before it finds the pool still too small.

Identities: every session and lease belongs to the identity (an opaque name) that created it. Calls pass
the caller's `identity`; another identity's session or engine is NOT_OWNER. `identity=None` is an
operator's call, checked against nobody. Without tenants everyone is the identity "".
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable

import numpy.typing as npt

from cache_service.core.accounting import Accounting, Counters
from cache_service.core.config import CoreConfig
from cache_service.core.errors import KVCacheError, Reason, invalid_argument
from cache_service.core.events import EventFeed
from cache_service.core.leases import Lease, LeaseTable, lease_expired
from cache_service.core.pages import PageAllocator
from cache_service.core.radix import RadixTree, token_key
from cache_service.core.sessions import Session, SessionTable
from cache_service.core.turns import Turns
from cache_service.core.types import (
    EMPTY_PAGES,
    AppendResult,
    CloseResult,
    CommitResult,
    EngineInfo,
    ExtendResult,
    MatchResult,
    OpenResult,
    ReapResult,
    SessionInfo,
    SessionState,
    Stats,
    TokenArray,
)
from cache_service.core.validate import as_tokens, check_count, check_id, check_salt, check_seconds

Clock = Callable[[], float]


class KVCacheCore:
    """The cache core. Single-threaded: one caller at a time, no awaits inside a call."""

    def __init__(self, config: CoreConfig, clock: Clock = time.monotonic) -> None:
        self.config = config
        self.page_size = config.page_size
        self._clock = clock
        self.pages = PageAllocator(config.num_pages)
        self.events = EventFeed(config.num_pages, config.page_size)
        """The change feed (radix pages in and out, sessions); it records once something `start`s it."""
        self.radix = RadixTree(config.page_size, self.pages.free, config.eviction_policy, self.events)
        self.sessions = SessionTable()
        self.leases = LeaseTable(config.expired_lease_memory)
        self.counters = Counters()
        self.turns = Turns(config, self.pages, self.radix, self.sessions, self.counters)
        self.accounting = Accounting(config, self.pages, self.radix, self.sessions, self.leases, self.counters)

    # ================================================================== probes

    def match_prefix(self, token_ids: npt.ArrayLike, cache_salt: str = "") -> MatchResult:
        """Read-only: how many leading tokens (whole pages) are cached under `cache_salt`. No LRU touch."""
        tokens = as_tokens(token_ids)
        check_salt(cache_salt)
        match = self.radix.match(cache_salt, token_key(tokens, self.page_size), touch=False)
        return MatchResult(match.num_pages * self.page_size, match.pages)

    # ================================================================== sessions

    def open_session(
        self,
        session_id: str = "",
        *,
        streaming: bool = False,
        timeout_seconds: float | None = None,
        cache_salt: str = "",
        engine_id: str = "",
        identity: str = "",
        quota: int = 0,
    ) -> OpenResult:
        """Open a session for `identity`. An empty id gets a generated one; `timeout_seconds` None means the
        default, 0 means never. `engine_id` (optional) must hold a live lease of the same identity and
        becomes the owner. SESSION_LIMIT when --max-sessions or the identity's `quota` (0: none) is full."""
        now = self._clock()
        if session_id:
            check_id(session_id, "session_id")
        check_salt(cache_salt)
        if timeout_seconds is None:
            timeout_seconds = self.config.session_timeout_seconds
        check_seconds(timeout_seconds, "timeout_seconds")
        lease = self._live_lease(engine_id, now, identity) if engine_id else None
        if session_id:
            self.sessions.check_new(session_id)
        self.sessions.check_room(identity, max_sessions=self.config.max_sessions, quota=quota)
        s = self.sessions.create(session_id, streaming=streaming, cache_salt=cache_salt, owner=engine_id,
                                 identity=identity, timeout_seconds=timeout_seconds, now=now)
        if lease is not None:
            lease.sessions.add(s.id)
        if self.events.recording:
            self.events.session("opened", s)
        return OpenResult(s.id, s.epoch, timeout_seconds)

    def append(
        self,
        session_id: str,
        token_ids: npt.ArrayLike,
        reserve_tokens: int = 0,
        *,
        epoch: int = 0,
        engine_id: str = "",
        identity: str | None = "",
    ) -> AppendResult:
        """Start a turn: append `token_ids` to the context and reserve `reserve_tokens` slots after it.

        Fails SESSION_BUSY while a turn is in flight, SESSION_CLOSING after a deferred close, and
        RESOURCE_EXHAUSTED (SESSION_TOKEN_LIMIT, SESSION_BUDGET, POOL_EXHAUSTED) without allocating.
        """
        now = self._clock()
        tokens = as_tokens(token_ids)
        check_count(reserve_tokens, "reserve_tokens")
        s = self._session(session_id, epoch, engine_id, identity, now)
        self._release_quarantine(now)
        if s.state is SessionState.CLOSING:
            raise KVCacheError(
                Reason.SESSION_CLOSING, f"session {session_id!r} is closing", session_id=session_id
            )
        if s.state is SessionState.IN_TURN:
            raise KVCacheError(
                Reason.SESSION_BUSY, f"session {session_id!r} already has turn {s.turns + 1} in flight",
                session_id=session_id,
            )
        context = s.committed_tokens + tokens.size
        if context == 0:
            raise KVCacheError(
                Reason.INVALID_TOKENS, "token_ids is empty and the session has no context yet",
                field="token_ids",
            )
        total = context + reserve_tokens
        cap = self.config.max_session_tokens
        if cap and total > cap:
            raise KVCacheError(
                Reason.SESSION_TOKEN_LIMIT,
                f"session {session_id!r} would hold {total} tokens (context {context} + reserve "
                f"{reserve_tokens}), above the per-session cap of {cap}",
                session_id=session_id, limit=cap, requested=total,
            )
        result = self.turns.begin(s, tokens, reserve_tokens)
        self.sessions.touch(s, now)
        return result

    def extend(self, session_id: str, reserve_tokens: int, *, epoch: int = 0, engine_id: str = "",
               identity: str | None = "") -> ExtendResult:
        """Grow the turn in flight by `reserve_tokens` slots (decode that outgrew its reservation): the
        capacity becomes at least the old capacity + `reserve_tokens`, in whole pages. Same capacity rules
        as an append (SESSION_TOKEN_LIMIT against the capacity asked, relief, never a partial allocation);
        NO_TURN_IN_FLIGHT without a turn. A turn whose close is deferred may still grow."""
        now = self._clock()
        check_count(reserve_tokens, "reserve_tokens")
        s = self._session(session_id, epoch, engine_id, identity, now)
        self._check_turn(s, 0)
        self._release_quarantine(now)
        total = len(s.pages) * self.page_size + reserve_tokens
        cap = self.config.max_session_tokens
        if cap and reserve_tokens and total > cap:
            raise KVCacheError(
                Reason.SESSION_TOKEN_LIMIT,
                f"session {session_id!r} would reach {total} slots (capacity {total - reserve_tokens} + "
                f"{reserve_tokens}), above the per-session cap of {cap}",
                session_id=session_id, limit=cap, requested=total,
            )
        result = self.turns.extend(s, reserve_tokens)
        self.sessions.touch(s, now)
        return result

    def commit(
        self,
        session_id: str,
        token_ids: npt.ArrayLike = EMPTY_PAGES,
        *,
        kv_tokens: int | None = None,
        abort: bool = False,
        turn: int = 0,
        epoch: int = 0,
        engine_id: str = "",
        identity: str | None = "",
    ) -> CommitResult:
        """End the turn in flight.

        Commit records the generated `token_ids`; KV is taken as written for every context token and
        every generated token but the last, capped at the reservation, unless `kv_tokens` says how many
        leading tokens have KV. The unused reservation is freed. `abort=True` rolls back to the last
        committed state (earlier KV kept). `turn`, when nonzero, must name the turn in flight. A deferred
        close completes here.
        """
        now = self._clock()
        generated = as_tokens(token_ids)
        s = self._session(session_id, epoch, engine_id, identity, now)
        self._check_turn(s, turn)
        if abort:
            if generated.size:
                raise invalid_argument("token_ids", "must be empty when abort is set")
            if kv_tokens is not None:
                raise invalid_argument("kv_tokens", "must be unset when abort is set")
            self.turns.abort(s)
        else:
            self.turns.commit(s, generated, self._kv_after_commit(s, generated, kv_tokens))
        self.sessions.touch(s, now)
        closed = s.close_pending
        if closed:
            self._finish_close(s, s.close_cache)
        else:
            self.sessions.set_state(s, SessionState.IDLE)
        return CommitResult(s.id, s.committed_tokens, s.kv_tokens, s.committed_pages, closed)

    def close(
        self, session_id: str, *, cache: bool = False, epoch: int = 0, engine_id: str = "",
        identity: str | None = "",
    ) -> CloseResult:
        """Close a session. During a turn the close is deferred to the turn's end (SESSION_CLOSING for
        new appends meanwhile). `cache=True` inserts the committed context's full pages into the radix."""
        now = self._clock()
        s = self._session(session_id, epoch, engine_id, identity, now)
        if s.in_turn:
            s.close_pending = True
            s.close_cache = cache
            self.sessions.set_state(s, SessionState.CLOSING)
            return CloseResult(s.id, closed=False, cached_tokens=0)
        return CloseResult(s.id, closed=True, cached_tokens=self._finish_close(s, cache))

    def get_session(self, session_id: str, *, epoch: int = 0) -> SessionInfo:
        return self.sessions.info(self.sessions.get(session_id, epoch), self._clock())

    def session_tokens(self, session_id: str, *, epoch: int = 0) -> TokenArray:
        """A copy of the session's context tokens (committed, plus the in-flight turn's input)."""
        tokens: TokenArray = self.sessions.get(session_id, epoch).tokens.view().copy()
        return tokens

    def list_sessions(self, engine_id: str = "", identity: str | None = None) -> list[SessionInfo]:
        """Sessions, least recently active first; only `engine_id`'s and `identity`'s when given."""
        now = self._clock()
        return [self.sessions.info(s, now) for s in self.sessions
                if (not engine_id or s.owner == engine_id) and (identity is None or s.identity == identity)]

    def list_sessions_lru(self, limit: int, *, engine_id: str = "", identity: str | None = None
                          ) -> tuple[list[SessionInfo], int]:
        """The `limit` least recently active sessions (filtered as in `list_sessions`), and how many match."""
        now = self._clock()
        shown: list[SessionInfo] = []
        total = 0
        for s in self.sessions:
            if (not engine_id or s.owner == engine_id) and (identity is None or s.identity == identity):
                total += 1
                if len(shown) < limit:
                    shown.append(self.sessions.info(s, now))
        return shown, total

    def list_sessions_page(self, *, after_epoch: int = 0, size: int, engine_id: str = "",
                           identity: str | None = None) -> tuple[list[SessionInfo], int, int]:
        """A page of sessions in the order they were opened, after the one of epoch `after_epoch`: up to
        `size` infos, how many match in all, and the epoch to continue after (0 when this is the last page)."""
        now = self._clock()
        page, total, more = self.sessions.page(
            after_epoch, size, lambda s: (not engine_id or s.owner == engine_id)
            and (identity is None or s.identity == identity))
        return [self.sessions.info(s, now) for s in page], total, page[-1].epoch if more and page else 0

    def reap(self) -> ReapResult:
        """Expire due leases and close timed-out sessions (their committed KV goes to the radix).

        An in-flight turn is never reaped while its owner's lease lives; an ownerless session is reaped
        on timeout even mid-turn (the turn is aborted, and what it released is quarantined like an expired
        lease's pages). Quarantined pages whose time has come are freed first.
        """
        now = self._clock()
        self.pages.release_due(now)
        reaped: list[str] = []
        engines: list[str] = []
        for lease in self.leases.due(now):
            engines.append(lease.engine_id)
            reaped.extend(self._end_lease(lease, expired=True, now=now))
        for s in self.sessions.timed_out(now):
            if s.in_turn and s.owner:
                continue  # its owner's lease is live (expired ones were handled above)
            if s.in_turn and self.config.quarantine_seconds:
                with self.pages.quarantining(now + self.config.quarantine_seconds):
                    self._reap_session(s)  # whoever started the turn may still be writing it
            else:
                self._reap_session(s)
            reaped.append(s.id)
        return ReapResult(tuple(reaped), tuple(engines))

    # ================================================================== leases

    def register_engine(self, engine_id: str = "", ttl_seconds: float = 0.0, *, identity: str | None = "",
                        held: bool = False) -> EngineInfo:
        """Start a lease for `identity` (TTL default from config, at most --max-lease-ttl). Re-registering a
        live id of the same identity releases what the previous incarnation held first: the usual cause is
        an engine restarted under the same name; another identity's live id is NOT_OWNER. A `held` lease
        lasts until `end_held_lease`, never expiring by TTL (HoldLease)."""
        now = self._clock()
        if engine_id:
            check_id(engine_id, "engine_id")
        check_seconds(ttl_seconds, "ttl_seconds")
        ceiling = self.config.max_lease_ttl_seconds
        if ceiling and ttl_seconds > ceiling:
            raise invalid_argument("ttl_seconds", f"{ttl_seconds} is above --max-lease-ttl={ceiling}")
        engine_id = engine_id or f"engine-{uuid.uuid4().hex[:12]}"
        owner = identity if identity is not None else ""
        old = self.leases.find(engine_id)
        if old is not None:
            self._check_lease_owner(old, identity)
            owner = old.identity if identity is None else owner
            if old.expired(now):
                self._end_lease(old, expired=True, now=now)  # a stalled incarnation may still write
            else:
                self._release_sessions(self.leases.end(old, expired=False), count=True)
        lease = self.leases.add(engine_id, ttl_seconds or self.config.lease_ttl_seconds, now, identity=owner,
                                held=held)
        return lease.info(now)

    def heartbeat(self, engine_id: str, *, identity: str | None = "") -> EngineInfo:
        now = self._clock()
        lease = self._live_lease(engine_id, now, identity)
        lease.renew(now)
        return lease.info(now)

    def unregister_engine(self, engine_id: str, *, identity: str | None = "") -> tuple[str, ...]:
        """End a lease cleanly: its sessions are closed (KV cached). Returns their ids."""
        now = self._clock()
        lease = self._live_lease(engine_id, now, identity)
        return self._end_lease(lease, expired=False, now=now)

    def end_held_lease(self, engine_id: str, serial: int) -> tuple[str, ...]:
        """The stream holding lease `serial` of `engine_id` ended (its engine went away): release everything
        at once, and remember the id so a late call hears LEASE_EXPIRED. Nothing if that lease already ended
        (unregistered, or registered again since). Returns the sessions closed."""
        lease = self.leases.find(engine_id)
        if lease is None or lease.serial != serial:
            return ()
        closed = self.leases.end(lease, expired=True)
        self._release_sessions(closed, count=True)
        return closed

    def held_lease(self, engine_id: str, serial: int) -> EngineInfo | None:
        """The lease `serial` of `engine_id` if it is still the live one, else None."""
        lease = self.leases.find(engine_id)
        if lease is None or lease.serial != serial:
            return None
        return lease.info(self._clock())

    def list_engines(self) -> list[EngineInfo]:
        now = self._clock()
        return [lease.info(now) for lease in self.leases.leases()]

    # ================================================================== pool

    def evict(self, num_pages: int) -> int:
        """Free up to `num_pages` unpinned radix pages (policy order). Returns how many were freed."""
        check_count(num_pages, "num_pages")
        return self.radix.evict(num_pages)

    def stats(self) -> Stats:
        return self.accounting.stats()

    def check_invariants(self) -> Stats:
        """Recount everything from scratch; raises InvariantError naming the first broken invariant."""
        return self.accounting.check_invariants()

    # ================================================================== internals

    def _session(self, session_id: str, epoch: int, engine_id: str, identity: str | None, now: float) -> Session:
        """The session a mutating call names. A session whose owner's lease is overdue is released first
        (the caller gets LEASE_EXPIRED if it is that owner, else SESSION_NOT_FOUND). A caller naming an
        engine whose lease has expired hears LEASE_EXPIRED for a session it no longer finds: that is why."""
        try:
            s = self.sessions.get(session_id, epoch)
        except KVCacheError:
            if engine_id and self.leases.has_expired(engine_id):
                raise lease_expired(engine_id) from None
            raise
        if s.owner:
            lease = self.leases.owner_of(s.owner)
            if lease.expired(now):
                self._end_lease(lease, expired=True, now=now)
                if engine_id == s.owner:
                    raise lease_expired(engine_id)
                raise KVCacheError(
                    Reason.SESSION_NOT_FOUND, f"session {session_id!r} not found (its owner's lease expired)",
                    session_id=session_id,
                )
        self.sessions.check_owner(s, engine_id, identity)
        return s

    def _live_lease(self, engine_id: str, now: float, identity: str | None) -> Lease:
        lease = self.leases.get(engine_id)
        self._check_lease_owner(lease, identity)
        if lease.expired(now):
            self._end_lease(lease, expired=True, now=now)
            raise lease_expired(engine_id)
        return lease

    @staticmethod
    def _check_lease_owner(lease: Lease, identity: str | None) -> None:
        if identity is not None and identity != lease.identity:
            raise KVCacheError(Reason.NOT_OWNER, f"engine {lease.engine_id!r} belongs to another identity",
                               engine_id=lease.engine_id)

    def _end_lease(self, lease: Lease, *, expired: bool, now: float) -> tuple[str, ...]:
        """End `lease` and close its sessions (their committed KV cached). Returns their ids.

        An expired lease's engine may be stalled rather than gone, and still write its pages: what its
        sessions release is quarantined for --quarantine-seconds instead of going straight to the free list.
        """
        closed = self.leases.end(lease, expired=expired)
        if expired and self.config.quarantine_seconds:
            with self.pages.quarantining(now + self.config.quarantine_seconds):
                self._release_sessions(closed, count=True)
        else:
            self._release_sessions(closed, count=expired)
        if expired:
            self.counters.expired_leases += 1
        return closed

    def _release_quarantine(self, now: float) -> None:
        due = self.pages.next_release()
        if due is not None and due <= now:
            self.pages.release_due(now)

    def _release_sessions(self, session_ids: tuple[str, ...], *, count: bool) -> None:
        for sid in session_ids:
            self._reap_session(self.sessions.get(sid), count=count)

    def _check_turn(self, s: Session, turn: int) -> None:
        if not s.in_turn:
            raise KVCacheError(
                Reason.NO_TURN_IN_FLIGHT, f"session {s.id!r} has no turn in flight", session_id=s.id
            )
        if turn and turn != s.turns + 1:
            raise KVCacheError(
                Reason.NO_TURN_IN_FLIGHT,
                f"turn {turn} of session {s.id!r} is not in flight (turn {s.turns + 1} is)", session_id=s.id,
            )

    def _kv_after_commit(self, s: Session, generated: TokenArray, kv_tokens: int | None) -> int:
        """Validate a commit against the token cap and return the session's KV token count after it."""
        new_total = s.turn_context_tokens + generated.size
        cap = self.config.max_session_tokens
        if cap and new_total > cap:
            raise KVCacheError(
                Reason.SESSION_TOKEN_LIMIT,
                f"committing {generated.size} tokens would bring session {s.id!r} to {new_total} tokens, "
                f"above the per-session cap of {cap}",
                session_id=s.id, limit=cap, requested=new_total,
            )
        capacity = len(s.pages) * self.page_size
        if kv_tokens is None:
            return min(s.turn_context_tokens + max(generated.size - 1, 0), capacity)
        hi = min(new_total, capacity)
        if not s.turn_cached_tokens <= kv_tokens <= hi:
            raise invalid_argument(
                "kv_tokens", f"{kv_tokens} is outside [{s.turn_cached_tokens}, {hi}] "
                "(the turn's cached tokens .. context with its reserved capacity)",
            )
        return kv_tokens

    def _finish_close(self, s: Session, cache: bool) -> int:
        """Release the session's KV and forget it. Returns the context tokens now cached (cache=True)."""
        self.turns.drop_kv(s, cache=cache)
        cached = self.turns.cached_tokens(s) if cache else 0
        self.counters.session_tokens -= s.committed_tokens
        self.sessions.remove(s)
        if self.events.recording:
            self.events.session("closed", s)
        if s.owner:
            lease = self.leases.find(s.owner)
            if lease is not None:
                lease.sessions.discard(s.id)
        return cached

    def _reap_session(self, s: Session, *, count: bool = True) -> None:
        """Close `s` now, aborting its turn if one is in flight; its committed KV goes to the radix
        (unless a deferred close asked otherwise)."""
        cache = s.close_cache if s.close_pending else True
        if s.in_turn:
            self.turns.abort(s)
        self._finish_close(s, cache)
        self.counters.reaped_sessions += count
