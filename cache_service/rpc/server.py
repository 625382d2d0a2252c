"""The gRPC server around a core: the servicer, the interceptor, health and reflection, bound to one address.

`RpcServer` knows nothing of flags or pools' creation: start-up (`cache_service.app`) hands it the core,
the pool's layout and handle, and `RpcSettings`.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import grpc
import grpc.aio
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1._async import HealthServicer
from grpc_reflection.v1alpha import reflection

from cache_service.core import KVCacheCore
from cache_service.memory import PoolHandle, PoolLayout
from cache_service.metrics import Metrics
from cache_service.rpc.interceptor import ServiceInterceptor
from cache_service.rpc.servicer import KVCacheServicer
from protos.kvcache.v1 import kvcache_pb2 as pb

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["KVCacheService"].full_name
HEALTH_NAME = health_pb2.DESCRIPTOR.services_by_name["Health"].full_name


@dataclass(frozen=True)
class RpcSettings:
    listen: str
    """host:port (port 0 picks a free one) or unix:/path."""
    auth_token: str = ""
    max_request_tokens: int = 1 << 20
    max_step_ops: int = 4096
    max_message_bytes: int = 64 << 20


class RpcServer:
    """A grpc.aio server serving `core`. `bind()`, `start()`, then `stop(grace)`."""

    def __init__(self, core: KVCacheCore, layout: PoolLayout, handle: PoolHandle, settings: RpcSettings, *,
                 instance_id: str, metrics: Metrics, clock: Callable[[], float] = time.monotonic) -> None:
        self.settings = settings
        self.health = HealthServicer()
        self.address = ""
        self.port = 0
        servicer = KVCacheServicer(core, layout, handle, instance_id=instance_id,
                                   max_request_tokens=settings.max_request_tokens,
                                   max_step_ops=settings.max_step_ops, metrics=metrics, clock=clock)
        interceptor = ServiceInterceptor(metrics, instance_id=instance_id, auth_token=settings.auth_token)
        self._server = grpc.aio.server(
            options=[
                ("grpc.max_receive_message_length", settings.max_message_bytes),
                ("grpc.max_send_message_length", settings.max_message_bytes),
                ("grpc.so_reuseport", 0),
                ("grpc.keepalive_permit_without_calls", 1),
                ("grpc.http2.min_ping_interval_without_data_ms", 5000),
            ],
        )
        self._server.add_generic_rpc_handlers((interceptor.service_handler(servicer),))
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self._server)
        reflection.enable_server_reflection((SERVICE_NAME, HEALTH_NAME, reflection.SERVICE_NAME), self._server)

    def bind(self) -> str:
        """Bind the listen address; returns the bound address (the real port when port 0 was asked)."""
        listen = self.settings.listen
        try:
            port = self._server.add_insecure_port(listen)
        except RuntimeError as e:
            raise OSError(f"cannot listen on {listen}: {e}") from None
        if listen.startswith("unix:"):
            self.address = listen
        else:
            self.port = port
            self.address = f"{listen.rpartition(':')[0]}:{port}"
        return self.address

    async def start(self) -> None:
        await self._server.start()
        for name in ("", SERVICE_NAME):
            await self.health.set(name, health_pb2.HealthCheckResponse.SERVING)

    async def wait(self) -> None:
        await self._server.wait_for_termination()

    async def stop(self, grace: float) -> None:
        """Health NOT_SERVING, stop accepting, give in-flight RPCs `grace` seconds."""
        await self.health.enter_graceful_shutdown()
        await self._server.stop(grace)
