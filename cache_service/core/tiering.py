"""The core's side of a tier beyond the pool (docs/design.md §8): page keys, which radix pages the tier holds,
loads in progress and offloads in progress. No I/O: the rpc layer hands what this module plans to the
`TierService` (whose threads talk to the store) and reports back here, on the loop, when the store is done.

Keys. A radix page's tier key is the SHA-256 chain of `tier_keys` over its path's tokens, rooted in the
namespace and the salt. Keys are computed per node when first needed and kept per page id (`_keys`,
`_keyed`) while the page stays in the radix; a page's key bit is cleared when eviction frees it.

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

Staging at eviction. A burst evicts in the same call that crosses the watermark, before any offload could run.
So eviction hands the pages the tier lacks to `stage` (set by the rpc layer; pure code here calls it as it
calls any injected callable), which copies their bytes out into bounded host memory before the page ids go
back to the allocator, i.e. before this call's allocation can hand them to a writer; the tier writes them from
there. Pages `stage` refuses (staging full, the tier down) are lost, counted in `evicted_unstored_pages`, and so
are staged pages the tier then failed to write (`lost`).

Events. While the facade records changes (KV events), pages the tier holds are announced as such: the pages an
offload stored, the pages staged at eviction (announced before their removal from the radix) and the pages a
load brought in, as `TIER_STORED` change tuples; pages it lost or dropped (`lost`, `dropped`) as `TIER_REMOVED`.
Publishers give them the tier's medium (events.py).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence

import numpy as np
import numpy.typing as npt

from cache_service.core.config import CoreConfig
from cache_service.core.errors import InvariantError
from cache_service.core.events import TIER_REMOVED, TIER_STORED
from cache_service.core.ledger import EVICTABLE, FREE, LOADING, Counters, PageLedger
from cache_service.core.pages import PageAllocator
from cache_service.core.radix import RadixNode, RadixTree
from cache_service.core.tier_keys import KEY_BYTES, Namespace, chain

TAINTED_QUARANTINE_SECONDS = 60.0
"""How long a page a failed transfer may still write waits before it is free again, by default
(--tier-tainted-quarantine): longer than the store's own transfer timeout, so a late write lands in a page
nobody owns."""
SCAN_LEAVES = 64
"""Most LRU leaves one offload planning looks at."""

Stage = Callable[[list[bytes], npt.NDArray[np.int32]], int]
"""`stage(keys, pages) -> n`: copy the first n pages' bytes out of the pool now (before they can be reused) for
the tier to write under their keys; n < len(pages) where there is no room for the rest."""


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

    __slots__ = ("done", "keys", "node", "pages", "pinned")

    def __init__(self, node: RadixNode, keys: list[bytes], pages: list[int], pinned: int) -> None:
        self.node = node
        self.keys = keys
        self.pages = pages
        self.pinned = pinned
        """Pages the pin holds (the path down to `node`, stored ones included)."""
        self.done = False

    @property
    def items(self) -> list[tuple[bytes, int]]:
        return list(zip(self.keys, self.pages, strict=True))


class TierIndex:
    """Keys, stored bits, loads and offloads of one core. Single-threaded like the core."""

    def __init__(self, config: CoreConfig, namespace: Namespace, ledger: PageLedger, pages: PageAllocator,
                 counters: Counters, clock: Callable[[], float]) -> None:
        if namespace.page_size != config.page_size:
            raise ValueError(f"tier namespace page size {namespace.page_size} != pool page size {config.page_size}")
        self.namespace = namespace
        self._ps = config.page_size
        self._pb = 4 * config.page_size
        self._ledger = ledger
        self._alloc = pages
        self._c = counters
        self._clock = clock
        self._tainted_seconds = config.tier_tainted_quarantine_seconds
        self.radix: RadixTree | None = None
        """Set by the facade once the tree exists (the tree's free callback is `free_evicted`)."""
        n = config.num_pages
        self._keys: npt.NDArray[np.uint8] = np.zeros((n, KEY_BYTES), dtype=np.uint8)
        self._keyed: npt.NDArray[np.bool_] = np.zeros(n, dtype=np.bool_)
        self._stored: npt.NDArray[np.bool_] = np.zeros(n, dtype=np.bool_)
        self._offloading: npt.NDArray[np.bool_] = np.zeros(n, dtype=np.bool_)
        self._stored_at: dict[bytes, int] = {}
        """Key -> page of every stored page, so a value the tier drops clears its page's stored mark."""
        self._staged: npt.NDArray[np.bool_] = np.zeros(n, dtype=np.bool_)
        """Pages being evicted that `stage` copied out (set by `evicting`, cleared by `free_evicted`)."""
        self.stage: Stage | None = None
        """Copies pages the tier lacks out of the pool at eviction (the rpc layer's); None: they are lost."""
        self.staged_pages = 0
        """Pages copied out at eviction, in all."""
        self._roots: dict[str, bytes] = {}
        self.stored_pages = 0
        self.offloading_pages = 0
        self.pinned_pages = 0
        """Radix pages held by offload pins (paths overlapping between offloads count once per offload)."""
        self.evicted_unstored_pages = 0
        """Radix pages evicted that the tier never got: neither stored nor staged, or staged and then `lost`."""
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

    # ------------------------------------------------------------------ keys

    def root(self, salt: str) -> bytes:
        r = self._roots.get(salt)
        if r is None:
            r = self._roots[salt] = self.namespace.root(salt)
        return r

    def _set_keys(self, pages: bytes | npt.NDArray[np.int32], keys: Sequence[bytes]) -> None:
        arr = np.frombuffer(pages, dtype=np.int32) if isinstance(pages, bytes) else pages
        if len(keys):
            self._keys[arr] = np.frombuffer(b"".join(keys), dtype=np.uint8).reshape(-1, KEY_BYTES)
        self._keyed[arr] = True

    def key_of(self, page: int) -> bytes:
        if not self._keyed[page]:
            raise InvariantError(f"tier: page {page} has no key")
        return bytes(self._keys[page])

    def _key_path(self, node: RadixNode) -> list[RadixNode]:
        """Key every page on the path to `node`; returns the path's nodes, root side first."""
        path: list[RadixNode] = []
        n: RadixNode | None = node
        while n is not None and n.parent is not None:
            path.append(n)
            n = n.parent
        path.reverse()
        first = 0  # the leading nodes whose pages have keys (a node's pages are keyed all or none, or a prefix)
        while first < len(path) and self._keyed[_last(path[first])]:
            first += 1
        parent = self.key_of(_last(path[first - 1])) if first else self.root(path[0].salt or "")
        for n in path[first:]:
            keys = chain(parent, n.key, self._ps)
            self._set_keys(n.pages, keys)
            parent = keys[-1]
        return path

    # ------------------------------------------------------------------ the radix's free callback

    def evicting(self, node: RadixNode, keep: int) -> None:
        """The radix's eviction hook: `node`'s pages past its first `keep` are about to be freed. Those the tier
        neither holds nor is reading are keyed and handed to `stage`, root side first, while their bytes are
        still the evicted KV."""
        stage = self.stage
        if stage is None:
            return
        arr = np.frombuffer(node.pages, dtype=np.int32)[keep:]
        lacking = arr[~self._stored[arr]]
        if not lacking.size:
            return
        self._key_path(node)
        keys = [bytes(k) for k in self._keys[lacking]]
        taken = stage(keys, lacking)
        if taken:
            self._staged[lacking[:taken]] = True
            self.staged_pages += taken
            self._announce(node, lacking[:taken].tolist())

    def free_evicted(self, pages: bytes, src: int) -> None:
        """Eviction frees radix pages: their keys, stored and staged bits go with them; a page that was neither
        stored nor staged is lost."""
        arr = np.frombuffer(pages, dtype=np.int32)
        stored = int(np.count_nonzero(self._stored[arr]))
        if stored:
            for k in self._keys[arr[self._stored[arr]]]:
                self._stored_at.pop(bytes(k), None)
        staged = int(np.count_nonzero(self._staged[arr] & ~self._stored[arr]))
        self.stored_pages -= stored
        self.evicted_unstored_pages += arr.size - stored - staged
        self._stored[arr] = False
        self._staged[arr] = False
        self._keyed[arr] = False
        self._alloc.give(pages, src)

    def lost(self, keys: list[bytes]) -> None:
        """Pages staged at eviction (by key) that the tier did not write after all (it failed, or the service
        stopped first): lost, counted with the pages evicted unstored, and no longer announced as the tier's."""
        self.evicted_unstored_pages += len(keys)
        self.dropped(keys)

    def dropped(self, keys: list[bytes]) -> None:
        """The tier no longer holds these keys' values (its own eviction, unsound values discarded): radix pages
        of those keys are unstored again (evicting them stages them), and the drop is announced."""
        for k in keys:
            page = self._stored_at.pop(k, None)
            if page is not None:
                self._stored[page] = False
                self.stored_pages -= 1
        changes = self._tree().changes
        if changes is not None and keys:
            changes.append((TIER_REMOVED, list(keys)))

    def _announce(self, node: RadixNode, pages: list[int]) -> None:
        """Record that the tier holds `pages` (on the keyed path to `node`), while events are recorded: one
        TIER_STORED change per run of consecutive path pages."""
        changes = self._tree().changes
        if changes is None or not pages:
            return
        path: list[RadixNode] = []
        n: RadixNode | None = node
        while n is not None and n.parent is not None:
            path.append(n)
            n = n.parent
        path.reverse()
        ids = np.frombuffer(b"".join(p.pages for p in path), dtype=np.int32)
        key = b"".join(p.key for p in path)
        want = np.isin(ids, np.asarray(pages, dtype=np.int32))
        pb = self._pb
        i, total = 0, ids.size
        salt = node.salt or ""
        while i < total:
            if not want[i]:
                i += 1
                continue
            j = i
            while j < total and want[j]:
                j += 1
            run = ids[i:j]
            changes.append((TIER_STORED, salt, int(ids[i - 1]) if i else None, key[i * pb:j * pb], run.tobytes(),
                            [bytes(k) for k in self._keys[run]]))
            i = j

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
                if match.node is not None:
                    radix.unlock(match.node)
                return None
        load = Load(plan.salt, plan.key, base, match.node, plan.keys[base - plan.matched: want - plan.matched],
                    pages)
        self.loads.add(load)
        return load

    def finish(self, load: Load, loaded: int, tainted: Iterable[int] = ()) -> None:
        """The store is done with `load`: its first `loaded` pages hold their keys' values, verified. They
        join the radix; the rest are freed, `tainted` ones (a transfer that may still write) quarantined."""
        if load.done:
            raise InvariantError("tier: a load finished twice")
        radix = self._tree()
        loaded = max(0, min(loaded, len(load.keys)))
        pages = load.pages
        node = None
        if loaded:
            key = load.key[load.base * self._pb: (load.base + loaded) * self._pb]
            ins = radix.insert(load.salt, key, pages[: loaded * 4], below=load.node, src=LOADING)
            existing = ins.num_existing_pages
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
            match = radix.match(leaf.salt or "", key, lock=True, touch=False)
            if match.num_pages != end or match.node is None:
                raise InvariantError(f"tier: the path of leaf {leaf.id} no longer matches its own tokens")
            self._offloading[pages] = True
            self.offloading_pages += len(pages)
            self.pinned_pages += end
            pin_room -= end
            room -= len(pages)
            job = Offload(match.node, [bytes(self._keys[p]) for p in pages], pages, end)
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
            self._announce(job.node, ok)
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
        """Stored and offloading pages are radix pages; the counts agree with the bits."""
        owned = np.zeros(self._keyed.size, dtype=np.bool_)
        owned[np.frombuffer(radix_pages, dtype=np.int32)] = True
        if (self._stored & ~owned).any() or (self._keyed & ~owned).any():
            raise InvariantError("tier: a page that is not in the radix is marked keyed or stored")
        if int(np.count_nonzero(self._stored)) != self.stored_pages:
            raise InvariantError("tier: stored page count != stored bits")
        if len(self._stored_at) != self.stored_pages or any(
                not self._stored[p] or bytes(self._keys[p]) != k for k, p in self._stored_at.items()):
            raise InvariantError("tier: the key -> page map of stored pages != the stored bits and keys")
        if int(np.count_nonzero(self._offloading)) != self.offloading_pages:
            raise InvariantError("tier: offloading page count != offloading bits")
        if sum(j.pinned for j in self.offloads) != self.pinned_pages:
            raise InvariantError("tier: pinned page count != pins of the offloads in progress")
        if sum(len(j.pages) for j in self.offloads) != self.offloading_pages:
            raise InvariantError("tier: offloading page count != pages of the offloads in progress")
        if (self._offloading & ~owned).any():
            raise InvariantError("tier: a page being offloaded left the radix")
        if self._staged.any():
            raise InvariantError("tier: a staged bit outlived the eviction that set it")
        if self._ledger.counts[LOADING] != len(self.loading()) >> 2:
            raise InvariantError("tier: LOADING count != pages of the loads in progress")

    def _tree(self) -> RadixTree:
        assert self.radix is not None, "TierIndex.radix is set by the facade"
        return self.radix


def _last(node: RadixNode) -> int:
    return int.from_bytes(node.pages[-4:], "little", signed=True)

