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

Threads: the loop captures and looks up, the load worker copies out, the offload worker reads slots and
releases them; one lock guards the key map and the free list. A slot's bytes are read without the lock: it
stays taken until its key is released, which happens only after the store finished reading it.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence

from cache_service.tier.memory import HostArea, PageBuffers, PageMemory


class EvictionStaging:
    """`slots` pages of host memory, keyed by tier key. `close()` (idempotent) frees the memory."""

    def __init__(self, memory: PageMemory, capacity_bytes: int) -> None:
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
        self._lock = threading.Lock()

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
                except BaseException:
                    self._free.append(slot)
                    raise
                self._slot_of[key] = slot
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
        return PageBuffers([area.view[o:o + self._chunk] for o in offsets], [area.address + o for o in offsets])

    def read_into(self, key: bytes, buffers: PageBuffers) -> bool:
        """Copy the staged value of `key` into `buffers` (a load's page); False when it is not staged (any
        more). The slot cannot be released meanwhile."""
        with self._lock:
            slot = self._slot_of.get(key)
            if slot is None:
                return False
            src = self.buffers(slot)
            for dst, chunk in zip(buffers.views, src.views, strict=True):
                dst[:] = chunk
            return True

    def release(self, keys: Sequence[bytes]) -> None:
        """The store is done with these keys' slots (written or failed): they are free again."""
        with self._lock:
            for key in keys:
                slot = self._slot_of.pop(key, None)
                if slot is not None:
                    self._free.append(slot)

    def _address(self, slot: int) -> int:
        assert self._area is not None, "a slot exists only where the area does"
        return self._area.address + slot * self._slot_bytes

    def close(self) -> None:
        with self._lock:
            self._slot_of.clear()
            self._free = []
            self._fresh = self.slots
        area, self._area = self._area, None
        if area is not None:
            area.close()
