"""The step lane: `Step` over a unix-domain socket of the service (docs/design.md §10, `--step-socket`).

Frames are `kvcache_common.step_lane`'s: a hello, then STEP frames carrying the gRPC method's own request
bytes, each answered before the next is read. A Step that arrives here runs through the very handler the gRPC
server runs for `Step` (`ServiceInterceptor`'s wrapping of `KVCacheServicer.Step`: decoding, the instance pin,
the caller's identity from the hello's bearer token, `--max-step-ops`, refusals, metrics, logs); only the
transport differs. A request-level refusal comes back as the google.rpc.Status the gRPC call would abort with.

Who may connect: the socket file's mode (0600, or 0660 with `group`); with tokens configured, the first
frame's bearer token must resolve to an identity, or the connection gets BAD_TOKEN and is closed: nothing is
applied before a valid hello. Each connection's peer credentials (SO_PEERCRED) are logged when it opens and
closes.

Bounds: at most `max_connections` at once (more are closed at accept); a hello must arrive within
`timeout_seconds` of the connection, and each later frame within `timeout_seconds` of its first byte (a
connection may idle between frames); a frame longer than `max_message_bytes` is refused RESOURCE_EXHAUSTED
and its connection closed unread; an answer the peer does not read within `timeout_seconds` closes it. A
frame that breaks the protocol closes its connection with one logged reason and changes nothing.

Polling (`poll_seconds`, --step-socket-poll-us): after a read, a connection keeps reading its socket for that
long (yielding the core between tries) before the loop goes back to epoll, so the rest of a large frame and a
scheduler's next Step are taken without a wake-up; at most `POLL_LIMIT_SECONDS` in one read callback.
"""

from __future__ import annotations

import asyncio
import contextlib
import grp
import os
import socket
import struct
import time
from collections.abc import Coroutine, Generator
from typing import Any

import grpc
from google.rpc import code_pb2, status_pb2

from cache_service.core import KVCacheError, Reason
from cache_service.log import get_logger
from cache_service.rpc.errors import status_proto
from cache_service.rpc.identity import Identities
from cache_service.rpc.interceptor import AUTH_HEADER, INSTANCE_HEADER
from cache_service.rpc.server import claim_unix_path
from kvcache_common import step_lane as wire

_UCRED = struct.Struct("3i")
_STATUS_DETAILS_KEY = "grpc-status-details-bin"
STAGE_BYTES = 64 << 10
"""A connection's staging buffer: a frame's header and the payload that comes with it in the same read."""
_STEP_ONLY = (wire.STEP,)
_HELLO_OR_STEP = (wire.HELLO, wire.STEP)
_NOT_READING = "not_reading"
_NOT_READING_MESSAGE = "the peer did not read its answer"
POLL_LIMIT_SECONDS = 1e-3
"""The longest one read callback keeps polling its connection (`_poll`), however many frames come in it: then
the event loop runs its other work (gRPC, other connections) before this connection is read again."""


def parse_group(text: str) -> int | None:
    """--step-socket-group: "" -> None (the service's own group, mode 0600), else a group name or gid."""
    text = text.strip()
    if not text:
        return None
    if text.isdigit():
        return int(text)
    try:
        return grp.getgrnam(text).gr_gid
    except KeyError:
        raise ValueError(f"no group named {text!r} on this host") from None


class _Refused(Exception):
    """What the lane's context raises where a gRPC context would abort: the status to send back."""

    def __init__(self, status: bytes) -> None:
        self.status = status


class _LaneContext:
    """The part of a grpc.aio context the interceptor's wrapping uses: the call's metadata (the hello's bearer
    token and the frame's instance pin) and the two ways it aborts, which become a REFUSED frame."""

    __slots__ = ("metadata",)

    def __init__(self, metadata: tuple[tuple[str, Any], ...]) -> None:
        self.metadata = metadata

    def invocation_metadata(self) -> tuple[tuple[str, Any], ...]:
        return self.metadata

    async def abort_with_status(self, status: grpc.Status) -> None:
        for key, value in status.trailing_metadata or ():
            if key == _STATUS_DETAILS_KEY:
                raise _Refused(value)
        raise _Refused(status_pb2.Status(code=status.code.value[0], message=status.details).SerializeToString())

    async def abort(self, code: grpc.StatusCode, details: str) -> None:
        raise _Refused(status_pb2.Status(code=code.value[0], message=details).SerializeToString())


