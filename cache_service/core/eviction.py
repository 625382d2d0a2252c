"""Eviction order of the radix tree's unlocked leaves: small strategy objects and a lazy heap.

A policy maps a leaf to a sort key (smallest first). Every key starts with the leaf's eviction class
(docs/design.md §15): a closed session's leftovers (`CLOSED_CHILD`) go before ordinary entries (`ORDINARY`),
which go before the radix prefix of a parent whose children are live (`PARENT`); the policy orders leaves
within a class. `LeafHeap` holds the evictable leaves in a heap with
lazy invalidation: a leaf whose key changed is pushed again with a new version, stale entries are
skipped when popped, and the heap is compacted when stale entries outnumber live ones, so an eviction
costs O(log n) per leaf touched and never rebuilds the heap per call.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Iterator
from typing import Generic, Protocol, TypeVar

_HEAP_SLACK = 1024

CLOSED_CHILD, ORDINARY, PARENT = 0, 1, 2
"""Radix eviction classes, first evicted first (a leaf's `klass`)."""
EVICTION_CLASSES = ("closed_child", "ordinary", "parent")
"""The classes' names, by number (stats and metrics)."""


class Leaf(Protocol):
    """What eviction reads of a radix node (it never walks the tree, and imports none of it)."""

    id: int
    tick: int
    hits: int
    heap_ver: int
    klass: int


RadixNode = TypeVar("RadixNode", bound=Leaf)


class EvictionPolicy(Protocol):
    """Orders unlocked leaves for eviction: the smallest key goes first."""

    def key(self, node: Leaf) -> tuple[int, ...]: ...


class LRUPolicy:
    """Least recently used first within a class (ticks are a logical clock, so order is deterministic)."""

    def key(self, node: Leaf) -> tuple[int, ...]:
        return (node.klass, node.tick)


class LFUPolicy:
    """Fewest hits first within a class, then least recently used."""

    def key(self, node: Leaf) -> tuple[int, ...]:
        return (node.klass, node.hits, node.tick)


EVICTION_POLICIES: dict[str, Callable[[], EvictionPolicy]] = {"lru": LRUPolicy, "lfu": LFUPolicy}


class LeafHeap(Generic[RadixNode]):
    """The set of evictable leaves, ordered by a policy."""

    __slots__ = ("_heap", "_leaves", "_policy")

    def __init__(self, policy: str) -> None:
        if policy not in EVICTION_POLICIES:
            raise ValueError(f"unknown eviction policy {policy!r}; known: {sorted(EVICTION_POLICIES)}")
        self._policy = EVICTION_POLICIES[policy]()
        self._heap: list[tuple[tuple[int, ...], int, int, RadixNode]] = []
        self._leaves: set[RadixNode] = set()

    def __contains__(self, node: RadixNode) -> bool:
        return node in self._leaves

    def add(self, node: RadixNode) -> None:
        leaves = self._leaves
        if node not in leaves:
            leaves.add(node)
            self.push(node)

    def discard(self, node: RadixNode) -> None:
        self._leaves.discard(node)

    def push(self, node: RadixNode) -> None:
        """(Re)queue `node` under its current key; earlier entries for it become stale."""
        ver = node.heap_ver = node.heap_ver + 1
        heap = self._heap
        heapq.heappush(heap, (self._policy.key(node), node.id, ver, node))
        if len(heap) > 2 * len(self._leaves) + _HEAP_SLACK:
            self._heap = [(self._policy.key(n), n.id, n.heap_ver, n) for n in self._leaves]
            heapq.heapify(self._heap)

    def pop_order(self) -> Iterator[RadixNode]:
        """Evictable leaves, first to evict first. The consumer may change the tree between items (a
        leaf it trims is pushed back; a parent that becomes a leaf is added)."""
        while self._heap:  # not a local: a push may compact the heap into a new list
            _, _, ver, node = heapq.heappop(self._heap)
            if ver == node.heap_ver and node in self._leaves:
                yield node

    def first(self, n: int) -> list[RadixNode]:
        """Up to `n` evictable leaves, first to evict first, left in place (O(entries · log n)): what a tier
        offloads ahead of eviction."""
        live = (e for e in self._heap if e[2] == e[3].heap_ver and e[3] in self._leaves)
        return [e[3] for e in heapq.nsmallest(n, live)]

    @property
    def entries(self) -> int:
        """Heap entries, stale ones included (bounded by 2 x leaves + a constant)."""
        return len(self._heap)

    def leaves(self) -> set[RadixNode]:
        return set(self._leaves)

    def live_entries(self) -> set[RadixNode]:
        """Leaves with a current (non-stale) heap entry: for invariant checks."""
        return {n for _, _, ver, n in self._heap if ver == n.heap_ver}
