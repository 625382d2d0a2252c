"""Eviction staging: bounded host memory that keeps pages the tier lacks from being lost at eviction.

A pool evicts when an allocation needs pages now; the pages the tier does not hold yet would be lost. So, on
the loop and inside the core call that evicts (before its allocation can hand the pages to a writer), each
such page is copied into a slot here (`capture`: one copy of its chunks, `PageMemory.capture`), under its
tier key; the tier's offload worker then writes the slot to the store and `release`s it. While a key is
staged, lookups count it as held and loads copy it from its slot (the bytes are the evicted KV, never
anything else: a slot is written only when it is taken, and reused only after its key is released).

`slots = capacity_bytes // payload_bytes`; none: staging is off (`--tier-staging-bytes 0`). When every slot
is taken, `capture` takes what fits and the caller counts the rest as lost. Slots are page-major (a page's
chunks contiguous), in memory the store registers (Mooncake puts from it without a copy).

The ledger (`ledger_path`, where the store has a directory: the disk tier's): a file of one key per slot,
mapped shared and written as slots are taken and released (a memory write, no system call). What a process
that dies without its drain (SIGKILL) leaves there is what staging lost; the next start counts it
(`crashed_pages`) and starts the ledger afresh. A stop that drains leaves it empty.

Threads: the loop captures and looks up, the load worker copies out, the offload worker reads slots and
releases them; one lock guards the key map and the free list. A slot's bytes are read without the lock: it
stays taken until its key is released, which happens only after the store finished reading it.
"""

from __future__ import annotations

import mmap
import os
import threading
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from cache_service.tier.memory import HostArea, PageBuffers, PageMemory


class EvictionStaging:
    """`slots` pages of host memory, keyed by tier key. `close()` (idempotent) frees the memory."""

    def __init__(self, memory: PageMemory, capacity_bytes: int, ledger_path: Path | None = None) -> None:
        if capacity_bytes < 0:
            raise ValueError(f"staging capacity must be >= 0 bytes, got {capacity_bytes}")
        self._memory = memory
        g = memory.geometry
        self._chunk = g.chunk_bytes
        self._slot_bytes = g.payload_bytes
        self.slots = capacity_bytes // self._slot_bytes
        self._area: HostArea | None = memory.host_area(self.slots * self._slot_bytes) if self.slots else None
        self._free: list[int] = []
        """Released slots; slots never used yet are `_fresh` and up (no list of a million small values)."""
        self._fresh = 0
        self._slot_of: dict[bytes, int] = {}
        self._flags = [0] * self.slots if memory.geometry.window_chunks else []
        """A window pool's: each slot's value flags (whether its page had its window rows when captured)."""
        self._lock = threading.Lock()
        self.crashed_pages = 0
        """Slots the previous process's ledger still held (it died before writing them): lost."""
        self._ledger: mmap.mmap | None = None
        if ledger_path is not None and self.slots:
            self.crashed_pages, self._ledger = _open_ledger(ledger_path, self.slots)

    @property
    def used(self) -> int:
        """Slots holding a page the tier has not finished writing."""
        with self._lock:
            return len(self._slot_of)

    def regions(self) -> list[tuple[int, int]]:
        """The host memory to register with the store (none when staging is off)."""
        area = self._area
        return [(area.address, area.nbytes)] if area is not None else []

    def capture(self, keys: Sequence[bytes], pages: Sequence[int]) -> tuple[int, list[tuple[bytes, int]]]:
        """Copy pages into free slots under their keys, in order, until the slots run out: returns (how many
        leading pages are staged, the (key, slot) pairs newly taken, which the caller queues for the store).
        A key staged already counts as staged (its bytes are the same KV) and takes no slot."""
        taken: list[tuple[bytes, int]] = []
        with self._lock:
            n = 0
            for key, page in zip(keys, pages, strict=True):
                if key in self._slot_of:
                    n += 1
                    continue
                if self._free:
                    slot = self._free.pop()
                elif self._fresh < self.slots:
                    slot = self._fresh
                    self._fresh += 1
                else:
                    break
                try:
                    self._memory.capture(int(page), self._address(slot))
                    if self._flags:
                        self._flags[slot] = self._memory.value_flags((int(page),))[0]
                except BaseException:
                    self._free.append(slot)
                    raise
                self._slot_of[key] = slot
                if self._ledger is not None:
                    self._ledger[slot * KEY_BYTES:(slot + 1) * KEY_BYTES] = key
                taken.append((key, slot))
                n += 1
        return n, taken

    def holds(self, key: bytes) -> bool:
        with self._lock:
            return key in self._slot_of

    def buffers(self, slot: int) -> PageBuffers:
        """A slot's chunks, in value order (what the store reads)."""
        area = self._area
        if area is None or area.view is None:
            raise ValueError("eviction staging is closed")
        start = slot * self._slot_bytes
        offsets = range(start, start + self._slot_bytes, self._chunk)
        return PageBuffers([area.view[o:o + self._chunk] for o in offsets], [area.address + o for o in offsets],
                           self._flags[slot] if self._flags else 0)

    def read_into(self, key: bytes, buffers: PageBuffers) -> bool:
        """Copy the staged value of `key` into `buffers` (a load's page); False when it is not staged (any
        more). The slot cannot be released meanwhile."""
        return self.read_flags_into(key, buffers) is not None

    def read_flags_into(self, key: bytes, buffers: PageBuffers) -> int | None:
        """`read_into`, answering the staged value's flags (None: not staged)."""
        with self._lock:
            slot = self._slot_of.get(key)
            if slot is None:
                return None
            src = self.buffers(slot)
            for dst, chunk in zip(buffers.views, src.views, strict=True):
                dst[:] = chunk
            return src.flags

    def release(self, keys: Sequence[bytes]) -> None:
        """The store is done with these keys' slots (written or failed): they are free again."""
        with self._lock:
            for key in keys:
                slot = self._slot_of.pop(key, None)
                if slot is not None:
                    self._free.append(slot)
                    if self._ledger is not None:
                        self._ledger[slot * KEY_BYTES:(slot + 1) * KEY_BYTES] = _EMPTY

    def _address(self, slot: int) -> int:
        assert self._area is not None, "a slot exists only where the area does"
        return self._area.address + slot * self._slot_bytes

    def close(self) -> None:
        """Free the memory; the ledger is cleared (what was staged is written or counted lost by then)."""
        with self._lock:
            if self._ledger is not None:
                self._ledger[:] = bytes(len(self._ledger))
                self._ledger.close()
                self._ledger = None
            self._slot_of.clear()
            self._free = []
            self._fresh = self.slots
        area, self._area = self._area, None
        if area is not None:
            area.close()


KEY_BYTES = 32
_EMPTY = bytes(KEY_BYTES)


def _open_ledger(path: Path, slots: int) -> tuple[int, mmap.mmap]:
    """(keys the ledger at `path` still holds: what a dead process lost, a fresh ledger of `slots` keys)."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    try:
        size = os.fstat(fd).st_size
        crashed = 0
        if size >= KEY_BYTES:
            with mmap.mmap(fd, size - size % KEY_BYTES, mmap.MAP_SHARED, mmap.PROT_READ) as old:
                keys = np.frombuffer(old, np.uint8).reshape(-1, KEY_BYTES)
                crashed = int(keys.any(axis=1).sum())
                del keys
        os.ftruncate(fd, 0)
        os.ftruncate(fd, slots * KEY_BYTES)
        return crashed, mmap.mmap(fd, slots * KEY_BYTES, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
    finally:
        os.close(fd)