class _Continue:
    """Awaits the rest of a coroutine that was started by hand (`send(None)`) and suspended: what it awaited is
    handed to the task running this, and what the task sends or throws back goes on to the coroutine."""

    __slots__ = ("_coro", "_first")

    def __init__(self, coro: Coroutine[Any, Any, Any], first: Any) -> None:
        self._coro = coro
        self._first = first

    def __await__(self) -> Generator[Any, Any, Any]:
        coro, awaited = self._coro, self._first
        while True:
            try:
                sent = yield awaited
            except GeneratorExit:
                coro.close()
                raise
            except BaseException as e:  # a cancellation goes on to the coroutine, like any throw
                try:
                    awaited = coro.throw(e)
                except StopIteration as done:
                    return done.value
            else:
                try:
                    awaited = coro.send(sent)
                except StopIteration as done:
                    return done.value


class _Connection(asyncio.BufferedProtocol):
    """One peer of the lane.

    A frame's first bytes are read into a fixed staging buffer (`STAGE_BYTES`), where a small frame arrives
    whole in one read; a larger payload continues straight into a bytearray of its length. While a Step runs
    and until its answer is written out, frames that arrive wait in the staging buffer, and the connection
    stops reading once any do: nothing more than one staging buffer and one frame is ever held. A Step that
    needs no I/O (every Step without a tier) runs to its answer inside the read callback; one that awaits
    continues as a task. Deadlines (the hello, a frame once begun, an answer the peer must read) are checked
    by the lane's sweeper, not by a timer per frame."""

    def __init__(self, lane: StepLaneServer) -> None:
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
            coro = lane.handle(lane.decode(request), _LaneContext(metadata))
            awaited = coro.send(None)
        except StopIteration as done:
            response: Any = done.value
        except _Refused as r:
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
            response = await _Continue(coro, awaited)
        except _Refused as r:
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


class StepLaneServer:
    """Serves `step` (the gRPC server's wrapped Step method handler) on the unix socket `path`, on the running
    event loop. `start()`, then `close()`."""

    def __init__(self, path: str, step: grpc.RpcMethodHandler, *, identities: Identities, instance_id: str,
                 max_message_bytes: int, group: int | None = None, max_connections: int = 64,
                 timeout_seconds: float = 5.0, poll_seconds: float = 0.0) -> None:
        self.path = path
        self.group = group
        self.max_connections = max_connections
        self.timeout_seconds = timeout_seconds
        self.poll_seconds = poll_seconds
        """How long a connection keeps reading its socket after a read before it returns to epoll (`_poll`;
        0: never)."""
        self.max_message_bytes = max_message_bytes
        self.decode = step.request_deserializer
        self.handle = step.unary_unary
        self.encode = step.response_serializer
        self.identities = identities
        self.ready = wire.header(wire.READY, len(instance_id)) + instance_id.encode()
        self.connections: set[_Connection] = set()
        self.log = get_logger("kvcache.step_lane")
        self.removed_stale_socket = ""
        self._server: asyncio.AbstractServer | None = None
        self._sweeper: asyncio.Task[None] | None = None

    async def start(self) -> None:
        """Bind `path` (mode 0600, or 0660 owned by `group`; a stale socket file is replaced, a live one
        refused with OSError naming the path) and accept connections."""
        self.removed_stale_socket = claim_unix_path(self.path, f"serve the step lane on {self.path}")
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
        try:
            old = os.umask(0o177)  # the socket file is 0600 from the moment it exists
            try:
                sock.bind(self.path)
            finally:
                os.umask(old)
            if self.group is not None:
                os.chown(self.path, -1, self.group)
                os.chmod(self.path, 0o660)
            sock.listen(max(16, self.max_connections))
        except OSError as e:
            sock.close()
            with contextlib.suppress(OSError):
                os.unlink(self.path)
            raise OSError(f"cannot serve the step lane on {self.path}: {e.strerror or e}") from None
        loop = asyncio.get_running_loop()
        self._server = await loop.create_unix_server(lambda: _Connection(self), sock=sock)
        self._sweeper = loop.create_task(self._sweep(), name="kvcache-step-lane-sweeper")

    async def _sweep(self) -> None:
        """Close the connections whose deadline passed; looks a quarter of the timeout apart, so a deadline is
        enforced between 1 and 1.25 timeouts after it was set."""
        loop = asyncio.get_running_loop()
        while True:
            await asyncio.sleep(self.timeout_seconds / 4)
            now = loop.time()
            for connection in [c for c in self.connections if c.deadline and c.deadline <= now]:
                connection.expire()

    async def close(self) -> None:
        """Stop accepting, end every connection, remove the socket file."""
        if self._sweeper is not None:
            self._sweeper.cancel()
            self._sweeper = None
        if self._server is not None:
            self._server.close()
            self._server = None
        for connection in list(self.connections):
            connection.abort()
        self.connections.clear()
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)


def _status(code: int, message: str) -> bytes:
    return bytes(status_pb2.Status(code=code, message=message).SerializeToString())
