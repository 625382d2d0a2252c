"""The `cuda_ipc` backend: the pool is one cudaMalloc allocation, exported with cudaIpcGetMemHandle.

Engines open the 64-byte handle once per process (cudaIpcOpenMemHandle) and wrap the pointer as torch
tensors. Devices are named by UUID, never by ordinal: ordinals differ between processes with different
CUDA_VISIBLE_DEVICES. MIG instances are refused (CUDA IPC does not work across them). The allocation
is freed only by `close()`, which the server calls after every lease is released.

The CUDA runtime calls sit behind `IpcRuntime` (cupy in production), so everything but the calls
themselves is tested without a GPU.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

from cache_service.memory.base import OwnedPool, PoolError, PoolHandle
from kvcache_common.cuda_driver import CudaDriver
from kvcache_common.cuda_driver import format_uuid as uuid_of_bytes
from kvcache_common.layout import PoolLayout

IPC_HANDLE_BYTES = 64


def format_uuid(raw: bytes | str) -> str:
    """A device UUID as nvidia-smi prints it: 'GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx' (or 'MIG-...')."""
    if isinstance(raw, str):
        return raw if raw[:4].upper() in ("GPU-", "MIG-") else f"GPU-{raw}"
    try:
        return uuid_of_bytes(raw)
    except ValueError as e:
        raise PoolError(str(e)) from None


def resolve_device(spec: str, uuids: Sequence[str], *, mig_ok: bool = False) -> int:
    """The index of the device `spec` names: an ordinal, or a UUID (a unique prefix is enough). A MIG
    instance's UUID is refused unless `mig_ok` (the backend then relies on the driver's own checks)."""
    if not uuids:
        raise PoolError("no CUDA device is visible; use --backend host_shm")
    if spec.isdigit():
        index = int(spec)
        if index >= len(uuids):
            raise PoolError(f"--device {spec}: only {len(uuids)} CUDA device(s) are visible (0..{len(uuids) - 1})")
        return index
    key = spec
    if spec.upper().startswith("MIG-"):
        if not mig_ok:
            raise PoolError(f"--device {spec}: MIG instances do not support CUDA IPC; give the service a whole GPU")
        key = "GPU-" + spec[4:]  # the driver reports a MIG instance's UUID as 16 bytes, formatted GPU-...
    matches = [i for i, u in enumerate(uuids) if u.lower().startswith(key.lower())]
    if len(matches) != 1:
        what = "no visible GPU has" if not matches else "more than one visible GPU matches"
        raise PoolError(f"--device {spec}: {what} this UUID (visible: {', '.join(uuids)})")
    return matches[0]


class IpcRuntime(Protocol):
    """The CUDA runtime calls the backend makes."""

    def device_count(self) -> int: ...

    def device_uuid(self, index: int) -> str: ...

    def malloc(self, index: int, nbytes: int) -> int: ...

    def memset(self, index: int, ptr: int, value: int, nbytes: int) -> None: ...

    def ipc_handle(self, index: int, ptr: int) -> bytes: ...

    def free(self, index: int, ptr: int) -> None: ...

    def free_memory(self, index: int) -> int:
        """Bytes of device `index`'s memory free right now."""
        ...


def _driver_uuid(index: int) -> str:
    """Device `index`'s UUID from the CUDA driver (cuDeviceGetUuid through cuda-python, part of kvcache[cuda])."""
    try:
        driver = CudaDriver()
    except ImportError:
        raise PoolError(f"GPU {index}'s UUID has a zero byte, which cupy cuts off; install cuda-python to read it "
                        "(pip install 'kvcache[cuda]')") from None
    try:
        return driver.device_uuid(index)
    finally:
        driver.close()


