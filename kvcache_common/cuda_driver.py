"""The CUDA driver calls behind the fd-handed GPU pool (`cuda_vmm`), for both sides: the service creates,
exports and zeroes the allocation; engines import, reserve, map and set access. One wrapper over
cuda-python's driver bindings (the optional `kvcache[cuda]` dependency), imported when first constructed.

Each call runs in the device's primary context (the one the CUDA runtime, cupy and torch use), retained
once per device and released by `close()`. Handles and addresses are plain ints. A failing call raises
`CudaError` naming the call and its CUresult.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

ACCESS_READWRITE = 3
"""CU_MEM_ACCESS_FLAGS_PROT_READWRITE."""


class CudaError(RuntimeError):
    """A CUDA driver call failed; the message names the call and the CUresult."""


def format_uuid(raw: bytes) -> str:
    """A device's 16 UUID bytes as nvidia-smi prints them: 'GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx'."""
    if len(raw) != 16:
        raise ValueError(f"a CUDA device UUID has 16 bytes, got {len(raw)}")
    h = raw.hex()
    return f"GPU-{h[:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:]}"


class CudaDriver:
    """cuda-python's driver bindings, the calls both sides make. Raises ImportError without cuda-python and
    CudaError when cuInit fails for any reason but "no device" (then `device_count()` is 0)."""

    def __init__(self) -> None:
        from cuda.bindings import driver  # optional dependency (kvcache[cuda])

        self._cu: Any = driver
        self._contexts: dict[int, Any] = {}
        (err,) = driver.cuInit(0)
        self._no_device = err == driver.CUresult.CUDA_ERROR_NO_DEVICE
        if not self._no_device:
            self._check("cuInit", (err,))

    # ------------------------------------------------------------------ plumbing

    def _check(self, call: str, result: tuple[Any, ...]) -> Any:
        err, *values = result
        if err != self._cu.CUresult.CUDA_SUCCESS:
            raise CudaError(f"{call}: {getattr(err, 'name', err)}")
        return values[0] if len(values) == 1 else tuple(values) or None

    def _device(self, index: int) -> Any:
        return self._check("cuDeviceGet", self._cu.cuDeviceGet(index))

    @contextlib.contextmanager
    def _context(self, index: int) -> Iterator[None]:
        cu = self._cu
        if index not in self._contexts:
            self._contexts[index] = self._check("cuDevicePrimaryCtxRetain",
                                                cu.cuDevicePrimaryCtxRetain(self._device(index)))
        self._check("cuCtxPushCurrent", cu.cuCtxPushCurrent(self._contexts[index]))
        try:
            yield
        finally:
            self._check("cuCtxPopCurrent", cu.cuCtxPopCurrent())

    def _prop(self, index: int) -> Any:
        """A pinned device allocation on `index`, exportable as a POSIX fd."""
        cu = self._cu
        prop = cu.CUmemAllocationProp()
        prop.type = cu.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
        prop.location.type = cu.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
        prop.location.id = index
        prop.requestedHandleTypes = cu.CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR
        return prop

    # ------------------------------------------------------------------ devices

    def device_count(self) -> int:
        return 0 if self._no_device else int(self._check("cuDeviceGetCount", self._cu.cuDeviceGetCount()))

    def device_uuid(self, index: int) -> str:
        uuid = self._check("cuDeviceGetUuid", self._cu.cuDeviceGetUuid(self._device(index)))
        return format_uuid(bytes(uuid.bytes))

    def device_uuids(self) -> list[str]:
        """Every visible device's UUID, by this process's ordinal."""
        return [self.device_uuid(i) for i in range(self.device_count())]

    def attribute(self, index: int, name: str) -> int:
        """CU_DEVICE_ATTRIBUTE_<name> of device `index`."""
        attr = getattr(self._cu.CUdevice_attribute, f"CU_DEVICE_ATTRIBUTE_{name}")
        return int(self._check("cuDeviceGetAttribute", self._cu.cuDeviceGetAttribute(attr, self._device(index))))

    def free_memory(self, index: int) -> int:
        """Bytes of device `index`'s memory free right now (cuMemGetInfo)."""
        with self._context(index):
            free, _total = self._check("cuMemGetInfo", self._cu.cuMemGetInfo())
            return int(free)

    # ------------------------------------------------------------------ allocations

    def granularity(self, index: int) -> int:
        """The minimum granularity, in bytes, of a POSIX-fd exportable allocation on device `index`."""
        flag = self._cu.CUmemAllocationGranularity_flags.CU_MEM_ALLOC_GRANULARITY_MINIMUM
        return int(self._check("cuMemGetAllocationGranularity",
                               self._cu.cuMemGetAllocationGranularity(self._prop(index), flag)))

    def create(self, index: int, nbytes: int) -> int:
        """cuMemCreate: `nbytes` of device memory exportable as a POSIX fd; the allocation handle."""
        with self._context(index):
            return int(self._check("cuMemCreate", self._cu.cuMemCreate(nbytes, self._prop(index), 0)))

    def export_fd(self, index: int, handle: int) -> int:
        """cuMemExportToShareableHandle: a new fd the caller owns."""
        cu = self._cu
        with self._context(index):
            return int(self._check("cuMemExportToShareableHandle", cu.cuMemExportToShareableHandle(
                cu.CUmemGenericAllocationHandle(handle),
                cu.CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 0)))

    def import_fd(self, index: int, fd: int) -> int:
        """cuMemImportFromShareableHandle: an allocation handle; `fd` stays the caller's to close."""
        cu = self._cu
        with self._context(index):
            # For the POSIX-fd handle type the "OS handle" is the fd's number itself.
            return int(self._check("cuMemImportFromShareableHandle", cu.cuMemImportFromShareableHandle(
                fd, cu.CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR)))

    def release(self, index: int, handle: int) -> None:
        with self._context(index):
            self._check("cuMemRelease", self._cu.cuMemRelease(self._cu.CUmemGenericAllocationHandle(handle)))

    # ------------------------------------------------------------------ mappings

    def reserve(self, index: int, nbytes: int, alignment: int) -> int:
        with self._context(index):
            return int(self._check("cuMemAddressReserve", self._cu.cuMemAddressReserve(nbytes, alignment, 0, 0)))

    def map(self, index: int, va: int, nbytes: int, handle: int) -> None:
        cu = self._cu
        with self._context(index):
            self._check("cuMemMap", cu.cuMemMap(cu.CUdeviceptr(va), nbytes, 0,
                                                cu.CUmemGenericAllocationHandle(handle), 0))

    def set_access(self, index: int, va: int, nbytes: int, flags: int) -> None:
        """Grant device `index` the access `flags` (CUmemAccess_flags) to [va, va + nbytes)."""
        cu = self._cu
        desc = cu.CUmemAccessDesc()
        desc.location.type = cu.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
        desc.location.id = index
        desc.flags = cu.CUmemAccess_flags(flags)
        with self._context(index):
            self._check("cuMemSetAccess", cu.cuMemSetAccess(cu.CUdeviceptr(va), nbytes, [desc], 1))

    def memset(self, index: int, va: int, value: int, nbytes: int) -> None:
        """Fill [va, va + nbytes) with the byte `value` and wait for it."""
        cu = self._cu
        with self._context(index):
            self._check("cuMemsetD8", cu.cuMemsetD8(cu.CUdeviceptr(va), value, nbytes))
            self._check("cuCtxSynchronize", cu.cuCtxSynchronize())

    def unmap(self, index: int, va: int, nbytes: int) -> None:
        with self._context(index):
            self._check("cuMemUnmap", self._cu.cuMemUnmap(self._cu.CUdeviceptr(va), nbytes))

    def free_address(self, index: int, va: int, nbytes: int) -> None:
        with self._context(index):
            self._check("cuMemAddressFree", self._cu.cuMemAddressFree(self._cu.CUdeviceptr(va), nbytes))

    def close(self) -> None:
        """Release the primary contexts retained; after every other call."""
        contexts, self._contexts = self._contexts, {}
        for index in contexts:
            self._check("cuDevicePrimaryCtxRelease", self._cu.cuDevicePrimaryCtxRelease(self._device(index)))
