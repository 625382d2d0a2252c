"""`KVCacheCore`: the facade over the page allocator, the radix tree, sessions and leases.

Every page is in exactly one state, and the counts always satisfy
`free + evictable + radix_locked + session_held + in_flight == num_pages - 1`:

- free: on the allocator's stack;
- evictable / radix_locked: owned by the radix tree, unpinned / pinned;
- session_held: committed KV a session owns privately (outside the radix);
- in_flight: pages handed out for a turn that has not committed yet.

A session turn is `append` (new tokens, reserve capacity) ... engine writes KV ... `commit` (generated
tokens; the reservation is trimmed) or `commit(abort=True)` (back to the last committed state). A
"radix turn" (every turn of a regular session, and a streaming session's first turn or first turn after
demotion) matches the radix and pins the match; other streaming turns touch no radix at all, so they
cost O(new tokens).

Failed calls change no client-visible state. The one exception is pressure relief: an append that needs
pages may evict radix entries and demote idle sessions before it finds the pool still too small.
"""

from __future__ import annotations

import math
import time
import uuid
from collections import Counter, OrderedDict
from collections.abc import Callable

import numpy as np
import numpy.typing as npt

from cache_service.core.allocator import PageAllocator
from cache_service.core.config import CoreConfig
from cache_service.core.errors import InvariantError, KVCacheError, Reason, invalid_argument
from cache_service.core.leases import Lease, LeaseTable
from cache_service.core.radix import RadixNode, RadixTree, token_key
from cache_service.core.sessions import Session
from cache_service.core.types import (
    EMPTY_PAGES,
    AppendResult,
    CloseResult,
    CommitResult,
    EngineInfo,
    MatchResult,
    OpenResult,
    PageArray,
    ReapResult,
    SessionInfo,
    SessionState,
    Stats,
    TokenArray,
)

Clock = Callable[[], float]

MAX_ID_CHARS = 128
MAX_SALT_CHARS = 256
_INT32_MAX = np.iinfo(np.int32).max


def _check_id(value: str, field: str) -> None:
    if len(value) > MAX_ID_CHARS:
        raise invalid_argument(field, f"longer than {MAX_ID_CHARS} characters")
    if not value.isprintable() or any(c.isspace() for c in value):
        raise invalid_argument(field, "must be printable with no whitespace")


def as_tokens(values: npt.ArrayLike, field: str = "token_ids") -> TokenArray:
    """Validate token ids and return them as a 1-D int32 array (no copy when already int32)."""
    arr = np.asarray(values)
    if arr.ndim != 1:
        raise KVCacheError(Reason.INVALID_TOKENS, f"{field} must be a flat list of token ids", field=field)
    if arr.size == 0:
        return arr.astype(np.int32, copy=False)
    if arr.dtype.kind not in "iu":
        raise KVCacheError(Reason.INVALID_TOKENS, f"{field} must hold integers", field=field)
    lo = int(arr.min())
    if lo < 0:
        index = int(np.flatnonzero(arr < 0)[0])
        raise KVCacheError(
            Reason.INVALID_TOKENS, f"{field}[{index}] = {lo} is negative", field=field, index=index
        )
    if arr.dtype != np.int32:
        hi = int(arr.max())
        if hi > _INT32_MAX:
            raise KVCacheError(Reason.INVALID_TOKENS, f"{field} holds {hi}, above int32", field=field)
        arr = arr.astype(np.int32)
    return arr


