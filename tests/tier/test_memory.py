"""Where the tier reads and writes pages: the chunk math against an engine's view of a real host_shm pool,
and the GPU staging path's slot handling (on CPU, with host memory standing in for the device)."""

from __future__ import annotations

import ctypes
import threading
import time

import numpy as np
import numpy.typing as npt
import pytest

from cache_service.memory import PoolError, PoolLayout
from cache_service.memory.cuda_vmm import ACCESS_READWRITE, CudaVmmPool
from cache_service.tier.memory import DevicePoolMemory, TierMemoryError, chunk_offsets, geometry, window_chunk_offsets
from tests.fakes import GRANULARITY, VA, FakeVmmDriver
from tests.tier.conftest import LAYOUT, Pool


def test_geometry_and_chunk_offsets_follow_the_pool_layout() -> None:
    g = geometry(LAYOUT)
    assert (g.num_chunks, g.chunk_bytes, g.value_bytes) == (4, 128, 64 + 512)
    plane = LAYOUT.num_pages * 128
    assert list(chunk_offsets(LAYOUT, 5)) == [5 * 128, plane + 5 * 128, 2 * plane + 5 * 128, 3 * plane + 5 * 128]


def test_an_mla_pages_value_is_its_latents_exactly() -> None:
    # one latent of 576 per token and layer, its halves in the K and V planes: a value holds 2 x 16 x 576 floats
    mla = PoolLayout(num_layers=2, num_kv_heads=1, head_dim=576, dtype="float32", page_size=16, num_pages=8,
                     attention="mla")
    g = geometry(mla)
    assert (g.num_chunks, g.chunk_bytes, g.value_bytes) == (4, 16 * 288 * 4, 64 + 2 * 16 * 576 * 4)
    plane = 8 * 16 * 288 * 4
    assert list(chunk_offsets(mla, 3)) == [3 * 18432 + i * plane for i in range(4)]


def test_a_window_pools_page_value_holds_every_layers_rows() -> None:
    # window layers 0-2 and full layer 3: the value is the whole page, as for a full-attention pool of the sizes
    window = PoolLayout(num_layers=4, num_kv_heads=2, head_dim=8, dtype="float16", page_size=4, num_pages=8,
                        sliding_window=16, window_layers=(0, 1, 2))
    full = PoolLayout(num_layers=4, num_kv_heads=2, head_dim=8, dtype="float16", page_size=4, num_pages=8)
    assert (geometry(window).num_chunks, geometry(window).chunk_bytes) == (8, 4 * 2 * 8 * 2)
    assert (geometry(full).num_chunks, geometry(full).chunk_bytes) == (8, 4 * 2 * 8 * 2)
    assert geometry(window).layout != geometry(full).layout  # a disk tier of one is never read by the other
    assert list(chunk_offsets(window, 3)) == list(chunk_offsets(full, 3))


def test_a_pages_chunks_are_the_engines_k_and_v_in_layer_order(pool: Pool) -> None:
    written = pool.write(9, seed=1)
    buffers = pool.memory.page(9)
    expected = [written[layer, kv].tobytes() for layer in range(2) for kv in range(2)]
    assert [bytes(v) for v in buffers.views] == expected
    base = pool.memory.base_address
    assert buffers.addresses == [base + o for o in chunk_offsets(LAYOUT, 9)]
    assert pool.memory.regions() == [(base, LAYOUT.size_bytes)]
    # writes through the views land in the engine's view of the same page, and nowhere else
    before = np.array(pool.kv)
    for i, view in enumerate(buffers.views):
        view[:] = bytes([i + 1]) * len(view)
    after = np.array(pool.kv)
    changed = np.argwhere((before.view(np.uint16) != after.view(np.uint16)).any(axis=(3, 4, 5)))
    assert {(int(layer), int(kv), int(page)) for layer, kv, page in changed} == {(0, 0, 9), (0, 1, 9), (1, 0, 9),
                                                                                 (1, 1, 9)}


@pytest.mark.parametrize("page", [0, -1, LAYOUT.num_pages])
def test_page_zero_and_pages_outside_the_pool_are_refused(pool: Pool, page: int) -> None:
    with pytest.raises(ValueError, match=f"page {page} is outside the pool"):
        pool.memory.page(page)


def test_close_is_idempotent_and_ends_access(pool: Pool) -> None:
    pool.memory.close()
    pool.memory.close()
    with pytest.raises(TierMemoryError, match="closed"):
        pool.memory.page(1)


# --------------------------------------------------------------------------------- GPU staging, on CPU


