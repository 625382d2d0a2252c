"""The tier's machinery between the asyncio loop that owns the core and the store: queues, worker threads,
completions, timeouts, faults and counters.

Threads: the loop thread calls `offload`, `load(_runs)` and `lookup(_runs)` (they never block); a load
worker runs lookups and loads in order, each `*_runs` call (a Step's ops) as one store call (loads: up to
`batch_pages` pages a call), an offload worker runs offloads, batching whatever is queued (up to
`batch_pages` per store call). Results come back to the loop with `call_soon_threadsafe`, so everything
that touches the core happens on the loop, as the core requires.

Ownership (what the core must keep in its accounting while the store works):
- `offload(items, done)`: every accepted page (a prefix of `items`; the rest are refused at once, counted
  as dropped, and the caller frees them as if there were no tier) is read by the store until `done` runs on
  the loop. The caller must neither free nor hand out those pages until then.
- `load(keys, pages, done)`: the pages are fresh, owned by the load, and readable by nobody until `done`
  runs on the loop (exactly once, even after the waiter gave up) with a `LoadResult`: its first `loaded`
  pages hold the values of the first `loaded` keys, verified; the rest are garbage (free them), except
  `tainted` pages, which a failed transfer may still write (quarantine them). The ticket's `wait()` gives
  the waiter the same result, or None once --tier-timeout has passed (a miss; the pages stay with the load
  until `done`).

Eviction staging (`stage`, with `staging_bytes`): pages the core evicts before the tier stored them are
copied into bounded host memory on the loop (staging.py) and queued like offloads; the offload worker writes
them from there and frees their slots. Until then lookups count them and loads copy them from their slots.
Pages staging cannot take (full, the tier down, the service stopping) and staged pages the store then fails
to write, or that are still unwritten when `close` ends the drain, are lost: counted (`staging_dropped_pages`,
`staging_lost_pages`), reported to `on_lost` on the loop (the core counts them as evicted unstored), and
logged once per episode.

Faults never raise into the loop: a store that cannot be reached marks the tier down (logged once, with
the outage counted), calls fail fast (misses, offloads answered "down") while it is down, and a link thread
probes it again after a back-off (0.5 s doubling to 30 s), setting the client up anew after three failed
probes; it also makes the first connection, so start-up never waits for the store.
Per-page failures (full, missing, unsound values) are counted by operation and reason, and logged once per
episode (until that operation succeeds again). Unsound values are discarded from the store.
"""

from __future__ import annotations

import asyncio
import contextlib
import queue
import threading
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any, cast

import numpy as np

from cache_service.log import get_logger
from cache_service.tier.backend import (
    DOWN,
    ERROR,
    MISSING,
    TAINTED,
    GetItem,
    GetResult,
    PackedBackend,
    PutItem,
    TierBackend,
    TierUnavailable,
)
from cache_service.tier.memory import PackedMemory, PageBuffers, PageMemory
from cache_service.tier.staging import EvictionStaging
from cache_service.tier.stats import TierCounters, TierStats
from cache_service.tier.value import HEADER_BYTES, Geometry, checksum, header, pack_headers, verify, verify_rows

CLOSED = "closed"
"""The service was stopping: the page was not offloaded (or loaded)."""

DEFAULT_BATCH_PAGES = 128
PACKED_MAX_VALUE_BYTES = 64 << 10
"""Values up to this size move as one array a batch: below it the per-chunk objects cost more than a copy."""
BEHIND_FULL_SECONDS = 1.0
"""The offload queue full for this long is falling behind (write-back keeps the queue full while the pool is
under its watermark: full alone is the normal state of a busy tier)."""
BEHIND_LOG_SECONDS = 30.0
"""A falling-behind episode that starts within this long of the last logged one is counted, not logged."""
RETRY_MIN_SECONDS = 0.5
RETRY_MAX_SECONDS = 30.0
RECONNECT_AFTER_PROBES = 3
DROPPED_CHECK_SECONDS = 0.5
"""How often an idle offload worker asks the backend what the store dropped on its own (`take_dropped`)."""


@dataclass(frozen=True)
class OffloadResult:
    keys: tuple[bytes, ...]
    pages: tuple[int, ...]
    reasons: tuple[str, ...]
    """Per page: "" stored (or already there), else why not."""

    @property
    def stored(self) -> list[bool]:
        return [not r for r in self.reasons]


@dataclass(frozen=True)
class LoadResult:
    keys: tuple[bytes, ...]
    pages: tuple[int, ...]
    loaded: int
    """The first `loaded` pages hold the first `loaded` keys' values, verified."""
    reasons: tuple[str, ...]
    """Per page: "" sound, else why not."""
    tainted: tuple[int, ...] = ()
    """Pages a failed transfer may still write into: quarantine them."""
    seconds: float = 0.0
    """Wall time of the load in the worker (staging, the store's get, verification)."""
    late: bool = False
    """The waiter had given up (--tier-timeout) before the load finished."""


