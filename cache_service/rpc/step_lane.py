"""The step lane: `Step` over a unix-domain socket of the service (docs/design.md §10, `--step-socket`).

A Step that arrives here runs through the very handler the gRPC server runs for `Step` (`ServiceInterceptor`'s
wrapping of `KVCacheServicer.Step`: decoding, the instance pin, the caller's identity from the hello's bearer
token, `--max-step-ops`, refusals, metrics, logs); only the transport differs. Each connection is a `LanePeer`
(lane_peer.py: frames, deadlines, polling).

Who may connect: the socket file's mode (0600, or 0660 with `group`); with tokens configured, the first
frame's bearer token must resolve to an identity, or the connection gets BAD_TOKEN and is closed: nothing is
applied before a valid hello. Each connection's peer credentials (SO_PEERCRED) are logged when it opens and
closes.

Bounds: at most `max_connections` at once (more are closed at accept); a hello must arrive within
`timeout_seconds` of the connection, and each later frame within `timeout_seconds` of its first byte (a
connection may idle between frames); a frame longer than `max_message_bytes` is refused RESOURCE_EXHAUSTED
and its connection closed unread; an answer the peer does not read within `timeout_seconds` closes it.
"""

from __future__ import annotations

import asyncio
import contextlib
import grp
import os
import socket

import grpc

from cache_service.log import get_logger
from cache_service.rpc.identity import Identities
from cache_service.rpc.lane_peer import LanePeer
from cache_service.rpc.server import claim_unix_path
from kvcache_common import step_lane as wire


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
        self.connections: set[LanePeer] = set()
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
        self._server = await loop.create_unix_server(lambda: LanePeer(self), sock=sock)
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
