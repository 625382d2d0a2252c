"""Page allocator over page ids 1..num_pages-1 with per-page reference counts.

Free pages live on an int32 stack; `alloc(n)` pops n ids and `free` pushes the ids whose count drops to 0,
so both cost O(pages asked) whatever the pool size. Ids come out in ascending order on a fresh pool and
freed ids are reused last-in first-out, which makes page ids in tests exact and predictable.
"""

from __future__ import annotations

import numpy as np

from cache_service.core.errors import InvariantError
from cache_service.core.types import PageArray

NULL_PAGE = 0
"""Page 0 is the padding / null page: never handed out."""


class PageAllocator:
    __slots__ = ("_num_free", "_num_pages", "_refcount", "_stack")

    def __init__(self, num_pages: int) -> None:
        if num_pages < 2:
            raise ValueError(f"num_pages must be >= 2 (page 0 is reserved), got {num_pages}")
        self._num_pages = num_pages
        # Top of the stack is the end of the array: a fresh pool hands out 1, 2, 3, ...
        self._stack = np.arange(num_pages - 1, 0, -1, dtype=np.int32)
        self._num_free = num_pages - 1
        self._refcount = np.zeros(num_pages, dtype=np.uint16)

    @property
    def num_pages(self) -> int:
        return self._num_pages

    @property
    def num_free(self) -> int:
        return self._num_free

    @property
    def num_used(self) -> int:
        return self._num_pages - 1 - self._num_free

    def alloc(self, n: int) -> PageArray | None:
        """Take `n` free pages (refcount 1 each); None when fewer than `n` are free. Never partial."""
        if n < 0:
            raise ValueError(f"alloc of a negative page count: {n}")
        if n > self._num_free:
            return None
        top = self._num_free
        pages: PageArray = self._stack[top - n : top][::-1].copy()
        self._num_free = top - n
        self._refcount[pages] = 1
        return pages

    def incref(self, pages: PageArray) -> None:
        """Add one owner to each page (each must be allocated)."""
        if pages.size == 0:
            return
        counts = self._refcount[pages]
        if not counts.all():
            bad = int(pages[np.flatnonzero(counts == 0)[0]])
            raise InvariantError(f"incref of free page {bad}: pages must be allocated before sharing")
        self._refcount[pages] = counts + 1

    def free(self, pages: PageArray) -> None:
        """Drop one owner from each page; pages left with no owner return to the free stack.

        `pages` must not repeat an id within one call.
        """
        if pages.size == 0:
            return
        counts = self._refcount[pages]
        if not counts.all():
            bad = int(pages[np.flatnonzero(counts == 0)[0]])
            raise InvariantError(f"double free of page {bad}: refcount is already 0")
        counts = counts - 1
        self._refcount[pages] = counts
        released = pages[counts == 0]
        top = self._num_free
        self._stack[top : top + released.size] = released
        self._num_free = top + released.size

    def refcount(self, page: int) -> int:
        return int(self._refcount[page])

    def allocated_mask(self) -> np.ndarray:
        """Boolean mask over page ids: True where refcount > 0 (O(num_pages); for invariant checks)."""
        return self._refcount > 0

    def check(self) -> None:
        """Verify the stack and the counts agree: O(num_pages), for tests and GetStats(verify)."""
        free = self._stack[: self._num_free]
        if self._refcount[NULL_PAGE] != 0 or (free == NULL_PAGE).any():
            raise InvariantError("null page 0 must never be allocated or on the free stack")
        if np.unique(free).size != free.size:
            raise InvariantError("free stack holds a page twice")
        if self._refcount[free].any():
            raise InvariantError("a page on the free stack has a nonzero refcount")
        if int(np.count_nonzero(self._refcount)) != self.num_used:
            raise InvariantError("allocated pages (refcount > 0) != num_pages - 1 - num_free")

    def metadata_bytes(self) -> int:
        """Bytes of per-page bookkeeping held by the allocator."""
        return int(self._stack.nbytes + self._refcount.nbytes)
