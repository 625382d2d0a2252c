"""Engine leases: the table of live leases, and what an expiry releases.

A lease belongs to the identity that registered it and names the sessions opened under it. It ends by
TTL (no heartbeat in time), by unregister or re-register, or, for a lease held by a stream (`held`), when
that stream ends; a held lease never expires by TTL. Ending a lease hands back the ids of its sessions;
the facade closes them (`turns.Turns` releases their KV). Ended engine ids are remembered (bounded) so that
a late call answers LEASE_EXPIRED rather than ENGINE_NOT_FOUND.
"""

from __future__ import annotations

from collections import OrderedDict

from cache_service.core.errors import KVCacheError, Reason
from cache_service.core.types import EngineInfo


class Lease:
    __slots__ = ("engine_id", "expires_at", "held", "identity", "serial", "sessions", "ttl_seconds")

    def __init__(self, engine_id: str, ttl_seconds: float, now: float, *, identity: str, held: bool,
                 serial: int) -> None:
        self.engine_id = engine_id
        self.ttl_seconds = ttl_seconds
        self.expires_at = now + ttl_seconds
        self.identity = identity
        """Who registered it: only they may use, renew or end it."""
        self.held = held
        """Held by a stream: it ends when the stream does, never by TTL."""
        self.serial = serial
        """Unique per registration: a stream ending can only end the lease it started."""
        self.sessions: set[str] = set()

    def renew(self, now: float) -> None:
        self.expires_at = now + self.ttl_seconds

    def expired(self, now: float) -> bool:
        return not self.held and now >= self.expires_at

    def info(self, now: float) -> EngineInfo:
        return EngineInfo(self.engine_id, self.ttl_seconds, self.expires_at - now, len(self.sessions), self.serial,
                          self.held)


def lease_expired(engine_id: str) -> KVCacheError:
    return KVCacheError(
        Reason.LEASE_EXPIRED, f"the lease of engine {engine_id!r} has expired; register again", engine_id=engine_id
    )


class LeaseTable:
    """Live leases plus a bounded memory of expired engine ids."""

    def __init__(self, expired_memory: int) -> None:
        self._live: dict[str, Lease] = {}
        self._expired: OrderedDict[str, None] = OrderedDict()
        self._expired_memory = expired_memory
        self._serial = 0

    def __len__(self) -> int:
        return len(self._live)

    def leases(self) -> list[Lease]:
        return list(self._live.values())

    def find(self, engine_id: str) -> Lease | None:
        return self._live.get(engine_id)

    def owner_of(self, engine_id: str) -> Lease:
        """The live lease a session names as its owner (it must exist: sessions die with their lease)."""
        return self._live[engine_id]

    def has_expired(self, engine_id: str) -> bool:
        """`engine_id` holds no live lease and is remembered as expired."""
        return engine_id in self._expired and engine_id not in self._live

    def get(self, engine_id: str) -> Lease:
        """The lease of `engine_id`, due or not: ENGINE_NOT_FOUND, or LEASE_EXPIRED for a remembered one."""
        lease = self._live.get(engine_id)
        if lease is None:
            if engine_id in self._expired:
                raise lease_expired(engine_id)
            raise KVCacheError(
                Reason.ENGINE_NOT_FOUND, f"engine {engine_id!r} is not registered", engine_id=engine_id
            )
        return lease

    def add(self, engine_id: str, ttl_seconds: float, now: float, *, identity: str, held: bool) -> Lease:
        """Start a lease (the id must hold no live lease)."""
        assert engine_id not in self._live, "end the previous lease first"
        self._expired.pop(engine_id, None)
        self._serial += 1
        lease = self._live[engine_id] = Lease(engine_id, ttl_seconds, now, identity=identity, held=held,
                                              serial=self._serial)
        return lease

    def end(self, lease: Lease, *, expired: bool) -> tuple[str, ...]:
        """Drop the lease; return the ids of its sessions (sorted), which the caller must close. An `expired`
        lease's id is remembered, so a late call hears LEASE_EXPIRED."""
        del self._live[lease.engine_id]
        if expired:
            self._expired[lease.engine_id] = None
            self._expired.move_to_end(lease.engine_id)
            while len(self._expired) > self._expired_memory:
                self._expired.popitem(last=False)
        return tuple(sorted(lease.sessions))

    def due(self, now: float) -> list[Lease]:
        return [lease for lease in self._live.values() if lease.expired(now)]
