"""Typed results of the kvcache RPCs. Page ids are numpy int32 arrays owned by the record.

`PoolLayout`, `DTYPE_BYTES` and `DTYPE_NAMES` are the service's own definitions (`kvcache_common.layout`),
re-exported here: client and service cannot disagree about the pool's arithmetic. `Stats` and `ReuseStats` are
generated from the proto (kvcache_common/stats.py), as the service's are.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import numpy.typing as npt

from kvcache_common.layout import DTYPE_BYTES as DTYPE_BYTES
from kvcache_common.layout import DTYPE_NAMES as DTYPE_NAMES
from kvcache_common.layout import PoolLayout as PoolLayout
from kvcache_common.stats import ReuseStats as ReuseStats
from kvcache_common.stats import ServiceStats

PageIds = npt.NDArray[np.int32]


NO_PAGES: PageIds = np.zeros(0, dtype=np.int32)
NO_PAGES.setflags(write=False)


def no_pages() -> PageIds:
    """The one empty, read-only page id array: the window page ids of a pool without window pages. One object, so
    records that hold it compare equal (a tuple compares a field by identity first; two empty arrays would compare
    element-wise)."""
    return NO_PAGES


@dataclass(frozen=True, slots=True)
class PoolInfo:
    layout: PoolLayout
    backend: str
    shm_path: str
    cuda_ipc_handle: bytes
    device_uuid: str
    size_bytes: int
    instance_id: str
    offset_bytes: int
    page_bytes: int
    server_version: str
    pool_socket: str = ""
    """host_memfd, cuda_vmm: the unix socket that hands the pool over (a path, or @name)."""
    step_socket: str = ""
    """The step lane's unix socket path ("" when the service serves none): the clients' Steps take it."""
    window_offset_bytes: int = 0
    """With `layout.window_pages`: where the window region starts in the mapping (0: one region)."""
    window_size_bytes: int = 0
    """With `layout.window_pages`: bytes of the window region (`size_bytes` counts both regions)."""


@dataclass(frozen=True, slots=True)
class EngineLease:
    engine_id: str
    ttl_seconds: float
    instance_id: str
    held: bool = False
    """Held by a HoldLease stream: it lasts while the client holds the stream, whatever the TTL."""


@dataclass(frozen=True, slots=True)
class HeartbeatResult:
    ttl_seconds: float
    expires_in_seconds: float
    instance_id: str
    num_sessions: int


@dataclass(frozen=True, slots=True)
class MatchResult:
    cached_tokens: int
    page_ids: PageIds
    tier_tokens: int = 0
    """Of cached_tokens, how many only the service's tier holds (an append loads them; no page ids yet)."""
    window_page_ids: PageIds = field(default_factory=no_pages)
    """With a window pool: one per page_ids entry, its window page (0: dropped) when the service matched; those
    of the pages the window before the match's end covers are nonzero. A probe pins nothing: read KV through a
    session's append, whose ids are current. Empty for other pools."""


@dataclass(frozen=True, slots=True)
class OpenedSession:
    session_id: str
    epoch: int
    timeout_seconds: float
    instance_id: str


@dataclass(frozen=True, slots=True)
class AppendResult:
    """Compute KV for positions [cached_tokens, context_tokens); truncate the page table to page_offset
    entries and append page_ids."""

    session_id: str
    epoch: int
    turn: int
    cached_tokens: int
    context_tokens: int
    capacity_tokens: int
    page_offset: int
    page_ids: PageIds
    num_pages: int
    prefix_hit_tokens: int
    tier_tokens: int = 0
    """Of cached_tokens, how many the service loaded from its tier for this append."""
    window_page_ids: PageIds = field(default_factory=no_pages)
    """With a window pool (`PoolLayout.window_pages`): one per page_ids entry, the window page of that page's
    window-layer rows (0: dropped). Truncate a window table beside the page table to page_offset and append these;
    its entries for the positions this turn reads or writes are current. Empty for other pools."""


@dataclass(frozen=True, slots=True)
class ExtendResult:
    """More slots for the turn in flight: truncate the page table to page_offset entries and append page_ids."""

    session_id: str
    epoch: int
    turn: int
    capacity_tokens: int
    page_offset: int
    page_ids: PageIds
    num_pages: int
    window_page_ids: PageIds = field(default_factory=no_pages)
    """With a window pool: one per page_ids entry, its window page (as `AppendResult.window_page_ids`)."""


@dataclass(frozen=True, slots=True)
class CommitResult:
    session_id: str
    context_tokens: int
    kv_tokens: int
    num_pages: int
    closed: bool


@dataclass(frozen=True, slots=True)
class CloseResult:
    session_id: str
    closed: bool
    cached_tokens: int


@dataclass(frozen=True, slots=True)
class ReapResult:
    session_ids: tuple[str, ...]
    engine_ids: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class SessionInfo:
    session_id: str
    epoch: int
    state: str
    """"IDLE", "IN_TURN", "CLOSING" or "PARKED" (its engine's lease ended: the next append adopts it)."""
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
    identity: str = ""
    """The identity that opened it (a --tenants-file name; "" without one)."""
    former_engine_id: str = ""
    """The engine whose lease end last parked it ("" if never parked)."""
    parked_seconds_left: float | None = None
    """Seconds until a parked session is closed (cache=true); None unless parked with a deadline."""
    parent_session_id: str = ""
    """The session it was opened under ("" for a top-level one; docs/design.md §15)."""
    child_sessions: int = 0
    """Its live children."""


@dataclass(frozen=True, slots=True)
class SessionPage:
    """One ListSessions page: `sessions` in the order they were opened, `total` matching in all, and the
    token of the next page ("" after the last)."""

    sessions: list[SessionInfo]
    total: int
    next_page_token: str


@dataclass(frozen=True, slots=True)
class ReuseReport:
    """Where the KV of a turn's context came from, as the engine saw it, sent with its commit
    (`commit_session(..., reuse=...)`, `StepBatch.commit(..., reuse=...)`): tokens already in the engine's own
    prefix cache, tokens taken from kvcache's pages (loaded, or attended in place), and tokens computed. The
    three sum to the turn's context tokens (its append's `context_tokens`)."""

    engine_cached_tokens: int = 0
    loaded_tokens: int = 0
    computed_tokens: int = 0


@dataclass(frozen=True, slots=True, kw_only=True)
class Stats(ServiceStats):
    """GetStats' answer: every field of the proto's GetStatsResponse but `tier`, by name (`ServiceStats`, generated
    from the proto in kvcache_common/stats.py), and `reuse`/`engine_reuse` as `ReuseStats`."""

    @property
    def pages_by_state(self) -> dict[str, int]:
        return {"free": self.free_pages, "evictable": self.evictable_pages,
                "radix_locked": self.radix_locked_pages, "session_held": self.session_held_pages,
                "in_flight": self.in_flight_pages, "quarantined": self.quarantined_pages}

    @property
    def accounting_holds(self) -> bool:
        """free + evictable + radix_locked + session_held + in_flight + quarantined == num_pages - 1."""
        return sum(self.pages_by_state.values()) == self.num_pages - 1
