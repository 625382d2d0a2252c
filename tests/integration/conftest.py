"""Integration harness: real `kvcache-service serve` processes, real clients in separate processes.

`ServerProcess` starts the console entry point (`python -m cache_service serve`) on a free TCP port
(`--listen 127.0.0.1:0`, the bound address read from the start line) or a unix socket, with a unique
shm prefix so concurrent tests never touch each other's pool files. After each test the fixture checks
the pool accounting invariant through GetStats(verify=True) and that SIGTERM leaves no pool file. A server
started with TLS flags is given the `client_options` (CA, client certificate) that check reaches it with.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import uuid
from collections.abc import Callable, Iterator
from dataclasses import replace
from pathlib import Path

import pytest

from engine_client import ClientOptions
from tests.tier.engine import Engine

REPO = Path(__file__).resolve().parents[2]
PYTHON = sys.executable
SHM_DIR = "/dev/shm"


class ServerProcess:
    def __init__(self, *args: str, listen: str = "127.0.0.1:0", shm_prefix: str | None = None,
                 env: dict[str, str] | None = None, log_path: Path | None = None, auth_token: str = "",
                 client_options: ClientOptions | None = None) -> None:
        self.auth_token = auth_token
        self.client_options = client_options or ClientOptions()
        """How a client reaches this server (TLS files); the auth token is added where verify_stats uses it."""
        if auth_token:
            args = (*args, "--auth-token", auth_token)
        self.shm_prefix = shm_prefix or f"kvtest-{uuid.uuid4().hex[:8]}"
        self.args = ["serve", "--listen", listen, "--shm-prefix", self.shm_prefix, "--log-format", "json",
                     "--reap-interval", "0.2", *args]
        self.log_path = log_path
        self._log = open(log_path, "ab") if log_path else subprocess.DEVNULL  # noqa: SIM115
        self.proc = subprocess.Popen(
            [PYTHON, "-m", "cache_service", *self.args], cwd=REPO, stdout=subprocess.PIPE, stderr=self._log,
            text=True, env={**os.environ, **(env or {})},
        )
        assert self.proc.stdout is not None
        self.banner = [self.proc.stdout.readline()]
        match = re.search(r"listening on (\S+) \(instance (\w+)\)", self.banner[0])
        if match is None:
            self.proc.kill()
            raise RuntimeError(f"server did not start: {self.banner[0]!r}; log: {self.log_tail()}")
        self.address, self.instance_id = match.group(1), match.group(2)
        while not self.banner[-1].startswith("  try "):  # the last line; a TLS server has one more before it
            line = self.proc.stdout.readline()
            if not line:
                raise RuntimeError(f"the start line ended early: {self.banner!r}; log: {self.log_tail()}")
            self.banner.append(line)

    @property
    def target(self) -> str:
        return self.address

    @property
    def pool_files(self) -> list[Path]:
        """Every pool file of this server's prefix (other servers may share the prefix)."""
        return sorted(Path(SHM_DIR).glob(f"{self.shm_prefix}-*.pool"))

    @property
    def own_pool_file(self) -> Path:
        return Path(SHM_DIR) / f"{self.shm_prefix}-{self.instance_id}.pool"

    def log_tail(self, n: int = 20) -> str:
        if self.log_path is None or not self.log_path.exists():
            return "(no log)"
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])

    def terminate(self, timeout: float = 15) -> tuple[int, str]:
        """SIGTERM and wait: (exit code, rest of stdout)."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        out, _ = self.proc.communicate(timeout=timeout)
        return self.proc.returncode, out

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=15)

    def close(self) -> None:
        """Kill the server if it still runs and remove the pool file a kill leaves (a test that stops its server
        with SIGTERM checks first that the server removed it itself)."""
        self.kill()
        self.own_pool_file.unlink(missing_ok=True)
        if self._log is not subprocess.DEVNULL:
            self._log.close()


def verify_stats(target: str, auth_token: str = "", options: ClientOptions | None = None) -> None:
    """GetStats(verify=True) through a fresh client (with `options`' TLS files, if any): the full invariant
    check passes."""
    from engine_client import KVCacheClient

    options = replace(options or ClientOptions(), auth_token=auth_token)
    with KVCacheClient(target, options) as client:
        st = client.get_stats(verify=True)
    assert st.verified and st.accounting_holds, st


@pytest.fixture
def start_server(tmp_path: Path) -> Iterator[Callable[..., ServerProcess]]:
    """Factory: start_server(*flags, listen=...) -> a running ServerProcess. At teardown each server
    still running must pass the invariant check and leave no pool file after SIGTERM."""
    started: list[ServerProcess] = []

    def factory(*args: str, **kwargs: object) -> ServerProcess:
        kwargs.setdefault("log_path", tmp_path / f"server-{len(started)}.log")
        server = ServerProcess(*args, **kwargs)  # type: ignore[arg-type]
        started.append(server)
        return server

    yield factory
    errors = []
    for server in started:
        if server.proc.poll() is None:
            try:
                verify_stats(server.target, server.auth_token, server.client_options)
            except Exception as e:  # report every server, then fail
                errors.append(f"{server.target}: {e}")
            code, _ = server.terminate()
            if code != 0:
                errors.append(f"{server.target}: exit code {code} on SIGTERM; log:\n{server.log_tail()}")
            if server.own_pool_file.exists():
                errors.append(f"{server.target}: SIGTERM left {server.own_pool_file}")
        server.close()  # a test that SIGKILLed its server leaves its pool file to this
    assert not errors, "\n".join(errors)


@pytest.fixture
def server(start_server: Callable[..., ServerProcess]) -> ServerProcess:
    """A default server on a free TCP port, page size 4 (small numbers in assertions)."""
    return start_server("--page-size", "4", "--num-pages", "256")


@pytest.fixture(params=["tcp", "unix"])
def any_server(request: pytest.FixtureRequest, start_server: Callable[..., ServerProcess],
               tmp_path: Path) -> ServerProcess:
    """The same server on TCP and on a unix socket."""
    listen = "127.0.0.1:0" if request.param == "tcp" else f"unix:{tmp_path}/kvcache.sock"
    return start_server("--page-size", "4", "--num-pages", "256", listen=listen)


@pytest.fixture
def engines(start_server: Callable[..., ServerProcess]) -> Iterator[list[Engine]]:
    """The tier tests' engines a test made (it appends them): closed at teardown, before its servers stop."""
    made: list[Engine] = []
    yield made
    for e in made:
        e.close()


def run_engine(script: str, *args: str, timeout: float = 60) -> str:
    """Run `tests/integration/engines.py <script> args...` in a separate process; return its stdout."""
    proc = subprocess.run([PYTHON, "-m", "tests.integration.engines", script, *args], cwd=REPO,
                          capture_output=True, text=True, timeout=timeout)
    if proc.returncode != 0:
        raise AssertionError(f"engine process {script} failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr}")
    return proc.stdout