class HostCopier:
    """A DeviceCopier whose "device" is host memory: the staging logic runs, the CUDA calls do not."""

    def __init__(self) -> None:
        self.pinned: dict[int, ctypes.Array[ctypes.c_char]] = {}
        self.copies: list[tuple[str, int, int, int]] = []
        """(direction, chunk bytes, pitch, chunks) of each copy call."""

    def alloc_pinned(self, nbytes: int) -> int:
        buf = ctypes.create_string_buffer(nbytes)
        self.pinned[ctypes.addressof(buf)] = buf
        return ctypes.addressof(buf)

    def free_pinned(self, address: int) -> None:
        del self.pinned[address]

    def gather(self, host: int, device: int, chunk: int, pitch: int, count: int) -> None:
        self.copies.append(("d2h", chunk, pitch, count))
        for i in range(count):
            ctypes.memmove(host + i * chunk, device + i * pitch, chunk)

    def scatter(self, device: int, host: int, chunk: int, pitch: int, count: int) -> None:
        self.copies.append(("h2d", chunk, pitch, count))
        for i in range(count):
            ctypes.memmove(device + i * pitch, host + i * chunk, chunk)


@pytest.fixture
def device() -> tuple[npt.NDArray[np.uint8], DevicePoolMemory, HostCopier]:
    pool = np.random.default_rng(0).integers(0, 255, LAYOUT.size_bytes, dtype=np.uint8)
    copier = HostCopier()
    return pool, DevicePoolMemory(LAYOUT, int(pool.ctypes.data), copier, slots=4), copier


def _page_bytes(pool: npt.NDArray[np.uint8], page: int) -> bytes:
    return b"".join(pool[o:o + LAYOUT.page_bytes].tobytes() for o in chunk_offsets(LAYOUT, page))


def test_staging_out_copies_each_chunk_into_a_page_major_slot(device: tuple[
        npt.NDArray[np.uint8], DevicePoolMemory, HostCopier]) -> None:
    pool, memory, copier = device
    staging = memory.stage_out([3, 7])
    assert [b"".join(bytes(v) for v in b.views) for b in staging.buffers] == [_page_bytes(pool, 3),
                                                                              _page_bytes(pool, 7)]
    host, size = memory.regions()[0]
    assert size == 4 * 512
    slot = staging.buffers[0]
    assert slot.addresses == [slot.addresses[0] + i * 128 for i in range(4)]  # contiguous within a slot
    assert all(host <= a < host + size for b in staging.buffers for a in b.addresses)
    assert copier.copies == [("d2h", 128, LAYOUT.num_pages * 128, 4)] * 2  # one strided copy a page
    staging.finish([True, True])


def test_a_load_reaches_the_device_only_for_sound_pages(device: tuple[
        npt.NDArray[np.uint8], DevicePoolMemory, HostCopier]) -> None:
    pool, memory, copier = device
    before = pool.copy()
    staging = memory.stage_in([5, 6])
    for i, buffers in enumerate(staging.buffers):
        for view in buffers.views:
            view[:] = bytes([0xA0 + i]) * len(view)
    assert np.array_equal(pool, before)  # nothing reaches the pool before finish
    staging.finish([True, False])
    assert _page_bytes(pool, 5) == b"\xa0" * 512
    assert _page_bytes(pool, 6) == _page_bytes(before, 6)
    assert copier.copies == [("h2d", 128, LAYOUT.num_pages * 128, 4)]  # page 5 only, in one copy
    staging.finish([True, True])  # once only
    assert copier.copies == [("h2d", 128, LAYOUT.num_pages * 128, 4)]


WINDOW = PoolLayout(num_layers=3, num_kv_heads=2, head_dim=8, dtype="float16", page_size=4, num_pages=16,
                    sliding_window=8, window_layers=(0, 2), window_pages=8)
"""Window rows apart: layer 1's rows in the pages, layers 0 and 2's in 8 window pages (128-byte chunks)."""


