"""Window rows: the sliding-window layers' rows of each page, kept apart from its full-attention rows
(docs/design.md §13, docs/attention-shapes.md "How a window pool is stored").

A pool with a window group has two page spaces. A **page** (the ids the allocator, the radix and the sessions
hold, 1..num_pages-1) names its full-attention rows; a **window page** (1..window_pages-1) holds one page's rows
of the window layers. `win[page]` is the window page of a page, 0 once its window rows were dropped. A page
always has its full rows while it is owned; its window rows come with it when it is taken (`attach`) and go back
with it when it is freed (`detach`), or earlier, on their own (`drop`), when no reader can need them:

- a hit at page boundary P (the radix match of P pages) needs the window rows of the `k = ceil((W - 1) /
  page_size)` pages before P (the last W - 1 positions a query at P attends to) and the full rows of all P
  pages: `usable` cuts a match back to the longest P for which both hold, so no reader is handed a page whose
  rows it needs but the pool dropped;
- **hit points** are where later requests can hit: `mark[page]` says a hit may end right after the page (a
  turn's prompt end and its committed end, the end of every radix match that was pinned, the end of every
  radix path). A page's window rows are needed iff a hit point lies within `k` pages after it on some path;
- `settle` (at a commit: the session moved past its pages) drops the window rows of the session's own pages
  that no hit point of its page table needs; `sweep` (under pressure) does the same over the whole radix, then
  `relieve` evicts whole radix pages (LRU) if the window pages are still short.

`usable`, `relieve` and the page hooks run inside the allocator's and the radix's calls (they are its hooks),
so every page that changes owner keeps its window page without the callers knowing the group exists.

A tier beyond the pool stores and loads by group (docs/design.md §8, docs/tiers.md "Window pools"): the window
rows of a page its store is reading are not dropped until it is done (`busy`); a load's pages take window pages
as any take does, or as many as are free (`attach_free`), and those whose values held none give theirs back
(`drop_loaded`) before they join the radix (`loaded` announces them to the full-attention groups only).
"""

from __future__ import annotations

from array import array
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

from cache_service.core.config import CoreConfig
from cache_service.core.errors import InvariantError
from cache_service.core.events import STORED_FULL, WINDOW_REMOVED, WINDOW_STORED
from cache_service.core.pages import PageAllocator
from cache_service.core.radix_node import STORED
from cache_service.core.types import EMPTY_PAGES, PageArray

if TYPE_CHECKING:
    from cache_service.core.radix import RadixTree

__all__ = ["WindowRows", "attach_window_rows", "window_page_ids", "window_span"]


class _Tier(Protocol):
    """The tier beyond the pool as window rows see it (`tiering.TierIndex`, a layer above)."""

    window: Any

    def offloading_view(self) -> memoryview: ...


