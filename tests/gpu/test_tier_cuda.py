"""On a GPU: the tier's staging path (docs/tiers.md): an offload copies a GPU page device-to-host into a
staging slot and stores it; a load verifies the value in a slot and copies it host-to-device into the page.

Real services with a GPU pool (cuda_vmm and cuda_ipc) and a disk tier; the engine writes K/V into the GPU pages
through its own mapping of the pool (`map_pool`), and checks byte for byte what a load put back."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from cache_service.tier.memory import CudaCopier, DevicePoolMemory, chunk_offsets
from engine_client import KVCacheClient, map_pool
from kvcache_common.layout import PoolLayout
from protos.kvcache.v1 import kvcache_pb2 as pb
from tests.integration.conftest import ServerProcess
from tests.tier.engine import TIER_ARGS, Engine, disk_tier, hit, prompt, write_then_evict

from .conftest import cupy_unavailable

GPU_NEEDS = "cuda_vmm"
BACKENDS = ("cuda_vmm", "cuda_ipc")


class DevicePages:
    """`kv[:, :, page]` over the GPU pool tensor: numpy in and out, copied through torch and synchronized, so
    the service's next copy of the page sees what was written."""

    def __init__(self, tensor: torch.Tensor) -> None:
        self._tensor = tensor

    def __getitem__(self, index: Any) -> np.ndarray:
        return self._tensor[index].cpu().numpy()

    def __setitem__(self, index: Any, value: np.ndarray) -> None:
        self._tensor[index] = torch.from_numpy(np.ascontiguousarray(value)).to(self._tensor.device)
        torch.cuda.synchronize()


class GpuEngine(Engine):
    """The tier tests' engine on a GPU pool: the pages it writes and reads are the service's GPU memory."""

    def map_pages(self, info: pb.GetPoolInfoResponse) -> Any:
        assert info.backend in BACKENDS and not info.shm_path
        self.client = KVCacheClient(self.target)
        self.pool = map_pool(self.client, "cuda")
        assert tuple(self.pool.tensor.shape) == self.shape and self.pool.tensor.is_cuda
        return DevicePages(self.pool.tensor)

    def close(self) -> None:
        super().close()
        self.pool.close()
        self.client.close()


def _flags(backend: str, tmp_path: Path) -> tuple[str, ...]:
    if backend == "cuda_ipc" and cupy_unavailable():
        pytest.skip(f"GPU test: {cupy_unavailable()}")
    return (*TIER_ARGS, "--backend", backend, "--device", "0", *disk_tier(tmp_path))


@pytest.mark.parametrize("backend", BACKENDS)
def test_an_evicted_gpu_prefix_comes_back_from_disk_byte_identical(
        start_server: Callable[..., ServerProcess], engines: list[Engine], tmp_path: Path, backend: str) -> None:
    p = prompt(11, 17)
    a = GpuEngine(start_server(*_flags(backend, tmp_path)).target)
    engines.append(a)
    write_then_evict(a, p)
    st = a.stats()
    assert st.evicted_pages > 0 and st.tier.offload_pages >= 4 and not st.tier.errors
    hit(a, p)


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_restarted_gpu_service_loads_what_it_offloaded_at_stop(
        start_server: Callable[..., ServerProcess], engines: list[Engine], tmp_path: Path, backend: str) -> None:
    """The stop copies the resident pages off the GPU into the tier; the next instance's new GPU pool gets them
    back on the first append."""
    p = prompt(12, 17)
    flags = _flags(backend, tmp_path)
    first = start_server(*flags)
    a = GpuEngine(first.target)
    a.turn(p)
    a.close()
    code, _ = first.terminate()
    assert code == 0
    second = start_server(*flags)
    assert second.instance_id != first.instance_id
    b = GpuEngine(second.target)
    engines.append(b)
    hit(b, p)


