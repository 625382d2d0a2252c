"""The step lane on by default (docs/design.md §10): a service started without lane flags serves it beside its
pool file and the engine client takes it; `--step-lane false` serves none and the client stays on gRPC; a
default lane that cannot be bound leaves the service on gRPC with one warning; stale default sockets of the
prefix are removed at start. Real service processes; each test ends with the pool's accounting invariant
(the `start_server` fixture)."""

from __future__ import annotations

import json
import os
import socket
import stat
from collections.abc import Callable
from pathlib import Path

from engine_client import KVCacheClient, StepBatch
from tests.integration.conftest import SHM_DIR, ServerProcess


def _step(client: KVCacheClient) -> None:
    """One Step of an open and an append: both go through, whichever transport carries them."""
    batch = StepBatch()
    opened = batch.open("s1", streaming=False)
    appended = batch.append("s1", list(range(40)), reserve_tokens=8)
    client.step(batch)
    assert opened.ok and appended.ok, (opened.error, appended.error)
    assert (appended.value.context_tokens, appended.value.num_pages) == (40, 3)


def _events(log: Path, event: str) -> list[dict[str, object]]:
    lines = [json.loads(line) for line in log.read_text().splitlines() if line.startswith("{")]
    return [line for line in lines if line.get("event") == event]


def test_a_service_serves_the_lane_beside_its_pool_and_the_client_takes_it(
        start_server: Callable[..., ServerProcess], tmp_path: Path) -> None:
    prefix = f"kvlane-{os.getpid()}"
    stale = f"{SHM_DIR}/{prefix}-deadbeef00000000.step"  # a killed service's socket: nobody answers on it
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as dead:
        dead.bind(stale)
    server = start_server(shm_prefix=prefix)
    path = f"{SHM_DIR}/{prefix}-{server.instance_id}.step"
    assert not os.path.exists(stale)
    assert [e["path"] for e in _events(tmp_path / "server-0.log", "removed_stale_socket")] == [stale]
    assert stat.S_ISSOCK(os.stat(path).st_mode) and stat.S_IMODE(os.stat(path).st_mode) == 0o600
    assert any(line.strip() == f"lane     Step also on {path} (--step-lane false: gRPC only)"
               for line in server.banner), server.banner
    with KVCacheClient(server.target) as client:
        assert client.get_pool_info().step_socket == path
        _step(client)
        assert client._lane is not None and client._lane.connected
        assert client._lane.instance_id == server.instance_id
    code, _ = server.terminate()
    assert code == 0, server.log_tail()
    assert not os.path.exists(path), "the service removes its lane socket when it stops"


def test_step_lane_false_serves_none_and_the_client_stays_on_grpc(
        start_server: Callable[..., ServerProcess]) -> None:
    server = start_server("--step-lane", "false")
    assert not list(Path(SHM_DIR).glob(f"{server.shm_prefix}-*.step"))
    assert not any("Step also on" in line for line in server.banner), server.banner
    with KVCacheClient(server.target) as client:
        assert client.get_pool_info().step_socket == ""
        _step(client)
        assert client._lane is None


def test_a_default_lane_that_cannot_be_bound_leaves_the_service_on_grpc(
        start_server: Callable[..., ServerProcess], tmp_path: Path) -> None:
    shm = tmp_path / ("d" * 100)  # the default socket path is longer than a unix socket's (108 bytes)
    shm.mkdir()
    server = start_server("--shm-dir", str(shm))
    path = f"{shm}/{server.shm_prefix}-{server.instance_id}.step"
    [warning] = _events(tmp_path / "server-0.log", "step_lane_off")
    assert warning["path"] == path and warning["level"] == "warning"
    assert warning["reason"] == f"cannot serve the step lane on {path}: AF_UNIX path too long"
    with KVCacheClient(server.target) as client:
        assert client.get_pool_info().step_socket == ""
        _step(client)
        assert client._lane is None
