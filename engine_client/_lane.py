"""The step lane from the engine's side: `Step` over the service's unix socket (docs/design.md §10).

The clients' `step` takes the lane when the service announces one (`GetPoolInfo.step_socket`) and this
process can open it, else gRPC; callers see no difference. `LaneChoice` keeps that decision for a client:
the announced path (learnt from the first GetPoolInfo answer, asked for once if nothing asked before), the
connection, and when to try connecting again after a connect failed (until then Steps go over gRPC).

A connection says hello once (the client's bearer token) and then carries one Step at a time: the request's
bytes as the clients build them for gRPC, with the instance id the client pins, and answers the
StepResponse bytes, or the google.rpc.Status of a refused call, raised as the same typed error gRPC's would
be. A connection that breaks or outlives the call's deadline mid-call raises `StepLaneBroken` and is closed;
the next call connects again (or, when that fails, goes over gRPC). The sync lane polls briefly for each
answer before it blocks (`ClientOptions.step_lane_poll_us`); the asyncio lane likewise before it waits on its
event loop.
"""

from __future__ import annotations

import asyncio
import os
import socket
import struct
import time
from collections.abc import Callable, Sequence

import grpc
from google.rpc import status_pb2

from engine_client.errors import KVCacheClientError, StepLaneBroken, error_from_status
from kvcache_common import step_lane as wire
from protos.kvcache.v1 import kvcache_pb2 as pb

STAGE_BYTES = 64 << 10
"""The sync lane's read buffer: an answer that fits arrives in one recv."""
SEND_BUFFER_BYTES = 1 << 20
"""The sync lane's socket send buffer (the kernel caps it at net.core.wmem_max): a Step of up to about this
size is written in one send, and the service reads it as it comes instead of in turns with this thread."""
MAX_PARTS = 256
"""Most buffers one send gathers (IOV_MAX is 1024 on Linux): a request of more parts is joined first."""
_TIMEVAL = struct.Struct("ll")
RETRY_SECONDS = 2.0
"""After a failed connect, Steps go over gRPC this long before the lane is tried again."""
_MAX_ANSWER = 1 << 31
"""The client reads whatever answer length the service sends (the service bounds what it writes)."""


class LaneChoice:
    """Whether a client's Steps take the lane: the announced path ("" none; None not known yet) and when a
    connect may be tried again. Shared logic of both clients; no I/O here."""

    __slots__ = ("_clock", "path", "retry_at")

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.path: str | None = None
        self.retry_at = 0.0
        self._clock = clock

    def learn(self, step_socket: str) -> None:
        """A GetPoolInfo answer's `step_socket`: the lane to use from now on ("" none)."""
        if step_socket != self.path:
            self.path = step_socket
            self.retry_at = 0.0

    def may_connect(self) -> bool:
        return bool(self.path) and self._clock() >= self.retry_at

    def connect_failed(self) -> None:
        self.retry_at = self._clock() + RETRY_SECONDS


def _hello(token: str) -> bytes:
    data = token.encode()
    return wire.header(wire.HELLO, len(data)) + data


def _refused(payload: bytes | bytearray) -> KVCacheClientError:
    return error_from_status(status_pb2.Status.FromString(bytes(payload)))


def _broken(path: str, why: str, deadline: bool = False) -> StepLaneBroken:
    code = grpc.StatusCode.DEADLINE_EXCEEDED if deadline else grpc.StatusCode.UNAVAILABLE
    return StepLaneBroken(code, "", f"the step lane {path} broke mid-call: {why}; the Step may or may not have "
                          "been applied (the next call connects again, or goes over gRPC)")


