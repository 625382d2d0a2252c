"""The `cuda_vmm` backend: the pool is one cuMemCreate allocation, exported as a POSIX file descriptor.

The allocation is made with the CUDA driver's virtual memory management API and the POSIX-fd handle type,
so `cuMemExportToShareableHandle` turns it into an fd that the pool socket hands to engines (SCM_RIGHTS,
`kvcache_common.pool_socket`); engines import, reserve, map and set access themselves. Unlike
cuda_ipc this needs no shared IPC namespace (no hostIPC in Kubernetes), only the socket.

Sizes are rounded up to the allocation granularity (2 MiB on current GPUs), so `handle().size_bytes` can
exceed the layout's size; the layout starts at offset 0. The service maps the allocation only to zero it,
then unmaps: it never touches KV bytes. `close()` releases the service's handle and fd; the memory lives
on while engines hold their imports, and goes back to the GPU when the last one releases it.

The driver calls sit behind `VmmDriver` (`kvcache_common.cuda_driver.CudaDriver`, over cuda-python, in
production), so everything but the calls themselves is tested without a GPU.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable
from typing import Protocol

from cache_service.memory.base import OwnedFdPool, PoolError, PoolHandle, format_bytes
from cache_service.memory.cuda_ipc import resolve_device
from kvcache_common.cuda_driver import ACCESS_READWRITE, CudaDriver
from kvcache_common.layout import PoolLayout

ATTR_VMM = "VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED"
ATTR_POSIX_FD = "HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED"


class VmmDriver(Protocol):
    """The CUDA driver calls the backend makes. Handles and addresses are plain ints."""

    def device_count(self) -> int: ...

    def device_uuid(self, index: int) -> str: ...

    def attribute(self, index: int, name: str) -> int:
        """CU_DEVICE_ATTRIBUTE_<name> of device `index`."""
        ...

    def granularity(self, index: int) -> int:
        """The minimum granularity, in bytes, of a POSIX-fd exportable allocation on device `index`."""
        ...

    def create(self, index: int, nbytes: int) -> int:
        """cuMemCreate: `nbytes` of device memory exportable as a POSIX fd; the allocation handle."""
        ...

    def export_fd(self, index: int, handle: int) -> int:
        """cuMemExportToShareableHandle: a new fd the caller owns."""
        ...

    def reserve(self, index: int, nbytes: int, alignment: int) -> int: ...

    def map(self, index: int, va: int, nbytes: int, handle: int) -> None: ...

    def set_access(self, index: int, va: int, nbytes: int, flags: int) -> None:
        """Grant device `index` the access `flags` (CUmemAccess_flags) to [va, va + nbytes)."""
        ...

    def memset(self, index: int, va: int, value: int, nbytes: int) -> None:
        """Fill [va, va + nbytes) with the byte `value` and wait for it."""
        ...

    def unmap(self, index: int, va: int, nbytes: int) -> None: ...

    def free_address(self, index: int, va: int, nbytes: int) -> None: ...

    def release(self, index: int, handle: int) -> None: ...

    def free_memory(self, index: int) -> int:
        """Bytes of device `index`'s memory free right now."""
        ...

    def close(self) -> None:
        """Drop what the driver object holds (contexts); after every other call."""
        ...


def fd_export_problem(driver: VmmDriver, index: int) -> str:
    """Why device `index` cannot hold a cuda_vmm pool, or "" when it can."""
    if not driver.attribute(index, ATTR_VMM):
        return f"does not support CUDA virtual memory management (CU_DEVICE_ATTRIBUTE_{ATTR_VMM}=0)"
    if not driver.attribute(index, ATTR_POSIX_FD):
        return f"cannot export memory as POSIX file descriptors (CU_DEVICE_ATTRIBUTE_{ATTR_POSIX_FD}=0)"
    return ""


