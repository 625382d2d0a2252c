"""KV events for routers: the core's change feed, numbered, buffered, and published two ways.

`EventHub` drains the core's change records (`KVCacheCore.take_events`) once per event-loop iteration (the
interceptor and the reaper `poke` it after each call; when records are waiting it schedules one `flush`),
numbers each batch (`seq`, upward across restarts: the first is
the clock in microseconds), keeps the last --kv-events-buffer batches, and hands each to:

- `ZmqPublisher`, in vLLM's wire format (what Dynamo's and llm-d's indexers read): frames
  `[topic, seq as 8 bytes big-endian, payload]`, payload a msgpack array `[ts, events, dp_rank]`, each event
  a msgpack map with a `type`; a ROUTER socket replays buffered batches on request. Sends never block: a
  subscriber that cannot keep up loses batches (ZMQ's high-water mark) and asks for a replay when it sees
  the gap in `seq`.
- `WatchEvents` watchers (the gRPC stream), whose queues are bounded too: a watcher that falls more than a
  buffer behind gets a fresh snapshot instead of the batches it missed.

Media: the pool's pages are announced with medium GPU or CPU (the pool's memory), the pages the tier holds
(records with `tier` set: stored, staged at eviction, loaded from it) with the tier's medium, DISK for the disk
tier and EXTERNAL for Mooncake Store (SGLang's names; Dynamo 1.6.1 counts both in its `disk` tier and drops
media it does not know, such as MOONCAKE), and removed from it when the tier drops them. A page in the pool and
in the tier is announced under both media with the same hash. Snapshots (WatchEvents, a replay older than the
buffer) carry the pool's pages only.

Cache salts in the ZMQ format: vLLM's events have no salt field, and Dynamo's indexer (1.6.1) merges pages
whose token ids match whatever `extra_keys` say, so a salted page is announced with `lora_name`
"cache_salt:<salt>" (a LoRA name is part of the block identity for Dynamo and llm-d): a router finds it only
when it asks with that name, never for a request of another salt or of none. Unsalted pages have no
`lora_name`. Session changes are WatchEvents-only (vLLM's format has no such event).

Layer groups in the ZMQ format: a pool of several groups (full attention and a sliding window on some layers)
announces each stored page once per group, as vLLM's hybrid KV cache manager does: `group_idx` (the group's
place in GetPoolInfo's `groups`), `kv_cache_spec_kind` ("full_attention", "sliding_window") and, for a window
group, `kv_cache_spec_sliding_window`; a removed page once per group with its `group_idx`. Where a pool keeps
its window rows apart (docs/design.md §13), a page whose window rows alone were freed is removed from the window
group only (its full-attention rows stay): one `BlockRemoved` with the window group's `group_idx` (WatchEvents:
`window_rows_only`). A one-group pool's
events have no group fields, as before groups. WatchEvents announces each page once: its groups are the
pool's (GetPoolInfo).
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import msgpack

from cache_service.core import KVCacheCore, SessionState
from cache_service.core.events import Cleared, Record, Removed, SessionChange, Stored
from cache_service.log import get_logger
from kvcache_common.layout import PoolLayout
from protos.kvcache.v1 import kvcache_pb2 as pb

CLOSE_REASONS = {
    "": pb.SESSION_CLOSE_REASON_UNSPECIFIED,
    "client": pb.SESSION_CLOSE_REASON_CLIENT,
    "timeout": pb.SESSION_CLOSE_REASON_TIMEOUT,
    "lease_ended": pb.SESSION_CLOSE_REASON_LEASE_ENDED,
    "parked_timeout": pb.SESSION_CLOSE_REASON_PARKED_TIMEOUT,
}
"""The core's close reasons (core.events.CLOSE_REASONS) on the wire."""
SALT_LORA_PREFIX = "cache_salt:"
END_SEQ = (-1).to_bytes(8, "big", signed=True)
"""The replay end marker's seq frame."""
SNAPSHOT_CHUNK = 512
"""Events per WatchEvents snapshot message."""
HEARTBEAT_SECONDS = 1.0
"""An idle publisher sends an empty batch this often, so a subscriber that missed batches (it connected
late, or reconnected to a restarted service) sees the gap in `seq` and asks for a replay."""

