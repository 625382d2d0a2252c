"""The `host_memfd` backend: the pool is an anonymous memory file (memfd_create), handed to engines as a
file descriptor over the pool socket (see `kvcache_common.pool_socket`).

Nothing is ever visible in /dev/shm or any directory: the memory lives as long as some process holds the
fd or a mapping, so a SIGKILLed service leaves nothing behind, and engines keep what they mapped until
they unmap. The file is reserved up front (a too-small memory limit fails at start, not as SIGBUS in an
engine later) and sealed against shrinking and growing, so no engine can pull the pool from under the
others.
"""

from __future__ import annotations

import errno
import fcntl
import os

from cache_service.memory.base import OwnedFdPool, PoolError, PoolHandle, format_bytes
from kvcache_common.layout import PoolLayout

SEALS = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL


class HostMemfdPool(OwnedFdPool):
    """Owns the memfd. `export_fd()` is what the pool socket sends; `close()` (idempotent) drops the
    service's reference (engines' mappings stay valid until they unmap)."""

    name = "host_memfd"

    def __init__(self, layout: PoolLayout, *, size_flag: str = "--num-pages") -> None:
        self.layout = layout
        try:
            fd = os.memfd_create("kvcache-pool", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        except OSError as e:
            raise PoolError(f"memfd_create failed: {e.strerror}; use --backend host_shm") from None
        try:
            os.posix_fallocate(fd, 0, layout.size_bytes)
            fcntl.fcntl(fd, fcntl.F_ADD_SEALS, SEALS)
        except OSError as e:
            os.close(fd)
            if e.errno in (errno.ENOSPC, errno.ENOMEM, errno.EFBIG):
                raise PoolError(f"no memory for a {format_bytes(layout.size_bytes)} host_memfd pool ({e.strerror}): "
                                f"raise the memory limit or lower {size_flag}") from None
            raise PoolError(f"cannot reserve the host_memfd pool: {e.strerror}") from None
        self._fd = fd
        self._open = True

    def handle(self) -> PoolHandle:
        return PoolHandle(backend=self.name, size_bytes=self.layout.size_bytes)

    def _release(self) -> None:
        self._close_fd()
