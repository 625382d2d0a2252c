"""The session record. All behaviour lives in `cache.KVCacheCore`; this is data plus derived counts.

Page-table layout of a session (`pages`), always a prefix chain of the session's context:

    [0, radix_pages)          tree pages pinned by `lock_node` (counted as radix_locked)
    [radix_pages, held_pages) private committed KV            (counted as session_held)
    [held_pages, len(pages))  pages of the turn in flight      (counted as in_flight)
"""

from __future__ import annotations

from cache_service.core.buffers import IntBuffer
from cache_service.core.radix import RadixNode
from cache_service.core.types import SessionState


class Session:
    __slots__ = (
        "cache_salt",
        "close_cache",
        "close_pending",
        "committed_tokens",
        "demoted",
        "epoch",
        "held_pages",
        "id",
        "kv_tokens",
        "last_active",
        "lock_node",
        "owner",
        "pages",
        "radix_pages",
        "radix_turn",
        "state",
        "streaming",
        "synced_pages",
        "timeout_seconds",
        "tokens",
        "turn_cached_tokens",
        "turn_context_tokens",
        "turns",
    )

    def __init__(
        self,
        session_id: str,
        epoch: int,
        *,
        streaming: bool,
        cache_salt: str,
        owner: str,
        timeout_seconds: float,
        now: float,
    ) -> None:
        self.id = session_id
        self.epoch = epoch
        self.streaming = streaming
        self.cache_salt = cache_salt
        self.owner = owner
        self.timeout_seconds = timeout_seconds
        self.last_active = now
        self.state = SessionState.IDLE
        self.close_pending = False
        self.close_cache = False
        self.demoted = False
        self.tokens = IntBuffer()
        self.committed_tokens = 0
        self.kv_tokens = 0
        self.pages = IntBuffer()
        self.held_pages = 0
        self.radix_pages = 0
        self.lock_node: RadixNode | None = None
        self.synced_pages = 0
        self.turns = 0
        self.radix_turn = False
        self.turn_cached_tokens = 0
        self.turn_context_tokens = 0

    @property
    def private_pages(self) -> int:
        """Committed pages the session owns outside the radix."""
        return self.held_pages - self.radix_pages

    @property
    def in_flight_pages(self) -> int:
        return len(self.pages) - self.held_pages

    @property
    def in_turn(self) -> bool:
        return self.state is not SessionState.IDLE

    def timed_out(self, now: float) -> bool:
        return self.timeout_seconds > 0 and now - self.last_active > self.timeout_seconds
