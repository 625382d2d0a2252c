"""What the tier's two worker threads share (docs/design.md §8): the parts they call (the store, the page
memory, eviction staging, the link) and count into, their queue, and the way back to the loop.

Everything that touches the core happens on the loop: a worker hands each result to `Handback.deliver`
(`call_soon_threadsafe`), and what runs there finishes the job (counters, the caller's `done`, the waiter's
future) or calls the hooks the service's owner set (`on_lost`, `on_dropped`)."""

from __future__ import annotations

import asyncio
import contextlib
import queue
from collections.abc import Callable, Iterator
from dataclasses import replace
from typing import Any

from cache_service.tier.backend import TierBackend
from cache_service.tier.jobs import Done, LoadJob, LoadResult, LookupJob, OffloadJob, OffloadResult
from cache_service.tier.link import Link
from cache_service.tier.memory import PackedMemory, PageMemory
from cache_service.tier.staging import EvictionStaging
from cache_service.tier.stats import TierCounters


class Handback:
    """The loop's side of the workers' results. `deliver` is called from a worker; the `finish_*` methods and
    `gave_up` run on the loop."""

    def __init__(self, counters: TierCounters, log: Any, pace: Callable[[], None]) -> None:
        self._counters = counters
        self._log = log
        self.pace = pace
        """Called on the loop after the offload queue or staging changed (the falling-behind check)."""
        self.loop: asyncio.AbstractEventLoop | None = None
        self.on_lost: Callable[[list[bytes]], None] | None = None
        self.on_dropped: Callable[[list[bytes]], None] | None = None

    def deliver(self, fn: Callable[..., None], *args: Any) -> None:
        """Run fn(*args) on the loop (from a worker); dropped when the loop is gone (shutdown)."""
        loop = self.loop
        if loop is None:
            return
        with contextlib.suppress(RuntimeError):  # the loop is closed
            loop.call_soon_threadsafe(fn, *args)

    def lost(self, keys: list[bytes]) -> None:
        """Staged pages the tier will never write: to `on_lost`, on the loop."""
        if keys and self.on_lost is not None:
            self.deliver(self.on_lost, keys)

    def dropped(self, keys: list[bytes]) -> None:
        """Values the store dropped (its LRU, unsound values discarded): to `on_dropped`, on the loop."""
        if keys and self.on_dropped is not None:
            self.deliver(self.on_dropped, keys)

    def finish_offload(self, job: OffloadJob, result: OffloadResult) -> None:
        with self._counters.lock:
            self._counters.queue_pages -= len(job.pages)
        self.pace()
        if job.done is not None:
            self._call(job.done, result)

    def finish_load(self, job: LoadJob, result: LoadResult) -> None:
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

    def finish_lookup(self, job: LookupJob, found: list[int]) -> None:
        if not job.gave_up:
            pages, misses = job.count(found)
            with self._counters.lock:
                self._counters.lookup_pages += pages
                self._counters.miss_pages += misses
        if not job.future.done():
            job.future.set_result(found)

    def gave_up(self, job: LoadJob) -> None:
        """The waiter stopped waiting (--tier-timeout): a miss now; the load still finishes later."""
        if job.gave_up or job.future.done():
            return
        job.gave_up = True
        with self._counters.lock:
            self._counters.load_timeouts += 1
            self._counters.miss_pages += len(job.keys)

    def _call(self, fn: Done, result: Any) -> None:
        try:
            fn(result)
        except Exception:
            self._log.exception("tier_callback_failed")


class Worker:
    """A worker's parts: it takes jobs from `queue` (until `jobs.STOP`), calls the store between `link.enter()`
    and `link.leave()`, counts into `counters` and hands results `back`. `batch_pages` bounds one store call;
    `packed`: the memory, where both sides move a batch as one array (else None)."""

    def __init__(self, backend: TierBackend, memory: PageMemory, staging: EvictionStaging | None, link: Link,
                 counters: TierCounters, log: Any, back: Handback, *, batch_pages: int,
                 packed: PackedMemory | None) -> None:
        self.backend = backend
        self.memory = memory
        self.staging = staging
        self.link = link
        self.counters = counters
        self.log = log
        self.back = back
        self.batch_pages = batch_pages
        self.packed = packed
        self.geometry = memory.geometry
        self.queue: queue.SimpleQueue[Any] = queue.SimpleQueue()

    def queued(self) -> Iterator[Any]:
        """Take what is still queued, one job at a time, until the queue is empty (at shutdown)."""
        while True:
            try:
                yield self.queue.get_nowait()
            except queue.Empty:
                return
