"""Run by tests/vllm/test_sliding_window.py with the vLLM venv's python (vLLM is not importable from the test's
venv): the connector's reading of vLLM 0.32's KV cache groups, built from vLLM's own spec classes, for a hybrid
model it takes and three it refuses. Prints one JSON object: each case's reading or refusal."""

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


def main() -> None:
    full, window = attention(FullAttentionSpec), attention(SlidingWindowSpec, sliding_window=32)
    g = _kv_groups(config((["l0", "l2"], window), (["l1", "l3"], full)))
    out: dict[str, Any] = {"hybrid": [g.attention, list(g.windows), g.of_layer, g.describe()]}
    refused = {
        "mamba": [(["l0"], MambaSpec(block_size=32, shapes=((4,),), dtypes=(torch.float32,))), (["l1"], full)],
        "two windows": [(["l0"], window), (["l1"], attention(SlidingWindowSpec, sliding_window=64))],
        "other heads": [(["l0"], window), (["l1"], attention(FullAttentionSpec, heads=4))],
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
