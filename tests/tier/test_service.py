"""TierService: completions on the loop thread, a bounded offload queue that never waits, bounded waits for
loads, fault handling and the counters, over the real disk tier. A slow store is the real one held at a
gate (a wrapper that blocks its calls until the test opens it)."""

from __future__ import annotations

import asyncio
import shutil
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from structlog.testing import capture_logs

from cache_service.tier import DiskTier, TierService, page_memory
from cache_service.tier.backend import CLOSED, DOWN, GetItem, GetResult, PutItem
from cache_service.tier.jobs import LoadResult, OffloadResult
from cache_service.tier.memory import geometry
from tests.tier.conftest import LAYOUT, Pool
from tests.tier.node import keys_for
from tests.tier.support import offload, on_disk

G = geometry(LAYOUT)


class Gated:
    """A real backend whose store calls wait for `gate` (a slow store), recording the calling threads."""

    def __init__(self, inner: DiskTier) -> None:
        self.inner = inner
        self.name = inner.name
        self.gate = threading.Event()
        self.gate.set()
        self.entered = threading.Semaphore(0)
        self.threads: set[str] = set()
        self.calls: list[tuple[str, list[int]]] = []
        """(operation, run sizes) of the exists and get calls, in order."""

    def _wait(self) -> None:
        self.threads.add(threading.current_thread().name)
        self.entered.release()
        assert self.gate.wait(30)

    def put(self, items: Sequence[PutItem]) -> list[str]:
        self._wait()
        return self.inner.put(items)

    def get(self, items: Sequence[GetItem]) -> list[GetResult]:
        self._wait()
        self.calls.append(("get", [len(items)]))
        return self.inner.get(items)

    def put_values(self, keys: Sequence[bytes], values: Any) -> list[str]:
        self._wait()
        return self.inner.put_values(keys, values)

    def get_values(self, keys: Sequence[bytes], values: Any) -> list[str]:
        self._wait()
        self.calls.append(("get", [len(keys)]))
        return self.inner.get_values(keys, values)

    def exists(self, runs: Sequence[Sequence[bytes]]) -> list[int]:
        self._wait()
        self.calls.append(("exists", [len(run) for run in runs]))
        return self.inner.exists(runs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


@pytest.fixture
def disk(tmp_path: Path) -> DiskTier:
    return DiskTier(tmp_path / "tier", 1 << 20, G)


def _service(backend: Any, pool: Pool, **kwargs: Any) -> TierService:
    service = TierService(backend, page_memory(pool.pool), **kwargs)
    service.start(asyncio.get_running_loop())
    return service


def test_results_come_back_on_the_loop_thread_and_the_store_runs_off_it(pool: Pool, disk: DiskTier) -> None:
    gated = Gated(disk)
    keys = keys_for(1, 4)

    async def scenario() -> None:
        service = _service(gated, pool)
        loop_thread = threading.current_thread().name
        seen: list[str] = []
        for p in range(1, 5):
            pool.write(p, seed=p)
        done: asyncio.Future[OffloadResult] = asyncio.get_running_loop().create_future()

        def on_offloaded(result: OffloadResult) -> None:
            seen.append(threading.current_thread().name)
            done.set_result(result)

        assert service.offload([(k, i + 1) for i, k in enumerate(keys)], on_offloaded) == 4
        result = await done
        assert result.pages == (1, 2, 3, 4) and result.stored == [True] * 4
        assert await service.lookup(keys) == 4
        loaded: list[LoadResult] = []
        ticket = service.load(keys, [11, 12, 13, 14], lambda r: (seen.append(threading.current_thread().name),
                                                                 loaded.append(r)))
        res = await ticket.wait()
        assert res is not None and res == loaded[0] and res.loaded == 4 and not res.late
        assert seen == [loop_thread, loop_thread]
        assert gated.threads == {"kvcache-tier-offload", "kvcache-tier-load"}
        for p in range(4):
            assert np.array_equal(pool.read(11 + p), pool.read(1 + p))
        st = service.stats()
        assert (st.offload_pages, st.offload_bytes, st.load_pages, st.load_bytes) == (4, 4 * 576, 4, 4 * 576)
        assert (st.hit_pages, st.miss_pages, st.lookup_pages, st.queue_pages, st.load_queue_pages) == (4, 0, 4, 0, 0)
        assert st.offload_seconds > 0 and st.load_seconds > 0 and st.up and st.errors == {}
        assert (st.stored_values, st.stored_bytes, st.capacity_bytes) == (4, 64 + 4 * 576, 1 << 20)
        await asyncio.to_thread(service.close)

    asyncio.run(scenario())


def test_a_steps_lookups_and_loads_go_to_the_store_together(pool: Pool, disk: DiskTier) -> None:
    gated = Gated(disk)
    a, b, c = keys_for(31, 3), keys_for(32, 3), keys_for(33, 2)  # c is never stored

    async def scenario() -> None:
        service = _service(gated, pool, batch_pages=5)
        written = [pool.write(p, seed=40 + p) for p in range(1, 7)]
        assert (await offload(service, [(k, i + 1) for i, k in enumerate(a + b)])).stored == [True] * 6
        found = await service.lookup_runs([a, c, [], b[:2] + c[:1]], [True, True, True, False])
        assert found == [3, 0, 0, 2]
        assert gated.calls == [("exists", [3, 2, 0, 3])]  # one store call for every run
        st = service.stats()
        assert (st.lookup_pages, st.miss_pages) == (5, 2)  # the uncounted probe adds neither
        done: list[LoadResult] = []
        tickets = service.load_runs([(a, [11, 12, 13], done.append), (c, [14, 15], done.append),
                                     (b, [16, 17, 18], done.append)])
        results = [await t.wait() for t in tickets]
        # batches of at most 5 pages: a and c together, then b
        assert gated.calls[1:] == [("get", [5]), ("get", [3])]
        assert [(r.loaded, r.pages) for r in results if r is not None] == [
            (3, (11, 12, 13)), (0, (14, 15)), (3, (16, 17, 18))]
        assert done == results and results[1] is not None and results[1].reasons == ("missing", "missing")
        for i, page in enumerate((11, 12, 13, 16, 17, 18)):
            assert np.array_equal(pool.read(page), written[i])
        st = service.stats()
        assert (st.load_pages, st.hit_pages, st.miss_pages, st.load_queue_pages) == (6, 6, 4, 0)
        await asyncio.to_thread(service.close)

    asyncio.run(scenario())


def test_runs_that_do_not_match_their_count_flags_are_refused(pool: Pool, disk: DiskTier) -> None:
    async def scenario() -> None:
        service = _service(disk, pool)
        with pytest.raises(ValueError, match="2 runs for 1 count flags"):
            await service.lookup_runs([keys_for(34, 1), keys_for(35, 1)], [True])
        with pytest.raises(ValueError, match="2 keys for 1 pages"):
            service.load_runs([(keys_for(36, 1), [20], None), (keys_for(37, 2), [21], None)])
        st = service.stats()
        assert (st.lookup_pages, st.load_queue_pages) == (0, 0)  # nothing was queued
        await asyncio.to_thread(service.close)

    asyncio.run(scenario())


def test_a_full_queue_refuses_pages_at_once_and_counts_them(pool: Pool, disk: DiskTier) -> None:
    gated = Gated(disk)
    keys = keys_for(2, 8)

    async def scenario() -> None:
        service = _service(gated, pool, queue_pages=4)
        gated.gate.clear()
        results: list[OffloadResult] = []
        assert service.offload([(keys[0], 1), (keys[1], 2)], results.append) == 2
        await asyncio.to_thread(gated.entered.acquire)  # the worker is inside the (slow) store
        assert service.offload([(k, i + 3) for i, k in enumerate(keys[2:6])], results.append) == 2
        assert service.offload([(keys[6], 7)], results.append) == 0
        st = service.stats()
        assert (st.queue_pages, st.queue_capacity_pages, st.offload_dropped_pages) == (4, 4, 3)
        gated.gate.set()
        while len(results) < 2:
            await asyncio.sleep(0.01)
        assert [r.pages for r in results] == [(1, 2), (3, 4)]
        assert service.stats().queue_pages == 0
        assert service.offload([(keys[7], 8)], results.append) == 1  # room again
        await asyncio.to_thread(service.close)
        assert on_disk(disk.directory, keys) == [True] * 4 + [False] * 3 + [True]

    asyncio.run(scenario())


def test_a_slow_load_is_a_miss_after_the_timeout_and_its_pages_stay_owned_until_done(pool: Pool,
                                                                                     disk: DiskTier) -> None:
    gated = Gated(disk)
    keys = keys_for(3, 3)

    async def scenario() -> None:
        service = _service(gated, pool, timeout_seconds=0.05)
        for p in (1, 2, 3):
            pool.write(p, seed=p)
        await offload(service, [(k, i + 1) for i, k in enumerate(keys)])
        gated.gate.clear()
        finished: list[LoadResult] = []
        ticket = service.load(keys, [21, 22, 23], finished.append)
        assert await ticket.wait() is None  # the store is stuck: a miss after --tier-timeout
        assert finished == []  # ... but the pages still belong to the load
        st = service.stats()
        assert (st.load_timeouts, st.miss_pages, st.hit_pages, st.load_queue_pages) == (1, 3, 0, 3)
        gated.gate.set()
        while not finished:
            await asyncio.sleep(0.01)
        late = finished[0]
        assert late.late and late.loaded == 3 and late.pages == (21, 22, 23)
        assert await ticket.wait() == late
        st = service.stats()
        assert (st.hit_pages, st.miss_pages, st.load_pages, st.load_queue_pages) == (0, 3, 3, 0)  # not a hit
        await asyncio.to_thread(service.close)

    asyncio.run(scenario())


def test_a_slow_lookup_is_zero_after_the_timeout(pool: Pool, disk: DiskTier) -> None:
    gated = Gated(disk)

    async def scenario() -> None:
        service = _service(gated, pool, timeout_seconds=0.05)
        gated.gate.clear()
        assert await service.lookup(keys_for(4, 2)) == 0
        assert await service.lookup(keys_for(4, 2), count=False, timeout=0) == 0
        st = service.stats()
        assert (st.lookup_pages, st.miss_pages, st.errors) == (2, 2, {("exists", "timeout"): 2})
        gated.gate.set()
        await asyncio.to_thread(service.close)

    asyncio.run(scenario())


def test_a_tier_that_goes_away_costs_hits_is_logged_once_and_comes_back(pool: Pool, tmp_path: Path) -> None:
    directory = tmp_path / "tier"
    disk = DiskTier(directory, 1 << 20, G)
    keys = keys_for(5, 6)

    async def scenario() -> None:
        service = _service(disk, pool, retry_seconds=0.05, retry_max_seconds=0.05)
        for p in range(1, 7):
            pool.write(p, seed=p)
        await offload(service, [(keys[0], 1)])
        shutil.rmtree(directory)  # the disk went away (an unmounted volume)
        with capture_logs() as logs:
            r1 = await offload(service, [(keys[1], 2)])
            r2 = await offload(service, [(keys[2], 3)])  # fails fast: no store call while down
            res = await service.load([keys[0]], [30]).wait()
            assert await service.lookup(keys) == 0
        assert (r1.reasons, r2.reasons) == ((DOWN,), (DOWN,))
        assert res is not None and res.reasons == (DOWN,) and res.loaded == 0
        assert [(e["event"], e.get("operation")) for e in logs if e["log_level"] != "debug"] == [
            ("tier_unavailable", "put"), ("tier_failures", "put"), ("tier_failures", "get"),
            ("tier_failures", "exists")]
        st = service.stats()
        assert (st.up, st.outages) == (False, 1)
        assert st.errors == {("put", DOWN): 2, ("get", DOWN): 1, ("exists", DOWN): 1}
        with capture_logs() as logs:
            directory.mkdir()  # back: the link thread's next probe finds it
            assert await asyncio.to_thread(service.wait_up, 30)
            r4 = await offload(service, [(keys[4], 5)])
        assert r4.reasons == ("",)
        assert [e["event"] for e in logs if e["log_level"] != "debug"] == ["tier_recovered", "tier_failures_ended"]
        st = service.stats()
        assert (st.up, st.outages, st.offload_pages) == (True, 1, 2)
        await asyncio.to_thread(service.close)

    asyncio.run(scenario())


def test_close_drains_queued_offloads_and_refuses_new_work(pool: Pool, disk: DiskTier) -> None:
    gated = Gated(disk)
    keys = keys_for(6, 3)

    async def scenario() -> None:
        service = _service(gated, pool)
        gated.gate.clear()
        results: list[OffloadResult] = []
        assert service.offload([(keys[0], 1)], results.append) == 1
        assert service.offload([(keys[1], 2)], results.append) == 1
        closing = asyncio.ensure_future(asyncio.to_thread(service.close, 10.0))
        await asyncio.sleep(0.05)
        gated.gate.set()
        assert await closing is True
        await asyncio.sleep(0)  # the deliveries are scheduled on this loop
        assert [r.reasons for r in results] == [("",), ("",)]
        assert on_disk(disk.directory, keys[:2]) == [True, True]  # drained: a restart finds them
        assert service.offload([(keys[2], 3)]) == 0
        late = await service.load([keys[0]], [9]).wait()
        assert late is not None and late.reasons == (CLOSED,)
        assert await service.lookup(keys) == 0

    asyncio.run(scenario())


def test_offloads_past_the_drain_deadline_are_dropped(pool: Pool, disk: DiskTier) -> None:
    gated = Gated(disk)
    keys = keys_for(7, 2)

    async def scenario() -> None:
        service = _service(gated, pool)
        gated.gate.clear()
        results: list[OffloadResult] = []
        service.offload([(keys[0], 1)], results.append)
        await asyncio.to_thread(gated.entered.acquire)
        service.offload([(keys[1], 2)], results.append)
        closing = asyncio.ensure_future(asyncio.to_thread(service.close, 0.0))
        await asyncio.sleep(0.05)
        gated.gate.set()
        await closing
        await asyncio.sleep(0)
        assert [r.reasons for r in results] == [("",), (CLOSED,)]
        assert service.stats().offload_dropped_pages == 1

    asyncio.run(scenario())


def test_mismatched_keys_and_pages_are_refused(pool: Pool, disk: DiskTier) -> None:
    async def scenario() -> None:
        service = _service(disk, pool)
        with pytest.raises(ValueError, match="2 keys for 1 pages"):
            service.load(keys_for(8, 2), [1])
        assert await service.lookup([]) == 0
        await asyncio.to_thread(service.close)

    asyncio.run(scenario())


def test_falling_behind_is_one_episode_logged_once_with_its_seconds(pool: Pool, disk: DiskTier) -> None:
    gated = Gated(disk)
    keys = keys_for(8, 8)
    now = [100.0]

    async def scenario() -> None:
        service = _service(gated, pool, queue_pages=4, clock=lambda: now[0])
        gated.gate.clear()
        results: list[OffloadResult] = []
        with capture_logs() as logs:
            assert service.offload([(keys[0], 1), (keys[1], 2)], results.append) == 2
            await asyncio.to_thread(gated.entered.acquire)  # the worker is inside the (slow) store
            assert service.offload([(keys[2], 3), (keys[3], 4)], results.append) == 2  # full: not behind yet
            assert service.stats().behind is False
            now[0] = 101.0  # full for a second: behind
            assert service.offload([(keys[4], 5)], results.append) == 0
            now[0] = 101.5
            assert service.offload([(keys[5], 6)], results.append) == 0  # refused: still the same episode
            now[0] = 103.5
            st = service.stats()
            assert (st.behind, st.behind_episodes, st.behind_seconds) == (True, 1, 2.5)
            gated.gate.set()
            while len(results) < 2:
                await asyncio.sleep(0.01)
        behind = [e for e in logs if e["event"] in ("tier_falling_behind", "tier_caught_up")]
        assert [(e["event"], e.get("queue_pages"), e.get("seconds"), e.get("pages_lost")) for e in behind] == [
            ("tier_falling_behind", 4, None, None), ("tier_caught_up", None, 2.5, 1)]
        st = service.stats()
        assert (st.behind, st.behind_episodes, st.behind_seconds, st.offload_dropped_pages) == (False, 1, 2.5, 2)
        await asyncio.to_thread(service.close)

    asyncio.run(scenario())
