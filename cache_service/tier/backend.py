"""What a tier backend provides: batched exists, put and get of page values, by key.

Backends are called from the tier's worker threads only (never from the asyncio loop), may block, and
must be safe to call from two threads at once (the load and the offload worker). A call that cannot reach
the store at all raises `TierUnavailable`; anything else is reported per page, so one bad value never
fails its neighbours. The payload moves between the caller's buffers (pool pages or staging slots, in
memory `register()` was given) and the store; the 64-byte header travels with it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple, Protocol, runtime_checkable

from cache_service.tier.memory import PageBuffers
from cache_service.tier.value import Geometry

# Per-page outcomes (the `reason` label of errors): "" is success.
MISSING = "missing"
"""The store holds no value under the key (it was never stored, or evicted since)."""
SHORT = "short"
"""The stored value is shorter than a value of this geometry (torn, or written by something else)."""
WRONG_SIZE = "wrong_size"
"""The stored value is longer, or of another geometry."""
FULL = "full"
"""The store has no room for the value."""
DOWN = "down"
"""The tier was unreachable; nothing was tried."""
TAINTED = "tainted"
"""A get failed in a way that may leave the store writing into the page later: the page must not be reused
until that cannot happen (quarantine it)."""
ERROR = "error"
"""Anything else the store refused."""
CLOSED = "closed"
"""The service was stopping: the page was not offloaded (or loaded). The service's own, never a backend's."""


class TierUnavailable(Exception):
    """The store cannot be reached at all (the whole call failed). `reason` is a short label."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(f"{reason}: {detail}")
        self.reason = reason
        self.detail = detail


class TierConfigError(ValueError):
    """The tier cannot start as configured; one line naming the flag."""


class PutItem(NamedTuple):
    key: bytes
    header: bytes
    """The value's 64-byte header (value.header)."""
    buffers: PageBuffers


class GetItem(NamedTuple):
    key: bytes
    buffers: PageBuffers


class GetResult(NamedTuple):
    reason: str
    """"": the value's bytes are in the buffers and its header in `header` (the caller verifies them)."""
    header: bytes


@dataclass(frozen=True)
class Usage:
    """What a backend knows it holds (the disk tier's index); None fields: unknown."""

    values: int | None
    bytes: int | None
    capacity_bytes: int | None


class TierBackend(Protocol):
    name: str
    medium: str
    """What KV events call this tier (Dynamo 1.6.1 reads GPU, CPU, CPU_PINNED, DISK, STORAGE, EXTERNAL)."""

    @property
    def connected(self) -> bool:
        """A client is set up (Mooncake connects on the tier's link thread, not at construction)."""

    def register(self, regions: Sequence[tuple[int, int]]) -> None:
        """The host memory every buffer handed to put and get lies in; called once before any of them (a
        backend not connected yet registers it when it connects)."""

    def exists(self, runs: Sequence[Sequence[bytes]]) -> list[int]:
        """For each run of keys, how many of its leading keys the store holds a value for: one store call
        for all the runs (a Step's appends and matches)."""

    def put(self, items: Sequence[PutItem]) -> list[str]:
        """Store each value (a key it already holds counts as stored); per item "" or a reason."""

    def get(self, items: Sequence[GetItem]) -> list[GetResult]:
        """Read each value into its buffers."""

    def discard(self, keys: Sequence[bytes]) -> None:
        """Drop values found unsound, so that nobody hits them again; best effort."""

    def take_dropped(self) -> list[bytes]:
        """Keys of values the store dropped on its own (its LRU) since the last call; [] where it cannot tell
        (Mooncake evicts without telling its clients)."""

    def probe(self) -> None:
        """Raise TierUnavailable unless the store answers now."""

    def reconnect(self) -> None:
        """Set the connection up (again): the first connection, or after the store was gone for a while.
        Raises TierUnavailable when it cannot; may block (Mooncake: up to ~90 s against an absent master)."""

    def usage(self) -> Usage: ...

    def describe(self) -> str:
        """One line for the start banner and logs."""

    def close(self) -> None:
        """Idempotent."""


@runtime_checkable
class PackedBackend(Protocol):
    """A store that also moves a batch as one array, `[n, value_bytes]` uint8 (each row a whole value, header
    included): no Python object per chunk. The tier uses it where the page memory can gather and scatter
    batches too (host pools)."""

    def put_values(self, keys: Sequence[bytes], values: Any) -> list[str]:
        """`put` of rows `values[i]` under `keys[i]`."""

    def get_values(self, keys: Sequence[bytes], values: Any) -> list[str]:
        """`get` into rows `values[i]` (the caller verifies them); per key "" or a reason."""


class TierSettings(Protocol):
    """The flags a tier is built from (the service configuration is one)."""

    @property
    def tier(self) -> str: ...

    @property
    def tier_dir(self) -> str: ...

    @property
    def tier_bytes(self) -> int: ...

    @property
    def mooncake_master(self) -> str: ...

    @property
    def mooncake_metadata(self) -> str: ...

    @property
    def mooncake_protocol(self) -> str: ...

    @property
    def mooncake_segment_bytes(self) -> int: ...

    @property
    def mooncake_local_hostname(self) -> str: ...


BackendFactory = Callable[[TierSettings, Geometry], TierBackend]
