"""Change records and page hashing: what a router learns of the radix and of sessions.

Records: `Stored` (pages entered the radix: one node's run, parents before children), `Removed` (pages
left it), `Cleared` (everything announced before is gone) and `SessionChange` (a session opened, closed,
was demoted, parked at its engine's lease end, or adopted by an engine). `Stored` and `Removed` with
`tier=True` say the same of the tier beyond the pool (§8): pages it holds (stored, staged at eviction, or
loaded from it) and pages it dropped; publishers give them the tier's medium. They are plain tuples of
Python values and numpy arrays: the core never imports a transport.

Page hashes are u64, chained: a page's hash covers its parent's hash and its own token ids, and the
first page of a tree chains from a hash of its cache salt, so equal tokens under different salts never
share a hash. They depend on nothing but (salt, token ids, page size), so they are the same across
restarts and instances. `PageHashes` keeps the hash of every page the radix holds and turns the radix's
plain change records (radix.STORED / radix.REMOVED tuples, in the order they happened) into records.
Nothing here records anything: the radix appends to the facade's queue, and the facade resolves what it
drains (`KVCacheCore.take_events`).
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Sequence
from typing import Any, NamedTuple, Protocol

import numpy as np
import numpy.typing as npt

from cache_service.core.types import TokenArray

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
    tier: bool = False
    """The pages entered the tier beyond the pool (not the radix)."""
    window: bool = False
    """Only the pages' window-layer rows came back (window.py): radix pages announced before, whose window rows
    alone had left (a `Removed` with `window` set), hold them again."""
    no_window: bool = False
    """A window pool's pages without their window-layer rows (loaded from tier values without them, or such
    values): announced to the full-attention groups only (docs/design.md §13)."""


class Removed(NamedTuple):
    """Pages left the radix (evicted)."""

    cache_salt: str
    hashes: list[int]
    tier: bool = False
    """The pages left the tier beyond the pool (not the radix)."""
    window: bool = False
    """Only the pages' window-layer rows left the pool (window.py); their full-attention rows stay."""


WINDOW_REMOVED = "window_removed"
"""Change tuple `(WINDOW_REMOVED, salt, page ids bytes)`: radix pages whose window rows were dropped (window.py)."""
WINDOW_STORED = "window_stored"
"""Change tuple `(WINDOW_STORED, salt, parent page id | None, token bytes, page ids bytes)`: a run of radix pages
(hashed already) whose window rows came back (window.py)."""
STORED_FULL = "stored_full"
"""Change tuple `(STORED_FULL, salt, parent page id | None, token bytes, page ids bytes)`: a radix STORED run of
pages without their window rows (loaded from tier values without them, window.py)."""
TIER_STORED = "tier_stored"
"""Change tuple `(TIER_STORED, salt, parent page id | None, token bytes, page ids bytes, tier keys, no_window)`:
radix pages (still in the radix at this point of the change order) that the tier now holds; `no_window`: their
values hold no window rows (a window pool's)."""
TIER_REMOVED = "tier_removed"
"""Change tuple `(TIER_REMOVED, tier keys)`: the tier no longer holds these (announced) pages."""


class TierEntry(NamedTuple):
    """One page announced as held by the tier: what a restarted service needs to announce it again (its tier
    key names it in the store; the rest is its Stored record)."""

    key: bytes
    cache_salt: str
    parent_hash: int | None
    hash: int
    token_bytes: bytes
    """The page's token ids, int32 little-endian."""


class TierJournalSink(Protocol):
    """Where the tier's announcements are kept across restarts (tier/journal.py)."""

    def stored(self, entries: Sequence[TierEntry]) -> None: ...

    def removed(self, keys: Sequence[bytes]) -> None: ...


class Cleared(NamedTuple):
    """Everything announced before is gone (a new instance starts empty)."""


