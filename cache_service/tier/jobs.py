"""What passes between the loop and the tier's workers: the jobs the loop queues, the results that come back,
and the ticket a load's waiter holds (docs/design.md §8). Jobs are made on the loop, run on a worker, and
finished on the loop again (worker.py's `Handback`)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any


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
    windowless: tuple[int, ...] = ()
    """A window pool's: of the loaded pages, those whose value held no window rows (their window pages, if they
    got one, hold filler: the core drops them)."""


Done = Callable[[Any], None]


@dataclass(eq=False)
class OffloadJob:
    keys: tuple[bytes, ...]
    pages: tuple[int, ...]
    """Pool pages (an offload ahead of eviction), or () for staged pages (`slots`)."""
    done: Done | None
    slots: tuple[int, ...] = ()
    """Eviction staging slots holding the keys' values (staged at eviction; the pages are gone)."""

    @property
    def size(self) -> int:
        return len(self.keys)


@dataclass(eq=False)
class LoadJob:
    keys: tuple[bytes, ...]
    pages: tuple[int, ...]
    done: Done | None
    future: asyncio.Future[LoadResult]
    gave_up: bool = False

    def unloaded(self, reason: str) -> LoadResult:
        """Nothing loaded, every page for `reason`."""
        return LoadResult(self.keys, self.pages, 0, (reason,) * len(self.keys))


@dataclass(eq=False)
class LookupJob:
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


STOP = object()
"""Queued last by `close`: the worker that takes it stops."""


class LoadTicket:
    """A load in progress. `await wait()`: the LoadResult, or None after the timeout (a miss)."""

    def __init__(self, job: LoadJob, timeout: float, gave_up: Callable[[LoadJob], None]) -> None:
        self._job = job
        self._timeout = timeout
        self._gave_up = gave_up

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
            self._gave_up(job)
            return None
