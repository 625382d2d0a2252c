"""The `host_shm` backend: the pool is a file in shared memory (/dev/shm) that engines map zero-copy.

The file is `<shm_dir>/<prefix>-<instance_id>.pool`, created exclusively, reserved up front with
posix_fallocate (a too-small /dev/shm fails at start, not as SIGBUS in an engine later) and held under
an exclusive flock for the service's life. The kernel drops the lock when the process dies, SIGKILL
included, so at start a file of our prefix whose lock can be taken belongs to a dead service and is
removed; a locked one belongs to a live service and is left alone.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
from pathlib import Path

from cache_service.memory.base import OwnedPool, PoolError, PoolHandle, format_bytes
from kvcache_common.layout import PoolLayout

SUFFIX = ".pool"


def pool_path(shm_dir: str | Path, prefix: str, instance_id: str) -> Path:
    return Path(shm_dir) / f"{prefix}-{instance_id}{SUFFIX}"


def remove_stale_pools(shm_dir: str | Path, prefix: str) -> list[Path]:
    """Unlink pool files of `prefix` whose owner is gone (their flock is free). Returns what was removed."""
    removed: list[Path] = []
    for path in sorted(Path(shm_dir).glob(f"{prefix}-*{SUFFIX}")):
        try:
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        except FileNotFoundError:
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            continue  # a live service holds it
        else:
            with contextlib.suppress(FileNotFoundError):
                path.unlink()
            removed.append(path)
        finally:
            os.close(fd)
    return removed


class HostShmPool(OwnedPool):
    """Owns the pool file. `close()` unlinks it (idempotent); mappings engines hold stay valid until
    they unmap, but no new engine can open it."""

    name = "host_shm"

    def __init__(self, layout: PoolLayout, *, shm_dir: str, prefix: str, instance_id: str,
                 size_flag: str = "--num-pages") -> None:
        """`size_flag` names the flag that sized the pool, for the message when /dev/shm is too small."""
        self.layout = layout
        self.path = pool_path(shm_dir, prefix, instance_id)
        self._fd: int | None = None
        if not Path(shm_dir).is_dir():
            raise PoolError(f"--shm-dir {shm_dir} does not exist or is not a directory")
        try:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
        except OSError as e:
            raise PoolError(f"cannot create the pool file {self.path}: {e.strerror}") from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            os.posix_fallocate(fd, 0, layout.size_bytes)
        except OSError as e:
            os.close(fd)
            with contextlib.suppress(FileNotFoundError):
                self.path.unlink()
            if e.errno in (errno.ENOSPC, errno.EFBIG):
                free = _free_bytes(shm_dir)
                raise PoolError(
                    f"{shm_dir} has no room for a {format_bytes(layout.size_bytes)} pool ({format_bytes(free)} free): "
                    f"enlarge it (docker --shm-size, a bigger memory emptyDir) or lower {size_flag}"
                ) from None
            raise PoolError(f"cannot reserve the pool file {self.path}: {e.strerror}") from None
        self._fd = fd
        self._open = True

    def handle(self) -> PoolHandle:
        return PoolHandle(backend=self.name, size_bytes=self.layout.size_bytes, shm_path=str(self.path))

    def _release(self) -> None:
        assert self._fd is not None, "an open pool file holds its fd"
        with contextlib.suppress(FileNotFoundError):
            self.path.unlink()
        fd, self._fd = self._fd, None
        os.close(fd)


def _free_bytes(path: str) -> int:
    st = os.statvfs(path)
    return st.f_bavail * st.f_frsize
