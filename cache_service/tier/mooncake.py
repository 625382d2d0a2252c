"""The `mooncake` tier: Mooncake Store, shared by every kvcache that names the same master.

kvcache is a client of the store (`mooncake.store.MooncakeDistributedStore`, from the
`mooncake-transfer-engine-non-cuda` wheel: `pip install 'kvcache[mooncake]'`). The store's memory belongs
to standalone `mooncake_client` processes on the storage nodes (or to this service when
--mooncake-segment-bytes > 0, which then takes its segment with it when it stops).

Transfers are zero-copy: the pool's host memory (or a GPU pool's pinned staging area) is registered with
the client (`register_buffer`) and every value moves with `batch_put_from_multi_buffers` /
`batch_get_into_multi_buffers`, whose buffers are the header slot and the page's `2 * num_layers` chunks
where they lie; one call per batch, split so that no call queues more than MAX_SLICES_PER_CALL transfer
slices (the TCP transport's limit). Headers sit in a small registered arena of their own.

What the store answers, and what it means here (seen against mooncake_master 0.3.13.post1 on loopback):
- put: 0 stored; -705 OBJECT_ALREADY_EXISTS (someone stored it first): stored; -200 NO_AVAILABLE_HANDLE:
  the store is full (objects under lease cannot be evicted yet); -900 RPC_FAIL: the master is gone.
- get: the byte count; -704 OBJECT_NOT_FOUND; -600 INVALID_PARAMS when the object is larger than the
  buffers (refused before any transfer); -800 TRANSFER_FAIL when it is smaller (and for transfers that
  broke mid-way: then the store may still write into the buffers, so the pages are reported TAINTED).
- exists: 1 / 0 per key, a negative code for a failed RPC.
- After the master is killed, calls fail with -900 at once or after a few seconds (the client blocks,
  releasing the GIL); when a master comes back on the same address, the same client works again. A
  client is set up again (`reconnect`) only when probing keeps failing.
- Writing into memory that was not registered corrupts the client process's heap: every buffer must lie
  in a registered region.

Evictions: the master evicts (its LRU, once leases expire and memory passes its high watermark) without
telling any client. So this instance watches the keys it announced as held (stored or loaded by it; at most
WATCH_KEYS, the least recently checked dropped from the watch first) and `take_dropped` reports those gone:
a get that finds a watched key missing, and a sweep at most every SWEEP_SECONDS that asks the store about
SWEEP_KEYS watched keys (one `batch_is_exist`), round robin. So a removal reaches KV events within
`WATCH_KEYS / SWEEP_KEYS * SWEEP_SECONDS` (64 s at the defaults), sooner when a lookup meets it.

The client's transfer engine listens on all interfaces (Mooncake has no option for that); with
--mooncake-local-hostname 127.0.0.1 (the default) and MC_TCP_BIND_ADDRESS=127.0.0.1 it announces and
connects to loopback addresses only.
"""

from __future__ import annotations

import os
import socket
import threading
import time
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

import numpy as np
import numpy.typing as npt

from cache_service.core.tier_keys import KEY_BYTES, key_text
from cache_service.memory.base import format_bytes
from cache_service.tier.backend import (
    DOWN,
    ERROR,
    FULL,
    MISSING,
    SHORT,
    TAINTED,
    WRONG_SIZE,
    GetItem,
    GetResult,
    PutItem,
    TierConfigError,
    TierSettings,
    TierUnavailable,
    Usage,
)
from cache_service.tier.value import HEADER_BYTES, Geometry

# Mooncake's ErrorCode values (mooncake-store/include/types.h); the Python binding returns plain ints.
NO_AVAILABLE_HANDLE = -200
INVALID_PARAMS = -600
REPLICA_IS_NOT_READY = -703
OBJECT_NOT_FOUND = -704
OBJECT_ALREADY_EXISTS = -705
LEASE_EXPIRED = -707
TRANSFER_FAIL = -800
RPC_FAIL = -900
RPC_TIMEOUT = -901
_RPC = (RPC_FAIL, RPC_TIMEOUT)

WATCH_KEYS = 1 << 16
"""Keys this instance announced as held whose presence it checks (module docstring)."""
SWEEP_KEYS = 1024
"""Watched keys asked about in one sweep (one batch_is_exist)."""
SWEEP_SECONDS = 1.0
"""The least time between sweeps."""

HEADER_SLOTS = 1024
"""Registered 64-byte header slots shared by the worker threads (a batch takes one per page)."""