def round_up(nbytes: int, granularity: int) -> int:
    return -(-nbytes // granularity) * granularity


def _one_line(e: BaseException) -> str:
    lines = str(e).strip().splitlines()
    return lines[0] if lines else type(e).__name__


def open_driver(factory: Callable[[], VmmDriver] | None = None) -> VmmDriver:
    """A driver, or a one-line PoolError saying what is missing."""
    try:
        return factory() if factory is not None else CudaDriver()
    except ImportError:
        raise PoolError("cuda_vmm needs cuda-python in the service (pip install 'kvcache[cuda]'); use --backend "
                        "cuda_ipc or host_shm") from None
    except Exception as e:  # the library is missing (cuda.pathfinder) or cuInit failed
        raise PoolError(f"cannot initialise the CUDA driver ({_one_line(e)}); use --backend host_shm") from None


class CudaVmmPool(OwnedFdPool):
    """Owns the allocation handle and its exported fd. `export_fd()` is what the pool socket sends;
    `close()` (idempotent) releases the service's references in reverse order of acquisition."""

    name = "cuda_vmm"

    def __init__(self, layout: PoolLayout, *, device: str, driver: VmmDriver | None = None,
                 size_flag: str = "--num-pages") -> None:
        self.layout = layout
        self._driver: VmmDriver = driver if driver is not None else open_driver()
        self.device_index = -1
        self.device_uuid = ""
        self.granularity = 0
        self.size_bytes = 0
        """The allocation's size: the layout's, rounded up to the granularity."""
        self._handle: int | None = None
        self._fd: int | None = None
        self._va: int | None = None
        self._mapped = False
        self._open = True
        """Open from here on: a start that fails releases what it acquired through `close()`."""
        d = self._driver
        try:
            uuids = [d.device_uuid(i) for i in range(d.device_count())]
        except Exception as e:
            self._discard()
            raise PoolError(f"cannot list CUDA devices ({_one_line(e)}); use --backend host_shm") from None
        try:
            self.device_index = resolve_device(device, uuids, mig_ok=True)
        except PoolError:
            self._discard()
            raise
        self.device_uuid = uuids[self.device_index]
        where = f"GPU {self.device_index} ({self.device_uuid})"
        try:
            problem = fd_export_problem(d, self.device_index)
            if problem:
                self._discard()
                raise PoolError(f"{where} {problem}: use --backend cuda_ipc")
            self.granularity = d.granularity(self.device_index)
        except PoolError:
            raise
        except Exception as e:
            self._discard()
            raise PoolError(f"cannot query {where} for virtual memory management: {_one_line(e)}") from None
        self.size_bytes = round_up(layout.size_bytes, self.granularity)
        index = self.device_index
        try:
            self._handle = d.create(index, self.size_bytes)
        except Exception as e:
            self._discard()
            raise PoolError(f"cannot allocate a {format_bytes(self.size_bytes)} pool on {where}: {_one_line(e)}; "
                            f"lower {size_flag}") from None
        try:
            self._fd = d.export_fd(index, self._handle)
            os.set_inheritable(self._fd, False)  # engines get it over the socket, never by inheritance
        except Exception as e:
            self._discard()
            raise PoolError(f"cannot export the pool on {where} as a file descriptor: {_one_line(e)}; use "
                            "--backend cuda_ipc") from None
        try:
            self._zero()
        except Exception as e:
            self._discard()
            raise PoolError(f"cannot zero the pool on {where}: {_one_line(e)}") from None

    def _zero(self) -> None:
        """Map the allocation, zero it, unmap it: the service itself never reads or writes KV."""
        d, index, size, handle = self._driver, self.device_index, self.size_bytes, self._handle
        assert handle is not None, "zeroing needs the allocation"
        self._va = d.reserve(index, size, self.granularity)
        d.map(index, self._va, size, handle)
        self._mapped = True
        d.set_access(index, self._va, size, ACCESS_READWRITE)
        d.memset(index, self._va, 0, size)
        self._unmap()

    def device_address(self) -> int:
        """Map the pool into this process (once; unmapped by `close()`) and return its device address: the
        tier copies pages through it. Without a tier the service never maps the pool after zeroing it."""
        if self.closed or self._handle is None:
            raise PoolError("the pool is closed")
        if not self._mapped:
            d, index, size = self._driver, self.device_index, self.size_bytes
            self._va = d.reserve(index, size, self.granularity)
            try:
                d.map(index, self._va, size, self._handle)
                self._mapped = True
                d.set_access(index, self._va, size, ACCESS_READWRITE)
            except Exception as e:
                self._unmap()
                raise PoolError(f"cannot map the cuda_vmm pool for the tier: {_one_line(e)}") from None
        assert self._va is not None, "a mapping has an address"
        return self._va

    def _unmap(self) -> None:
        d, index = self._driver, self.device_index
        if self._mapped:
            assert self._va is not None, "a mapping has an address"
            self._mapped = False
            d.unmap(index, self._va, self.size_bytes)
        if self._va is not None:
            va, self._va = self._va, None
            d.free_address(index, va, self.size_bytes)

    def handle(self) -> PoolHandle:
        return PoolHandle(backend=self.name, size_bytes=self.size_bytes, device_uuid=self.device_uuid,
                          offset_bytes=0)

    def _release(self) -> None:
        """Unmap (while zeroing, or the tier's mapping), free the address range, release the allocation handle,
        close the fd, then the driver. Every step runs even when one fails; failures are raised together after."""
        errors: list[str] = []
        steps: list[Callable[[], None]] = [self._unmap, self._release_handle, self._close_fd, self._driver.close]
        for step in steps:
            try:
                step()
            except Exception as e:
                errors.append(_one_line(e))
        if errors:
            raise PoolError(f"releasing the cuda_vmm pool: {'; '.join(errors)}")

    def _release_handle(self) -> None:
        if self._handle is not None:
            handle, self._handle = self._handle, None
            self._driver.release(self.device_index, handle)

    def _discard(self) -> None:
        """Release what a failed start acquired; its own failure must not hide the start's."""
        with contextlib.suppress(PoolError):
            self.close()
