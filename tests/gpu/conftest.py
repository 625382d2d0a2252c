"""GPU tests: marked `gpu`, skipped (with the reason) where there is no CUDA device, or where a test module's
backend lacks its package (`GPU_NEEDS`: "cupy" for cuda_ipc, the default; "cuda_vmm" for cuda-python and a
GPU that exports memory as POSIX fds; "vllm_triton" for cuda_vmm and vLLM's Python sources, `make gpu-carry`).

`make gpu-test` runs them on a GPU machine and prints a table with the bandwidth check.
"""

from __future__ import annotations

import pytest

from tests.integration.conftest import ServerProcess, engines, start_server  # noqa: F401  (fixtures used here)


def torch_cuda_unavailable() -> str:
    """Why torch cannot use a GPU here ("" when it can)."""
    try:
        import torch
    except ImportError:
        return "torch is not installed"
    if not torch.cuda.is_available():
        return "no CUDA device is visible to torch"
    return ""


def cupy_unavailable() -> str:
    try:
        import cupy  # noqa: F401
    except ImportError:
        return "cupy is not installed (pip install 'kvcache[cuda]')"
    return ""


def cuda_vmm_unavailable(device: str = "0") -> str:
    """Why the service could not run cuda_vmm on `device` here ("" when it can), as its own probe says."""
    from cache_service.memory.select import probe_cuda_vmm

    probe = probe_cuda_vmm(device)
    return "" if probe.available else f"cuda_vmm: {probe.reason}"


def vllm_triton_unavailable() -> str:
    """Why vLLM's Triton KV cache write cannot run here ("" when it can): its Python sources on the path
    (`make gpu-carry`), with a GPU that runs cuda_vmm for the pool."""
    try:
        import vllm.v1.attention.ops.triton_reshape_and_cache_flash  # noqa: F401
    except Exception as e:  # vLLM is not installed here: its sources are carried to a GPU machine
        return f"vLLM's Triton kernels do not import ({type(e).__name__}: {e}); carry them with `make gpu-carry`"
    return cuda_vmm_unavailable()


def cuda_unavailable() -> str:
    """Why the cuda_ipc GPU tests cannot run here ("" when they can)."""
    return torch_cuda_unavailable() or cupy_unavailable()


NEEDS = {"cupy": cupy_unavailable, "cuda_vmm": cuda_vmm_unavailable, "vllm_triton": vllm_triton_unavailable}


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    no_torch = torch_cuda_unavailable()
    reasons: dict[str, str] = {}
    for item in items:
        if "tests/gpu/" in item.nodeid:
            item.add_marker(pytest.mark.gpu)
            needs = getattr(item.module, "GPU_NEEDS", "cupy")
            reason = no_torch or reasons.setdefault(needs, NEEDS[needs]())
            if reason:
                item.add_marker(pytest.mark.skip(reason=f"GPU test: {reason}"))


GPU_POOL = ("--backend", "cuda_ipc", "--device", "0", "--page-size", "4", "--num-pages", "512")
GPU_VMM_POOL = ("--backend", "cuda_vmm", "--device", "0", "--page-size", "4", "--num-pages", "512")
HOST_POOL = ("--backend", "host_shm", "--page-size", "4", "--num-pages", "512")
