"""The pool socket: hands an fd-backed pool (`host_memfd`, `cuda_vmm`) to engines over a unix socket.

One short exchange per connection (`kvcache_common.pool_socket` has the protocol). Before anything is
sent, the peer's credentials (SO_PEERCRED) must name an allowed uid (--pool-socket-uids; by default the
service's own) and its bearer token must resolve to an identity that may drive engines (engine or admin),
exactly as the RPCs decide; a refusal carries the same reasons (BAD_TOKEN, ROLE_REQUIRED) and no fd.
Each exchange is bounded in time, so a client that connects and says nothing cannot hold a slot.

The socket is a path (created 0600, removed at stop; a stale one left by a SIGKILLed service is replaced,
a live one refused) or "@name" in Linux's abstract namespace, which every container of a pod shares and
which vanishes with the process.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
import struct
from collections.abc import Callable
from typing import Any

from cache_service.core import KVCacheError
from cache_service.log import get_logger
from cache_service.rpc.identity import Identities, Role
from cache_service.rpc.server import claim_unix_path
from kvcache_common import pool_socket as wire

EXCHANGE_SECONDS = 5.0
_UCRED = struct.Struct("3i")


def parse_uids(text: str) -> frozenset[int] | None:
    """--pool-socket-uids: "" -> only this process's uid, "*" -> any (None), else a comma list of uids."""
    text = text.strip()
    if text == "*":
        return None
    if not text:
        return frozenset({os.getuid()})
    try:
        return frozenset(int(u) for u in text.split(","))
    except ValueError:
        raise ValueError(f"not a list of uids: {text!r} (use e.g. 1000,1001, or * for any)") from None


class PoolSocketServer:
    """Serves `export_fd()` on `address` to peers that pass the checks. `start()`, then `close()`."""

    def __init__(self, address: str, export_fd: Callable[[], int], *, identities: Identities, instance_id: str,
                 backend: str, size_bytes: int, device_uuid: str = "", allowed_uids: frozenset[int] | None,
                 exchange_seconds: float = EXCHANGE_SECONDS) -> None:
        self.address = address
        self.exchange_seconds = exchange_seconds
        self._export_fd = export_fd
        self._identities = identities
        self._instance_id = instance_id
        self._header = {"ok": True, "backend": backend, "instance_id": instance_id, "size_bytes": size_bytes,
                        "device_uuid": device_uuid}
        self._uids = allowed_uids
        self._sock: socket.socket | None = None
        self._task: asyncio.Task[None] | None = None
        self._exchanges: set[asyncio.Task[None]] = set()
        self._log = get_logger("kvcache.pool_socket")
        self.served = 0
        self.refused = 0

    def start(self) -> None:
        abstract = self.address.startswith("@")
        if not abstract:
            claim_unix_path(self.address, f"serve the pool on {self.address}")
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
        try:
            if not abstract:
                old = os.umask(0o177)  # the socket file is 0600 from the moment it exists
                try:
                    sock.bind(self.address)
                finally:
                    os.umask(old)
            else:
                sock.bind(wire.socket_address(self.address))
            sock.listen(64)
            sock.setblocking(False)
        except OSError as e:
            sock.close()
            raise OSError(f"cannot serve the pool on {self.address}: {e.strerror}") from None
        self._sock = sock
        self._task = asyncio.get_running_loop().create_task(self._accept_loop(), name="kvcache-pool-socket")

    async def _accept_loop(self) -> None:
        loop = asyncio.get_running_loop()
        assert self._sock is not None
        while True:
            conn, _ = await loop.sock_accept(self._sock)
            task = loop.create_task(self._serve(conn))
            self._exchanges.add(task)
            task.add_done_callback(self._exchanges.discard)

    async def _serve(self, conn: socket.socket) -> None:
        loop = asyncio.get_running_loop()
        with conn:
            conn.setblocking(False)
            pid, uid, gid = _UCRED.unpack(conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _UCRED.size))
            try:
                data = await asyncio.wait_for(loop.sock_recv(conn, wire.MAX_MESSAGE), self.exchange_seconds)
                reply = self._decide(data, uid)
            except TimeoutError:
                reply = _refusal("DEADLINE_EXCEEDED", "DEADLINE_EXCEEDED",
                                 f"no request within {self.exchange_seconds:g} s")
            fds = [self._export_fd()] if reply["ok"] else []
            if reply["ok"]:
                self.served += 1
                self._log.info("pool_fd_sent", peer_pid=pid, peer_uid=uid, peer_gid=gid)
            else:
                self.refused += 1
                self._log.warning("pool_fd_refused", peer_pid=pid, peer_uid=uid, reason=reply["reason"],
                                  message=reply["message"])
            try:
                socket.send_fds(conn, [wire.encode(reply)], fds)
            except OSError as e:
                self._log.warning("pool_socket_send_failed", peer_pid=pid, peer_uid=uid, error=e.strerror)

    def _decide(self, data: bytes, uid: int) -> dict[str, Any]:
        if self._uids is not None and uid not in self._uids:
            return _refusal("PERMISSION_DENIED", "PEER_NOT_ALLOWED",
                            f"peer uid {uid} is not allowed by --pool-socket-uids (allowed: "
                            f"{','.join(map(str, sorted(self._uids)))})")
        try:
            request = wire.decode(data)
        except ValueError as e:
            return _refusal("INVALID_ARGUMENT", "INVALID_ARGUMENT", f"bad pool socket request: {e}")
        if request.get("version") != wire.VERSION:
            return _refusal("INVALID_ARGUMENT", "INVALID_ARGUMENT",
                            f"pool socket protocol version {request.get('version')!r}; this service speaks "
                            f"{wire.VERSION}")
        token = request.get("token") or ""
        try:
            who = self._identities.resolve(f"Bearer {token}".encode() if token else b"")
            who.need(Role.ENGINE, Role.ADMIN, what="mapping the pool")
        except KVCacheError as e:
            return _refusal(e.code.value, e.reason.value, e.message)
        expected = request.get("instance_id") or ""
        if expected and expected != self._instance_id:
            return _refusal("FAILED_PRECONDITION", "INSTANCE_MISMATCH",
                            f"the client last talked to service instance {expected}, this is {self._instance_id}: "
                            "the service restarted; remap the pool")
        return self._header

    def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            self._task = None
        for task in list(self._exchanges):
            task.cancel()
        if self._sock is not None:
            self._sock.close()
            self._sock = None
            if not self.address.startswith("@"):
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(self.address)


def _refusal(code: str, reason: str, message: str) -> dict[str, Any]:
    return {"ok": False, "code": code, "reason": reason, "message": message}
