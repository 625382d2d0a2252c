"""The page allocator: page ids 1..num_pages-1, each free, owned by exactly one holder, or quarantined.

Free pages live on an int32 stack; `alloc(n)` pops n ids and `free` pushes them back, so both cost
O(pages asked) whatever the pool size. Ids come out in ascending order on a fresh pool and freed ids are
reused last-in first-out, which makes page ids in tests exact and predictable. A page has one owner at a
time (the radix tree, a session, a turn in flight), so one state byte per page is all the state: a second
free of a page is a bug and raises before anything changes. The bytes live in a bytearray with a numpy
view: runs of a few pages (one page per decode extension) are marked element by element, which is
several times cheaper than numpy fancy indexing at that size.

Quarantine: pages freed inside `quarantining(until)` (what an expired lease released: a stalled engine
may still write them) do not go back to the stack but wait, in the order they came, until `release_due`
passes `until`.
"""

from __future__ import annotations

import contextlib
from collections import deque
from collections.abc import Iterator

import numpy as np
import numpy.typing as npt

from cache_service.core.errors import InvariantError
from cache_service.core.types import PageArray

NULL_PAGE = 0
"""Page 0 is the padding / null page: never handed out."""
FREE, OWNED, QUARANTINED = 0, 1, 2
"""A page's state byte."""
_SMALL = 32
"""Up to this many pages, the state bytes are updated per element rather than through numpy."""


class PageAllocator:
    __slots__ = ("_num_free", "_num_pages", "_num_quarantined", "_quarantine", "_quarantine_until", "_stack",
                 "_state", "_view")

    def __init__(self, num_pages: int) -> None:
        if num_pages < 2:
            raise ValueError(f"num_pages must be >= 2 (page 0 is reserved), got {num_pages}")
        self._num_pages = num_pages
        # Top of the stack is the end of the array: a fresh pool hands out 1, 2, 3, ...
        self._stack = np.arange(num_pages - 1, 0, -1, dtype=np.int32)
        self._num_free = num_pages - 1
        self._state = bytearray(num_pages)
        self._view: npt.NDArray[np.uint8] = np.frombuffer(self._state, dtype=np.uint8)  # a view, not a copy
        self._quarantine: deque[tuple[float, PageArray]] = deque()
        self._num_quarantined = 0
        self._quarantine_until: float | None = None

    @property
    def num_pages(self) -> int:
        return self._num_pages

    @property
    def num_free(self) -> int:
        return self._num_free

    @property
    def num_quarantined(self) -> int:
        return self._num_quarantined

    @property
    def num_used(self) -> int:
        """Owned pages (neither free nor quarantined)."""
        return self._num_pages - 1 - self._num_free - self._num_quarantined

    def alloc(self, n: int) -> PageArray | None:
        """Take `n` free pages; None when fewer than `n` are free. Never partial."""
        if n < 0:
            raise ValueError(f"alloc of a negative page count: {n}")
        if n > self._num_free:
            return None
        top = self._num_free
        pages: PageArray = self._stack[top - n : top][::-1].copy()
        self._num_free = top - n
        if n <= _SMALL:
            state = self._state
            for p in pages.tolist():
                state[p] = OWNED
        else:
            self._view[pages] = OWNED
        return pages

    def free(self, pages: PageArray) -> None:
        """Give back `pages` (distinct ids, each owned): to the free stack, or to quarantine inside
        `quarantining`."""
        n = pages.size
        if n == 0:
            return
        to = QUARANTINED if self._quarantine_until is not None else FREE
        if n <= _SMALL:
            state = self._state
            ids = pages.tolist()
            for p in ids:
                if state[p] != OWNED:
                    raise InvariantError(f"double free of page {p}: it is not owned")
            for p in ids:
                state[p] = to
        else:
            owned = self._view[pages] == OWNED
            if not owned.all():
                bad = int(pages[np.flatnonzero(~owned)[0]])
                raise InvariantError(f"double free of page {bad}: it is not owned")
            self._view[pages] = to
        if self._quarantine_until is not None:
            self._quarantine.append((self._quarantine_until, pages.copy()))
            self._num_quarantined += n
            return
        self._push(pages)

    def _push(self, pages: PageArray) -> None:
        top = self._num_free
        self._stack[top : top + pages.size] = pages
        self._num_free = top + pages.size

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
        q = self._quarantine
        while q and q[0][0] <= now:
            _, pages = q.popleft()
            self._view[pages] = FREE
            self._push(pages)
            released += pages.size
        self._num_quarantined -= released
        return released

    def next_release(self) -> float | None:
        """When the next quarantined pages come free (None: none are quarantined)."""
        return self._quarantine[0][0] if self._quarantine else None

    def is_allocated(self, page: int) -> bool:
        return self._state[page] == OWNED

    def allocated_mask(self) -> npt.NDArray[np.bool_]:
        """Boolean mask over page ids: True where owned (O(num_pages); for invariant checks)."""
        mask: npt.NDArray[np.bool_] = self._view == OWNED
        return mask

    def check(self) -> None:
        """Verify the stack, the quarantine and the state bytes agree: O(num_pages), for tests and
        GetStats(verify)."""
        free = self._stack[: self._num_free]
        if self._view[NULL_PAGE] != FREE or (free == NULL_PAGE).any():
            raise InvariantError("null page 0 must never be allocated or on the free stack")
        if np.unique(free).size != free.size:
            raise InvariantError("free stack holds a page twice")
        if (self._view[free] != FREE).any():
            raise InvariantError("a page on the free stack is not in the free state")
        held = np.concatenate([p for _, p in self._quarantine]) if self._quarantine else free[:0]
        if held.size != self._num_quarantined or (self._view[held] != QUARANTINED).any():
            raise InvariantError("quarantined pages and their count or state disagree")
        if int(np.count_nonzero(self._view == QUARANTINED)) != self._num_quarantined:
            raise InvariantError("pages in the quarantined state != the quarantine's count")
        if int(np.count_nonzero(self._view == OWNED)) != self.num_used:
            raise InvariantError("owned pages != num_pages - 1 - free - quarantined")

    def metadata_bytes(self) -> int:
        """Bytes of per-page bookkeeping held by the allocator."""
        return int(self._stack.nbytes + len(self._state))
