"""The GPU bandwidth benchmark on a machine without a GPU: its pool's model is valid and it says why it stops.

(On a GPU it runs in `make gpu-test`; its pool model failed there once because nothing built it on CPU.)"""

from __future__ import annotations

import pytest
import torch

from bench import gpu_bandwidth
from engine_client.reference.workload import model_flags


def test_the_pool_model_gives_the_serve_flags() -> None:
    flags = model_flags(gpu_bandwidth.POOL_MODEL)
    assert flags == ["--num-layers", "8", "--num-kv-heads", "8", "--head-dim", "128", "--dtype", "float16"]


def test_without_a_gpu_it_exits_2_with_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    if torch.cuda.is_available():
        pytest.skip("a GPU is visible: make gpu-test runs the benchmark")
    assert gpu_bandwidth.main(["--json"]) == 2
    assert capsys.readouterr().err == "gpu_bandwidth: no CUDA device is visible to torch\n"
