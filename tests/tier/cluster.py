"""A real Mooncake Store on loopback for tests: `mooncake_master` and a standalone `mooncake_client` holding
the store's memory, both from the `mooncake-transfer-engine-non-cuda` wheel in this venv.

Everything binds 127.0.0.1 where Mooncake lets us choose (docs/design.md §8): the master's RPC and metrics
ports (its defaults are 50051, ours too, and 0.0.0.0:9003), the client's service port; processes get
MC_TCP_BIND_ADDRESS=127.0.0.1 and announce 127.0.0.1. The transfer engines' handshake listeners bind all
interfaces (Mooncake has no option), but every address announced and dialled is loopback.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

from tests.loopback import free_port

BIN = Path(sys.executable).parent
LOOPBACK_ENV = {"MC_TCP_BIND_ADDRESS": "127.0.0.1"}


def wait_listening(port: int, proc: subprocess.Popen[bytes], what: str, log: Path, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{what} exited with {proc.returncode}: {log.read_text(errors='replace')[-2000:]}")
        try:
            socket.create_connection(("127.0.0.1", port), 0.2).close()
            return
        except OSError:
            time.sleep(0.02)
    raise RuntimeError(f"{what} did not listen on 127.0.0.1:{port} within {timeout} s")


class MooncakeCluster:
    """A master and one storage client (`segment` bytes, e.g. "64MB"). `kill_master()` / `start_master()`
    simulate an outage on the same address; `stop()` ends both (idempotent)."""

    def __init__(self, workdir: Path, segment: str = "64MB", lease_ttl_ms: int = 10000, start: bool = True) -> None:
        self.workdir = workdir
        self.rpc_port = free_port()
        self.metrics_port = free_port()
        self.client_port = free_port()
        self.segment = segment
        self.lease_ttl_ms = lease_ttl_ms
        self.master: subprocess.Popen[bytes] | None = None
        self.client: subprocess.Popen[bytes] | None = None
        self._starts = 0
        started = time.monotonic()
        if start:
            self.start_master()
            self.start_client()
        self.startup_seconds = time.monotonic() - started

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.rpc_port}"

    def _spawn(self, name: str, args: list[str]) -> tuple[subprocess.Popen[bytes], Path]:
        self._starts += 1
        log = self.workdir / f"{name}-{self._starts}.log"
        proc = subprocess.Popen([str(BIN / name), *args], stdout=open(log, "wb"),  # noqa: SIM115
                                stderr=subprocess.STDOUT, env={**os.environ, **LOOPBACK_ENV})
        return proc, log

    def start_master(self) -> None:
        self.master, log = self._spawn("mooncake_master", [
            f"--rpc_port={self.rpc_port}", "--rpc_address=127.0.0.1", "--metrics_host=127.0.0.1",
            f"--metrics_port={self.metrics_port}", f"--default_kv_lease_ttl={self.lease_ttl_ms}"])
        wait_listening(self.rpc_port, self.master, "mooncake_master", log)

    def start_client(self) -> None:
        self.client, log = self._spawn("mooncake_client", [
            "--host=127.0.0.1", f"--port={self.client_port}", f"--master_server_address={self.address}",
            "--metadata_server=P2PHANDSHAKE", f"--global_segment_size={self.segment}", "--protocol=tcp"])
        wait_listening(self.client_port, self.client, "mooncake_client", log)

    def kill_master(self) -> None:
        if self.master is not None:
            self.master.kill()
            self.master.wait()
            self.master = None

    def stop(self) -> None:
        for proc in (self.client, self.master):
            if proc is not None and proc.poll() is None:
                proc.terminate()
                try:
                    proc.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
        self.client = self.master = None
