"""Where the tier reads and writes pages: the pool itself (host pools) or a pinned staging area (GPU pools).

The pool is laid out `[num_layers][2][num_pages][page_size][heads][dim]`, so one page is `2 * num_layers`
chunks of `page_bytes`, `num_pages * page_bytes` apart. A tier value is those chunks in order (layer 0 K,
layer 0 V, layer 1 K, ...), so for a host pool the store reads and writes the pool pages in place: a disk
tier with `preadv`/`pwritev` of the chunks, Mooncake with multi-buffer puts and gets of registered pool
memory. Nothing is copied in between.

A GPU pool cannot be read by `preadv` or (without GPUDirect) by Mooncake's TCP transport, so its pages go
through a pinned host staging area of `slots` pages, laid out page-major (a slot's chunks are contiguous):
an offload copies the page's chunks device-to-host into a slot and stores the slot; a load gets into a slot,
is verified there, and only then copied host-to-device into the page, each page in one strided copy of its
chunks. The staging path is written against cuda-python's driver API; its slot handling is tested on CPU with
a host-to-host copier, and the whole path with real GPU pools by `tests/gpu/test_tier_cuda.py` (`make gpu-test`,
run on an H100 and an H200).

`stage_out(pages)` and `stage_in(pages)` hand the tier one `PageBuffers` per page; `Staging.finish(ok)`
ends the batch (for loads into a GPU pool: copies the pages whose value was sound into the pool).
Worker threads call these; nothing here touches the asyncio loop or the core.

A pool that keeps its window rows apart (docs/design.md §13) is two regions: a page's value is its chunks in the
pages' region (its full-attention layers) and then its window page's in the window region (`window`: the core's
page -> window page table, read for the pages a batch moves, which the core keeps from changing meanwhile).
A page without a window page reads (offloads) and writes (loads) window page 0's chunks instead, which is never
handed out: filler that the value's CRC does not cover and no page keeps.

Eviction staging (`staging.py`) copies pages the tier lacks out of the pool at eviction, on the loop, into
host memory this module allocates (`host_area`): `capture(page, address)` is one copy of the page's chunks
into contiguous host memory (a host pool: one strided numpy copy; a GPU pool: the same strided device-to-host
copy as `stage_out`, into pinned memory).
"""

from __future__ import annotations

import contextlib
import ctypes
import mmap
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple, Protocol, runtime_checkable

import numpy as np
import numpy.typing as npt

from cache_service.tier.value import Geometry
from kvcache_common.layout import PoolLayout


class TierMemoryError(RuntimeError):
    """The tier cannot reach the pool's memory; one line."""


def geometry(layout: PoolLayout) -> Geometry:
    """The value geometry of a pool layout: 2 * num_layers chunks of one page of one plane; a pool that keeps its
    window rows apart has its window layers' chunks last (`window_chunks`)."""
    window = 2 * len(layout.window_layers) if layout.window_pages else 0
    return Geometry(num_chunks=2 * layout.num_layers, chunk_bytes=layout.page_bytes, layout=layout.describe(),
                    window_chunks=window)


def chunk_offsets(layout: PoolLayout, page: int) -> range:
    """Byte offsets in the pool of a page's chunks, in value order (each layer's K, then its V): `start` is the
    first, `step` the distance between two (one K or V plane of the pool). A window pool: its full-attention
    layers' chunks only (`window_chunk_offsets` has the rest)."""
    plane = layout.num_pages * layout.page_bytes
    start = page * layout.page_bytes
    return range(start, start + 2 * len(layout.full_layers) * plane, plane)


def window_chunk_offsets(layout: PoolLayout, window_page: int) -> range:
    """Byte offsets in the pool of a window page's chunks (the window layers' K and V, in layer order); empty
    without window pages. Window page 0 is never handed out: it takes the window chunks of a page that has none
    (filler a value's CRC does not cover, docs/design.md §13)."""
    if not layout.window_pages:
        return range(0)
    plane = layout.window_pages * layout.page_bytes
    start = layout.window_offset_bytes + window_page * layout.page_bytes
    return range(start, start + 2 * len(layout.window_layers) * plane, plane)


