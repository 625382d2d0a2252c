"""The page allocator: page ids 1..num_pages-1, each free, owned by exactly one holder, or quarantined.

Free pages live on an int32 stack; `take(n)` pops n ids and `give` pushes them back, so both cost
O(pages asked) whatever the pool size. Page ids travel as int32 little-endian bytes (what a page table and
a response hold), so the hot path makes no numpy array per call; `alloc`/`free` are the same calls on
numpy arrays. Every call names the ledger state the pages come from or go to, and moves the ledger's
counts: the allocator keeps no page count of its own (the stack's top is the ledger's FREE count).

Ids come out in ascending order on a fresh pool and freed ids are reused last-in first-out, which makes
page ids in tests exact and predictable. A page has one owner at a time (the radix tree, a session, a
turn in flight), so one state byte per page is all the state: a second free of a page is a bug and
raises before anything changes. The bytes live in a bytearray with a numpy view: runs of a few pages
(one page per decode extension) are marked element by element, which is several times cheaper than
numpy fancy indexing at that size.

Quarantine: pages freed inside `quarantining(until)` (what an expired lease released: a stalled engine
may still write them) do not go back to the stack but wait, in the order they came, until `release_due`
passes `until`.
"""

from __future__ import annotations

import contextlib
from array import array
from collections import deque
from collections.abc import Iterator
from typing import Protocol

import numpy as np
import numpy.typing as npt

from cache_service.core.errors import InvariantError
from cache_service.core.ledger import FREE, IN_FLIGHT, QUARANTINED, PageLedger
from cache_service.core.types import PageArray

NULL_PAGE = 0
"""Page 0 is the padding / null page: never handed out."""
FREE_BYTE, OWNED_BYTE, QUARANTINED_BYTE = 0, 1, 2
"""A page's state byte."""
OWNED = OWNED_BYTE
_SMALL = 32
"""Up to this many pages, the state bytes are updated per element rather than through numpy."""

__all__ = ["NULL_PAGE", "OWNED", "QUARANTINED_BYTE", "PageAllocator", "WindowHooks"]


class WindowHooks(Protocol):
    """A window pool's window rows (`window.WindowRows`, docs/design.md §13) as the allocator calls them (the first
    four) and the session slots reach them through it (the rest)."""

    def relieve(self, n: int) -> bool: ...

    def attach(self, pages: bytes) -> None: ...

    def detach(self, pages: bytes) -> None: ...

    def unmark(self, pages: bytes) -> None: ...

    def settle(self, pages: bytes | bytearray, since: int, hits: tuple[int, ...]) -> None: ...

    def adopt(self, salt: str, parent: int | None, key: bytes, tree: bytes, ours: bytes) -> None: ...

    @property
    def free_pages(self) -> int: ...

    @property
    def usable_pages(self) -> int: ...


