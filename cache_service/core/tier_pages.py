"""What the tier holds of the radix, page by page (docs/design.md §8): tier keys, stored and staged marks, the
radix's eviction hooks and the events that announce what the tier holds. `tiering.TierIndex` adds the loads
and offloads in progress on top.

Keys. A radix page's tier key is the SHA-256 chain of `tier_keys` over its path's tokens, rooted in the
namespace and the salt. Keys are computed per node when first needed and kept per page id (`_keys`,
`_keyed`) while the page stays in the radix; a page's key bit is cleared when eviction frees it.

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
from typing import Any, Protocol

import numpy as np
import numpy.typing as npt

from cache_service.core.config import CoreConfig
from cache_service.core.errors import InvariantError
from cache_service.core.events import TIER_REMOVED, TIER_STORED
from cache_service.core.pages import PageAllocator
from cache_service.core.radix import RadixTree
from cache_service.core.radix_node import RadixNode
from cache_service.core.tier_keys import KEY_BYTES, Namespace, chain


class WindowRowsOfTier(Protocol):
    """What the tier uses of a window pool's rows (`window.WindowRows`, docs/design.md §13): a layer below it."""

    win: Any
    """Page -> its window page (0: none)."""

    def attach_free(self, pages: bytes) -> None: ...

    def drop_loaded(self, pages: Iterable[int]) -> None: ...

    def loaded(self, changes: list[Any] | None, first: int) -> None: ...

    def adopt(self, salt: str, parent: int | None, key: bytes, tree: bytes, ours: bytes, bare: bool = True) -> None: ...

Stage = Callable[[list[bytes], npt.NDArray[np.int32]], int]
"""`stage(keys, pages) -> n`: copy the first n pages' bytes out of the pool now (before they can be reused) for
the tier to write under their keys; n < len(pages) where there is no room for the rest."""


class TierPages:
    """Keys, stored and staged marks of one core's radix pages. Single-threaded like the core."""

    def __init__(self, config: CoreConfig, namespace: Namespace, pages: PageAllocator) -> None:
        if namespace.page_size != config.page_size:
            raise ValueError(f"tier namespace page size {namespace.page_size} != pool page size {config.page_size}")
        self.namespace = namespace
        self._ps = config.page_size
        self._pb = 4 * config.page_size
        self._alloc = pages
        self.radix: RadixTree | None = None
        """Set by the facade once the tree exists (the tree's free callback is `free_evicted`)."""
        self.window: WindowRowsOfTier | None = None
        """A window pool's window rows (window.py sets it): values say by group what they hold."""
        n = config.num_pages
        self._keys: npt.NDArray[np.uint8] = np.zeros((n, KEY_BYTES), dtype=np.uint8)
        self._keyed: npt.NDArray[np.bool_] = np.zeros(n, dtype=np.bool_)
        self._stored: npt.NDArray[np.bool_] = np.zeros(n, dtype=np.bool_)
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
        self.evicted_unstored_pages = 0
        """Radix pages evicted that the tier never got: neither stored nor staged, or staged and then `lost`."""

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
        path = _path(node)
        first = 0  # the leading nodes whose pages have keys (a node's pages are keyed all or none, or a prefix)
        while first < len(path) and self._keyed[_last(path[first])]:
            first += 1
        parent = self.key_of(_last(path[first - 1])) if first else self.root(path[0].salt or "")
        for n in path[first:]:
            keys = chain(parent, n.key, self._ps)
            self._set_keys(n.pages, keys)
            parent = keys[-1]
        return path

    # ------------------------------------------------------------------ the radix's eviction hooks

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

    # ------------------------------------------------------------------ what the tier reports

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

    def _announce(self, node: RadixNode, pages: list[int], windowless: frozenset[int] = frozenset()) -> None:
        """Record that the tier holds `pages` (on the keyed path to `node`), while events are recorded: one
        TIER_STORED change per run of consecutive path pages (a window pool's: per run of pages whose values hold
        their window rows, or not: those with none now or in `windowless`)."""
        changes = self._tree().changes
        if changes is None or not pages:
            return
        path = _path(node)
        ids = np.frombuffer(b"".join(p.pages for p in path), dtype=np.int32)
        key = b"".join(p.key for p in path)
        want = np.isin(ids, np.asarray(pages, dtype=np.int32))
        window = self.window
        # A window pool's values hold window rows iff the page had them when the store read it (kept since:
        # WindowRows.busy) or the value loaded had them: runs split where that changes.
        rows = (np.frombuffer(window.win, dtype=np.int32)[ids] != 0) if window is not None else np.ones_like(want)
        if windowless:
            rows &= ~np.isin(ids, np.fromiter(windowless, dtype=np.int32))
        pb = self._pb
        i, total = 0, ids.size
        salt = node.salt or ""
        while i < total:
            if not want[i]:
                i += 1
                continue
            j = i
            while j < total and want[j] and rows[j] == rows[i]:
                j += 1
            run = ids[i:j]
            changes.append((TIER_STORED, salt, int(ids[i - 1]) if i else None, key[i * pb:j * pb], run.tobytes(),
                            [bytes(k) for k in self._keys[run]], not bool(rows[i])))
            i = j

    # ------------------------------------------------------------------ accounting

    def check_pages(self, owned: npt.NDArray[np.bool_]) -> None:
        """Keyed and stored pages are radix pages (`owned`); the stored count and key map agree with the bits;
        no staged bit outlives its eviction."""
        if (self._stored & ~owned).any() or (self._keyed & ~owned).any():
            raise InvariantError("tier: a page that is not in the radix is marked keyed or stored")
        if int(np.count_nonzero(self._stored)) != self.stored_pages:
            raise InvariantError("tier: stored page count != stored bits")
        if len(self._stored_at) != self.stored_pages or any(
                not self._stored[p] or bytes(self._keys[p]) != k for k, p in self._stored_at.items()):
            raise InvariantError("tier: the key -> page map of stored pages != the stored bits and keys")
        if self._staged.any():
            raise InvariantError("tier: a staged bit outlived the eviction that set it")

    def _tree(self) -> RadixTree:
        assert self.radix is not None, "TierIndex.radix is set by the facade"
        return self.radix


def _path(node: RadixNode) -> list[RadixNode]:
    """The nodes from the root's child down to `node`, root side first."""
    path: list[RadixNode] = []
    n: RadixNode | None = node
    while n is not None and n.parent is not None:
        path.append(n)
        n = n.parent
    path.reverse()
    return path


def _last(node: RadixNode) -> int:
    return int.from_bytes(node.pages[-4:], "little", signed=True)
