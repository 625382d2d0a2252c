"""The tier's counters, as GetStats, metrics and the CLI show them.

`TierCounters` is written by the worker threads and the loop thread under one lock; `snapshot()` is the
frozen `TierStats` everything else reads.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping
from dataclasses import dataclass, field


@dataclass(frozen=True)
class TierStats:
    backend: str = ""
    """"" when there is no tier (--tier none)."""
    up: bool = False
    """The store answered the last call (False while an outage lasts)."""
    hit_pages: int = 0
    """Pages loaded from the tier and handed to a request in time."""
    miss_pages: int = 0
    """Pages looked up in the tier that it could not hand over in time (absent, unsound, failed, late)."""
    lookup_pages: int = 0
    """Keys asked about by lookups (exists)."""
    load_pages: int = 0
    """Pages loaded: read and verified in place, in the leading run of their load (in time or late); a sound
    value after an unsound one is of no use to the prefix and not counted."""
    load_bytes: int = 0
    load_seconds: float = 0.0
    """Wall time of the store's get calls, summed."""
    load_timeouts: int = 0
    """Loads the caller stopped waiting for (--tier-timeout)."""
    offload_pages: int = 0
    """Pages stored (or found already stored)."""
    offload_bytes: int = 0
    offload_seconds: float = 0.0
    """Wall time of staging, checksums and the store's put calls, summed."""
    offload_dropped_pages: int = 0
    """Pages not offloaded because the queue was full or the tier down (eviction never waits)."""
    queue_pages: int = 0
    """Pages waiting to be offloaded now."""
    queue_capacity_pages: int = 0
    load_queue_pages: int = 0
    """Pages of loads waiting for, or in, the store now."""
    tainted_pages: int = 0
    """Pages a failed get may still write into (the owner quarantines them)."""
    errors: Mapping[tuple[str, str], int] = field(default_factory=dict)
    """(operation, reason) -> count; operations: exists, put, get; reasons: backend.py and value.py."""
    outages: int = 0
    """Times the store became unreachable."""
    stored_values: int | None = None
    """Values the tier holds, where it knows (disk); None: unknown (Mooncake)."""
    stored_bytes: int | None = None
    capacity_bytes: int | None = None
    staging_pages: int = 0
    """Pages evicted before the tier stored them that wait in eviction staging for the tier now."""
    staging_capacity_pages: int = 0
    """Eviction staging's slots (--tier-staging-bytes / a value's payload bytes; 0: no staging)."""
    staged_pages: int = 0
    """Pages copied into eviction staging, in all."""
    staging_written_pages: int = 0
    """Staged pages the tier then stored."""
    staging_dropped_pages: int = 0
    """Evicted pages the tier lacked that staging could not take (full, the tier down, stopping): lost."""
    staging_lost_pages: int = 0
    """Staged pages the tier did not store (it failed, or the service stopped first): lost."""
    staging_hit_pages: int = 0
    """Pages loads copied from eviction staging (staged, not written yet)."""
    behind: bool = False
    """The tier is falling behind now: the offload queue full for a second, or eviction staging over half full."""
    behind_episodes: int = 0
    """Times the tier fell behind (each logged once: `tier_falling_behind`, then `tier_caught_up`)."""
    behind_seconds: float = 0.0
    """Seconds spent behind, in all (the episode in progress included)."""
    recovered_values: int = 0
    """Values the store found at start (the disk tier's segments; 0 for Mooncake)."""
    torn_values: int = 0
    """Values found cut short or unsound at start (a crash mid-write): not used, counted."""
    staging_crashed_pages: int = 0
    """Pages eviction staging held when the previous process on this tier died without its drain (a SIGKILL):
    lost, counted at this start (the disk tier keeps the staging ledger in its directory)."""


class TierCounters:
    """Mutable counters behind a lock (two worker threads and the loop write them)."""

    def __init__(self, backend: str, queue_capacity_pages: int, staging_capacity_pages: int = 0) -> None:
        self.lock = threading.Lock()
        self.backend = backend
        self.up = True
        self.hit_pages = 0
        self.miss_pages = 0
        self.lookup_pages = 0
        self.load_pages = 0
        self.load_bytes = 0
        self.load_seconds = 0.0
        self.load_timeouts = 0
        self.offload_pages = 0
        self.offload_bytes = 0
        self.offload_seconds = 0.0
        self.offload_dropped_pages = 0
        self.queue_pages = 0
        self.queue_capacity_pages = queue_capacity_pages
        self.load_queue_pages = 0
        self.tainted_pages = 0
        self.errors: dict[tuple[str, str], int] = {}
        self.outages = 0
        self.staging_capacity_pages = staging_capacity_pages
        self.staged_pages = 0
        self.staging_written_pages = 0
        self.staging_dropped_pages = 0
        self.staging_lost_pages = 0
        self.staging_hit_pages = 0
        self.behind_since: float | None = None
        self.behind_episodes = 0
        self.behind_seconds = 0.0
        self.recovered_values = 0
        self.torn_values = 0
        self.staging_crashed_pages = 0

    def error(self, operation: str, reason: str, n: int = 1) -> None:
        """Count n failures (call with the lock held)."""
        key = (operation, reason)
        self.errors[key] = self.errors.get(key, 0) + n

    def snapshot(self, stored_values: int | None = None, stored_bytes: int | None = None,
                 capacity_bytes: int | None = None, *, staging_pages: int = 0, now: float = 0.0) -> TierStats:
        with self.lock:
            since = self.behind_since
            return TierStats(
                backend=self.backend, up=self.up, hit_pages=self.hit_pages, miss_pages=self.miss_pages,
                lookup_pages=self.lookup_pages, load_pages=self.load_pages, load_bytes=self.load_bytes,
                load_seconds=self.load_seconds, load_timeouts=self.load_timeouts, offload_pages=self.offload_pages,
                offload_bytes=self.offload_bytes, offload_seconds=self.offload_seconds,
                offload_dropped_pages=self.offload_dropped_pages, queue_pages=self.queue_pages,
                queue_capacity_pages=self.queue_capacity_pages, load_queue_pages=self.load_queue_pages,
                tainted_pages=self.tainted_pages, errors=dict(self.errors), outages=self.outages,
                stored_values=stored_values, stored_bytes=stored_bytes, capacity_bytes=capacity_bytes,
                staging_pages=staging_pages, staging_capacity_pages=self.staging_capacity_pages,
                staged_pages=self.staged_pages, staging_written_pages=self.staging_written_pages,
                staging_dropped_pages=self.staging_dropped_pages, staging_lost_pages=self.staging_lost_pages,
                staging_hit_pages=self.staging_hit_pages, behind=since is not None,
                behind_episodes=self.behind_episodes,
                behind_seconds=self.behind_seconds + (max(0.0, now - since) if since is not None else 0.0),
                recovered_values=self.recovered_values, torn_values=self.torn_values,
                staging_crashed_pages=self.staging_crashed_pages)
