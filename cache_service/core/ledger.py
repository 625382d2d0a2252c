"""The page ledger: how many pages each kind of owner holds, and the core's running totals.

Every page but the null page is in exactly one state at a time:

    FREE          on the allocator's free stack
    EVICTABLE     owned by the radix tree, pinned by nobody
    RADIX_LOCKED  owned by the radix tree, pinned by a session
    SESSION_HELD  committed KV a session owns privately (outside the radix)
    IN_FLIGHT     handed out for a turn that has not committed yet
    QUARANTINED   released by an expired lease, not yet free (its engine may still write it)
    LOADING       fresh pages a tier load is writing into (tiering.py): in no radix node and no page
                  table, so nothing can read them before the load completed

The counters here are the one record of those counts: whoever moves pages from one owner to another
(the allocator, the radix tree, a session slot) says so with `move(n, src, dst)`, and `Stats` and the
accounting invariant (`sum == num_pages - 1`) read them off `counts`. `accounting.check_invariants`
recounts every state from the structures and compares.

A new page state (a tier's pages being loaded or offloaded) is a constant appended here with its name in
`STATE_NAMES`, the `move`s of the code that owns it, a `Stats` field, and a recount in accounting: the
invariant sums every state, so it needs no change.
"""

from __future__ import annotations

from cache_service.core.errors import InvariantError

FREE, EVICTABLE, RADIX_LOCKED, SESSION_HELD, IN_FLIGHT, QUARANTINED, LOADING = range(7)
STATE_NAMES = ("free", "evictable", "radix_locked", "session_held", "in_flight", "quarantined", "loading")
"""Index -> name; each is also the `Stats` field `<name>_pages`."""


class PageLedger:
    """Pages by state (`counts[state]`). Single-threaded, like the whole core."""

    __slots__ = ("counts", "usable_pages")

    def __init__(self, usable_pages: int) -> None:
        self.usable_pages = usable_pages
        self.counts = [0] * len(STATE_NAMES)
        self.counts[FREE] = usable_pages

    def move(self, n: int, src: int, dst: int) -> None:
        """`n` pages changed owner from state `src` to state `dst`."""
        c = self.counts
        c[src] -= n
        c[dst] += n

    def by_name(self) -> dict[str, int]:
        return dict(zip(STATE_NAMES, self.counts, strict=True))

    def check(self) -> None:
        """The counts are never negative and always sum to the usable pages."""
        if min(self.counts) < 0:
            raise InvariantError(f"page ledger: a negative count in {self.by_name()}")
        total = sum(self.counts)
        if total != self.usable_pages:
            raise InvariantError(
                f"accounting: {' + '.join(STATE_NAMES)} = {total} != num_pages - 1 = {self.usable_pages}"
            )


class Counters:
    """Running totals that are not page states: tokens, hits, and how often things happened."""

    __slots__ = (
        "adopted_sessions",
        "demoted_parent_pages",
        "demoted_session_pages",
        "demoted_sessions",
        "duplicate_pages",
        "expired_leases",
        "expired_parked_sessions",
        "miss_tokens",
        "parked_sessions",
        "prefix_hit_tokens",
        "reaped_sessions",
        "session_hit_tokens",
        "session_kv_tokens",
        "session_tokens",
    )

    def __init__(self) -> None:
        self.session_tokens = 0
        self.session_kv_tokens = 0
        self.prefix_hit_tokens = 0
        self.session_hit_tokens = 0
        self.miss_tokens = 0
        self.duplicate_pages = 0
        self.demoted_sessions = 0
        self.reaped_sessions = 0
        self.expired_leases = 0
        self.parked_sessions = 0
        self.adopted_sessions = 0
        self.expired_parked_sessions = 0
        self.demoted_session_pages = 0
        self.demoted_parent_pages = 0
