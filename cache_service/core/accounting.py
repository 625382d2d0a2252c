"""Accounting: the `Stats` snapshot and the from-scratch invariant check, read off the page ledger.

Every page is in exactly one ledger state (ledger.py), and the counts always satisfy
`free + evictable + radix_locked + session_held + in_flight + quarantined + loading == num_pages - 1`
(loading: pages a tier load writes into, see tiering.py).
`stats()` reads the ledger in O(1); `check_invariants` recounts every state from the structures
themselves (the allocator's stack and quarantine, the radix nodes, the session slots) and compares.
"""

from __future__ import annotations

from collections import Counter

import numpy as np
import numpy.typing as npt

from cache_service.core.config import CoreConfig
from cache_service.core.errors import InvariantError
from cache_service.core.eviction import CLOSED_CHILD, ORDINARY, PARENT
from cache_service.core.leases import LeaseTable
from cache_service.core.ledger import (
    EVICTABLE,
    FREE,
    IN_FLIGHT,
    LOADING,
    QUARANTINED,
    RADIX_LOCKED,
    SESSION_HELD,
    Counters,
    PageLedger,
)
from cache_service.core.pages import PageAllocator
from cache_service.core.radix import RadixTree
from cache_service.core.radix_node import RadixNode
from cache_service.core.reuse import ReuseLedger
from cache_service.core.sessions import SessionTable
from cache_service.core.slot import CLOSING, IDLE, IN_TURN, SessionSlot, Slots
from cache_service.core.tiering import TierIndex
from cache_service.core.types import Stats
from cache_service.core.window import WindowRows


