"""A window pool's values (docs/design.md §8, §13; tier/value.py, tier/memory.py): a page's full-attention
chunks from the pages' region, then its window chunks from its window page; the flags say whether the value holds
them; a load puts them back only where the page has a window page; a value of the other layout is refused."""

from __future__ import annotations

import asyncio
import uuid
from array import array
from pathlib import Path

import numpy as np
import pytest

from cache_service.memory import HostShmPool, PoolLayout
from cache_service.tier import DiskTier, TierService, page_memory
from cache_service.tier.memory import HostPoolMemory, geometry
from cache_service.tier.value import (
    BAD_CHECKSUM,
    WINDOW_APART,
    WINDOW_ROWS,
    WRONG_LAYOUT,
    checksum,
    header,
    pack_headers,
    verify,
)
from tests.tier.support import offload

LAYOUT = PoolLayout(num_layers=3, num_kv_heads=2, head_dim=8, dtype="float16", page_size=4, num_pages=16,
                    sliding_window=8, window_layers=(0, 2), window_pages=8)
"""Layer 1 full, layers 0 and 2 windowed: a value is 2 full chunks then 4 window chunks of 128 bytes."""
G = geometry(LAYOUT)
ONE_REGION = geometry(PoolLayout(num_layers=3, num_kv_heads=2, head_dim=8, dtype="float16", page_size=4,
                                 num_pages=16, sliding_window=8, window_layers=(0, 2)))


def _key(i: int) -> bytes:
    return bytes([i]) * 32


def test_a_value_says_by_group_what_it_holds_and_its_crc_covers_only_that() -> None:
    assert (G.num_chunks, G.window_chunks, G.full_chunks, G.chunk_bytes) == (6, 4, 2, 128)
    assert (G.flags(True), G.flags(False), ONE_REGION.flags(True)) == (WINDOW_APART | WINDOW_ROWS, WINDOW_APART, 0)
    chunks = [bytes([c]) * 128 for c in range(6)]
    full = header(_key(1), G, checksum(chunks[:2]), G.flags(False))
    assert verify(full, _key(1), G, chunks) == ""
    assert verify(full, _key(1), G, [*chunks[:2], *[b"\xff" * 128] * 4]) == ""  # window chunks are filler
    both = header(_key(1), G, checksum(chunks), G.flags(True))
    assert verify(both, _key(1), G, [*chunks[:2], *[b"\xff" * 128] * 4]) == BAD_CHECKSUM
    # The other layout's values (same size, chunks in another order) are never read.
    assert verify(header(_key(1), G, checksum(chunks), 0), _key(1), G, chunks) == WRONG_LAYOUT
    assert verify(both, _key(1), ONE_REGION, chunks) == WRONG_LAYOUT
    assert verify(header(_key(1), G, checksum(chunks), WINDOW_ROWS), _key(1), G, chunks) == WRONG_LAYOUT


@pytest.fixture
def pool(tmp_path: Path) -> HostShmPool:
    p = HostShmPool(LAYOUT, shm_dir=str(tmp_path), prefix="tierwin", instance_id=uuid.uuid4().hex[:12])
    yield p
    p.close()