class StepLane:
    """One blocking connection to a step lane. `connect` (hello), then `step` for each call; `close`.

    With `poll_seconds`, a Step's answer is first polled for (non-blocking reads, up to that long) before the
    read blocks in the kernel: an answer that comes within it is read without this thread being put to sleep
    and woken again (a wake-up costs more than an empty Step's handler on a machine like the benchmark's).
    The poll spends its time on this thread's core; the call's deadline then still applies to the blocking
    read after it."""

    def __init__(self, path: str, poll_seconds: float = 0.0) -> None:
        self.path = path
        self.poll_seconds = poll_seconds
        self.instance_id = ""
        self._sock: socket.socket | None = None
        self._stage = bytearray(STAGE_BYTES)
        self._stage_view = memoryview(self._stage)
        self._timeout = 0.0

    def connect(self, token: str, timeout: float) -> None:
        """Open the socket and say hello. OSError when it cannot be opened (the caller then uses gRPC); the
        typed error of a refused hello (BadToken)."""
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
        try:
            sock.settimeout(timeout)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, SEND_BUFFER_BYTES)
            sock.connect(self.path)
            # Blocking from now on, with the deadline in the kernel (SO_RCVTIMEO / SO_SNDTIMEO): each read is one
            # recv, where a Python socket timeout polls before every one.
            sock.settimeout(None)
            self._set_timeout(sock, timeout)
            sock.sendall(_hello(token))
            kind, payload = self._read(sock, (wire.READY, wire.REFUSED))
        except BlockingIOError:
            sock.close()
            raise TimeoutError(f"no hello answer from {self.path} within {timeout:g} s") from None
        except BaseException:
            sock.close()
            raise
        if kind == wire.REFUSED:
            sock.close()
            raise _refused(payload)
        self.instance_id = bytes(payload).decode("ascii")
        self._sock = sock

    @property
    def connected(self) -> bool:
        return self._sock is not None

    def step(self, parts: Sequence[bytes], pin: str, timeout: float) -> pb.StepResponse:
        """Send one StepRequest's bytes, `parts` in order (`pin`: the instance id the call pins, "" none), and
        read its answer. The call's refusal raises its typed error; a broken connection StepLaneBroken (and
        closes it)."""
        sock = self._sock
        assert sock is not None, "connect() first"
        pinned = pin.encode()
        size = len(pinned) + sum(map(len, parts))
        try:
            if timeout != self._timeout:
                self._set_timeout(sock, timeout)
            _send(sock, (wire.header(wire.STEP, size, len(pinned)), pinned, *parts))
            kind, payload = self._read(sock, (wire.ANSWER, wire.REFUSED), self.poll_seconds, timeout)
        except (TimeoutError, BlockingIOError):
            self.close()
            raise _broken(self.path, f"no answer within {timeout:g} s", deadline=True) from None
        except (OSError, ValueError) as e:
            self.close()
            raise _broken(self.path, str(e) or type(e).__name__) from None
        if kind == wire.REFUSED:
            raise _refused(payload)
        return pb.StepResponse.FromString(payload)  # type: ignore[arg-type]  # upb parses any buffer

    def _set_timeout(self, sock: socket.socket, timeout: float) -> None:
        whole = int(timeout)
        value = _TIMEVAL.pack(whole, max(int((timeout - whole) * 1e6), 0 if whole else 1))  # (0, 0): no deadline
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, value)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, value)
        self._timeout = timeout

    def _read(self, sock: socket.socket, expect: tuple[int, ...], poll: float = 0.0,
              timeout: float = 0.0) -> tuple[int, bytes | bytearray]:
        """The next frame: a small one in one recv (into the staging buffer), a larger one's payload read
        straight into its own buffer; its first bytes polled for up to `poll` seconds before a blocking read,
        which then waits what is left of `timeout`. The service sends nothing but the answer to the request it
        was sent, so a read never takes bytes of another frame."""
        view = self._stage_view
        have = 0
        if poll:
            have = _poll_into(sock, view, poll)
            if not have:  # the poll took its part of the deadline (the next call sets the whole one again)
                self._set_timeout(sock, max(timeout - poll, 1e-6))
        while have < wire.HEADER_BYTES:
            n = sock.recv_into(view[have:])
            if not n:
                raise ConnectionResetError("the service closed the connection")
            have += n
        kind, _, length = wire.parse_header(view, expect=expect, max_length=_MAX_ANSWER)
        end = wire.HEADER_BYTES + length
        if end <= len(view):
            _recv_into(sock, view[have:end])
            return kind, bytes(view[wire.HEADER_BYTES:end])
        payload = bytearray(length)
        payload[:have - wire.HEADER_BYTES] = view[wire.HEADER_BYTES:have]
        _recv_into(sock, memoryview(payload)[have - wire.HEADER_BYTES:])
        return kind, payload

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None


def _send(sock: socket.socket, parts: tuple[bytes, ...]) -> None:
    """Write `parts` in one sendmsg where the socket takes them at once, else the rest as the peer reads (more
    than `MAX_PARTS` are joined first)."""
    if len(parts) > MAX_PARTS:
        parts = (b"".join(parts),)
    sent = sock.sendmsg(parts)
    for part in parts:
        if sent >= len(part):
            sent -= len(part)
            continue
        sock.sendall(memoryview(part)[sent:])
        sent = 0


def _poll_into(sock: socket.socket, view: memoryview, seconds: float) -> int:
    """Bytes read into `view` by non-blocking reads tried for up to `seconds` (0: nothing came in that time;
    the caller then blocks). The peer's end of stream raises, as a blocking read's would."""
    clock = time.perf_counter
    end = clock() + seconds
    while True:
        try:
            n = sock.recv_into(view, 0, socket.MSG_DONTWAIT)
        except (BlockingIOError, InterruptedError):
            if clock() >= end:
                return 0
            os.sched_yield()  # the service, when it waits for this core, runs first
            continue
        if not n:
            raise ConnectionResetError("the service closed the connection")
        return n