Visible = Callable[[Record], bool]


def default_topic(model_name: str) -> str:
    return f"kv@{socket.gethostname()}@{model_name}"


def lora_name_for(cache_salt: str) -> str | None:
    return SALT_LORA_PREFIX + cache_salt if cache_salt else None


# ----------------------------------------------------------------------------------------- wire format

SPEC_KINDS = {"full": "full_attention", "mla": "mla_attention", "sliding_window": "sliding_window"}
"""A layer group's kind (`kvcache_common.layout.GROUP_KINDS`) as vLLM's `kv_cache_spec_kind` names it."""


@dataclass(frozen=True, slots=True)
class WireGroup:
    """What vLLM's events say of a KV cache group: `kv_cache_spec_kind` and `kv_cache_spec_sliding_window`."""

    kind: str
    sliding_window: int | None = None


def wire_groups(layout: PoolLayout) -> tuple[WireGroup, ...]:
    """The pool's layer groups as its events name them, in GetPoolInfo's order; () for a one-group pool (its
    events carry no group fields)."""
    groups = layout.groups
    if len(groups) == 1:
        return ()
    return tuple(WireGroup(SPEC_KINDS[g.kind], g.sliding_window or None) for g in groups)


def wire_event(record: Record, medium: str, page_size: int, tier_medium: str = "") -> dict[str, Any] | None:
    """One record as a vLLM KV event map (None for records vLLM's format has no event for). `medium` is the
    pool's, `tier_medium` the tier's (for records with `tier` set)."""
    if isinstance(record, Stored | Removed) and record.tier:
        medium = tier_medium
    if isinstance(record, Stored):
        return {"type": "BlockStored", "block_hashes": record.hashes, "parent_block_hash": record.parent_hash,
                "token_ids": record.token_ids.tolist(), "block_size": page_size, "lora_id": None,
                "medium": medium, "lora_name": lora_name_for(record.cache_salt)}
    if isinstance(record, Removed):
        return {"type": "BlockRemoved", "block_hashes": record.hashes, "medium": medium}
    if isinstance(record, Cleared):
        return {"type": "AllBlocksCleared"}
    return None


def wire_events(record: Record, medium: str, page_size: int, tier_medium: str = "",
                groups: tuple[WireGroup, ...] = ()) -> list[dict[str, Any]]:
    """A record's vLLM KV event maps: `wire_event`'s, or with `groups` one stored (removed) event per group,
    each naming its group as vLLM's hybrid manager does (vLLM's field order; None fields left out as its
    encoder leaves them out)."""
    event = wire_event(record, medium, page_size, tier_medium)
    if event is None:
        return []
    if not groups or isinstance(record, Cleared):
        return [event]
    if isinstance(record, Removed):  # only the window rows left: the window groups' events only
        return [{**event, "group_idx": i} for i, g in enumerate(groups)
                if not record.window or g.kind == "sliding_window"]
    return [{**event, "group_idx": i, "kv_cache_spec_kind": g.kind,
             **({"kv_cache_spec_sliding_window": g.sliding_window} if g.sliding_window else {})}
            for i, g in enumerate(groups)]


def wire_batch(ts: float, records: Iterable[Record], medium: str, page_size: int, dp_rank: int = 0,
               tier_medium: str = "", groups: tuple[WireGroup, ...] = ()) -> bytes:
    """The msgpack payload of one batch: `[ts, [event maps...], dp_rank]` (always three elements); `groups`:
    the pool's (`wire_groups`)."""
    events = [e for r in records for e in wire_events(r, medium, page_size, tier_medium, groups)]
    payload: bytes = msgpack.packb([ts, events, dp_rank], use_bin_type=True)
    return payload


# ----------------------------------------------------------------------------------------- protobuf


