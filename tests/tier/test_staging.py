"""Eviction staging (staging.py, TierService.stage) over a real host_shm pool and the real disk tier (held at a
gate where a test needs a slow store): a staged page is the evicted KV even after its page was reused, loads
take it from staging before the tier wrote it, a full staging area drops and counts with one log line per
episode, and what the tier never wrote (the service stopped first) is lost and counted."""

from __future__ import annotations

import asyncio
import shutil
import signal
import subprocess
import sys
import threading
from pathlib import Path

import numpy as np
import pytest
from structlog.testing import capture_logs

from cache_service.tier import DiskTier, TierService, page_memory
from cache_service.tier.memory import geometry
from cache_service.tier.staging import EvictionStaging
from tests.tier.conftest import LAYOUT, Pool
from tests.tier.node import keys_for
from tests.tier.support import REPO, on_disk
from tests.tier.test_service import Gated, _service

G = geometry(LAYOUT)


@pytest.fixture
def disk(tmp_path: Path) -> DiskTier:
    return DiskTier(tmp_path / "tier", 1 << 20, G)


def _kv(seed: int) -> np.ndarray:
    """What `Pool.write(page, seed)` writes."""
    shape = (LAYOUT.num_layers, 2, LAYOUT.page_size, LAYOUT.num_kv_heads, LAYOUT.head_dim)
    return np.random.default_rng(seed).standard_normal(shape).astype(np.float16)


def _pages(ids: list[int]) -> np.ndarray:
    return np.asarray(ids, dtype=np.int32)


async def _written(service: TierService) -> None:
    """Until staging is empty (the offload worker wrote and freed every slot)."""
    assert service.staging is not None
    for _ in range(2000):
        if not service.staging.used:
            return
        await asyncio.sleep(0.005)
    raise AssertionError(f"staging never drained: {service.stats()}")


def test_staging_rounds_down_to_whole_values_and_zero_is_off(pool: Pool) -> None:
    staging = EvictionStaging(pool.memory, 3 * G.payload_bytes - 1)
    assert (staging.slots, staging.regions()[0][1]) == (2, 2 * G.payload_bytes)
    staging.close()
    staging.close()
    assert EvictionStaging(pool.memory, G.payload_bytes - 1).slots == 0
    with pytest.raises(ValueError, match="staging capacity must be >= 0 bytes, got -1"):
        EvictionStaging(pool.memory, -1)


def test_a_staged_page_is_served_from_staging_and_then_written_from_it(pool: Pool, disk: DiskTier,
                                                                      tmp_path: Path) -> None:
    gated = Gated(disk)
    keys = keys_for(31, 2)

    async def scenario() -> None:
        service = _service(gated, pool, staging_bytes=8 * G.payload_bytes)
        gated.gate.clear()  # the store is slow: nothing is written yet
        written = [pool.write(5, seed=1), pool.write(6, seed=2)]
        assert np.array_equal(written[0], _kv(1))
        assert service.stage(keys, _pages([5, 6])) == 2
        pool.scribble([5, 6])  # the evicted pages are reused at once: staging holds the evicted KV
        assert await service.lookup(keys) == 2  # no store call: the lookup is answered from staging
        result = await service.load(keys, [9, 10]).wait()
        assert result is not None and (result.loaded, result.reasons) == (2, ("", ""))
        assert np.array_equal(pool.read(9), written[0]) and np.array_equal(pool.read(10), written[1])
        st = service.stats()
        assert (st.staging_pages, st.staging_capacity_pages, st.staged_pages, st.staging_hit_pages,
                st.staging_written_pages) == (2, 8, 2, 2, 0)
        assert gated.calls == []  # neither the lookup nor the load waited for the slow store
        gated.gate.set()
        await _written(service)
        st = service.stats()
        assert (st.staging_pages, st.staging_written_pages, st.staging_lost_pages, st.offload_pages) == (2 - 2, 2, 0,
                                                                                                       2)
        await asyncio.to_thread(service.close)

    asyncio.run(scenario())

    async def restarted() -> None:  # a new service on the same directory finds what staging wrote
        pool.scribble([3, 4])
        service = _service(DiskTier(tmp_path / "tier", 1 << 20, G), pool)
        result = await service.load(keys, [3, 4]).wait()
        assert result is not None and result.loaded == 2
        await asyncio.to_thread(service.close)

    asyncio.run(restarted())
    assert np.array_equal(pool.read(3), _kv(1)) and np.array_equal(pool.read(4), _kv(2))


