"""The page allocator: page ids 1..num_pages-1, each free or owned by exactly one holder.

Free pages live on an int32 stack; `alloc(n)` pops n ids and `free` pushes them back, so both cost
O(pages asked) whatever the pool size. Ids come out in ascending order on a fresh pool and freed ids are
reused last-in first-out, which makes page ids in tests exact and predictable. A page has one owner at a
time (the radix tree, a session, a turn in flight), so one "allocated" byte per page is all the state:
a second free of a page is a bug and raises before anything changes. The byte lives in a bytearray
with a numpy view: runs of a few pages (one page per decode extension) are marked element by element,
which is several times cheaper than numpy fancy indexing at that size.
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt

from cache_service.core.errors import InvariantError
from cache_service.core.types import PageArray

NULL_PAGE = 0
"""Page 0 is the padding / null page: never handed out."""
_SMALL = 32
"""Up to this many pages, the mask is updated per element rather than through numpy."""


class PageAllocator:
    __slots__ = ("_allocated", "_mask", "_num_free", "_num_pages", "_stack")

    def __init__(self, num_pages: int) -> None:
        if num_pages < 2:
            raise ValueError(f"num_pages must be >= 2 (page 0 is reserved), got {num_pages}")
        self._num_pages = num_pages
        # Top of the stack is the end of the array: a fresh pool hands out 1, 2, 3, ...
        self._stack = np.arange(num_pages - 1, 0, -1, dtype=np.int32)
        self._num_free = num_pages - 1
        self._allocated = bytearray(num_pages)
        self._mask: npt.NDArray[np.bool_] = np.frombuffer(self._allocated, dtype=np.bool_)  # a view, not a copy

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
        """Take `n` free pages; None when fewer than `n` are free. Never partial."""
        if n < 0:
            raise ValueError(f"alloc of a negative page count: {n}")
        if n > self._num_free:
            return None
        top = self._num_free
        pages: PageArray = self._stack[top - n : top][::-1].copy()
        self._num_free = top - n
        if n <= _SMALL:
            allocated = self._allocated
            for p in pages.tolist():
                allocated[p] = 1
        else:
            self._mask[pages] = True
        return pages

    def free(self, pages: PageArray) -> None:
        """Return `pages` (distinct ids, each allocated) to the free stack."""
        n = pages.size
        if n == 0:
            return
        if n <= _SMALL:
            allocated = self._allocated
            ids = pages.tolist()
            for p in ids:
                if not allocated[p]:
                    raise InvariantError(f"double free of page {p}: it is already free")
            for p in ids:
                allocated[p] = 0
        else:
            owned = self._mask[pages]
            if not owned.all():
                bad = int(pages[np.flatnonzero(~owned)[0]])
                raise InvariantError(f"double free of page {bad}: it is already free")
            self._mask[pages] = False
        top = self._num_free
        self._stack[top : top + pages.size] = pages
        self._num_free = top + pages.size

    def is_allocated(self, page: int) -> bool:
        return bool(self._allocated[page])

    def allocated_mask(self) -> npt.NDArray[np.bool_]:
        """Boolean mask over page ids: True where allocated (O(num_pages); for invariant checks)."""
        mask: npt.NDArray[np.bool_] = self._mask.copy()
        return mask

    def check(self) -> None:
        """Verify the stack and the mask agree: O(num_pages), for tests and GetStats(verify)."""
        free = self._stack[: self._num_free]
        if self._mask[NULL_PAGE] or (free == NULL_PAGE).any():
            raise InvariantError("null page 0 must never be allocated or on the free stack")
        if np.unique(free).size != free.size:
            raise InvariantError("free stack holds a page twice")
        if self._mask[free].any():
            raise InvariantError("a page on the free stack is marked allocated")
        if int(np.count_nonzero(self._mask)) != self.num_used:
            raise InvariantError("allocated pages != num_pages - 1 - num_free")

    def metadata_bytes(self) -> int:
        """Bytes of per-page bookkeeping held by the allocator."""
        return int(self._stack.nbytes + len(self._allocated))
