"""The radix tree's from-scratch check (`RadixTree.check`): every node's shape, lock and class, and the tree's
running counters and leaf heap recounted from the nodes. O(tree size); for tests and GetStats(verify)."""

from __future__ import annotations

from typing import Any

from cache_service.core.errors import InvariantError
from cache_service.core.eviction import PARENT, LeafHeap


def check_tree(tree: Any, heap: LeafHeap[Any]) -> bytes:
    """Recount `tree` (a `radix.RadixTree`, whose evictable leaves are in `heap`) from its nodes; return every page it
    owns (int32 LE). Typed loosely: this module sits below the tree in the core's layers."""
    evictable = locked = 0
    owned: list[bytes] = []
    leaves: set[Any] = set()
    pb = tree.page_bytes
    for n in tree.iter_nodes():
        if n.parent is None:
            if n.lock_ref != 1 or n.pages or not n.children:
                raise InvariantError(f"salt root {n.salt!r} must be locked, pageless and non-empty")
            continue
        if n.lock_ref < 0:
            raise InvariantError(f"node {n.id} has a negative lock_ref {n.lock_ref}")
        if n.guard < 0 or (n.guard > 0) != (n.klass == PARENT):
            raise InvariantError(f"node {n.id}: eviction class {n.klass} does not match its {n.guard} guards")
        if n.num_pages == 0 or len(n.key) != n.num_pages * pb:
            raise InvariantError(f"node {n.id}: key bytes and page count disagree")
        if n.parent.children.get(n.key[:pb]) is not n:
            raise InvariantError(f"node {n.id} is not reachable under its first page key")
        if n.parent.parent is not None and n.lock_ref > n.parent.lock_ref:
            raise InvariantError(f"node {n.id} is locked more often than its parent")
        if n.lock_ref:
            locked += n.num_pages
        else:
            evictable += n.num_pages
        if n.lock_ref == 0 and not n.children:
            leaves.add(n)
        owned.append(n.pages)
    if (evictable, locked) != (tree.evictable_pages, tree.locked_pages):
        raise InvariantError(
            f"radix page counters (evictable={tree.evictable_pages}, locked={tree.locked_pages}) "
            f"!= recount ({evictable}, {locked})"
        )
    if sum(tree.evicted_by_class) != tree.evicted_pages_total:
        raise InvariantError(f"pages evicted by class {tree.evicted_by_class} do not sum to "
                             f"{tree.evicted_pages_total}")
    if leaves != heap.leaves():
        raise InvariantError("evictable leaf set differs from the unlocked leaves of the tree")
    if not leaves <= heap.live_entries():
        raise InvariantError("an evictable leaf has no live heap entry")
    return b"".join(owned)
