"""Pool-file lifecycle and graceful shutdown of a real server process."""

from __future__ import annotations

import json
import signal
import socket
import subprocess
import sys
import uuid
from collections.abc import Callable
from pathlib import Path

from engine_client import KVCacheClient

from .conftest import REPO, SHM_DIR, ServerProcess


def test_sigterm_drains_releases_sessions_and_leaves_no_pool_file(
    start_server: Callable[..., ServerProcess]
) -> None:
    server = start_server()
    [pool_file] = server.pool_files
    assert pool_file.name == f"{server.shm_prefix}-{server.instance_id}.pool"
    assert pool_file.stat().st_size == 1024 * 2 * 2 * 16 * 4 * 64 * 2  # the default layout, exactly
    with KVCacheClient(server.target) as client:
        client.register_engine("e1", hold=False)  # a held lease would end with this client, before SIGTERM
        client.open_session("s1")
        client.append_session("s1", [1, 2, 3], 5)  # a turn left in flight at shutdown
    code, out = server.terminate()
    assert code == 0
    assert f"stopped cleanly (instance {server.instance_id}, pool released)" in out
    assert not pool_file.exists()
    events = [json.loads(line) for line in server.log_tail(50).splitlines()]
    stopped = next(e for e in events if e["event"] == "stopped")
    assert stopped["released_sessions"] == 1


def test_sigint_is_as_clean_as_sigterm(start_server: Callable[..., ServerProcess]) -> None:
    server = start_server()
    [pool_file] = server.pool_files
    server.proc.send_signal(signal.SIGINT)
    assert server.proc.wait(timeout=15) == 0
    assert not pool_file.exists()


def test_a_sigkill_leftover_is_removed_at_the_next_start(start_server: Callable[..., ServerProcess]) -> None:
    first = start_server()
    [leftover] = first.pool_files
    first.kill()  # SIGKILL: no cleanup ran
    assert leftover.exists()
    second = start_server(shm_prefix=first.shm_prefix)
    assert not leftover.exists()
    assert [p.name for p in second.pool_files] == [f"{first.shm_prefix}-{second.instance_id}.pool"]
    events = [json.loads(line) for line in second.log_tail(50).splitlines()]
    assert {"event": "removed_stale_pool_file", "path": str(leftover)}.items() <= next(
        e for e in events if e["event"] == "removed_stale_pool_file").items()


def test_a_live_services_pool_file_is_never_taken_for_stale(start_server: Callable[..., ServerProcess]) -> None:
    first = start_server()
    second = start_server(shm_prefix=first.shm_prefix)
    names = {p.name for p in second.pool_files}
    assert names == {f"{first.shm_prefix}-{first.instance_id}.pool", f"{first.shm_prefix}-{second.instance_id}.pool"}
    with KVCacheClient(first.target) as client:
        assert Path(client.get_pool_info().shm_path).exists()


def serve_and_fail(listen: str) -> tuple[subprocess.CompletedProcess[str], str]:
    """A second service on `listen`, which must refuse to start: (the finished process, its shm prefix). Each
    call's prefix is its own, so a refused start of another test running beside this one is never seen here."""
    prefix = f"kvtest-second-{uuid.uuid4().hex[:8]}"
    return subprocess.run([sys.executable, "-m", "cache_service", "serve", "--listen", listen, "--shm-prefix",
                           prefix], cwd=REPO, capture_output=True, text=True, timeout=30), prefix


def test_a_busy_port_is_one_line_and_the_first_service_keeps_serving(
        start_server: Callable[..., ServerProcess]) -> None:
    first = start_server()
    second, prefix = serve_and_fail(first.address)
    port = first.address.rpartition(":")[2]
    assert second.returncode == 1
    assert second.stderr.splitlines() == [  # ours alone: grpc never got to log its own error first
        f"kvcache-service: error: cannot listen on {first.address}: port {port} is in use (another "
        f"kvcache-service?); stop it, or pick another port (--listen 127.0.0.1:0 picks a free one)"]
    with KVCacheClient(first.target) as client:
        assert client.get_pool_info().instance_id == first.instance_id
    assert not list(Path(SHM_DIR).glob(f"{prefix}-*.pool"))  # the refused start left no pool file


def test_a_live_unix_socket_is_never_stolen(start_server: Callable[..., ServerProcess], tmp_path: Path) -> None:
    sock = tmp_path / "kv.sock"
    first = start_server(listen=f"unix:{sock}")
    second, prefix = serve_and_fail(f"unix:{sock}")
    assert second.returncode == 1
    assert second.stderr.splitlines() == [
        f"kvcache-service: error: cannot listen on unix:{sock}: a running process serves it (another "
        "kvcache-service?); stop it or choose another path"]
    assert sock.is_socket()
    with KVCacheClient(first.target) as client:  # still reachable at its path, still the same instance
        assert client.get_pool_info().instance_id == first.instance_id
    assert not list(Path(SHM_DIR).glob(f"{prefix}-*.pool"))  # the refused start left no pool file


def test_a_stale_unix_socket_file_is_removed_and_logged(start_server: Callable[..., ServerProcess],
                                                        tmp_path: Path) -> None:
    sock = tmp_path / "kv.sock"
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as left:  # bound, never unlinked: as after SIGKILL
        left.bind(str(sock))
    server = start_server(listen=f"unix:{sock}")
    with KVCacheClient(server.target) as client:
        assert client.get_pool_info().instance_id == server.instance_id
    events = [json.loads(line) for line in server.log_tail(50).splitlines()]
    assert {"event": "removed_stale_socket", "path": str(sock)}.items() <= next(
        e for e in events if e["event"] == "removed_stale_socket").items()
