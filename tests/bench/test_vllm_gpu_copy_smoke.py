"""The vLLM connector's GPU copy benchmark on a machine without a GPU: its layer tensors are laid out as
vLLM's layouts say (built here on CPU) and it says why it stops."""

from __future__ import annotations

import pytest
import torch

from bench import vllm_gpu_copy


@pytest.mark.parametrize(("layout", "strides"), [("LBNHC", (16 * 8 * 256, 8 * 256, 256, 1)),
                                                 ("LBHNC", (16 * 8 * 256, 256, 16 * 256, 1))])
def test_the_layer_tensors_have_the_layouts_memory_order(layout: str, strides: tuple[int, ...]) -> None:
    (kv,) = vllm_gpu_copy.vllm_layers(layout, blocks=3, layers=1, device="cpu")
    assert kv.k.shape == (3, 16, 8, 128) and kv.v.shape == (3, 16, 8, 128)
    # K's strides over [block, token, head, dim]; V is the same run, 128 values on
    assert kv.k.stride() == strides and kv.v.data_ptr() == kv.k.data_ptr() + 128 * 2


def test_without_a_gpu_it_exits_2_with_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    if torch.cuda.is_available():
        pytest.skip("a GPU is visible: the benchmark runs there")
    assert vllm_gpu_copy.main([]) == 2
    assert capsys.readouterr().err == "vllm_gpu_copy: no CUDA device is visible to torch\n"
