"""Ids, enums and the immutable result records the core hands to the rpc layer.

Per-operation results are NamedTuples (built on every call, they must be cheap); the inspection records
(`SessionInfo`, `Stats`) are frozen dataclasses, converted to protobuf field by field. Arrays in results
are numpy int32 and owned by the record (copies or fresh arrays, never views into core buffers), so a
caller may keep them after the core has moved on.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np
import numpy.typing as npt

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


class ExtendResult(NamedTuple):
    """More slots for the turn in flight: truncate the page table to `page_offset`, append `page_ids`."""

    session_id: str
    epoch: int
    turn: int
    capacity_tokens: int
    page_offset: int
    page_ids: PageArray
    num_pages: int


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


@dataclass(frozen=True, slots=True)
class Reuse:
    """Reuse as engines report it at their commits (core/reuse.py): the reported turns of one engine
    (`engine_id` "" in the total)."""

    engine_id: str = ""
    turns: int = 0
    matched_tokens: int = 0
    """kvcache's cached_tokens at those turns' appends."""
    engine_cached_tokens: int = 0
    """Context tokens the engine already held in its own prefix cache."""
    loaded_tokens: int = 0
    """Context tokens the engine took from kvcache's pages."""
    computed_tokens: int = 0
    """Context tokens the engine computed."""


@dataclass(frozen=True, slots=True)
class Stats:
    """A snapshot of the pool and cache. Pages by state (free, evictable, radix_locked, session_held,
    in_flight, quarantined, loading) always sum to `num_pages - 1`."""

    num_pages: int
    page_size: int
    free_pages: int
    evictable_pages: int
    radix_locked_pages: int
    session_held_pages: int
    in_flight_pages: int
    quarantined_pages: int
    session_budget_pages: int
    radix_tokens: int
    session_tokens: int
    session_kv_tokens: int
    prefix_hit_tokens: int
    session_hit_tokens: int
    miss_tokens: int
    evicted_pages: int
    duplicate_pages: int
    """Pages freed because the radix already held the same tokens (KV computed twice by racing turns)."""
    demoted_sessions: int
    reaped_sessions: int
    expired_leases: int
    sessions_idle: int
    sessions_in_turn: int
    sessions_closing: int
    sessions_demoted: int
    engines: int
    loading_pages: int = 0
    """Pages a tier load is writing into (ledger state LOADING; part of the invariant's sum)."""
    offloading_pages: int = 0
    """Radix pages a tier offload is reading (pinned in the radix, so counted as radix_locked too)."""
    tier_stored_pages: int = 0
    """Radix pages the tier is known to hold (eviction of these loses nothing)."""
    evicted_unstored_pages: int = 0
    """Radix pages evicted before the tier held them (with a tier: lost for good)."""
    sessions_parked: int = 0
    """Idle sessions with no owner since their engine's lease ended (counted in sessions_idle too)."""
    parked_sessions: int = 0
    """Cumulative: sessions parked at a lease's end."""
    adopted_sessions: int = 0
    """Cumulative: parked sessions an append continued (adopted)."""
    expired_parked_sessions: int = 0
    """Cumulative: parked sessions closed (cache=true) at their parked timeout (counted in reaped_sessions too)."""
    evicted_closed_child_pages: int = 0
    """Cumulative radix pages evicted by class (docs/design.md §15; the three sum to evicted_pages): what closed
    sessions left (a child's close, a drop), ordinary entries, and prefixes of parents whose children are live."""
    evicted_ordinary_pages: int = 0
    evicted_parent_pages: int = 0
    demoted_session_pages: int = 0
    """Cumulative pages relief demoted from idle sessions without live children (they became radix entries)."""
    demoted_parent_pages: int = 0
    """Cumulative pages relief demoted from parents whose children are live (the last resort)."""
    reuse: Reuse = Reuse()
    """What engines reported at their commits, in total (reuse.py)."""
    engine_reuse: tuple[Reuse, ...] = ()
    """The same per engine (the engines that reported last), by engine id."""
    window_pages: int = 0
    """A pool whose window rows are kept apart (docs/design.md §13): its usable window pages (0: none kept apart).
    window_free_pages + window_held_pages == window_pages."""
    window_free_pages: int = 0
    window_held_pages: int = 0
    """Window pages holding a page's window-layer rows (a page with full rows and no window rows holds none)."""
    window_policy_dropped_pages: int = 0
    """Cumulative window pages dropped at commits: rows no hit point of the session needs."""
    window_pressure_dropped_pages: int = 0
    """Cumulative window pages dropped under pressure: radix rows no hit point needs."""
    window_evicted_pages: int = 0
    """Cumulative whole radix pages evicted because window pages were short (counted in evicted_pages too)."""
    window_cut_hit_tokens: int = 0
    """Cumulative tokens pinned matches gave up because the window rows before their end were gone."""

    @property
    def usable_pages(self) -> int:
        return self.num_pages - 1

    @property
    def sessions(self) -> int:
        return self.sessions_idle + self.sessions_in_turn + self.sessions_closing