def proto_event(record: Record, medium: str, page_size: int, tier_medium: str = "") -> pb.KvEvent:
    if isinstance(record, Stored | Removed) and record.tier:
        medium = tier_medium
    if isinstance(record, Stored):
        stored = pb.BlockStored(block_hashes=record.hashes, token_ids=record.token_ids.tolist(),
                                block_size=page_size, medium=medium, cache_salt=record.cache_salt)
        if record.parent_hash is not None:
            stored.parent_block_hash = record.parent_hash
        return pb.KvEvent(stored=stored)
    if isinstance(record, Removed):
        return pb.KvEvent(removed=pb.BlockRemoved(block_hashes=record.hashes, medium=medium,
                                                  cache_salt=record.cache_salt, window_rows_only=record.window))
    if isinstance(record, Cleared):
        return pb.KvEvent(cleared=pb.AllBlocksCleared())
    if record.kind == "opened":
        return pb.KvEvent(session_opened=pb.SessionOpened(
            session_id=record.session_id, epoch=record.epoch, streaming=record.streaming,
            cache_salt=record.cache_salt, engine_id=record.engine_id, parent_session_id=record.parent_session_id))
    if record.kind == "closed":
        return pb.KvEvent(session_closed=pb.SessionClosed(session_id=record.session_id, epoch=record.epoch,
                                                          reason=CLOSE_REASONS[record.reason]))
    if record.kind == "parked":
        return pb.KvEvent(session_parked=pb.SessionParked(session_id=record.session_id, epoch=record.epoch,
                                                          former_engine_id=record.engine_id))
    if record.kind == "adopted":
        return pb.KvEvent(session_adopted=pb.SessionAdopted(session_id=record.session_id, epoch=record.epoch,
                                                            engine_id=record.engine_id))
    return pb.KvEvent(session_demoted=pb.SessionDemoted(session_id=record.session_id, epoch=record.epoch))


# ----------------------------------------------------------------------------------------- the hub


@dataclass(frozen=True, slots=True)
class Batch:
    seq: int
    ts: float
    records: list[Record]
    payload: bytes | None
    """The ZMQ payload (None when no publisher is configured)."""


class Watcher:
    """One WatchEvents stream's queue of batches; bounded: an overflow empties it and asks for a snapshot."""

    def __init__(self, limit: int) -> None:
        self._limit = limit
        self._queue: deque[Batch] = deque()
        self._ready = asyncio.Event()
        self.lagged = False

    def push(self, batch: Batch) -> None:
        if len(self._queue) >= self._limit:
            self._queue.clear()
            self.lagged = True
        else:
            self._queue.append(batch)
        self._ready.set()

    def clear(self) -> None:
        self._queue.clear()
        self.lagged = False

    async def next(self) -> Batch | None:
        """The next batch, or None when the watcher lagged (it needs a snapshot)."""
        while not self._queue and not self.lagged:
            self._ready.clear()
            await self._ready.wait()
        if self.lagged:
            self.lagged = False
            return None
        return self._queue.popleft()


