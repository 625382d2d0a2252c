"""Fakes shared by tests: a clock the test moves, and CUDA drivers for tests that must run without a GPU."""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

from cache_service.memory.cuda_ipc import IPC_HANDLE_BYTES


class FakeClock:
    """time.monotonic for a core or server under test; the test moves it."""

    def __init__(self, now: float = 1000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


UUIDS = ["GPU-11111111-2222-3333-4444-555555555555", "GPU-abcdef01-2222-3333-4444-555555555555"]


class FakeDriver:
    def __init__(self, uuids: list[str] = UUIDS, fail: str = "") -> None:
        self.uuids = uuids
        self.fail = fail
        self.calls: list[tuple[Any, ...]] = []
        self.on_free: Callable[[], None] | None = None

    def device_count(self) -> int:
        if self.fail == "count":
            raise RuntimeError("cudaErrorNoDevice: no CUDA-capable device is detected")
        return len(self.uuids)

    def device_uuid(self, index: int) -> str:
        return self.uuids[index]

    def malloc(self, index: int, nbytes: int) -> int:
        if self.fail == "malloc":
            raise RuntimeError("cudaErrorMemoryAllocation: out of memory\nmore detail")
        self.calls.append(("malloc", index, nbytes))
        return 0x7F0000000000

    def memset(self, index: int, ptr: int, value: int, nbytes: int) -> None:
        self.calls.append(("memset", index, ptr, value, nbytes))

    def ipc_handle(self, index: int, ptr: int) -> bytes:
        self.calls.append(("ipc_handle", index, ptr))
        return bytes(range(IPC_HANDLE_BYTES)) if self.fail != "handle" else b"short"

    def free(self, index: int, ptr: int) -> None:
        self.calls.append(("free", index, ptr))
        if self.on_free is not None:
            self.on_free()


GRANULARITY = 2 << 20
HANDLE = 0x5EED
VA = 0x7F0000000000
FREE_BYTES = 80 << 30
"""What the fake and scripted drivers report free on their GPU: 80 GiB."""


class FakeVmmDriver:
    """A `VmmDriver` that records its calls. `export_fd` hands out a real fd (a memfd) so that tests can
    check who closes it; `fail` names the call that raises, `attrs` overrides device attributes."""

    def __init__(self, uuids: list[str] = UUIDS, fail: str = "", granularity: int = GRANULARITY,
                 attrs: dict[str, int] | None = None) -> None:
        self.uuids = uuids
        self.fail = fail
        self.gran = granularity
        self.attrs = attrs or {}
        self.calls: list[tuple[Any, ...]] = []
        self.fds: list[int] = []

    def _call(self, *call: Any) -> None:
        if call[0] == self.fail:
            raise RuntimeError(f"{call[0]}: CUDA_ERROR_OUT_OF_MEMORY\nmore detail")
        self.calls.append(call)

    def device_count(self) -> int:
        if self.fail == "device_count":
            raise RuntimeError("cuDeviceGetCount: CUDA_ERROR_NOT_INITIALIZED")
        return len(self.uuids)

    def device_uuid(self, index: int) -> str:
        return self.uuids[index]

    def attribute(self, index: int, name: str) -> int:
        self._call("attribute", index, name)
        return self.attrs.get(name, 1)

    def granularity(self, index: int) -> int:
        self._call("granularity", index)
        return self.gran

    def create(self, index: int, nbytes: int) -> int:
        self._call("create", index, nbytes)
        return HANDLE

    def export_fd(self, index: int, handle: int) -> int:
        self._call("export_fd", index, handle)
        fd = os.memfd_create("fake-vmm")  # inheritable, like the driver's
        os.set_inheritable(fd, True)
        self.fds.append(fd)
        return fd

    def reserve(self, index: int, nbytes: int, alignment: int) -> int:
        self._call("reserve", index, nbytes, alignment)
        return VA

    def map(self, index: int, va: int, nbytes: int, handle: int) -> None:
        self._call("map", index, va, nbytes, handle)

    def set_access(self, index: int, va: int, nbytes: int, flags: int) -> None:
        self._call("set_access", index, va, nbytes, flags)

    def memset(self, index: int, va: int, value: int, nbytes: int) -> None:
        self._call("memset", index, va, value, nbytes)

    def unmap(self, index: int, va: int, nbytes: int) -> None:
        self._call("unmap", index, va, nbytes)

    def free_address(self, index: int, va: int, nbytes: int) -> None:
        self._call("free_address", index, va, nbytes)

    def release(self, index: int, handle: int) -> None:
        self._call("release", index, handle)

    def free_memory(self, index: int) -> int:
        self._call("free_memory", index)
        return FREE_BYTES

    def close(self) -> None:
        self._call("close")


def plain_arg(value: Any) -> Any:
    """A cuda-python argument as a plain value: enums by name, handles and pointers as ints, structs as tuples."""
    if hasattr(value, "name") and hasattr(value, "value"):  # a CUDA enum member
        return str(value.name)
    if hasattr(value, "requestedHandleTypes"):  # CUmemAllocationProp
        return ("prop", plain_arg(value.type), plain_arg(value.location.type), value.location.id,
                plain_arg(value.requestedHandleTypes))
    if hasattr(value, "flags") and hasattr(value, "location"):  # CUmemAccessDesc
        return ("access", plain_arg(value.location.type), value.location.id, plain_arg(value.flags))
    if isinstance(value, list):
        return [plain_arg(v) for v in value]
    try:
        return int(value)
    except TypeError:
        return value


class ScriptedCuda:
    """cuda-python's driver module with its functions replaced by a script of a one-GPU machine: each call is
    recorded with plain arguments and answered with CUDA_SUCCESS (or `fail`'s error). The module's own types
    (CUmemAllocationProp, CUdeviceptr, the enums) stay real, so what the production driver and importer build
    and pass is checked, short of running the GPU."""

    FUNCTIONS = ("cuInit", "cuDeviceGetCount", "cuDeviceGet", "cuDeviceGetUuid", "cuDeviceGetAttribute",
                 "cuMemGetAllocationGranularity", "cuDevicePrimaryCtxRetain", "cuDevicePrimaryCtxRelease",
                 "cuCtxPushCurrent", "cuCtxPopCurrent", "cuMemCreate", "cuMemExportToShareableHandle",
                 "cuMemImportFromShareableHandle", "cuMemAddressReserve", "cuMemMap", "cuMemSetAccess", "cuMemsetD8",
                 "cuCtxSynchronize", "cuMemUnmap", "cuMemAddressFree", "cuMemRelease", "cuMemGetInfo")

    def __init__(self, cu: Any, uuid: bytes = bytes.fromhex("abcdef01222233334444555555555555"),
                 fail: str = "") -> None:
        self.cu = cu
        self.uuid = uuid
        self.fail = fail
        self.calls: list[tuple[Any, ...]] = []
        self.fds: list[int] = []
        ok = cu.CUresult.CUDA_SUCCESS
        self.results: dict[str, Callable[..., tuple[Any, ...]]] = {
            "cuDeviceGetCount": lambda: (ok, 1),
            "cuDeviceGet": lambda ordinal: (ok, cu.CUdevice(ordinal)),
            "cuDeviceGetUuid": lambda dev: (ok, type("CUuuid", (), {"bytes": self.uuid})()),
            "cuDeviceGetAttribute": lambda attr, dev: (ok, 1),
            "cuMemGetAllocationGranularity": lambda prop, flag: (ok, GRANULARITY),
            "cuDevicePrimaryCtxRetain": lambda dev: (ok, cu.CUcontext(0xC7C7)),
            "cuCtxPopCurrent": lambda: (ok, cu.CUcontext(0xC7C7)),
            "cuMemCreate": lambda size, prop, flags: (ok, cu.CUmemGenericAllocationHandle(HANDLE)),
            "cuMemExportToShareableHandle": lambda handle, kind, flags: (ok, self._fd()),
            "cuMemImportFromShareableHandle": lambda fd, kind: (ok, cu.CUmemGenericAllocationHandle(HANDLE + 1)),
            "cuMemAddressReserve": lambda size, alignment, addr, flags: (ok, cu.CUdeviceptr(VA)),
            "cuMemGetInfo": lambda: (ok, FREE_BYTES, 2 * FREE_BYTES),
        }

    def _fd(self) -> int:
        fd = os.memfd_create("scripted-vmm")
        self.fds.append(fd)
        return fd

    def _function(self, name: str) -> Callable[..., tuple[Any, ...]]:
        def call(*args: Any) -> tuple[Any, ...]:
            self.calls.append((name, *(plain_arg(a) for a in args)))
            if name == self.fail:
                return (self.cu.CUresult.CUDA_ERROR_OUT_OF_MEMORY,)
            answer = self.results.get(name)
            return answer(*args) if answer is not None else (self.cu.CUresult.CUDA_SUCCESS,)
        return call

    def install(self, monkeypatch: Any) -> ScriptedCuda:
        for name in self.FUNCTIONS:
            monkeypatch.setattr(self.cu, name, self._function(name))
        return self

    def names(self) -> list[str]:
        """The calls' names, without the context push/pop around each."""
        return [c[0] for c in self.calls if c[0] not in ("cuCtxPushCurrent", "cuCtxPopCurrent")]
