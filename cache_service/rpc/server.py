"""Server lifecycle: pool + core + grpc.aio server, health, reflection, reaper, metrics, shutdown.

Start: create the pool (removing stale files of our prefix), bind, mark SERVING. Stop: health
NOT_SERVING, stop accepting and give in-flight RPCs `grace` seconds, release every lease (sessions
closed), then free the pool. The pool is never freed while the server can still hand out its pages.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from collections.abc import Callable

import grpc
import grpc.aio
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1._async import HealthServicer
from grpc_reflection.v1alpha import reflection

from cache_service import __version__
from cache_service.config import ServiceConfig
from cache_service.core import CoreConfig, KVCacheCore
from cache_service.log import get_logger
from cache_service.memory import PoolBackend
from cache_service.memory.select import PoolChoice, create_pool
from cache_service.metrics import Metrics, serve_metrics
from cache_service.rpc.interceptor import ServiceInterceptor
from cache_service.rpc.servicer import KVCacheServicer
from protos.kvcache.v1 import kvcache_pb2 as pb
from protos.kvcache.v1 import kvcache_pb2_grpc as pb_grpc

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["KVCacheService"].full_name


def core_config(config: ServiceConfig) -> CoreConfig:
    return CoreConfig(
        num_pages=config.resolved_num_pages,
        page_size=config.page_size,
        session_timeout_seconds=config.session_timeout,
        lease_ttl_seconds=config.lease_ttl,
        session_budget_pages=config.session_budget_pages,
        max_session_tokens=config.max_session_tokens,
        eviction_policy=config.eviction_policy,
        demote_idle_sessions=config.demote_idle_sessions,
    )


class KVCacheServer:
    """One service instance. `await start()`, then `await stop()` (idempotent)."""

    def __init__(self, config: ServiceConfig, *, clock: Callable[[], float] = time.monotonic,
                 pool_factory: Callable[[ServiceConfig, str], PoolChoice] = create_pool) -> None:
        self.config = config
        self.instance_id = uuid.uuid4().hex[:16]
        self._log = get_logger("kvcache.server")
        self._clock = clock
        self._pool_factory = pool_factory
        self.pool: PoolBackend | None = None
        self.pool_why = ""
        self.core = KVCacheCore(core_config(config), clock)
        self._server: grpc.aio.Server | None = None
        self._health = HealthServicer()
        self._reaper: asyncio.Task[None] | None = None
        self._metrics_server: asyncio.Server | None = None
        self.address = ""
        self.port = 0
        self.metrics_port = 0
        self._stopped = False

    async def start(self) -> None:
        cfg = self.config
        choice = self._pool_factory(cfg, self.instance_id)
        self.pool, self.pool_why = choice.pool, choice.why
        for path in choice.removed_stale:
            self._log.warning("removed_stale_pool_file", path=path)
        try:
            await self._start_server()
        except BaseException:
            self.pool.close()
            raise
        self._log.info("serving", address=self.address, instance_id=self.instance_id,
                       backend=self.pool.name, pool_pages=cfg.resolved_num_pages)

    async def _start_server(self) -> None:
        cfg = self.config
        assert self.pool is not None
        metrics = Metrics(self.core.stats, {"instance_id": self.instance_id, "backend": self.pool.name,
                                            "version": __version__})
        servicer = KVCacheServicer(self.core, self.pool.layout, self.pool.handle(), instance_id=self.instance_id,
                                   max_request_tokens=cfg.max_request_tokens, clock=self._clock)
        server = grpc.aio.server(
            interceptors=[ServiceInterceptor(metrics, instance_id=self.instance_id, auth_token=cfg.auth_token)],
            options=[
                ("grpc.max_receive_message_length", cfg.max_message_bytes),
                ("grpc.max_send_message_length", cfg.max_message_bytes),
                ("grpc.so_reuseport", 0),
                ("grpc.keepalive_permit_without_calls", 1),
                ("grpc.http2.min_ping_interval_without_data_ms", 5000),
            ],
        )
        pb_grpc.add_KVCacheServiceServicer_to_server(servicer, server)
        health_pb2_grpc.add_HealthServicer_to_server(self._health, server)
        reflection.enable_server_reflection(
            (SERVICE_NAME, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name, reflection.SERVICE_NAME),
            server,
        )
        try:
            port = server.add_insecure_port(cfg.listen)
        except RuntimeError as e:
            raise OSError(f"cannot listen on {cfg.listen}: {e}") from None
        if cfg.listen.startswith("unix:"):
            self.address = cfg.listen
        else:
            host = cfg.listen.rpartition(":")[0]
            self.port = port
            self.address = f"{host}:{port}"
        await server.start()
        self._server = server
        for name in ("", SERVICE_NAME):
            await self._health.set(name, health_pb2.HealthCheckResponse.SERVING)
        self._reaper = asyncio.create_task(self._reap_forever(), name="kvcache-reaper")
        if cfg.metrics_port:
            self._metrics_server = await serve_metrics(metrics, cfg.metrics_host, cfg.metrics_port)
            self.metrics_port = self._metrics_server.sockets[0].getsockname()[1]

    async def _reap_forever(self) -> None:
        interval = self.config.reap_interval
        while True:
            await asyncio.sleep(interval)
            try:
                res = self.core.reap()
            except Exception:
                self._log.exception("reaper_failed")
                continue
            if res.session_ids or res.engine_ids:
                self._log.info("reaped", sessions=list(res.session_ids), expired_engines=list(res.engine_ids))

    async def wait(self) -> None:
        if self._server is not None:
            await self._server.wait_for_termination()

    async def stop(self, grace: float | None = None) -> None:
        if self._stopped:
            return
        self._stopped = True
        grace = self.config.grace_period if grace is None else grace
        self._log.info("draining", grace_seconds=grace)
        await self._health.enter_graceful_shutdown()
        if self._server is not None:
            await self._server.stop(grace)
        if self._reaper is not None:
            self._reaper.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._reaper
        if self._metrics_server is not None:
            self._metrics_server.close()
            await self._metrics_server.wait_closed()
        released = 0
        for engine in self.core.list_engines():
            released += len(self.core.unregister_engine(engine.engine_id))
        if self.pool is not None:
            self.pool.close()
        self._log.info("stopped", released_sessions=released, instance_id=self.instance_id)


async def build_server(config: ServiceConfig, **kwargs: object) -> tuple[KVCacheServer, int]:
    """Create and start a server; returns it and its bound TCP port (0 for a unix socket)."""
    server = KVCacheServer(config, **kwargs)  # type: ignore[arg-type]
    await server.start()
    return server, server.port