Done = Callable[[Any], None]


@dataclass(eq=False)
class _Offload:
    keys: tuple[bytes, ...]
    pages: tuple[int, ...]
    """Pool pages (an offload ahead of eviction), or () for staged pages (`slots`)."""
    done: Done | None
    slots: tuple[int, ...] = ()
    """Eviction staging slots holding the keys' values (staged at eviction; the pages are gone)."""

    @property
    def size(self) -> int:
        return len(self.keys)


@dataclass
class _SlotBatch:
    buffers: list[PageBuffers]

    def finish(self, ok: Sequence[bool]) -> None:
        pass


class _PackedLoad:
    """A load's pages as one `[n, value_bytes]` array: the store reads into it (`get`, with the rows verified
    there), and `finish` scatters the sound rows into their pool pages in one copy. `buffers` are the rows'
    chunks, for what eviction staging copies in."""

    def __init__(self, memory: PackedMemory, pages: Sequence[int], geometry: Geometry) -> None:
        self._memory = memory
        self._pages = list(pages)
        self._geometry = geometry
        n = len(self._pages)
        self.values = np.empty((n, geometry.value_bytes), np.uint8)
        payload = self.values[:, HEADER_BYTES:].reshape(n, geometry.num_chunks, geometry.chunk_bytes)
        self.buffers = _LazyRows(payload)

    def get(self, backend: Any, keys: Sequence[bytes], asked: list[int]) -> list[GetResult]:
        if not asked:
            return []
        whole = len(asked) == len(self._pages)
        rows = self.values if whole else np.ascontiguousarray(self.values[asked])
        mine = [keys[i] for i in asked]
        reasons = backend.get_values(mine, rows)
        checked = verify_rows(rows, mine, self._geometry)
        if not whole:
            self.values[asked] = rows
        return [GetResult(r or c, b"") for r, c in zip(reasons, checked, strict=True)]

    def finish(self, ok: Sequence[bool]) -> None:
        rows = [i for i, good in enumerate(ok) if good]
        if rows:
            self._memory.scatter([self._pages[i] for i in rows], self.values[rows, HEADER_BYTES:])


class _LazyRows:
    """`buffers[i]` of a packed load: a row's chunks, made only for the rows asked (eviction staging's)."""

    def __init__(self, payload: Any) -> None:
        self._payload = payload

    def __len__(self) -> int:
        return len(self._payload)

    def __getitem__(self, i: int) -> PageBuffers:
        return PageBuffers([c.data for c in self._payload[i]], [])

    def __iter__(self) -> Any:
        return (self[i] for i in range(len(self)))


@dataclass(eq=False)
class _Load:
    keys: tuple[bytes, ...]
    pages: tuple[int, ...]
    done: Done | None
    future: asyncio.Future[LoadResult]
    gave_up: bool = False


@dataclass(eq=False)
class _Lookup:
    runs: tuple[tuple[bytes, ...], ...]
    counts: tuple[bool, ...]
    future: asyncio.Future[list[int]]
    gave_up: bool = False

    def count(self, found: Sequence[int]) -> tuple[int, int]:
        """(lookup pages, miss pages) of the counted runs, given what was found."""
        pages = misses = 0
        for run, counted, n in zip(self.runs, self.counts, found, strict=True):
            if counted:
                pages += len(run)
                misses += len(run) - n
        return pages, misses


_STOP = object()


class LoadTicket:
    """A load in progress. `await wait()`: the LoadResult, or None after the timeout (a miss)."""

    def __init__(self, service: TierService, job: _Load, timeout: float) -> None:
        self._service = service
        self._job = job
        self._timeout = timeout

    @property
    def pages(self) -> tuple[int, ...]:
        return self._job.pages

    async def wait(self, timeout: float | None = None) -> LoadResult | None:
        """Wait at most `timeout` seconds (default: the service's --tier-timeout)."""
        job = self._job
        limit = self._timeout if timeout is None else timeout
        if job.future.done():
            return job.future.result()
        try:
            return await asyncio.wait_for(asyncio.shield(job.future), limit)
        except TimeoutError:
            self._service._gave_up(job)
            return None


class _Link:
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