def test_strided_and_per_chunk_staging_move_the_same_bytes() -> None:
    """A page's chunks in one cuMemcpy2D each way, against one copy a chunk (`max_pitch = 0`), on device memory
    torch allocated in the same primary context: the bytes staged out are the page's, and a load changes that
    page only."""
    layout = PoolLayout(num_layers=4, num_kv_heads=2, head_dim=64, dtype="bfloat16", page_size=16, num_pages=9)
    kv = torch.randint(0, 256, (layout.size_bytes,), dtype=torch.uint8, device="cuda")
    torch.cuda.synchronize()

    def page_bytes(page: int) -> bytes:
        return b"".join(kv[o:o + layout.page_bytes].cpu().numpy().tobytes() for o in chunk_offsets(layout, page))

    copiers = [CudaCopier(0), CudaCopier(0)]
    copiers[1].max_pitch = 0
    assert copiers[0].max_pitch >= layout.num_pages * layout.page_bytes
    for n, copier in enumerate(copiers):
        memory = DevicePoolMemory(layout, kv.data_ptr(), copier, slots=4)
        out = memory.stage_out([3, 7])
        assert [b"".join(bytes(v) for v in b.views) for b in out.buffers] == [page_bytes(3), page_bytes(7)]
        out.finish([True, True])
        before = {p: page_bytes(p) for p in range(1, layout.num_pages)}
        load = memory.stage_in([2, 5])
        for i, buffers in enumerate(load.buffers):
            for view in buffers.views:
                view[:] = bytes([0x40 + 16 * n + i]) * len(view)
        load.finish([True, False])
        torch.cuda.synchronize()
        after = {p: page_bytes(p) for p in range(1, layout.num_pages)}
        assert after[2] == bytes([0x40 + 16 * n]) * (2 * layout.num_layers * layout.page_bytes)
        assert {p: b for p, b in after.items() if p != 2} == {p: b for p, b in before.items() if p != 2}
        memory.close()
        copier.close()


def test_eviction_staging_captures_a_gpu_page_into_pinned_memory() -> None:
    """`capture` is one strided device-to-host copy of the page's chunks into pinned host memory: the staged
    bytes are the page's, and stay so after the page is overwritten (reused by a writer)."""
    from cache_service.tier.staging import EvictionStaging

    layout = PoolLayout(num_layers=4, num_kv_heads=2, head_dim=64, dtype="bfloat16", page_size=16, num_pages=9)
    kv = torch.randint(0, 256, (layout.size_bytes,), dtype=torch.uint8, device="cuda")
    torch.cuda.synchronize()

    def page_bytes(page: int) -> bytes:
        return b"".join(kv[o:o + layout.page_bytes].cpu().numpy().tobytes() for o in chunk_offsets(layout, page))

    copier = CudaCopier(0)
    memory = DevicePoolMemory(layout, kv.data_ptr(), copier, slots=4)
    staging = EvictionStaging(memory, 2 * memory.geometry.payload_bytes)
    want = page_bytes(5)
    assert staging.capture([b"k5"], [5]) == (1, [(b"k5", 0)])
    kv.fill_(7)  # the page is reused
    torch.cuda.synchronize()
    assert b"".join(bytes(v) for v in staging.buffers(0).views) == want
    staging.close()
    memory.close()
    copier.close()


def test_a_gpu_burst_loses_nothing_it_evicts(start_server: Callable[..., ServerProcess], engines: list[Engine],
                                            tmp_path: Path) -> None:
    """Issue 42's burst on a cuda_vmm pool: a 16-page prefix, then 5 unrelated 512-token prompts each evicting
    within its call; every page of the prefix comes back from the disk tier, byte-identical."""
    from tests.integration.test_tier_e2e import BURST

    a = GpuEngine(start_server(*BURST, "--backend", "cuda_vmm", "--device", "0", *disk_tier(tmp_path)).target)
    engines.append(a)
    p = prompt(13, 16 * 16 + 1)
    a.turn(p)
    for i in range(5):
        a.turn(prompt(20 + i, 512))
    st = a.settle()
    assert (st.evicted_pages, st.evicted_unstored_pages, st.tier.staging_dropped_pages) == (128, 0, 0)
    sid, res = a.append(p)
    assert (res.cached_tokens, res.tier_tokens) == (256, 256)
    assert a.cached_pages_match(p, list(res.page_ids), 16)
    a.stub.CommitSession(pb.CommitSessionRequest(session_id=sid, abort=True), timeout=10)
