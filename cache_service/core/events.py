"""The change feed: every page that enters or leaves the radix, and sessions opening, closing and being
demoted, recorded as they happen for whoever publishes them (the ZMQ publisher, WatchEvents).

Page hashes are u64, chained: a page's hash covers its parent's hash and its own token ids, and the
first page of a tree chains from a hash of its cache salt, so equal tokens under different salts never
share a hash. They depend on nothing but (salt, token ids, page size), so they are the same across
restarts and instances. A record names the pages of one radix node run: its hashes in order, the hash of
the page before the first (None at the start of a tree) and their token ids.

The feed costs nothing until something listens: `start()` turns recording on and hashes what the tree
already holds (so a consumer that arrives late gets a complete `snapshot()`); from then on every change
is recorded until `drain()` takes the records. `on_record`, when set, is called at the first record after
a drain: the publisher uses it to schedule one flush per event-loop iteration. The core never imports a
transport: records are plain tuples of Python values and numpy arrays.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, NamedTuple

import numpy as np
import numpy.typing as npt

from cache_service.core.types import PageArray, TokenArray

if TYPE_CHECKING:
    from cache_service.core.radix import RadixNode, RadixTree
    from cache_service.core.sessions import Session

HASH_PERSON = b"kvcache-page-v1"
"""Domain separation of the page hash (BLAKE2b personalisation, at most 16 bytes)."""
_SALT_PERSON = b"kvcache-salt-v1"


class Stored(NamedTuple):
    """Pages entered the radix: one node's run, parents before children."""

    cache_salt: str
    parent_hash: int | None
    """The hash of the page before `hashes[0]` in its sequence; None when it starts the tree."""
    hashes: list[int]
    token_ids: TokenArray
    """len(hashes) * page_size token ids, the pages' own."""


class Removed(NamedTuple):
    """Pages left the radix (evicted)."""

    cache_salt: str
    hashes: list[int]


class Cleared(NamedTuple):
    """Everything announced before is gone (a new instance starts empty)."""


class SessionChange(NamedTuple):
    """A session opened, closed, or was demoted (its KV became ordinary radix entries)."""

    kind: str
    """"opened", "closed" or "demoted"."""
    session_id: str
    epoch: int
    cache_salt: str
    streaming: bool
    engine_id: str
    identity: str


Record = Stored | Removed | Cleared | SessionChange

SESSION_KINDS = ("opened", "closed", "demoted")


def salt_hash(cache_salt: str) -> bytes:
    """The 8-byte chain start of a salt's tree."""
    return hashlib.blake2b(cache_salt.encode(), digest_size=8, person=_SALT_PERSON).digest()


_PAGE_HASH = hashlib.blake2b(digest_size=8, person=HASH_PERSON)
"""A configured BLAKE2b state to copy: copying costs half of constructing one with these parameters."""


def chain_hashes(start: bytes, key: bytes, page_bytes: int) -> list[int]:
    """Hashes of the pages of `key` (int32 little-endian token bytes, whole pages), chained from `start`
    (the 8-byte big-endian hash of the page before, or a salt's chain start): BLAKE2b-64 personalised
    "kvcache-page-v1" over the previous hash's 8 bytes and the page's token bytes."""
    out: list[int] = []
    prev = start
    view = memoryview(key)
    for off in range(0, len(key), page_bytes):
        h = _PAGE_HASH.copy()
        h.update(prev)
        h.update(view[off : off + page_bytes])
        prev = h.digest()
        out.append(int.from_bytes(prev, "big"))
    return out


class EventFeed:
    """Records radix and session changes while `recording` (see the module doc)."""

    __slots__ = ("_hashes", "_records", "on_record", "page_bytes", "page_size", "recording")

    def __init__(self, num_pages: int, page_size: int) -> None:
        self.page_size = page_size
        self.page_bytes = page_size * 4
        self.recording = False
        self._hashes: npt.NDArray[np.uint64] = np.zeros(num_pages, dtype=np.uint64)
        """The hash of each page the radix holds (valid while recording)."""
        self._records: list[Record] = []
        self.on_record: Callable[[], None] | None = None

    # ------------------------------------------------------------------ lifecycle

    def start(self, radix: RadixTree) -> None:
        """Record from now on; hash every page the tree holds already. Idempotent."""
        if self.recording:
            return
        for node in _nodes(radix):
            self._hashes[node.pages] = chain_hashes(self._chain_start(node)[1], node.key, self.page_bytes)
        self.recording = True

    def drain(self) -> list[Record]:
        """The records since the last drain, oldest first."""
        records, self._records = self._records, []
        return records

    @property
    def pending(self) -> int:
        return len(self._records)

    def snapshot(self, radix: RadixTree) -> list[Stored]:
        """The whole tree as Stored records, parents before children (the feed must be recording)."""
        assert self.recording, "start() the feed first"
        return [Stored(node.salt or "", self._chain_start(node)[0], self._hashes[node.pages].tolist(),
                       np.frombuffer(node.key, dtype="<i4").astype(np.int32)) for node in _nodes(radix)]

    # ------------------------------------------------------------------ recording (called by the core)

    def stored(self, node: RadixNode) -> None:
        """`node` (a new leaf) entered the tree with all its pages."""
        parent_hash, start = self._chain_start(node)
        hashes = chain_hashes(start, node.key, self.page_bytes)
        self._hashes[node.pages] = hashes
        self._add(Stored(node.salt or "", parent_hash, hashes,
                         np.frombuffer(node.key, dtype="<i4")))  # a view of immutable bytes

    def removed(self, cache_salt: str, pages: PageArray) -> None:
        """`pages` left the tree. Consecutive removals under one salt share a record (an append that
        evicts a page at a time would otherwise make one record per page)."""
        last = self._records[-1] if self._records else None
        if type(last) is Removed and last.cache_salt == cache_salt:
            last.hashes.extend(self._hashes[pages].tolist())
        else:
            self._add(Removed(cache_salt, self._hashes[pages].tolist()))

    def cleared(self) -> None:
        self._add(Cleared())

    def session(self, kind: str, s: Session) -> None:
        self._add(SessionChange(kind, s.id, s.epoch, s.cache_salt, s.streaming, s.owner, s.identity))

    def _add(self, record: Record) -> None:
        if not self._records and self.on_record is not None:
            self.on_record()
        self._records.append(record)

    # ------------------------------------------------------------------ helpers

    def _chain_start(self, node: RadixNode) -> tuple[int | None, bytes]:
        """(the published parent hash, the 8-byte chain start) of `node`'s first page; its parent's pages
        must be hashed already."""
        parent = node.parent
        assert parent is not None
        if parent.parent is None:
            return None, salt_hash(node.salt or "")
        parent_hash = int(self._hashes[parent.pages[-1]])
        return parent_hash, parent_hash.to_bytes(8, "big")


def _nodes(radix: RadixTree) -> Iterator[RadixNode]:
    """Every node with pages, parents before children."""
    for root in radix.roots():
        stack = list(root.children.values())
        while stack:
            node = stack.pop()
            yield node
            stack.extend(node.children.values())