class KVCacheCore:
    """The cache core. Single-threaded: one caller at a time, no awaits inside a call."""

    def __init__(self, config: CoreConfig, clock: Clock = time.monotonic) -> None:
        self.config = config
        self.page_size = config.page_size
        self._clock = clock
        self.allocator = PageAllocator(config.num_pages)
        self.radix = RadixTree(config.page_size, self.allocator.free, config.eviction_policy)
        self._sessions: OrderedDict[str, Session] = OrderedDict()  # least recently active first
        self._leases = LeaseTable(config.expired_lease_memory)
        self._next_epoch = 1
        self._session_held = 0
        self._in_flight = 0
        self._session_tokens = 0
        self._session_kv_tokens = 0
        self._prefix_hit_tokens = 0
        self._session_hit_tokens = 0
        self._miss_tokens = 0
        self._demoted_total = 0
        self._duplicate_total = 0
        self._reaped_total = 0
        self._expired_total = 0
        self._num_in_turn = 0
        self._num_closing = 0
        self._num_demoted = 0

    # ================================================================== probes

    def match_prefix(self, token_ids: npt.ArrayLike, cache_salt: str = "") -> MatchResult:
        """Read-only: how many leading tokens (whole pages) are cached under `cache_salt`. No LRU touch."""
        tokens = as_tokens(token_ids)
        self._check_salt(cache_salt)
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
    ) -> OpenResult:
        """Open a session. An empty id gets a generated one; `timeout_seconds` None means the default,
        0 means never. `engine_id` (optional) must hold a live lease and becomes the owner."""
        now = self._clock()
        if session_id:
            _check_id(session_id, "session_id")
        self._check_salt(cache_salt)
        if timeout_seconds is None:
            timeout_seconds = self.config.session_timeout_seconds
        elif not (math.isfinite(timeout_seconds) and timeout_seconds >= 0):
            raise invalid_argument("timeout_seconds", f"must be finite and >= 0, got {timeout_seconds}")
        lease = self._live_lease(engine_id, now) if engine_id else None
        if not session_id:
            session_id = uuid.uuid4().hex
        if session_id in self._sessions:
            raise KVCacheError(
                Reason.SESSION_EXISTS, f"session {session_id!r} is already open", session_id=session_id
            )
        session = Session(
            session_id,
            self._next_epoch,
            streaming=streaming,
            cache_salt=cache_salt,
            owner=engine_id,
            timeout_seconds=timeout_seconds,
            now=now,
        )
        self._next_epoch += 1
        self._sessions[session_id] = session
        if lease is not None:
            lease.sessions.add(session_id)
        return OpenResult(session_id, session.epoch, timeout_seconds)

    def append(
        self,
        session_id: str,
        token_ids: npt.ArrayLike,
        reserve_tokens: int = 0,
        *,
        epoch: int = 0,
        engine_id: str = "",
    ) -> AppendResult:
        """Start a turn: append `token_ids` to the context and reserve `reserve_tokens` slots after it.

        New tokens first fill the free slots of the context's last page. Fails SESSION_BUSY while a turn
        is in flight, SESSION_CLOSING after a deferred close, and RESOURCE_EXHAUSTED (SESSION_TOKEN_LIMIT,
        SESSION_BUDGET, POOL_EXHAUSTED) without allocating anything.
        """
        now = self._clock()
        tokens = as_tokens(token_ids)
        if reserve_tokens < 0:
            raise invalid_argument("reserve_tokens", f"must be >= 0, got {reserve_tokens}")
        s = self._lookup(session_id, epoch, engine_id, now)
        if s.state is SessionState.CLOSING:
            raise KVCacheError(
                Reason.SESSION_CLOSING, f"session {session_id!r} is closing", session_id=session_id
            )
        if s.state is SessionState.IN_TURN:
            raise KVCacheError(
                Reason.SESSION_BUSY,
                f"session {session_id!r} already has turn {s.turns + 1} in flight",
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
        ps = self.page_size
        pages_total = -(-total // ps)
        radix_turn = not s.streaming or s.held_pages == 0
        s.tokens.extend(tokens)
        lock_node: RadixNode | None = None
        if radix_turn:
            assert s.lock_node is None and len(s.pages) == 0, "a radix turn starts with no pages"
            key = token_key(s.tokens.view(), ps, context - 1)
            match = self.radix.match(s.cache_salt, key, lock=True)
            lock_node = match.node
            matched_pages = match.num_pages
            cached = matched_pages * ps
            radix_hit = cached
            base_pages = matched_pages
        else:
            cached = min(s.kv_tokens, context - 1)
            radix_hit = 0
            base_pages = s.held_pages
        try:
            new_pages = self._allocate(max(0, pages_total - base_pages), s)
        except KVCacheError:
            s.tokens.truncate(s.committed_tokens)
            if lock_node is not None:
                self.radix.unlock(lock_node)
            raise
        before = self._footprint(s)
        if radix_turn:
            s.pages.extend(match.pages)
            s.radix_pages = s.held_pages = matched_pages
            s.lock_node = lock_node
            s.synced_pages = 0
        s.pages.extend(new_pages)
        self._settle(s, before)
        self._set_state(s, SessionState.IN_TURN)
        if s.demoted:
            s.demoted = False
            self._num_demoted -= 1
        s.radix_turn = radix_turn
        s.turn_cached_tokens = cached
        s.turn_context_tokens = context
        self._touch(s, now)
        self._prefix_hit_tokens += radix_hit
        self._session_hit_tokens += cached - radix_hit
        self._miss_tokens += context - cached
        offset = s.synced_pages
        delta = s.pages.view()[offset:].copy()
        s.synced_pages = len(s.pages)
        return AppendResult(
            session_id=s.id,
            epoch=s.epoch,
            turn=s.turns + 1,
            cached_tokens=cached,
            context_tokens=context,
            capacity_tokens=len(s.pages) * ps,
            page_offset=offset,
            page_ids=delta,
            num_pages=len(s.pages),
            prefix_hit_tokens=radix_hit,
        )

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
        s = self._lookup(session_id, epoch, engine_id, now)
        if not s.in_turn:
            raise KVCacheError(
                Reason.NO_TURN_IN_FLIGHT, f"session {session_id!r} has no turn in flight",
                session_id=session_id,
            )
        if turn and turn != s.turns + 1:
            raise KVCacheError(
                Reason.NO_TURN_IN_FLIGHT,
                f"turn {turn} of session {session_id!r} is not in flight (turn {s.turns + 1} is)",
                session_id=session_id,
            )
        if abort:
            if generated.size:
                raise invalid_argument("token_ids", "must be empty when abort is set")
            if kv_tokens is not None:
                raise invalid_argument("kv_tokens", "must be unset when abort is set")
            self._abort_turn(s)
        else:
            new_total = s.turn_context_tokens + generated.size
            cap = self.config.max_session_tokens
            if cap and new_total > cap:
                raise KVCacheError(
                    Reason.SESSION_TOKEN_LIMIT,
                    f"committing {generated.size} tokens would bring session {session_id!r} to "
                    f"{new_total} tokens, above the per-session cap of {cap}",
                    session_id=session_id, limit=cap, requested=new_total,
                )
            capacity = len(s.pages) * self.page_size
            if kv_tokens is None:
                kv = min(s.turn_context_tokens + max(generated.size - 1, 0), capacity)
            else:
                hi = min(new_total, capacity)
                if not s.turn_cached_tokens <= kv_tokens <= hi:
                    raise invalid_argument(
                        "kv_tokens", f"{kv_tokens} is outside [{s.turn_cached_tokens}, {hi}] "
                        "(the turn's cached tokens .. context with its reserved capacity)",
                    )
                kv = kv_tokens
            self._commit_turn(s, generated, kv)
        self._touch(s, now)
        closed = False
        if s.close_pending:
            self._finish_close(s, s.close_cache)
            closed = True
        else:
            self._set_state(s, SessionState.IDLE)
        return CommitResult(s.id, s.committed_tokens, s.kv_tokens, s.held_pages, closed)

    def close(
        self, session_id: str, *, cache: bool = False, epoch: int = 0, engine_id: str = ""
    ) -> CloseResult:
        """Close a session. During a turn the close is deferred to the turn's end (SESSION_CLOSING for
        new appends meanwhile). `cache=True` inserts the committed context's full pages into the radix."""
        now = self._clock()
        s = self._lookup(session_id, epoch, engine_id, now)
        if s.in_turn:
            s.close_pending = True
            s.close_cache = cache
            self._set_state(s, SessionState.CLOSING)
            return CloseResult(s.id, closed=False, cached_tokens=0)
        return CloseResult(s.id, closed=True, cached_tokens=self._finish_close(s, cache))

    def get_session(self, session_id: str, *, epoch: int = 0) -> SessionInfo:
        s = self._sessions.get(session_id)
        if s is None or (epoch and epoch != s.epoch):
            raise KVCacheError(
                Reason.SESSION_NOT_FOUND, f"session {session_id!r} not found", session_id=session_id
            )
        return self._info(s, self._clock())

    def session_tokens(self, session_id: str, *, epoch: int = 0) -> TokenArray:
        """A copy of the session's context tokens (committed, plus the in-flight turn's input)."""
        s = self._sessions.get(session_id)
        if s is None or (epoch and epoch != s.epoch):
            raise KVCacheError(
                Reason.SESSION_NOT_FOUND, f"session {session_id!r} not found", session_id=session_id
            )
        tokens: TokenArray = s.tokens.view().copy()
        return tokens

    def list_sessions(self, engine_id: str = "") -> list[SessionInfo]:
        """Sessions, least recently active first; only `engine_id`'s when given."""
        now = self._clock()
        return [self._info(s, now) for s in self._sessions.values() if not engine_id or s.owner == engine_id]

    def reap(self) -> ReapResult:
        """Expire due leases and close timed-out sessions (their committed KV goes to the radix).

        An in-flight turn is never reaped while its owner's lease lives; an ownerless session is reaped
        on timeout even mid-turn (the turn is aborted).
        """
        now = self._clock()
        reaped: list[str] = []
        engines: list[str] = []
        for lease in self._leases.due(now):
            engines.append(lease.engine_id)
            reaped.extend(self._expire_lease(lease))
        for s in [s for s in self._sessions.values() if s.timed_out(now)]:
            if s.in_turn and s.owner:
                continue  # its owner's lease is live (expired ones were handled above)
            self._reap_session(s)
            reaped.append(s.id)
        return ReapResult(tuple(reaped), tuple(engines))

    # ================================================================== leases

    def register_engine(self, engine_id: str = "", ttl_seconds: float = 0.0) -> EngineInfo:
        """Start a lease (TTL default from config). Re-registering a live id releases what the previous
        incarnation held first: the usual cause is an engine restarted under the same name."""
        now = self._clock()
        if engine_id:
            _check_id(engine_id, "engine_id")
        if not (math.isfinite(ttl_seconds) and ttl_seconds >= 0):
            raise invalid_argument("ttl_seconds", f"must be finite and >= 0, got {ttl_seconds}")
        engine_id = engine_id or f"engine-{uuid.uuid4().hex[:12]}"
        old = self._leases.live.get(engine_id)
        if old is not None:
            self._release_lease(old, reaped=True)
        self._leases.forget_expired(engine_id)
        lease = Lease(engine_id, ttl_seconds or self.config.lease_ttl_seconds, now)
        self._leases.live[engine_id] = lease
        return self._engine_info(lease, now)

    def heartbeat(self, engine_id: str) -> EngineInfo:
        now = self._clock()
        lease = self._live_lease(engine_id, now)
        lease.renew(now)
        return self._engine_info(lease, now)

    def unregister_engine(self, engine_id: str) -> tuple[str, ...]:
        """End a lease cleanly: its sessions are closed (KV cached). Returns their ids."""
        now = self._clock()
        lease = self._live_lease(engine_id, now)
        return self._release_lease(lease, reaped=False)

    def list_engines(self) -> list[EngineInfo]:
        now = self._clock()
        return [self._engine_info(lease, now) for lease in self._leases.live.values()]

    # ================================================================== pool

    def evict(self, num_pages: int) -> int:
        """Free up to `num_pages` unpinned radix pages (policy order). Returns how many were freed."""
        if num_pages < 0:
            raise invalid_argument("num_pages", f"must be >= 0, got {num_pages}")
        return self.radix.evict(num_pages)

    def stats(self) -> Stats:
        idle = len(self._sessions) - self._num_in_turn - self._num_closing
        return Stats(
            num_pages=self.config.num_pages,
            page_size=self.page_size,
            free_pages=self.allocator.num_free,
            evictable_pages=self.radix.evictable_pages,
            radix_locked_pages=self.radix.locked_pages,
            session_held_pages=self._session_held,
            in_flight_pages=self._in_flight,
            session_budget_pages=self.config.budget_pages,
            radix_tokens=self.radix.cached_pages * self.page_size,
            session_tokens=self._session_tokens,
            session_kv_tokens=self._session_kv_tokens,
            prefix_hit_tokens=self._prefix_hit_tokens,
            session_hit_tokens=self._session_hit_tokens,
            miss_tokens=self._miss_tokens,
            evicted_pages=self.radix.evicted_pages_total,
            duplicate_pages=self._duplicate_total,
            demoted_sessions=self._demoted_total,
            reaped_sessions=self._reaped_total,
            expired_leases=self._expired_total,
            sessions_idle=idle,
            sessions_in_turn=self._num_in_turn,
            sessions_closing=self._num_closing,
            sessions_demoted=self._num_demoted,
            engines=len(self._leases.live),
        )

    # ================================================================== internals: turns

    def _allocate(self, n: int, s: Session) -> PageArray:
        """n fresh pages for session `s`'s turn. All or nothing.

        Relief happens only when it is known to suffice, so a hopeless request changes nothing. The pool
        is checked first (it is the absolute limit), then the session budget. Relief: the budget first
        (demote idle sessions LRU-first), then the pool (evict radix entries, then demote idle sessions
        and evict what they released).
        """
        if n == 0:
            return EMPTY_PAGES
        victims = self._demotable(s)
        short = n - self.allocator.num_free
        if short > 0 and short > self.radix.evictable_pages + self._reclaimable(victims):
            raise self._pool_exhausted(s, n)
        budget = self.config.session_budget_pages
        over = self._session_held + self._in_flight + n - budget if budget else 0
        if over > 0 and sum(v.private_pages for v in victims) < over:
            raise KVCacheError(
                Reason.SESSION_BUDGET,
                f"session {s.id!r} needs {n} pages; sessions hold {self._session_held + self._in_flight}"
                f" of a {budget}-page session budget and idle sessions cannot give {over}",
                session_id=s.id, requested_pages=n, budget_pages=budget,
            )
        for v in victims:
            if over <= 0:
                break
            over -= v.private_pages
            self._demote(v)
        short = n - self.allocator.num_free
        if short > 0:
            short -= self.radix.evict(short)
            for v in self._demotable(s):
                if short <= 0:
                    break
                self._demote(v)
                short -= self.radix.evict(short)
        pages = self.allocator.alloc(n)
        if pages is None:
            raise InvariantError(f"allocator refused {n} pages after relief that was computed to suffice")
        return pages

    def _reclaimable(self, victims: list[Session]) -> int:
        """Pages that demoting all `victims` would make free or evictable: their private pages, plus
        pinned radix pages that no one else pins."""
        pins: Counter[RadixNode] = Counter()
        total = 0
        for v in victims:
            total += v.private_pages
            n = v.lock_node
            while n is not None and n.parent is not None:
                pins[n] += 1
                n = n.parent
        return total + sum(node.num_pages for node, k in pins.items() if k == node.lock_ref)

    def _pool_exhausted(self, s: Session, n: int) -> KVCacheError:
        st = self.stats()
        return KVCacheError(
            Reason.POOL_EXHAUSTED,
            f"session {s.id!r} needs {n} pages; {st.free_pages} free, {st.evictable_pages} evictable, "
            f"{st.radix_locked_pages} pinned, {st.session_held_pages} held by sessions, "
            f"{st.in_flight_pages} in flight",
            session_id=s.id, requested_pages=n, free_pages=st.free_pages,
        )

    def _demotable(self, s: Session) -> list[Session]:
        """Idle streaming sessions holding KV, least recently active first (never `s` itself)."""
        if not self.config.demote_idle_sessions:
            return []
        return [
            v for v in self._sessions.values()
            if v is not s and v.state is SessionState.IDLE and v.held_pages > 0
        ]

    def _demote(self, s: Session) -> None:
        """Turn an idle session's KV into ordinary evictable radix entries; it keeps its tokens, and its
        next append re-matches the radix."""
        self._drop_kv(s, cache=True)
        s.demoted = True
        self._num_demoted += 1
        self._demoted_total += 1

    def _commit_turn(self, s: Session, generated: TokenArray, kv: int) -> None:
        ps = self.page_size
        before = self._footprint(s)
        s.tokens.extend(generated)
        self._session_tokens += len(s.tokens) - s.committed_tokens
        s.committed_tokens = len(s.tokens)
        self._session_kv_tokens += kv - s.kv_tokens
        s.kv_tokens = kv
        if s.radix_turn and not s.streaming:
            # Regular session: all full KV pages go to the radix; the session keeps only its tokens.
            self._settle(s, before)
            self._drop_kv(s, cache=True)
        else:
            if s.radix_turn:
                # Streaming first turn: the prompt's full pages join the radix and stay pinned.
                prompt_pages = min(s.turn_context_tokens, kv) // ps
                if prompt_pages > s.radix_pages:
                    self._cache_into_radix(s, prompt_pages, pin=True)
            keep = max(-(-kv // ps), s.held_pages)
            self.allocator.free(s.pages.view()[keep:].copy())
            s.pages.truncate(keep)
            s.held_pages = keep
            s.synced_pages = min(s.synced_pages, keep)
            self._settle(s, before)
        s.turns += 1

    def _abort_turn(self, s: Session) -> None:
        before = self._footprint(s)
        self.allocator.free(s.pages.view()[s.held_pages :].copy())
        s.pages.truncate(s.held_pages)
        if s.radix_turn:
            # The turn's radix match is released; the session is back to holding nothing.
            if s.lock_node is not None:
                self.radix.unlock(s.lock_node)
            s.lock_node = None
            s.pages.clear()
            s.held_pages = s.radix_pages = 0
        s.synced_pages = min(s.synced_pages, len(s.pages))
        s.tokens.truncate(s.committed_tokens)
        self._settle(s, before)

    def _cache_into_radix(self, s: Session, num_pages: int, *, pin: bool) -> None:
        """Insert the session's first `num_pages` pages (with their tokens) into the radix.

        Pages the tree already had are duplicates: ours are freed and the page table switches to the
        tree's copies (same tokens, same KV). With pin=True the session's pin moves to the new node; with
        pin=False the pin is dropped and pages [0, num_pages) are the tree's, no longer the session's.
        Accounting is settled by the caller.
        """
        ps = self.page_size
        pinned = s.radix_pages
        pages = s.pages.view()
        key = token_key(s.tokens.view(), ps, num_pages * ps)
        if len(key) != num_pages * ps * 4:
            raise InvariantError(f"session {s.id!r} has fewer than {num_pages} pages of tokens")
        ins = self.radix.insert(s.cache_salt, key, pages[:num_pages])
        existing = ins.num_existing_pages
        if existing < pinned or not np.array_equal(ins.pages[:pinned], pages[:pinned]):
            raise InvariantError(f"session {s.id!r}: its pinned radix prefix changed under the pin")
        if existing > pinned:
            duplicates = pages[pinned:existing].copy()
            pages[pinned:existing] = ins.pages[pinned:existing]
            self.allocator.free(duplicates)
            self._duplicate_total += duplicates.size
            s.synced_pages = min(s.synced_pages, pinned)
        old = s.lock_node
        if pin:
            assert ins.node is not None
            self.radix.lock(ins.node)
            s.lock_node = ins.node
            s.radix_pages = num_pages
            s.held_pages = max(s.held_pages, num_pages)
        else:
            s.lock_node = None
            s.radix_pages = 0
        if old is not None:
            self.radix.unlock(old)

    def _drop_kv(self, s: Session, *, cache: bool) -> None:
        """Release an idle session's KV: into the radix (cache=True, full pages) or back to the pool."""
        before = self._footprint(s)
        start = s.radix_pages
        full = max(s.kv_tokens // self.page_size, s.radix_pages)
        if cache and full > 0:
            self._cache_into_radix(s, full, pin=False)
            start = full
        elif s.lock_node is not None:
            self.radix.unlock(s.lock_node)
            s.lock_node = None
        self.allocator.free(s.pages.view()[start:].copy())
        s.pages.clear()
        s.held_pages = s.radix_pages = s.synced_pages = 0
        self._session_kv_tokens -= s.kv_tokens
        s.kv_tokens = 0
        self._settle(s, before)

    # ================================================================== internals: lifecycle

    def _finish_close(self, s: Session, cache: bool) -> int:
        """Release the session's KV and forget it. Returns the context tokens now cached (cache=True)."""
        self._drop_kv(s, cache=cache)
        cached = 0
        if cache:
            key = token_key(s.tokens.view(), self.page_size)
            cached = self.radix.match(s.cache_salt, key, touch=False).num_pages * self.page_size
        self._set_state(s, SessionState.IDLE)
        if s.demoted:
            self._num_demoted -= 1
        self._session_tokens -= s.committed_tokens
        del self._sessions[s.id]
        if s.owner:
            lease = self._leases.live.get(s.owner)
            if lease is not None:
                lease.sessions.discard(s.id)
        return cached

    def _reap_session(self, s: Session, *, count: bool = True) -> None:
        """Close `s` now, aborting its turn if one is in flight; its committed KV goes to the radix
        (unless a deferred close asked otherwise)."""
        cache = s.close_cache if s.close_pending else True
        if s.in_turn:
            self._abort_turn(s)
        self._finish_close(s, cache)
        self._reaped_total += count

    def _release_lease(self, lease: Lease, *, reaped: bool) -> tuple[str, ...]:
        closed = tuple(sorted(lease.sessions))
        for sid in closed:
            self._reap_session(self._sessions[sid], count=reaped)
        del self._leases.live[lease.engine_id]
        return closed

    def _expire_lease(self, lease: Lease) -> tuple[str, ...]:
        closed = self._release_lease(lease, reaped=True)
        self._leases.remember_expired(lease.engine_id)
        self._expired_total += 1
        return closed

    def _live_lease(self, engine_id: str, now: float) -> Lease:
        lease = self._leases.live.get(engine_id)
        if lease is None:
            if self._leases.was_expired(engine_id):
                raise KVCacheError(
                    Reason.LEASE_EXPIRED, f"the lease of engine {engine_id!r} has expired; register again",
                    engine_id=engine_id,
                )
            raise KVCacheError(
                Reason.ENGINE_NOT_FOUND, f"engine {engine_id!r} is not registered", engine_id=engine_id
            )
        if lease.expired(now):
            self._expire_lease(lease)
            raise KVCacheError(
                Reason.LEASE_EXPIRED, f"the lease of engine {engine_id!r} has expired; register again",
                engine_id=engine_id,
            )
        return lease

    def _lookup(self, session_id: str, epoch: int, engine_id: str, now: float) -> Session:
        s = self._sessions.get(session_id)
        if s is None or (epoch and epoch != s.epoch):
            raise KVCacheError(
                Reason.SESSION_NOT_FOUND, f"session {session_id!r} not found", session_id=session_id
            )
        if s.owner:
            lease = self._leases.live[s.owner]
            if lease.expired(now):
                self._expire_lease(lease)
                if engine_id == s.owner:
                    raise KVCacheError(
                        Reason.LEASE_EXPIRED, f"the lease of engine {engine_id!r} has expired",
                        engine_id=engine_id,
                    )
                raise KVCacheError(
                    Reason.SESSION_NOT_FOUND,
                    f"session {session_id!r} not found (its owner's lease expired)", session_id=session_id,
                )
            if engine_id and engine_id != s.owner:
                raise KVCacheError(
                    Reason.NOT_OWNER, f"session {session_id!r} belongs to another engine",
                    session_id=session_id, engine_id=engine_id,
                )
        return s

    def _check_salt(self, cache_salt: str) -> None:
        if len(cache_salt) > MAX_SALT_CHARS:
            raise invalid_argument("cache_salt", f"longer than {MAX_SALT_CHARS} characters")

    def _touch(self, s: Session, now: float) -> None:
        s.last_active = now
        self._sessions.move_to_end(s.id)

    def _set_state(self, s: Session, state: SessionState) -> None:
        for old_or_new, sign in ((s.state, -1), (state, 1)):
            if old_or_new is SessionState.IN_TURN:
                self._num_in_turn += sign
            elif old_or_new is SessionState.CLOSING:
                self._num_closing += sign
        s.state = state

    @staticmethod
    def _footprint(s: Session) -> tuple[int, int]:
        return s.private_pages, s.in_flight_pages

    def _settle(self, s: Session, before: tuple[int, int]) -> None:
        held, in_flight = self._footprint(s)
        self._session_held += held - before[0]
        self._in_flight += in_flight - before[1]

    def _info(self, s: Session, now: float) -> SessionInfo:
        return SessionInfo(
            session_id=s.id,
            epoch=s.epoch,
            state=s.state,
            streaming=s.streaming,
            cache_salt=s.cache_salt,
            engine_id=s.owner,
            context_tokens=len(s.tokens),
            kv_tokens=s.kv_tokens,
            turns=s.turns,
            num_pages=len(s.pages),
            radix_pages=s.radix_pages,
            held_pages=s.private_pages,
            in_flight_pages=s.in_flight_pages,
            idle_seconds=max(0.0, now - s.last_active),
            timeout_seconds=s.timeout_seconds,
            demoted=s.demoted,
            close_pending=s.close_pending,
        )

    def _engine_info(self, lease: Lease, now: float) -> EngineInfo:
        return EngineInfo(lease.engine_id, lease.ttl_seconds, lease.expires_at - now, len(lease.sessions))

    # ================================================================== verification

    def check_invariants(self) -> Stats:
        """Recount everything from scratch and compare with the running counters. O(pool + tree + sessions).

        Checks: allocator consistency; every allocated page has exactly one owner (the tree or one
        session) and every owned page is allocated; per-node lock counts equal the pins sessions hold;
        session counters; and `free + evictable + radix_locked + session_held + in_flight == num_pages-1`.
        """
        self.allocator.check()
        owned: list[PageArray] = [self.radix.check()]
        expected_locks: Counter[RadixNode] = Counter()
        held = in_flight = tokens = kv = in_turn = closing = demoted = 0
        for sid, s in self._sessions.items():
            if sid != s.id:
                raise InvariantError(f"session table key {sid!r} != session id {s.id!r}")
            pages = s.pages.view()
            if not 0 <= s.radix_pages <= s.held_pages <= len(pages):
                raise InvariantError(f"session {sid!r}: radix_pages <= held_pages <= len(pages) violated")
            if (s.lock_node is None) != (s.radix_pages == 0):
                raise InvariantError(f"session {sid!r}: pinned pages without a pin (or the reverse)")
            if s.lock_node is not None:
                path = self.radix._path_pages(s.lock_node, s.lock_node.num_pages, s.radix_pages)
                if not np.array_equal(path, pages[: s.radix_pages]):
                    raise InvariantError(f"session {sid!r}: pinned page table != its radix path")
                n: RadixNode | None = s.lock_node
                while n is not None and n.parent is not None:
                    expected_locks[n] += 1
                    n = n.parent
            if s.kv_tokens > s.held_pages * self.page_size:
                raise InvariantError(f"session {sid!r}: kv_tokens beyond its held pages")
            if s.committed_tokens > len(s.tokens) or (not s.in_turn and s.committed_tokens != len(s.tokens)):
                raise InvariantError(f"session {sid!r}: committed token count disagrees with its state")
            owned.append(pages[s.radix_pages :])
            held += s.private_pages
            in_flight += s.in_flight_pages
            tokens += s.committed_tokens
            kv += s.kv_tokens
            in_turn += s.state is SessionState.IN_TURN
            closing += s.state is SessionState.CLOSING
            demoted += s.demoted
            if s.owner and sid not in self._leases.live[s.owner].sessions:
                raise InvariantError(f"session {sid!r} is missing from its owner's lease")
        for n in self.radix.iter_nodes():
            if n.parent is not None and n.lock_ref != expected_locks.get(n, 0):
                raise InvariantError(
                    f"radix node {n.id}: lock_ref {n.lock_ref} != {expected_locks.get(n, 0)} session pins"
                )
        all_owned = np.concatenate(owned)
        counts = np.bincount(all_owned, minlength=self.config.num_pages)
        if counts[0]:
            raise InvariantError("the null page 0 is owned by someone")
        if (counts > 1).any():
            page = int(np.flatnonzero(counts > 1)[0])
            raise InvariantError(f"page {page} has {counts[page]} owners (no page may have two)")
        allocated = self.allocator.allocated_mask()
        if not np.array_equal(counts > 0, allocated):
            page = int(np.flatnonzero((counts > 0) != allocated)[0])
            raise InvariantError(f"page {page}: allocated and owned disagree (a leak or a stray free)")
        if (held, in_flight) != (self._session_held, self._in_flight):
            raise InvariantError(
                f"session page counters (held={self._session_held}, in_flight={self._in_flight}) "
                f"!= recount ({held}, {in_flight})"
            )
        if (tokens, kv) != (self._session_tokens, self._session_kv_tokens):
            raise InvariantError("session token counters != recount")
        if (in_turn, closing, demoted) != (self._num_in_turn, self._num_closing, self._num_demoted):
            raise InvariantError("session state counters != recount")
        for lease in self._leases.live.values():
            for sid in lease.sessions:
                if sid not in self._sessions or self._sessions[sid].owner != lease.engine_id:
                    raise InvariantError(f"lease {lease.engine_id!r} lists session {sid!r} it does not own")
        st = self.stats()
        total = (
            st.free_pages + st.evictable_pages + st.radix_locked_pages + st.session_held_pages
            + st.in_flight_pages
        )
        if total != st.usable_pages:
            raise InvariantError(
                f"accounting: free + evictable + radix_locked + session_held + in_flight = {total} "
                f"!= num_pages - 1 = {st.usable_pages}"
            )
        return st
