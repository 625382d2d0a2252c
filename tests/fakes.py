"""Fakes shared by tests that must run without a GPU."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from cache_service.memory.cuda_ipc import IPC_HANDLE_BYTES

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