class CupyDriver:
    """IpcRuntime over cupy's runtime bindings (plain cudaMalloc, not cupy's memory pool: an IPC handle
    must name the allocation's base)."""

    def __init__(self) -> None:
        import cupy  # optional dependency (kvcache[cuda])

        self._cupy: Any = cupy
        self._rt: Any = cupy.cuda.runtime

    def device_count(self) -> int:
        return int(self._rt.getDeviceCount())

    def device_uuid(self, index: int) -> str:
        props = self._rt.getDeviceProperties(index)
        if "uuid" not in props:
            raise PoolError("this cupy does not report device UUIDs; install cupy >= 13 (pip install 'kvcache[cuda]')")
        raw = props["uuid"]
        if isinstance(raw, bytes) and len(raw) < 16:
            # cupy hands the runtime's char[16] over as a C string: a UUID with a zero byte comes back cut at it
            # (seen on an H200), so the driver is asked for all 16 bytes.
            return _driver_uuid(index)
        return format_uuid(raw)

    def malloc(self, index: int, nbytes: int) -> int:
        with self._cupy.cuda.Device(index):
            return int(self._rt.malloc(nbytes))

    def memset(self, index: int, ptr: int, value: int, nbytes: int) -> None:
        with self._cupy.cuda.Device(index):
            self._rt.memset(ptr, value, nbytes)
            self._rt.deviceSynchronize()

    def ipc_handle(self, index: int, ptr: int) -> bytes:
        with self._cupy.cuda.Device(index):
            return bytes(self._rt.ipcGetMemHandle(ptr))

    def free(self, index: int, ptr: int) -> None:
        with self._cupy.cuda.Device(index):
            self._rt.free(ptr)

    def free_memory(self, index: int) -> int:
        with self._cupy.cuda.Device(index):
            free, _total = self._rt.memGetInfo()
            return int(free)


def _one_line(e: BaseException) -> str:
    lines = str(e).strip().splitlines()
    return lines[0] if lines else type(e).__name__


class CudaIpcPool(OwnedPool):
    """Owns the GPU allocation. `close()` frees it (idempotent)."""

    name = "cuda_ipc"

    def __init__(self, layout: PoolLayout, *, device: str, driver: IpcRuntime | None = None) -> None:
        self.layout = layout
        self._driver: IpcRuntime = driver if driver is not None else CupyDriver()
        d = self._driver
        try:
            uuids = [d.device_uuid(i) for i in range(d.device_count())]
        except PoolError:
            raise
        except Exception as e:  # the driver's own error type (cupy's CUDARuntimeError)
            raise PoolError(f"cannot list CUDA devices ({_one_line(e)}); use --backend host_shm") from None
        self.device_index = resolve_device(device, uuids)
        self.device_uuid = uuids[self.device_index]
        if self.device_uuid.upper().startswith("MIG-"):
            raise PoolError(f"device {self.device_index} is MIG instance {self.device_uuid}: MIG does not support "
                            "CUDA IPC; give the service a whole GPU")
        size = layout.size_bytes
        try:
            self._ptr: int | None = d.malloc(self.device_index, size)
            self._open = True
        except Exception as e:
            raise PoolError(f"cannot allocate a {size / 2**20:.1f} MiB pool on GPU {self.device_index} "
                            f"({self.device_uuid}): {_one_line(e)}; lower --num-pages") from None
        try:
            d.memset(self.device_index, self._ptr, 0, size)
            self._handle = d.ipc_handle(self.device_index, self._ptr)
        except Exception as e:
            self.close()
            raise PoolError(
                f"cannot export the pool on GPU {self.device_index} with CUDA IPC: {_one_line(e)}") from None
        if len(self._handle) != IPC_HANDLE_BYTES:
            self.close()
            raise PoolError(f"cudaIpcGetMemHandle returned {len(self._handle)} bytes, not {IPC_HANDLE_BYTES}")

    def handle(self) -> PoolHandle:
        return PoolHandle(backend=self.name, size_bytes=self.layout.size_bytes, cuda_ipc_handle=self._handle,
                          device_uuid=self.device_uuid, offset_bytes=0)

    def device_address(self) -> int:
        """The pool's device address in this process (the tier copies pages through it)."""
        if self._ptr is None:
            raise PoolError("the pool is closed")
        return self._ptr

    def _release(self) -> None:
        assert self._ptr is not None, "an open pool holds its allocation"
        ptr, self._ptr = self._ptr, None
        self._driver.free(self.device_index, ptr)
