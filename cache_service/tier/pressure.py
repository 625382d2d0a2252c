"""When the tier cannot keep up (docs/design.md §8), said once an episode, on the loop: the offload queue or
eviction staging falling behind, and eviction staging refusing pages."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from cache_service.tier.staging import EvictionStaging
from cache_service.tier.stats import TierCounters

BEHIND_FULL_SECONDS = 1.0
"""The offload queue full for this long is falling behind (write-back keeps the queue full while the pool is
under its watermark: full alone is the normal state of a busy tier)."""
BEHIND_LOG_SECONDS = 30.0
"""A falling-behind episode that starts within this long of the last logged one is counted, not logged."""


class Pressure:
    """Episodes of back-pressure, each one warning at its start and one line at its end. Loop only."""

    def __init__(self, backend: str, counters: TierCounters, staging: EvictionStaging | None, log: Any,
                 clock: Callable[[], float]) -> None:
        self._backend = backend
        self._counters = counters
        self._staging = staging
        self._log = log
        self._clock = clock
        self._behind_dropped = 0
        self._behind_logged = False
        self._full_since: float | None = None
        self._behind_last_log: float | None = None
        self._staging_episode: str | None = None
        self._staging_episode_pages = 0

    def check(self) -> None:
        """After the offload queue or staging changed: start or end a falling-behind episode. It starts when
        the queue has been full for BEHIND_FULL_SECONDS or staging is more than half full, and ends once the
        queue is at most half full and staging at most a quarter; one warning at its start, one line at its
        end."""
        c = self._counters
        staged = self._staging.used if self._staging is not None else 0
        slots = self._staging.slots if self._staging is not None else 0
        with c.lock:
            queued, capacity, since = c.queue_pages, c.queue_capacity_pages, c.behind_since
            dropped = c.offload_dropped_pages + c.staging_dropped_pages
        now = self._clock()
        if queued < capacity:
            self._full_since = None
        elif self._full_since is None:
            self._full_since = now
        full = self._full_since is not None and now - self._full_since >= BEHIND_FULL_SECONDS
        if since is None and (full or 2 * staged > slots > 0):
            with c.lock:
                c.behind_since = now
                c.behind_episodes += 1
            self._behind_logged = self._behind_last_log is None or now - self._behind_last_log >= BEHIND_LOG_SECONDS
            if self._behind_logged:  # episodes that flap within the interval are counted, not logged
                self._behind_last_log = now
                self._behind_dropped = dropped
                self._log.warning("tier_falling_behind", backend=self._backend, queue_pages=queued,
                                  queue_capacity_pages=capacity, staging_pages=staged, staging_slots=slots,
                                  effect="offloads ahead of eviction wait; pages evicted meanwhile go to staging, "
                                         "and are lost once it is full")
        elif since is not None and 2 * queued <= capacity and 4 * staged <= slots:
            with c.lock:
                c.behind_since = None
                c.behind_seconds += now - since
            if self._behind_logged:
                self._log.info("tier_caught_up", backend=self._backend, seconds=round(now - since, 3),
                               pages_lost=dropped - self._behind_dropped)

    def staging_refused(self, why: str, dropped: int) -> None:
        """Log staging refusals once per episode (same reason until a capture takes every page again); `why`
        "" when the capture took every page."""
        episode = self._staging_episode
        if why and episode is None:
            self._staging_episode = why
            self._staging_episode_pages = dropped
            slots = self._staging.slots if self._staging is not None else 0
            self._log.warning("tier_staging_refused", reason=why, pages=dropped, slots=slots,
                              effect="evicted pages the tier lacks are lost (counted in evicted_unstored_pages) "
                                     "until staging takes them again")
        elif why:
            self._staging_episode_pages += dropped
        elif episode is not None:
            self._log.info("tier_staging_refusals_ended", reason=episode, pages_lost=self._staging_episode_pages)
            self._staging_episode = None
            self._staging_episode_pages = 0