def test_a_window_pools_page_is_its_full_chunks_then_its_window_pages(device: tuple[
        npt.NDArray[np.uint8], DevicePoolMemory, HostCopier]) -> None:
    g = geometry(WINDOW)
    assert (g.num_chunks, g.window_chunks, g.chunk_bytes) == (6, 4, 128)
    assert list(chunk_offsets(WINDOW, 3)) == [3 * 128, 16 * 128 + 3 * 128]
    at = WINDOW.window_offset_bytes
    assert at == 2 * 16 * 128
    assert list(window_chunk_offsets(WINDOW, 5)) == [at + 5 * 128 + i * 8 * 128 for i in range(4)]
    pool = np.random.default_rng(1).integers(0, 255, WINDOW.size_bytes, dtype=np.uint8)
    copier = HostCopier()
    memory = DevicePoolMemory(WINDOW, int(pool.ctypes.data), copier, slots=4)
    win = [0] * 16
    win[3] = 5
    memory.window = win

    def chunks(page: int, window_page: int) -> bytes:
        offsets = [*chunk_offsets(WINDOW, page), *window_chunk_offsets(WINDOW, window_page)]
        return b"".join(pool[o:o + 128].tobytes() for o in offsets)

    out = memory.stage_out([3, 4])  # page 4 has no window page: window page 0's bytes are its filler
    assert [b"".join(bytes(v) for v in b.views) for b in out.buffers] == [chunks(3, 5), chunks(4, 0)]
    assert [b.flags for b in out.buffers] == [g.flags(True), g.flags(False)] == [3, 1]
    assert copier.copies == [("d2h", 128, 16 * 128, 2), ("d2h", 128, 8 * 128, 4)] * 2
    out.finish([True, True])
    copier.copies.clear()
    before = pool.copy()
    win[6] = 2
    staging = memory.stage_in([6, 7])
    for i, buffers in enumerate(staging.buffers):
        for view in buffers.views:
            view[:] = bytes([0xB0 + i]) * len(view)
    staging.finish([True, True])
    assert chunks(6, 2) == b"\xb0" * 768
    window_zero = b"".join(before[o:o + 128].tobytes() for o in window_chunk_offsets(WINDOW, 0))
    assert chunks(7, 0) == b"\xb1" * 256 + window_zero  # page 7 has no window page: window page 0 is left alone
    assert copier.copies == [("h2d", 128, 16 * 128, 2), ("h2d", 128, 8 * 128, 4), ("h2d", 128, 16 * 128, 2)]
    memory.close()


def test_a_batch_waits_for_free_slots(device: tuple[npt.NDArray[np.uint8], DevicePoolMemory, HostCopier]) -> None:
    _, memory, _ = device
    held = memory.stage_in([1, 2, 3])
    got: list[int] = []

    def second() -> None:
        s = memory.stage_in([4, 5])
        got.append(len(s.buffers))
        s.finish([False, False])

    t = threading.Thread(target=second)
    t.start()
    time.sleep(0.05)
    assert got == []  # 1 slot free, 2 needed
    held.finish([False] * 3)
    t.join(5)
    assert got == [2]
    with pytest.raises(ValueError, match="larger than the 4 staging slots"):
        memory.stage_out([1, 2, 3, 4, 5])
    memory.close()
    memory.close()


def test_cuda_vmm_maps_the_pool_for_the_tier_once_and_unmaps_it_at_close() -> None:
    layout = PoolLayout(num_layers=2, num_kv_heads=2, head_dim=8, dtype="bfloat16", page_size=4, num_pages=10)
    driver = FakeVmmDriver()
    pool = CudaVmmPool(layout, device="0", driver=driver)
    start = len(driver.calls)
    assert pool.device_address() == VA
    assert pool.device_address() == VA
    size = pool.size_bytes
    assert driver.calls[start:] == [("reserve", 0, size, GRANULARITY), ("map", 0, VA, size, 0x5EED),
                                    ("set_access", 0, VA, size, ACCESS_READWRITE)]
    pool.close()
    assert ("unmap", 0, VA, size) in driver.calls[start:]
    with pytest.raises(PoolError, match="closed"):
        pool.device_address()


def test_capture_copies_a_host_pages_chunks_into_staging(pool: Pool) -> None:
    written = pool.write(9, seed=3)
    area = pool.memory.host_area(2 * 512)
    pool.memory.capture(9, area.address + 512)
    assert area.view is not None
    assert bytes(area.view[512:]) == b"".join(written[layer, kv].tobytes() for layer in range(2) for kv in range(2))
    assert bytes(area.view[:512]) == bytes(512)  # the other slot is untouched
    area.close()
    area.close()
    with pytest.raises(ValueError, match="page 0 is outside the pool"):
        pool.memory.capture(0, 0)


def test_capture_on_a_gpu_pool_is_one_strided_copy_into_pinned_memory(device: tuple[
        npt.NDArray[np.uint8], DevicePoolMemory, HostCopier]) -> None:
    pool, memory, copier = device
    area = memory.host_area(512)
    assert area.address in copier.pinned
    memory.capture(6, area.address)
    assert area.view is not None and bytes(area.view) == _page_bytes(pool, 6)
    assert copier.copies == [("d2h", 128, LAYOUT.num_pages * 128, 4)]
    area.close()
    assert area.address not in copier.pinned  # freed through the copier
