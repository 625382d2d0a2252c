"""`KVCacheCore`: the facade the rpc layer calls. It builds the core and delegates:

    ledger.py      pages by state, the one source of the page counters; pages.py the allocator (free stack, quarantine)
    radix.py       the radix prefix cache (radix_node.py its nodes, radix_classes.py and eviction.py eviction order)
    slot.py        session slots and their states; turns.py their page tables (each changed nowhere else)
    sessions.py    the session table: lookup, least-recently-active order, the info view
    capacity.py    the token cap and the relief plan (evict, demote) computed before anything changes
    tiering.py     a tier beyond the pool: loads, offloads, and (tier_pages.py) page keys and stored marks
    window.py      a window group's rows kept apart from the full rows (docs/design.md §13)
    leases.py      engine leases; lifecycle.py how sessions and leases end (closes, reaper, parking)
    ops.py         each session call's checks, lookups and lease expiry, handing the work to the owners above
    accounting.py  stats() and check_invariants(), read off the ledger; validate.py input checks
    events.py      change records and page hashing; recorder.py the queue they wait in (`take_events` drains it)

Identities: every session and lease belongs to the identity (an opaque name) that created it. Calls pass
the caller's `identity`; another identity's session or engine is NOT_OWNER. `identity=None` is an
operator's call, checked against nobody. Without tenants everyone is the identity "".
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

import numpy as np
import numpy.typing as npt

from cache_service.core.accounting import Accounting
from cache_service.core.config import CoreConfig
from cache_service.core.events import Record, Removed, Stored, TierEntry, TierJournalSink
from cache_service.core.leases import LeaseTable
from cache_service.core.ledger import Counters, PageLedger
from cache_service.core.lifecycle import Lifecycle
from cache_service.core.ops import Ops
from cache_service.core.pages import PageAllocator
from cache_service.core.radix import RadixTree
from cache_service.core.recorder import Recorder
from cache_service.core.sessions import SessionTable, session_filter
from cache_service.core.slot import Slots
from cache_service.core.tier_keys import Namespace
from cache_service.core.tiering import TierIndex
from cache_service.core.turns import Turns
from cache_service.core.types import (
    EMPTY_PAGES,
    AppendResult,
    CloseMode,
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
from cache_service.core.validate import check_count, token_bytes
from cache_service.core.window import attach_window_rows, window_page_ids

Clock = Callable[[], float]


def _pages(ids: bytes) -> npt.NDArray[np.int32]:
    return np.frombuffer(ids, dtype=np.int32)


class KVCacheCore:
    """The cache core. Single-threaded: one caller at a time, no awaits inside a call."""

    def __init__(self, config: CoreConfig, clock: Clock = time.monotonic, *, tier: Namespace | None = None) -> None:
        """`tier`: the namespace of a tier beyond the pool (tiering.py); None without one."""
        self.config = config
        self.page_size = config.page_size
        self._clock = clock
        self.ledger = PageLedger(config.usable_pages)
        self.counters = Counters()
        self.pages = PageAllocator(config.num_pages, self.ledger)
        self.tier = TierIndex(config, tier, self.ledger, self.pages, self.counters, clock) if tier else None
        self.radix = RadixTree(config.page_size, self.ledger, self.tier.free_evicted if self.tier else self.pages.give,
                               config.eviction_policy)
        if self.tier is not None:
            self.tier.radix = self.radix
            self.radix.evict_hook = self.tier.evicting
        self.window = attach_window_rows(config, self.radix, self.pages, tier=self.tier)
        """The window group's rows kept apart (window.py); None unless `config.window_pages`."""
        self.slots = Slots(config.page_size, self.radix, self.counters)
        self.sessions = SessionTable(self.slots)
        self.turns = Turns(config, self.pages, self.radix, self.ledger, self.counters, self.slots,
                           victims=self.sessions.demotable)
        self.leases = LeaseTable(config.expired_lease_memory)
        self.recorder = Recorder(config, self.radix, self.slots, self.window)
        self.lifecycle = Lifecycle(config, clock, self.sessions, self.leases, self.slots, self.turns, self.radix,
                                   self.pages, self.counters)
        self.ops = Ops(config, clock, self.pages, self.radix, self.slots, self.turns, self.sessions, self.leases,
                       self.lifecycle)
        self.accounting = Accounting(config, self.ledger, self.pages, self.radix, self.slots, self.sessions,
                                     self.leases, self.counters, self.tier, self.ops.reuse, self.window)

    # ================================================================== probes

    def match_prefix(self, token_ids: npt.ArrayLike, cache_salt: str = "") -> MatchResult:
        """Read-only: how many leading tokens (whole pages) are cached under `cache_salt`, their pages and, with a
        window pool, their window pages as they are now (nothing is pinned). No LRU touch."""
        cached, pages = self.ops.match(token_bytes(token_ids), cache_salt)
        return MatchResult(cached, _pages(pages), window_page_ids(self.window, pages))

    # ================================================================== sessions

    def open_session(self, session_id: str = "", *, streaming: bool = False, timeout_seconds: float | None = None,
                     cache_salt: str = "", engine_id: str = "", identity: str = "", quota: int = 0,
                     parent_session_id: str = "") -> OpenResult:
        """Open a session for `identity`. An empty id gets a generated one; `timeout_seconds` None means the
        default, 0 means never. `engine_id` (optional) must hold a live lease of the same identity and
        becomes the owner. SESSION_LIMIT when --max-sessions or the identity's `quota` (0: none) is full.
        `parent_session_id` (optional) names the open session of the same identity and salt it works for
        (docs/design.md §15)."""
        return OpenResult(*self.ops.open(session_id, streaming, timeout_seconds, cache_salt, engine_id, identity,
                                         quota, parent_session_id))

    def append(self, session_id: str, token_ids: npt.ArrayLike, reserve_tokens: int = 0, *, epoch: int = 0,
               engine_id: str = "", identity: str | None = "") -> AppendResult:
        """Start a turn: append `token_ids` to the context and reserve `reserve_tokens` slots after it.

        Fails SESSION_BUSY while a turn is in flight, SESSION_CLOSING after a deferred close, and
        RESOURCE_EXHAUSTED (SESSION_TOKEN_LIMIT, SESSION_BUDGET, POOL_EXHAUSTED) without allocating.
        """
        s, (cached, context, capacity, offset, pages, num_pages, hit) = self.ops.append(
            session_id, token_bytes(token_ids), reserve_tokens, epoch, engine_id, identity)
        return AppendResult(s.id, s.epoch, s.turns + 1, cached, context, capacity, offset, _pages(pages), num_pages,
                            hit, window_page_ids(self.window, pages))

    def extend(self, session_id: str, reserve_tokens: int, *, epoch: int = 0, engine_id: str = "",
               identity: str | None = "") -> ExtendResult:
        """Grow the turn in flight by `reserve_tokens` slots (decode that outgrew its reservation): the
        capacity becomes at least the old capacity + `reserve_tokens`, in whole pages. Same capacity rules
        as an append (SESSION_TOKEN_LIMIT against the capacity asked, relief, never a partial allocation);
        NO_TURN_IN_FLIGHT without a turn. A turn whose close is deferred may still grow."""
        s, (capacity, offset, pages, num_pages) = self.ops.extend(session_id, reserve_tokens, epoch, engine_id,
                                                                  identity)
        return ExtendResult(s.id, s.epoch, s.turns + 1, capacity, offset, _pages(pages), num_pages,
                            window_page_ids(self.window, pages))

    def commit(self, session_id: str, token_ids: npt.ArrayLike = EMPTY_PAGES, *, kv_tokens: int | None = None,
               abort: bool = False, turn: int = 0, epoch: int = 0, engine_id: str = "",
               identity: str | None = "", reuse: tuple[int, int, int] | None = None) -> CommitResult:
        """End the turn in flight.

        Commit records the generated `token_ids`; KV is taken as written for every context token and
        every generated token but the last, capped at the reservation, unless `kv_tokens` says how many
        leading tokens have KV. The unused reservation is freed. `abort=True` rolls back to the last
        committed state (earlier KV kept). `turn`, when nonzero, must name the turn in flight. A deferred
        close completes here. `reuse`: the engine's (engine_cached, loaded, computed) tokens of the turn's
        context (reuse.py; they must sum to it), added to its reuse figures.
        """
        return CommitResult(*self.ops.commit(session_id, token_bytes(token_ids), kv_tokens, abort, turn, epoch,
                                             engine_id, identity, reuse))

    def close(self, session_id: str, *, cache: bool = False, mode: CloseMode | None = None, epoch: int = 0,
              engine_id: str = "", identity: str | None = "") -> CloseResult:
        """Close a session. During a turn the close is deferred to the turn's end (SESSION_CLOSING for
        new appends meanwhile). `mode` says what stays (docs/design.md §15); without it `cache=True` inserts
        the committed context's full pages into the radix, and cache=False frees the private KV (keep-prefix
        for a top-level session, drop for a child)."""
        return CloseResult(*self.ops.close(session_id, cache, epoch, engine_id, identity, int(mode or 0)))

    def get_session(self, session_id: str, *, epoch: int = 0) -> SessionInfo:
        return self.sessions.info(self.sessions.get(session_id, epoch), self._clock())

    def session_tokens(self, session_id: str, *, epoch: int = 0) -> TokenArray:
        """A copy of the session's context tokens (committed, plus the in-flight turn's input)."""
        return np.frombuffer(bytes(self.sessions.get(session_id, epoch).tokens), dtype="<i4").astype(np.int32)

    def list_sessions(self, engine_id: str = "", identity: str | None = None, *, former_engine_id: str = "",
                      state: SessionState | None = None) -> list[SessionInfo]:
        """Sessions, least recently active first; only those of owner `engine_id`, `identity`, former owner
        `former_engine_id` and `state` (as `SessionInfo.state` shows it: PARKED for a parked one) when given."""
        return self.list_sessions_lru(len(self.sessions), engine_id=engine_id, identity=identity,
                                      former_engine_id=former_engine_id, state=state)[0]

    def list_sessions_lru(self, limit: int, *, engine_id: str = "", identity: str | None = None,
                          former_engine_id: str = "", state: SessionState | None = None
                          ) -> tuple[list[SessionInfo], int]:
        """The `limit` least recently active sessions (filtered as in `list_sessions`), and how many match."""
        now = self._clock()
        shown, total = self.sessions.lru(limit, session_filter(engine_id, identity, former_engine_id, state))
        return [self.sessions.info(s, now) for s in shown], total

    def list_sessions_page(self, *, after_epoch: int = 0, size: int, engine_id: str = "",
                           identity: str | None = None, former_engine_id: str = "",
                           state: SessionState | None = None) -> tuple[list[SessionInfo], int, int]:
        """A page of sessions in the order they were opened, after the one of epoch `after_epoch`: up to
        `size` infos, how many match in all, and the epoch to continue after (0 when this is the last page)."""
        now = self._clock()
        page, total, more = self.sessions.page(after_epoch, size,
                                               session_filter(engine_id, identity, former_engine_id, state))
        return [self.sessions.info(s, now) for s in page], total, page[-1].epoch if more and page else 0

    def reap(self) -> ReapResult:
        """Expire due leases (their sessions parked) and close timed-out sessions, parked ones past their parked
        timeout included (their committed KV goes to the radix).

        An in-flight turn is never reaped while its owner's lease lives; an ownerless session is reaped
        on timeout even mid-turn (the turn is aborted, and what it released is quarantined like an expired
        lease's pages). Quarantined pages whose time has come are freed first.
        """
        return ReapResult(*self.lifecycle.reap())

    # ================================================================== leases

    def register_engine(self, engine_id: str = "", ttl_seconds: float = 0.0, *, identity: str | None = "",
                        held: bool = False) -> EngineInfo:
        """Start a lease for `identity` (TTL default from config, at most --max-lease-ttl). Re-registering a
        live id of the same identity ends the previous incarnation's lease first (its sessions parked, for the
        new one to adopt): the usual cause is an engine restarted under the same name; another identity's live
        id is NOT_OWNER. A `held` lease lasts until `end_held_lease`, never expiring by TTL (HoldLease)."""
        return self.lifecycle.register(engine_id, ttl_seconds, identity, held)

    def heartbeat(self, engine_id: str, *, identity: str | None = "") -> EngineInfo:
        now = self._clock()
        lease = self.lifecycle.live_lease(engine_id, now, identity)
        lease.renew(now)
        return lease.info(now)

    def unregister_engine(self, engine_id: str, *, identity: str | None = "") -> tuple[str, ...]:
        """End a lease cleanly: its sessions are parked (another engine may continue them). Returns their ids."""
        now = self._clock()
        return self.lifecycle.end_lease(self.lifecycle.live_lease(engine_id, now, identity), expired=False, now=now)

    def end_held_lease(self, engine_id: str, serial: int) -> tuple[str, ...]:
        """The stream holding lease `serial` of `engine_id` ended (its engine went away, so nothing is
        quarantined): abort its turns in flight and park its sessions at once, and remember the id so a late
        call hears LEASE_EXPIRED. Nothing if that lease already ended (unregistered, or registered again
        since). Returns the sessions parked."""
        lease = self.leases.find(engine_id)
        if lease is None or lease.serial != serial:
            return ()
        return self.lifecycle.park_sessions(self.leases.end(lease, expired=True), self._clock(), fence=False)

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

    # ================================================================== change events (recorder.py)

    @property
    def recording(self) -> bool:
        return self.recorder.recording

    def start_events(self) -> None:
        """Record changes from now on, hashing what the tree holds already (idempotent)."""
        self.recorder.start()

    def pending_events(self) -> bool:
        """Changes are waiting for `take_events`."""
        return self.recorder.pending()

    def take_events(self) -> list[Record]:
        """The change records since the last take, oldest first (nothing until `start_events`)."""
        return self.recorder.take()

    def set_tier_journal(self, journal: TierJournalSink | None) -> None:
        """Tell `journal` of every page announced as held by the tier and of every such page removed."""
        self.recorder.hashes.journal = journal

    def announce_tier(self, entries: Sequence[TierEntry]) -> int:
        """Announce pages a tier held before this instance started (parents first; recording must be on),
        after every change recorded so far. Returns the pages announced."""
        return self.recorder.announce_tier(entries)

    def record_cleared(self) -> None:
        """Announce that everything announced before is gone (a new instance starts empty)."""
        self.recorder.cleared()

    def event_snapshot(self) -> list[Stored | Removed]:
        """The whole tree as Stored records, parents before children (recording must be on); on a window pool a
        run's pages without window rows follow it as a window-only Removed."""
        return self.recorder.snapshot()