class SessionChange(NamedTuple):
    """A session opened, closed, was demoted (its KV became ordinary radix entries), parked (its engine's lease
    ended; `engine_id` is that former owner) or adopted (`engine_id` continues it)."""

    kind: str
    """"opened", "closed", "demoted", "parked" or "adopted"."""
    session_id: str
    epoch: int
    cache_salt: str
    streaming: bool
    engine_id: str
    identity: str
    reason: str = ""
    """Why a "closed" session closed: one of CLOSE_REASONS ("" for the other kinds)."""
    parent_session_id: str = ""
    """The session it was opened under ("" for a top-level one; docs/design.md §15)."""


Record = Stored | Removed | Cleared | SessionChange

SESSION_KINDS = ("opened", "closed", "demoted", "parked", "adopted")
CLOSE_REASONS = ("client", "timeout", "lease_ended", "parked_timeout")
"""Why a session closed: its client closed it (CloseSession, or a close op; at its turn's end when one was in
flight), it sat idle past its timeout, its engine's lease ended while its close was deferred or before it
committed anything (a lease's end parks the others, §11), or it was parked and no engine adopted it within
--parked-session-timeout."""


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


class PageHashes:
    """The hash of every page the radix holds, kept as the radix's change records are resolved in order
    (a page id is reused only after its removal was resolved, so the table always matches the tree as of
    the last record resolved)."""

    __slots__ = ("_hashes", "_tier", "journal", "page_bytes", "page_size")

    def __init__(self, num_pages: int, page_size: int) -> None:
        self.page_size = page_size
        self.page_bytes = page_size * 4
        self._hashes: npt.NDArray[np.uint64] = np.zeros(num_pages, dtype=np.uint64)
        self._tier: dict[bytes, tuple[str, int]] = {}
        """Tier key -> (salt, hash) of every page announced as held by the tier and not removed since."""
        self.journal: TierJournalSink | None = None
        """Told of every page announced as held by the tier, and of every such page removed."""

    @property
    def tier_announced(self) -> int:
        return len(self._tier)

    def tier_stored(self, salt: str, parent_page: int | None, key: bytes, pages: bytes, keys: list[bytes],
                    out: list[Record], no_window: bool = False) -> None:
        """Radix pages the tier holds now: one Stored(tier=True) per run of pages not announced yet (hashes
        from the table: the pages are still in the tree at this point of the change order)."""
        ids = np.frombuffer(pages, dtype=np.int32)
        hashes: list[int] = self._hashes[ids].tolist()
        parent = None if parent_page is None else int(self._hashes[parent_page])
        pb = self.page_bytes
        start = -1
        for i in range(len(keys) + 1):
            new = i < len(keys) and keys[i] not in self._tier
            if new and start < 0:
                start = i
            elif not new and start >= 0:
                first_parent = parent if start == 0 else hashes[start - 1]
                out.append(Stored(salt, first_parent, hashes[start:i],
                                  np.frombuffer(key[start * pb:i * pb], dtype="<i4"), True, False, no_window))
                for k, h in zip(keys[start:i], hashes[start:i], strict=True):
                    self._tier[k] = (salt, h)
                if self.journal is not None:
                    self.journal.stored([TierEntry(keys[j], salt, parent if j == 0 else hashes[j - 1], hashes[j],
                                                   key[j * pb:(j + 1) * pb]) for j in range(start, i)])
                start = -1

    def tier_announce(self, entries: Sequence[TierEntry], out: list[Record]) -> None:
        """Pages a tier held before this instance started (its journal's, parents first): Stored(tier=True)
        records, one per chain run, registered as announced so their removal is announced too."""
        for e in entries:
            if e.key in self._tier:
                continue
            self._tier[e.key] = (e.cache_salt, e.hash)
            tokens = np.frombuffer(e.token_bytes, dtype="<i4")
            last = out[-1] if out else None
            if (type(last) is Stored and last.tier and last.cache_salt == e.cache_salt and last.hashes
                    and last.hashes[-1] == e.parent_hash):
                out[-1] = last._replace(token_ids=np.concatenate((last.token_ids, tokens)))
                last.hashes.append(e.hash)
            else:
                out.append(Stored(e.cache_salt, e.parent_hash, [e.hash], tokens, True))

    def tier_removed(self, keys: list[bytes], out: list[Record]) -> None:
        """Announced pages the tier dropped: Removed(tier=True) records, one per salt run."""
        gone: list[bytes] = []
        for k in keys:
            entry = self._tier.pop(k, None)
            if entry is None:
                continue
            gone.append(k)
            salt, h = entry
            last = out[-1] if out else None
            if type(last) is Removed and last.tier and last.cache_salt == salt:
                last.hashes.append(h)
            else:
                out.append(Removed(salt, [h], True))
        if self.journal is not None and gone:
            self.journal.removed(gone)

    def _chain_start(self, salt: str, parent_page: int | None) -> tuple[int | None, bytes]:
        """(the published parent hash, the 8-byte chain start) of a run after `parent_page`."""
        if parent_page is None:
            return None, salt_hash(salt)
        parent_hash = int(self._hashes[parent_page])
        return parent_hash, parent_hash.to_bytes(8, "big")

    def stored(self, salt: str, parent_page: int | None, key: bytes, pages: bytes) -> Stored:
        """A run entered the tree (its parent's pages are hashed already)."""
        parent_hash, start = self._chain_start(salt, parent_page)
        hashes = chain_hashes(start, key, self.page_bytes)
        self._hashes[np.frombuffer(pages, dtype=np.int32)] = hashes
        return Stored(salt, parent_hash, hashes, np.frombuffer(key, dtype="<i4"))  # a view of immutable bytes

    def removed(self, pages: bytes) -> list[int]:
        """The hashes of pages that left the tree."""
        hashes: list[int] = self._hashes[np.frombuffer(pages, dtype=np.int32)].tolist()
        return hashes

    def hash_tree(self, runs: Iterable[tuple[str, int | None, bytes, bytes]]) -> None:
        """Hash every run of a tree (parents before children): what it held before anyone listened."""
        for salt, parent_page, key, pages in runs:
            self.stored(salt, parent_page, key, pages)

    def snapshot(self, runs: Iterable[tuple[str, int | None, bytes, bytes]]) -> list[Stored]:
        """A hashed tree's runs as Stored records, parents before children."""
        return [Stored(salt, self._chain_start(salt, parent_page)[0],
                       self._hashes[np.frombuffer(pages, dtype=np.int32)].tolist(),
                       np.frombuffer(key, dtype="<i4").astype(np.int32)) for salt, parent_page, key, pages in runs]

    def resolve(self, changes: list[Any], out: list[Record]) -> None:
        """Append to `out` the records of `changes` (radix change tuples and session records, in order).
        Consecutive removals under one salt share a record (an append that evicts a page at a time would
        otherwise make one record per page)."""
        for change in changes:
            kind = change[0] if type(change) is tuple else None
            if kind == "stored":
                out.append(self.stored(change[1], change[2], change[3], change[4]))
            elif kind == STORED_FULL:
                out.append(self.stored(change[1], change[2], change[3], change[4])._replace(no_window=True))
            elif kind == TIER_STORED:
                self.tier_stored(change[1], change[2], change[3], change[4], change[5], out,
                                 len(change) > 6 and change[6])
            elif kind == TIER_REMOVED:
                self.tier_removed(change[1], out)
            elif kind == WINDOW_STORED:
                out.append(Stored(change[1], None if change[2] is None else int(self._hashes[change[2]]),
                                  self._hashes[np.frombuffer(change[4], dtype=np.int32)].tolist(),
                                  np.frombuffer(change[3], dtype="<i4"), False, True))
            elif kind == WINDOW_REMOVED:
                out.append(Removed(change[1], self.removed(change[2]), False, True))
            elif kind == "removed":
                last = out[-1] if out else None
                if type(last) is Removed and not last.tier and not last.window and last.cache_salt == change[1]:
                    last.hashes.extend(self.removed(change[2]))
                else:
                    out.append(Removed(change[1], self.removed(change[2])))
            else:
                out.append(change)
