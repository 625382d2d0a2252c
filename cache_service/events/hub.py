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

The formats are wire.py's; the ZMQ sockets publisher.py's.
"""

from __future__ import annotations

import asyncio
import socket
import time
from collections import deque
from collections.abc import Callable, Iterator

from cache_service.core import KVCacheCore, SessionState
from cache_service.core.events import Cleared, Record, SessionChange
from cache_service.events.publisher import ZmqPublisher
from cache_service.events.wire import Batch, WireGroup, proto_event, wire_batch
from cache_service.log import get_logger
from protos.kvcache.v1 import kvcache_pb2 as pb

SNAPSHOT_CHUNK = 512
"""Events per WatchEvents snapshot message."""
HEARTBEAT_SECONDS = 1.0
"""An idle publisher sends an empty batch this often, so a subscriber that missed batches (it connected
late, or reconnected to a restarted service) sees the gap in `seq` and asks for a replay."""

Visible = Callable[[Record], bool]


def default_topic(model_name: str) -> str:
    return f"kv@{socket.gethostname()}@{model_name}"


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
        pages (parents before children; on a window pool each run followed by the window-rows-only removal of its
        pages without window rows), the opened sessions (each parked one followed by its `parked`).
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

