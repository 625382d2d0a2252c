"""Ids, enums and the immutable result records the core hands to the rpc layer.

Per-operation results are NamedTuples (built on every call, they must be cheap); the inspection records
(`SessionInfo`, `Stats`) are frozen dataclasses; rpc/convert.py converts them to protobuf by field name. Arrays
in results are numpy int32 and owned by the record (copies or fresh arrays, never views into core buffers), so
a caller may keep them after the core has moved on.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np
import numpy.typing as npt

from kvcache_common.stats import CoreStats, ReuseStats

PageArray = npt.NDArray[np.int32]
"""A 1-D int32 array of page ids."""
TokenArray = npt.NDArray[np.int32]
"""A 1-D int32 array of token ids."""
TokenBytes = bytes | memoryview
"""Token ids as int32 little-endian bytes, or a view of a request's bytes (a Step's op: no copy)."""

EMPTY_PAGES: PageArray = np.zeros(0, dtype=np.int32)
EMPTY_PAGES.setflags(write=False)


class CloseMode(enum.IntEnum):
    """What a close keeps (docs/design.md §15); the numbers are the proto's CloseMode values."""

    CACHE = 1
    """The committed context's full pages go into the radix (a resumed or forked conversation hits)."""
    DROP = 2
    """Private pages are freed at once; what the radix also holds (a streaming session's pinned first-turn
    prompt) stays, as a leftover that is evicted first."""
    KEEP_PREFIX = 3
    """Private pages are freed at once; the pinned first-turn prompt stays as an ordinary radix entry
    (SGLang's streaming close)."""


class SessionState(enum.Enum):
    IDLE = "IDLE"
    """No turn in flight."""
    IN_TURN = "IN_TURN"
    """Between AppendSession and CommitSession."""
    CLOSING = "CLOSING"
    """Close requested during a turn; completes when the turn commits or aborts."""
    PARKED = "PARKED"
    """Idle with no owner since its engine's lease ended (docs/design.md §11): its KV stays session-held until the
    parked timeout; the next append (any engine of its identity) adopts it."""


class MatchResult(NamedTuple):
    """A read-only probe: the leading `cached_tokens` (whole pages) are in the radix, in `page_ids`."""

    cached_tokens: int
    page_ids: PageArray
    window_page_ids: PageArray = EMPTY_PAGES
    """With a window pool: one per `page_ids` entry, its window page (0: dropped), read at the match. The match ends
    where the `k` pages before its end (all, when fewer) have theirs (window.py `usable`); the probe pins nothing,
    so later drops make them stale (docs/design.md §13). Empty otherwise."""


class OpenResult(NamedTuple):
    session_id: str
    epoch: int
    """Unique across all sessions of this service instance; a reused id gets a new epoch."""
    timeout_seconds: float


class AppendResult(NamedTuple):
    """The turn's page-table delta and which positions need KV.

    The engine truncates its page table to `page_offset` entries and appends `page_ids`; it then computes
    KV for positions [cached_tokens, context_tokens) and may write decode KV up to `capacity_tokens`.
    """

    session_id: str
    epoch: int
    turn: int
    cached_tokens: int
    context_tokens: int
    capacity_tokens: int
    page_offset: int
    page_ids: PageArray
    num_pages: int
    """Length of the session's whole page table after this append."""
    prefix_hit_tokens: int
    """Of `cached_tokens`, how many came from the radix (the rest are the session's own KV)."""
    window_page_ids: PageArray = EMPTY_PAGES
    """With a window pool (`CoreConfig.window_pages`): one per `page_ids` entry, the window page holding that
    page's window rows, 0 where they were dropped (docs/design.md §13). Empty otherwise."""


class ExtendResult(NamedTuple):
    """More slots for the turn in flight: truncate the page table to `page_offset`, append `page_ids`."""

    session_id: str
    epoch: int
    turn: int
    capacity_tokens: int
    page_offset: int
    page_ids: PageArray
    num_pages: int
    window_page_ids: PageArray = EMPTY_PAGES
    """With a window pool: one per `page_ids` entry, its window page (as `AppendResult.window_page_ids`)."""


class CommitResult(NamedTuple):
    session_id: str
    context_tokens: int
    kv_tokens: int
    num_pages: int
    closed: bool
    """True when a deferred close completed with this commit or abort."""


class CloseResult(NamedTuple):
    session_id: str
    closed: bool
    """False when the close is deferred until the in-flight turn ends."""
    cached_tokens: int
    """Tokens of the session's context now in the radix (close with cache=true)."""


@dataclass(frozen=True, slots=True)
class SessionInfo:
    session_id: str
    epoch: int
    state: SessionState
    streaming: bool
    cache_salt: str
    engine_id: str
    context_tokens: int
    kv_tokens: int
    turns: int
    num_pages: int
    radix_pages: int
    held_pages: int
    in_flight_pages: int
    idle_seconds: float
    timeout_seconds: float
    demoted: bool
    close_pending: bool
    identity: str
    """The identity that opened it ("" without --tenants-file)."""
    former_engine_id: str = ""
    """The engine whose lease end last parked it ("" if never parked); kept after an adoption."""
    parked_seconds_left: float | None = None
    """Seconds until a parked session is closed (cache=true); None unless parked with a deadline."""
    parent_session_id: str = ""
    """The session it was opened under ("" for a top-level session); kept after the parent closes."""
    child_sessions: int = 0
    """Open sessions opened under it (its live children)."""


@dataclass(frozen=True, slots=True)
class EngineInfo:
    engine_id: str
    ttl_seconds: float
    expires_in_seconds: float
    num_sessions: int
    serial: int = 0
    """Unique per registration: `end_held_lease` takes it, so a stream only ever ends the lease it started."""
    held: bool = False
    """Held by a HoldLease stream (no TTL expiry while it is open)."""


@dataclass(frozen=True, slots=True)
class ReapResult:
    session_ids: tuple[str, ...]
    """Sessions closed because they timed out (parked ones at their parked timeout included). An expired
    lease's sessions are parked, not closed."""
    engine_ids: tuple[str, ...]
    """Engines whose lease expired in this pass."""


Reuse = ReuseStats
"""Reuse as engines report it at their commits (core/reuse.py): the reported turns of one engine (`engine_id` ""
in the total). Generated from the proto's ReuseStats (kvcache_common/stats.py)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Stats(CoreStats):
    """A snapshot of the pool and cache: `CoreStats`, the fields GetStats sends (declared once, in the proto's
    GetStatsResponse, and generated). Pages by state (free, evictable, radix_locked, session_held, in_flight,
    quarantined, loading) always sum to `num_pages - 1`. A new counter is a proto field, then `make proto`,
    then its value in accounting.py's `stats()` (which must name every field)."""

    @property
    def usable_pages(self) -> int:
        return self.num_pages - 1

    @property
    def sessions(self) -> int:
        return self.sessions_idle + self.sessions_in_turn + self.sessions_closing
