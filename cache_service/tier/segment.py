"""One segment file of the disk tier (docs/design.md §8): its format and its bytes. What it holds, and the order
segments are reclaimed in, is the index's (disk.py).

Layout: `<dir>/seg-<12-digit id>.kvs`. A segment is a 64-byte segment header (magic, version, the value
geometry and a digest of the pool layout it was written for), then values of one fixed size back to back
(each a whole value: its own 64-byte header naming its key, then the payload), so value `i` is at
`SEGMENT_HEADER_BYTES + i * value_bytes`. Values are appended (one `pwritev` a run of them) and read (one
`preadv` a run of consecutive ones); a value is never rewritten in place. A value cut short by a crash is cut
off at the next start; a value whose header is not sound names no key.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import os
import re
import struct
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from cache_service.tier.value import HEADER, HEADER_BYTES, MAGIC, VERSION, Geometry

SEGMENT_MAGIC = b"KVS1"
SEGMENT_VERSION = 1
SEGMENT_HEADER = struct.Struct("<4sHHQII32s8x")
"""magic | version u16 | header bytes u16 | value bytes u64 | chunks u32 | chunk bytes u32 | layout digest."""
SEGMENT_HEADER_BYTES = SEGMENT_HEADER.size
assert SEGMENT_HEADER_BYTES == 64, SEGMENT_HEADER_BYTES
SEGMENT_NAME = re.compile(r"seg-(\d{12})\.kvs")
IOV_MAX = os.sysconf("SC_IOV_MAX") if hasattr(os, "sysconf") else 1024
_SCAN_CHUNK_BYTES = 8 << 20


def segment_name(segment_id: int) -> str:
    return f"seg-{segment_id:012d}.kvs"


def layout_digest(geometry: Geometry) -> bytes:
    """What a segment header records of the pool it was written for (the layout's words and the geometry)."""
    text = f"{geometry.layout}|{geometry.num_chunks}|{geometry.chunk_bytes}".encode()
    return hashlib.sha256(text).digest()


def _header_fields(geometry: Geometry, digest: bytes) -> tuple[object, ...]:
    return (SEGMENT_MAGIC, SEGMENT_VERSION, SEGMENT_HEADER_BYTES, geometry.value_bytes, geometry.num_chunks,
            geometry.chunk_bytes, digest)


def move(fd: int, buffers: list[memoryview], offset: int, write: bool) -> int:
    """pwritev (write) or preadv every byte of `buffers` at `offset`, continuing after short transfers; returns
    the bytes moved (less than asked only when a read reaches the end of the file)."""
    views = [b.cast("B") for b in buffers]
    moved = 0
    while views:
        n = os.pwritev(fd, views[:IOV_MAX], offset + moved) if write else os.preadv(fd, views[:IOV_MAX],
                                                                                     offset + moved)
        if n <= 0:
            if write:
                raise OSError(errno.EIO, "pwritev wrote nothing")
            break
        moved += n
        while views and n >= len(views[0]):
            n -= len(views[0])
            views.pop(0)
        if n:
            views[0] = views[0][n:]
    return moved


@dataclass(eq=False)
class Segment:
    id: int
    path: Path
    fd: int
    capacity: int
    """Values it may hold (0 for a foreign segment: never written or read)."""
    keys: list[bytes | None] = field(default_factory=list)
    """Per slot written: the key it holds, or None (discarded, unsound, or superseded)."""
    live: int = 0
    size: int = SEGMENT_HEADER_BYTES
    """File bytes counted against the budget."""
    readers: int = 0
    reclaimed: bool = False
    touched: bool = False
    """Hit since the last batch: its mtime is brought forward (the LRU order a restart rebuilds)."""

    @classmethod
    def create(cls, path: Path, segment_id: int, geometry: Geometry, digest: bytes, capacity: int) -> Segment:
        """A new, empty segment file at `path` (never one that exists)."""
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
        try:
            os.pwrite(fd, SEGMENT_HEADER.pack(*_header_fields(geometry, digest)), 0)
        except OSError:
            os.close(fd)
            with contextlib.suppress(OSError):
                os.unlink(path)
            raise
        return cls(segment_id, path, fd, capacity)

    @classmethod
    def open(cls, path: Path, segment_id: int) -> Segment:
        """A segment found at start, as big as its file; not yet read (`written_for`, `scan`)."""
        fd = os.open(path, os.O_RDWR | os.O_CLOEXEC)
        return cls(segment_id, path, fd, 0, size=os.fstat(fd).st_size)

    def written_for(self, geometry: Geometry, digest: bytes) -> bool:
        """Whether its header is whole and names this value geometry and pool layout."""
        raw = os.pread(self.fd, SEGMENT_HEADER_BYTES, 0)
        return len(raw) == SEGMENT_HEADER_BYTES and SEGMENT_HEADER.unpack(raw) == _header_fields(geometry, digest)

    def cut_torn_tail(self, value_bytes: int) -> int:
        """Cut off a value cut short by a crash mid-write; returns the bytes cut (0: none)."""
        whole, tail = divmod(self.size - SEGMENT_HEADER_BYTES, value_bytes)
        if tail:
            os.ftruncate(self.fd, SEGMENT_HEADER_BYTES + whole * value_bytes)
            self.size -= tail
        return tail

    def scan(self, geometry: Geometry) -> Iterator[bytes | None]:
        """Per value written, in order: the key its header names, or None where the header is not sound (read
        a few MiB at a time for small values, a header at a time for large ones)."""
        value = geometry.value_bytes
        whole = (self.size - SEGMENT_HEADER_BYTES) // value
        per_read = max(1, _SCAN_CHUNK_BYTES // value) if value <= (64 << 10) else 1
        slot = 0
        while slot < whole:
            n = min(per_read, whole - slot)
            offset = SEGMENT_HEADER_BYTES + slot * value
            raw = os.pread(self.fd, n * value, offset) if n > 1 else os.pread(self.fd, HEADER_BYTES, offset)
            for i in range(n):
                yield _sound_key(raw, i * value, geometry)
            slot += n

    def append(self, buffers: list[memoryview]) -> None:
        """One pwritev of values at the file's end (`size`, which the caller then grows); nothing half-written
        stays behind when it fails."""
        try:
            move(self.fd, buffers, self.size, write=True)
        except OSError:
            with contextlib.suppress(OSError):
                os.ftruncate(self.fd, self.size)
            raise

    def read(self, slot: int, buffers: list[memoryview], value_bytes: int) -> int:
        """One preadv of consecutive values from `slot` on; returns the bytes read."""
        return move(self.fd, buffers, SEGMENT_HEADER_BYTES + slot * value_bytes, write=False)


def _sound_key(raw: bytes, at: int, geometry: Geometry) -> bytes | None:
    if len(raw) < at + HEADER_BYTES:
        return None
    magic, version, header_bytes, chunks, chunk_bytes, _crc, _flags, key = HEADER.unpack_from(raw, at)
    if (magic, version, header_bytes, chunks, chunk_bytes) != (MAGIC, VERSION, HEADER_BYTES, geometry.num_chunks,
                                                               geometry.chunk_bytes):
        return None
    return bytes(key)