def window_span(window_tokens: int, page_size: int) -> int:
    """Pages before a hit point whose window rows the hit needs: ceil((W - 1) / page_size)."""
    return max(0, -(-(window_tokens - 1) // page_size))


def attach_window_rows(config: CoreConfig, radix: RadixTree, pages: PageAllocator, *, tier: _Tier | None
                       ) -> WindowRows | None:
    """The window rows of a pool that keeps them apart (`config.window_pages`), hooked into the allocator, the
    tree and the `tier` beyond the pool (its loads and offloads store and load by group; the pages its store
    reads keep their window rows meanwhile, docs/design.md §8, §13); None for a pool without."""
    if not config.window_pages:
        return None
    window = WindowRows(config.num_pages, config.window_pages, config.page_size, config.window_tokens)
    if tier is not None:
        window.busy = tier.offloading_view()
        tier.window = window
    window.radix = radix
    pages.window = window
    radix.usable = window.usable
    return window


def window_page_ids(window: WindowRows | None, pages: bytes) -> PageArray:
    """The window pages of a page-table delta `pages` (int32 LE; empty without a window pool): read in the call
    that makes the delta, so they are the ones the engine must use for this turn's positions (docs/design.md
    §13)."""
    if window is None:
        return EMPTY_PAGES
    return np.frombuffer(window.window_of(pages), dtype=np.int32)


class WindowRows:
    """The window group's page space and which pages still hold their window rows. Single-threaded."""

    __slots__ = ("_dirty", "_free", "_state", "busy", "changes", "cut_hit_tokens", "evicted_pages", "k", "mark",
                 "num_pages", "page_size", "policy_dropped_pages", "pressure_dropped_pages", "radix", "win",
                 "window_pages", "window_tokens")

    def __init__(self, num_pages: int, window_pages: int, page_size: int, window_tokens: int) -> None:
        if window_pages < 2:
            raise ValueError(f"window_pages must be >= 2 (window page 0 is reserved), got {window_pages}")
        self.num_pages = num_pages
        self.window_pages = window_pages
        self.page_size = page_size
        self.window_tokens = window_tokens
        self.k = window_span(window_tokens, page_size)
        self.win = array("i", bytes(4 * num_pages))
        """Page -> its window page (0: none)."""
        self.mark = bytearray(num_pages)
        """1 where a hit may end right after the page (a hit point)."""
        self.busy: Any = bytes(num_pages)
        """Nonzero where a tier's store is reading the page (its value says whether it has window rows): those
        window rows are not dropped until the store is done (a window page may still move to such a page: `adopt`,
        the same KV; the tier then announces the value as without them, tiering.py)."""
        self._free = array("i", range(window_pages - 1, 0, -1))
        """Free window pages, a stack (a fresh pool hands out 1, 2, 3, ...)."""
        self._state = bytearray(window_pages)
        """1 where a window page is attached to a page."""
        self.radix: RadixTree | None = None
        self.changes: list[Any] | None = None
        """Where (WINDOW_REMOVED, salt, pages) records go for radix pages that lost their window rows."""
        self.policy_dropped_pages = 0
        """Cumulative window pages dropped at commits (`settle`)."""
        self.pressure_dropped_pages = 0
        """Cumulative window pages dropped under pressure (`sweep`)."""
        self.evicted_pages = 0
        """Cumulative whole radix pages evicted because window pages were short."""
        self.cut_hit_tokens = 0
        """Cumulative tokens pinned matches gave up because the window before them was gone."""
        self._dirty = True
        """The radix may hold rows no hit point needs (a commit came since the last sweep: its insert may have put
        pages below a path's former end). Nothing else makes rows unneeded: hit points are only ever added."""

    # ------------------------------------------------------------------ counts

    @property
    def usable_pages(self) -> int:
        return self.window_pages - 1

    @property
    def free_pages(self) -> int:
        return len(self._free)

    @property
    def held_pages(self) -> int:
        return self.window_pages - 1 - len(self._free)

    def window_of(self, pages: bytes) -> bytes:
        """The window pages (int32 LE; 0 where dropped) of `pages` (int32 LE): what a page-table delta sends beside
        its page ids. A few pages (a decode step's delta) by hand, more in one numpy gather (measured: 1.8 against
        2.8 us for one page, 7.6 against 2.7 us for 64)."""
        if len(pages) <= 16:
            if not pages:
                return b""
            win = self.win
            return array("i", [win[p] for p in memoryview(pages).cast("i")]).tobytes()
        return np.frombuffer(self.win, dtype=np.int32)[np.frombuffer(pages, dtype=np.int32)].tobytes()

    # ------------------------------------------------------------------ the allocator's hooks

    def attach(self, pages: bytes) -> None:
        """Give each of `pages` (just taken) a window page; `relieve` made sure there are enough."""
        free, win, state = self._free, self.win, self._state
        for p in memoryview(pages).cast("i"):
            w = free.pop()
            state[w] = 1
            win[p] = w

    def attach_free(self, pages: bytes) -> None:
        """Give window pages to as many of `pages` (just taken without them) as there are free ones, the last
        pages first (a hit at their end needs the window before it); the others keep none."""
        ids = memoryview(pages).cast("i")
        self.attach(ids[max(0, len(ids) - len(self._free)):].tobytes())

    def drop_loaded(self, pages: Iterable[int]) -> None:
        """Tier loads' pages whose values held no window rows (in no radix node yet): their window pages hold
        filler and go back free."""
        win = self.win
        self._drop([p for p in pages if win[p]])

    def loaded(self, changes: list[Any] | None, first: int) -> None:
        """A tier load's pages entered the radix (its STORED records from `changes[first:]`): the runs of pages
        without window rows are announced to the full-attention groups only (STORED_FULL), and the radix may hold
        rows no hit point needs now (the load extended a path past its former end)."""
        self._dirty = True
        if changes is None:
            return
        win = self.win
        i = first
        while i < len(changes):
            change = changes[i]
            if type(change) is not tuple or change[0] != STORED:
                i += 1
                continue
            _, salt, parent, key, pages = change
            ids = memoryview(pages).cast("i")
            pb = len(key) // len(ids)
            runs = []
            start = 0
            for j in range(1, len(ids) + 1):
                if j == len(ids) or bool(win[ids[j]]) != bool(win[ids[start]]):
                    runs.append((STORED if win[ids[start]] else STORED_FULL, salt,
                                 parent if start == 0 else ids[start - 1], key[start * pb:j * pb],
                                 pages[start * 4:j * 4]))
                    start = j
            changes[i:i + 1] = runs
            i += len(runs)

    def detach(self, pages: bytes) -> None:
        """`pages` were freed: their window pages (where they have one) and hit points go with them."""
        win, mark, state, free = self.win, self.mark, self._state, self._free
        for p in memoryview(pages).cast("i"):
            w = win[p]
            if w:
                win[p] = 0
                state[w] = 0
                free.append(w)
            mark[p] = 0

    def unmark(self, pages: bytes) -> None:
        """`pages` were quarantined: no longer hit points (their window pages wait for `detach`)."""
        mark = self.mark
        for p in memoryview(pages).cast("i"):
            mark[p] = 0

    def relieve(self, n: int) -> bool:
        """Make `n` window pages free: drop the window rows no hit point needs, then evict whole radix pages in
        eviction order (and the dead tail that leaves on the first leaf, `_trim`). False (nothing evicted) when even
        evicting every unpinned radix page would not do."""
        if n <= len(self._free):
            return True
        self.sweep()
        short = n - len(self._free)
        if short <= 0:
            return True
        radix = self.radix
        if radix is None or short > self._evictable_window_pages(radix):
            return False
        while len(self._free) < n and radix.evict(1):
            self.evicted_pages += 1
        self._trim(radix)
        return len(self._free) >= n

    def _trim(self, radix: RadixTree) -> None:
        """Evict the tail of the first leaf in eviction order while its last page has no window rows: no hit can
        end past a leaf's last page with window rows, so those pages' full rows serve nobody."""
        if not self.k:
            return
        win = self.win
        while True:
            first = radix.first_to_evict(1)
            if not first or win[int.from_bytes(first[0].pages[-4:], "little", signed=True)]:
                return
            radix.evict(1)
            self.evicted_pages += 1

    # ------------------------------------------------------------------ the radix's hook

    def usable(self, pages: bytes, pin: bool) -> int:
        """How many leading pages of a radix match (`pages`, int32 LE) a reader may use: the longest P whose
        window before it (`k` pages) still has its window rows. A pinned match (`pin`) makes P a hit point."""
        ids = memoryview(pages).cast("i")
        n = len(ids)
        k, win = self.k, self.win
        end = n
        if k and n:
            i = n - 1
            while i >= 0:
                if win[ids[i]]:
                    if end - i >= k or i == 0:
                        break
                else:
                    end = i
                i -= 1
            else:
                end = 0
        if pin:
            self.cut_hit_tokens += (n - end) * self.page_size
            if end:
                self.mark[ids[end - 1]] = 1
        return end

    # ------------------------------------------------------------------ the session's hooks

    def adopt(self, salt: str, parent: int | None, key: bytes, tree: bytes, ours: bytes, bare: bool = True) -> None:
        """An insert of a session's run (`key`, its token bytes, after radix page `parent` or at its tree's start)
        found the tree holding the first `len(ours)` pages of `tree` (the insert's pages) where the session brought
        `ours` (the same tokens, about to be freed), and the rest of `tree` entered the tree. A tree page without
        window rows takes over ours (the same KV), and our hit points carry over.

        While recording: the tree pages that got their window rows back are announced again in the window group
        (WINDOW_STORED, one record per run, before the insert's own record of the pages after them: parents
        first), and the pages that entered without window rows (a commit dropped them first) are announced as
        removed from it right after theirs, so a replay of the records holds, per group, the radix pages that
        hold its rows (docs/design.md §13). `bare` False: the caller announces the new pages by group itself (a
        tier load's, `loaded`)."""
        win, mark = self.win, self.mark
        n = len(ours) >> 2
        ids = memoryview(tree).cast("i")
        back: list[int] = []
        for i, o in enumerate(memoryview(ours).cast("i")):
            t = ids[i]
            if not win[t] and win[o]:
                win[t] = win[o]
                win[o] = 0
                back.append(i)
            if mark[o]:
                mark[t] = 1
        changes = self.changes
        if changes is None:
            return
        if back:
            at = len(changes) - 1 if len(ids) > n else len(changes)  # the insert's record of the new pages is last
            pb = self.page_size * 4
            runs = []
            j = 0
            while j < len(back):
                a = back[j]
                while j + 1 < len(back) and back[j + 1] == back[j] + 1:
                    j += 1
                b = back[j] + 1
                runs.append((WINDOW_STORED, salt, parent if a == 0 else ids[a - 1], key[a * pb : b * pb],
                             tree[a * 4 : b * 4]))
                j += 1
            changes[at:at] = runs
        if not bare:
            return
        without = [p for p in ids[n:] if not win[p]]
        if without:
            changes.append((WINDOW_REMOVED, salt, array("i", without).tobytes()))

    def settle(self, pages: bytes | bytearray, since: int, hits: tuple[int, ...]) -> None:
        """A session committed: `hits` (in pages) are its hit points (where a later request's match of the
        turn's prompt ends, and of its committed KV), `pages` its page table, `since` the first page that is its
        own (not the radix's). Drops the window rows of its own pages that no hit point on the table needs; the
        page at the last hit point and after (the session's continuation) stay."""
        ids = memoryview(bytes(pages)).cast("i")
        mark, win, k, busy = self.mark, self.win, self.k, self.busy
        last = max(hits)
        for h in hits:
            if h:
                mark[ids[h - 1]] = 1
        need = 0
        dropped = []
        for i in range(min(len(ids), last) - 1, since - 1, -1):
            p = ids[i]
            if mark[p]:
                need = k
            if need > 0:
                need -= 1
            elif win[p] and not busy[p]:
                dropped.append(p)
        self._drop(dropped)
        self.policy_dropped_pages += len(dropped)
        self._dirty = True

    # ------------------------------------------------------------------ pressure

    def sweep(self) -> int:
        """Drop the window rows of every radix page that no hit point needs (a path's end is a hit point, and so
        is where a pin ends: a streaming session's next turn reads the window before its pinned prompt's end).
        Returns how many window pages came free. O(radix pages)."""
        radix = self.radix
        if radix is None or not self._dirty:
            return 0
        self._dirty = False
        mark, win, k, busy = self.mark, self.win, self.k, self.busy
        total = 0
        demand: dict[int, int] = {}
        for node in reversed(radix.iter_nodes()):  # children before their parents
            if node.parent is None:
                continue  # a salt root: pageless
            need = max([demand.pop(c.id, 0) for c in node.children.values()], default=0)
            if not node.children or node.lock_ref > sum(c.lock_ref for c in node.children.values()):
                need = k  # a path's end, or where a pin ends (a session continues after it)
            ids = memoryview(node.pages).cast("i")
            dropped = []
            for i in range(len(ids) - 1, -1, -1):
                p = ids[i]
                if mark[p] and need < k:
                    need = k
                if need > 0:
                    need -= 1
                elif win[p] and not busy[p]:
                    dropped.append(p)
            if dropped:
                self._drop(dropped, node.salt or "")
                total += len(dropped)
            demand[node.id] = need
        self.pressure_dropped_pages += total
        return total

    def _evictable_window_pages(self, radix: RadixTree) -> int:
        win = self.win
        return sum(1 for node in radix.iter_nodes() if node.parent is not None and not node.lock_ref
                   for p in memoryview(node.pages).cast("i") if win[p])

    def _drop(self, pages: list[int], salt: str | None = None) -> None:
        win, state, free = self.win, self._state, self._free
        for p in pages:
            w = win[p]
            win[p] = 0
            state[w] = 0
            free.append(w)
        if pages and salt is not None and self.changes is not None:
            self.changes.append((WINDOW_REMOVED, salt, array("i", pages).tobytes()))

    # ------------------------------------------------------------------ verification

    def check(self, owned: Any) -> None:
        """Every window page is free or attached to exactly one owned page, never both; hit points only on
        owned pages. `owned`: a boolean mask over page ids (allocated or quarantined). O(pool), in numpy."""
        free = np.frombuffer(self._free, dtype=np.int32).copy()  # copies: a live view would pin the stack's size
        win = np.frombuffer(self.win, dtype=np.int32).copy()
        if np.unique(free).size != free.size or ((free <= 0) | (free >= self.window_pages)).any():
            raise InvariantError("window free stack holds a page twice or an id out of range")
        attached = np.flatnonzero(win)
        ws = win[attached]
        if np.unique(ws).size != ws.size:
            raise InvariantError("a window page is attached to two pages")
        if np.intersect1d(ws, free).size:
            raise InvariantError("a window page is both free and attached")
        if ws.size + free.size != self.window_pages - 1:
            raise InvariantError(f"window pages: {ws.size} attached + {free.size} free != {self.window_pages - 1}")
        state = np.frombuffer(self._state, dtype=np.uint8)
        if (state[ws] != 1).any() or int(state.sum()) != ws.size:
            raise InvariantError("window page states disagree with the attached pages")
        stray = attached[~owned[attached]]
        if stray.size:
            raise InvariantError(f"page {int(stray[0])} is not owned but holds window rows")
        marked = np.flatnonzero(np.frombuffer(self.mark, dtype=np.uint8))
        stray = marked[~owned[marked]]
        if stray.size:
            raise InvariantError(f"page {int(stray[0])} is not owned but is a hit point")
