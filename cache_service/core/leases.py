"""Engine leases: register, heartbeat, expire. Sessions name their owner; the core releases them."""

from __future__ import annotations

from collections import OrderedDict


class Lease:
    __slots__ = ("engine_id", "expires_at", "sessions", "ttl_seconds")

    def __init__(self, engine_id: str, ttl_seconds: float, now: float) -> None:
        self.engine_id = engine_id
        self.ttl_seconds = ttl_seconds
        self.expires_at = now + ttl_seconds
        self.sessions: set[str] = set()

    def renew(self, now: float) -> None:
        self.expires_at = now + self.ttl_seconds

    def expired(self, now: float) -> bool:
        return now >= self.expires_at


class LeaseTable:
    """Live leases plus a bounded memory of expired engine ids (to answer LEASE_EXPIRED)."""

    def __init__(self, expired_memory: int) -> None:
        self.live: dict[str, Lease] = {}
        self._expired: OrderedDict[str, None] = OrderedDict()
        self._expired_memory = expired_memory

    def remember_expired(self, engine_id: str) -> None:
        self._expired[engine_id] = None
        self._expired.move_to_end(engine_id)
        while len(self._expired) > self._expired_memory:
            self._expired.popitem(last=False)

    def was_expired(self, engine_id: str) -> bool:
        return engine_id in self._expired

    def forget_expired(self, engine_id: str) -> None:
        self._expired.pop(engine_id, None)

    def due(self, now: float) -> list[Lease]:
        return [lease for lease in self.live.values() if lease.expired(now)]
