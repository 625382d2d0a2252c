"""The change recorder: where the radix's, the sessions' and the window rows' change records wait until the
facade's `take_events` drains them, resolved into hashed records (events.py).

Nothing is recorded until `start`: the tree, the slots and the window rows append to one shared list only while
`changes` is set on them (None: nobody listens, and the hot path pays nothing). Records that must come out in
order with ones not yet taken (a tier's announcements at start, a snapshot) are resolved first into `_ready`,
which the next `take` returns ahead of what follows.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from cache_service.core.config import CoreConfig
from cache_service.core.events import Cleared, PageHashes, Record, Removed, Stored, TierEntry
from cache_service.core.radix import RadixTree
from cache_service.core.slot import Slots
from cache_service.core.window import WindowRows


class Recorder:
    """The facade's queue of change records and the page hashes that resolve them."""

    def __init__(self, config: CoreConfig, radix: RadixTree, slots: Slots, window: WindowRows | None) -> None:
        self._radix = radix
        self._slots = slots
        self._window = window
        self._changes: list[Any] = []
        """Change records (radix tuples, session records) since the last `take`, while recording."""
        self.hashes = PageHashes(config.num_pages, config.page_size)
        self._ready: list[Record] = []

    @property
    def recording(self) -> bool:
        return self._slots.changes is not None

    def start(self) -> None:
        """Record changes from now on, hashing what the tree holds already (idempotent)."""
        if self._slots.changes is None:
            self.hashes.hash_tree(self._radix.runs())
            self._radix.changes = self._slots.changes = self._changes
            if self._window is not None:
                self._window.changes = self._changes

    def pending(self) -> bool:
        return bool(self._changes or self._ready)

    def take(self) -> list[Record]:
        """The change records since the last take, oldest first (nothing until `start`)."""
        out, self._ready = self._ready, []
        self.hashes.resolve(self._changes, out)
        self._changes.clear()
        return out

    def announce_tier(self, entries: Sequence[TierEntry]) -> int:
        """Announce pages a tier held before this instance started (parents first), after every change recorded
        so far (the instance's AllBlocksCleared first). Returns the pages announced."""
        assert self.recording, "start_events() first"
        self._settle()
        before = self.hashes.tier_announced
        self.hashes.tier_announce(entries, self._ready)
        return self.hashes.tier_announced - before

    def cleared(self) -> None:
        """Everything announced before is gone (a new instance starts empty)."""
        self._changes.append(Cleared())

    def snapshot(self) -> list[Stored | Removed]:
        """The whole tree as Stored records, parents before children; on a window pool each run's pages without
        window rows follow it as a Removed of their window rows (docs/design.md §13). Changes not taken yet are
        resolved first and kept for the next `take`."""
        assert self.recording, "start_events() first"
        self._settle()
        runs = list(self._radix.runs())
        stored = self.hashes.snapshot(runs)
        if self._window is None:
            return list(stored)
        win = np.frombuffer(self._window.win, dtype=np.int32)
        out: list[Stored | Removed] = []
        for record, (salt, _, _, pages) in zip(stored, runs, strict=True):
            out.append(record)
            ids = np.frombuffer(pages, dtype=np.int32)
            bare = ids[win[ids] == 0]
            if bare.size:
                out.append(Removed(salt, self.hashes.removed(bare.tobytes()), False, True))
        return out

    def _settle(self) -> None:
        """Resolve the records so far into `_ready`, so what is made next comes after them."""
        self.hashes.resolve(self._changes, self._ready)
        self._changes.clear()