class EventHub:
    """Numbers, buffers and fans out the core's change feed (see the module doc)."""

    def __init__(self, core: KVCacheCore, *, instance_id: str, medium: str, buffer: int,
                 publisher: ZmqPublisher | None = None, clock: Callable[[], float] = time.time,
                 tier_medium: str = "", groups: tuple[WireGroup, ...] = ()) -> None:
        """`medium`: the pool's (GPU or CPU); `tier_medium`: the tier's (DISK, EXTERNAL), for its records;
        `groups`: the pool's layer groups as the ZMQ events name them (`wire_groups`)."""
        self.core = core
        self.groups = groups
        self.instance_id = instance_id
        self.medium = medium
        self.tier_medium = tier_medium
        self.page_size = core.page_size
        self.publisher = publisher
        self._clock = clock
        self._next_seq = time.time_ns() // 1000
        self._ring: deque[Batch] = deque(maxlen=buffer)
        self._buffer = buffer
        self._watchers: set[Watcher] = set()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._scheduled = False
        self._heartbeat: asyncio.Task[None] | None = None
        self._last_publish = 0.0
        self.batches = 0
        self.events: dict[str, int] = {"stored": 0, "removed": 0, "cleared": 0, "session": 0}
        self._log = get_logger("kvcache.events")

    # ------------------------------------------------------------------ lifecycle

    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        """Hook the feed; with a ZMQ publisher, record from now on, announce AllBlocksCleared first (a
        router forgets what an earlier instance at this address announced), and keep idle subscribers
        informed with heartbeats."""
        self._loop = loop
        if self.publisher is not None:
            self.core.start_events()
            self.core.record_cleared()
            self.flush()
            self._heartbeat = loop.create_task(self._beat(), name="kvcache-kv-heartbeat")

    async def _beat(self) -> None:
        while True:
            await asyncio.sleep(HEARTBEAT_SECONDS)
            if self._clock() - self._last_publish >= HEARTBEAT_SECONDS:
                self.flush(heartbeat=True)

    def ensure_recording(self) -> None:
        """A watcher arrived: record from now on (hashing what the tree holds already)."""
        self.core.start_events()

    def close(self) -> None:
        if self._heartbeat is not None:
            self._heartbeat.cancel()
            self._heartbeat = None
        self.flush()
        self._loop = None
        if self.publisher is not None:
            self.publisher.close()

    # ------------------------------------------------------------------ batches

    @property
    def last_seq(self) -> int:
        """The seq of the last batch published (one below the first seq when none was)."""
        return self._next_seq - 1

    @property
    def watchers(self) -> int:
        return len(self._watchers)

    @property
    def dropped(self) -> int:
        """Batches the ZMQ publisher could not send."""
        return self.publisher.dropped if self.publisher is not None else 0

    def poke(self) -> None:
        """A call may have changed the cache: when records are waiting, flush them once this event-loop
        iteration is done (one batch for all the calls it served)."""
        if not self._scheduled and self._loop is not None and self.core.pending_events():
            self._scheduled = True
            self._loop.call_soon(self.flush)

    def flush(self, *, heartbeat: bool = False) -> None:
        """Publish what the feed recorded since the last flush as one batch (a `heartbeat` goes out even
        when empty, to ZMQ only)."""
        self._scheduled = False
        records = self.core.take_events()
        if not records and not heartbeat:
            return
        seq = self._next_seq
        self._next_seq += 1
        ts = self._clock()
        payload = None
        if self.publisher is not None:
            payload = wire_batch(ts, records, self.medium, self.page_size, tier_medium=self.tier_medium,
                                 groups=self.groups)
            self.publisher.publish(seq, payload)
        self._last_publish = ts
        batch = Batch(seq, ts, records, payload)
        self._ring.append(batch)
        self.batches += 1
        for r in records:
            self.events[_COUNTER[type(r).__name__]] += 1
        if records:
            for w in self._watchers:
                w.push(batch)

    def replay(self, start: int) -> Iterator[Batch]:
        """Buffered batches with seq >= start, oldest first."""
        return (b for b in list(self._ring) if b.seq >= start)

    def holds(self, seq: int) -> bool:
        """The buffer can resume at `seq`: it holds that batch, or `seq` is the next one."""
        first = self._ring[0].seq if self._ring else self._next_seq
        return first <= seq <= self._next_seq

    # ------------------------------------------------------------------ watchers

    def watch(self) -> Watcher:
        w = Watcher(self._buffer)
        self._watchers.add(w)
        return w

    def unwatch(self, w: Watcher) -> None:
        self._watchers.discard(w)

    def snapshot(self, visible: Visible | None) -> list[pb.WatchEventsResponse]:
        """The current tree and open sessions as snapshot messages at `last_seq`: `cleared`, the stored
        pages (parents before children), the opened sessions (each parked one followed by its `parked`).
        Call right after `flush` so the live batches that follow continue from it."""
        records: list[Record] = [Cleared(), *self.core.event_snapshot()]
        for info in self.core.list_sessions():
            records.append(SessionChange("opened", info.session_id, info.epoch, info.cache_salt, info.streaming,
                                         info.engine_id, info.identity, "", info.parent_session_id))
            if info.state is SessionState.PARKED:
                records.append(SessionChange("parked", info.session_id, info.epoch, info.cache_salt, info.streaming,
                                             info.former_engine_id, info.identity))
        events = [proto_event(r, self.medium, self.page_size, self.tier_medium) for r in records
                  if visible is None or visible(r)]
        ts = self._clock()
        chunks = [events[i : i + SNAPSHOT_CHUNK] for i in range(0, len(events), SNAPSHOT_CHUNK)] or [[]]
        return [pb.WatchEventsResponse(seq=self.last_seq, ts=ts, instance_id=self.instance_id, snapshot=True,
                                       events=chunk) for chunk in chunks]

    def message(self, batch: Batch, visible: Visible | None) -> pb.WatchEventsResponse:
        events = [proto_event(r, self.medium, self.page_size, self.tier_medium) for r in batch.records
                  if visible is None or visible(r)]
        return pb.WatchEventsResponse(seq=batch.seq, ts=batch.ts, instance_id=self.instance_id, events=events)


