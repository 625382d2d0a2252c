"""Capacity: decide how to make room for `n` new pages before anything changes.

`plan_relief` reads the pool, the radix and the session table and returns a `ReliefPlan`: which idle
sessions to demote for the session budget, which to demote for the pool, and that eviction then covers
the rest; or it raises the RESOURCE_EXHAUSTED reason when no relief can suffice, so a hopeless request
changes nothing. It never moves a page: `turns.Turns` carries the plan out. The pool is checked first
(it is the absolute limit), then the session budget.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

from cache_service.core.accounting import Counters
from cache_service.core.config import CoreConfig
from cache_service.core.errors import KVCacheError, Reason
from cache_service.core.pages import PageAllocator
from cache_service.core.radix import RadixNode, RadixTree
from cache_service.core.sessions import Session, SessionTable


@dataclass(slots=True)
class ReliefPlan:
    """Demote `budget_victims`; then evict what the pool lacks, demoting `pool_victims` one at a time
    while evictions fall short. Demoting every pool victim makes `free + evictable >= n`, so afterwards
    `n` pages are free. Victims are idle sessions, least recently active first."""

    budget_victims: list[Session] = field(default_factory=list)
    pool_victims: list[Session] = field(default_factory=list)


NO_RELIEF = ReliefPlan()


class _Reclaim:
    """Pages that demoting a growing set of victims makes free or evictable: their private pages, plus
    pinned radix pages that only those victims pin."""

    __slots__ = ("_pins", "pages")

    def __init__(self) -> None:
        self._pins: Counter[RadixNode] = Counter()
        self.pages = 0

    def add(self, v: Session) -> None:
        self.pages += v.private_pages
        n = v.lock_node
        while n is not None and n.parent is not None:
            self._pins[n] += 1
            if self._pins[n] == n.lock_ref:
                self.pages += n.num_pages
            n = n.parent


def plan_relief(
    n: int, requester: Session, *, config: CoreConfig, pages: PageAllocator, radix: RadixTree,
    sessions: SessionTable, counters: Counters,
) -> ReliefPlan:
    """How to free room for `n` pages for `requester`'s turn. Raises POOL_EXHAUSTED (checked first) or
    SESSION_BUDGET when even demoting every idle session cannot make room.

    Idle sessions are visited least recently active first and only while they are needed, so when
    eviction alone covers the pool (the steady state of a full cache) no session is looked at.
    """
    free = pages.num_free
    potential = free + radix.evictable_pages
    budget = config.session_budget_pages
    over = counters.session_held_pages + counters.in_flight_pages + n - budget if budget else 0
    if over <= 0 and n <= potential:
        return NO_RELIEF
    plan = ReliefPlan()
    reclaim = _Reclaim()
    victims = sessions.demotable(requester) if config.demote_idle_sessions else iter(())
    for v in victims:
        if over > 0:
            plan.budget_victims.append(v)
            over -= v.private_pages
        elif potential + reclaim.pages < n:
            plan.pool_victims.append(v)
        else:
            break
        reclaim.add(v)
    if n > potential + reclaim.pages:  # every idle session would not do
        raise _pool_exhausted(requester, n, pages, radix, counters)
    if over > 0:
        raise KVCacheError(
            Reason.SESSION_BUDGET,
            f"session {requester.id!r} needs {n} pages; sessions hold "
            f"{counters.session_held_pages + counters.in_flight_pages} of a {budget}-page session budget and "
            f"idle sessions cannot give {over + sum(v.private_pages for v in plan.budget_victims)}",
            session_id=requester.id, requested_pages=n, budget_pages=budget,
        )
    return plan


def _pool_exhausted(s: Session, n: int, pages: PageAllocator, radix: RadixTree, counters: Counters) -> KVCacheError:
    return KVCacheError(
        Reason.POOL_EXHAUSTED,
        f"session {s.id!r} needs {n} pages; {pages.num_free} free, {radix.evictable_pages} evictable, "
        f"{radix.locked_pages} pinned, {counters.session_held_pages} held by sessions, "
        f"{counters.in_flight_pages} in flight",
        session_id=s.id, requested_pages=n, free_pages=pages.num_free,
    )
