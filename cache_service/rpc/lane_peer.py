"""One peer of the step lane (step_lane.py; docs/design.md §10): its frames, deadlines and polling.

Frames are `kvcache_common.step_lane`'s: a hello, then STEP frames carrying the gRPC method's own request
bytes, each answered before the next is read. A Step runs through the handler the lane was given (the gRPC
server's wrapped `Step`), with a context that turns the handler's aborts into a REFUSED frame carrying the
google.rpc.Status the gRPC call would abort with.

Nothing of a peer without a valid hello is buffered or applied. A frame longer than the lane's
`max_message_bytes` is refused RESOURCE_EXHAUSTED and its connection closed unread; a frame that breaks the
protocol closes its connection with one logged reason and changes nothing. Deadlines (a hello, a frame once
begun, an answer the peer must read) are set here and enforced by the lane's sweeper.

Polling (the lane's `poll_seconds`, --step-socket-poll-us): after a read, a connection keeps reading its socket
for that long (yielding the core between tries) before the loop goes back to epoll, so the rest of a large frame
and a scheduler's next Step are taken without a wake-up; at most `POLL_LIMIT_SECONDS` in one read callback.
"""

from __future__ import annotations

import asyncio
import os
import socket
import struct
import time
from collections.abc import Callable, Coroutine
from typing import Any, Protocol

from google.rpc import code_pb2, status_pb2

from cache_service.core import KVCacheError, Reason
from cache_service.rpc.errors import status_proto
from cache_service.rpc.identity import Identities
from cache_service.rpc.interceptor import AUTH_HEADER, INSTANCE_HEADER
from cache_service.rpc.lane_call import Continue, LaneContext, Refused
from kvcache_common import step_lane as wire

_UCRED = struct.Struct("3i")
STAGE_BYTES = 64 << 10
"""A connection's staging buffer: a frame's header and the payload that comes with it in the same read."""
_STEP_ONLY = (wire.STEP,)
_HELLO_OR_STEP = (wire.HELLO, wire.STEP)
_NOT_READING = "not_reading"
_NOT_READING_MESSAGE = "the peer did not read its answer"
POLL_LIMIT_SECONDS = 1e-3
"""The longest one read callback keeps polling its connection (`_poll`), however many frames come in it: then
the event loop runs its other work (gRPC, other connections) before this connection is read again."""


class LaneHost(Protocol):
    """What a peer reads of its lane (`step_lane.StepLaneServer`): the bounds, the Step handler and its codec,
    the identities, the READY frame, the log, and the set of open peers it joins and leaves."""

    connections: set[LanePeer]
    max_connections: int
    max_message_bytes: int
    timeout_seconds: float
    poll_seconds: float
    identities: Identities
    ready: bytes
    log: Any
    decode: Callable[[Any], Any]
    handle: Callable[[Any, Any], Coroutine[Any, Any, Any]]
    encode: Callable[[Any], bytes]