TCP_SLICE_BYTES = 64 << 10
"""Mooncake's TCP transport moves a buffer as slices of at most 64 KiB ..."""
MAX_SLICES_PER_CALL = 480
"""... and queues at most 1024 of them per peer (more fail at once with TRANSFER_FAIL, "TCP lane queue-full
rejection" in its log: seen with 64 Llama-8B pages in one call). The two worker threads share a peer, so a
call carries at most this many slices; a bigger batch is split into several calls."""

PROBE_KEY = b"\0" * KEY_BYTES


def import_client() -> Any:
    """The MooncakeDistributedStore class; a TierConfigError with what to install when it cannot load."""
    try:
        from mooncake.store import MooncakeDistributedStore
    except ImportError as e:
        raise TierConfigError(
            f"--tier mooncake: the Mooncake client does not load ({e}); install it with pip install "
            "'kvcache[mooncake]' and Debian's libibverbs1 (apt-get install libibverbs1)") from None
    return MooncakeDistributedStore


def _host_port(address: str) -> tuple[str, int] | None:
    host, sep, port = address.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) <= 65535:
        return None
    return host, int(port)


class _HeaderArena:
    """Registered 64-byte slots for headers, handed out per batch under a lock."""

    def __init__(self, slots: int) -> None:
        self.array: npt.NDArray[np.uint8] = np.zeros(slots * HEADER_BYTES, dtype=np.uint8)
        self.address = int(self.array.ctypes.data)
        self.nbytes = self.array.nbytes
        self._free = list(range(slots - 1, -1, -1))
        self._cond = threading.Condition()
        self._slots = slots

    def take(self, n: int) -> list[int]:
        n = min(n, self._slots)
        with self._cond:
            self._cond.wait_for(lambda: len(self._free) >= n)
            return [self._free.pop() for _ in range(n)]

    def give(self, slots: Sequence[int]) -> None:
        with self._cond:
            self._free.extend(slots)
            self._cond.notify_all()

    def view(self, slot: int) -> memoryview:
        return self.array[slot * HEADER_BYTES:(slot + 1) * HEADER_BYTES].data

    def addr(self, slot: int) -> int:
        return self.address + slot * HEADER_BYTES