class WindowTable(Protocol):
    """Page -> its window page (0: none): the core's `WindowRows.win`, read by the tier's threads for the pages
    they move (which the core keeps from changing meanwhile: docs/tiers.md, "Window pools")."""

    def __getitem__(self, page: int, /) -> int: ...


class PageBuffers(NamedTuple):
    """One page's bytes, in value order: writable views for file I/O and checksums, and their addresses for
    stores that transfer by address (registered memory)."""

    views: list[memoryview]
    addresses: list[int]
    flags: int = 0
    """The header flags of the value these bytes make (`Geometry.flags`: a window pool's, whether the page had
    its window rows when its buffers were resolved)."""


class Staging(Protocol):
    """One batch's buffers; `finish` ends it exactly once."""

    buffers: list[PageBuffers]

    def finish(self, ok: Sequence[bool]) -> None:
        """Loads: the pages whose value was sound (ok[i]) become visible in the pool. Offloads: ok is ignored.
        Releases staging slots."""


class PageMemory(Protocol):
    """Host-addressable bytes of pool pages, for the tier's worker threads."""

    geometry: Geometry
    window: WindowTable | None
    """A window pool's page -> window page (set once the core exists); None: none (every page windowless)."""

    def value_flags(self, pages: Sequence[int]) -> list[int]:
        """The header flags of the pages' values as they are now (whether each has its window page)."""

    def regions(self) -> list[tuple[int, int]]:
        """(address, bytes) of the host memory the store transfers to and from: what to register."""

    def stage_out(self, pages: Sequence[int]) -> Staging:
        """Buffers holding the pages' bytes, ready to be stored."""

    def stage_in(self, pages: Sequence[int]) -> Staging:
        """Buffers a load writes into; `finish(ok)` makes the sound ones the pages' bytes."""

    @property
    def max_batch_pages(self) -> int:
        """The most pages one staging batch may hold (a worker splits bigger batches)."""

    def host_area(self, nbytes: int) -> HostArea:
        """`nbytes` of host memory the store can transfer from (pinned for a GPU pool); the caller closes it."""

    def capture(self, page: int, address: int) -> None:
        """Copy the page's chunks, in value order, into `payload_bytes` of host memory at `address` (in a
        `host_area`), synchronously: when it returns, the page may be reused."""

    def close(self) -> None: ...


@runtime_checkable
class PackedMemory(Protocol):
    """Page memory that copies a batch of pages to and from one array, `[n, payload_bytes]` (rows may be
    strided, e.g. the payload columns of an `[n, value_bytes]` array): one copy a batch, not one a chunk."""

    def gather(self, pages: Sequence[int], out: Any) -> None: ...

    def scatter(self, pages: Sequence[int], src: Any) -> None: ...


class HostArea:
    """Host memory for eviction staging: `address`, `view` (writable bytes), `close()` (idempotent; frees it
    through `free`, or leaves an mmap to the garbage collector)."""

    def __init__(self, address: int, view: memoryview, free: Any = None, owner: Any = None) -> None:
        self.address = address
        self.view: memoryview | None = view
        self.nbytes = len(view)
        self._free = free
        self._owner = owner
        """What keeps the memory alive (an anonymous mmap)."""

    def close(self) -> None:
        if self.view is None:
            return
        self.view.release()
        self.view = None
        free, self._free = self._free, None
        if free is not None:
            free(self.address)
        owner, self._owner = self._owner, None
        if isinstance(owner, mmap.mmap):
            with contextlib.suppress(BufferError):  # a buffer still exported: the mapping goes with the last one
                owner.close()


def _value_flags(memory: PageMemory, pages: Sequence[int]) -> list[int]:
    g = memory.geometry
    if not g.window_chunks:
        return [0] * len(pages)
    win = memory.window
    return [g.flags(win is not None and win[p] != 0) for p in pages]


def _window_page(memory: PageMemory, page: int) -> int:
    win = memory.window
    return 0 if win is None else int(win[page])


