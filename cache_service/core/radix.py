"""Radix prefix cache at page granularity, namespaced by cache salt.

Keys are token ids as little-endian int32 bytes, cut to whole pages: only full pages are cached. Each node
(radix_node.py) owns a run of pages and the tokens that produced them. Comparisons are bytes slices compared by
memcmp; a walk copies each node's span of the query once, never the remaining key per node.

Locks count per node along the path to the root, as in SGLang: `lock(node)` pins every ancestor. An
unbalanced unlock raises InvariantError before changing anything. Splits keep the original node object
as the lower half, so a lock handle (a node) stays valid whatever splits happen above it.

Eviction frees unlocked leaves in class then policy order (LRU by default; see `eviction.py`; the classes are
`classes`, radix_classes.py): O(log n) per leaf touched, no rebuild per call. `evict(n)` frees exactly n pages
when it can, trimming a leaf from its tail (the remaining pages are still a valid prefix).

The tree knows nothing of sessions, nor of who listens to its changes: it moves its pages' counts in the
page ledger (pages it takes from their owner's state, EVICTABLE <-> RADIX_LOCKED as pins come and go,
EVICTABLE -> FREE through the allocator's `give` when it evicts), and while `changes` is a list it
appends a plain record of every page run that enters (`STORED`) or leaves (`REMOVED`) the tree, which
the facade drains and hashes (events.py).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from cache_service.core.errors import InvariantError
from cache_service.core.eviction import CLOSED_CHILD, EVICTION_POLICIES, ORDINARY, PARENT, LeafHeap
from cache_service.core.ledger import EVICTABLE, RADIX_LOCKED, PageLedger
from cache_service.core.radix_check import check_tree
from cache_service.core.radix_classes import EvictionClasses
from cache_service.core.radix_node import (
    PAGE_ID_BYTES,
    REMOVED,
    STORED,
    TOKEN_BYTES,
    RadixInsert,
    RadixMatch,
    RadixNode,
    last_page,
    token_key,
    tree_nodes,
)

__all__ = ["EVICTION_POLICIES", "REMOVED", "STORED", "RadixInsert", "RadixMatch", "RadixNode", "RadixTree",
           "token_key"]

_new = tuple.__new__
"""Builds a RadixMatch or RadixInsert from its fields: what the NamedTuple's constructor does, without its Python
frame (two are made per turn)."""


class RadixTree:
    """Page-granular radix tree. It owns the pages it holds; eviction hands them to `free_pages`."""

    def __init__(self, page_size: int, ledger: PageLedger, free_pages: Callable[[bytes, int], None],
                 policy: str = "lru") -> None:
        self._leaves: LeafHeap[RadixNode] = LeafHeap(policy)
        self.classes = EvictionClasses(self._leaves)
        """The nodes' eviction classes (guards of parent sessions, closed sessions' leftovers)."""
        self.page_size = page_size
        self.page_bytes = page_size * TOKEN_BYTES
        self._ledger = ledger
        self._counts = ledger.counts
        self._free_pages = free_pages
        """The allocator's `give(pages, src_state)`."""
        self.evict_hook: Callable[[RadixNode, int], None] | None = None
        """Called as `hook(node, keep)` just before eviction frees `node`'s pages past its first `keep` (its
        tokens and path still intact): a tier copies the pages it lacks out while their bytes are still the
        evicted KV, before this call's allocation can hand the pages to a writer."""
        self._roots: dict[str, RadixNode] = {}
        self._next_id = 1
        self._tick = 0
        self.evicted_pages_total = 0
        self.evicted_by_class = [0, 0, 0]
        """Pages evicted, by eviction class (they sum to `evicted_pages_total`)."""
        self.changes: list[Any] | None = None
        """Where change records go while someone listens (the facade's queue); None: nobody does."""
        self.usable: Callable[[bytes, bool], int] | None = None
        """A window pool's `WindowRows.usable(pages, pin)`: how many leading pages of a match a reader may use
        (window.py); None: every matched page."""

    # ------------------------------------------------------------------ queries

    @property
    def evictable_pages(self) -> int:
        return self._counts[EVICTABLE]

    @property
    def locked_pages(self) -> int:
        return self._counts[RADIX_LOCKED]

    @property
    def cached_pages(self) -> int:
        return self._counts[EVICTABLE] + self._counts[RADIX_LOCKED]

    @property
    def heap_entries(self) -> int:
        """Entries in the eviction heap, stale ones included."""
        return self._leaves.entries

    @property
    def num_salts(self) -> int:
        return len(self._roots)

    def roots(self) -> list[RadixNode]:
        """The salt roots (pageless; their children start each salt's sequences)."""
        return list(self._roots.values())

    def first_to_evict(self, n: int) -> list[RadixNode]:
        """Up to `n` unlocked leaves in eviction order, without evicting them."""
        return self._leaves.first(n)

    def runs(self) -> Iterator[tuple[str, int | None, bytes, bytes]]:
        """Every node's run as (salt, parent's last page id or None, key, pages), parents before children."""
        for root in self._roots.values():
            stack = list(root.children.values())
            while stack:
                node = stack.pop()
                yield node.salt or "", last_page(node.parent), node.key, node.pages
                stack.extend(node.children.values())

    def match(self, salt: str, key: bytes | bytearray, *, lock: bool = False, touch: bool = True, end: int = -1
              ) -> RadixMatch:
        """Longest cached prefix of `key` (whole pages) under `salt`; `end` >= 0 matches `key[:end]` without
        copying it (a session's token buffer).

        With lock=True the match is pinned and returned as `node` (splitting a node when the match ends
        inside it); the caller must `unlock(node)` exactly once. touch=False leaves LRU order alone (a
        read-only probe).
        """
        root = self._roots.get(salt)
        if root is None or not (len(key) if end < 0 else end):
            return _new(RadixMatch, (0, b"", None))
        node, matched, into = self._walk(root, key, touch=touch, end=end)
        if matched == 0:
            return _new(RadixMatch, (0, b"", None))
        pages = self._matched_pages(node, into, matched)
        if self.usable is not None:
            cut = self.usable(pages, lock)
            if cut < matched:  # the window before the match's end is gone: it ends where the window is whole
                if cut == 0:
                    return _new(RadixMatch, (0, b"", None))
                node, matched, into = self._walk(root, key, touch=False, end=cut * self.page_bytes)
                pages = pages[: cut * PAGE_ID_BYTES]
        if not lock:
            return _new(RadixMatch, (matched, pages, None))
        if into < node.num_pages:
            node = self._split(node, into)
        self.lock(node)
        return _new(RadixMatch, (matched, pages, node))

    def matched_pages(self, salt: str, key: bytes | bytearray, end: int = -1) -> int:
        """How many leading whole pages of `key` (`key[:end]` for `end` >= 0) are cached under `salt`:
        `match(salt, key, touch=False, end=end)`'s `num_pages` without gathering the pages (a read-only probe)."""
        root = self._roots.get(salt)
        if root is None or not (len(key) if end < 0 else end):
            return 0
        node, matched, into = self._walk(root, key, touch=False, end=end)
        if self.usable is None or not matched:
            return matched
        return self.usable(self._matched_pages(node, into, matched), False)

    def find(self, salt: str, key: bytes | bytearray, end: int = -1) -> RadixNode | None:
        """The deepest node a read-only walk of `key` (`key[:end]` for `end` >= 0) reaches under `salt` (the
        match may end inside it), or None when nothing matches. No LRU touch."""
        root = self._roots.get(salt)
        if root is None or not (len(key) if end < 0 else end):
            return None
        node, matched, _ = self._walk(root, key, touch=False, end=end)
        return node if matched else None

    def insert(self, salt: str, key: bytes, pages: bytes, *, below: RadixNode | None = None,
               src: int = EVICTABLE) -> RadixInsert:
        """Cache `pages` (int32 LE page ids) under `key` (len(key) == num pages * page_bytes).

        Pages the tree already holds for a leading part of the key are left alone: the result says how
        many, and the caller frees its own copies of them. The new tail pages become tree-owned (the tree
        takes them over from their owner, whose ledger state is `src`). The returned node ends exactly at
        the key's end.

        `below`, a node the caller holds locked, says where `key` starts: the sequence is the path to
        `below` followed by `key` (the path is touched as a walk from the root would touch it, but not
        compared again). Without it the key starts at the salt's root.
        """
        num_pages = len(key) // self.page_bytes
        if len(key) != num_pages * self.page_bytes or len(pages) != num_pages * PAGE_ID_BYTES:
            raise InvariantError(
                f"radix insert needs whole pages: key has {len(key)} bytes, {len(pages) >> 2} pages given"
            )
        if num_pages == 0:
            return _new(RadixInsert, (0, b"", below))
        if below is None:
            root = self._roots.get(salt)
            if root is None:
                root = RadixNode(0, b"", b"", None)
                root.salt = salt
                root.lock_ref = 1  # roots are never evicted
                self._roots[salt] = root
            node, matched, into = self._walk(root, key, touch=True)
        else:
            node, matched, into = self._walk(below, key, touch=True)
            n: RadixNode | None = below
            while n is not None and n.parent is not None:
                n.tick = self._tick
                n.hits += 1
                if n.klass == CLOSED_CHILD:
                    n.klass = ORDINARY
                n = n.parent
        if matched:
            existing = self._matched_pages(node, into, matched, below)
            if into < node.num_pages:
                node = self._split(node, into)
        else:
            existing = b""
        if matched == num_pages:
            return _new(RadixInsert, (matched, existing, node))
        new_key = key[matched * self.page_bytes :]
        new_pages = bytes(pages[matched * PAGE_ID_BYTES :])
        leaf = RadixNode(self._new_id(), new_key, new_pages, node)
        leaf.tick = self._tick
        leaf.salt = node.salt
        node.children[new_key[: self.page_bytes]] = leaf
        self._ledger.move(num_pages - matched, src, EVICTABLE)
        # What `_update_leaf` decides for both, known here: `node` has a child now, so it is no evictable
        # leaf; the new leaf is one (unlocked, childless, below a node).
        self._leaves.discard(node)
        self._leaves.add(leaf)
        if self.changes is not None:
            self.changes.append((STORED, leaf.salt or "", last_page(node), new_key, new_pages))
        return _new(RadixInsert, (matched, existing + new_pages if matched else new_pages, leaf))

    # ------------------------------------------------------------------ locks

    def lock(self, node: RadixNode) -> None:
        """Pin `node` and its ancestors: their pages move from evictable to locked."""
        n: RadixNode | None = node
        counts = self._counts
        while n is not None and n.parent is not None:
            if n.lock_ref == 0:
                k = len(n.pages) >> 2
                counts[EVICTABLE] -= k
                counts[RADIX_LOCKED] += k
                self._leaves.discard(n)
            n.lock_ref += 1
            n = n.parent

    def unlock(self, node: RadixNode) -> None:
        """Release one `lock(node)`. An unlock without a matching lock raises before changing anything."""
        n: RadixNode | None = node
        while n is not None and n.parent is not None:
            if n.lock_ref <= 0:
                raise InvariantError(
                    f"radix lock balance: unlock of node {n.id} whose lock_ref is {n.lock_ref}"
                )
            n = n.parent
        n = node
        counts = self._counts
        while n is not None and n.parent is not None:
            n.lock_ref -= 1
            if n.lock_ref == 0:
                k = len(n.pages) >> 2
                counts[RADIX_LOCKED] -= k
                counts[EVICTABLE] += k
                self._update_leaf(n)
            n = n.parent

    # ------------------------------------------------------------------ eviction

    def evict(self, num_pages: int, max_class: int = PARENT) -> int:
        """Free up to `num_pages` unlocked pages, leaves first in class then policy order, only from classes
        up to `max_class`. Returns pages freed."""
        freed = 0
        if num_pages <= 0:
            return 0
        changes = self.changes
        hook = self.evict_hook
        by_class = self.evicted_by_class
        for node in self._leaves.pop_order():
            if node.klass > max_class:
                self._leaves.push(node)  # back in place: every leaf after it is of its class or later
                break
            by_class[node.klass] += min(num_pages - freed, len(node.pages) >> 2)
            has = len(node.pages) >> 2
            take = min(num_pages - freed, has)
            if hook is not None:
                hook(node, has - take)
            if take == has:
                if changes is not None:
                    changes.append((REMOVED, node.salt or "", node.pages))
                self._free_pages(node.pages, EVICTABLE)
                self._remove_leaf(node)
            else:
                keep = has - take
                gone = node.pages[keep * PAGE_ID_BYTES :]
                if changes is not None:
                    changes.append((REMOVED, node.salt or "", gone))
                node.pages = node.pages[: keep * PAGE_ID_BYTES]
                node.key = node.key[: keep * self.page_bytes]
                self._free_pages(gone, EVICTABLE)
                self._leaves.push(node)
            freed += take
            if freed >= num_pages:
                break
        self.evicted_pages_total += freed
        return freed

    # ------------------------------------------------------------------ internals

    def _new_id(self) -> int:
        self._next_id += 1
        return self._next_id - 1

    def _walk(self, root: RadixNode, key: bytes | bytearray, *, touch: bool, end: int = -1
              ) -> tuple[RadixNode, int, int]:
        """Follow `key` (`key[:end]` for `end` >= 0) down from `root`: (deepest node reached, pages matched,
        pages matched into it).

        `into` equals the node's page count unless the match stops inside the node.
        """
        pb = self.page_bytes
        n = len(key) if end < 0 else end
        node = root
        pos = 0
        into = 0
        if touch:
            self._tick += 1
        while pos < n:
            child = node.children.get(bytes(key[pos : pos + pb]))  # bytes of bytes: the same object
            if child is None:
                break
            ckey = child.key
            clen = len(ckey)
            # Compared in place (memcmp, no copy of either side): the whole child, or the query's rest.
            if clen <= n - pos:
                span = clen
                same = key.startswith(ckey, pos)
            else:
                span = n - pos
                same = ckey.startswith(memoryview(key)[pos:n])
            common = span if same else self._common_pages(key, pos, ckey, span) * pb
            node = child
            into = common // pb
            pos += common
            if touch:
                child.tick = self._tick
                child.hits += 1
                if child.klass == CLOSED_CHILD:
                    child.klass = ORDINARY  # hit again: no longer a leftover nobody wants
            if common < clen:
                break
        if touch and node in self._leaves:
            self._leaves.push(node)  # its priority changed
        return node, pos // pb, into

    def _common_pages(self, key: bytes | bytearray, pos: int, other: bytes, span: int) -> int:
        """Leading whole pages where key[pos:pos+span] equals other[:span] (known to differ somewhere)."""
        pb = self.page_bytes
        # Page 0 matches (children are keyed by it); not all of them do, so the answer is < span // pb.
        lo, hi = 1, span // pb - 1
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if key[pos : pos + mid * pb] == other[: mid * pb]:
                lo = mid
            else:
                hi = mid - 1
        return lo

    def path_pages(self, node: RadixNode, into: int | None = None, above: RadixNode | None = None) -> bytes:
        """The pages (int32 LE) from the root (or from the end of `above`, an ancestor) down to `node`,
        taking only its first `into` pages (all by default)."""
        parts = [node.pages if into is None else node.pages[: into * PAGE_ID_BYTES]]
        n = node.parent
        while n is not None and n.parent is not None and n is not above:
            parts.append(n.pages)
            n = n.parent
        if len(parts) == 1:
            return parts[0]
        parts.reverse()
        return b"".join(parts)

    def _matched_pages(self, node: RadixNode, into: int, matched: int, above: RadixNode | None = None) -> bytes:
        pages = self.path_pages(node, into, above)
        if len(pages) != matched * PAGE_ID_BYTES:
            raise InvariantError(f"radix path holds {len(pages) >> 2} pages, walk matched {matched}")
        return pages

    def _split(self, node: RadixNode, at: int) -> RadixNode:
        """Cut `node` after `at` pages. The new upper node is returned; `node` keeps the lower half and its
        identity (lock handles on it stay valid). Lock counts and LRU state carry over to both halves."""
        parent = node.parent
        assert parent is not None, "the root is never split"
        cut = at * self.page_bytes
        upper = RadixNode(self._new_id(), node.key[:cut], node.pages[: at * PAGE_ID_BYTES], parent)
        upper.lock_ref = node.lock_ref
        upper.salt = node.salt
        upper.tick = node.tick
        upper.hits = node.hits
        parent.children[upper.key[: self.page_bytes]] = upper
        node.key = node.key[cut:]
        node.pages = node.pages[at * PAGE_ID_BYTES :]
        node.parent = upper
        upper.children[node.key[: self.page_bytes]] = node
        return upper

    def _remove_leaf(self, node: RadixNode) -> None:
        parent = node.parent
        assert parent is not None and not node.children and node.lock_ref == 0
        del parent.children[node.key[: self.page_bytes]]
        self._leaves.discard(node)
        node.parent = None
        if node.guard:
            self.classes.forward(node, parent)
        if parent.parent is None:
            if not parent.children:
                assert parent.salt is not None
                del self._roots[parent.salt]
        else:
            self._update_leaf(parent)

    def _is_evictable_leaf(self, node: RadixNode) -> bool:
        return node.parent is not None and node.lock_ref == 0 and not node.children

    def _update_leaf(self, node: RadixNode) -> None:
        if self._is_evictable_leaf(node):
            self._leaves.add(node)
        else:
            self._leaves.discard(node)

    # ------------------------------------------------------------------ verification

    def iter_nodes(self) -> list[RadixNode]:
        """Every node, the salt roots included, each parent before its children."""
        return tree_nodes(list(self._roots.values()))

    def check(self) -> bytes:
        """Recount everything from the nodes; return every page the tree owns (int32 LE). O(tree size)."""
        return check_tree(self, self._leaves)

