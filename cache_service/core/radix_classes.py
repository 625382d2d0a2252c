"""The radix tree's eviction classes (docs/design.md §15): which class each node's leaf goes in.

Every node has a `klass` that leads its eviction key (`eviction.CLOSED_CHILD` < `ORDINARY` < `PARENT`).
`guard(node)` puts a node in PARENT (a parent session whose children are live is certain to return to the path
ending there); the guard stays on the node however it is split (the lower half keeps its identity), and when the
guarded leaf is evicted it moves up to its parent, the path's new end (`forward`; `unguard` follows it there).
`mark_leftover(node)` puts an unguarded node in CLOSED_CHILD (what a closed subagent left behind); a match that
touches it makes it ORDINARY again (the tree's walk does that).

The classes change only nodes' `klass`, `guard` and `forward` and re-key leaves in the tree's heap; the tree's
shape, locks and pages are the tree's alone.
"""

from __future__ import annotations

from cache_service.core.errors import InvariantError
from cache_service.core.eviction import CLOSED_CHILD, ORDINARY, PARENT, LeafHeap
from cache_service.core.radix_node import RadixNode


class EvictionClasses:
    """The eviction classes of one tree's nodes, re-keying its evictable leaves in `leaves` as they change."""

    __slots__ = ("_leaves",)

    def __init__(self, leaves: LeafHeap[RadixNode]) -> None:
        self._leaves = leaves

    def guard(self, node: RadixNode) -> None:
        """Defer `node`'s eviction to the last class (PARENT) until a matching `unguard`."""
        node.guard += 1
        self._reclass(node)

    def unguard(self, node: RadixNode) -> None:
        """Release one `guard(node)`, wherever eviction has moved it since (nothing when it went with its
        path's last node)."""
        n = self.guarded_at(node)
        if n is None:
            return
        if n.guard <= 0:
            raise InvariantError(f"radix guard balance: unguard of node {n.id} whose guard is {n.guard}")
        n.guard -= 1
        self._reclass(n)

    @staticmethod
    def guarded_at(node: RadixNode) -> RadixNode | None:
        """Where a `guard(node)` is now: `node`, or the node eviction moved it to (None: gone with its path)."""
        n: RadixNode | None = node
        while n is not None and n.parent is None:
            n = n.forward
        return n

    def mark_leftover(self, node: RadixNode) -> None:
        """What a closed session left on the path ending at `node` goes first (CLOSED_CHILD): `node` and the
        ancestors that lead only to it, up to the first one that is guarded, pinned or shared with another
        path (those are not leftovers nobody wants)."""
        n: RadixNode | None = node
        while n is not None and n.parent is not None and n.guard == 0 and n.lock_ref == 0:
            if n.klass != CLOSED_CHILD:
                n.klass = CLOSED_CHILD
                if n in self._leaves:
                    self._leaves.push(n)
            if len(n.parent.children) != 1:
                break
            n = n.parent

    @staticmethod
    def forward(node: RadixNode, parent: RadixNode) -> None:
        """`node`, a leaf just cut from `parent`, hands its guards on to `parent`, its path's new end (a salt
        root takes none: the path is gone)."""
        if parent.parent is not None:
            node.forward = parent
            parent.guard += node.guard
            parent.klass = PARENT
        node.guard = 0

    def _reclass(self, node: RadixNode) -> None:
        klass = PARENT if node.guard > 0 else ORDINARY
        if node.klass != klass:
            node.klass = klass
            if node in self._leaves:
                self._leaves.push(node)
