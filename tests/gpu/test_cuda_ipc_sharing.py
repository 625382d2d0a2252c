"""On a GPU: the pool in GPU memory is shared zero-copy between separate engine processes (cuda_ipc)."""

from __future__ import annotations

import json
from collections.abc import Callable

from engine_client import KVCacheClient
from tests.integration.conftest import ServerProcess, run_engine

from .conftest import GPU_POOL, cuda_vmm_unavailable


def test_the_start_line_and_pool_info_name_the_gpu(start_server: Callable[..., ServerProcess]) -> None:
    server = start_server(*GPU_POOL)
    with KVCacheClient(server.target) as c:
        info = c.get_pool_info()
    assert info.backend == "cuda_ipc" and len(info.cuda_ipc_handle) == 64
    assert info.device_uuid.startswith("GPU-") and info.offset_bytes == 0
    assert server.banner[1].startswith(f"  backend  cuda_ipc: GPU {info.device_uuid} (--backend cuda_ipc)")


def test_two_processes_share_pages_through_the_service(start_server: Callable[..., ServerProcess]) -> None:
    server = start_server(*GPU_POOL)
    a = json.loads(run_engine("writer", "--target", server.target, "--tokens", "42", "--seed", "5",
                              "--device", "cuda"))
    b = json.loads(run_engine("reader", "--target", server.target, "--tokens", "42", "--seed", "5",
                              "--device", "cuda"))
    assert (b["cached_tokens"], b["prefix_hit_tokens"]) == (40, 40)
    assert b["pages"][:10] == a["pages"][:10]
    assert b["identical"] is True  # torch.equal on the GPU, then byte for byte
    assert b["device"].startswith("cuda")


def test_auto_picks_a_gpu_backend_when_a_gpu_is_visible(start_server: Callable[..., ServerProcess]) -> None:
    """cuda_vmm where the GPU exports memory as POSIX fds (tests/gpu/test_cuda_vmm_sharing.py), else cuda_ipc."""
    server = start_server("--backend", "auto", "--num-pages", "64")
    backend = "cuda_ipc" if cuda_vmm_unavailable() else "cuda_vmm"
    assert server.banner[1].startswith(f"  backend  {backend}: GPU GPU-") and "(auto: " in server.banner[1]
