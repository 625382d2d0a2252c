"""The offload worker (docs/design.md §8): writes queued pages to the store, batching whatever is queued (up to
`batch_pages` per store call). Staged pages go first, from their eviction staging slots, which are freed once
written; what the store fails to write from there is lost (counted, and handed to `on_lost`)."""

from __future__ import annotations

import queue
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from typing import cast

import numpy as np

from cache_service.tier.backend import CLOSED, DOWN, ERROR, PackedBackend, PutItem, TierUnavailable
from cache_service.tier.jobs import STOP, OffloadJob, OffloadResult
from cache_service.tier.memory import PackedMemory, PageBuffers
from cache_service.tier.value import HEADER_BYTES, checksum, covered_chunks, header, pack_headers
from cache_service.tier.worker import Worker

DROPPED_CHECK_SECONDS = 0.5
"""How often an idle offload worker asks the backend what the store dropped on its own (`take_dropped`)."""


@dataclass
class _SlotBatch:
    buffers: list[PageBuffers]

    def finish(self, ok: Sequence[bool]) -> None:
        pass


class OffloadWorker(Worker):
    drain_deadline: float | None = None
    """Set by `close`: past it, what is still queued is not written (CLOSED)."""

    def run(self) -> None:
        """The thread: take jobs until STOP, merging queued ones into one batch."""
        while True:
            try:
                job = self.queue.get(timeout=DROPPED_CHECK_SECONDS)
            except queue.Empty:  # idle: what the store dropped on its own still reaches KV events
                self._check_dropped()
                continue
            if job is STOP:
                return
            jobs = [job]
            n = job.size
            stop = False
            while n < self.batch_pages:
                try:
                    more = self.queue.get_nowait()
                except queue.Empty:
                    break
                if more is STOP:
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

    def fail_queued(self) -> None:
        """What is still queued once the thread stopped: answered CLOSED (staged pages are lost)."""
        for job in self.queued():
            if isinstance(job, OffloadJob) and job.slots:
                self._staged_done(list(job.keys), [CLOSED] * job.size)
            elif isinstance(job, OffloadJob):
                with self.counters.lock:
                    self.counters.offload_dropped_pages += len(job.pages)
                self.back.deliver(self.back.finish_offload, job,
                                  OffloadResult(job.keys, job.pages, (CLOSED,) * len(job.pages)))

    def _run_offloads(self, jobs: list[OffloadJob]) -> None:
        keys = [k for j in jobs for k in j.keys]
        pages = [p for j in jobs for p in j.pages]
        reasons: list[str] = []
        for start in range(0, len(keys), self.batch_pages):
            reasons += self._put(keys[start:start + self.batch_pages], pages[start:start + self.batch_pages])
        at = 0
        for job in jobs:
            n = len(job.pages)
            self.back.deliver(self.back.finish_offload, job,
                              OffloadResult(job.keys, job.pages, tuple(reasons[at:at + n])))
            at += n

    def _run_staged(self, jobs: list[OffloadJob]) -> None:
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
        with self.counters.lock:
            self.counters.staging_written_pages += len(keys) - len(lost)
            self.counters.staging_lost_pages += len(lost)
        self.back.lost(lost)
        self.back.deliver(self.back.pace)  # staging drained: an episode may end

    def _past_drain(self) -> bool:
        return self.drain_deadline is not None and time.monotonic() > self.drain_deadline

    def _put(self, keys: list[bytes], pages: list[int], slots: Sequence[int] = ()) -> list[str]:
        """Store keys' values from pool `pages`, or from eviction staging `slots` (then `pages` is empty)."""
        n = len(keys)
        if self._past_drain():
            if not slots:
                with self.counters.lock:
                    self.counters.offload_dropped_pages += n
            return [CLOSED] * n
        if not self.link.enter():
            self.link.note("put", Counter({DOWN: n}))
            return [DOWN] * n
        started = time.perf_counter()
        geometry = self.geometry
        try:
            if self.packed is not None and not slots:
                reasons = self._put_packed(self.packed, keys, pages)
            else:
                try:
                    staging = (_SlotBatch([self.staging.buffers(s) for s in slots])
                               if slots and self.staging is not None else self.memory.stage_out(pages))
                except Exception as e:
                    self.log.warning("tier_staging_failed", operation="put", error=str(e))
                    self.link.note("put", Counter({ERROR: n}))
                    return [ERROR] * n
                try:
                    items = [PutItem(k, header(k, geometry, checksum(covered_chunks(geometry, b.flags, b.views)),
                                                 b.flags), b)
                             for k, b in zip(keys, staging.buffers, strict=True)]
                    reasons = self.backend.put(items)
                except TierUnavailable as e:
                    self.link.down("put", e)
                    reasons = [DOWN] * n
                except Exception as e:
                    self.log.warning("tier_put_failed", error=repr(e))
                    reasons = [ERROR] * n
                finally:
                    staging.finish([True] * n)
        finally:
            self.link.leave()
        seconds = time.perf_counter() - started
        stored = reasons.count("")
        with self.counters.lock:
            c = self.counters
            c.offload_pages += stored
            c.offload_bytes += stored * geometry.value_bytes
            c.offload_seconds += seconds
        self.link.note("put", Counter(r for r in reasons if r))
        self._report_dropped()
        return reasons

    def _put_packed(self, packed: PackedMemory, keys: list[bytes], pages: list[int]) -> list[str]:
        """The batch as one `[n, value_bytes]` array: the pages gathered in one copy, the headers and CRCs
        computed over it, the store's `put_values` (one write a run of the segment)."""
        n = len(keys)
        try:
            values = np.empty((n, self.geometry.value_bytes), np.uint8)
            flags = self.memory.value_flags(pages) if self.geometry.window_chunks else None
            packed.gather(pages, values[:, HEADER_BYTES:])
            pack_headers(values, keys, self.geometry, flags)
        except Exception as e:
            self.log.warning("tier_staging_failed", operation="put", error=str(e))
            return [ERROR] * n
        try:
            return cast(PackedBackend, self.backend).put_values(keys, values)
        except TierUnavailable as e:
            self.link.down("put", e)
            return [DOWN] * n
        except Exception as e:
            self.log.warning("tier_put_failed", error=repr(e))
            return [ERROR] * n

    def _check_dropped(self) -> None:
        """`_report_dropped` while the store is up (a backend that must ask the store asks it then)."""
        if not self.link.enter():
            return
        try:
            self._report_dropped()
        except Exception as e:  # the link thread notices a store that is gone; this check waits for it
            self.log.debug("tier_dropped_check_failed", error=str(e))
        finally:
            self.link.leave()

    def _report_dropped(self) -> None:
        """Hand the keys the store dropped since the last report to `on_dropped` (on the loop)."""
        self.back.dropped(self.backend.take_dropped())
