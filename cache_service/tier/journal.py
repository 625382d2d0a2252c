"""The announcement journal: what the KV events said a tier holds, kept beside the tier so that a restarted
service can say it again (docs/design.md §8).

A tier value is found by its key alone (a SHA-256 chain over the pages' tokens, core/tier_keys.py), but a
router's `BlockStored` event needs the page's token ids, its page hash and its parent's hash. A restarted
service knows the keys its disk tier holds (the segment headers) and nothing else, so it could not tell a
router what it holds until those pages were stored or loaded again. The journal closes that gap: every page
the events announce as held by the tier is appended as one record (key, cache salt, parent hash, hash, token
ids), every page the events announce as gone as a removal. At the next start the service reads the journal,
keeps the entries whose key the tier still holds and whose parent is kept too (a page whose parent is gone
cannot be matched: neither the radix nor a router reaches it), announces them, parents first, right after
`AllBlocksCleared`, and rewrites the journal to exactly those entries.

File: `<tier-dir>/.kvcache-announced`, a magic line then records back to back:

    stored   b"S" | key (32) | salt bytes u16 | salt (utf-8) | has parent u8 | parent hash u64 | hash u64 |
             token bytes u32 | token ids (int32 little-endian)
    removed  b"R" | key (32)

(little-endian). Appends are not fsynced: a record torn by a crash ends the journal there (what follows is
unreadable and the tail is dropped at the rewrite), which costs announcements, never correctness: an entry
is only announced when the tier holds its key, and a key names its tokens.
"""

from __future__ import annotations

import contextlib
import os
import struct
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import BinaryIO

from cache_service.core.events import TierEntry
from cache_service.core.tier_keys import KEY_BYTES

JOURNAL_NAME = ".kvcache-announced"
MAGIC = b"kvcache-announced v1\n"
_STORED = b"S"
_REMOVED = b"R"
_SALT = struct.Struct("<H")
COMPACT_FACTOR = 4
COMPACT_MIN = 4096
_HASHES = struct.Struct("<BQQI")
"""has parent | parent hash | hash | token bytes."""


def encode(entry: TierEntry) -> bytes:
    salt = entry.cache_salt.encode()
    parent = entry.parent_hash
    return b"".join((_STORED, entry.key, _SALT.pack(len(salt)), salt,
                     _HASHES.pack(parent is not None, parent or 0, entry.hash, len(entry.token_bytes)),
                     entry.token_bytes))


def decode(data: bytes) -> tuple[list[TierEntry], int]:
    """The entries still held after the journal's stored and removed records, in the order first stored, and
    the number of bytes read (a torn or foreign tail ends the read)."""
    if not data.startswith(MAGIC):
        return [], 0
    held: dict[bytes, TierEntry] = {}
    at = len(MAGIC)
    end = len(data)
    while at < end:
        kind = data[at:at + 1]
        key = data[at + 1:at + 1 + KEY_BYTES]
        if len(key) < KEY_BYTES or kind not in (_STORED, _REMOVED):
            break
        pos = at + 1 + KEY_BYTES
        if kind == _REMOVED:
            held.pop(key, None)
            at = pos
            continue
        if pos + _SALT.size > end:
            break
        (salt_len,) = _SALT.unpack_from(data, pos)
        pos += _SALT.size
        salt = data[pos:pos + salt_len]
        pos += salt_len
        if pos + _HASHES.size > end:
            break
        has_parent, parent, page_hash, token_len = _HASHES.unpack_from(data, pos)
        pos += _HASHES.size
        tokens = data[pos:pos + token_len]
        pos += token_len
        if len(tokens) < token_len or len(salt) < salt_len:
            break
        try:
            text = salt.decode()
        except UnicodeDecodeError:
            break
        held.pop(key, None)  # a key stored again goes to the end: after its (re-stored) parent
        held[key] = TierEntry(key, text, parent if has_parent else None, page_hash, bytes(tokens))
        at = pos
    return list(held.values()), at


def parents_first(entries: Sequence[TierEntry], present: Sequence[bool]) -> list[TierEntry]:
    """The entries whose key is present and whose chain up to its first page is all present, each after its
    parent (the order a router can attach them in)."""
    by_hash = {e.hash: e for e, p in zip(entries, present, strict=True) if p}
    out: list[TierEntry] = []
    state: dict[int, bool] = {}  # hash -> kept (decided)

    for entry in by_hash.values():
        chain: list[TierEntry] = []
        node: TierEntry | None = entry
        kept = True
        while node is not None and node.hash not in state:
            chain.append(node)
            if node.parent_hash is None:
                node = None
                break
            parent = by_hash.get(node.parent_hash)
            if parent is None:
                kept = False
                node = None
                break
            node = parent
        if node is not None:
            kept = state[node.hash]
        for n in reversed(chain):
            state[n.hash] = kept
            if kept:
                out.append(n)
    return out


class TierJournal:
    """The journal of one tier directory. Not thread-safe: the event loop calls it (the core's event hashing
    calls `stored` and `removed` as it resolves tier changes)."""

    def __init__(self, directory: str | os.PathLike[str]) -> None:
        self.path = Path(directory) / JOURNAL_NAME
        self._file: BinaryIO | None = None
        self._records = 0
        self._live = 0
        """Records appended since the last rewrite, and the entries held by the estimate stored - removed: the
        journal is compacted (`load` and `rewrite`) when it holds four times more records than entries."""
        self.torn_bytes = 0
        """Bytes of a torn or unreadable tail found by `load` (dropped at the rewrite)."""

    def load(self) -> list[TierEntry]:
        """What the journal says the tier held, in the order stored ([] without a journal)."""
        try:
            data = self.path.read_bytes()
        except FileNotFoundError:
            return []
        entries, read = decode(data)
        self.torn_bytes = len(data) - read if data.startswith(MAGIC) else len(data)
        return entries

    def rewrite(self, entries: Iterable[TierEntry]) -> None:
        """Replace the journal with `entries` (atomically: a new file renamed over the old), and append to it
        from now on."""
        self.close()
        tmp = self.path.with_name(self.path.name + ".tmp")
        with open(tmp, "wb") as f:
            f.write(MAGIC)
            n = 0
            for e in entries:
                f.write(encode(e))
                n += 1
        os.replace(tmp, self.path)
        self._records = self._live = n
        self._file = open(self.path, "ab")  # noqa: SIM115 (kept open: appended to per event batch)

    def stored(self, entries: Sequence[TierEntry]) -> None:
        if self._file is not None and entries:
            self._file.write(b"".join(encode(e) for e in entries))
            self._appended(len(entries), len(entries))

    def removed(self, keys: Sequence[bytes]) -> None:
        if self._file is not None and keys:
            self._file.write(b"".join(_REMOVED + k for k in keys))
            self._appended(len(keys), -len(keys))

    def _appended(self, records: int, live: int) -> None:
        assert self._file is not None
        self._file.flush()
        self._records += records
        self._live = max(0, self._live + live)
        if self._records > COMPACT_FACTOR * max(self._live, COMPACT_MIN):
            self.rewrite(self.load())

    def close(self) -> None:
        if self._file is not None:
            with contextlib.suppress(OSError):
                self._file.close()
            self._file = None
