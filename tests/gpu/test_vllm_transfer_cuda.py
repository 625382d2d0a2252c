"""On a GPU: the vLLM connector's copies (engine_client/vllm/transfer.py) between a real GPU pool and paged KV
on the same device take the torch path (index_select / index_put_ / index_copy_ on device tensors) and move
exactly what the CPU path moves, bit for bit.

vLLM's CUDA build is not installed here, so the "vLLM" side is a device tensor with K and V as `[blocks,
block_size, heads, dim]` views; how the connector views vLLM 0.32's layer tensors in each `KVCacheLayout`
is checked on CPU tensors built by vLLM's own layout code (tests/vllm/test_layouts.py, docs/vllm.md)."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

from engine_client import KVCacheClient, map_pool
from engine_client.vllm.scheduler import StepPlan
from engine_client.vllm.transfer import HostStaging, LayerKV, TransferIndex, Transfers, load_layer, save_layer
from engine_client.vllm.worker import WorkerSide, head_shard
from tests.integration.conftest import ServerProcess

from .conftest import GPU_VMM_POOL, HOST_POOL

GPU_NEEDS = "cuda_vmm"
BS = 8
"""vLLM's block size in this test: two of the pool's 4-token pages."""


def _flash(kv: torch.Tensor) -> LayerKV:
    return LayerKV(k=kv[0], v=kv[1])


def test_loads_and_saves_on_the_gpu_move_what_the_cpu_path_moves(
        start_server: Callable[..., ServerProcess]) -> None:
    server = start_server(*GPU_VMM_POOL)
    with KVCacheClient(server.target) as client, map_pool(client, "cuda") as pool:
        layers, _, num_pages, page_size, heads, dim = pool.tensor.shape
        assert pool.tensor.is_cuda and (layers, page_size) == (2, 4)
        gen = torch.Generator(device=pool.tensor.device).manual_seed(3)
        layer = pool.tensor[1]  # [K/V, pages, page_size, heads, dim] of the pool's second layer
        layer[:, 1:40].copy_(torch.randn(2, 39, page_size, heads, dim, generator=gen, device=layer.device))
        # request 1: positions [4, 22) on pages 7, 3, 12, 30, 5 and blocks 6, 2, 9; request 2: [40, 43) on page 21
        t = Transfers.build([(4, 22, np.array([7, 3, 12, 30, 5], np.int32), np.array([6, 2, 9], np.int32)),
                             (40, 43, np.array([21], np.int32), np.array([4], np.int32))])
        gpu_index = TransferIndex.build(t, page_size=page_size, block_size=BS, device=layer.device)
        cpu_index = TransferIndex.build(t, page_size=page_size, block_size=BS)
        assert gpu_index.pool_slots.is_cuda and len(gpu_index) == 21

        vllm = torch.zeros(2, 10, BS, heads, dim, dtype=layer.dtype, device=layer.device)
        load_layer(layer, _flash(vllm), gpu_index)
        want = torch.zeros(2, 10, BS, heads, dim, dtype=layer.dtype)
        load_layer(layer.cpu(), _flash(want), cpu_index)
        torch.cuda.synchronize()
        assert torch.equal(vllm.cpu(), want) and want.any()
        # positions 4..7: page 7 -> block 6, offsets 4..7; 40..42: page 21 -> block 4, offsets 0..2
        assert torch.equal(vllm[0, 6, 4:8], layer[0, 7]) and torch.equal(vllm[1, 4, :3], layer[1, 21, :3])

        computed = torch.randn(2, 10, BS, heads, dim, generator=gen, device=layer.device).to(layer.dtype)
        before = layer.cpu()
        save_layer(_flash(computed), layer, gpu_index)
        expected = before.clone()
        save_layer(_flash(computed.cpu()), expected, cpu_index)
        torch.cuda.synchronize()
        assert torch.equal(layer.cpu(), expected) and not torch.equal(expected, before)
        untouched = [p for p in range(num_pages) if p not in (7, 3, 12, 30, 5, 21)]
        assert torch.equal(layer[:, untouched].cpu(), before[:, untouched])


def test_a_host_pool_serves_gpu_kv_through_pinned_staging(start_server: Callable[..., ServerProcess]) -> None:
    """A host_shm pool as the CPU tier of a GPU engine: loads and saves of every layer go through pinned
    buffers (at most `budget_bytes` of them: a save past it flushes early), reach the same bytes as the CPU
    path, and the pool holds the saves only once they are flushed."""
    server = start_server(*HOST_POOL)
    with KVCacheClient(server.target) as client, map_pool(client) as pool:
        layers, _, _, page_size, heads, dim = pool.tensor.shape
        assert not pool.tensor.is_cuda and (layers, page_size) == (2, 4)
        gen = torch.Generator().manual_seed(5)
        for i in range(layers):
            pool.tensor[i, :, 1:40].copy_(torch.randn(2, 39, page_size, heads, dim, generator=gen))
        t = Transfers.build([(4, 22, np.array([7, 3, 12, 30, 5], np.int32), np.array([6, 2, 9], np.int32)),
                             (40, 43, np.array([21], np.int32), np.array([4], np.int32))])
        index = TransferIndex.build(t, page_size=page_size, block_size=BS, device="cuda", pool_device="cpu")
        cpu_index = TransferIndex.build(t, page_size=page_size, block_size=BS)
        assert index.blocks.is_cuda and not index.pool_slots.is_cuda
        # a layer's 21 positions take 2 x 21 x heads x dim x 2 bytes = 21,504: one 32 KiB buffer, the budget
        staging = HostStaging(budget_bytes=32768)

        vllm = [torch.zeros(2, 10, BS, heads, dim, dtype=pool.tensor.dtype, device="cuda") for _ in range(layers)]
        for i in range(layers):
            load_layer(pool.tensor[i], _flash(vllm[i]), index, staging)
        torch.cuda.synchronize()
        for i in range(layers):
            want = torch.zeros(2, 10, BS, heads, dim, dtype=pool.tensor.dtype)
            load_layer(pool.tensor[i], _flash(want), cpu_index)
            assert torch.equal(vllm[i].cpu(), want) and want.any()
        assert staging.pinned_bytes == 32768  # the second layer waited for the first's copy and reused its buffer

        before = pool.tensor.clone()
        computed = [torch.randn(2, 10, BS, heads, dim, device="cuda").to(pool.tensor.dtype) for _ in range(layers)]
        expected = before.clone()
        for i in range(layers):
            save_layer(_flash(computed[i]), pool.tensor[i], index, staging)
            save_layer(_flash(computed[i].cpu()), expected[i], cpu_index)
        # the second layer's save found the budget spent: the first layer's save was flushed to make room
        assert staging.flushes == 1 and torch.equal(pool.tensor[0], expected[0])
        assert torch.equal(pool.tensor[1], before[1])
        staging.flush()
        assert staging.flushes == 2 and torch.equal(pool.tensor, expected) and not torch.equal(expected, before)
        assert staging.pinned_bytes == 32768


def test_the_worker_stages_a_host_pool_for_gpu_kv_and_reports_saves_once_they_reach_the_pool(
        start_server: Callable[..., ServerProcess]) -> None:
    """The connector's worker with GPU layers over a host_shm pool: it stages (made when it maps the pool),
    a step's saves reach the pool at the step's end, before it reports them saved, and loads come back."""
    server = start_server(*HOST_POOL)
    worker = WorkerSide(lambda: KVCacheClient(server.target), block_size=BS, shard=head_shard(0, 1, 4))
    gen = torch.Generator(device="cuda").manual_seed(9)
    tensors = [torch.randn(2, 10, BS, 4, 64, generator=gen, device="cuda").half() for _ in range(2)]
    worker.register([(f"layer.{i}", _flash(t)) for i, t in enumerate(tensors)], num_kv_heads=4, head_dim=64,
                    dtype=torch.float16)
    try:
        with KVCacheClient(server.target) as client, map_pool(client) as pool:
            instance = client.get_pool_info().instance_id
            t = Transfers.build([(4, 22, np.array([7, 3, 12, 30, 5], np.int32), np.array([6, 2, 9], np.int32)),
                                 (40, 43, np.array([21], np.int32), np.array([4], np.int32))])
            cpu_index = TransferIndex.build(t, page_size=4, block_size=BS)
            before = pool.tensor.clone()
            expected = before.clone()
            for i, kv in enumerate(tensors):
                save_layer(_flash(kv.cpu()), expected[i], cpu_index)

            worker.begin(StepPlan(instance_id=instance, page_size=4, saves=t, save_reqs=["a", "b"]))
            for i in range(2):
                worker.save(f"layer.{i}")
            assert torch.equal(pool.tensor, before)  # staged: the pool is written at the step's end
            report = worker.end()
            assert report is not None and report.saved == {"a": (4, 22), "b": (40, 43)} and not report.save_failed
            assert torch.equal(pool.tensor, expected) and not torch.equal(expected, before)

            for kv in tensors:
                kv.zero_()
            worker.begin(StepPlan(instance_id=instance, page_size=4, loads=t, load_reqs=["a", "b"]))
            for i in range(2):
                worker.load(f"layer.{i}")
            report = worker.end()
            assert report is not None and not report.load_failed
            torch.cuda.synchronize()
            for i, kv in enumerate(tensors):
                want = torch.zeros(2, 10, BS, 4, 64, dtype=torch.float16)
                load_layer(pool.tensor[i], _flash(want), cpu_index)
                assert torch.equal(kv.cpu(), want) and want.any()
            c = worker.counters
            assert (c.save_tokens, c.load_tokens, c.save_pages, c.load_pages) == (21, 21, 6, 6)
            assert (c.save_errors, c.load_errors) == (0, 0)
    finally:
        worker.close()
