"""Capacity: the per-session token cap, and how to make room for `n` new pages before anything changes.

`check_token_cap` is the one check of --max-session-tokens (appends, extensions and commits all call it).
`plan_relief` reads the page ledger and the idle sessions it is offered and returns a `ReliefPlan`:
which idle sessions to demote for the session budget, which to demote for the pool, and that eviction
then covers the rest; or it raises the RESOURCE_EXHAUSTED reason when no relief can suffice, so a hopeless
request changes nothing. It never moves a page: the slots carry the plan out. The pool is checked first
(it is the absolute limit), then the session budget.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Generic, Protocol, TypeVar

from cache_service.core.config import CoreConfig
from cache_service.core.errors import KVCacheError, Reason
from cache_service.core.ledger import EVICTABLE, FREE, IN_FLIGHT, RADIX_LOCKED, SESSION_HELD, PageLedger
from cache_service.core.radix_node import RadixNode


class Holder(Protocol):
    """What relief reads of a session: its id, its private pages and its radix pin."""

    @property
    def id(self) -> str: ...

    @property
    def private_pages(self) -> int: ...

    @property
    def lock_node(self) -> RadixNode | None: ...


def check_token_cap(cap: int, session_id: str, total: int, what: str) -> None:
    """SESSION_TOKEN_LIMIT when `total` tokens (`what` says how they add up) exceed the per-session cap
    `cap` (0: no cap)."""
    if cap and total > cap:
        raise KVCacheError(
            Reason.SESSION_TOKEN_LIMIT, f"session {session_id!r} would reach {total} tokens ({what}), above the "
            f"per-session cap of {cap}", session_id=session_id, limit=cap, requested=total,
        )


H = TypeVar("H", bound=Holder)


@dataclass(slots=True)
class ReliefPlan(Generic[H]):
    """Demote `budget_victims`; then evict what the pool lacks, demoting `pool_victims` one at a time
    while evictions fall short. Demoting every pool victim makes `free + evictable >= n`, so afterwards
    `n` pages are free. Victims are idle sessions, least recently active first."""

    budget_victims: list[H] = field(default_factory=list)
    pool_victims: list[H] = field(default_factory=list)


class _Reclaim:
    """Pages that demoting a growing set of victims makes free or evictable: their private pages, plus
    pinned radix pages that only those victims pin."""

    __slots__ = ("_pins", "pages")

    def __init__(self) -> None:
        self._pins: Counter[RadixNode] = Counter()
        self.pages = 0

    def add(self, v: Holder) -> None:
        self.pages += v.private_pages
        n = v.lock_node
        while n is not None and n.parent is not None:
            self._pins[n] += 1
            if self._pins[n] == n.lock_ref:
                self.pages += n.num_pages
            n = n.parent


def plan_relief(n: int, requester: Holder, *, config: CoreConfig, ledger: PageLedger,
                victims: Iterator[H]) -> ReliefPlan[H]:
    """How to free room for `n` pages for `requester`'s turn, demoting from `victims` (idle sessions
    holding KV, least recently active first) only while they are needed. Raises POOL_EXHAUSTED (checked
    first) or SESSION_BUDGET when even demoting every idle session cannot make room.

    When eviction alone covers the pool (the steady state of a full cache) no session is looked at.
    """
    counts = ledger.counts
    potential = counts[FREE] + counts[EVICTABLE]
    budget = config.session_budget_pages
    sessions_hold = counts[SESSION_HELD] + counts[IN_FLIGHT]
    over = sessions_hold + n - budget if budget else 0
    plan: ReliefPlan[H] = ReliefPlan()
    if over <= 0 and n <= potential:
        return plan
    reclaim = _Reclaim()
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
        raise KVCacheError(
            Reason.POOL_EXHAUSTED,
            f"session {requester.id!r} needs {n} pages; {counts[FREE]} free, {counts[EVICTABLE]} evictable, "
            f"{counts[RADIX_LOCKED]} pinned, {counts[SESSION_HELD]} held by sessions, {counts[IN_FLIGHT]} in flight",
            session_id=requester.id, requested_pages=n, free_pages=counts[FREE],
        )
    if over > 0:
        raise KVCacheError(
            Reason.SESSION_BUDGET,
            f"session {requester.id!r} needs {n} pages; sessions hold {sessions_hold} of a {budget}-page session "
            f"budget and idle sessions cannot give {over + sum(v.private_pages for v in plan.budget_victims)}",
            session_id=requester.id, requested_pages=n, budget_pages=budget,
        )
    return plan
