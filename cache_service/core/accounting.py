"""Accounting: the running counters, the `Stats` snapshot, and the from-scratch invariant check.

Every page is in exactly one state, and the counts always satisfy
`free + evictable + radix_locked + session_held + in_flight + quarantined == num_pages - 1`:

- free: on the allocator's stack;
- evictable / radix_locked: owned by the radix tree, unpinned / pinned;
- session_held: committed KV a session owns privately (outside the radix);
- in_flight: pages handed out for a turn that has not committed yet;
- quarantined: released by an expired lease, not yet free (its engine may still write them).

The radix tree counts its own pages; `Counters` holds the sessions' page counts (moved by `settle`
whenever a session's page table changes) and the cumulative totals. `check_invariants` recounts
everything from the structures themselves and compares.
"""

from __future__ import annotations

from collections import Counter

import numpy as np

from cache_service.core.config import CoreConfig
from cache_service.core.errors import InvariantError
from cache_service.core.leases import LeaseTable
from cache_service.core.pages import PageAllocator
from cache_service.core.radix import RadixNode, RadixTree
from cache_service.core.sessions import Session, SessionTable
from cache_service.core.types import PageArray, SessionState, Stats

Footprint = tuple[int, int]
"""A session's (private pages, in-flight pages), taken before a change and settled after it."""


class Counters:
    """Running totals the structures do not keep themselves."""

    __slots__ = (
        "demoted_sessions",
        "duplicate_pages",
        "expired_leases",
        "in_flight_pages",
        "miss_tokens",
        "prefix_hit_tokens",
        "reaped_sessions",
        "session_held_pages",
        "session_hit_tokens",
        "session_kv_tokens",
        "session_tokens",
    )

    def __init__(self) -> None:
        self.session_held_pages = 0
        self.in_flight_pages = 0
        self.session_tokens = 0
        self.session_kv_tokens = 0
        self.prefix_hit_tokens = 0
        self.session_hit_tokens = 0
        self.miss_tokens = 0
        self.duplicate_pages = 0
        self.demoted_sessions = 0
        self.reaped_sessions = 0
        self.expired_leases = 0

    @staticmethod
    def footprint(s: Session) -> Footprint:
        return s.private_pages, s.in_flight_pages

    def settle(self, s: Session, before: Footprint) -> None:
        """Move the page counters by how `s`'s footprint changed since `before`."""
        self.session_held_pages += s.private_pages - before[0]
        self.in_flight_pages += s.in_flight_pages - before[1]


