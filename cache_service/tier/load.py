"""The load worker (docs/design.md §8): runs lookups and loads in the order queued, each `*_runs` call (a
Step's ops) as one store call (loads: up to `batch_pages` pages a call). Pages still in eviction staging are
counted by lookups and copied from their slots by loads; every value the store returns is verified (header,
size, CRC) before its page is visible, and unsound values are discarded from the store."""

from __future__ import annotations

import contextlib
import time
from collections import Counter
from collections.abc import Sequence
from typing import Any

import numpy as np

from cache_service.tier.backend import CLOSED, DOWN, ERROR, TAINTED, GetItem, GetResult, TierUnavailable
from cache_service.tier.jobs import STOP, LoadJob, LoadResult, LookupJob
from cache_service.tier.memory import PackedMemory, PageBuffers
from cache_service.tier.value import HEADER_BYTES, WINDOW_ROWS, Geometry, header_flags, verify, verify_rows
from cache_service.tier.worker import Worker

_UNSOUND = frozenset({"bad_header", "wrong_key", "wrong_size", "bad_checksum", "short"})


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


class LoadWorker(Worker):
    closing = False
    """Set by `close`: lookups find nothing and loads load nothing (CLOSED) from then on."""

    def run(self) -> None:
        """The thread: a lookup job, or a list of loads (one `load_runs` call), until STOP."""
        while True:
            job = self.queue.get()
            if job is STOP:
                self.fail_queued()
                return
            if isinstance(job, LookupJob):
                self.back.deliver(self.back.finish_lookup, job, self._exists(job.runs))
            else:
                for batch in self._batches(job):
                    for load, result in zip(batch, self._get(batch), strict=True):
                        self.back.deliver(self.back.finish_load, load, result)

    def fail_queued(self) -> None:
        """What is still queued: lookups find nothing, loads load nothing (CLOSED)."""
        for job in self.queued():
            if isinstance(job, LookupJob):
                self.back.deliver(self.back.finish_lookup, job, [0] * len(job.runs))
            elif isinstance(job, list):
                for load in job:
                    self.back.deliver(self.back.finish_load, load, load.unloaded(CLOSED))

    def _batches(self, jobs: list[LoadJob]) -> list[list[LoadJob]]:
        """Consecutive loads grouped into store calls of at most `batch_pages` pages (a bigger load alone)."""
        batches: list[list[LoadJob]] = []
        pages = 0
        for job in jobs:
            if batches and pages + len(job.keys) <= self.batch_pages:
                batches[-1].append(job)
                pages += len(job.keys)
            else:
                batches.append([job])
                pages = len(job.keys)
        return batches

    def _exists(self, runs: tuple[tuple[bytes, ...], ...]) -> list[int]:
        """Leading keys of each run that staging or the store holds (the store asked once, for the rest)."""
        staging = self.staging
        if staging is None or self.closing:
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
        if self.closing:
            return none
        if not self.link.enter():
            self.link.note("exists", Counter({DOWN: 1}))
            return none
        try:
            found = self.backend.exists(runs)
        except TierUnavailable as e:
            self.link.down("exists", e)
            self.link.note("exists", Counter({DOWN: 1}))
            return none
        except Exception as e:
            self.log.warning("tier_exists_failed", error=repr(e))
            self.link.note("exists", Counter({ERROR: 1}))
            return none
        finally:
            self.link.leave()
        if len(found) != len(runs):
            self.log.warning("tier_exists_failed", error=f"{len(found)} answers for {len(runs)} runs")
            self.link.note("exists", Counter({ERROR: 1}))
            return none
        self.link.note("exists", Counter())
        return [min(n, len(run)) for n, run in zip(found, runs, strict=True)]

    def _get(self, jobs: list[LoadJob]) -> list[LoadResult]:
        """One store call for `jobs` (one load each, a Step's appends together); a result per job."""
        n = sum(len(job.keys) for job in jobs)
        if self.closing:
            return [job.unloaded(CLOSED) for job in jobs]
        if not self.link.enter():
            self.link.note("get", Counter({DOWN: n}))
            return [job.unloaded(DOWN) for job in jobs]
        try:
            return self._get_entered(jobs)
        finally:
            self.link.leave()

    def _get_entered(self, jobs: list[LoadJob]) -> list[LoadResult]:
        keys = [key for job in jobs for key in job.keys]
        pages = [page for job in jobs for page in job.pages]
        n = len(keys)
        started = time.perf_counter()
        reasons: list[str] = []
        staging: Any
        if self.packed is not None:
            staging = _PackedLoad(self.packed, pages, self.geometry)
        else:
            try:
                staging = self.memory.stage_in(pages)
            except Exception as e:
                self.log.warning("tier_staging_failed", operation="get", error=str(e))
                self.link.note("get", Counter({ERROR: n}))
                return [job.unloaded(ERROR) for job in jobs]
        ok: list[bool] = [False] * n
        staged = self.staging
        local = [False] * n
        flags = [0] * n
        if staged is not None and staged.used:
            for i, k in enumerate(keys):
                got_flags = staged.read_flags_into(k, staging.buffers[i]) if staged.holds(k) else None
                local[i] = got_flags is not None
                flags[i] = got_flags or 0
        try:
            asked = [i for i in range(n) if not local[i]]
            try:
                if isinstance(staging, _PackedLoad):
                    got = staging.get(self.backend, keys, asked)
                else:
                    got = self.backend.get([GetItem(keys[i], staging.buffers[i]) for i in asked]) if asked else []
            except TierUnavailable as e:
                self.link.down("get", e)
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
                    flags[i] = header_flags(staging.values[i, :HEADER_BYTES])
                else:
                    reason = res.reason or verify(res.header, key, self.geometry, staging.buffers[i].views)
                    flags[i] = header_flags(res.header)
                reasons.append(reason)
                ok[i] = not reason
        except Exception as e:
            self.log.warning("tier_get_failed", error=repr(e))
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
            self.log.warning("tier_staging_failed", operation="get", error=str(e))
            loaded = [0] * len(jobs)
        seconds = time.perf_counter() - started
        unsound = [k for k, r in zip(keys, reasons, strict=True) if r in _UNSOUND]
        if unsound:
            with contextlib.suppress(Exception):
                self.backend.discard(unsound)
            self.back.dropped(unsound)
        with self.counters.lock:
            c = self.counters
            c.load_pages += sum(loaded)
            c.load_bytes += sum(loaded) * self.geometry.value_bytes
            c.load_seconds += seconds
            c.staging_hit_pages += sum(local)
        self.link.note("get", Counter(r for r in reasons if r))
        out: list[LoadResult] = []
        start = 0
        for job, count in zip(jobs, loaded, strict=True):
            mine = tuple(reasons[start:start + len(job.keys)])
            tainted = tuple(p for p, r in zip(job.pages, mine, strict=True) if r == TAINTED)
            windowless = tuple(p for p, f in zip(job.pages[:count], flags[start:start + count], strict=True)
                               if not f & WINDOW_ROWS) if self.geometry.window_chunks else ()
            out.append(LoadResult(job.keys, job.pages, count, mine, tainted, seconds, windowless=windowless))
            start += len(job.keys)
        return out