class PageAllocator:
    __slots__ = ("_ids", "_ledger", "_num_pages", "_quarantine_until", "_stack", "_state", "_view", "ledger",
                 "quarantine", "window")

    def __init__(self, num_pages: int, ledger: PageLedger | None = None) -> None:
        if num_pages < 2:
            raise ValueError(f"num_pages must be >= 2 (page 0 is reserved), got {num_pages}")
        self._num_pages = num_pages
        self.ledger = self._ledger = ledger if ledger is not None else PageLedger(num_pages - 1)
        # Top of the stack is the end of the array: a fresh pool hands out 1, 2, 3, ...
        self._ids = array("i", np.arange(num_pages - 1, 0, -1, dtype=np.int32).tobytes())
        """The stack as Python ints (runs of a few pages pop and push here without numpy's per-call cost)."""
        self._stack: npt.NDArray[np.int32] = np.frombuffer(self._ids, dtype=np.int32)  # a view of _ids
        self._state = bytearray(num_pages)
        self._view: npt.NDArray[np.uint8] = np.frombuffer(self._state, dtype=np.uint8)  # a view, not a copy
        self.quarantine: deque[tuple[float, bytes]] = deque()
        self._quarantine_until: float | None = None
        self.window: WindowHooks | None = None
        """A window pool's window rows (window.py): every page taken gets its window page, every page freed
        gives it back; None without a window group."""

    @property
    def num_pages(self) -> int:
        return self._num_pages

    @property
    def num_free(self) -> int:
        return self._ledger.counts[FREE]

    @property
    def num_quarantined(self) -> int:
        return self._ledger.counts[QUARANTINED]

    @property
    def num_used(self) -> int:
        """Owned pages (neither free nor quarantined)."""
        return self._num_pages - 1 - self.num_free - self.num_quarantined

    # ------------------------------------------------------------------ the hot path: page ids as bytes

    def take(self, n: int, to: int) -> bytes | None:
        """Take `n` free pages for an owner in ledger state `to`, as int32 LE bytes; None when fewer than
        `n` are free. Never partial."""
        counts = self._ledger.counts
        if n > counts[FREE]:
            return None
        if n < 0:
            raise ValueError(f"alloc of a negative page count: {n}")
        window = self.window
        if window is not None:
            if not window.relieve(n):  # may evict radix pages: the free count is read after it
                return None
            if n > counts[FREE]:
                return None
        top = counts[FREE]
        counts[FREE] = top - n
        counts[to] += n
        if n == 1:  # a decode extension: the common case
            p = self._ids[top - 1]
            self._state[p] = OWNED_BYTE
            out = p.to_bytes(4, "little")
        elif n <= _SMALL:
            run = self._ids[top - n : top]
            run.reverse()
            state = self._state
            for p in run:
                state[p] = OWNED_BYTE
            out = run.tobytes()
        else:
            chunk = self._stack[top - n : top][::-1]
            self._view[chunk] = OWNED_BYTE
            out = chunk.tobytes()
        if window is not None:
            window.attach(out)
        return out

    def give(self, pages: bytes, src: int) -> None:
        """Give back `pages` (int32 LE bytes of distinct owned ids) that an owner in ledger state `src`
        held: to the free stack, or to quarantine inside `quarantining`."""
        n = len(pages) >> 2
        if n == 0:
            return
        quarantine = self._quarantine_until is not None
        to = QUARANTINED_BYTE if quarantine else FREE_BYTE
        if n <= _SMALL:
            state = self._state
            run = array("i")
            run.frombytes(pages)
            for p in run:
                if state[p] != OWNED_BYTE:
                    raise InvariantError(f"double free of page {p}: it is not owned")
            for p in run:
                state[p] = to
        else:
            arr = np.frombuffer(pages, dtype=np.int32)
            owned = self._view[arr] == OWNED_BYTE
            if not owned.all():
                bad = int(arr[np.flatnonzero(~owned)[0]])
                raise InvariantError(f"double free of page {bad}: it is not owned")
            self._view[arr] = to
        counts = self._ledger.counts
        counts[src] -= n
        if self.window is not None:  # a quarantined page keeps its window page until it is released
            if quarantine:
                self.window.unmark(pages)
            else:
                self.window.detach(pages)
        if quarantine:
            assert self._quarantine_until is not None
            self.quarantine.append((self._quarantine_until, bytes(pages)))
            counts[QUARANTINED] += n
            return
        top = counts[FREE]
        if n <= _SMALL:
            self._ids[top : top + n] = run
        else:
            self._stack[top : top + n] = arr
        counts[FREE] = top + n

    # ------------------------------------------------------------------ the same on numpy arrays

    def alloc(self, n: int, to: int = IN_FLIGHT) -> PageArray | None:
        """`take` as a fresh int32 array."""
        pages = self.take(n, to)
        return None if pages is None else np.frombuffer(pages, dtype=np.int32).copy()

    def free(self, pages: PageArray, src: int = IN_FLIGHT) -> None:
        """`give` of an int32 array."""
        self.give(np.ascontiguousarray(pages, dtype=np.int32).tobytes(), src)

    # ------------------------------------------------------------------ quarantine

    @contextlib.contextmanager
    def quarantining(self, until: float) -> Iterator[None]:
        """Pages freed inside stay quarantined until `release_due(now)` with now >= `until`."""
        outer, self._quarantine_until = self._quarantine_until, until
        try:
            yield
        finally:
            self._quarantine_until = outer

    def release_due(self, now: float) -> int:
        """Free the quarantined pages whose time has come; returns how many."""
        released = 0
        q = self.quarantine
        counts = self._ledger.counts
        while q and q[0][0] <= now:
            _, pages = q.popleft()
            arr = np.frombuffer(pages, dtype=np.int32)
            if self.window is not None:
                self.window.detach(pages)
            self._view[arr] = FREE_BYTE
            top = counts[FREE]
            self._stack[top : top + arr.size] = arr
            counts[FREE] = top + arr.size
            counts[QUARANTINED] -= arr.size
            released += arr.size
        return released

    def next_release(self) -> float | None:
        """When the next quarantined pages come free (None: none are quarantined)."""
        return self.quarantine[0][0] if self.quarantine else None

    # ------------------------------------------------------------------ inspection

    def is_allocated(self, page: int) -> bool:
        return self._state[page] == OWNED_BYTE

    def is_quarantined(self, page: int) -> bool:
        return self._state[page] == QUARANTINED_BYTE

    def allocated_mask(self) -> npt.NDArray[np.bool_]:
        """Boolean mask over page ids: True where owned (O(num_pages); for invariant checks)."""
        mask: npt.NDArray[np.bool_] = self._view == OWNED_BYTE
        return mask

    def quarantined_mask(self) -> npt.NDArray[np.bool_]:
        """Boolean mask over page ids: True where quarantined."""
        mask: npt.NDArray[np.bool_] = self._view == QUARANTINED_BYTE
        return mask

    def check(self) -> None:
        """Verify the stack, the quarantine, the state bytes and the ledger's FREE and QUARANTINED counts
        agree: O(num_pages), for tests and GetStats(verify)."""
        free = self._stack[: self.num_free]
        if self._view[NULL_PAGE] != FREE_BYTE or (free == NULL_PAGE).any():
            raise InvariantError("null page 0 must never be allocated or on the free stack")
        if np.unique(free).size != free.size:
            raise InvariantError("free stack holds a page twice")
        if (self._view[free] != FREE_BYTE).any():
            raise InvariantError("a page on the free stack is not in the free state")
        if int(np.count_nonzero(self._view == FREE_BYTE)) - 1 != free.size:  # the null page is FREE too
            raise InvariantError("pages in the free state != the ledger's free count")
        held = (np.frombuffer(b"".join(p for _, p in self.quarantine), dtype=np.int32) if self.quarantine
                else free[:0])
        if held.size != self.num_quarantined or (self._view[held] != QUARANTINED_BYTE).any():
            raise InvariantError("quarantined pages and their count or state disagree")
        if int(np.count_nonzero(self._view == QUARANTINED_BYTE)) != self.num_quarantined:
            raise InvariantError("pages in the quarantined state != the ledger's quarantined count")

    def metadata_bytes(self) -> int:
        """Bytes of per-page bookkeeping held by the allocator."""
        return int(self._stack.nbytes + len(self._state))