class TierService:
    """One tier (backend + page memory) serving one asyncio loop. `start(loop)`, then the loop-side calls,
    then `close()` (idempotent; blocks while it drains, so call it through `asyncio.to_thread`)."""

    def __init__(self, backend: TierBackend, memory: PageMemory, *, timeout_seconds: float = 1.0,
                 queue_pages: int = 256, batch_pages: int = DEFAULT_BATCH_PAGES,
                 retry_seconds: float = RETRY_MIN_SECONDS, retry_max_seconds: float = RETRY_MAX_SECONDS,
                 reconnect_after: int = RECONNECT_AFTER_PROBES, staging_bytes: int = 0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if queue_pages < 1 or batch_pages < 1:
            raise ValueError("queue_pages and batch_pages must be >= 1")
        self.backend = backend
        self.memory = memory
        ledger = getattr(backend, "staging_ledger_path", None)  # stores with a directory of their own (disk)
        staging = EvictionStaging(memory, staging_bytes, ledger) if staging_bytes > 0 else None
        self.staging = staging if staging is not None and staging.slots else None
        """Where pages evicted before the tier stored them wait for it (None: --tier-staging-bytes 0)."""
        self.on_lost: Callable[[list[bytes]], None] | None = None
        """Called on the loop with the keys of staged pages the tier will never write (the core counts them)."""
        self.on_dropped: Callable[[list[bytes]], None] | None = None
        """Called on the loop with the keys of values the store dropped (its LRU, unsound values discarded)."""
        self._staging_episode: str | None = None
        self._staging_episode_pages = 0
        self.timeout_seconds = timeout_seconds
        self._clock = clock
        self._behind_dropped = 0
        self._behind_logged = False
        self._full_since: float | None = None
        self._behind_last_log: float | None = None
        self.batch_pages = min(batch_pages, memory.max_batch_pages)
        self._geometry = memory.geometry
        self._packed: PackedMemory | None = (memory if isinstance(memory, PackedMemory) and isinstance(
            backend, PackedBackend) and self._geometry.value_bytes <= PACKED_MAX_VALUE_BYTES else None)
        """Where both sides move a batch as one array (host pools, the disk tier, small values): no object per
        chunk. Large values go straight between the pool and the store instead (no copy)."""
        self._log = get_logger("kvcache.tier")
        self._counters = TierCounters(backend.name, queue_pages, self.staging.slots if self.staging else 0)
        c = self._counters
        c.recovered_values = backend.usage().values or 0
        c.torn_values = getattr(backend, "torn_values", 0)  # the disk tier's start; Mooncake cannot tell
        c.staging_crashed_pages = staging.crashed_pages if staging is not None else 0
        if c.torn_values or c.staging_crashed_pages:
            self._log.warning("tier_lost_at_start", backend=backend.name, recovered_values=c.recovered_values,
                              torn_values=c.torn_values, staging_crashed_pages=c.staging_crashed_pages,
                              note="the previous process died mid-write or with pages in eviction staging")
        self._link = _Link(backend, self._counters, self._log, retry=retry_seconds, retry_max=retry_max_seconds,
                           reconnect_after=reconnect_after)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._offloads: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._loads: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._threads: list[threading.Thread] = []
        self._closing = False
        self._closed = False
        self._drain_deadline: float | None = None

    # ------------------------------------------------------------------ lifecycle

    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        """Hand the page memory to the backend (registered now, or at its first connection) and start the
        workers and the link thread, which connects a backend that starts unconnected. Raises TierConfigError
        when the store refuses the memory. Returns at once: `wait_up` waits for the store."""
        self._loop = loop
        self.backend.register(self.memory.regions() + (self.staging.regions() if self.staging else []))
        for name, target in (("kvcache-tier-load", self._load_worker), ("kvcache-tier-offload", self._offload_worker),
                             ("kvcache-tier-link", self._link.run)):
            thread = threading.Thread(target=target, name=name, daemon=True)
            thread.start()
            self._threads.append(thread)

    def close(self, drain_seconds: float = 5.0) -> bool:
        """Stop taking work; let queued offloads finish for at most `drain_seconds` (a restarted service then
        finds them), fail queued loads, stop the workers, close the store and the page mapping. Returns False
        when a worker was still inside a store call at the deadline: the page mapping is then left open (the
        store may still write it) and the process should exit soon."""
        if self._closed:
            return True
        self._closed = True
        self._closing = True
        self._drain_deadline = time.monotonic() + drain_seconds
        self._offloads.put(_STOP)
        self._loads.put(_STOP)
        stopped = True
        for thread in self._threads[:2]:
            thread.join(timeout=max(0.0, drain_seconds) + 1.0)
            stopped = stopped and not thread.is_alive()
        self._link.stop()  # a link thread inside a connect attempt is left to it (daemon)
        if stopped:  # work queued while the workers stopped: nothing touched its pages
            self._fail_queued_loads()
            self._fail_queued_offloads()
        with contextlib.suppress(Exception):
            self.backend.close()
        lost = self._counters.snapshot().staging_lost_pages
        if lost:
            self._log.warning("tier_staging_unwritten", pages=lost,
                              note="pages staged at eviction that the tier never wrote are lost (counted)")
        if stopped:
            if self.staging is not None:
                self.staging.close()
            self.memory.close()
        else:
            self._log.warning("tier_close_timeout", note="a store call is still running; the pool mapping stays")
        return stopped

    # ------------------------------------------------------------------ loop side

    def wait_up(self, timeout: float) -> bool:
        """Block up to `timeout` seconds until the store answers (not on the loop)."""
        return self._link.wait_up(timeout)

    def wait_first_connection(self, timeout: float) -> bool:
        """Block up to `timeout` seconds until the first connection attempt ended (start-up's banner then says
        whether the store answered); True when it is up. Not on the loop."""
        return self._link.wait_tried(timeout)

    def stats(self) -> TierStats:
        usage = self.backend.usage()
        return self._counters.snapshot(usage.values, usage.bytes, usage.capacity_bytes,
                                       staging_pages=self.staging.used if self.staging is not None else 0,
                                       now=self._clock())

    def _check_pace(self) -> None:
        """On the loop, after the offload queue or staging changed: start or end a falling-behind episode. It
        starts when the queue has been full for BEHIND_FULL_SECONDS or staging is more than half full, and ends
        once the queue is at most half full and staging at most a quarter; one warning at its start, one line
        at its end."""
        c = self._counters
        staged = self.staging.used if self.staging is not None else 0
        slots = self.staging.slots if self.staging is not None else 0
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
                self._log.warning("tier_falling_behind", backend=self.backend.name, queue_pages=queued,
                                  queue_capacity_pages=capacity, staging_pages=staged, staging_slots=slots,
                                  effect="offloads ahead of eviction wait; pages evicted meanwhile go to staging, "
                                         "and are lost once it is full")
        elif since is not None and 2 * queued <= capacity and 4 * staged <= slots:
            with c.lock:
                c.behind_since = None
                c.behind_seconds += now - since
            if self._behind_logged:
                self._log.info("tier_caught_up", backend=self.backend.name, seconds=round(now - since, 3),
                               pages_lost=dropped - self._behind_dropped)

    def stage(self, keys: list[bytes], pages: Any) -> int:
        """Eviction staging, on the loop, inside the core call that evicts `pages` (the tier lacks them): copy
        what fits into staging now, queue it for the store, and return how many leading pages are staged. The
        rest are lost (the caller counts them): staging is full or off, the tier is down, or stopping. One log
        line per episode of refusals, one when it ends."""
        n = len(keys)
        why = ("off" if self.staging is None else "stopping" if self._closing else
               "tier down" if not self._counters.up else "")
        staged = 0
        if not why:
            assert self.staging is not None
            try:
                staged, taken = self.staging.capture(keys, [int(p) for p in pages])
            except Exception as e:  # a copy that failed loses the pages, never the call
                self._log.warning("tier_staging_failed", operation="capture", error=str(e))
                staged, taken, why = 0, [], "copy failed"
            if taken:
                with self._counters.lock:
                    self._counters.staged_pages += len(taken)
                self._offloads.put(_Offload(tuple(k for k, _ in taken), (), None, tuple(s for _, s in taken)))
            if staged < n and not why:
                why = "full"
        if staged < n:
            with self._counters.lock:
                self._counters.staging_dropped_pages += n - staged
        if why == "off":
            return 0
        self._staging_note(why, n - staged)
        self._check_pace()
        return staged

    def _staging_note(self, why: str, dropped: int) -> None:
        """Log staging refusals once per episode (same reason until a capture takes every page again)."""
        episode = self._staging_episode
        if why and episode is None:
            self._staging_episode = why
            self._staging_episode_pages = dropped
            slots = self.staging.slots if self.staging is not None else 0
            self._log.warning("tier_staging_refused", reason=why, pages=dropped, slots=slots,
                              effect="evicted pages the tier lacks are lost (counted in evicted_unstored_pages) "
                                     "until staging takes them again")
        elif why:
            self._staging_episode_pages += dropped
        elif episode is not None:
            self._log.info("tier_staging_refusals_ended", reason=episode, pages_lost=self._staging_episode_pages)
            self._staging_episode = None
            self._staging_episode_pages = 0

    @property
    def up(self) -> bool:
        return self._counters.up

    @property
    def offload_room(self) -> int:
        """Pages the offload queue takes now (0 while closing)."""
        c = self._counters
        with c.lock:
            return 0 if self._closing else max(0, c.queue_capacity_pages - c.queue_pages)

    def offload(self, items: Sequence[tuple[bytes, int]], done: Done | None = None) -> int:
        """Queue (key, page) pairs for storing; returns how many leading pairs were accepted. The rest are
        not offloaded (queue full or closing; counted as dropped). `done(OffloadResult)` runs on the loop once
        the store is finished with the accepted pages. While the tier is down, accepted pages come back at
        once with reason "down" (the worker probes the store when its back-off allows)."""
        c = self._counters
        with c.lock:
            room = 0 if self._closing else c.queue_capacity_pages - c.queue_pages
            accepted = max(0, min(len(items), room))
            c.queue_pages += accepted
            c.offload_dropped_pages += len(items) - accepted
        if accepted:
            keys = tuple(k for k, _ in items[:accepted])
            pages = tuple(p for _, p in items[:accepted])
            self._offloads.put(_Offload(keys, pages, done))
        self._check_pace()
        return accepted

    def load(self, keys: Sequence[bytes], pages: Sequence[int], done: Done | None = None) -> LoadTicket:
        """Read the values of `keys` into `pages` (fresh pages the caller owns, one per key, readable by
        nobody until `done(LoadResult)` runs on the loop). Returns a ticket to wait on."""
        return self.load_runs([(keys, pages, done)])[0]

    def load_runs(self, runs: Sequence[tuple[Sequence[bytes], Sequence[int], Done | None]]) -> list[LoadTicket]:
        """`load` for several runs (a Step's appends) at once: their store calls are batched together (up to
        the batch size in pages), each run keeps its own result, `done` and ticket."""
        loop = self._require_loop()
        jobs: list[_Load] = []
        for keys, pages, done in runs:
            if len(keys) != len(pages):
                raise ValueError(f"{len(keys)} keys for {len(pages)} pages")
            jobs.append(_Load(tuple(keys), tuple(int(p) for p in pages), done, loop.create_future()))
        with self._counters.lock:
            self._counters.load_queue_pages += sum(len(job.keys) for job in jobs)
        if self._closing:  # `done` still runs later on the loop, never inside this call
            for job in jobs:
                loop.call_soon(self._finish_load, job, self._unloaded(job, CLOSED))
        elif jobs:
            self._loads.put(jobs)
        return [LoadTicket(self, job, self.timeout_seconds) for job in jobs]

    async def lookup(self, keys: Sequence[bytes], *, count: bool = True, timeout: float | None = None) -> int:
        """How many leading keys the tier holds (0 when it is down, slow past the timeout, or closing).
        `count`: add the keys it does not hold to the miss counter (False for read-only probes)."""
        return (await self.lookup_runs([keys], [count], timeout=timeout))[0]

    async def lookup_runs(self, runs: Sequence[Sequence[bytes]], counts: Sequence[bool], *,
                          timeout: float | None = None) -> list[int]:
        """`lookup` for several runs of keys (a Step's appends and matches) in one store call; `counts[i]`:
        whether run i's keys count as lookups and misses."""
        if len(runs) != len(counts):
            raise ValueError(f"{len(runs)} runs for {len(counts)} count flags")
        if not any(runs):
            return [0] * len(runs)
        loop = self._require_loop()
        job = _Lookup(tuple(tuple(run) for run in runs), tuple(counts), loop.create_future())
        if self._closing:
            self._finish_lookup(job, [0] * len(runs))
        else:
            self._loads.put(job)
        limit = self.timeout_seconds if timeout is None else timeout
        try:
            return await asyncio.wait_for(asyncio.shield(job.future), limit)
        except TimeoutError:
            job.gave_up = True
            pages, misses = job.count([0] * len(runs))
            with self._counters.lock:
                self._counters.lookup_pages += pages
                self._counters.miss_pages += misses
                self._counters.error("exists", "timeout")
            return [0] * len(runs)

    def _require_loop(self) -> asyncio.AbstractEventLoop:
        if self._loop is None:
            raise RuntimeError("TierService.start(loop) first")
        return self._loop

    def _gave_up(self, job: _Load) -> None:
        if job.gave_up or job.future.done():
            return
        job.gave_up = True
        with self._counters.lock:
            self._counters.load_timeouts += 1
            self._counters.miss_pages += len(job.keys)

    def _deliver(self, fn: Callable[..., None], *args: Any) -> None:
        """Run fn(*args) on the loop (from a worker); dropped when the loop is gone (shutdown)."""
        loop = self._loop
        if loop is None:
            return
        with contextlib.suppress(RuntimeError):  # the loop is closed
            loop.call_soon_threadsafe(fn, *args)

    def _finish_offload(self, job: _Offload, result: OffloadResult) -> None:
        with self._counters.lock:
            self._counters.queue_pages -= len(job.pages)
        self._check_pace()
        if job.done is not None:
            self._call(job.done, result)

    def _finish_load(self, job: _Load, result: LoadResult) -> None:
        c = self._counters
        with c.lock:
            c.load_queue_pages -= len(job.pages)
            c.tainted_pages += len(result.tainted)
            if not job.gave_up:
                c.hit_pages += result.loaded
                c.miss_pages += len(job.keys) - result.loaded
        result = replace(result, late=job.gave_up)
        if job.done is not None:
            self._call(job.done, result)
        if not job.future.done():
            job.future.set_result(result)

    def _finish_lookup(self, job: _Lookup, found: list[int]) -> None:
        if not job.gave_up:
            pages, misses = job.count(found)
            with self._counters.lock:
                self._counters.lookup_pages += pages
                self._counters.miss_pages += misses
        if not job.future.done():
            job.future.set_result(found)

    def _call(self, fn: Done, result: Any) -> None:
        try:
            fn(result)
        except Exception:
            self._log.exception("tier_callback_failed")

    # ------------------------------------------------------------------ workers

    def _offload_worker(self) -> None:
        while True:
            try:
                job = self._offloads.get(timeout=DROPPED_CHECK_SECONDS)
            except queue.Empty:  # idle: what the store dropped on its own still reaches KV events
                self._check_dropped()
                continue
            if job is _STOP:
                return
            jobs = [job]
            n = job.size
            stop = False
            while n < self.batch_pages:
                try:
                    more = self._offloads.get_nowait()
                except queue.Empty:
                    break
                if more is _STOP:
                    stop = True
                    break
                jobs.append(more)
                n += more.size
            staged = [j for j in jobs if j.slots]
            if staged:  # first: their slots are what keeps the next eviction from losing pages
                self._run_staged(staged)
            self._run_offloads([j for j in jobs if not j.slots])
            if stop:
                return

    def _run_offloads(self, jobs: list[_Offload]) -> None:
        keys = [k for j in jobs for k in j.keys]
        pages = [p for j in jobs for p in j.pages]
        reasons: list[str] = []
        for start in range(0, len(keys), self.batch_pages):
            reasons += self._put(keys[start:start + self.batch_pages], pages[start:start + self.batch_pages])
        at = 0
        for job in jobs:
            n = len(job.pages)
            self._deliver(self._finish_offload, job, OffloadResult(job.keys, job.pages, tuple(reasons[at:at + n])))
            at += n

    def _run_staged(self, jobs: list[_Offload]) -> None:
        """Write staged pages from their slots, then free the slots; the ones not written are lost."""
        keys = [k for j in jobs for k in j.keys]
        slots = [s for j in jobs for s in j.slots]
        reasons: list[str] = []
        for start in range(0, len(keys), self.batch_pages):
            reasons += self._put(keys[start:start + self.batch_pages], [], slots[start:start + self.batch_pages])
        self._staged_done(keys, reasons)

    def _staged_done(self, keys: list[bytes], reasons: Sequence[str]) -> None:
        assert self.staging is not None, "staged work exists only with staging"
        self.staging.release(keys)
        lost = [k for k, r in zip(keys, reasons, strict=True) if r]
        with self._counters.lock:
            self._counters.staging_written_pages += len(keys) - len(lost)
            self._counters.staging_lost_pages += len(lost)
        if lost and self.on_lost is not None:
            self._deliver(self.on_lost, lost)
        self._deliver(self._check_pace)  # staging drained: an episode may end

    def _past_drain(self) -> bool:
        return self._drain_deadline is not None and time.monotonic() > self._drain_deadline

    def _put(self, keys: list[bytes], pages: list[int], slots: Sequence[int] = ()) -> list[str]:
        """Store keys' values from pool `pages`, or from eviction staging `slots` (then `pages` is empty)."""
        n = len(keys)
        if self._past_drain():
            if not slots:
                with self._counters.lock:
                    self._counters.offload_dropped_pages += n
            return [CLOSED] * n
        if not self._link.enter():
            self._link.note("put", Counter({DOWN: n}))
            return [DOWN] * n
        started = time.perf_counter()
        geometry = self._geometry
        try:
            if self._packed is not None and not slots:
                reasons = self._put_packed(self._packed, keys, pages)
            else:
                try:
                    staging = (_SlotBatch([self.staging.buffers(s) for s in slots])
                               if slots and self.staging is not None else self.memory.stage_out(pages))
                except Exception as e:
                    self._log.warning("tier_staging_failed", operation="put", error=str(e))
                    self._link.note("put", Counter({ERROR: n}))
                    return [ERROR] * n
                try:
                    items = [PutItem(k, header(k, geometry, checksum(b.views)), b)
                             for k, b in zip(keys, staging.buffers, strict=True)]
                    reasons = self.backend.put(items)
                except TierUnavailable as e:
                    self._link.down("put", e)
                    reasons = [DOWN] * n
                except Exception as e:
                    self._log.warning("tier_put_failed", error=repr(e))
                    reasons = [ERROR] * n
                finally:
                    staging.finish([True] * n)
        finally:
            self._link.leave()
        seconds = time.perf_counter() - started
        stored = reasons.count("")
        with self._counters.lock:
            c = self._counters
            c.offload_pages += stored
            c.offload_bytes += stored * geometry.value_bytes
            c.offload_seconds += seconds
        self._link.note("put", Counter(r for r in reasons if r))
        self._report_dropped()
        return reasons

    def _check_dropped(self) -> None:
        """`_report_dropped` while the store is up (a backend that must ask the store asks it then)."""
        if not self._link.enter():
            return
        try:
            self._report_dropped()
        except Exception as e:  # the link thread notices a store that is gone; this check waits for it
            self._log.debug("tier_dropped_check_failed", error=str(e))
        finally:
            self._link.leave()

    def _put_packed(self, packed: PackedMemory, keys: list[bytes], pages: list[int]) -> list[str]:
        """The batch as one `[n, value_bytes]` array: the pages gathered in one copy, the headers and CRCs
        computed over it, the store's `put_values` (one write a run of the segment)."""
        n = len(keys)
        try:
            values = np.empty((n, self._geometry.value_bytes), np.uint8)
            packed.gather(pages, values[:, HEADER_BYTES:])
            pack_headers(values, keys, self._geometry)
        except Exception as e:
            self._log.warning("tier_staging_failed", operation="put", error=str(e))
            return [ERROR] * n
        try:
            return cast(PackedBackend, self.backend).put_values(keys, values)
        except TierUnavailable as e:
            self._link.down("put", e)
            return [DOWN] * n
        except Exception as e:
            self._log.warning("tier_put_failed", error=repr(e))
            return [ERROR] * n

    def _report_dropped(self) -> None:
        """Hand the keys the store dropped since the last report to `on_dropped` (on the loop)."""
        dropped = self.backend.take_dropped()
        if dropped and self.on_dropped is not None:
            self._deliver(self.on_dropped, dropped)

    def _load_worker(self) -> None:
        while True:
            job = self._loads.get()
            if job is _STOP:
                self._fail_queued_loads()
                return
            if isinstance(job, _Lookup):
                self._deliver(self._finish_lookup, job, self._exists(job.runs))
            else:
                for batch in self._batches(job):
                    for load, result in zip(batch, self._get(batch), strict=True):
                        self._deliver(self._finish_load, load, result)

    def _batches(self, jobs: list[_Load]) -> list[list[_Load]]:
        """Consecutive loads grouped into store calls of at most `batch_pages` pages (a bigger load alone)."""
        batches: list[list[_Load]] = []
        pages = 0
        for job in jobs:
            if batches and pages + len(job.keys) <= self.batch_pages:
                batches[-1].append(job)
                pages += len(job.keys)
            else:
                batches.append([job])
                pages = len(job.keys)
        return batches

    def _fail_queued_loads(self) -> None:
        while True:
            try:
                job = self._loads.get_nowait()
            except queue.Empty:
                return
            if isinstance(job, _Lookup):
                self._deliver(self._finish_lookup, job, [0] * len(job.runs))
            elif isinstance(job, list):
                for load in job:
                    self._deliver(self._finish_load, load, self._unloaded(load, CLOSED))

    def _fail_queued_offloads(self) -> None:
        while True:
            try:
                job = self._offloads.get_nowait()
            except queue.Empty:
                return
            if isinstance(job, _Offload) and job.slots:
                self._staged_done(list(job.keys), [CLOSED] * job.size)
            elif isinstance(job, _Offload):
                with self._counters.lock:
                    self._counters.offload_dropped_pages += len(job.pages)
                self._deliver(self._finish_offload, job,
                              OffloadResult(job.keys, job.pages, (CLOSED,) * len(job.pages)))

    def _exists(self, runs: tuple[tuple[bytes, ...], ...]) -> list[int]:
        """Leading keys of each run that staging or the store holds (the store asked once, for the rest)."""
        staging = self.staging
        if staging is None or self._closing:
            return self._store_exists(runs)
        held = [[staging.holds(k) for k in run] for run in runs]
        asks = tuple(tuple(k for k, h in zip(run, hs, strict=True) if not h) for run, hs in zip(runs, held,
                                                                                              strict=True))
        stored = self._store_exists(asks) if any(asks) else [0] * len(runs)
        out: list[int] = []
        for hs, n in zip(held, stored, strict=True):
            count = 0
            for h in hs:
                if not h:
                    if n == 0:
                        break
                    n -= 1
                count += 1
            out.append(count)
        return out

    def _store_exists(self, runs: tuple[tuple[bytes, ...], ...]) -> list[int]:
        none = [0] * len(runs)
        if self._closing:
            return none
        if not self._link.enter():
            self._link.note("exists", Counter({DOWN: 1}))
            return none
        try:
            found = self.backend.exists(runs)
        except TierUnavailable as e:
            self._link.down("exists", e)
            self._link.note("exists", Counter({DOWN: 1}))
            return none
        except Exception as e:
            self._log.warning("tier_exists_failed", error=repr(e))
            self._link.note("exists", Counter({ERROR: 1}))
            return none
        finally:
            self._link.leave()
        if len(found) != len(runs):
            self._log.warning("tier_exists_failed", error=f"{len(found)} answers for {len(runs)} runs")
            self._link.note("exists", Counter({ERROR: 1}))
            return none
        self._link.note("exists", Counter())
        return [min(n, len(run)) for n, run in zip(found, runs, strict=True)]

    @staticmethod
    def _unloaded(job: _Load, reason: str) -> LoadResult:
        return LoadResult(job.keys, job.pages, 0, (reason,) * len(job.keys))

    def _get(self, jobs: list[_Load]) -> list[LoadResult]:
        """One store call for `jobs` (one load each, a Step's appends together); a result per job."""
        n = sum(len(job.keys) for job in jobs)
        if self._closing:
            return [self._unloaded(job, CLOSED) for job in jobs]
        if not self._link.enter():
            self._link.note("get", Counter({DOWN: n}))
            return [self._unloaded(job, DOWN) for job in jobs]
        try:
            return self._get_entered(jobs)
        finally:
            self._link.leave()

    def _get_entered(self, jobs: list[_Load]) -> list[LoadResult]:
        keys = [key for job in jobs for key in job.keys]
        pages = [page for job in jobs for page in job.pages]
        n = len(keys)
        started = time.perf_counter()
        reasons: list[str] = []
        staging: Any
        if self._packed is not None:
            staging = _PackedLoad(self._packed, pages, self._geometry)
        else:
            try:
                staging = self.memory.stage_in(pages)
            except Exception as e:
                self._log.warning("tier_staging_failed", operation="get", error=str(e))
                self._link.note("get", Counter({ERROR: n}))
                return [self._unloaded(job, ERROR) for job in jobs]
        ok: list[bool] = [False] * n
        staged = self.staging
        local = [False] * n
        if staged is not None and staged.used:
            for i, k in enumerate(keys):
                local[i] = staged.holds(k) and staged.read_into(k, staging.buffers[i])
        try:
            asked = [i for i in range(n) if not local[i]]
            try:
                if isinstance(staging, _PackedLoad):
                    got = staging.get(self.backend, keys, asked)
                else:
                    got = self.backend.get([GetItem(keys[i], staging.buffers[i]) for i in asked]) if asked else []
            except TierUnavailable as e:
                self._link.down("get", e)
                got = [GetResult(DOWN, b"")] * len(asked)
            results: list[GetResult | None] = [None] * n
            for i, answer in zip(asked, got, strict=False):
                results[i] = answer
            for i, key in enumerate(keys):
                res = results[i]
                if local[i]:
                    reason = ""  # our own copy of the evicted page, made on the loop
                elif res is None:
                    break  # a store that answered fewer items than asked
                elif isinstance(staging, _PackedLoad):
                    reason = res.reason  # verified by rows in `get`
                else:
                    reason = res.reason or verify(res.header, key, self._geometry, staging.buffers[i].views)
                reasons.append(reason)
                ok[i] = not reason
        except Exception as e:
            self._log.warning("tier_get_failed", error=repr(e))
            reasons = [TAINTED] * n  # unknown: the store may still be writing
            ok = [False] * n
        reasons += [ERROR] * (n - len(reasons))  # a store that answered fewer items than asked
        loaded: list[int] = []  # per job: its leading sound values
        visible: list[bool] = []
        start = 0
        for job in jobs:
            size = len(job.keys)
            count = 0
            while count < size and ok[start + count]:
                count += 1
            loaded.append(count)
            visible += [i < count for i in range(size)]
            start += size
        try:
            staging.finish(visible)
        except Exception as e:
            self._log.warning("tier_staging_failed", operation="get", error=str(e))
            loaded = [0] * len(jobs)
        seconds = time.perf_counter() - started
        unsound = [k for k, r in zip(keys, reasons, strict=True) if r in _UNSOUND]
        if unsound:
            with contextlib.suppress(Exception):
                self.backend.discard(unsound)
            if self.on_dropped is not None:
                self._deliver(self.on_dropped, unsound)
        with self._counters.lock:
            c = self._counters
            c.load_pages += sum(loaded)
            c.load_bytes += sum(loaded) * self._geometry.value_bytes
            c.load_seconds += seconds
            c.staging_hit_pages += sum(local)
        self._link.note("get", Counter(r for r in reasons if r))
        out: list[LoadResult] = []
        start = 0
        for job, count in zip(jobs, loaded, strict=True):
            mine = tuple(reasons[start:start + len(job.keys)])
            tainted = tuple(p for p, r in zip(job.pages, mine, strict=True) if r == TAINTED)
            out.append(LoadResult(job.keys, job.pages, count, mine, tainted, seconds))
            start += len(job.keys)
        return out


_QUIET = frozenset({MISSING, CLOSED})
"""Counted, never logged: a value evicted between a lookup and its get, or work dropped at shutdown."""

_UNSOUND = frozenset({"bad_header", "wrong_key", "wrong_size", "bad_checksum", "short"})
