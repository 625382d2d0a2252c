"""What every pool backend provides, and the handle that GetPoolInfo publishes."""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass
from types import TracebackType
from typing import Protocol, TypeVar

from kvcache_common.layout import PoolLayout


def format_bytes(n: float) -> str:
    """1536 -> "1.5 KiB", 100 * 2**30 -> "100.0 GiB" (binary units, one decimal)."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


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
    pool_socket: str = ""
    """fd backends: where engines receive the pool (set by start-up, which serves the socket)."""


class PoolBackend(Protocol):
    """Allocates the pool once at start and exports a handle; frees it on close (idempotent)."""

    name: str
    layout: PoolLayout

    def handle(self) -> PoolHandle: ...

    def close(self) -> None: ...

    @property
    def closed(self) -> bool: ...


_Pool = TypeVar("_Pool", bound="OwnedPool")


class OwnedPool:
    """What every backend shares (docs/design.md §2): `close()` runs the backend's `_release()` exactly once
    (idempotent), `closed` says whether it ran, the pool is a context manager, and a pool dropped without
    `close()` is closed when it is collected (a safety net; owners call `close()`). A backend sets `_open`
    once its `__init__` holds what `_release()` frees; a start that fails half-way calls `close()` itself."""

    _open = False

    @property
    def closed(self) -> bool:
        return not self._open

    def close(self) -> None:
        if self._open:
            self._open = False
            self._release()

    def _release(self) -> None:
        """Free what the backend holds (called once, by `close()`)."""
        raise NotImplementedError

    def __enter__(self: _Pool) -> _Pool:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()

    def __del__(self) -> None:
        if self._open:
            with contextlib.suppress(Exception):  # nothing can be reported from a collector
                self.close()


class OwnedFdPool(OwnedPool):
    """An owned pool whose memory is a file descriptor (`_fd`, set by the backend's `__init__`), handed to engines
    over the pool socket: what the fd backends share."""

    _fd: int | None = None

    def export_fd(self) -> int:
        """The pool's fd (the service keeps ownership; the socket sends a duplicate)."""
        if self._fd is None:
            raise PoolError("the pool is closed")
        return self._fd

    def _close_fd(self) -> None:
        """Drop the service's reference (once; engines' mappings stay valid until they unmap)."""
        if self._fd is not None:
            fd, self._fd = self._fd, None
            os.close(fd)


class FdPool(PoolBackend, Protocol):
    """A backend whose pool is a file descriptor, handed to engines over the pool socket."""

    def export_fd(self) -> int:
        """The pool's fd; the backend keeps it (the socket sends duplicates)."""
        ...


def exports_fd(pool: PoolBackend) -> bool:
    return callable(getattr(pool, "export_fd", None))
