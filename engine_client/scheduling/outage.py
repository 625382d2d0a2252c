"""kvcache up and down as an engine's integration sees it: one warning per outage (docs/design.md §7, §14).

The engine computes while kvcache is unreachable and reconnects on its own; a connection is a generation
(sessions of an older one are gone with its lease). `Outage` says which transition is news: the first
failure of an outage (warn once), the connection that ends one (back, or a restarted service: a new pool
instance whose cache starts empty), or the first connection ever. The engine words its own messages.
"""

from __future__ import annotations

import time
from collections.abc import Callable

__all__ = ["Outage"]


class Outage:
    """The up/down state of one line to kvcache."""

    FIRST = "first"
    BACK = "back"
    RESTARTED = "restarted"

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self.up = False
        self.ever_up = False
        self.down_since: float | None = None
        """When the current outage began (None: not in one)."""
        self.instance_id = ""
        """The pool instance of the last connection."""

    def down(self) -> bool:
        """The line failed; True the first time in an outage (the caller warns then, and only then)."""
        self.up = False
        if self.down_since is not None:
            return False
        self.down_since = self._clock()
        return True

    def came_up(self, instance_id: str) -> tuple[str, float | None]:
        """A connection to pool instance `instance_id`: (FIRST | BACK | RESTARTED, the seconds the outage it
        ends lasted, None when it ends none)."""
        was, previous = self.ever_up, self.instance_id
        seconds = None if self.down_since is None else self._clock() - self.down_since
        self.up, self.ever_up, self.down_since, self.instance_id = True, True, None, instance_id
        if not was:
            return self.FIRST, seconds
        return (self.RESTARTED if previous != instance_id else self.BACK), seconds
