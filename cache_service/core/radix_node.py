"""The radix tree's value types: a node (a run of cached pages), what a match and an insert return, and the
page-granular key of a token sequence.

A node owns a run of pages (`pages`: int32 little-endian page ids, 4 bytes a page) and the tokens that produced
them (`key`, int32 little-endian, whole pages). A node is internal to the tree (radix.py); callers hold nodes
only as lock and guard handles. Splits keep the original node object as the lower half, so a handle stays
valid whatever splits happen above it.
"""

from __future__ import annotations

from typing import NamedTuple

from cache_service.core.eviction import ORDINARY
from cache_service.core.types import TokenArray

TOKEN_BYTES = 4
PAGE_ID_BYTES = 4
STORED, REMOVED = "stored", "removed"
"""Change record kinds: (STORED, salt, parent's last page id or None, key, pages) for a new leaf's run;
(REMOVED, salt, pages) for pages evicted."""


class RadixNode:
    """A run of cached pages. Internal to the tree; callers hold nodes only as lock handles."""

    __slots__ = (
        "children",
        "forward",
        "guard",
        "heap_ver",
        "hits",
        "id",
        "key",
        "klass",
        "lock_ref",
        "pages",
        "parent",
        "salt",
        "tick",
    )

    def __init__(self, node_id: int, key: bytes, pages: bytes, parent: RadixNode | None) -> None:
        self.id = node_id
        self.key = key
        self.pages = pages
        self.parent = parent
        self.children: dict[bytes, RadixNode] = {}
        self.lock_ref = 0
        self.tick = 0
        self.hits = 0
        self.heap_ver = 0
        self.salt: str | None = None  # every node's tree's cache salt
        self.klass = ORDINARY
        """Eviction class (eviction.CLOSED_CHILD / ORDINARY / PARENT): leads the eviction key."""
        self.guard = 0
        """Guards on this node (parent sessions whose children are live); klass is PARENT while > 0."""
        self.forward: RadixNode | None = None
        """Once evicted with guards: the node they moved to (`unguard` follows it)."""

    @property
    def num_pages(self) -> int:
        return len(self.pages) >> 2

    def page_ids(self) -> list[int]:
        return memoryview(self.pages).cast("i").tolist()

    def __repr__(self) -> str:
        return f"RadixNode(id={self.id}, pages={self.page_ids()}, lock_ref={self.lock_ref})"


class RadixMatch(NamedTuple):
    num_pages: int
    pages: bytes
    """int32 LE page ids."""
    node: RadixNode | None
    """The locked node covering exactly the matched pages (only when matched with lock=True and
    num_pages > 0)."""


class RadixInsert(NamedTuple):
    num_existing_pages: int
    """Leading pages that were already cached: the caller's copies of them are duplicates."""
    pages: bytes
    """The tree's pages for the whole key after the insert (existing ones first), int32 LE."""
    node: RadixNode | None
    """The node ending exactly at the end of the key (None for an empty key)."""


def token_key(tokens: TokenArray | bytes | bytearray, page_size: int, max_tokens: int | None = None) -> bytes:
    """The radix key of `tokens[:max_tokens]` (an int32 array, or int32 LE bytes), cut to whole pages."""
    if isinstance(tokens, bytes | bytearray):
        size = len(tokens) >> 2
        n = size if max_tokens is None else min(size, max_tokens)
        n -= n % page_size
        return bytes(tokens[: n * 4]) if n * 4 != len(tokens) or type(tokens) is not bytes else tokens
    n = tokens.size if max_tokens is None else min(tokens.size, max_tokens)
    n -= n % page_size
    return tokens[:n].astype("<i4", copy=False).tobytes()


def last_page(node: RadixNode | None) -> int | None:
    """The last page id of `node`'s run (None for a salt root: a run under it starts its tree)."""
    if node is None or node.parent is None:
        return None
    return int.from_bytes(node.pages[-PAGE_ID_BYTES:], "little", signed=True)


def tree_nodes(roots: list[RadixNode]) -> list[RadixNode]:
    """Every node under `roots`, the roots included, each parent before its children."""
    out: list[RadixNode] = []
    stack = list(roots)
    while stack:
        n = stack.pop()
        out.append(n)
        stack.extend(n.children.values())
    return out
