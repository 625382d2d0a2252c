"""TierService: the tier as the asyncio loop that owns the core sees it (docs/design.md §8). It takes work
on the loop, never blocking, and hands it to three threads: the load worker (load.py: lookups and loads, in
order), the offload worker (offload.py: offloads and staged pages, batched) and the link (link.py: connects
the store, probes it while it is down, logs faults once an episode). Results come back to the loop
(worker.py's `Handback`, through `call_soon_threadsafe`), so everything that touches the core happens there.

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
- `stage(keys, pages)` (eviction staging, with `staging_bytes`): pages the core evicts before the tier stored
  them are copied into bounded host memory on the loop (staging.py) and queued like offloads; until written
  lookups count them and loads copy them from their slots. Pages staging cannot take, and staged pages never
  written, are lost: counted, reported to `on_lost` on the loop, logged once an episode (pressure.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

from cache_service.log import get_logger
from cache_service.tier.backend import CLOSED, PackedBackend, TierBackend
from cache_service.tier.jobs import STOP, Done, LoadJob, LoadTicket, LookupJob, OffloadJob
from cache_service.tier.link import RECONNECT_AFTER_PROBES, RETRY_MAX_SECONDS, RETRY_MIN_SECONDS, Link
from cache_service.tier.load import LoadWorker
from cache_service.tier.memory import PackedMemory, PageMemory
from cache_service.tier.offload import OffloadWorker
from cache_service.tier.pressure import Pressure
from cache_service.tier.staging import EvictionStaging
from cache_service.tier.stats import TierCounters, TierStats
from cache_service.tier.worker import Handback

DEFAULT_BATCH_PAGES = 128
PACKED_MAX_VALUE_BYTES = 64 << 10
"""Values up to this size move as one array a batch: below it the per-chunk objects cost more than a copy."""


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
        self.timeout_seconds = timeout_seconds
        self._clock = clock
        self.batch_pages = min(batch_pages, memory.max_batch_pages)
        packed: PackedMemory | None = (memory if isinstance(memory, PackedMemory) and isinstance(
            backend, PackedBackend) and memory.geometry.value_bytes <= PACKED_MAX_VALUE_BYTES else None)
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
        self._link = Link(backend, c, self._log, retry=retry_seconds, retry_max=retry_max_seconds,
                          reconnect_after=reconnect_after)
        self._pressure = Pressure(backend.name, c, self.staging, self._log, clock)
        self._back = Handback(c, self._log, self._pressure.check)
        parts = (backend, memory, self.staging, self._link, c, self._log, self._back)
        self._offloader = OffloadWorker(*parts, batch_pages=self.batch_pages, packed=packed)
        self._loader = LoadWorker(*parts, batch_pages=self.batch_pages, packed=packed)
        self._threads: list[threading.Thread] = []
        self._closing = False
        self._closed = False

    @property
    def on_lost(self) -> Callable[[list[bytes]], None] | None:
        """Called on the loop with the keys of staged pages the tier will never write (the core counts them)."""
        return self._back.on_lost

    @on_lost.setter
    def on_lost(self, fn: Callable[[list[bytes]], None] | None) -> None:
        self._back.on_lost = fn

    @property
    def on_dropped(self) -> Callable[[list[bytes]], None] | None:
        """Called on the loop with the keys of values the store dropped (its LRU, unsound values discarded)."""
        return self._back.on_dropped

    @on_dropped.setter
    def on_dropped(self, fn: Callable[[list[bytes]], None] | None) -> None:
        self._back.on_dropped = fn

    # ------------------------------------------------------------------ lifecycle

    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        """Hand the page memory to the backend (registered now, or at its first connection) and start the
        workers and the link thread, which connects a backend that starts unconnected. Raises TierConfigError
        when the store refuses the memory. Returns at once: `wait_up` waits for the store."""
        self._back.loop = loop
        self.backend.register(self.memory.regions() + (self.staging.regions() if self.staging else []))
        for name, target in (("kvcache-tier-load", self._loader.run), ("kvcache-tier-offload", self._offloader.run),
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
        self._closing = self._loader.closing = True
        self._offloader.drain_deadline = time.monotonic() + drain_seconds
        self._offloader.queue.put(STOP)
        self._loader.queue.put(STOP)
        stopped = True
        for thread in self._threads[:2]:
            thread.join(timeout=max(0.0, drain_seconds) + 1.0)
            stopped = stopped and not thread.is_alive()
        self._link.stop()  # a link thread inside a connect attempt is left to it (daemon)
        if stopped:  # work queued while the workers stopped: nothing touched its pages
            self._loader.fail_queued()
            self._offloader.fail_queued()
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
                self._offloader.queue.put(OffloadJob(tuple(k for k, _ in taken), (), None,
                                                     tuple(s for _, s in taken)))
            if staged < n and not why:
                why = "full"
        if staged < n:
            with self._counters.lock:
                self._counters.staging_dropped_pages += n - staged
        if why == "off":
            return 0
        self._pressure.staging_refused(why, n - staged)
        self._pressure.check()
        return staged

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
            self._offloader.queue.put(OffloadJob(keys, pages, done))
        self._pressure.check()
        return accepted

    def load(self, keys: Sequence[bytes], pages: Sequence[int], done: Done | None = None) -> LoadTicket:
        """Read the values of `keys` into `pages` (fresh pages the caller owns, one per key, readable by
        nobody until `done(LoadResult)` runs on the loop). Returns a ticket to wait on."""
        return self.load_runs([(keys, pages, done)])[0]

    def load_runs(self, runs: Sequence[tuple[Sequence[bytes], Sequence[int], Done | None]]) -> list[LoadTicket]:
        """`load` for several runs (a Step's appends) at once: their store calls are batched together (up to
        the batch size in pages), each run keeps its own result, `done` and ticket."""
        loop = self._require_loop()
        jobs: list[LoadJob] = []
        for keys, pages, done in runs:
            if len(keys) != len(pages):
                raise ValueError(f"{len(keys)} keys for {len(pages)} pages")
            jobs.append(LoadJob(tuple(keys), tuple(int(p) for p in pages), done, loop.create_future()))
        with self._counters.lock:
            self._counters.load_queue_pages += sum(len(job.keys) for job in jobs)
        if self._closing:  # `done` still runs later on the loop, never inside this call
            for job in jobs:
                loop.call_soon(self._back.finish_load, job, job.unloaded(CLOSED))
        elif jobs:
            self._loader.queue.put(jobs)
        return [LoadTicket(job, self.timeout_seconds, self._back.gave_up) for job in jobs]

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
        job = LookupJob(tuple(tuple(run) for run in runs), tuple(counts), loop.create_future())
        if self._closing:
            self._back.finish_lookup(job, [0] * len(runs))
        else:
            self._loader.queue.put(job)
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
        if self._back.loop is None:
            raise RuntimeError("TierService.start(loop) first")
        return self._back.loop
