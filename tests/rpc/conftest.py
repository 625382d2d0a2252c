"""In-process servers: the real grpc.aio server on its own event loop in a thread, a fake clock if wanted.

Tests talk to it with ordinary sync stubs or clients over 127.0.0.1. At teardown the invariant check runs
and the server stops (releasing its pool).
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable, Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import grpc
import pytest

from cache_service.app import KVCacheServer
from cache_service.config import ServiceConfig
from protos.kvcache.v1 import kvcache_pb2 as pb
from protos.kvcache.v1 import kvcache_pb2_grpc as pb_grpc


class ThreadServer:
    """A KVCacheServer serving from a background thread's event loop."""

    def __init__(self, config: ServiceConfig, clock: Callable[[], float] | None = None) -> None:
        self._loop = asyncio.new_event_loop()
        kwargs: dict[str, Any] = {} if clock is None else {"clock": clock}
        self.server = KVCacheServer(config, **kwargs)
        self._thread = threading.Thread(target=self._loop.run_forever, name="kvcache-test-server", daemon=True)
        self._thread.start()
        self.call(self.server.start())
        self.target = self.server.address
        self.channel = grpc.insecure_channel(self.target)
        self.stub: Any = pb_grpc.KVCacheServiceStub(self.channel)  # type: ignore[no-untyped-call]

    def call(self, coro: Any) -> Any:
        """Run a coroutine on the server's loop and wait for it."""
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout=30)

    def verify(self) -> pb.GetStatsResponse:
        st = self.stub.GetStats(pb.GetStatsRequest(verify=True), timeout=10)
        assert st.verified
        return st

    def stop(self) -> None:
        self.channel.close()
        self.call(self.server.stop(grace=0))
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=10)
        self._loop.close()


BASE = ServiceConfig(listen="127.0.0.1:0", page_size=4, num_pages=64, log_level="error", reap_interval=3600,
                     shm_prefix="kvrpc")


@pytest.fixture
def start_thread_server(tmp_path: Path) -> Iterator[Callable[..., ThreadServer]]:
    """Factory: start_thread_server(clock=None, **config overrides) -> a running ThreadServer whose pool file
    lives in tmp_path. Every server passes the invariant check at teardown."""
    started: list[ThreadServer] = []

    def factory(clock: Callable[[], float] | None = None, **overrides: Any) -> ThreadServer:
        config = replace(BASE, shm_dir=str(tmp_path), **overrides)
        server = ThreadServer(config, clock)
        started.append(server)
        return server

    yield factory
    for server in started:
        try:
            server.verify()
        finally:
            server.stop()
