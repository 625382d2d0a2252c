"""Core configuration: sizes in pages and tokens, times in seconds. Frozen; validated on construction."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class CoreConfig:
    num_pages: int
    """Pages in the pool, page 0 included (reserved as the null page, never handed out)."""
    page_size: int
    """Tokens per page."""
    session_timeout_seconds: float = 600.0
    """Default sliding session timeout; 0 means sessions never time out."""
    lease_ttl_seconds: float = 30.0
    """Default engine lease TTL when RegisterEngine asks for none."""
    session_budget_pages: int = 0
    """Most pages that sessions may hold privately (held + in flight); 0 means no budget beyond the pool."""
    max_session_tokens: int = 0
    """Per-session cap on context + reservation, in tokens; 0 means no cap beyond the pool."""
    eviction_policy: str = "lru"
    """Name in `cache_service.core.radix.EVICTION_POLICIES`."""
    demote_idle_sessions: bool = True
    """Under pool or budget pressure, demote idle sessions LRU-first into evictable radix entries."""
    expired_lease_memory: int = 4096
    """How many expired engine ids are remembered to answer LEASE_EXPIRED instead of ENGINE_NOT_FOUND."""
    quarantine_seconds: float = 0.0
    """How long pages released by an expired lease wait before they are free again; 0 frees them at once."""
    parked_session_timeout_seconds: float = 600.0
    """How long a parked session (its engine's lease ended) keeps its KV before it is closed with cache=true;
    0 means the session's own sliding timeout (never, for a session whose timeout is 0)."""
    max_sessions: int = 0
    """Most sessions open at once; 0 means no bound beyond memory."""
    max_lease_ttl_seconds: float = 0.0
    """Largest TTL a lease may ask for; 0 means no bound."""
    tier_watermark: float = 0.5
    """With a tier: offload radix pages ahead of eviction while fewer than this share of the usable pages is free."""
    tier_pin_fraction: float = 0.25
    """With a tier: most share of the usable pages that offloads in progress may pin (pinned pages are not evicted)."""
    tier_tainted_quarantine_seconds: float = 60.0
    """With a tier: how long a page a failed store transfer may still write waits before it is free again."""
    tier_policy: str = "write-back"
    """With a tier: when radix pages are offloaded, a name in `cache_service.core.tiering.TIER_POLICIES`
    (write-back: ahead of eviction, under the watermark; write-through: as soon as they are evictable)."""
    window_pages: int = 0
    """Pages of the window group's own page space (window page 0 included, reserved); 0: the pool has no window
    rows kept apart (every page holds every layer's rows). docs/design.md §13, window.py."""
    window_tokens: int = 0
    """The sliding window W (tokens) of the window group; with `window_pages`."""
    window_prompt_ends: bool = False
    """Keep the window rows before each turn's prompt end too (a replay of a turn's prompt hits it whole), not
    only before each turn's committed end (where the next turn's prompt hits)."""

    def __post_init__(self) -> None:
        if self.num_pages < 2:
            raise ValueError(f"num_pages must be >= 2 (page 0 is reserved), got {self.num_pages}")
        if self.page_size < 1:
            raise ValueError(f"page_size must be >= 1, got {self.page_size}")
        if self.session_timeout_seconds < 0:
            raise ValueError(f"session_timeout_seconds must be >= 0, got {self.session_timeout_seconds}")
        if self.lease_ttl_seconds <= 0:
            raise ValueError(f"lease_ttl_seconds must be > 0, got {self.lease_ttl_seconds}")
        if not 0 <= self.session_budget_pages <= self.num_pages - 1:
            raise ValueError(
                f"session_budget_pages must be in [0, {self.num_pages - 1}], got {self.session_budget_pages}"
            )
        if self.max_session_tokens < 0:
            raise ValueError(f"max_session_tokens must be >= 0, got {self.max_session_tokens}")
        for name in ("quarantine_seconds", "max_lease_ttl_seconds", "parked_session_timeout_seconds",
                     "tier_tainted_quarantine_seconds"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        if self.max_sessions < 0:
            raise ValueError(f"max_sessions must be >= 0, got {self.max_sessions}")
        for name in ("tier_watermark", "tier_pin_fraction"):
            if not 0 < getattr(self, name) <= 1:
                raise ValueError(f"{name} must be in (0, 1], got {getattr(self, name)}")
        if self.window_pages and (self.window_pages < 2 or self.window_tokens < 1):
            raise ValueError(f"window_pages ({self.window_pages}) must be >= 2 with window_tokens >= 1 "
                             f"(got {self.window_tokens})")
        if self.window_tokens and not self.window_pages:
            raise ValueError(f"window_tokens {self.window_tokens} needs window_pages")
        if self.max_lease_ttl_seconds and self.lease_ttl_seconds > self.max_lease_ttl_seconds:
            raise ValueError(f"lease_ttl_seconds {self.lease_ttl_seconds} is above max_lease_ttl_seconds "
                             f"{self.max_lease_ttl_seconds}")

    @property
    def usable_pages(self) -> int:
        return self.num_pages - 1

    @property
    def budget_pages(self) -> int:
        """The effective session budget in pages (the whole pool when none is set)."""
        return self.session_budget_pages or self.usable_pages
