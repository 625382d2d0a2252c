"""What every pool backend provides, and the handle that GetPoolInfo publishes."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from protos.kvcache.v1.layout import PoolLayout


class PoolError(RuntimeError):
    """The pool cannot be created or exported; the message is one line that says what to do."""


@dataclass(frozen=True, slots=True)
class PoolHandle:
    backend: str
    size_bytes: int
    shm_path: str = ""
    cuda_ipc_handle: bytes = b""
    device_uuid: str = ""
    offset_bytes: int = 0


class PoolBackend(Protocol):
    """Allocates the pool once at start and exports a handle; frees it on close (idempotent)."""

    name: str
    layout: PoolLayout

    def handle(self) -> PoolHandle: ...

    def close(self) -> None: ...

    @property
    def closed(self) -> bool: ...