# --------------------------------------------------------------------------------------------- host pools


@dataclass
class _InPlace:
    buffers: list[PageBuffers]

    def finish(self, ok: Sequence[bool]) -> None:
        pass


class HostPoolMemory:
    """The service's own shared mapping of a host pool (host_shm's file or host_memfd's fd): the tier reads
    and writes pages in place. `close()` (idempotent) unmaps it once no buffer is in use."""

    def __init__(self, layout: PoolLayout, fd: int) -> None:
        self.layout = layout
        self.geometry = geometry(layout)
        try:
            self._mmap: mmap.mmap | None = mmap.mmap(fd, layout.size_bytes, mmap.MAP_SHARED,
                                                     mmap.PROT_READ | mmap.PROT_WRITE)
        except (OSError, ValueError) as e:
            raise TierMemoryError(f"cannot map the pool for the tier: {e}") from None
        self._array: npt.NDArray[np.uint8] | None = np.frombuffer(self._mmap, dtype=np.uint8)
        self._base = int(self._array.ctypes.data)
        full = 2 * len(layout.full_layers)
        self._planes: npt.NDArray[np.uint8] | None = self._array[:layout.num_pages * layout.bytes_per_page].reshape(
            full, layout.num_pages, layout.page_bytes)
        """The pages' region as `[2 * layers][pages][page bytes]`: `[:, page]` is a page's chunks in value order
        (a window pool: its full-attention layers')."""
        self._window_planes: npt.NDArray[np.uint8] | None = self._array[layout.window_offset_bytes:].reshape(
            2 * len(layout.window_layers), layout.window_pages, layout.page_bytes) if layout.window_pages else None
        """A window pool's window region as `[2 * window layers][window pages][page bytes]`."""
        self.window: WindowTable | None = None

    @property
    def base_address(self) -> int:
        return self._base

    @property
    def max_batch_pages(self) -> int:
        return self.layout.num_pages

    def regions(self) -> list[tuple[int, int]]:
        return [(self._base, self.layout.size_bytes)]

    def page(self, page: int) -> PageBuffers:
        """A page's chunks in the pool."""
        array = self._array
        if array is None:
            raise TierMemoryError("the tier's pool mapping is closed")
        if not 0 < page < self.layout.num_pages:
            raise ValueError(f"page {page} is outside the pool (1..{self.layout.num_pages - 1})")
        offsets = [*chunk_offsets(self.layout, page), *window_chunk_offsets(self.layout, _window_page(self, page))]
        size = self.layout.page_bytes
        return PageBuffers([array[o:o + size].data for o in offsets], [self._base + o for o in offsets],
                           _value_flags(self, (page,))[0])

    def value_flags(self, pages: Sequence[int]) -> list[int]:
        return _value_flags(self, pages)

    def stage_out(self, pages: Sequence[int]) -> Staging:
        return _InPlace([self.page(p) for p in pages])

    def stage_in(self, pages: Sequence[int]) -> Staging:
        return _InPlace([self.page(p) for p in pages])

    def _batch(self, pages: Sequence[int], rows: Any) -> tuple[Any, Any, Any]:
        planes = self._planes
        if planes is None:
            raise TierMemoryError("the tier's pool mapping is closed")
        index = np.asarray(pages, dtype=np.intp)
        if index.size and (index.min() < 1 or index.max() >= self.layout.num_pages):
            raise ValueError(f"a page outside the pool (1..{self.layout.num_pages - 1})")
        view = rows.reshape(len(index), self.geometry.num_chunks, self.layout.page_bytes)
        if not np.shares_memory(view, rows):
            raise ValueError("the rows must reshape into chunks without a copy")
        return planes, index, view

    def _window_index(self, pages: Sequence[int]) -> Any:
        win = self.window
        return np.asarray([0 if win is None else win[p] for p in pages], dtype=np.intp)

    def gather(self, pages: Sequence[int], out: Any) -> None:
        """The pages' payloads into the rows of `out` (`[n, payload_bytes]`), in value order (a window pool's
        window chunks from each page's window page, window page 0's filler where it has none)."""
        planes, index, view = self._batch(pages, out)
        full = planes.shape[0]
        view[:, :full] = planes[:, index].transpose(1, 0, 2)
        if self._window_planes is not None:
            view[:, full:] = self._window_planes[:, self._window_index(pages)].transpose(1, 0, 2)

    def scatter(self, pages: Sequence[int], src: Any) -> None:
        """The rows of `src` (`[n, payload_bytes]`) into the pages (a window pool's window chunks into the window
        pages of the pages that have one)."""
        planes, index, view = self._batch(pages, src)
        full = planes.shape[0]
        planes[:, index] = view[:, :full].transpose(1, 0, 2)
        if self._window_planes is not None:
            windex = self._window_index(pages)
            has = windex != 0
            if has.any():
                self._window_planes[:, windex[has]] = view[has, full:].transpose(1, 0, 2)

    def host_area(self, nbytes: int) -> HostArea:
        mm = mmap.mmap(-1, nbytes, mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        view = memoryview(mm).cast("B")
        address = ctypes.addressof(ctypes.c_char.from_buffer(mm))
        return HostArea(address, view, owner=mm)

    def capture(self, page: int, address: int) -> None:
        planes = self._planes
        if planes is None:
            raise TierMemoryError("the tier's pool mapping is closed")
        if not 0 < page < self.layout.num_pages:
            raise ValueError(f"page {page} is outside the pool (1..{self.layout.num_pages - 1})")
        chunks, size = self.geometry.num_chunks, self.layout.page_bytes
        dst = np.ctypeslib.as_array((ctypes.c_uint8 * (chunks * size)).from_address(address)).reshape(chunks, size)
        full = planes.shape[0]
        dst[:full] = planes[:, page]
        if self._window_planes is not None:
            dst[full:] = self._window_planes[:, _window_page(self, page)]

    def close(self) -> None:
        if self._mmap is None:
            return
        self._array = None
        self._planes = None
        self._window_planes = None
        mm, self._mmap = self._mmap, None
        with contextlib.suppress(BufferError):  # a view is still referenced: the mapping goes with the last one
            mm.close()


# --------------------------------------------------------------------------------------------- GPU pools


class DeviceCopier(Protocol):
    """Synchronous copies between device memory and pinned host memory, and the pinned allocations."""

    def alloc_pinned(self, nbytes: int) -> int: ...

    def free_pinned(self, address: int) -> None: ...

    def gather(self, host: int, device: int, chunk: int, pitch: int, count: int) -> None:
        """Device to host: `count` chunks of `chunk` bytes, `pitch` apart from `device`, into contiguous host
        memory at `host`."""

    def scatter(self, device: int, host: int, chunk: int, pitch: int, count: int) -> None:
        """Host to device: contiguous `count * chunk` bytes at `host` into chunks `pitch` apart from `device`."""


class CudaCopier:
    """DeviceCopier over cuda-python's driver API in the device's primary context (the one cupy, torch and
    the pool backends use). A page's chunks go in one strided copy (`cuMemcpy2D`) where the pool's plane is
    within the device's maximum pitch, else one copy a chunk; `max_pitch = 0` forces the latter (the benchmark's
    comparison)."""

    def __init__(self, device_index: int) -> None:
        from cuda.bindings import driver  # optional dependency (kvcache[cuda])

        self._cu: Any = driver
        self._check("cuInit", driver.cuInit(0))
        device = self._check("cuDeviceGet", driver.cuDeviceGet(device_index))
        self._ctx = self._check("cuDevicePrimaryCtxRetain", driver.cuDevicePrimaryCtxRetain(device))
        self._device = device
        self._lock = threading.Lock()
        self.max_pitch: int = self._check("cuDeviceGetAttribute", driver.cuDeviceGetAttribute(
            driver.CUdevice_attribute.CU_DEVICE_ATTRIBUTE_MAX_PITCH, device))

    def _check(self, call: str, result: Any) -> Any:
        err, *values = result if isinstance(result, tuple) else (result,)
        if err != self._cu.CUresult.CUDA_SUCCESS:
            raise TierMemoryError(f"{call}: {getattr(err, 'name', err)}")
        return values[0] if len(values) == 1 else None

    def _in_context(self, call: str, fn: Any, *args: Any) -> Any:
        cu = self._cu
        with self._lock:
            self._check("cuCtxPushCurrent", cu.cuCtxPushCurrent(self._ctx))
            try:
                return self._check(call, fn(*args))
            finally:
                self._check("cuCtxPopCurrent", cu.cuCtxPopCurrent())

    def alloc_pinned(self, nbytes: int) -> int:
        return int(self._in_context("cuMemHostAlloc", self._cu.cuMemHostAlloc, nbytes, 0))

    def free_pinned(self, address: int) -> None:
        self._in_context("cuMemFreeHost", self._cu.cuMemFreeHost, address)

    def _copy(self, to_host: bool, host: int, device: int, chunk: int, pitch: int, count: int) -> None:
        """`count` chunks between contiguous host memory and device memory `pitch` apart: one cuMemcpy2D, or one
        copy a chunk where the pitch exceeds the device's maximum."""
        cu = self._cu
        if pitch > self.max_pitch:
            for i in range(count):
                h, d = host + i * chunk, cu.CUdeviceptr(device + i * pitch)
                if to_host:
                    self._in_context("cuMemcpyDtoH", cu.cuMemcpyDtoH, h, d, chunk)
                else:
                    self._in_context("cuMemcpyHtoD", cu.cuMemcpyHtoD, d, h, chunk)
            return
        copy = cu.CUDA_MEMCPY2D()
        copy.WidthInBytes, copy.Height = chunk, count
        on_host, on_device = cu.CUmemorytype.CU_MEMORYTYPE_HOST, cu.CUmemorytype.CU_MEMORYTYPE_DEVICE
        if to_host:
            copy.srcMemoryType, copy.srcDevice, copy.srcPitch = on_device, cu.CUdeviceptr(device), pitch
            copy.dstMemoryType, copy.dstHost, copy.dstPitch = on_host, host, chunk
        else:
            copy.srcMemoryType, copy.srcHost, copy.srcPitch = on_host, host, chunk
            copy.dstMemoryType, copy.dstDevice, copy.dstPitch = on_device, cu.CUdeviceptr(device), pitch
        self._in_context("cuMemcpy2D", cu.cuMemcpy2D, copy)

    def gather(self, host: int, device: int, chunk: int, pitch: int, count: int) -> None:
        self._copy(True, host, device, chunk, pitch, count)

    def scatter(self, device: int, host: int, chunk: int, pitch: int, count: int) -> None:
        self._copy(False, host, device, chunk, pitch, count)

    def close(self) -> None:
        self._check("cuDevicePrimaryCtxRelease", self._cu.cuDevicePrimaryCtxRelease(self._device))


class _Slots:
    def __init__(self, memory: DevicePoolMemory, pages: Sequence[int], slots: list[int], inbound: bool,
                 flags: Sequence[int] = ()) -> None:
        self._memory = memory
        self._pages = list(pages)
        self._slots = slots
        self._inbound = inbound
        self._done = False
        self.buffers = [memory.slot(s) for s in slots]
        if flags:
            self.buffers = [b._replace(flags=f) for b, f in zip(self.buffers, flags, strict=True)]

    def finish(self, ok: Sequence[bool]) -> None:
        if self._done:
            return
        self._done = True
        try:
            if self._inbound:
                for page, slot, good in zip(self._pages, self._slots, ok, strict=True):
                    if good:
                        self._memory.copy_slot_to_page(slot, page)
        finally:
            self._memory.release(self._slots)


class DevicePoolMemory:
    """A GPU pool seen through `slots` pages of pinned host staging (page-major, registered with the store
    instead of the pool). `device_base` is the pool's address in this process (the service's own mapping);
    `copier` makes the copies. Worker threads share the slots under a lock; a batch larger than the free
    slots waits for them."""

    def __init__(self, layout: PoolLayout, device_base: int, copier: DeviceCopier, slots: int = 256) -> None:
        if slots < 1:
            raise ValueError("the staging area needs at least one slot")
        self.layout = layout
        self.geometry = geometry(layout)
        self._device_base = device_base
        self._copier = copier
        self._slot_bytes = self.geometry.payload_bytes
        self._nslots = slots
        self._host = copier.alloc_pinned(slots * self._slot_bytes)
        self._view: memoryview | None = memoryview(
            (ctypes.c_char * (slots * self._slot_bytes)).from_address(self._host)).cast("B")
        self._free = list(range(slots - 1, -1, -1))
        self._cond = threading.Condition()
        self.window: WindowTable | None = None

    @property
    def max_batch_pages(self) -> int:
        return self._nslots

    def regions(self) -> list[tuple[int, int]]:
        return [(self._host, self._nslots * self._slot_bytes)]

    def value_flags(self, pages: Sequence[int]) -> list[int]:
        return _value_flags(self, pages)

    def _copy_page(self, to_host: bool, host: int, page: int, window_page: int) -> None:
        """A page's chunks between `host` (contiguous, value order) and the pool: one strided copy of its
        full-attention chunks and, on a window pool, one of its window page's (into the pool only where the page
        has one)."""
        chunk = self.geometry.chunk_bytes
        c = chunk_offsets(self.layout, page)
        w = window_chunk_offsets(self.layout, window_page)
        for at, span in ((host, c), (host + len(c) * chunk, w)):
            if not len(span) or (span is w and not to_host and not window_page):
                continue
            if to_host:
                self._copier.gather(at, self._device_base + span.start, chunk, span.step, len(span))
            else:
                self._copier.scatter(self._device_base + span.start, at, chunk, span.step, len(span))

    def slot(self, slot: int) -> PageBuffers:
        view = self._view
        if view is None:
            raise TierMemoryError("the tier's staging area is closed")
        chunk = self.geometry.chunk_bytes
        start = slot * self._slot_bytes
        offsets = range(start, start + self._slot_bytes, chunk)
        return PageBuffers([view[o:o + chunk] for o in offsets], [self._host + o for o in offsets])

    def _take(self, n: int) -> list[int]:
        if n > self._nslots:
            raise ValueError(f"a batch of {n} pages is larger than the {self._nslots} staging slots")
        with self._cond:
            self._cond.wait_for(lambda: len(self._free) >= n)
            return [self._free.pop() for _ in range(n)]

    def release(self, slots: Sequence[int]) -> None:
        with self._cond:
            self._free.extend(slots)
            self._cond.notify_all()

    def stage_out(self, pages: Sequence[int]) -> Staging:
        slots = self._take(len(pages))
        try:
            for page, slot in zip(pages, slots, strict=True):
                self._copy_page(True, self._host + slot * self._slot_bytes, page, _window_page(self, page))
        except BaseException:
            self.release(slots)
            raise
        return _Slots(self, pages, slots, inbound=False, flags=self.value_flags(pages))

    def stage_in(self, pages: Sequence[int]) -> Staging:
        return _Slots(self, pages, self._take(len(pages)), inbound=True)

    def host_area(self, nbytes: int) -> HostArea:
        address = self._copier.alloc_pinned(nbytes)
        view = memoryview((ctypes.c_char * nbytes).from_address(address)).cast("B")
        return HostArea(address, view, free=self._copier.free_pinned)

    def capture(self, page: int, address: int) -> None:
        if self._view is None:
            raise TierMemoryError("the tier's staging area is closed")
        self._copy_page(True, address, page, _window_page(self, page))

    def copy_slot_to_page(self, slot: int, page: int) -> None:
        """A verified slot into its page (a window pool's window chunks only where the page has a window page)."""
        self._copy_page(False, self._host + slot * self._slot_bytes, page, _window_page(self, page))

    def close(self) -> None:
        if self._view is None:
            return
        self._view = None
        self._copier.free_pinned(self._host)
