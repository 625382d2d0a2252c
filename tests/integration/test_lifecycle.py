"""Pool-file lifecycle and graceful shutdown of a real server process."""

from __future__ import annotations

import json
import signal
from collections.abc import Callable
from pathlib import Path

from engine_client import KVCacheClient

from .conftest import ServerProcess


def test_sigterm_drains_releases_sessions_and_leaves_no_pool_file(
    start_server: Callable[..., ServerProcess]
) -> None:
    server = start_server()
    [pool_file] = server.pool_files
    assert pool_file.name == f"{server.shm_prefix}-{server.instance_id}.pool"
    assert pool_file.stat().st_size == 1024 * 2 * 2 * 16 * 4 * 64 * 2  # the default layout, exactly
    with KVCacheClient(server.target) as client:
        client.register_engine("e1")
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
