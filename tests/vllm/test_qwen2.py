"""The same connector with another model family: a tiny Qwen2 (attention biases), vLLM alone vs on kvcache."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.integration.conftest import ServerProcess

from .conftest import VllmEngine, drained, request, tokens
from .test_connector import hits, prompt

pytestmark = [pytest.mark.xdist_group("vllm-c"), pytest.mark.timeout(900)]  # real vLLM engines start in ~20-60 s


def test_qwen2_tokens_equal_vllm_alone_and_the_next_engine_loads_the_prompts(
        models: dict[str, Path], engine_log_dir: Path, kvcache: ServerProcess) -> None:
    model = models["qwen2"]
    lengths = (33, 80, 128)
    batch = [request(prompt(100 + seed, n), 6) for seed, n in enumerate(lengths)]
    alone = VllmEngine(model, engine_log_dir / "qwen2-alone.log")
    try:
        want = tokens(alone.generate(batch))
    finally:
        alone.close()
    for i in range(2):
        engine = VllmEngine(model, engine_log_dir / f"qwen2-{i}.log", kvcache=kvcache.target)
        try:
            out = engine.generate(batch)
        finally:
            engine.close()
        assert tokens(out) == want
        assert [o["num_cached_tokens"] for o in out] == ([0, 0, 0] if i == 0 else [hits(n) for n in lengths])
        drained(kvcache.target)
