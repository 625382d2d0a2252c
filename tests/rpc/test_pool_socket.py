"""The pool socket of an fd-backed pool (host_memfd here): who gets the fd, who does not, and why."""

from __future__ import annotations

import asyncio
import os
import socket
import stat
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from cache_service.rpc.identity import Identities
from cache_service.rpc.pool_socket import PoolSocketServer, parse_uids
from engine_client import BadToken, KVCacheClient, PoolMappingError, RoleRequired, ServiceRestarted, map_pool
from engine_client._codec import pool_info
from engine_client.mapping.fd import receive_pool_fd
from kvcache_common import pool_socket as wire
from protos.kvcache.v1 import kvcache_pb2 as pb

from .conftest import ThreadServer

TOKENS = {"alice": "alice-token-0123456789", "dash": "dash-token-01234567890", "ops": "ops-token-0123456789"}


def raw_exchange(address: str, request: bytes | None) -> tuple[dict[str, Any], list[int]]:
    """Talk to the socket without engine_client: (the reply, the fds that came with it)."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(10)
        sock.connect(wire.socket_address(address))
        if request is not None:
            sock.sendall(request)
        data, fds, _, _ = socket.recv_fds(sock, wire.MAX_MESSAGE, 4)
    return wire.decode(data), fds


def request(**fields: Any) -> bytes:
    return wire.encode({"version": 1, "token": "", "instance_id": "", **fields})


@pytest.fixture
def memfd_server(start_thread_server: Callable[..., ThreadServer]) -> ThreadServer:
    return start_thread_server(backend="host_memfd")


def test_get_pool_info_names_the_socket_and_map_pool_maps_it(memfd_server: ThreadServer) -> None:
    instance = memfd_server.server.instance_id
    with KVCacheClient(memfd_server.target) as client:
        info = client.get_pool_info()
        assert (info.backend, info.pool_socket, info.shm_path) == ("host_memfd", f"@kvcache-{instance}", "")
        with map_pool(client) as a, map_pool(info) as b:
            a.tensor[1, 0, 3].fill_(2.5)
            assert bool((b.tensor[1, 0, 3] == 2.5).all())  # two mappings, one memory
            assert a.tensor.shape == (info.layout.num_layers, 2, 64, 4, 4, 64)
    reply, fds = raw_exchange(info.pool_socket, request(instance_id=instance))
    try:
        assert reply == {"ok": True, "backend": "host_memfd", "instance_id": instance,
                         "size_bytes": info.size_bytes, "device_uuid": ""}
        assert len(fds) == 1 and os.fstat(fds[0]).st_size == info.size_bytes
        assert os.readlink(f"/proc/self/fd/{fds[0]}").startswith("/memfd:kvcache-pool")  # in no directory
    finally:
        for fd in fds:
            os.close(fd)
    assert memfd_server.server.pool_socket is not None and memfd_server.server.pool_socket.served == 3


@pytest.mark.parametrize(("payload", "reason", "message"), [
    (b"hello", "INVALID_ARGUMENT", "bad pool socket request: not a JSON message"),
    (wire.encode({"version": 2}), "INVALID_ARGUMENT", "pool socket protocol version 2; this service speaks 1"),
    (request(instance_id="0" * 16), "INSTANCE_MISMATCH", "the client last talked to service instance 0000000000000000"),
])
def test_bad_requests_get_a_reason_and_no_fd(memfd_server: ThreadServer, payload: bytes, reason: str,
                                             message: str) -> None:
    address = f"@kvcache-{memfd_server.server.instance_id}"
    reply, fds = raw_exchange(address, payload)
    assert fds == [] and reply["ok"] is False and reply["reason"] == reason and reply["message"].startswith(message)


def test_a_restarted_service_is_detected_at_the_socket(memfd_server: ThreadServer) -> None:
    with KVCacheClient(memfd_server.target) as client:
        info = client.get_pool_info()
    stale = type(info)(**{**{f: getattr(info, f) for f in info.__dataclass_fields__}, "instance_id": "f" * 16})
    with pytest.raises(ServiceRestarted, match="the service restarted"):
        map_pool(stale)
    gone = type(info)(**{**{f: getattr(info, f) for f in info.__dataclass_fields__}, "pool_socket": "@nobody-here"})
    with pytest.raises(ServiceRestarted, match="cannot reach the pool socket @nobody-here"):
        map_pool(gone)


def test_identities_decide_who_gets_the_pool(start_thread_server: Callable[..., ThreadServer], tmp_path: Path) -> None:
    path = tmp_path / "tenants.yaml"
    path.write_text("tenants:\n"
                    f"  - {{name: alice, token: {TOKENS['alice']}, role: engine, cache_salts: [a]}}\n"
                    f"  - {{name: dash, token: {TOKENS['dash']}, role: reader}}\n"
                    f"  - {{name: ops, token: {TOKENS['ops']}, role: admin}}\n")
    server = start_thread_server(backend="host_memfd", tenants_file=str(path))
    md = (("authorization", f"Bearer {TOKENS['alice']}"),)
    admin = (("authorization", f"Bearer {TOKENS['ops']}"),)
    server.verify = lambda: server.stub.GetStats(pb.GetStatsRequest(verify=True), metadata=admin,  # type: ignore[method-assign]
                                                 timeout=10)
    info = pool_info(server.stub.GetPoolInfo(pb.GetPoolInfoRequest(), metadata=md, timeout=10))
    with map_pool(info, auth_token=TOKENS["alice"]) as pool:
        assert pool.tensor.numel() > 0
    with pytest.raises(RoleRequired) as err:
        map_pool(info, auth_token=TOKENS["dash"])
    assert "mapping the pool needs the engine or admin role" in err.value.message
    for token in ("", "not-a-token-of-anyone"):
        with pytest.raises(BadToken):
            receive_pool_fd(info, token)
    reply, fds = raw_exchange(info.pool_socket, request(token="nope"))  # and truly no fd came with the refusal
    assert (reply["reason"], fds) == ("BAD_TOKEN", [])
    assert server.server.pool_socket is not None
    assert (server.server.pool_socket.served, server.server.pool_socket.refused) == (1, 4)


def test_a_peer_uid_outside_the_list_gets_no_fd(start_thread_server: Callable[..., ThreadServer]) -> None:
    server = start_thread_server(backend="host_memfd", pool_socket_uids=str(os.getuid() + 4242))
    with KVCacheClient(server.target) as client:
        info = client.get_pool_info()
        with pytest.raises(PoolMappingError, match=f"peer uid {os.getuid()} is not allowed by --pool-socket-uids"):
            map_pool(client)
    reply, fds = raw_exchange(info.pool_socket, request())
    assert (reply["reason"], fds) == ("PEER_NOT_ALLOWED", [])


def test_uid_lists() -> None:
    assert parse_uids("") == frozenset({os.getuid()})
    assert parse_uids("*") is None
    assert parse_uids("1000, 1001") == frozenset({1000, 1001})
    with pytest.raises(ValueError, match="not a list of uids"):
        parse_uids("root")


def test_a_path_socket_is_private_replaces_a_stale_one_and_refuses_a_live_one(tmp_path: Path) -> None:
    path = str(tmp_path / "pool.sock")
    stale = socket.socket(socket.AF_UNIX)
    stale.bind(path)
    stale.close()  # a file nobody serves, as a SIGKILLed service leaves it
    read_end, write_end = os.pipe()

    async def scenario() -> None:
        server = PoolSocketServer(path, lambda: write_end, identities=Identities(), instance_id="i",
                                  backend="host_memfd", size_bytes=1, allowed_uids=None, exchange_seconds=0.2)
        server.start()
        try:
            assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
            second = PoolSocketServer(path, lambda: write_end, identities=Identities(), instance_id="j",
                                      backend="host_memfd", size_bytes=1, allowed_uids=None)
            with pytest.raises(OSError, match="a running process serves it"):
                second.start()
            reply, fds = await asyncio.to_thread(raw_exchange, path, None)  # says nothing: timed out
            assert (reply["reason"], fds) == ("DEADLINE_EXCEEDED", [])
            reply, fds = await asyncio.to_thread(raw_exchange, path, request())
            assert reply["ok"] and len(fds) == 1
            os.write(fds[0], b"!")  # the received fd is the very pipe the server exported
            os.close(fds[0])
            assert os.read(read_end, 1) == b"!"
        finally:
            server.close()
        assert not os.path.exists(path)

    try:
        asyncio.run(scenario())
    finally:
        os.close(read_end)
        os.close(write_end)

