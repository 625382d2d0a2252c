"""Map a `cuda_vmm` pool: receive the service's allocation as a file descriptor over its pool socket, import
it, reserve an address range, map it with read/write access on the local GPU and wrap it as a torch CUDA
tensor, no copy.

The GPU is found by UUID (ordinals differ between processes). Each `map_cuda_vmm` imports and maps on its
own; the import keeps the memory alive even after the service has released it, until `close()` unmaps
the range, frees it and releases the import. Tensors derived from the pool must not be used after
`close()`: the range is unmapped, not reference-counted.

The tensor reaches torch through `__cuda_array_interface__` (torch keeps the pointer, no cupy needed);
the CUDA driver calls go through cuda-python. Both sit behind `VmmImporter` so that the logic around them
is tested without a GPU.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Protocol

import torch

from engine_client.errors import PoolMappingError
from engine_client.mapping.base import Device, MappedPool, PoolImporter, split_regions
from engine_client.mapping.cuda_ipc import find_device, normalize_uuid
from engine_client.mapping.fd import receive_pool_fd
from engine_client.types import PoolInfo
from kvcache_common.cuda_driver import ACCESS_READWRITE, CudaDriver


class VmmImporter(Protocol):
    """The CUDA driver calls an import makes. Handles and addresses are plain ints; `index` is a CUDA
    ordinal of this process (the same as torch's)."""

    def device_uuids(self) -> list[str]: ...

    def granularity(self, index: int) -> int:
        """The minimum allocation granularity, in bytes, of a POSIX-fd allocation on device `index`."""
        ...

    def import_fd(self, index: int, fd: int) -> int:
        """cuMemImportFromShareableHandle: an allocation handle; `fd` stays the caller's to close."""
        ...

    def reserve(self, index: int, nbytes: int, alignment: int) -> int: ...

    def map(self, index: int, va: int, nbytes: int, handle: int) -> None: ...

    def set_access(self, index: int, va: int, nbytes: int, flags: int) -> None:
        """Grant device `index` the access `flags` (CUmemAccess_flags) to [va, va + nbytes)."""
        ...

    def wrap(self, index: int, va: int, nbytes: int) -> torch.Tensor:
        """A uint8 CUDA tensor over [va, va + nbytes) on device `index`, without copying."""
        ...

    def unmap(self, index: int, va: int, nbytes: int) -> None: ...

    def free_address(self, index: int, va: int, nbytes: int) -> None: ...

    def release(self, index: int, handle: int) -> None: ...

    def close(self) -> None:
        """Drop what the importer holds (contexts); after every other call."""
        ...


class _CudaRange:
    """[ptr, ptr + nbytes) as a 1-D uint8 array that torch.as_tensor adopts without a copy."""

    def __init__(self, ptr: int, nbytes: int) -> None:
        self.__cuda_array_interface__ = {"shape": (nbytes,), "typestr": "|u1", "data": (ptr, False),
                                         "strides": None, "version": 3}


class CudaPythonImporter(CudaDriver):
    """VmmImporter over the shared cuda-python driver wrapper, plus the one torch call (`wrap`)."""

    def __init__(self) -> None:
        try:
            super().__init__()
        except ImportError:
            raise PoolMappingError("mapping a cuda_vmm pool needs cuda-python in the engine process "
                                   "(pip install 'kvcache[cuda]')") from None

    def wrap(self, index: int, va: int, nbytes: int) -> torch.Tensor:
        device = torch.device("cuda", index)
        tensor = torch.as_tensor(_CudaRange(va, nbytes), device=device)
        if tensor.data_ptr() != va or tensor.device != device:  # torch copied or placed it elsewhere
            raise RuntimeError(f"torch wrapped the mapped range as {tensor.device} at {tensor.data_ptr():#x}, "
                               f"not {device} at {va:#x}")
        return tensor


class _Mapping:
    """What one import holds, released in reverse order of acquisition (each step at most once)."""

    def __init__(self, importer: VmmImporter, index: int, nbytes: int) -> None:
        self.importer, self.index, self.nbytes = importer, index, nbytes
        self.handle: int | None = None
        self.va: int | None = None
        self.mapped = False

    def release(self) -> None:
        imp, index = self.importer, self.index
        try:
            if self.mapped:
                assert self.va is not None, "a mapping has an address"
                self.mapped = False
                imp.unmap(index, self.va, self.nbytes)
            if self.va is not None:
                va, self.va = self.va, None
                imp.free_address(index, va, self.nbytes)
            if self.handle is not None:
                handle, self.handle = self.handle, None
                imp.release(index, handle)
        finally:
            imp.close()


def _one_line(e: BaseException) -> str:
    lines = str(e).strip().splitlines()
    return lines[0] if lines else type(e).__name__


def map_cuda_vmm(info: PoolInfo, device: Device = None, *, auth_token: str = "",
                 importer: VmmImporter | None = None) -> MappedPool:
    """Map `info`'s pool on the local GPU that has its UUID; a zero-copy torch tensor of the layout's shape."""
    layout = info.layout
    if info.size_bytes - info.offset_bytes < layout.size_bytes:
        raise PoolMappingError(f"the pool holds {info.size_bytes} bytes from offset {info.offset_bytes}, the "
                               f"layout needs {layout.size_bytes}")
    imp = importer if importer is not None else CudaPythonImporter()
    try:
        index = find_device(info.device_uuid, imp.device_uuids(), device, backend="cuda_vmm")
        granularity = imp.granularity(index)
    except BaseException:
        imp.close()
        raise
    if info.size_bytes % granularity:
        imp.close()
        raise PoolMappingError(f"the pool's {info.size_bytes} bytes are not a multiple of the allocation "
                               f"granularity of cuda:{index} ({granularity} bytes): is this the service's GPU?")
    try:
        fd, header = receive_pool_fd(info, auth_token)
    except BaseException:
        imp.close()
        raise
    mapping = _Mapping(imp, index, info.size_bytes)
    step = "cuMemImportFromShareableHandle"
    try:
        try:
            if header.get("size_bytes") != info.size_bytes:
                raise PoolMappingError(f"the pool socket sent a pool of {header.get('size_bytes')} bytes, "
                                       f"GetPoolInfo said {info.size_bytes}")
            if normalize_uuid(str(header.get("device_uuid", ""))) != normalize_uuid(info.device_uuid):
                raise PoolMappingError(f"the pool socket sent a pool on GPU {header.get('device_uuid')}, "
                                       f"GetPoolInfo said {info.device_uuid}")
            mapping.handle = imp.import_fd(index, fd)
        finally:
            os.close(fd)  # the import holds the memory now
        step = "cuMemAddressReserve"
        mapping.va = imp.reserve(index, info.size_bytes, granularity)
        step = "cuMemMap"
        imp.map(index, mapping.va, info.size_bytes, mapping.handle)
        mapping.mapped = True
        step = "cuMemSetAccess"
        imp.set_access(index, mapping.va, info.size_bytes, ACCESS_READWRITE)
        step = "wrapping the range as a torch tensor"
        raw = imp.wrap(index, mapping.va, info.size_bytes)
    except PoolMappingError:
        mapping.release()
        raise
    except Exception as e:
        mapping.release()
        raise PoolMappingError(
            f"{step} failed on cuda:{index} ({_one_line(e)}). Check that this engine runs on the service's node "
            f"and GPU ({info.device_uuid}) and that the service (instance {info.instance_id}) is still running"
        ) from None
    tensor, window = split_regions(raw, info)
    return MappedPool(info, tensor, release=mapping.release, window=window)


if TYPE_CHECKING:  # IMPORTERS reaches this function by name; let mypy check it fits the contract
    _importer: PoolImporter = map_cuda_vmm