def test_pages_go_to_the_disk_tier_and_back_by_group(pool: HostShmPool, tmp_path: Path) -> None:
    memory = page_memory(pool)
    assert isinstance(memory, HostPoolMemory) and memory.geometry == G
    win = array("i", [0] * LAYOUT.num_pages)
    memory.window = win
    full = np.memmap(pool.path, dtype=np.float16, mode="r+", shape=LAYOUT.shape)
    window = np.memmap(pool.path, dtype=np.float16, mode="r+", offset=LAYOUT.window_offset_bytes,
                       shape=LAYOUT.window_shape)
    rng = np.random.default_rng(7)
    full[:, :, 1:3] = rng.standard_normal(full[:, :, 1:3].shape).astype(np.float16)
    window[:, :, 3] = rng.standard_normal(window[:, :, 3].shape).astype(np.float16)
    win[1] = 3  # page 1 holds its window rows in window page 3; page 2 lost its own
    wrote_full, wrote_window = np.array(full[:, :, 1:3]), np.array(window[:, :, 3])
    disk = DiskTier(tmp_path / "tier", 1 << 20, G)

    async def scenario() -> None:
        service = TierService(disk, memory)
        service.start(asyncio.get_running_loop())
        result = await offload(service, [(_key(1), 1), (_key(2), 2)])
        assert result.stored == [True, True]
        # A one-region pool's value under a key of ours (a store shared by mistake): refused, counted, a miss.
        other = np.zeros((1, G.value_bytes), np.uint8)
        pack_headers(other, [_key(3)], G)
        assert disk.put_values([_key(3)], other) == [""]
        full[:, :, 5:8] = np.float16(-7.0)
        window[:, :, 4:6] = np.float16(-7.0)
        win[5], win[6], win[7] = 4, 5, 0  # page 7: no window page could be taken for it
        ticket = service.load([_key(1), _key(2)], [5, 6])
        res = await ticket.wait()
        assert res is not None and (res.loaded, res.windowless) == (2, (6,))
        ticket = service.load([_key(1)], [7])
        res = await ticket.wait()
        assert res is not None and (res.loaded, res.windowless) == (1, ())
        ticket = service.load([_key(3)], [8])
        res = await ticket.wait()
        assert res is not None and (res.loaded, res.reasons) == (0, (WRONG_LAYOUT,))
        assert service.stats().errors == {("get", WRONG_LAYOUT): 1}
        await asyncio.to_thread(service.close)

    asyncio.run(scenario())
    assert np.array_equal(full[:, :, 5], wrote_full[:, :, 0]) and np.array_equal(full[:, :, 6], wrote_full[:, :, 1])
    assert np.array_equal(full[:, :, 7], wrote_full[:, :, 0])
    assert np.array_equal(window[:, :, 4], wrote_window)  # page 5's window page: page 1's window rows
    # Page 6's value held no window rows: its window page got the filler, which `windowless` tells the core to drop.
    assert not np.array_equal(window[:, :, 5], np.full_like(window[:, :, 5], -7.0))
    memory.close()


def test_eviction_staging_keeps_what_each_page_held_and_writes_it_with_its_flags(pool: HostShmPool,
                                                                                 tmp_path: Path) -> None:
    memory = page_memory(pool)
    win = array("i", [0] * LAYOUT.num_pages)
    memory.window = win
    full = np.memmap(pool.path, dtype=np.float16, mode="r+", shape=LAYOUT.shape)
    window = np.memmap(pool.path, dtype=np.float16, mode="r+", offset=LAYOUT.window_offset_bytes,
                       shape=LAYOUT.window_shape)
    rng = np.random.default_rng(3)
    full[:, :, 1:3] = rng.standard_normal(full[:, :, 1:3].shape).astype(np.float16)
    window[:, :, 6] = rng.standard_normal(window[:, :, 6].shape).astype(np.float16)
    win[1] = 6
    wrote_full, wrote_window = np.array(full[:, :, 1:3]), np.array(window[:, :, 6])
    keys = [_key(11), _key(12)]

    async def staged() -> None:
        service = TierService(DiskTier(tmp_path / "tier", 1 << 20, G), memory, staging_bytes=4 * G.payload_bytes)
        service.start(asyncio.get_running_loop())
        assert service.stage(keys, np.array([1, 2], dtype=np.int32)) == 2
        win[1] = 0  # evicted: the pages and their window page are someone else's now
        full[:, :, 1:3] = np.float16(-7.0)
        window[:, :, 6] = np.float16(-7.0)
        win[9] = 2
        res = await service.load(keys, [9, 10]).wait()  # from staging (or the store, once written)
        assert res is not None and (res.loaded, res.windowless) == (2, (10,))
        await asyncio.to_thread(service.close)  # drains: staging's values are written with their flags

    async def restarted() -> None:  # a new service (the old one closed its mapping) on the same directory
        again = page_memory(pool)
        again.window = win
        service = TierService(DiskTier(tmp_path / "tier", 1 << 20, G), again)
        service.start(asyncio.get_running_loop())
        win[11], win[12] = 3, 4
        res = await service.load(keys, [11, 12]).wait()
        assert res is not None and (res.loaded, res.windowless) == (2, (12,))
        await asyncio.to_thread(service.close)

    asyncio.run(staged())
    assert np.array_equal(full[:, :, 9], wrote_full[:, :, 0]) and np.array_equal(window[:, :, 2], wrote_window)
    full[:, :, 9:11] = np.float16(-7.0)
    asyncio.run(restarted())
    assert np.array_equal(full[:, :, 11], wrote_full[:, :, 0]) and np.array_equal(full[:, :, 12], wrote_full[:, :, 1])
    assert np.array_equal(window[:, :, 3], wrote_window)
