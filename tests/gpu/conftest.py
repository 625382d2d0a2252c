"""GPU tests: marked `gpu`, skipped (with the reason) where there is no CUDA device or no cupy.

`make gpu-test` runs them on a GPU machine and prints a table with the bandwidth check.
"""

from __future__ import annotations

import pytest

from tests.integration.conftest import ServerProcess, start_server  # noqa: F401  (fixtures used here)


def cuda_unavailable() -> str:
    """Why the GPU tests cannot run here ("" when they can)."""
    try:
        import torch
    except ImportError:
        return "torch is not installed"
    if not torch.cuda.is_available():
        return "no CUDA device is visible to torch"
    try:
        import cupy  # noqa: F401
    except ImportError:
        return "cupy is not installed (pip install 'kvcache[cuda]')"
    return ""


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    reason = cuda_unavailable()
    for item in items:
        if "tests/gpu/" in item.nodeid:
            item.add_marker(pytest.mark.gpu)
            if reason:
                item.add_marker(pytest.mark.skip(reason=f"GPU test: {reason}"))


GPU_POOL = ("--backend", "cuda_ipc", "--device", "0", "--page-size", "4", "--num-pages", "512")
