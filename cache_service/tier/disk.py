"""The `disk` tier: one file per page value under --tier-dir, least recently used first out within
--tier-bytes, found again by a restarted service.

Layout: `<dir>/<first two hex digits of the key>/kvc1-<key hex>.kv`, each file a whole value (header and
payload). A value is written to a temporary name in the same directory and renamed into place, so a file
under a value's name is never one still being written; a crash can leave only temporary files, which the
next start removes. No fsync: after a power loss a renamed file may be short or hold stale blocks, which
the header and CRC turn into a miss (a tier is a cache; a lost value costs a hit).

The index (key -> size, in LRU order) lives in memory and is rebuilt from the directory at start, ordered
by modification time; a hit touches the file's mtime, so the order survives restarts. One service owns a
directory at a time (an flock on `<dir>/.kvcache-tier.lock`); a second one is refused at start.

Reads and writes go straight between the file and the page buffers with preadv/pwritev (the pool's own
chunks for host pools): the kernel's page cache is the only copy.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import itertools
import os
import threading
from collections import OrderedDict
from collections.abc import Sequence
from pathlib import Path

from cache_service.core.tier_keys import key_from_text, key_text
from cache_service.memory.base import format_bytes
from cache_service.tier.backend import (
    ERROR,
    FULL,
    MISSING,
    SHORT,
    WRONG_SIZE,
    GetItem,
    GetResult,
    PutItem,
    TierConfigError,
    TierSettings,
    TierUnavailable,
    Usage,
)
from cache_service.tier.value import HEADER_BYTES, Geometry

SUFFIX = ".kv"
TEMP_SUFFIX = ".tmp"
LOCK_NAME = ".kvcache-tier.lock"
_IOV_MAX = os.sysconf("SC_IOV_MAX") if hasattr(os, "sysconf") else 1024


def _writev_all(fd: int, buffers: Sequence[object], total: int) -> None:
    """pwritev every byte of `buffers` from offset 0 (a short write continues where it stopped)."""
    views = [memoryview(b).cast("B") for b in buffers]  # type: ignore[arg-type]
    offset = 0
    while views:
        n = os.pwritev(fd, views[:_IOV_MAX], offset)
        if n <= 0:
            raise OSError(errno.EIO, "pwritev wrote nothing")
        offset += n
        _consume(views, n)
    assert offset == total, (offset, total)


def _readv_all(fd: int, buffers: Sequence[memoryview]) -> int:
    """preadv into every buffer from offset 0 until they are full or the file ends; returns bytes read."""
    views = [memoryview(b).cast("B") for b in buffers]
    offset = 0
    while views:
        n = os.preadv(fd, views[:_IOV_MAX], offset)
        if n <= 0:
            break
        offset += n
        _consume(views, n)
    return offset


def _consume(views: list[memoryview], n: int) -> None:
    """Drop the first `n` bytes of `views` (what one pwritev/preadv moved)."""
    while views and n >= len(views[0]):
        n -= len(views[0])
        views.pop(0)
    if n:
        views[0] = views[0][n:]


class DiskTier:
    """Page values as files under `directory`, at most `capacity_bytes` in all (LRU)."""

    name = "disk"
    medium = "DISK"

    def __init__(self, directory: str | os.PathLike[str], capacity_bytes: int, geometry: Geometry) -> None:
        self.directory = Path(directory).absolute()
        self.geometry = geometry
        self._lock = threading.Lock()
        self._index: OrderedDict[bytes, int] = OrderedDict()
        self._bytes = 0
        self._dropped: list[bytes] = []
        """Keys evicted by the LRU since `take_dropped` (KV events announce their removal)."""
        self._temp_names = itertools.count()
        self._lock_fd: int | None = None
        try:
            # The directory itself is made, never its parents: a missing parent is a typo or a volume not
            # mounted, where values written would fill another disk (README: a missing directory stops it).
            self.directory.mkdir(exist_ok=True)
            fd = os.open(self.directory / LOCK_NAME, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        except FileNotFoundError:
            raise TierConfigError(f"--tier-dir {self.directory}: {self.directory.parent} does not exist (the tier "
                                  "directory is created, its parent must exist)") from None
        except OSError as e:
            raise TierConfigError(f"--tier-dir {self.directory}: {e.strerror or e}") from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise TierConfigError(f"--tier-dir {self.directory}: another kvcache-service uses this directory; give "
                                  "each service its own") from None
        self._lock_fd = fd
        if capacity_bytes <= 0:
            st = os.statvfs(self.directory)
            capacity_bytes = st.f_bavail * st.f_frsize // 2
        self.capacity_bytes = capacity_bytes
        if capacity_bytes < geometry.value_bytes:
            self.close()
            raise TierConfigError(f"--tier-bytes {capacity_bytes} holds no page value of "
                                  f"{format_bytes(geometry.value_bytes)}")
        self.removed_temp_files, self.evicted_at_start = self._rebuild()
        self._dropped = []  # what the start evicted was never announced by this instance

    @classmethod
    def from_settings(cls, settings: TierSettings, geometry: Geometry) -> DiskTier:
        if not settings.tier_dir:
            raise TierConfigError("--tier-dir: the disk tier needs a directory")
        return cls(settings.tier_dir, settings.tier_bytes, geometry)

    # ------------------------------------------------------------------ index

    def path(self, key: bytes) -> Path:
        text = key_text(key)
        return self.directory / key.hex()[:2] / (text + SUFFIX)

    def _rebuild(self) -> tuple[int, int]:
        """Index every value file by mtime (oldest first), remove temporary files, then evict down to the
        capacity. Returns (temporary files removed, values evicted)."""
        found: list[tuple[int, bytes, int]] = []
        removed = 0
        for sub in self.directory.iterdir():
            if not sub.is_dir() or len(sub.name) != 2:
                continue
            for entry in os.scandir(sub):
                if entry.name.endswith(TEMP_SUFFIX):
                    with contextlib.suppress(FileNotFoundError):
                        os.unlink(entry.path)
                    removed += 1
                    continue
                if not entry.name.endswith(SUFFIX):
                    continue
                key = key_from_text(entry.name[:-len(SUFFIX)])
                if key is None:
                    continue
                try:
                    st = entry.stat()
                except FileNotFoundError:
                    continue
                found.append((st.st_mtime_ns, key, st.st_size))
        found.sort()
        for _, key, size in found:
            self._index[key] = size
            self._bytes += size
        return removed, len(self._evict_over(self.capacity_bytes))

    def _evict_over(self, capacity: int) -> list[bytes]:
        """Drop least recently used values until the index fits `capacity`; unlink their files."""
        gone: list[bytes] = []
        with self._lock:
            while self._bytes > capacity and self._index:
                key, size = self._index.popitem(last=False)
                self._bytes -= size
                gone.append(key)
        for key in gone:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.path(key))
        with self._lock:
            self._dropped += gone
        return gone

    def take_dropped(self) -> list[bytes]:
        with self._lock:
            dropped, self._dropped = self._dropped, []
        return dropped

    def _forget(self, key: bytes) -> None:
        with self._lock:
            size = self._index.pop(key, None)
            if size is not None:
                self._bytes -= size

    # ------------------------------------------------------------------ TierBackend

    @property
    def connected(self) -> bool:
        return self._lock_fd is not None

    def register(self, regions: Sequence[tuple[int, int]]) -> None:
        pass  # files need no registration

    def exists(self, runs: Sequence[Sequence[bytes]]) -> list[int]:
        self._check_open()
        found: list[int] = []
        with self._lock:
            index = self._index
            for run in runs:
                n = 0
                while n < len(run) and run[n] in index:
                    n += 1
                found.append(n)
        return found

    def put(self, items: Sequence[PutItem]) -> list[str]:
        self._check_open()
        value_bytes = self.geometry.value_bytes
        out: list[str] = []
        for item in items:
            with self._lock:
                if item.key in self._index:
                    self._index.move_to_end(item.key)
                    out.append("")
                    continue
            out.append(self._write(item, value_bytes))
        self._evict_over(self.capacity_bytes)
        return out

    def _write(self, item: PutItem, value_bytes: int) -> str:
        final = self.path(item.key)
        temp = final.with_name(f".{final.name}.{os.getpid()}.{next(self._temp_names)}{TEMP_SUFFIX}")
        try:
            final.parent.mkdir(exist_ok=True)
            fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
            try:
                _writev_all(fd, [item.header, *item.buffers.views], value_bytes)
            finally:
                os.close(fd)
            os.rename(temp, final)
        except OSError as e:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(temp)
            if e.errno in (errno.ENOSPC, errno.EDQUOT):
                return FULL
            if e.errno in (errno.ENOENT, errno.EROFS, errno.EACCES) and not self.directory.is_dir():
                raise TierUnavailable("io", f"{self.directory}: {e.strerror}") from None
            return ERROR
        with self._lock:
            old = self._index.pop(item.key, None)
            self._bytes += value_bytes - (old or 0)
            self._index[item.key] = value_bytes
        return ""

    def get(self, items: Sequence[GetItem]) -> list[GetResult]:
        self._check_open()
        value_bytes = self.geometry.value_bytes
        out: list[GetResult] = []
        for item in items:
            path = self.path(item.key)
            try:
                fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
            except FileNotFoundError:
                self._forget(item.key)
                out.append(GetResult(MISSING, b""))
                continue
            except OSError:
                out.append(GetResult(ERROR, b""))
                continue
            try:
                size = os.fstat(fd).st_size
                if size != value_bytes:
                    out.append(GetResult(SHORT if size < value_bytes else WRONG_SIZE, b""))
                    continue
                head = bytearray(HEADER_BYTES)
                n = _readv_all(fd, [memoryview(head), *item.buffers.views])
                if n != value_bytes:
                    out.append(GetResult(SHORT, b""))
                    continue
                out.append(GetResult("", bytes(head)))
            except OSError:
                out.append(GetResult(ERROR, b""))
                continue
            finally:
                os.close(fd)
            with self._lock:
                if item.key in self._index:
                    self._index.move_to_end(item.key)
            with contextlib.suppress(OSError):
                os.utime(path)  # the LRU order a restarted service rebuilds
        return out

    def discard(self, keys: Sequence[bytes]) -> None:
        for key in keys:
            self._forget(key)
            with contextlib.suppress(OSError):
                os.unlink(self.path(key))

    def probe(self) -> None:
        self._check_open()
        if not self.directory.is_dir():
            raise TierUnavailable("io", f"{self.directory} is gone")

    def reconnect(self) -> None:
        self.probe()

    def _check_open(self) -> None:
        if self._lock_fd is None:
            raise TierUnavailable("closed", "the disk tier is closed")

    def usage(self) -> Usage:
        with self._lock:
            return Usage(values=len(self._index), bytes=self._bytes, capacity_bytes=self.capacity_bytes)

    def indexed_keys(self) -> list[bytes]:
        """Indexed keys, least recently used first."""
        with self._lock:
            return list(self._index)

    def describe(self) -> str:
        u = self.usage()
        return (f"disk {self.directory}: {u.values:,} values, {format_bytes(u.bytes or 0)} of "
                f"{format_bytes(self.capacity_bytes)}")

    def close(self) -> None:
        if self._lock_fd is not None:
            fd, self._lock_fd = self._lock_fd, None
            os.close(fd)
