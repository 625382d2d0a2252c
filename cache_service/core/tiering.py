"""The core's side of a tier beyond the pool (docs/design.md §8): what the tier holds of the radix, page by
page (`tier_pages.TierPages`: keys, stored and staged marks, eviction staging, events), and the loads and
offloads in progress. No I/O: the rpc layer hands what this module plans to the `TierService` (whose threads
talk to the store) and reports back here, on the loop, when the store is done.

Loads (`plan` -> the store's lookup -> `begin` -> the store's get -> `finish` -> `release`). `plan` reads the
radix (no change) and names the keys of the full pages beyond its match. `begin` pins the match in the radix
and takes fresh pages in ledger state LOADING: they are in no radix node and no page table, so no match, no
append and no Step answer can hand them out while the store writes them. `finish` (the store's completion,
on the loop, exactly once) inserts the pages that loaded verified into the radix under the pinned match
(duplicates of pages inserted meanwhile are freed), frees the others and quarantines those a failed transfer
may still write; until the waiter's `release` the new pages stay pinned, so the append that asked for them
finds them.

Offloads (`plan_offload` -> the store's put -> `offload_done`). Eviction never waits for the tier: pages are
written ahead of it. While fewer than half the pool's pages are free (a low watermark, `--tier-watermark`),
the pages the tier lacks on the paths of the least recently used evictable leaves are handed to the store,
root side first; each path is pinned (a radix lock the tier holds) down to its last such page, within a pin
limit of a quarter of the pool (`--tier-pin-fraction`); the pin ends when the store is done reading, which
marks the stored pages. Eviction then takes the same LRU leaves, already stored. That is the write-back
policy (HiCache's name); write-through (`--tier-policy`) offloads the same way with no watermark, so pages go
to the tier as soon as they are evictable, where the store's bandwidth allows.

A window pool (window.py) stores and loads by group: an offload's pin holds its path whole (the window cut of a
match is for readers), and its pages keep their window rows until the store is done; a load's pages take window
pages as any take does (or as many as are free), and `finish` drops those whose values held none.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence

import numpy as np
import numpy.typing as npt

from cache_service.core.config import CoreConfig
from cache_service.core.errors import InvariantError
from cache_service.core.ledger import EVICTABLE, FREE, LOADING, Counters, PageLedger
from cache_service.core.pages import PageAllocator
from cache_service.core.radix_node import RadixNode
from cache_service.core.tier_keys import Namespace, chain
from cache_service.core.tier_pages import TierPages

TAINTED_QUARANTINE_SECONDS = 60.0
"""How long a page a failed transfer may still write waits before it is free again, by default
(--tier-tainted-quarantine): longer than the store's own transfer timeout, so a late write lands in a page
nobody owns."""
SCAN_LEAVES = 64
"""Most LRU leaves one offload planning looks at."""


def _write_back(config: CoreConfig) -> int:
    return max(1, int(config.usable_pages * config.tier_watermark))


def _write_through(config: CoreConfig) -> int:
    return config.usable_pages + 1  # always under it: offload whatever is evictable and unstored


TIER_POLICIES: dict[str, Callable[[CoreConfig], int]] = {
    "write-back": _write_back,
    "write-through": _write_through,
}
"""--tier-policy name -> the low watermark (free pages) under which offloads run."""


class LoadPlan:
    """What `plan` found: `keys` of the full pages of `key` beyond the `matched` pages the radix held."""

    __slots__ = ("key", "keys", "matched", "salt")

    def __init__(self, salt: str, key: bytes, matched: int, keys: list[bytes]) -> None:
        self.salt = salt
        self.key = key
        self.matched = matched
        self.keys = keys


class Load:
    """A load in progress: `pages` (int32 LE, ledger LOADING) receive the values of `keys`, which follow the
    `base` pages of `key` that the radix holds (pinned by `node`)."""

    __slots__ = ("base", "done", "held", "key", "keys", "loaded", "node", "pages", "released", "salt")

    def __init__(self, salt: str, key: bytes, base: int, node: RadixNode | None, keys: list[bytes],
                 pages: bytes) -> None:
        self.salt = salt
        self.key = key
        self.base = base
        self.node = node
        self.keys = keys
        self.pages = pages
        self.done = False
        """`finish` ran: the pages are in the radix, freed or quarantined."""
        self.released = False
        """The waiter is finished with the load (answered, or gave up)."""
        self.held: RadixNode | None = None
        """The loaded pages' node, pinned from `finish` until `release`."""
        self.loaded = 0
        """Pages inserted into the radix (or found there already)."""

    @property
    def page_list(self) -> list[int]:
        return memoryview(self.pages).cast("i").tolist()

    def tier_tokens(self, prefix_hit_tokens: int, page_size: int) -> int:
        """Of an append's radix hit, the tokens this load brought in time."""
        if not self.done or not self.loaded:
            return 0
        return max(0, min(prefix_hit_tokens - self.base * page_size, self.loaded * page_size))


