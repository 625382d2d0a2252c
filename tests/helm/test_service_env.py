"""The container env the chart renders starts a real service that its own probes and helm test accept.

One server process per case (about half a second each): the env comes from the rendered manifest
unchanged, except that ports and the shm directory are chart values chosen for this machine.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

import helm_python as helm
import pytest

from cache_service.config import parse_bytes
from tests.helm.support import (
    REPO_ROOT,
    env_values,
    helm_test_pod,
    pod_spec,
    render,
    render_tool,
    service_container,
)

pytestmark = pytest.mark.integration

START_TIMEOUT_S = 20.0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "cache_service", *args],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=30,
    )


@pytest.mark.parametrize("example", ["defaults", "cpu"])
def test_rendered_env_serves_health_and_metrics(chart: helm.Chart, tmp_path: Path, example: str) -> None:
    values: dict[str, Any] = {}
    if example != "defaults":
        values = render_tool.load_values(render_tool.EXAMPLES_DIR / f"{example}.yaml")
    grpc_port, metrics_port = _free_port(), _free_port()
    values = {
        **values,
        "grpc": {"port": grpc_port},
        "service": {"port": grpc_port},
        "metrics": {"port": metrics_port},
        "config": {**values.get("config", {}), "shmDir": str(tmp_path), "shmPrefix": "kvhelm"},
    }
    objects = render(chart, values)
    env = env_values(service_container(objects))
    server = subprocess.Popen(
        [sys.executable, "-m", "cache_service", "serve"],
        cwd=REPO_ROOT,
        env={**os.environ, **env},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        # What the readiness probe asks, then what `helm test` runs, with the target swapped for the
        # Service's name that this machine cannot resolve.
        deadline = time.monotonic() + START_TIMEOUT_S
        target = f"127.0.0.1:{grpc_port}"
        while (
            check := _cli("health", "--target", target, "--service", "kvcache.v1.KVCacheService")
        ).returncode:
            assert server.poll() is None, (
                f"server exited {server.returncode}: {server.communicate()[0][-2000:]}"
            )
            assert time.monotonic() < deadline, (
                f"not SERVING after {START_TIMEOUT_S} s: {check.stdout}{check.stderr}"
            )
            time.sleep(0.1)
        assert check.stdout.strip() == f"{target}: SERVING"
        test_command = helm_test_pod(objects)["spec"]["containers"][0]["command"]
        assert test_command[:3] == ["kvcache-service", "health", "--target"]
        assert _cli(*test_command[1:3], target, *test_command[4:]).returncode == 0
        with urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=5) as response:
            assert b"\nkvcache_" in response.read()
        (pool_file,) = tmp_path.glob("kvhelm-*.pool")
        shm_volume = next(v for v in pod_spec(objects)["volumes"] if v["name"] == "shm")
        assert pool_file.stat().st_size <= parse_bytes(shm_volume["emptyDir"]["sizeLimit"])
    finally:
        server.send_signal(signal.SIGTERM)
        output = server.communicate(timeout=30)[0]
    assert server.returncode == 0, output[-2000:]
    assert not pool_file.exists(), "SIGTERM must unlink the pool"