class Accounting:
    """Reads every structure of one core: `stats()` in O(1), `check_invariants()` from scratch."""

    def __init__(self, config: CoreConfig, ledger: PageLedger, pages: PageAllocator, radix: RadixTree,
                 slots: Slots, sessions: SessionTable, leases: LeaseTable, counters: Counters,
                 tier: TierIndex | None = None, reuse: ReuseLedger | None = None,
                 window: WindowRows | None = None) -> None:
        self._config = config
        self._ledger = ledger
        self._pages = pages
        self._radix = radix
        self._slots = slots
        self._sessions = sessions
        self._leases = leases
        self._c = counters
        self._tier = tier
        self._reuse = reuse or ReuseLedger()
        self._window = window

    def stats(self) -> Stats:
        c, sessions, radix, pages, slots = self._c, self._sessions, self._radix, self._ledger.counts, self._slots
        w = self._window
        return Stats(
            num_pages=self._config.num_pages,
            page_size=self._config.page_size,
            free_pages=pages[FREE],
            evictable_pages=pages[EVICTABLE],
            radix_locked_pages=pages[RADIX_LOCKED],
            session_held_pages=pages[SESSION_HELD],
            in_flight_pages=pages[IN_FLIGHT],
            quarantined_pages=pages[QUARANTINED],
            session_budget_pages=self._config.budget_pages,
            radix_tokens=(pages[EVICTABLE] + pages[RADIX_LOCKED]) * self._config.page_size,
            session_tokens=c.session_tokens,
            session_kv_tokens=c.session_kv_tokens,
            prefix_hit_tokens=c.prefix_hit_tokens,
            session_hit_tokens=c.session_hit_tokens,
            miss_tokens=c.miss_tokens,
            evicted_pages=radix.evicted_pages_total,
            duplicate_pages=c.duplicate_pages,
            demoted_sessions=c.demoted_sessions,
            reaped_sessions=c.reaped_sessions,
            expired_leases=c.expired_leases,
            sessions_idle=sessions.num_idle,
            sessions_in_turn=slots.num_in_turn,
            sessions_closing=slots.num_closing,
            sessions_demoted=slots.num_demoted,
            engines=len(self._leases),
            loading_pages=pages[LOADING],
            offloading_pages=self._tier.offloading_pages if self._tier else 0,
            tier_stored_pages=self._tier.stored_pages if self._tier else 0,
            evicted_unstored_pages=self._tier.evicted_unstored_pages if self._tier else 0,
            sessions_parked=slots.num_parked,
            parked_sessions=c.parked_sessions,
            adopted_sessions=c.adopted_sessions,
            expired_parked_sessions=c.expired_parked_sessions,
            evicted_closed_child_pages=radix.evicted_by_class[CLOSED_CHILD],
            evicted_ordinary_pages=radix.evicted_by_class[ORDINARY],
            evicted_parent_pages=radix.evicted_by_class[PARENT],
            demoted_session_pages=c.demoted_session_pages,
            demoted_parent_pages=c.demoted_parent_pages,
            reuse=self._reuse.total,
            engine_reuse=self._reuse.engines(),
            window_pages=w.usable_pages if w else 0,
            window_free_pages=w.free_pages if w else 0,
            window_held_pages=w.held_pages if w else 0,
            window_policy_dropped_pages=w.policy_dropped_pages if w else 0,
            window_pressure_dropped_pages=w.pressure_dropped_pages if w else 0,
            window_evicted_pages=w.evicted_pages if w else 0,
            window_cut_hit_tokens=w.cut_hit_tokens if w else 0,
        )

    def check_invariants(self) -> Stats:
        """Recount everything from scratch and compare with the running counters. O(pool + tree + sessions).

        Checks: the ledger sums to the pool; allocator consistency (its free and quarantined counts are
        the ledger's); every allocated page has exactly one owner (the tree or one session) and every
        owned page is allocated; the radix's evictable and locked counts and the sessions' held and
        in-flight counts are the ledger's; per-node lock counts equal the pins sessions hold; session
        counters.
        """
        self._ledger.check()
        self._pages.check()
        radix_pages = self._radix.check()
        owned: list[bytes] = [radix_pages]
        expected_locks: Counter[RadixNode] = Counter()
        if self._tier is not None:
            self._tier.check(radix_pages)
            owned.append(self._tier.loading())
            for pin in self._tier.pins():
                up: RadixNode | None = pin
                while up is not None and up.parent is not None:
                    expected_locks[up] += 1
                    up = up.parent
        held = in_flight = tokens = kv = in_turn = closing = demoted = parked = 0
        for sid, s in self._sessions.items():
            self._check_session(sid, s, expected_locks)
            owned.append(bytes(s.pages[s.radix_pages * 4 :]))
            held += s.private_pages
            in_flight += s.in_flight_pages
            tokens += s.committed_tokens
            kv += s.kv_tokens
            in_turn += s.state is IN_TURN
            closing += s.state is CLOSING
            demoted += s.demoted
            parked += s.parked
        expected_guards = self._check_tree()
        for n in self._radix.iter_nodes():
            if n.parent is not None and n.lock_ref != expected_locks.get(n, 0):
                raise InvariantError(
                    f"radix node {n.id}: lock_ref {n.lock_ref} != {expected_locks.get(n, 0)} session and tier pins"
                )
            if n.parent is not None and n.guard != expected_guards.get(n, 0):
                raise InvariantError(
                    f"radix node {n.id}: guard {n.guard} != {expected_guards.get(n, 0)} guards of parent sessions"
                )
        self._check_single_owner(np.frombuffer(b"".join(owned), dtype=np.int32))
        if self._window is not None:
            self._window.check(self._pages.allocated_mask() | self._pages.quarantined_mask())
        c, counts = self._c, self._ledger.counts
        if (held, in_flight) != (counts[SESSION_HELD], counts[IN_FLIGHT]):
            raise InvariantError(
                f"session page counters (held={counts[SESSION_HELD]}, in_flight={counts[IN_FLIGHT]}) "
                f"!= recount ({held}, {in_flight})"
            )
        if (tokens, kv) != (c.session_tokens, c.session_kv_tokens):
            raise InvariantError("session token counters != recount")
        t = self._slots
        if (in_turn, closing, demoted, parked) != (t.num_in_turn, t.num_closing, t.num_demoted, t.num_parked):
            raise InvariantError("session state counters != recount")
        if sorted(s.id for s in self._sessions.parked_sessions()) != sorted(s.id for s in self._sessions if s.parked):
            raise InvariantError("the parked order does not hold exactly the parked sessions")
        for lease in self._leases.leases():
            for sid in lease.sessions:
                holder = self._sessions.find(sid)
                if holder is None or holder.owner != lease.engine_id:
                    raise InvariantError(f"lease {lease.engine_id!r} lists session {sid!r} it does not own")
        st = self.stats()
        total = (
            st.free_pages + st.evictable_pages + st.radix_locked_pages + st.session_held_pages
            + st.in_flight_pages + st.quarantined_pages + st.loading_pages
        )
        if st.window_free_pages + st.window_held_pages != st.window_pages:
            raise InvariantError(f"accounting: window pages free {st.window_free_pages} + held {st.window_held_pages} "
                                 f"!= {st.window_pages}")
        if total != st.usable_pages:
            raise InvariantError(
                f"accounting: free + evictable + radix_locked + session_held + in_flight + quarantined + loading "
                f"= {total} "
                f"!= num_pages - 1 = {st.usable_pages}"
            )
        return st

    def _check_tree(self) -> Counter[RadixNode]:
        """The agent tree (docs/design.md §15): every parent link names an open session that lists the child,
        each parent's live-children count is its children, and only parents with live children guard a radix
        node. Returns the guards each node should have."""
        guards: Counter[RadixNode] = Counter()
        for s in self._sessions:
            p = s.parent
            if p is not None and (self._sessions.find(p.id) is not p or s not in p.children):
                raise InvariantError(f"session {s.id!r}: its parent {p.id!r} is not open or does not list it")
            if any(c.parent is not s or self._sessions.find(c.id) is not c for c in s.children):
                raise InvariantError(f"session {s.id!r} lists a child that is not open or not its own")
            if s.guard_node is not None:
                if not s.children:
                    raise InvariantError(f"session {s.id!r} guards the radix with no live children")
                at = self._radix.classes.guarded_at(s.guard_node)
                if at is not None:
                    guards[at] += 1
        return guards

    def _check_session(self, sid: str, s: SessionSlot, expected_locks: Counter[RadixNode]) -> None:
        if sid != s.id:
            raise InvariantError(f"session table key {sid!r} != session id {s.id!r}")
        pages = bytes(s.pages)
        if not 0 <= s.radix_pages <= s.committed_pages <= len(pages) >> 2:
            raise InvariantError(f"session {sid!r}: radix_pages <= committed_pages <= len(pages) violated")
        if (s.lock_node is None) != (s.radix_pages == 0):
            raise InvariantError(f"session {sid!r}: pinned pages without a pin (or the reverse)")
        if s.lock_node is not None:
            path = self._radix.path_pages(s.lock_node)
            if path != pages[: s.radix_pages * 4]:
                raise InvariantError(f"session {sid!r}: pinned page table != its radix path")
            n: RadixNode | None = s.lock_node
            while n is not None and n.parent is not None:
                expected_locks[n] += 1
                n = n.parent
        if s.kv_tokens > s.committed_pages * self._config.page_size:
            raise InvariantError(f"session {sid!r}: kv_tokens beyond its committed pages")
        context = len(s.tokens) >> 2
        if s.committed_tokens > context or (not s.in_turn and s.committed_tokens != context):
            raise InvariantError(f"session {sid!r}: committed token count disagrees with its state")
        if s.parked and (s.owner or s.state is not IDLE):
            raise InvariantError(f"session {sid!r}: a parked session has an owner or a turn in flight")
        if s.owner:
            lease = self._leases.find(s.owner)
            if lease is None or sid not in lease.sessions:
                raise InvariantError(f"session {sid!r} is missing from its owner's lease")
            if lease.identity != s.identity:
                raise InvariantError(f"session {sid!r} and its owner's lease belong to different identities")

    def _check_single_owner(self, all_owned: npt.NDArray[np.int32]) -> None:
        counts = np.bincount(all_owned, minlength=self._config.num_pages)
        if counts[0]:
            raise InvariantError("the null page 0 is owned by someone")
        if (counts > 1).any():
            page = int(np.flatnonzero(counts > 1)[0])
            raise InvariantError(f"page {page} has {counts[page]} owners (no page may have two)")
        allocated = self._pages.allocated_mask()
        if not np.array_equal(counts > 0, allocated):
            page = int(np.flatnonzero((counts > 0) != allocated)[0])
            raise InvariantError(f"page {page}: allocated and owned disagree (a leak or a stray free)")