_COUNTER = {"Stored": "stored", "Removed": "removed", "Cleared": "cleared", "SessionChange": "session"}


# ----------------------------------------------------------------------------------------- ZMQ


def _zmq_bind_address(endpoint: str) -> str:
    """tcp://host:0 asks ZMQ for a free port (its spelling is host:*)."""
    if endpoint.startswith("tcp://") and endpoint.endswith(":0"):
        return endpoint[:-2] + ":*"
    return endpoint


class ZmqPublisher:
    """A PUB socket (and optionally a ROUTER for replays) bound at start. `endpoint` and
    `replay_endpoint` are the bound addresses (the real port when port 0 was asked)."""

    def __init__(self, endpoint: str, replay_endpoint: str, topic: str, *, hwm: int = 100_000) -> None:
        import zmq
        import zmq.asyncio

        self._zmq = zmq
        self.topic = topic.encode()
        self._ctx = zmq.asyncio.Context()
        self._pub = self._ctx.socket(zmq.PUB)
        self._pub.setsockopt(zmq.SNDHWM, hwm)
        self._pub.setsockopt(zmq.LINGER, 500)
        self._router: Any = None
        self._task: asyncio.Task[None] | None = None
        self.dropped = 0
        self.replays = 0
        try:
            self._pub.bind(_zmq_bind_address(endpoint))
            self.endpoint = self._pub.getsockopt_string(zmq.LAST_ENDPOINT)
            self.replay_endpoint = ""
            if replay_endpoint:
                self._router = self._ctx.socket(zmq.ROUTER)
                self._router.setsockopt(zmq.LINGER, 0)
                self._router.setsockopt(zmq.SNDHWM, hwm)
                self._router.bind(_zmq_bind_address(replay_endpoint))
                self.replay_endpoint = self._router.getsockopt_string(zmq.LAST_ENDPOINT)
        except zmq.ZMQError as e:
            self.close()
            raise OSError(f"cannot bind KV events endpoint: {e}") from None

    def publish(self, seq: int, payload: bytes) -> None:
        """Send without blocking; a batch the high-water mark refuses is dropped (a subscriber replays it)."""
        try:
            self._pub.send_multipart([self.topic, seq.to_bytes(8, "big"), payload], flags=self._zmq.NOBLOCK)
        except self._zmq.Again:
            self.dropped += 1

    def serve_replay(self, hub: EventHub) -> None:
        if self._router is not None:
            self._task = asyncio.get_running_loop().create_task(self._replay_loop(hub), name="kvcache-kv-replay")

    async def _replay_loop(self, hub: EventHub) -> None:
        """Answer `[identity, "", start_seq]` (REQ) or `[identity, start_seq]` (DEALER) with every buffered
        batch from start_seq, `[identity, "", topic, seq, payload]`, then `[identity, "", "", -1, ""]`."""
        zmq = self._zmq
        log = get_logger("kvcache.events")
        while True:
            frames = await self._router.recv_multipart()
            if len(frames) < 2 or len(frames[-1]) != 8:
                log.warning("kv_events_bad_replay_request", frames=len(frames))
                continue
            identity, start = frames[0], int.from_bytes(frames[-1], "big")
            self.replays += 1
            try:
                for batch in hub.replay(start):
                    if batch.payload is not None:
                        self._router.send_multipart([identity, b"", self.topic, batch.seq.to_bytes(8, "big"),
                                                     batch.payload], flags=zmq.NOBLOCK)
                self._router.send_multipart([identity, b"", b"", END_SEQ, b""], flags=zmq.NOBLOCK)
            except zmq.Again:
                log.warning("kv_events_replay_dropped", start_seq=start)

    def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            self._task = None
        for sock in (self._pub, self._router):
            if sock is not None:
                with contextlib.suppress(Exception):
                    sock.close()
        self._ctx.term()