class Offload:
    """An offload in progress: the store reads `pages` (radix pages, pinned by the tier's lock on `node`)."""

    __slots__ = ("done", "keys", "node", "pages", "pinned", "windowless")

    def __init__(self, node: RadixNode, keys: list[bytes], pages: list[int], pinned: int,
                 windowless: frozenset[int] = frozenset()) -> None:
        self.node = node
        self.keys = keys
        self.pages = pages
        self.pinned = pinned
        """Pages the pin holds (the path down to `node`, stored ones included)."""
        self.windowless = windowless
        """A window pool's: the pages without window rows when planned. The store reads each page's window rows
        where it has them when it reads it; none is dropped meanwhile, but one may come (`WindowRows.adopt`), so
        these are announced without them (what their values may well be)."""
        self.done = False

    @property
    def items(self) -> list[tuple[bytes, int]]:
        return list(zip(self.keys, self.pages, strict=True))


class TierIndex(TierPages):
    """What the tier holds of one core's radix pages (`TierPages`), and its loads and offloads in progress.
    Single-threaded like the core."""

    def __init__(self, config: CoreConfig, namespace: Namespace, ledger: PageLedger, pages: PageAllocator,
                 counters: Counters, clock: Callable[[], float]) -> None:
        super().__init__(config, namespace, pages)
        self._ledger = ledger
        self._c = counters
        self._clock = clock
        self._tainted_seconds = config.tier_tainted_quarantine_seconds
        self._offloading: npt.NDArray[np.bool_] = np.zeros(config.num_pages, dtype=np.bool_)
        """Pages the store is reading (an offload in progress). A window pool's window rows of these are kept until
        the store is done (`WindowRows.busy`): the value says it has them, so they must stay the page's."""
        self.offloading_pages = 0
        self.pinned_pages = 0
        """Radix pages held by offload pins (paths overlapping between offloads count once per offload)."""
        try:
            watermark = TIER_POLICIES[config.tier_policy]
        except KeyError:
            raise ValueError(f"tier_policy must be one of {', '.join(TIER_POLICIES)}, got {config.tier_policy!r}")\
                from None
        self.policy = config.tier_policy
        self.low_watermark = watermark(config)
        """Offload while fewer pages than this are free (write-through: always)."""
        self.pin_limit = max(1, int(config.usable_pages * config.tier_pin_fraction))
        """Most pages offloads may pin at once (pinned pages cannot be evicted)."""
        self.loads: set[Load] = set()
        """Loads not finished (their pages are LOADING)."""
        self.held: set[Load] = set()
        """Finished loads whose pages stay pinned until `release`."""
        self.offloads: set[Offload] = set()
        self._scanned: tuple[int, ...] | None = None

    def offloading_view(self) -> memoryview:
        """The offloading bits as bytes over page ids (a window pool keeps those pages' window rows)."""
        return self._offloading.view(np.uint8).data

    # ------------------------------------------------------------------ loads

    def plan(self, salt: str, key: bytes) -> LoadPlan | None:
        """The keys of `key`'s full pages (int32 LE tokens, whole pages) beyond what the radix holds under
        `salt`; None when it holds them all. Changes nothing but key caches."""
        radix = self._tree()
        total = len(key) // self._pb
        if total == 0:
            return None
        match = radix.match(salt, key, touch=False)
        m = match.num_pages
        if m >= total:
            return None
        if m and self._keyed[last := int.from_bytes(match.pages[-4:], "little", signed=True)]:
            keys = chain(self.key_of(last), key[m * self._pb:], self._ps)
        else:
            keys = chain(self.root(salt), key, self._ps)
            if m:
                self._set_keys(match.pages, keys[:m])
            keys = keys[m:]
        return LoadPlan(salt, key, m, keys)

    def begin(self, plan: LoadPlan, found: int) -> Load | None:
        """Start loading the first `found` pages of `plan` (the tier holds them): pin what the radix holds
        now and take fresh LOADING pages for the rest, evicting if the pool is full. None when nothing is
        left to load (the radix caught up, or lost the plan's prefix meanwhile) or the pool has no room."""
        if found <= 0:
            return None
        radix = self._tree()
        want = plan.matched + min(found, len(plan.keys))
        match = radix.match(plan.salt, plan.key[: want * self._pb], lock=True)
        base = match.num_pages
        if base >= want or base < plan.matched:
            if match.node is not None:
                radix.unlock(match.node)
            return None
        n = want - base
        pages = self._alloc.take(n, LOADING)
        if pages is None:
            short = n - self._ledger.counts[FREE]
            if short <= self._ledger.counts[EVICTABLE]:
                radix.evict(short)
            pages = self._alloc.take(n, LOADING)
            if pages is None:
                pages = self._take_windowless(n)
            if pages is None:
                if match.node is not None:
                    radix.unlock(match.node)
                return None
        load = Load(plan.salt, plan.key, base, match.node, plan.keys[base - plan.matched: want - plan.matched],
                    pages)
        self.loads.add(load)
        return load

    def _take_windowless(self, n: int) -> bytes | None:
        """A window pool whose window pages are short even after relief (window.py's `relieve`): `n` LOADING
        pages without them, and window pages for as many of the last ones as are free; the values of the others
        load without their window rows (docs/design.md §13). None without a window pool or free pages."""
        window, hooks = self.window, self._alloc.window
        if window is None:
            return None
        self._alloc.window = None
        try:
            pages = self._alloc.take(n, LOADING)
        finally:
            self._alloc.window = hooks
        if pages is not None:
            window.attach_free(pages)
        return pages

    def finish(self, load: Load, loaded: int, tainted: Iterable[int] = (), windowless: Iterable[int] = ()) -> None:
        """The store is done with `load`: its first `loaded` pages hold their keys' values, verified. They
        join the radix; the rest are freed, `tainted` ones (a transfer that may still write) quarantined. A
        window pool's `windowless` pages (values without window rows) lose the window page they were given
        (its bytes are filler) before they join; duplicates of tree pages lacking window rows give the tree
        theirs (`WindowRows.adopt`)."""
        if load.done:
            raise InvariantError("tier: a load finished twice")
        radix = self._tree()
        loaded = max(0, min(loaded, len(load.keys)))
        pages = load.pages
        node = None
        window = self.window
        if loaded and window is not None:
            window.drop_loaded(windowless)
        if loaded:
            key = load.key[load.base * self._pb: (load.base + loaded) * self._pb]
            changes = radix.changes
            first = len(changes) if changes is not None else 0
            ins = radix.insert(load.salt, key, pages[: loaded * 4], below=load.node, src=LOADING)
            existing = ins.num_existing_pages
            if window is not None:
                if existing:  # before `loaded` splits the insert's record: adopt's records go before it
                    below = load.node.pages if load.base and load.node is not None else b""
                    window.adopt(load.salt, int.from_bytes(below[-4:], "little") if below else None, key, ins.pages,
                                 pages[: existing * 4], bare=False)
                window.loaded(changes, first)
            if existing:
                self._alloc.give(pages[: existing * 4], LOADING)
                self._c.duplicate_pages += existing
            new = np.frombuffer(pages[existing * 4: loaded * 4], dtype=np.int32)
            if new.size:
                self._set_keys(new, load.keys[existing:loaded])
                self._stored[new] = True
                self.stored_pages += new.size
                self._stored_at.update(zip(load.keys[existing:loaded], new.tolist(), strict=True))
            node = ins.node
            if node is not None and new.size:
                self._key_path(node)
                self._announce(node, new.tolist())
        rest = np.frombuffer(pages[loaded * 4:], dtype=np.int32)
        if rest.size:
            bad = np.isin(rest, np.fromiter(tainted, dtype=np.int32))
            if bad.any():
                with self._alloc.quarantining(self._clock() + self._tainted_seconds):
                    self._alloc.give(rest[bad].tobytes(), LOADING)
            if not bad.all():
                self._alloc.give(rest[~bad].tobytes(), LOADING)
        if node is not None and not load.released:
            radix.lock(node)
            load.held = node
            self.held.add(load)
        if load.node is not None:
            radix.unlock(load.node)
            load.node = None
        load.loaded = loaded
        load.done = True
        self.loads.discard(load)

    def release(self, load: Load) -> None:
        """The waiter is finished with `load` (idempotent): the loaded pages' pin ends, or, for a load still
        in progress, `finish` will not pin them."""
        load.released = True
        if load.held is not None:
            self._tree().unlock(load.held)
            load.held = None
            self.held.discard(load)

    # ------------------------------------------------------------------ offloads

    def plan_offload(self, room: int, *, force: bool = False) -> list[Offload]:
        """Name the radix pages the tier lacks on the paths of the LRU evictable leaves, root side first, up to
        `room` pages (the offload queue's room), and pin each path only down to its last such page (a radix
        lock on a node ending there). Pinned pages count against the pin limit (a share of the pool), so
        offloads never hold what an allocation needs. Only while free pages are under the low watermark (the
        scan skips stored pages, and is not repeated while nothing changed), unless `force` (at stop: offload
        what is resident; no pin limit). Each pin ends at `offload_done`."""
        radix = self._tree()
        counts = self._ledger.counts
        if not force and counts[FREE] >= self.low_watermark:
            return []
        pin_room = (self.pin_limit - self.pinned_pages) if not force else counts[EVICTABLE]
        stamp = (counts[FREE], counts[EVICTABLE], radix.evicted_pages_total, radix.heap_entries, self.stored_pages)
        if room <= 0 or pin_room <= 0 or (not force and stamp == self._scanned):
            return []
        jobs: list[Offload] = []
        pb = self._pb
        for leaf in radix.first_to_evict(SCAN_LEAVES if not force else max(SCAN_LEAVES, room)):
            path = self._key_path(leaf)
            ids = memoryview(b"".join(n.pages for n in path)).cast("i").tolist()
            pages: list[int] = []
            end = 0
            for i, p in enumerate(ids[:pin_room]):
                if not self._stored[p] and not self._offloading[p]:
                    if len(pages) == room:
                        break
                    pages.append(p)
                    end = i + 1
            if not pages:
                continue
            key = b"".join(n.key for n in path)[: end * pb]
            usable, radix.usable = radix.usable, None  # the pin holds the path whole, its window rows or not
            try:
                match = radix.match(leaf.salt or "", key, lock=True, touch=False)
            finally:
                radix.usable = usable
            if match.num_pages != end or match.node is None:
                raise InvariantError(f"tier: the path of leaf {leaf.id} no longer matches its own tokens")
            self._offloading[pages] = True
            self.offloading_pages += len(pages)
            self.pinned_pages += end
            pin_room -= end
            room -= len(pages)
            win = self.window.win if self.window is not None else None
            job = Offload(match.node, [bytes(self._keys[p]) for p in pages], pages, end,
                          frozenset(p for p in pages if not win[p]) if win is not None else frozenset())
            self.offloads.add(job)
            jobs.append(job)
            if room <= 0 or pin_room <= 0:
                break
        if not jobs:
            self._scanned = stamp
        return jobs

    def offload_done(self, job: Offload, stored: Sequence[bool] | None, accepted: int | None = None) -> None:
        """The store is done reading `job`'s pages (`stored[i]`: page i is in the tier now; None: nothing was
        stored). `accepted`, when given, is how many leading pages the queue took: the rest were refused and
        `offload_done` is called again for the accepted ones when the store finishes them."""
        if job.done:
            return
        if accepted is not None and accepted < len(job.pages):
            refused = job.pages[accepted:]
            self._offloading[refused] = False
            self.offloading_pages -= len(refused)
            job.pages = job.pages[:accepted]
            job.keys = job.keys[:accepted]
            if accepted:
                return
        job.done = True
        self.offloads.discard(job)
        self.pinned_pages -= job.pinned
        pages = job.pages
        self._offloading[pages] = False
        self.offloading_pages -= len(pages)
        if stored is not None:
            ok = [p for p, s in zip(pages, stored, strict=False) if s and not self._stored[p]]
            self._stored[ok] = True
            self.stored_pages += len(ok)
            self._stored_at.update((bytes(self._keys[p]), p) for p in ok)
            self._announce(job.node, ok, job.windowless)
        self._tree().unlock(job.node)

    # ------------------------------------------------------------------ accounting

    def loading(self) -> bytes:
        """Every LOADING page (int32 LE)."""
        return b"".join(load.pages for load in self.loads)

    def pins(self) -> Iterable[RadixNode]:
        """The radix nodes the tier holds locked (one entry per lock)."""
        for load in self.loads:
            if load.node is not None:
                yield load.node
        for load in self.held:
            if load.held is not None:
                yield load.held
        for job in self.offloads:
            yield job.node

    def check(self, radix_pages: bytes) -> None:
        """Stored and offloading pages are radix pages; the counts agree with the bits and the transfers."""
        owned = np.zeros(self._keyed.size, dtype=np.bool_)
        owned[np.frombuffer(radix_pages, dtype=np.int32)] = True
        self.check_pages(owned)
        if int(np.count_nonzero(self._offloading)) != self.offloading_pages:
            raise InvariantError("tier: offloading page count != offloading bits")
        if sum(j.pinned for j in self.offloads) != self.pinned_pages:
            raise InvariantError("tier: pinned page count != pins of the offloads in progress")
        if sum(len(j.pages) for j in self.offloads) != self.offloading_pages:
            raise InvariantError("tier: offloading page count != pages of the offloads in progress")
        if (self._offloading & ~owned).any():
            raise InvariantError("tier: a page being offloaded left the radix")
        if self._ledger.counts[LOADING] != len(self.loading()) >> 2:
            raise InvariantError("tier: LOADING count != pages of the loads in progress")
