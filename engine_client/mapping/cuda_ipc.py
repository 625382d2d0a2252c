"""Map a `cuda_ipc` pool: open the service's cudaIpcMemHandle and wrap it as torch CUDA tensors, no copy.

The GPU is found by UUID (ordinals differ between processes). A handle can be opened only once per
process and device, so mappings are shared and counted: the handle is closed when the last
`MappedPool` over it closes. Failures say which CUDA error happened and what to check.

The CUDA calls sit behind `IpcImporter` (cupy + torch DLPack in production) so the logic around them is
tested without a GPU.
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING, Any, Protocol

import torch
from torch.utils.dlpack import from_dlpack

from engine_client.errors import PoolMappingError
from engine_client.mapping.base import Device, MappedPool, PoolImporter, split_regions
from engine_client.types import PoolInfo


def normalize_uuid(uuid: str) -> str:
    """'GPU-8F3E...' / '8f3e...' / with or without dashes -> '8f3e...' (hex only, lower case)."""
    u = uuid.strip().lower()
    for prefix in ("gpu-", "mig-"):
        u = u.removeprefix(prefix)
    return u.replace("-", "")


class IpcImporter(Protocol):
    def device_uuids(self) -> list[str]: ...

    def open(self, index: int, handle: bytes) -> int: ...

    def wrap(self, index: int, ptr: int, nbytes: int) -> torch.Tensor:
        """A uint8 CUDA tensor over [ptr, ptr + nbytes) on device `index`, without copying."""
        ...

    def close(self, index: int, ptr: int) -> None: ...


class CupyImporter:
    """cudaIpcOpenMemHandle through cupy; the pointer reaches torch through DLPack."""

    def __init__(self) -> None:
        try:
            import cupy
        except ImportError:
            raise PoolMappingError("mapping a cuda_ipc pool needs cupy in the engine process "
                                   "(pip install 'kvcache[cuda]')") from None
        self._cupy: Any = cupy

    def device_uuids(self) -> list[str]:
        if not torch.cuda.is_available():
            return []
        return [str(torch.cuda.get_device_properties(i).uuid) for i in range(torch.cuda.device_count())]

    def open(self, index: int, handle: bytes) -> int:
        cp = self._cupy
        with cp.cuda.Device(index):
            return int(cp.cuda.runtime.ipcOpenMemHandle(handle, cp.cuda.runtime.cudaIpcMemLazyEnablePeerAccess))

    def wrap(self, index: int, ptr: int, nbytes: int) -> torch.Tensor:
        cp = self._cupy
        mem = cp.cuda.UnownedMemory(ptr, nbytes, None, index)
        array = cp.ndarray((nbytes,), dtype=cp.uint8, memptr=cp.cuda.MemoryPointer(mem, 0))
        return from_dlpack(array)

    def close(self, index: int, ptr: int) -> None:
        cp = self._cupy
        with cp.cuda.Device(index):
            cp.cuda.runtime.ipcCloseMemHandle(ptr)


class _Opened:
    __slots__ = ("count", "ptr", "raw")

    def __init__(self, ptr: int, raw: torch.Tensor) -> None:
        self.ptr = ptr
        self.raw = raw
        self.count = 0


class IpcMappings:
    """Opened handles of this process, by (handle, device). CUDA refuses a second open of a handle in one
    process, so this table is per process by nature; it is the only shared state of the client."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._open: dict[tuple[bytes, int], _Opened] = {}

    def acquire(self, importer: IpcImporter, index: int, handle: bytes, nbytes: int) -> torch.Tensor:
        key = (handle, index)
        with self._lock:
            entry = self._open.get(key)
            if entry is None:
                ptr = importer.open(index, handle)
                try:
                    entry = _Opened(ptr, importer.wrap(index, ptr, nbytes))
                except BaseException:
                    importer.close(index, ptr)
                    raise
                self._open[key] = entry
            entry.count += 1
            return entry.raw

    def release(self, importer: IpcImporter, index: int, handle: bytes) -> None:
        key = (handle, index)
        with self._lock:
            entry = self._open.get(key)
            if entry is None:
                return
            entry.count -= 1
            if entry.count == 0:
                del self._open[key]
                entry.raw = torch.empty(0)
                importer.close(index, entry.ptr)

    def open_count(self) -> int:
        with self._lock:
            return len(self._open)


MAPPINGS = IpcMappings()


def find_device(pool_uuid: str, uuids: list[str], device: Device = None, *, backend: str = "cuda_ipc") -> int:
    """The local index of the pool's GPU. With `device`, check that it is that GPU."""
    if not uuids:
        raise PoolMappingError(
            f"the pool lives in GPU memory ({pool_uuid}) but this process sees no CUDA device: run the engine on "
            "the service's node with the GPU visible (CUDA_VISIBLE_DEVICES, the device plugin's allocation)"
        )
    want = normalize_uuid(pool_uuid)
    if device is not None:
        dev = torch.device(device)
        if dev.type != "cuda":
            raise PoolMappingError(f"a {backend} pool lives on a GPU; it cannot be mapped on {dev}")
        index = dev.index if dev.index is not None else 0
        if index >= len(uuids):
            raise PoolMappingError(f"{dev} does not exist here ({len(uuids)} CUDA device(s) visible)")
        if normalize_uuid(uuids[index]) != want:
            where = _index_of(want, uuids)
            hint = f"it is cuda:{where} here" if where is not None else "this process cannot see it"
            raise PoolMappingError(f"{dev} is GPU {uuids[index]}, but the pool lives on GPU {pool_uuid} ({hint})")
        return index
    found = _index_of(want, uuids)
    if found is None:
        raise PoolMappingError(
            f"the pool lives on GPU {pool_uuid}, which this process cannot see (visible: {', '.join(uuids)}): "
            "run the engine on the service's GPU (CUDA_VISIBLE_DEVICES, the same node)"
        )
    return found


def _index_of(want: str, uuids: list[str]) -> int | None:
    for i, u in enumerate(uuids):
        if normalize_uuid(u) == want:
            return i
    return None


def map_cuda_ipc(info: PoolInfo, device: Device = None, importer: IpcImporter | None = None,
                 mappings: IpcMappings = MAPPINGS, *, auth_token: str = "") -> MappedPool:
    """Map `info`'s pool on the local GPU that has its UUID; zero-copy torch tensors."""
    importer = importer if importer is not None else CupyImporter()
    index = find_device(info.device_uuid, importer.device_uuids(), device)
    if len(info.cuda_ipc_handle) != 64:
        raise PoolMappingError(f"a CUDA IPC handle has 64 bytes, the service sent {len(info.cuda_ipc_handle)}")
    try:
        raw = mappings.acquire(importer, index, info.cuda_ipc_handle, info.size_bytes)
    except PoolMappingError:
        raise
    except Exception as e:
        detail = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise PoolMappingError(
            f"cudaIpcOpenMemHandle failed on cuda:{index} ({detail}). Check that this engine runs on the service's "
            f"machine and GPU ({info.device_uuid}), shares its IPC namespace (the same pod, or hostIPC for pods "
            f"on the node), that the GPU is not a MIG instance, and that the service (instance {info.instance_id}) "
            "is still running"
        ) from None
    tensor, window = split_regions(raw, info)
    return MappedPool(info, tensor, release=lambda: mappings.release(importer, index, info.cuda_ipc_handle),
                      window=window)


if TYPE_CHECKING:  # IMPORTERS reaches this function by name; let mypy check it fits the contract
    _importer: PoolImporter = map_cuda_ipc