class MooncakeTier:
    """Mooncake Store through its Python client. Thread-safe: the client is; the header arena locks."""

    name = "mooncake"
    medium = "EXTERNAL"
    """SGLang's name for a store beyond the node (Dynamo reads it as its disk tier; vLLM would say STORAGE)."""

    def __init__(self, master: str, geometry: Geometry, *, metadata: str = "P2PHANDSHAKE", protocol: str = "tcp",
                 segment_bytes: int = 0, local_hostname: str = "127.0.0.1", rdma_devices: str = "") -> None:
        if _host_port(master) is None:
            raise TierConfigError(f"--mooncake-master: {master!r} is not host:port")
        self.master = master
        self.geometry = geometry
        self.metadata = metadata
        self.protocol = protocol
        self.segment_bytes = segment_bytes
        self.local_hostname = local_hostname
        self._rdma_devices = rdma_devices
        self._cls = import_client()
        # Read by the transfer engine at setup: bind its TCP transport to the address it announces.
        os.environ.setdefault("MC_TCP_BIND_ADDRESS", local_hostname)
        self._headers = _HeaderArena(HEADER_SLOTS)
        slices = 1 + geometry.num_chunks * -(-geometry.chunk_bytes // TCP_SLICE_BYTES)
        self.pages_per_call = max(1, MAX_SLICES_PER_CALL // slices)
        """Values per store call (a value of more than 1024 slices cannot move over TCP at all)."""
        self._regions: list[tuple[int, int]] = []
        self._lock = threading.Lock()
        self._store: Any = None
        self._closed = False
        self._watch_lock = threading.Lock()
        self._watched: OrderedDict[bytes, None] = OrderedDict()
        """Keys announced as held (stored or loaded here), least recently checked first."""
        self._gone: list[bytes] = []
        """Watched keys found missing since the last `take_dropped`."""
        self._next_sweep = 0.0

    @classmethod
    def from_settings(cls, settings: TierSettings, geometry: Geometry) -> MooncakeTier:
        if not settings.mooncake_master:
            raise TierConfigError("--mooncake-master: the mooncake tier needs the master's host:port")
        return cls(settings.mooncake_master, geometry, metadata=settings.mooncake_metadata,
                   protocol=settings.mooncake_protocol, segment_bytes=settings.mooncake_segment_bytes,
                   local_hostname=settings.mooncake_local_hostname)

    def _connect(self) -> Any:
        """A client set up against the master, with the header arena and every registered region.

        Mooncake's setup retries an absent master for ~90 s (20 tries) and does not notice one that comes up
        meanwhile, so the master's port is tried first: no listener, no setup (TierUnavailable at once)."""
        host, port = _host_port(self.master) or ("", 0)
        try:
            socket.create_connection((host, port), timeout=2.0).close()
        except OSError as e:
            raise TierUnavailable("connect", f"master {self.master} does not answer: {e.strerror or e}") from None
        store = self._cls()
        rc = store.setup(self.local_hostname, self.metadata, self.segment_bytes, 0, self.protocol,
                         self._rdma_devices, self.master)
        if rc != 0:
            store.close()
            raise TierUnavailable("setup", f"setup against master {self.master} returned {rc}")
        for address, nbytes in [(self._headers.address, self._headers.nbytes), *self._regions]:
            rc = store.register_buffer(address, nbytes)
            if rc != 0:
                store.close()
                raise TierUnavailable("register", f"register_buffer of {format_bytes(nbytes)} returned {rc}")
        return store

    def _client(self) -> Any:
        with self._lock:
            if self._closed or self._store is None:
                raise TierUnavailable(DOWN, "the Mooncake client is closed")
            return self._store

    # ------------------------------------------------------------------ TierBackend

    @property
    def connected(self) -> bool:
        with self._lock:
            return self._store is not None

    def register(self, regions: Sequence[tuple[int, int]]) -> None:
        with self._lock:
            store = self._store
            self._regions.extend(regions)
        if store is None:
            return  # registered at connection
        for address, nbytes in regions:
            rc = store.register_buffer(address, nbytes)
            if rc != 0:
                raise TierConfigError(f"--tier mooncake: cannot register {format_bytes(nbytes)} of pool memory "
                                      f"with the store (register_buffer returned {rc})")

    def exists(self, runs: Sequence[Sequence[bytes]]) -> list[int]:
        flat = [key_text(k) for run in runs for k in run]
        if not flat:
            return [0] * len(runs)
        codes = self._client().batch_is_exist(flat)
        if len(codes) != len(flat) or codes[0] < 0:
            raise TierUnavailable("rpc", f"batch_is_exist returned {codes[0] if codes else 'nothing'}")
        found: list[int] = []
        start = 0
        for run in runs:  # a key the store could not answer for (code < 0) ends its run like a missing one
            n = 0
            while n < len(run) and codes[start + n] == 1:
                n += 1
            found.append(n)
            start += len(run)
        return found

    def put(self, items: Sequence[PutItem]) -> list[str]:
        if not items:
            return []
        store = self._client()
        slots = self._headers.take(min(len(items), self.pages_per_call))
        try:
            out: list[str] = []
            for start in range(0, len(items), len(slots)):
                out += self._put(store, items[start:start + len(slots)], slots)
            self._watch([i.key for i, reason in zip(items, out, strict=True) if not reason])
            return out
        finally:
            self._headers.give(slots)

    def _put(self, store: Any, items: Sequence[PutItem], slots: Sequence[int]) -> list[str]:
        sizes = [HEADER_BYTES] + [self.geometry.chunk_bytes] * self.geometry.num_chunks
        ptrs: list[list[int]] = []
        for item, slot in zip(items, slots, strict=False):
            self._headers.view(slot)[:] = item.header
            ptrs.append([self._headers.addr(slot), *item.buffers.addresses])
        codes = store.batch_put_from_multi_buffers([key_text(i.key) for i in items], ptrs, [sizes] * len(items))
        if codes and all(c in _RPC for c in codes):
            raise TierUnavailable("rpc", f"batch_put_from_multi_buffers returned {codes[0]}")
        return [_put_reason(c) for c in codes]

    def get(self, items: Sequence[GetItem]) -> list[GetResult]:
        if not items:
            return []
        store = self._client()
        slots = self._headers.take(min(len(items), self.pages_per_call))
        try:
            out: list[GetResult] = []
            for start in range(0, len(items), len(slots)):
                out += self._get(store, items[start:start + len(slots)], slots)
            self._watch([i.key for i, r in zip(items, out, strict=True) if not r.reason])
            self._unwatch([i.key for i, r in zip(items, out, strict=True) if r.reason == MISSING], gone=True)
            return out
        finally:
            self._headers.give(slots)

    def _get(self, store: Any, items: Sequence[GetItem], slots: Sequence[int]) -> list[GetResult]:
        sizes = [HEADER_BYTES] + [self.geometry.chunk_bytes] * self.geometry.num_chunks
        ptrs = [[self._headers.addr(slot), *item.buffers.addresses] for item, slot in zip(items, slots, strict=False)]
        codes = store.batch_get_into_multi_buffers([key_text(i.key) for i in items], ptrs, [sizes] * len(items))
        if codes and all(c in _RPC for c in codes):
            raise TierUnavailable("rpc", f"batch_get_into_multi_buffers returned {codes[0]}")
        value_bytes = self.geometry.value_bytes
        out: list[GetResult] = []
        for code, slot in zip(codes, slots, strict=False):
            if code == value_bytes:
                out.append(GetResult("", bytes(self._headers.view(slot))))
            elif code > 0:
                out.append(GetResult(SHORT, b""))
            else:
                out.append(GetResult(_get_reason(code), b""))
        return out

    def take_dropped(self) -> list[bytes]:
        """Watched keys a get found missing, and those a sweep (when due) finds gone (module docstring)."""
        with self._watch_lock:
            gone, self._gone = self._gone, []
            now = time.monotonic()
            if now < self._next_sweep or not self._watched:
                return gone
            self._next_sweep = now + SWEEP_SECONDS
            batch: list[bytes] = []
            while self._watched and len(batch) < SWEEP_KEYS:
                batch.append(self._watched.popitem(last=False)[0])
        codes: list[int] = []
        try:
            codes = list(self._client().batch_is_exist([key_text(k) for k in batch]))
        except Exception:  # the store is down or closing: ask again at the next sweep
            codes = []
        answered = len(codes) == len(batch)
        with self._watch_lock:
            for key, code in zip(batch, codes if answered else [1] * len(batch), strict=True):
                if code == 0:
                    gone.append(key)
                elif key not in self._watched:  # a get or put may have watched it again meanwhile
                    self._watched[key] = None
        return gone

    def _watch(self, keys: Sequence[bytes]) -> None:
        if not keys:
            return
        with self._watch_lock:
            for k in keys:
                self._watched[k] = None
                self._watched.move_to_end(k)
            while len(self._watched) > WATCH_KEYS:
                self._watched.popitem(last=False)

    def _unwatch(self, keys: Sequence[bytes], *, gone: bool) -> None:
        if not keys:
            return
        with self._watch_lock:
            for k in keys:
                if self._watched.pop(k, 0) is None and gone:
                    self._gone.append(k)

    def discard(self, keys: Sequence[bytes]) -> None:
        if keys:
            self._unwatch(keys, gone=False)  # the caller announces the drop of what it discards
            self._client().batch_remove([key_text(k) for k in keys], force=True)

    def probe(self) -> None:
        code = self._client().batch_is_exist([key_text(PROBE_KEY)])[0]
        if code < 0:
            raise TierUnavailable("rpc", f"batch_is_exist returned {code}")

    def reconnect(self) -> None:
        with self._lock:
            if self._closed:
                raise TierUnavailable(DOWN, "the Mooncake client is closed")
            old, self._store = self._store, None
        if old is not None:
            old.close()
        store = self._connect()
        with self._lock:
            if self._closed:
                store.close()
                raise TierUnavailable(DOWN, "the Mooncake client is closed")
            self._store = store

    def usage(self) -> Usage:
        return Usage(values=None, bytes=None, capacity_bytes=None)

    def describe(self) -> str:
        segment = (f"contributes a {format_bytes(self.segment_bytes)} segment" if self.segment_bytes
                   else "contributes no memory")
        return (f"mooncake master {self.master} ({self.protocol}, metadata {self.metadata}, announced as "
                f"{self.local_hostname}; {segment})")

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            store, self._store = self._store, None
        if store is not None:
            store.close()


def _put_reason(code: int) -> str:
    if code in (0, OBJECT_ALREADY_EXISTS):
        return ""
    if code == NO_AVAILABLE_HANDLE:
        return FULL
    if code in _RPC:
        return DOWN
    return ERROR


# Get failures after which the store cannot be writing into the buffers any more (refused before a
# transfer was submitted); any other failure may leave a transfer in flight.
_SAFE_GET_FAILURES = {OBJECT_NOT_FOUND: MISSING, REPLICA_IS_NOT_READY: MISSING, LEASE_EXPIRED: MISSING,
                      INVALID_PARAMS: WRONG_SIZE, RPC_FAIL: DOWN, RPC_TIMEOUT: DOWN}


def _get_reason(code: int) -> str:
    return _SAFE_GET_FAILURES.get(code, TAINTED)
