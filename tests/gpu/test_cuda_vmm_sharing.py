"""On a GPU: the pool in GPU memory is shared zero-copy between separate engine processes (cuda_vmm: each
engine receives the allocation as a file descriptor over the pool socket, then imports and maps it)."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import torch

from engine_client import KVCacheClient, map_pool
from tests.integration.conftest import ServerProcess, run_engine

from .conftest import GPU_VMM_POOL

GPU_NEEDS = "cuda_vmm"


def test_the_start_line_and_pool_info_name_the_gpu_and_the_socket(
        start_server: Callable[..., ServerProcess]) -> None:
    server = start_server(*GPU_VMM_POOL)
    with KVCacheClient(server.target) as c:
        info = c.get_pool_info()
    socket = f"@kvcache-{server.instance_id}"
    assert (info.backend, info.cuda_ipc_handle, info.shm_path, info.pool_socket) == ("cuda_vmm", b"", "", socket)
    assert info.device_uuid.startswith("GPU-") and info.offset_bytes == 0
    assert info.layout.size_bytes <= info.size_bytes < info.layout.size_bytes + (64 << 20)  # one granule at most
    assert server.banner[1] == f"  backend  cuda_vmm: GPU {info.device_uuid}, handed out on {socket} (--backend " \
                               "cuda_vmm)\n"


def test_two_processes_share_pages_through_the_service(start_server: Callable[..., ServerProcess]) -> None:
    server = start_server(*GPU_VMM_POOL)
    a = json.loads(run_engine("writer", "--target", server.target, "--tokens", "42", "--seed", "5",
                              "--device", "cuda"))
    b = json.loads(run_engine("reader", "--target", server.target, "--tokens", "42", "--seed", "5",
                              "--device", "cuda"))
    assert (b["cached_tokens"], b["prefix_hit_tokens"]) == (40, 40)
    assert b["pages"][:10] == a["pages"][:10]
    assert b["identical"] is True  # torch.equal on the GPU, then byte for byte
    assert b["device"].startswith("cuda")


def test_a_pool_socket_path_serves_engines_too(start_server: Callable[..., ServerProcess], tmp_path: Path) -> None:
    """The chart's daemonset mode: the socket is a file in a directory engines mount (hostPath)."""
    socket = tmp_path / "pool.sock"
    server = start_server(*GPU_VMM_POOL, "--pool-socket", str(socket))
    a = json.loads(run_engine("writer", "--target", server.target, "--tokens", "42", "--seed", "7",
                              "--device", "cuda"))
    b = json.loads(run_engine("reader", "--target", server.target, "--tokens", "42", "--seed", "7",
                              "--device", "cuda"))
    assert b["identical"] is True and b["pages"][:10] == a["pages"][:10]
    assert socket.is_socket()


def test_the_mapping_outlives_the_service(start_server: Callable[..., ServerProcess]) -> None:
    """An engine's import keeps the memory: the service stopping does not pull the pages from under it."""
    server = start_server(*GPU_VMM_POOL)
    with KVCacheClient(server.target) as client, map_pool(client, "cuda") as pool:
        pool.tensor[1, 0, 7].fill_(3.0)
        expected = pool.tensor[1].clone()
        code, _ = server.terminate()
        assert code == 0
        torch.cuda.synchronize()
        assert torch.equal(pool.tensor[1], expected)
        assert pool.tensor[1, 0, 7].eq(3.0).all()


def test_auto_prefers_cuda_vmm(start_server: Callable[..., ServerProcess]) -> None:
    server = start_server("--backend", "auto", "--num-pages", "64")
    assert server.banner[1].startswith("  backend  cuda_vmm: GPU GPU-")
    assert "(auto: GPU 0 (GPU-" in server.banner[1] and "exports memory as POSIX file descriptors)" in \
        server.banner[1]