def _recv_into(sock: socket.socket, view: memoryview) -> None:
    while view:
        n = sock.recv_into(view)
        if not n:
            raise ConnectionResetError("the service closed the connection")
        view = view[n:]


class AsyncStepLane:
    """`StepLane` for the asyncio client: one connection on the running loop.

    With `poll_seconds`, a Step's answer is first polled for (non-blocking reads of the connection's socket,
    yielding the core between tries, up to that long) before the wait goes to the event loop: an answer that
    comes within it skips the loop's epoll round and the process's sleep and wake-up. The poll holds the loop
    for at most that long (50 us by default) once a Step; what it reads is handed to the connection's stream,
    which the rest of the answer then follows."""

    def __init__(self, path: str, poll_seconds: float = 0.0) -> None:
        self.path = path
        self.poll_seconds = poll_seconds
        self.instance_id = ""
        self._reader: asyncio.StreamReader | None = None
        self._writer: asyncio.StreamWriter | None = None
        self._fd = -1

    async def connect(self, token: str, timeout: float) -> None:
        try:
            reader, writer = await asyncio.wait_for(asyncio.open_unix_connection(self.path, limit=1 << 20), timeout)
        except asyncio.TimeoutError:
            raise OSError(f"cannot connect to {self.path} within {timeout:g} s") from None
        try:
            writer.write(_hello(token))
            kind, payload = await asyncio.wait_for(_aread(reader, (wire.READY, wire.REFUSED)), timeout)
        except asyncio.TimeoutError:
            writer.close()
            raise OSError(f"no hello answer from {self.path} within {timeout:g} s") from None
        except BaseException:
            writer.close()
            raise
        if kind == wire.REFUSED:
            writer.close()
            raise _refused(payload)
        self.instance_id = payload.decode("ascii")
        self._reader, self._writer = reader, writer
        self._fd = writer.get_extra_info("socket").fileno()  # non-blocking, as asyncio keeps it

    @property
    def connected(self) -> bool:
        return self._writer is not None

    async def step(self, parts: Sequence[bytes], pin: str, timeout: float) -> pb.StepResponse:
        reader, writer = self._reader, self._writer
        assert reader is not None and writer is not None, "connect() first"
        pinned = pin.encode()
        try:
            writer.write(wire.header(wire.STEP, len(pinned) + sum(map(len, parts)), len(pinned)))
            if pinned:
                writer.write(pinned)
            writer.writelines(parts)
            kind, payload = await asyncio.wait_for(self._exchange(writer, reader, self._fd, self.poll_seconds),
                                                   timeout)
        except asyncio.TimeoutError:
            self.close()
            raise _broken(self.path, f"no answer within {timeout:g} s", deadline=True) from None
        except (OSError, ValueError, asyncio.IncompleteReadError) as e:
            self.close()
            raise _broken(self.path, str(e) or type(e).__name__) from None
        if kind == wire.REFUSED:
            raise _refused(payload)
        return pb.StepResponse.FromString(payload)

    @staticmethod
    async def _exchange(writer: asyncio.StreamWriter, reader: asyncio.StreamReader, fd: int, poll: float
                        ) -> tuple[int, bytes]:
        await writer.drain()
        if poll:
            _poll_stream(fd, reader, poll)
        return await _aread(reader, (wire.ANSWER, wire.REFUSED))

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()
            self._reader = self._writer = None
            self._fd = -1


def _poll_stream(fd: int, reader: asyncio.StreamReader, seconds: float) -> None:
    """Non-blocking reads of `fd` (the stream's own socket, which asyncio keeps non-blocking) tried for up to
    `seconds`, yielding the core between tries: the first bytes that come are handed to `reader` (the end of
    stream too); nothing in that time leaves the wait to the event loop. Runs on the loop's thread with no await,
    so the stream's transport reads nothing meanwhile and the bytes keep their order."""
    clock = time.perf_counter
    end = clock() + seconds
    while True:
        try:
            data = os.read(fd, STAGE_BYTES)
        except (BlockingIOError, InterruptedError):
            if clock() >= end:
                return
            os.sched_yield()
            continue
        if data:
            reader.feed_data(data)
        else:
            reader.feed_eof()
        return


async def _aread(reader: asyncio.StreamReader, expect: tuple[int, ...]) -> tuple[int, bytes]:
    head = await reader.readexactly(wire.HEADER_BYTES)
    kind, _, length = wire.parse_header(head, expect=expect, max_length=_MAX_ANSWER)
    return kind, await reader.readexactly(length)
