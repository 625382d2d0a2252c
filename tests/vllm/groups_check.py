"""Run by tests/vllm/test_sliding_window.py with the vLLM venv's python (vLLM is not importable from the test's
venv): the connector's reading of vLLM 0.32's KV cache groups, built from vLLM's own spec classes, for a hybrid
model it takes and four it refuses (one of them the groups vLLM made for a tiny Qwen3-Next-style model:
docs/attention-shapes.md, "Recurrent state"). Prints one JSON object: each case's reading or refusal."""

from __future__ import annotations

import json
import types
from typing import Any

import torch
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheGroupSpec, MambaSpec, SlidingWindowSpec

from engine_client.vllm.connector import _kv_groups


def config(*groups: tuple[list[str], Any]) -> Any:
    return types.SimpleNamespace(kv_cache_groups=[KVCacheGroupSpec(names, spec) for names, spec in groups])


def attention(cls: type, heads: int = 2, **more: Any) -> Any:
    return cls(block_size=32, num_kv_heads=heads, head_size=64, dtype=torch.float32, **more)


def gdn() -> Any:
    """A Gated DeltaNet layer's group as vLLM 0.32's CPU build made it in scripts/vllm_recurrent_probe.py."""
    return MambaSpec(block_size=256, shapes=((3, 512), (4, 64, 64)), dtypes=(torch.bfloat16, torch.float32),
                     page_size_padded=131072, mamba_cache_mode="align")


def main() -> None:
    full, window = attention(FullAttentionSpec), attention(SlidingWindowSpec, sliding_window=32)
    next_full = FullAttentionSpec(block_size=256, num_kv_heads=2, head_size=64, dtype=torch.bfloat16)
    g = _kv_groups(config((["l0", "l2"], window), (["l1", "l3"], full)))
    out: dict[str, Any] = {"hybrid": [g.attention, list(g.windows), g.of_layer, g.describe()]}
    refused = {
        "mamba": [(["l0"], MambaSpec(block_size=32, shapes=((4,),), dtypes=(torch.float32,))), (["l1"], full)],
        "two windows": [(["l0"], window), (["l1"], attention(SlidingWindowSpec, sliding_window=64))],
        "other heads": [(["l0"], window), (["l1"], attention(FullAttentionSpec, heads=4))],
        "qwen3-next": [*[([f"model.layers.{i}.linear_attn"], gdn()) for i in range(3)],
                       (["model.layers.3.self_attn.attn"], next_full)],
    }
    for name, groups in refused.items():
        try:
            _kv_groups(config(*groups))
            out[name] = "accepted"
        except ValueError as e:
            out[name] = str(e)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
