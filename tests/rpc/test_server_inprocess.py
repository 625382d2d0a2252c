"""The server in this process (real grpc.aio server, asyncio client), with a fake GPU pool."""

from __future__ import annotations

import asyncio

from grpc_health.v1 import health_pb2

from cache_service.app import KVCacheServer, build_server
from cache_service.config import ServiceConfig
from cache_service.memory.cuda_ipc import CudaIpcPool
from cache_service.memory.select import PoolChoice
from cache_service.rpc.server import SERVICE_NAME
from engine_client import AsyncKVCacheClient
from tests.fakes import UUIDS, FakeDriver

CONFIG = ServiceConfig(listen="127.0.0.1:0", num_pages=16, page_size=4, backend="cuda_ipc", log_level="error",
                       reap_interval=60)


def fake_gpu(driver: FakeDriver):  # type: ignore[no-untyped-def]
    return lambda cfg, instance_id: PoolChoice(CudaIpcPool(cfg.layout(), device=cfg.device, driver=driver),
                                               "fake GPU")


def test_get_pool_info_publishes_the_cuda_ipc_handle_uuid_size_and_offset() -> None:
    async def scenario() -> None:
        server, port = await build_server(CONFIG, pool_factory=fake_gpu(FakeDriver()))
        try:
            async with AsyncKVCacheClient(f"127.0.0.1:{port}") as c:
                info = await c.get_pool_info()
        finally:
            await server.stop(grace=0)
        assert (info.backend, info.device_uuid, info.offset_bytes, info.shm_path) == ("cuda_ipc", UUIDS[0], 0, "")
        assert info.cuda_ipc_handle == bytes(range(64))
        assert info.size_bytes == CONFIG.layout().size_bytes == 2 * 2 * 16 * 4 * 4 * 64 * 2
        assert info.instance_id == server.instance_id

    asyncio.run(scenario())


def test_shutdown_drains_stops_releases_leases_and_only_then_frees_the_pool() -> None:
    async def scenario() -> list[tuple[int, int, int]]:
        driver = FakeDriver()
        server = KVCacheServer(CONFIG, pool_factory=fake_gpu(driver))
        await server.start()
        async with AsyncKVCacheClient(server.address) as c:
            await c.register_engine("e1")
            await c.open_session("s1")
            await c.append_session("s1", [1, 2, 3], 4)  # a turn in flight at shutdown
        seen: list[tuple[int, int, int]] = []

        def at_free() -> None:
            st = server.core.stats()
            seen.append((st.engines, st.sessions, server.health._server_status[SERVICE_NAME]))

        driver.on_free = at_free
        await server.stop(grace=0.5)
        await server.stop()  # idempotent
        return seen

    # Freed once, after every lease was released and with health already NOT_SERVING.
    assert asyncio.run(scenario()) == [(0, 0, health_pb2.HealthCheckResponse.NOT_SERVING)]
