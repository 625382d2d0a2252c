"""On a GPU: `serve --model` with `--gpu-memory-fraction` (issue 20): a real model's layout, sized to a share of
the device's free memory, in GPU memory that an engine maps with that layout."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from engine_client import KVCacheClient, map_pool
from tests.integration.conftest import ServerProcess

from .conftest import cupy_unavailable

GPU_NEEDS = "cuda_vmm"
LLAMA = Path(__file__).resolve().parent.parent / "models" / "llama-3.1-8b.json"
PAGE_BYTES = 32 * 2 * 16 * 8 * 128 * 2
"""Llama 3.1 8B at 16 tokens a page: 32 layers, K and V, 8 KV heads x 128, bfloat16 (2 MiB)."""
FRACTION = 0.05


@pytest.mark.parametrize("backend", ["cuda_vmm", "cuda_ipc"])
def test_a_model_pool_sized_by_a_fraction_of_free_gpu_memory(start_server: Callable[..., ServerProcess],
                                                              backend: str) -> None:
    if backend == "cuda_ipc" and cupy_unavailable():
        pytest.skip(f"GPU test: {cupy_unavailable()}")
    free_before, _ = torch.cuda.mem_get_info(0)  # this process's context exists now; the service makes its own
    server = start_server("--model", str(LLAMA), "--backend", backend, "--device", "0", "--gpu-memory-fraction",
                          str(FRACTION))
    with KVCacheClient(server.target) as client, map_pool(client, "cuda") as pool:
        info = client.get_pool_info()
        lay = info.layout
        assert (lay.num_layers, lay.num_kv_heads, lay.head_dim, lay.dtype, lay.page_size) == \
            (32, 8, 128, "bfloat16", 16)
        # the service read the free memory after its own context took some (at most 2 GiB here)
        assert int((free_before - (2 << 30)) * FRACTION) // PAGE_BYTES <= lay.num_pages
        assert lay.num_pages <= int(free_before * FRACTION) // PAGE_BYTES
        assert tuple(pool.tensor.shape) == (32, 2, lay.num_pages, 16, 8, 128)
        assert pool.tensor.dtype == torch.bfloat16 and pool.tensor.is_cuda
        pool.tensor[31, 1, lay.num_pages - 1].fill_(1.5)  # the last page of the last layer is really there
        torch.cuda.synchronize()
        assert pool.tensor[31, 1, lay.num_pages - 1].eq(1.5).all()
    assert server.banner[1].startswith(f"  backend  {backend}: GPU GPU-")
    assert f"--backend {backend}; {FRACTION:g} of " in server.banner[1] and server.banner[1].endswith(" free)\n")
    assert server.banner[2] == f"  model    {LLAMA}: LlamaForCausalLM, 32 layers, 8 kv heads x 128, bfloat16\n"
