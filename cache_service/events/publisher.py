"""The ZMQ side of KV events: a PUB socket that sends each batch as frames `[topic, seq as 8 bytes big-endian,
payload]` (payload: wire.py's msgpack batch) without ever blocking, and a ROUTER socket that replays the
batches the hub still buffers to a subscriber that saw a gap in `seq`."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable, Iterable
from typing import Any

from cache_service.events.wire import Batch
from cache_service.log import get_logger

END_SEQ = (-1).to_bytes(8, "big", signed=True)
"""The replay end marker's seq frame."""


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

    def serve_replay(self, replay: Callable[[int], Iterable[Batch]]) -> None:
        """Answer replay requests with `replay(start_seq)` (`EventHub.replay`: the buffered batches from it)."""
        if self._router is not None:
            self._task = asyncio.get_running_loop().create_task(self._replay_loop(replay), name="kvcache-kv-replay")

    async def _replay_loop(self, replay: Callable[[int], Iterable[Batch]]) -> None:
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
                for batch in replay(start):
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