class Accounting:
    """Reads every structure of one core: `stats()` in O(1), `check_invariants()` from scratch."""

    def __init__(self, config: CoreConfig, pages: PageAllocator, radix: RadixTree, sessions: SessionTable,
                 leases: LeaseTable, counters: Counters) -> None:
        self._config = config
        self._pages = pages
        self._radix = radix
        self._sessions = sessions
        self._leases = leases
        self._c = counters

    def stats(self) -> Stats:
        c, sessions, radix = self._c, self._sessions, self._radix
        return Stats(
            num_pages=self._config.num_pages,
            page_size=self._config.page_size,
            free_pages=self._pages.num_free,
            evictable_pages=radix.evictable_pages,
            radix_locked_pages=radix.locked_pages,
            session_held_pages=c.session_held_pages,
            in_flight_pages=c.in_flight_pages,
            quarantined_pages=self._pages.num_quarantined,
            session_budget_pages=self._config.budget_pages,
            radix_tokens=radix.cached_pages * self._config.page_size,
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
            sessions_in_turn=sessions.num_in_turn,
            sessions_closing=sessions.num_closing,
            sessions_demoted=sessions.num_demoted,
            engines=len(self._leases),
        )

    def check_invariants(self) -> Stats:
        """Recount everything from scratch and compare with the running counters. O(pool + tree + sessions).

        Checks: allocator consistency; every allocated page has exactly one owner (the tree or one
        session) and every owned page is allocated; per-node lock counts equal the pins sessions hold;
        session counters; and `free + evictable + radix_locked + session_held + in_flight + quarantined
        == num_pages - 1`.
        """
        self._pages.check()
        owned: list[PageArray] = [self._radix.check()]
        expected_locks: Counter[RadixNode] = Counter()
        held = in_flight = tokens = kv = in_turn = closing = demoted = 0
        for sid, s in self._sessions.items():
            self._check_session(sid, s, expected_locks)
            owned.append(s.pages.view()[s.radix_pages :])
            held += s.private_pages
            in_flight += s.in_flight_pages
            tokens += s.committed_tokens
            kv += s.kv_tokens
            in_turn += s.state is SessionState.IN_TURN
            closing += s.state is SessionState.CLOSING
            demoted += s.demoted
        for n in self._radix.iter_nodes():
            if n.parent is not None and n.lock_ref != expected_locks.get(n, 0):
                raise InvariantError(
                    f"radix node {n.id}: lock_ref {n.lock_ref} != {expected_locks.get(n, 0)} session pins"
                )
        self._check_single_owner(np.concatenate(owned))
        c = self._c
        if (held, in_flight) != (c.session_held_pages, c.in_flight_pages):
            raise InvariantError(
                f"session page counters (held={c.session_held_pages}, in_flight={c.in_flight_pages}) "
                f"!= recount ({held}, {in_flight})"
            )
        if (tokens, kv) != (c.session_tokens, c.session_kv_tokens):
            raise InvariantError("session token counters != recount")
        t = self._sessions
        if (in_turn, closing, demoted) != (t.num_in_turn, t.num_closing, t.num_demoted):
            raise InvariantError("session state counters != recount")
        for lease in self._leases.leases():
            for sid in lease.sessions:
                holder = self._sessions.find(sid)
                if holder is None or holder.owner != lease.engine_id:
                    raise InvariantError(f"lease {lease.engine_id!r} lists session {sid!r} it does not own")
        st = self.stats()
        total = (
            st.free_pages + st.evictable_pages + st.radix_locked_pages + st.session_held_pages
            + st.in_flight_pages + st.quarantined_pages
        )
        if total != st.usable_pages:
            raise InvariantError(
                f"accounting: free + evictable + radix_locked + session_held + in_flight + quarantined = {total} "
                f"!= num_pages - 1 = {st.usable_pages}"
            )
        return st

    def _check_session(self, sid: str, s: Session, expected_locks: Counter[RadixNode]) -> None:
        if sid != s.id:
            raise InvariantError(f"session table key {sid!r} != session id {s.id!r}")
        pages = s.pages.view()
        if not 0 <= s.radix_pages <= s.committed_pages <= len(pages):
            raise InvariantError(f"session {sid!r}: radix_pages <= committed_pages <= len(pages) violated")
        if (s.lock_node is None) != (s.radix_pages == 0):
            raise InvariantError(f"session {sid!r}: pinned pages without a pin (or the reverse)")
        if s.lock_node is not None:
            path = self._radix.path_pages(s.lock_node)
            if not np.array_equal(path[: s.radix_pages], pages[: s.radix_pages]) or path.size != s.radix_pages:
                raise InvariantError(f"session {sid!r}: pinned page table != its radix path")
            n: RadixNode | None = s.lock_node
            while n is not None and n.parent is not None:
                expected_locks[n] += 1
                n = n.parent
        if s.kv_tokens > s.committed_pages * self._config.page_size:
            raise InvariantError(f"session {sid!r}: kv_tokens beyond its committed pages")
        if s.committed_tokens > len(s.tokens) or (not s.in_turn and s.committed_tokens != len(s.tokens)):
            raise InvariantError(f"session {sid!r}: committed token count disagrees with its state")
        if s.owner:
            lease = self._leases.find(s.owner)
            if lease is None or sid not in lease.sessions:
                raise InvariantError(f"session {sid!r} is missing from its owner's lease")
            if lease.identity != s.identity:
                raise InvariantError(f"session {sid!r} and its owner's lease belong to different identities")

    def _check_single_owner(self, all_owned: PageArray) -> None:
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
