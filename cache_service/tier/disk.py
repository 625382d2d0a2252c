"""The `disk` tier: page values appended to segment files under --tier-dir, whole segments reclaimed least
recently used first within --tier-bytes, found again by a restarted service (docs/design.md §8).

Layout: `<dir>/seg-<12-digit id>.kvs`, each a segment file (segment.py: a 64-byte header naming the value
geometry and pool layout, then values of one fixed size back to back). A batch of puts is one `pwritev` a
run of values (the file operations are per batch, not per page); a batch of gets one `preadv` per run of
consecutive values. Segments are append-only: a value is never rewritten in place, and a segment's bytes go
back to the disk only when the whole segment is reclaimed (unlinked).

Capacity and LRU: the budget counts segment files. Segments are kept in least-recently-used order (a put
into one, a hit on one of its values, or a put of a key it holds moves it to the end); when a new segment
needs room, the least recently used segments are reclaimed whole, their values dropped (`take_dropped`).
A segment whose every value was discarded goes at once. The index (key -> segment, slot) lives in memory.

Restart: the index is rebuilt from the segment files, ordered by modification time (a hit touches its
segment's mtime once a batch, so the order survives): every value header is read and checked (magic,
geometry). A torn tail (a value cut short by a crash mid-write) is cut off and counted (`torn_values`); a
value whose header is not sound is skipped and counted too. Values are not fsynced on the write path (a
tier is a cache): after a power loss a value may hold stale blocks, which its CRC turns into a miss at load.
`close()` fsyncs the segment being written. A segment written for another pool layout or value geometry is
never read: it holds no key for this service and is reclaimed in its LRU turn like any other.

One service owns a directory at a time (an flock on `<dir>/.kvcache-tier.lock`); a second one is refused.
Values go straight between the files and the page buffers (the pool's own chunks for host pools): the
kernel's page cache is the only copy.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from cache_service.memory.base import format_bytes
from cache_service.tier.backend import (
    ERROR,
    FULL,
    MISSING,
    SHORT,
    GetItem,
    GetResult,
    PutItem,
    TierConfigError,
    TierSettings,
    TierUnavailable,
    Usage,
)
from cache_service.tier.segment import (
    IOV_MAX,
    SEGMENT_HEADER_BYTES,
    SEGMENT_NAME,
    Segment,
    layout_digest,
    segment_name,
)
from cache_service.tier.value import HEADER_BYTES, Geometry

LOCK_NAME = ".kvcache-tier.lock"
STAGING_LEDGER_NAME = ".kvcache-staging"
SEGMENTS_PER_BUDGET = 16
"""The budget is cut into about this many segments: what one reclamation frees (1/16 of the budget)."""
MAX_SEGMENT_BYTES = 1 << 30


class DiskTier:
    """Page values in segment files under `directory`, at most `capacity_bytes` of files (LRU by segment)."""

    name = "disk"
    medium = "DISK"

    def __init__(self, directory: str | os.PathLike[str], capacity_bytes: int, geometry: Geometry, *,
                 segment_values: int = 0) -> None:
        """`segment_values`: values a segment holds (0: about 1/16 of the budget, at most 1 GiB a segment)."""
        self.directory = Path(directory).absolute()
        self.geometry = geometry
        self._value = geometry.value_bytes
        self._digest = layout_digest(geometry)
        self._lock = threading.Lock()
        """Guards the index, the segments' order and their reader counts."""
        self._write_lock = threading.Lock()
        """One writer at a time appends to the active segment."""
        self._where: dict[bytes, tuple[Segment, int]] = {}
        self._segments: OrderedDict[int, Segment] = OrderedDict()
        """Least recently used first."""
        self._active: Segment | None = None
        self._unsynced: dict[int, Segment] = {}
        """Segments written since the last `sync`."""
        self._next_id = 0
        self._bytes = 0
        self._dropped: list[bytes] = []
        """Keys reclaimed with their segments since `take_dropped` (KV events announce their removal)."""
        self._lock_fd: int | None = None
        self.torn_values = 0
        """Values found cut short or unsound at start (a crash mid-write): not indexed."""
        self.foreign_segments = 0
        """Segments of another layout or geometry found at start: never read."""
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
        if capacity_bytes < SEGMENT_HEADER_BYTES + self._value:
            self.close()
            raise TierConfigError(f"--tier-bytes {capacity_bytes} holds no page value of "
                                  f"{format_bytes(self._value)}")
        fit = (capacity_bytes - SEGMENT_HEADER_BYTES) // self._value
        default = min(capacity_bytes // SEGMENTS_PER_BUDGET, MAX_SEGMENT_BYTES) // self._value
        self.segment_values = max(1, min(fit, segment_values or default))
        self.evicted_at_start = self._rebuild()
        self._dropped = []  # what the start reclaimed was never announced by this instance

    @property
    def staging_ledger_path(self) -> Path:
        """Where eviction staging keeps its ledger (what a crash lost is counted at the next start)."""
        return self.directory / STAGING_LEDGER_NAME

    @classmethod
    def from_settings(cls, settings: TierSettings, geometry: Geometry) -> DiskTier:
        if not settings.tier_dir:
            raise TierConfigError("--tier-dir: the disk tier needs a directory")
        return cls(settings.tier_dir, settings.tier_bytes, geometry)

    # ------------------------------------------------------------------ segments

    def segment_path(self, segment_id: int) -> Path:
        return self.directory / segment_name(segment_id)

    def _rebuild(self) -> int:
        """Index every segment (oldest mtime first), cut torn tails, then reclaim down to the budget. Returns
        the values reclaimed."""
        found: list[tuple[int, int, Path]] = []
        for entry in os.scandir(self.directory):
            m = SEGMENT_NAME.fullmatch(entry.name)
            if m is None:
                continue
            with contextlib.suppress(FileNotFoundError):
                found.append((entry.stat().st_mtime_ns, int(m.group(1)), Path(entry.path)))
        found.sort()
        for _, segment_id, path in found:
            self._next_id = max(self._next_id, segment_id + 1)
            try:
                seg = Segment.open(path, segment_id)
            except FileNotFoundError:
                continue
            self._segments[segment_id] = seg
            self._bytes += seg.size
            if not seg.written_for(self.geometry, self._digest):
                self.foreign_segments += 1  # counted against the budget, never read
                continue
            self._index_segment(seg)
        return len(self._reclaim(0))

    def _index_segment(self, seg: Segment) -> None:
        tail = seg.cut_torn_tail(self._value)
        if tail:
            self.torn_values += 1
            self._bytes -= tail
        for slot, key in enumerate(seg.scan(self.geometry)):
            seg.keys.append(key)
            if key is None:
                self.torn_values += 1
                continue
            old = self._where.get(key)
            if old is not None:  # written twice (reclaimed and stored again): the newer copy counts
                old[0].keys[old[1]] = None
                old[0].live -= 1
            self._where[key] = (seg, slot)
            seg.live += 1

    def _new_segment(self) -> Segment:
        """A fresh segment at the LRU's end, after reclaiming what it needs (called with the write lock)."""
        size = SEGMENT_HEADER_BYTES + self.segment_values * self._value
        gone = self._reclaim(size)
        segment_id = self._next_id
        self._next_id += 1
        seg = Segment.create(self.segment_path(segment_id), segment_id, self.geometry, self._digest,
                             self.segment_values)
        with self._lock:
            self._segments[segment_id] = seg
            self._bytes += seg.size
            self._dropped += gone
        return seg

    def _reclaim(self, room: int) -> list[bytes]:
        """Reclaim least recently used segments (never the active one) until `room` more bytes fit the budget;
        returns the keys they held."""
        gone: list[bytes] = []
        with self._lock:
            while self._bytes + room > self.capacity_bytes:
                victim = next((s for s in self._segments.values() if s is not self._active), None)
                if victim is None:
                    break
                gone += self._drop_segment(victim)
        return gone

    def _drop_segment(self, seg: Segment) -> list[bytes]:
        """Unlink a segment and forget its keys (with the lock held); its fd closes when no reader is left."""
        del self._segments[seg.id]
        self._bytes -= seg.size
        keys = [k for k in seg.keys if k is not None]
        for key in keys:
            del self._where[key]
        seg.reclaimed = True
        with contextlib.suppress(FileNotFoundError):
            os.unlink(seg.path)
        if seg.readers == 0:
            os.close(seg.fd)
        return keys

    def _forget_all(self) -> None:
        """The directory is gone: so is every value (with the write lock held)."""
        with self._lock:
            self._active = None
            for seg in list(self._segments.values()):
                self._dropped += self._drop_segment(seg)

    def take_dropped(self) -> list[bytes]:
        with self._lock:
            dropped, self._dropped = self._dropped, []
        return dropped

    def _touch(self, seg: Segment) -> None:
        """Most recently used now (with the lock held)."""
        if not seg.reclaimed:
            self._segments.move_to_end(seg.id)
            seg.touched = True

    def _sync_mtimes(self, segments: Sequence[Segment]) -> None:
        for seg in segments:
            if seg.touched and not seg.reclaimed and seg is not self._active:
                seg.touched = False
                with contextlib.suppress(OSError):
                    os.utime(seg.path)  # the LRU order a restarted service rebuilds

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
            where = self._where
            for run in runs:
                n = 0
                while n < len(run) and run[n] in where:
                    n += 1
                found.append(n)
        return found

    def put(self, items: Sequence[PutItem]) -> list[str]:
        """Append the values the tier lacks to the active segment, one pwritev a run (a new segment where the
        active one is full); a key held already counts as stored and touches its segment."""
        return self._store([item.key for item in items],
                           lambda i: [memoryview(items[i].header), *items[i].buffers.views])

    def put_values(self, keys: Sequence[bytes], values: Any) -> list[str]:
        """`put` of whole values, the rows of `values` (`[n, value_bytes]` uint8)."""
        return self._store(list(keys), lambda i: [values[i].data])

    def _store(self, keys: list[bytes], value_of: Callable[[int], list[memoryview]]) -> list[str]:
        self._check_open()
        out = [""] * len(keys)
        with self._write_lock:
            if not self.directory.is_dir():  # an open segment of a removed directory would take writes
                self._forget_all()
                raise TierUnavailable("io", f"{self.directory} is gone")
            todo: list[int] = []
            with self._lock:
                batch: set[bytes] = set()
                for i, key in enumerate(keys):
                    held = self._where.get(key)
                    if held is not None:
                        self._touch(held[0])
                    elif key not in batch:
                        batch.add(key)
                        todo.append(i)
            at = 0
            while at < len(todo):
                try:
                    seg = self._active
                    if seg is None or len(seg.keys) >= seg.capacity:
                        self._active = None
                        seg = self._active = self._new_segment()
                    n = min(len(todo) - at, seg.capacity - len(seg.keys))
                    run = todo[at:at + n]
                    self._append(seg, [keys[i] for i in run], [v for i in run for v in value_of(i)])
                except OSError as e:
                    reason = self._failed(e)
                    for i in todo[at:]:
                        out[i] = reason
                    break
                at += n
            with self._lock:
                touched = [s for s in self._segments.values() if s.touched]
            self._sync_mtimes(touched)
        return out

    def _append(self, seg: Segment, keys: list[bytes], buffers: list[memoryview]) -> None:
        """One pwritev of the values at the segment's end; indexed only once all of it is written."""
        seg.append(buffers)
        with self._lock:
            for key in keys:
                self._where[key] = (seg, len(seg.keys))
                seg.keys.append(key)
                seg.live += 1
            grown = len(keys) * self._value
            seg.size += grown
            self._bytes += grown
            self._segments.move_to_end(seg.id)  # its mtime moves with the write
            self._unsynced[seg.id] = seg

    def _failed(self, e: OSError) -> str:
        if e.errno in (errno.ENOSPC, errno.EDQUOT):
            return FULL
        if not self.directory.is_dir():
            raise TierUnavailable("io", f"{self.directory}: {e.strerror}") from None
        return ERROR

    def get(self, items: Sequence[GetItem]) -> list[GetResult]:
        """Read each value into its buffers: one preadv per run of consecutive values of a segment."""
        heads = [bytearray(HEADER_BYTES) for _ in items]
        reasons = self._load([item.key for item in items],
                             lambda i: [memoryview(heads[i]), *items[i].buffers.views], 1 + self.geometry.num_chunks)
        return [GetResult(r, bytes(h) if not r else b"") for r, h in zip(reasons, heads, strict=True)]

    def get_values(self, keys: Sequence[bytes], values: Any) -> list[str]:
        """`get` of whole values into the rows of `values` (`[n, value_bytes]` uint8)."""
        return self._load(list(keys), lambda i: [values[i].data], 1)

    def _load(self, keys: list[bytes], value_of: Callable[[int], list[memoryview]], views: int) -> list[str]:
        self._check_open()
        out = [MISSING] * len(keys)
        located: list[tuple[Segment, int, int]] = []  # (segment, slot, item)
        with self._lock:
            for i, key in enumerate(keys):
                held = self._where.get(key)
                if held is not None:
                    held[0].readers += 1
                    self._touch(held[0])
                    located.append((held[0], held[1], i))
        located.sort(key=lambda x: (x[0].id, x[1]))
        try:
            start = 0
            while start < len(located):
                end = start + 1
                while (end < len(located) and located[end][0] is located[start][0]
                       and located[end][1] == located[end - 1][1] + 1 and (end - start + 1) * views <= IOV_MAX):
                    end += 1
                self._read_run(located[start:end], value_of, out)
                start = end
            self._sync_mtimes(list(dict.fromkeys(seg for seg, _, _ in located)))
        finally:
            with self._lock:
                for seg, _, _ in located:
                    seg.readers -= 1
                    if seg.reclaimed and seg.readers == 0:
                        os.close(seg.fd)
        return out

    def _read_run(self, run: list[tuple[Segment, int, int]], value_of: Callable[[int], list[memoryview]],
                  out: list[str]) -> None:
        seg, first, _ = run[0]
        buffers = [v for _, _, i in run for v in value_of(i)]
        try:
            n = seg.read(first, buffers, self._value)
        except OSError:
            for _, _, i in run:
                out[i] = ERROR
            return
        for k, (_, _, i) in enumerate(run):
            out[i] = "" if n >= (k + 1) * self._value else SHORT

    def discard(self, keys: Sequence[bytes]) -> None:
        """Forget values found unsound; a segment left with no value is reclaimed at once."""
        with self._lock:
            for key in keys:
                held = self._where.pop(key, None)
                if held is None:
                    continue
                seg, slot = held
                seg.keys[slot] = None
                seg.live -= 1
                if seg.live == 0 and seg is not self._active and not seg.reclaimed:
                    self._drop_segment(seg)

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
            return Usage(values=len(self._where), bytes=self._bytes, capacity_bytes=self.capacity_bytes)

    def indexed_keys(self) -> list[bytes]:
        """Indexed keys, least recently used segment first, each segment's in the order written."""
        with self._lock:
            return [k for seg in self._segments.values() for k in seg.keys if k is not None]

    def segment_ids(self) -> list[int]:
        """Segments, least recently used first."""
        with self._lock:
            return list(self._segments)

    def sync(self) -> None:
        """fsync the segments written since the last sync (what the write path leaves to the page cache)."""
        with self._write_lock:
            with self._lock:
                segments = [s for s in self._unsynced.values() if not s.reclaimed]
                self._unsynced.clear()
            for seg in segments:
                os.fsync(seg.fd)

    def describe(self) -> str:
        u = self.usage()
        return (f"disk {self.directory}: {u.values:,} values, {format_bytes(u.bytes or 0)} of "
                f"{format_bytes(self.capacity_bytes)}")

    def close(self) -> None:
        if self._lock_fd is None:
            return
        with contextlib.suppress(OSError):
            self.sync()
        with self._write_lock, self._lock:
            self._active = None
            for seg in self._segments.values():
                if seg.readers == 0:
                    with contextlib.suppress(OSError):
                        os.close(seg.fd)
                seg.reclaimed = True  # a reader still inside closes it
            self._segments.clear()
            self._where.clear()
            fd, self._lock_fd = self._lock_fd, None
            os.close(fd)