class LanePeer(asyncio.BufferedProtocol):
    """One peer of the lane.

    A frame's first bytes are read into a fixed staging buffer (`STAGE_BYTES`), where a small frame arrives
    whole in one read; a larger payload continues straight into a bytearray of its length. While a Step runs
    and until its answer is written out, frames that arrive wait in the staging buffer, and the connection
    stops reading once any do: nothing more than one staging buffer and one frame is ever held. A Step that
    needs no I/O (every Step without a tier) runs to its answer inside the read callback; one that awaits
    continues as a task. Deadlines (the hello, a frame once begun, an answer the peer must read) are checked
    by the lane's sweeper, not by a timer per frame."""

    def __init__(self, lane: LaneHost) -> None:
        self._lane = lane
        self._loop = asyncio.get_running_loop()
        self._transport: asyncio.Transport | None = None
        self._peer: dict[str, int] = {}
        self._stage = bytearray(STAGE_BYTES)
        self._stage_view = memoryview(self._stage)
        self._have = 0
        """Bytes waiting in the staging buffer."""
        self._payload: bytearray | None = None
        """A payload being read straight into its buffer (None: reading into the staging buffer)."""
        self._got = 0
        """Bytes of `_payload` read so far."""
        self._payload_buffer = bytearray()
        """The buffer of the frame whose header was read last."""
        self._pin = 0
        self._metadata: tuple[tuple[str, Any], ...] = ()
        self._hello_done = False
        self._busy = False
        """A Step is running or its answer is being written: frames wait."""
        self._paused = False
        self._writing_paused = False
        self.deadline = 0.0
        """loop.time() by which the peer must have done `_due` (0: nothing is due)."""
        self._due = self._due_reason = ""
        self._closed = False
        self._fd = -1
        """The socket's descriptor, which `_poll` reads directly (non-blocking, as asyncio made it)."""
        self._polling = False

    # ------------------------------------------------------------------ the transport's callbacks

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self._transport = transport
        lane = self._lane
        sock = transport.get_extra_info("socket")
        pid, uid, gid = _UCRED.unpack(sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _UCRED.size))
        self._peer = {"peer_pid": pid, "peer_uid": uid, "peer_gid": gid}
        self._fd = sock.fileno()
        if len(lane.connections) >= lane.max_connections:
            self._close("too_many_connections", f"{len(lane.connections)} connections are open, the most "
                        "--step-socket-max-connections allows")
            return
        lane.connections.add(self)
        self._expect("a hello did not arrive whole")

    def get_buffer(self, sizehint: int) -> memoryview:
        payload = self._payload
        if payload is None:
            return self._stage_view[self._have:]
        return memoryview(payload)[self._got:]

    def buffer_updated(self, nbytes: int) -> None:
        self._take(nbytes)
        if self._lane.poll_seconds and not self._polling:
            self._poll()

    def _take(self, nbytes: int) -> None:
        """`nbytes` more were read into the buffer `get_buffer` gave: take the frames they complete."""
        if self._closed:
            return
        payload = self._payload
        if payload is not None:
            self._got += nbytes
            if self._got == len(payload):
                self._payload = None
                self._frame(payload)
                self._parse()
            return
        self._have += nbytes
        if self._busy:  # a frame before the answer to the last one: it waits, and so does the socket
            if not self._paused:
                self._paused = True
                assert self._transport is not None
                self._transport.pause_reading()
            return
        self._parse()

    def _poll(self) -> None:
        """Keep reading the socket for up to `poll_seconds` after a read, before going back to the event loop:
        the rest of a large frame, or the next Step of a peer that sends Steps back to back, is taken as it
        comes instead of after a wake-up through epoll (on this machine a wake-up of each process costs more
        than an empty Step's handler). Reads are non-blocking (the socket is asyncio's) and go through
        `get_buffer` / `_take` like the transport's own; each frame taken starts the window again, up to
        `POLL_LIMIT_SECONDS` in all. It stops while a Step is running or waiting to be read (`_busy`), when
        the connection closes, and at an error or the peer's end of stream, which are left to the transport
        to see on its next read (epoll still reports them)."""
        transport = self._transport
        assert transport is not None
        clock = time.perf_counter
        fd, window = self._fd, self._lane.poll_seconds
        now = clock()
        end, limit = now + window, now + POLL_LIMIT_SECONDS
        self._polling = True
        try:
            while not self._busy and not self._closed and not transport.is_closing():
                try:
                    n = os.readv(fd, (self.get_buffer(-1),))
                except (BlockingIOError, InterruptedError):
                    now = clock()
                    if now >= end or now >= limit:
                        return
                    os.sched_yield()  # a peer waiting for this core (the client, on a busy machine) runs first
                    continue
                except OSError:
                    return
                if not n:
                    return
                self._take(n)
                now = clock()
                end = min(now + window, limit)
        finally:
            self._polling = False

    def pause_writing(self) -> None:
        self._writing_paused = True

    def resume_writing(self) -> None:
        self._writing_paused = False
        if self._busy and self._due == _NOT_READING and not self._closed:
            self.deadline = 0.0
            self._due = ""
            self._busy = False
            self._resume()

    def eof_received(self) -> bool:
        return False  # close the transport

    def connection_lost(self, exc: Exception | None) -> None:
        if not self._closed:
            self._closed = True
            payload = self._payload
            if payload is not None or self._have:
                size, got = (len(payload), self._got) if payload is not None else (wire.HEADER_BYTES, self._have)
                part = "payload" if payload is not None else "header"
                self._lane.log.warning("step_lane_closed", reason="truncated", message=f"the peer closed the "
                                       f"connection inside a frame ({got} of the {size} bytes of its {part} read)",
                                       **self._peer)
            else:
                self._lane.log.info("step_lane_disconnected", **self._peer)
        self.deadline = 0.0
        self._lane.connections.discard(self)

    # ------------------------------------------------------------------ frames

    def _parse(self) -> None:
        """Take every whole frame the staging buffer holds, one at a time (a Step stops it until answered)."""
        stage = self._stage
        while not self._busy and not self._closed:
            have = self._have
            if have < wire.HEADER_BYTES:
                if have and not self.deadline:  # the first bytes of a frame: the rest must follow in time
                    self._expect("a frame did not arrive whole")
                return
            if not self._header():
                return
            length = len(self._payload_buffer)
            take = min(have - wire.HEADER_BYTES, length)
            payload = self._payload_buffer
            payload[:take] = self._stage_view[wire.HEADER_BYTES:wire.HEADER_BYTES + take]
            rest = have - wire.HEADER_BYTES - take
            if rest:
                stage[:rest] = stage[wire.HEADER_BYTES + take:have]
            self._have = rest
            if take < length:  # the rest of the payload is read straight into it
                self._payload, self._got = payload, take
                if not self.deadline:
                    self._expect("a frame did not arrive whole")
                return
            self._frame(payload)

    def _header(self) -> bool:
        """Check the staged header and make its payload's buffer; False: the connection is closed."""
        expect = _STEP_ONLY if self._hello_done else _HELLO_OR_STEP
        try:
            kind, pin, length = wire.parse_header(self._stage, expect=expect, max_length=self._lane.max_message_bytes)
        except wire.TooLarge as e:
            self._close("too_large", str(e), _status(code_pb2.RESOURCE_EXHAUSTED, str(e)))
            return False
        except wire.FrameError as e:
            self._close("bad_frame", str(e))
            return False
        if not self._hello_done:  # nothing of a peer without a hello is buffered, let alone applied
            if kind != wire.HELLO:
                self._no_hello()
                return False
            if length > wire.MAX_HELLO:
                self._close("bad_hello", f"a hello of {length} bytes (at most {wire.MAX_HELLO})")
                return False
        self._pin = pin
        self._payload_buffer = bytearray(length)
        return True

    def _frame(self, payload: bytearray) -> None:
        """A whole frame arrived: the hello, or a Step to run."""
        self.deadline = 0.0
        if not self._hello_done:
            self._hello(payload)
            return
        pin = self._pin
        metadata = self._metadata
        request: bytearray | memoryview = payload
        if pin:
            metadata = (*metadata, (INSTANCE_HEADER, payload[:pin].decode("ascii", "replace")))
            request = memoryview(payload)[pin:]
        self._busy = True
        lane = self._lane
        try:
            coro = lane.handle(lane.decode(request), LaneContext(metadata))
            awaited = coro.send(None)
        except StopIteration as done:
            response: Any = done.value
        except Refused as r:
            self._answer(wire.REFUSED, r.status)
            return
        except Exception:  # the handler maps every error to a status: this is the lane's own bug
            self._internal_error()
            return
        else:
            self._loop.create_task(self._finish(coro, awaited))
            return
        self._answer(wire.ANSWER, lane.encode(response))

    async def _finish(self, coro: Coroutine[Any, Any, Any], awaited: Any) -> None:
        """The rest of a Step that awaited (tier loads), on a task of its own; then the frames that waited."""
        lane = self._lane
        try:
            response = await Continue(coro, awaited)
        except Refused as r:
            self._answer(wire.REFUSED, r.status)
        except Exception:
            self._internal_error()
            return
        else:
            self._answer(wire.ANSWER, lane.encode(response))
        if not self._busy:
            self._resume()

    def _internal_error(self) -> None:
        self._lane.log.exception("step_lane_internal_error", **self._peer)
        self._close("internal", "the lane failed to answer a Step; see the traceback above")

    def _answer(self, kind: int, out: bytes) -> None:
        """Write the answer; the connection stays busy until the peer has taken it off the write buffer."""
        transport = self._transport
        if self._closed or transport is None:
            return
        transport.write(wire.header(kind, len(out)) + out)  # one write: one send
        if self._writing_paused:  # the peer is not reading: wait for it, but not for ever
            self._expect(_NOT_READING, reason="not_reading")
            return
        self._busy = False

    def _resume(self) -> None:
        """After an answer written outside the read callback: read again, and take the frames that waited."""
        if self._paused and not self._closed:
            self._paused = False
            assert self._transport is not None
            self._transport.resume_reading()
        self._parse()

    def _no_hello(self) -> None:
        """A first frame that is not a hello: refused as a call without a token is (BAD_TOKEN where tokens are
        configured), and the connection closed before its payload is read."""
        if not self._lane.identities.open:
            err = KVCacheError(Reason.BAD_TOKEN, "the first frame on the step lane must be a hello carrying the "
                               "bearer token")
        else:
            err = KVCacheError(Reason.INVALID_ARGUMENT, "the first frame on the step lane must be a hello",
                               field="hello")
        self._close("no_hello", err.message, status_proto(err).SerializeToString())

    def _hello(self, token: bytearray) -> None:
        lane = self._lane
        auth = b"Bearer " + token if token else b""
        try:
            lane.identities.resolve(auth)
        except KVCacheError as e:
            self._close("bad_token", e.message, status_proto(e).SerializeToString())
            return
        self._hello_done = True
        self._metadata = ((AUTH_HEADER, auth),) if auth else ()
        assert self._transport is not None
        self._transport.write(lane.ready)
        lane.log.info("step_lane_connected", **self._peer)

    # ------------------------------------------------------------------ deadlines and closing

    def _expect(self, what: str, reason: str = "timeout") -> None:
        self.deadline = self._loop.time() + self._lane.timeout_seconds
        self._due, self._due_reason = what, reason

    def expire(self) -> None:
        """The deadline passed (the lane's sweeper calls this)."""
        what = _NOT_READING_MESSAGE if self._due == _NOT_READING else self._due
        self._close(self._due_reason, f"{what} within {self._lane.timeout_seconds:g} s (--step-socket-timeout)")

    def _close(self, reason: str, message: str, reply: bytes = b"") -> None:
        """End the connection with one log line: `reason` (a short stable word) and `message`; `reply`, a
        status, is sent first as a REFUSED frame."""
        if self._closed:
            return
        self._closed = True
        self.deadline = 0.0
        self._lane.log.warning("step_lane_closed", reason=reason, message=message, **self._peer)
        self._lane.connections.discard(self)
        transport = self._transport
        assert transport is not None
        if reply:
            transport.write(wire.header(wire.REFUSED, len(reply)) + reply)
            transport.close()  # what is written goes out first
        else:
            transport.abort()

    def abort(self) -> None:
        self._closed = True
        self.deadline = 0.0
        if self._transport is not None:
            self._transport.abort()


def _status(code: int, message: str) -> bytes:
    return bytes(status_pb2.Status(code=code, message=message).SerializeToString())
