"""The tier's link to its store: whether it is reachable, the thread that connects and reconnects it, and the
fault log of the store calls (docs/design.md §8, "Faults").

A store that cannot be reached marks the tier down (logged once, with the outage counted); calls fail fast
(misses, offloads answered "down") while it is down, and the link thread probes it again after a back-off
(0.5 s doubling to 30 s), setting the client up anew after three failed probes. It also makes the first
connection, so start-up never waits for the store. Per-page failures (full, missing, unsound values) are
counted by operation and reason, and logged once per episode (until that operation succeeds again).
"""

from __future__ import annotations

import threading
import time
from collections import Counter
from typing import Any

from cache_service.tier.backend import CLOSED, MISSING, TierBackend
from cache_service.tier.stats import TierCounters

RETRY_MIN_SECONDS = 0.5
RETRY_MAX_SECONDS = 30.0
RECONNECT_AFTER_PROBES = 3

_QUIET = frozenset({MISSING, CLOSED})
"""Counted, never logged: a value evicted between a lookup and its get, or work dropped at shutdown."""


class Link:
    """Whether the store is reachable, and the thread that (re)connects it.

    Workers call the store only between `enter()` (False while the link is down: fail fast) and `leave()`. A
    call that finds the store unreachable reports `down()`; the link thread then probes it after a back-off
    (`retry` seconds, doubling up to `retry_max`), and after `reconnect_after` failed probes sets the client up
    anew, once no worker is inside a store call. The first connection (a backend that starts unconnected,
    like Mooncake, whose setup can block for 90 s against an absent master) happens on the same thread, so
    neither start-up nor the loop ever waits for it."""

    def __init__(self, backend: TierBackend, counters: TierCounters, log: Any, *, retry: float, retry_max: float,
                 reconnect_after: int) -> None:
        self._backend = backend
        self._counters = counters
        self._log = log
        self._retry = retry
        self._retry_max = retry_max
        self._reconnect_after = reconnect_after
        self._cond = threading.Condition()
        self._up = backend.connected
        self._ever_up = self._up
        self._tried = self._up
        """The first connection was attempted (or not needed)."""
        self._inflight = 0
        self._stopping = False
        self._since = time.monotonic()
        self._episodes: set[tuple[str, str]] = set()
        with counters.lock:
            counters.up = self._up

    def enter(self) -> bool:
        with self._cond:
            if not self._up or self._stopping:
                return False
            self._inflight += 1
            return True

    def leave(self) -> None:
        with self._cond:
            self._inflight -= 1
            self._cond.notify_all()

    def stop(self) -> None:
        with self._cond:
            self._stopping = True
            self._cond.notify_all()

    def wait_up(self, timeout: float) -> bool:
        with self._cond:
            return self._cond.wait_for(lambda: self._up or self._stopping, timeout) and self._up

    def wait_tried(self, timeout: float) -> bool:
        """Wait until the first connection attempt ended; True when the store is up."""
        with self._cond:
            self._cond.wait_for(lambda: self._tried or self._stopping, timeout)
            return self._up

    def down(self, operation: str, error: Exception) -> None:
        with self._cond:
            if not self._up:
                return
            self._up = False
            self._since = time.monotonic()
            with self._counters.lock:
                self._counters.up = False
                self._counters.outages += 1
            self._cond.notify_all()
        self._log.warning("tier_unavailable", backend=self._backend.name, operation=operation, error=str(error),
                          effect="misses and dropped offloads until it answers again")

    def run(self) -> None:
        """The link thread: while the store is down, probe / reconnect it with back-off."""
        failed = 0
        delay = self._retry
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._stopping or not self._up)
                if self._stopping:
                    return
            reconnect = not self._backend.connected or failed >= self._reconnect_after
            try:
                if reconnect:
                    with self._cond:  # never tear a client down under a call in progress
                        self._cond.wait_for(lambda: self._stopping or self._inflight == 0)
                        if self._stopping:
                            return
                    self._backend.reconnect()
                self._backend.probe()
            except Exception as e:  # the store's own errors too: the link thread must live on
                first = not self._ever_up and failed == 0
                failed = 0 if reconnect and self._backend.connected else failed + 1
                if first:
                    with self._counters.lock:
                        self._counters.outages += 1
                    self._log.warning("tier_unavailable", backend=self._backend.name, operation="connect",
                                      error=str(e), effect="misses and dropped offloads until it answers")
                else:
                    self._log.debug("tier_probe_failed", error=str(e), reconnect=reconnect)
                with self._cond:
                    self._tried = True
                    self._cond.notify_all()
                    self._cond.wait_for(lambda: self._stopping, delay)
                delay = min(delay * 2, self._retry_max)
                continue
            with self._cond:
                self._up = True
                self._tried = True
                with self._counters.lock:
                    self._counters.up = True
                self._cond.notify_all()
                down_for = time.monotonic() - self._since
            if self._ever_up:
                self._log.info("tier_recovered", backend=self._backend.name, down_seconds=round(down_for, 3),
                               reconnected=reconnect)
            else:
                self._log.info("tier_connected", backend=self._backend.name, seconds=round(down_for, 3))
            self._ever_up = True
            failed = 0
            delay = self._retry

    def note(self, operation: str, failures: Counter[str]) -> None:
        """Count one call's per-page failures; log each (operation, reason) once per episode; a call with no
        failure ends the operation's episodes."""
        started: list[tuple[str, int]] = []
        with self._cond, self._counters.lock:
            for reason, n in failures.items():
                self._counters.error(operation, reason, n)
                if reason not in _QUIET and (operation, reason) not in self._episodes:
                    self._episodes.add((operation, reason))
                    started.append((reason, n))
            ended = [] if failures else [r for (op, r) in self._episodes if op == operation]
            for reason in ended:
                self._episodes.discard((operation, reason))
        for reason, n in started:
            self._log.warning("tier_failures", backend=self._backend.name, operation=operation, reason=reason,
                              pages=n, note="logged once until this operation succeeds again")
        for reason in ended:
            self._log.info("tier_failures_ended", backend=self._backend.name, operation=operation, reason=reason)
