"""The connector reads every KV layout vLLM 0.32's GPU backends take, on CPU tensors built by vLLM's own
layout code (tests/vllm/layout_check.py runs in the vLLM venv; vLLM does not import in the test's)."""

from __future__ import annotations

import os
import subprocess

from tests.integration.conftest import REPO

from .conftest import VLLM_PYTHON

LAYOUTS = ("LBHNC", "LBNHC", "LHBNC", "BLHNC", "BLNHC", "BHLNC")


def test_each_gpu_backends_layout_reads_back_what_its_cache_write_put_there() -> None:
    env = {**os.environ, "PYTHONPATH": str(REPO), "LD_PRELOAD": str(VLLM_PYTHON.resolve().parent.parent / "lib" /
                                                                     "libiomp5.so")}
    run = subprocess.run([str(VLLM_PYTHON), "-m", "tests.vllm.layout_check"], cwd=REPO, env=env,
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    lines = run.stdout.splitlines()
    # FlashAttention and Triton attention take any layout (vLLM: supported_kv_cache_layouts() is None):
    # NHD (LBNHC), HND (LBHNC) and the layer- or block-interleaved ones, each in float16, bfloat16, float32
    assert lines[:-1] == [f"{backend} {layout} ok" for backend in ("FLASH_ATTN", "TRITON_ATTN") for layout in LAYOUTS]
    assert lines[-1] == ("mislabelled KV layout LBNHC puts the axes in memory as BNHC, but the layer tensor of shape "
                         "(5, 2, 16, 128) has strides (4096, 2048, 128, 1)")
