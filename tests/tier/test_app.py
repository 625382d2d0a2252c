"""The tier inside a running service (in this process, real grpc.aio server, real host_shm pool): what the
tier does shows in GetStats over gRPC; stopping drains queued offloads before the pool goes, so a restarted
service's tier holds them."""

from __future__ import annotations

import asyncio
from pathlib import Path

import grpc
import numpy as np

from cache_service.app import build_server
from cache_service.config import ServiceConfig
from cache_service.tier import DiskTier
from cache_service.tier.memory import geometry
from cache_service.tier.segment import SEGMENT_HEADER_BYTES
from protos.kvcache.v1 import kvcache_pb2 as pb
from protos.kvcache.v1 import kvcache_pb2_grpc as pb_grpc
from tests.tier.node import keys_for


def _config(tmp_path: Path) -> ServiceConfig:
    return ServiceConfig(listen="127.0.0.1:0", num_pages=32, page_size=4, num_layers=2, num_kv_heads=2, head_dim=8,
                         backend="host_shm", shm_dir=str(tmp_path), log_level="error", reap_interval=60,
                         tier="disk", tier_dir=str(tmp_path / "tier"), tier_bytes=1 << 20)


def test_offloads_and_loads_show_in_get_stats_and_survive_a_restart(tmp_path: Path) -> None:
    cfg = _config(tmp_path)
    keys = keys_for(21, 3)

    async def scenario() -> None:
        server, port = await build_server(cfg)
        try:
            assert server.tier is not None and server.pool is not None
            kv = np.memmap(server.pool.handle().shm_path, dtype=np.float16, mode="r+", shape=cfg.layout().shape)
            kv[:, :, 1:4] = np.arange(kv[:, :, 1:4].size, dtype=np.float16).reshape(kv[:, :, 1:4].shape)
            done: asyncio.Future[object] = asyncio.get_running_loop().create_future()
            assert server.tier.offload([(k, i + 1) for i, k in enumerate(keys)], done.set_result) == 3
            await done
            result = await server.tier.load(keys[:2], [10, 11]).wait()
            assert result is not None and result.loaded == 2
            assert np.array_equal(kv[:, :, 10:12], kv[:, :, 1:3])
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
                stub = pb_grpc.KVCacheServiceStub(channel)  # type: ignore[no-untyped-call]
                st = (await stub.GetStats(pb.GetStatsRequest(verify=True), timeout=10)).tier
            value = geometry(cfg.layout()).value_bytes
            assert (st.backend, st.up, st.offload_pages, st.offload_bytes, st.load_pages, st.hit_pages) == (
                "disk", True, 3, 3 * value, 2, 2)
            assert (st.stored_values, st.stored_bytes, st.capacity_bytes) == (
                3, SEGMENT_HEADER_BYTES + 3 * value, 1 << 20)
            del kv
        finally:
            await server.stop(grace=1)

    asyncio.run(scenario())
    restarted = DiskTier(tmp_path / "tier", 1 << 20, geometry(cfg.layout()))
    assert restarted.exists([keys]) == [3]
    restarted.close()


def test_stop_drains_queued_offloads_before_the_pool_goes(tmp_path: Path) -> None:
    cfg = _config(tmp_path)
    keys = keys_for(22, 20)

    async def scenario() -> None:
        server, _ = await build_server(cfg)
        assert server.tier is not None
        for i, key in enumerate(keys):  # 20 separate offloads, queued faster than the worker stores them
            assert server.tier.offload([(key, 1 + i)]) == 1
        await server.stop(grace=5)

    asyncio.run(scenario())
    restarted = DiskTier(tmp_path / "tier", 1 << 20, geometry(cfg.layout()))
    assert restarted.exists([keys]) == [20]
    restarted.close()
