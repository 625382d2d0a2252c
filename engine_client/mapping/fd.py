"""Receive an fd-backed pool (host_memfd, cuda_vmm) from the service's pool socket.

One exchange (`kvcache_common.pool_socket`): send the bearer token and the instance id GetPoolInfo
gave, get the pool's file descriptor (SCM_RIGHTS) and a header, or a refusal with the service's reason,
raised as the same typed error an RPC would raise (BadToken, RoleRequired, ServiceRestarted).
"""

from __future__ import annotations

import socket
from typing import Any

import grpc

from engine_client.errors import REASON_ERRORS, KVCacheClientError, PoolMappingError, ServiceRestarted
from engine_client.types import PoolInfo
from kvcache_common import pool_socket as wire

TIMEOUT_SECONDS = 10.0


def receive_pool_fd(info: PoolInfo, auth_token: str = "") -> tuple[int, dict[str, Any]]:
    """(the pool's fd, which the caller owns and must close; the service's header)."""
    if not info.pool_socket:
        raise PoolMappingError(f"the service reports a {info.backend} pool without a pool socket")
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC) as sock:
            sock.settimeout(TIMEOUT_SECONDS)
            sock.connect(wire.socket_address(info.pool_socket))
            sock.sendall(wire.encode({"version": wire.VERSION, "token": auth_token, "instance_id": info.instance_id}))
            data, fds, _, _ = socket.recv_fds(sock, wire.MAX_MESSAGE, 1)
    except (FileNotFoundError, ConnectionRefusedError) as e:
        raise ServiceRestarted(grpc.StatusCode.FAILED_PRECONDITION, "POOL_UNAVAILABLE",
                               f"cannot reach the pool socket {info.pool_socket} ({e.strerror}): the service "
                               "stopped or restarted, or this process cannot see its socket (same pod or host? "
                               "the same hostPath directory?)") from None
    except OSError as e:
        raise PoolMappingError(f"pool socket {info.pool_socket}: {e.strerror or e}") from None
    try:
        header = wire.decode(data)
    except ValueError as e:
        for fd in fds:
            socket.close(fd)
        raise PoolMappingError(f"pool socket {info.pool_socket} answered {e}") from None
    if not header.get("ok"):
        for fd in fds:
            socket.close(fd)
        raise _refused(header)
    if len(fds) != 1:
        for fd in fds:
            socket.close(fd)
        raise PoolMappingError(f"pool socket {info.pool_socket} answered without a file descriptor")
    if header.get("instance_id") != info.instance_id or header.get("backend") != info.backend:
        socket.close(fds[0])
        raise ServiceRestarted(grpc.StatusCode.FAILED_PRECONDITION, "INSTANCE_MISMATCH",
                               f"the pool socket serves instance {header.get('instance_id')} "
                               f"({header.get('backend')}), GetPoolInfo named {info.instance_id}: remap")
    return fds[0], header


def _refused(header: dict[str, Any]) -> Exception:
    reason, message = str(header.get("reason", "")), str(header.get("message", ""))
    if reason == "INSTANCE_MISMATCH":
        return ServiceRestarted(grpc.StatusCode.FAILED_PRECONDITION, reason, message)
    cls = REASON_ERRORS.get(reason)
    if cls is not None:
        code = getattr(grpc.StatusCode, str(header.get("code", "")), grpc.StatusCode.PERMISSION_DENIED)
        error: KVCacheClientError = cls(code, reason, message)
        return error
    return PoolMappingError(f"the pool socket refused: {message} ({reason or header.get('code')})")
