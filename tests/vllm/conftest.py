"""Real vLLM on a real kvcache: vLLM engine processes (`python -m engine_client.vllm.driver`, in `.venv-vllm`,
made by `make vllm-setup`) and `kvcache-service serve` processes on free loopback ports.

An engine takes ~20 s to start here, so each module starts its engines once (module-scoped fixtures) and
the modules are pinned to xdist groups balanced by their time (tests/conftest.py ENGINE_GROUPS, collected
first so that `make test`'s `--dist loadgroup` starts them all at once, each on its own worker): `vllm`
(test_connector.py, the agent-pressure and vLLM benches' smoke tests), `vllm-b` (test_mla.py,
test_serve_recipe.py, test_tensor_parallel.py) and `vllm-c` (test_qwen2.py, tests/sglang,
test_sliding_window.py); at most two engines at a time in each.
Models are tiny random-initialised checkpoints this module saves (float32, head_dim 64; nothing is
downloaded). After every test the kvcache services must pass the accounting invariant with no turn left
in flight and no regular session left open (finished and aborted requests commit and close).
"""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

from engine_client import KVCacheClient
from engine_client.vllm.driver import DriverError, EngineProcess, save_model
from tests.integration.conftest import REPO, ServerProcess, verify_stats
from tests.loopback import wait_until

VLLM_PYTHON = REPO / ".venv-vllm" / "bin" / "python"
PAGE = 16
BLOCK = 32
LAYOUT = ("--num-layers", "2", "--num-kv-heads", "2", "--head-dim", "64", "--dtype", "float32")
ENGINE_ARGS = ("--num-blocks", "48", "--max-model-len", "1024")
"""The same vLLM configuration with and without kvcache (48 blocks of 32 tokens: small enough that a burst
of long requests is preempted)."""


class VllmEngine(EngineProcess):
    """A driver process in .venv-vllm; a failure to start or answer is a test failure with the engine's log."""

    def __init__(self, model: Path, log: Path, *, kvcache: str = "", args: tuple[str, ...] = ENGINE_ARGS,
                 extra: dict[str, Any] | None = None) -> None:
        if not VLLM_PYTHON.exists():
            raise AssertionError(f"{VLLM_PYTHON} is missing: `make vllm-setup` makes the vLLM venv")
        try:
            super().__init__(VLLM_PYTHON, model, log, kvcache=kvcache, extra=extra, args=args, cwd=REPO)
        except DriverError as e:
            raise AssertionError(str(e)) from None

    def command(self, cmd: dict[str, Any], timeout: float = 180.0) -> dict[str, Any]:
        try:
            return super().command(cmd, timeout)
        except DriverError as e:
            raise AssertionError(str(e)) from None


@contextmanager
def started_engines(model: Path, log_dir: Path, prefix: str, specs: dict[str, dict[str, Any]]
                    ) -> Iterator[dict[str, VllmEngine]]:
    """The engines `specs` names (name -> `VllmEngine` keyword arguments), started two at a time (a start is
    CPU-bound for ~20-60 s here), logging to `log_dir/<prefix>-<name>.log`; at exit the ones still in the
    dict are closed all at once (a TP engine takes ~15 s to exit)."""
    engines: dict[str, VllmEngine] = {}

    def start(name: str) -> None:
        engines[name] = VllmEngine(model, log_dir / f"{prefix}-{name}.log", **specs[name])

    try:
        with ThreadPoolExecutor(2) as pool:
            for future in [pool.submit(start, name) for name in specs]:
                future.result()
        yield engines
    finally:
        with ThreadPoolExecutor(max(1, len(engines))) as pool:
            list(pool.map(VllmEngine.close, list(engines.values())))


def stop_cleanly(server: ServerProcess) -> None:
    """SIGTERM a module's kvcache: it must exit 0 (after the invariant checks of the tests that used it)."""
    code, _ = server.terminate()
    server.close()
    assert code == 0, server.log_tail()


def request(prompt: list[int], max_tokens: int = 8, **more: Any) -> dict[str, Any]:
    return {"prompt": prompt, "max_tokens": max_tokens, **more}


def tokens(outputs: list[dict[str, Any]]) -> list[list[int]]:
    return [o["tokens"] for o in outputs]


def kvcache_server(log: Path, *flags: str, listen: str = "127.0.0.1:0") -> ServerProcess:
    return ServerProcess("--page-size", str(PAGE), "--num-pages", "1024", *LAYOUT, *flags, listen=listen,
                         log_path=log)


def drained(target: str) -> None:
    """No turn in flight and no regular session open on `target` (streaming sessions may stay; a dead engine's
    requests closed at its lease's end, having committed nothing), then the full invariant check. Finishes are
    sent asynchronously: wait for them."""
    with KVCacheClient(target) as client:
        def settled() -> bool:
            st = client.get_stats()
            sessions = client.list_sessions()
            regular = [s for s in sessions if not s.streaming]
            return st.sessions_in_turn == 0 and st.in_flight_pages == 0 and not regular
        wait_until(settled, f"kvcache at {target}: every vLLM request committed and closed", timeout=15)
    verify_stats(target)


@pytest.fixture(scope="session")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Tiny random Llama and Qwen2 checkpoints (2 layers, 2 KV heads of 64, float32)."""
    root = tmp_path_factory.mktemp("models")
    return {family: save_model(family, root / family) for family in ("llama", "qwen2")}


@pytest.fixture(scope="module")
def kvcache(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    """The module's kvcache service (page 16, the tiny models' layout)."""
    server = kvcache_server(tmp_path_factory.mktemp("kvcache") / "server.log")
    yield server
    stop_cleanly(server)


@pytest.fixture(autouse=True)
def _invariant_after_each_test(request: pytest.FixtureRequest) -> Iterator[None]:
    yield
    if "kvcache" in request.fixturenames:
        server: ServerProcess = request.getfixturevalue("kvcache")
        if server.proc.poll() is None:
            drained(server.target)


@pytest.fixture(scope="module")
def engine_log_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("engines")