def test_full_staging_drops_counts_and_logs_once_per_episode(pool: Pool, disk: DiskTier) -> None:
    gated = Gated(disk)
    keys = keys_for(32, 5)

    async def scenario() -> None:
        service = _service(gated, pool, staging_bytes=2 * G.payload_bytes)
        lost: list[list[bytes]] = []
        service.on_lost = lost.append
        gated.gate.clear()
        with capture_logs() as logs:
            assert service.stage(keys[:3], _pages([1, 2, 3])) == 2  # room for two
            assert service.stage(keys[3:4], _pages([4])) == 0
            assert service.stage(keys[:2], _pages([7, 8])) == 2  # staged already: the same KV, no slot
            gated.gate.set()
            await _written(service)
            assert service.stage(keys[4:], _pages([5])) == 1  # room again: the episode ends
        refused = [e for e in logs if e["event"] == "tier_staging_refused"]
        assert [(e["reason"], e["pages"], e["slots"]) for e in refused] == [("full", 1, 2)]
        ended = [e for e in logs if e["event"] == "tier_staging_refusals_ended"]
        assert [(e["reason"], e["pages_lost"]) for e in ended] == [("full", 2)]
        await _written(service)
        st = service.stats()
        assert (st.staged_pages, st.staging_dropped_pages, st.staging_written_pages, st.staging_lost_pages) == (
            3, 2, 3, 0)
        assert lost == []
        await asyncio.to_thread(service.close)
        assert service.stage(keys[:1], _pages([1])) == 0  # stopping: nothing is staged

    asyncio.run(scenario())


def test_staged_pages_the_tier_never_wrote_before_the_stop_are_lost_and_counted(pool: Pool, disk: DiskTier) -> None:
    gated = Gated(disk)
    keys = keys_for(33, 3)

    async def scenario() -> None:
        service = _service(gated, pool, staging_bytes=8 * G.payload_bytes)
        lost: list[list[bytes]] = []
        service.on_lost = lost.append
        gated.gate.clear()
        assert service.stage(keys[:1], _pages([1])) == 1
        await asyncio.to_thread(gated.entered.acquire)  # the worker is inside the store's put
        assert service.stage(keys[1:], _pages([2, 3])) == 2  # queued behind it
        with capture_logs() as logs:
            closing = asyncio.ensure_future(asyncio.to_thread(service.close, 0.0))
            await asyncio.sleep(0.05)
            threading.Timer(0.0, gated.gate.set).start()
            assert await closing is True
        await asyncio.sleep(0)  # the loss is reported on this loop
        st = service.stats()
        assert (st.staged_pages, st.staging_written_pages, st.staging_lost_pages) == (3, 1, 2)
        assert lost == [keys[1:]]
        assert [e["pages"] for e in logs if e["event"] == "tier_staging_unwritten"] == [2]
        assert on_disk(disk.directory, keys[:2]) == [True, False]

    asyncio.run(scenario())


def test_a_tier_that_is_down_stages_nothing_counts_and_logs_once(pool: Pool, tmp_path: Path) -> None:
    """While the store is down staging takes nothing (it would only fail): the pages are lost and counted, one
    log line for the episode and one when staging takes pages again (the tier came back)."""
    directory = tmp_path / "tier"
    keys = keys_for(34, 4)

    async def scenario() -> None:
        service = _service(DiskTier(directory, 1 << 20, G), pool, staging_bytes=8 * G.payload_bytes,
                           retry_seconds=0.05, retry_max_seconds=0.05)
        for p in range(1, 5):
            pool.write(p, seed=p)
        shutil.rmtree(directory)  # the disk went away (an unmounted volume)
        assert service.stage(keys[:1], _pages([1])) == 1  # not known to be down yet: staged, and its put fails
        await _written(service)
        assert not service.up
        with capture_logs() as logs:
            assert service.stage(keys[1:2], _pages([2])) == 0
            assert service.stage(keys[2:3], _pages([3])) == 0
            directory.mkdir()  # back: the link thread's next probe finds it
            assert await asyncio.to_thread(service.wait_up, 30)
            assert service.stage(keys[3:], _pages([4])) == 1
            await _written(service)
        refusals = [(e["event"], e.get("reason"), e.get("pages", e.get("pages_lost"))) for e in logs
                    if e["event"].startswith("tier_staging")]
        assert refusals == [("tier_staging_refused", "tier down", 1), ("tier_staging_refusals_ended", "tier down", 2)]
        st = service.stats()
        assert (st.staged_pages, st.staging_written_pages, st.staging_lost_pages, st.staging_dropped_pages) == (
            2, 1, 1, 2)
        await asyncio.to_thread(service.close)

    asyncio.run(scenario())


def test_pages_staging_held_at_a_sigkill_are_counted_at_the_next_start(pool: Pool, tmp_path: Path) -> None:
    directory = tmp_path / "tier"
    proc = subprocess.Popen([sys.executable, "-m", "tests.tier.node", "stage-and-wait", "--tier", "disk", "--dir",
                             str(directory), "--seed", "12", "--pages", "5"], cwd=REPO, stdout=subprocess.PIPE,
                            text=True)
    assert proc.stdout is not None
    assert proc.stdout.readline().strip() == "staged 5"
    proc.send_signal(signal.SIGKILL)  # five pages in staging, none written
    proc.wait()
    with capture_logs() as logs:
        service = TierService(DiskTier(directory, 1 << 20, G), page_memory(pool.pool), staging_bytes=1 << 20)
    st = service.stats()
    assert (st.staging_crashed_pages, st.recovered_values, st.torn_values) == (5, 0, 0)
    assert [(e["event"], e["staging_crashed_pages"]) for e in logs if e["log_level"] == "warning"] == [
        ("tier_lost_at_start", 5)]
    assert service.close() is True  # a clean stop leaves the ledger empty
    again = TierService(DiskTier(directory, 1 << 20, G), page_memory(pool.pool), staging_bytes=1 << 20)
    assert again.stats().staging_crashed_pages == 0
    again.close()
