"""GetStats' records, both sides' one declaration of them: what the core counts (`CoreStats`, the core's
`Stats`), all that GetStats answers (`ServiceStats`, the engine client's `Stats`) and engines' reported reuse
(`ReuseStats`). The service converts them to and from the proto by field name.

Generated from `message GetStatsResponse` and `message ReuseStats` in protos/kvcache/v1/kvcache.proto by
scripts/gen_protos.py: do not edit; change the proto and run `make proto`. `make proto-check` fails when
this file is stale.
"""

from __future__ import annotations

from dataclasses import dataclass

SERVICE_STATS_FIELDS = ("instance_id", "uptime_seconds", "physical_usage", "verified", "tier")
"""GetStatsResponse fields the service adds to what the core counts (`CoreStats`)."""
UNRECORDED_STATS_FIELDS = {"tier": "the tier's own record is cache_service.tier.stats.TierStats"}
"""GetStatsResponse fields with no field here, and why."""


@dataclass(frozen=True, slots=True)
class ReuseStats:
    """Reuse over the turns an engine reported (docs/design.md §5): `matched_tokens` is what kvcache held for them
    at their appends (cached_tokens); the engine's own figures say where each context token's KV came from: its own
    prefix cache, kvcache's pages (loaded), or computed (the three sum to the turns' context)."""

    engine_id: str = ""
    """"" in the total, and for turns committed without an engine."""
    turns: int = 0
    matched_tokens: int = 0
    engine_cached_tokens: int = 0
    loaded_tokens: int = 0
    computed_tokens: int = 0


@dataclass(frozen=True, slots=True, kw_only=True)
class CoreStats:
    """What the core counts, as GetStats sends it: every GetStatsResponse field but SERVICE_STATS_FIELDS.
    Pages by state (free, evictable, radix_locked, session_held, in_flight, quarantined, loading) sum to
    `num_pages - 1`."""

    num_pages: int
    page_size: int
    free_pages: int
    evictable_pages: int
    radix_locked_pages: int
    session_held_pages: int
    in_flight_pages: int
    session_budget_pages: int
    radix_tokens: int
    session_tokens: int
    session_kv_tokens: int
    prefix_hit_tokens: int
    """Cumulative: tokens served from the radix at appends, from sessions' own KV, and computed."""
    session_hit_tokens: int
    miss_tokens: int
    evicted_pages: int
    duplicate_pages: int
    demoted_sessions: int
    reaped_sessions: int
    expired_leases: int
    sessions_idle: int
    sessions_in_turn: int
    sessions_closing: int
    sessions_demoted: int
    engines: int
    quarantined_pages: int
    """Pages an expired lease released, held back for --quarantine-seconds before they are free again (an engine
    that stalled past its TTL may still write them)."""
    loading_pages: int
    """Pages a tier load is writing into: owned by the load, readable by nobody until it completes. A page state of
    its own: free + evictable + radix_locked + session_held + in_flight + quarantined + loading == num_pages - 1."""
    offloading_pages: int
    """Radix pages a tier offload is reading now (pinned until the store is done; counted in radix_locked_pages)."""
    tier_stored_pages: int
    """Radix pages the tier is known to hold (evicting them loses nothing)."""
    evicted_unstored_pages: int
    """Cumulative: radix pages evicted before the tier held them (0 without a tier)."""
    sessions_parked: int
    """Parked sessions now (docs/design.md §11; counted in sessions_idle too)."""
    parked_sessions: int
    """Cumulative: sessions parked at their engine's lease end, parked sessions an append adopted, and parked
    sessions closed at their parked timeout (counted in reaped_sessions too)."""
    adopted_sessions: int
    expired_parked_sessions: int
    evicted_closed_child_pages: int
    """Cumulative radix pages evicted by class (docs/design.md §15; the three sum to evicted_pages): what closed
    sessions left behind (a child's close, a drop), ordinary entries, and the paths of parents whose children are
    live."""
    evicted_ordinary_pages: int
    evicted_parent_pages: int
    demoted_session_pages: int
    """Cumulative pages relief demoted from idle sessions without live children, and from parents whose children are
    live (the last resort)."""
    demoted_parent_pages: int
    reuse: ReuseStats
    """What engines reported at their commits (CommitSessionRequest.reuse), in total and per engine (the 64 engines
    that reported last, by engine_id): kvcache's matched tokens beside the engines' own figures."""
    engine_reuse: tuple[ReuseStats, ...]
    window_pages: int
    """A pool whose window-layer rows are kept apart (docs/design.md §13; 0 without): its usable window pages, those
    free and those holding a page's window rows (window_free_pages + window_held_pages == window_pages)."""
    window_free_pages: int
    window_held_pages: int
    window_policy_dropped_pages: int
    """Cumulative window pages dropped on their own while their pages' full-attention rows stay: at commits (rows no
    hit point of the session needs) and under pressure (radix rows no hit point needs)."""
    window_pressure_dropped_pages: int
    window_evicted_pages: int
    """Cumulative whole radix pages evicted because window pages were short (counted in evicted_pages too)."""
    window_cut_hit_tokens: int
    """Cumulative tokens pinned matches gave up because the window rows before their end were gone."""


@dataclass(frozen=True, slots=True, kw_only=True)
class ServiceStats(CoreStats):
    """All that GetStats answers: `CoreStats` and the service's own fields."""

    instance_id: str
    uptime_seconds: float
    physical_usage: float
    """1 - free_pages / (num_pages - 1)."""
    verified: bool
    """True when verify was requested and the invariant check passed."""
