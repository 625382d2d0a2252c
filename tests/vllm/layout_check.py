"""Run by tests/vllm/test_layouts.py with the vLLM venv's python (vLLM is not importable from the test's venv):
for each GPU attention backend vLLM 0.32 describes and each KV cache layout it takes, build a model's layer
tensors on CPU with vLLM's own allocation code (`compute_layout_strides`, `create_kv_cache_views`), write
known K/V into them the way the backend's cache write does (`kv.transpose(1, 2).split(head_size, -1)`, the
shape and order the backends declare), and read them back through the connector's view
(`engine_client.vllm.transfer.layer_kv`, given only vLLM's layout description). Prints one line per case:

    FLASH_ATTN LBNHC ok
"""

from __future__ import annotations

import importlib
import sys

import torch

from engine_client.vllm.transfer import KVLayoutError, layer_kv

BACKENDS = {"FLASH_ATTN": ("flash_attn", "FlashAttentionBackend"),
            "TRITON_ATTN": ("triton_attn", "TritonAttentionBackend")}
"""The GPU backends whose class imports on vLLM's CPU build (FlashInfer's module needs the flashinfer
package: its layouts, "any" and LBHNC/BLHNC on SM100, are among the ones every case here covers)."""

LAYERS, BLOCKS, BLOCK, HEADS, DIM = 3, 5, 16, 2, 64


def layouts(backend: type) -> list[object]:
    from vllm.v1.kv_cache_layout import KVCacheLayout

    declared = backend.supported_kv_cache_layouts()
    return list(declared) if declared is not None else list(KVCacheLayout)  # None: "any layout"


def tensors(layout: object, dtype: torch.dtype) -> list[torch.Tensor]:
    """The layer tensors vLLM's worker would get, from vLLM's own layout code."""
    from vllm.v1.kv_cache_interface import (
        FullAttentionSpec,
        KVCacheTensor,
        compute_layout_strides,
        create_kv_cache_views,
    )

    spec = FullAttentionSpec(block_size=BLOCK, num_kv_heads=HEADS, head_size=DIM, dtype=dtype)
    layer_stride, block_stride, *_ = compute_layout_strides(spec, BLOCKS, LAYERS, layout)
    size = LAYERS * BLOCKS * spec.page_size_bytes
    names = [f"model.layers.{i}.self_attn.attn" for i in range(LAYERS)]
    raw = torch.zeros(size, dtype=torch.int8)
    tensor = KVCacheTensor(size=size, layers=names, layer_stride=layer_stride, block_stride=block_stride)
    return create_kv_cache_views(raw, spec, BLOCKS, layout, tensor)


def check(name: str, layout: object, dtype: torch.dtype) -> str:
    views = tensors(layout, dtype)
    gen = torch.Generator().manual_seed(0)
    slots = torch.randperm(BLOCKS * BLOCK, generator=gen)[: 2 * BLOCK]
    for i, kv in enumerate(views):
        key = torch.randn(slots.numel(), HEADS, DIM, generator=gen).to(dtype)
        value = torch.randn(slots.numel(), HEADS, DIM, generator=gen).to(dtype)
        key_cache, value_cache = kv.transpose(1, 2).split(DIM, dim=-1)  # the backends' cache write
        key_cache[slots // BLOCK, slots % BLOCK] = key
        value_cache[slots // BLOCK, slots % BLOCK] = value
        view = layer_kv(kv, layout=layout.name, order=tuple(layout.layer_view_order), packing="split",  # type: ignore[attr-defined]
                        block_size=BLOCK, num_heads=HEADS, head_dim=DIM)
        if view.k.data_ptr() != kv.data_ptr():
            return f"layer {i}: the view is not on the layer tensor's memory"
        if not (torch.equal(view.k[slots // BLOCK, slots % BLOCK], key)
                and torch.equal(view.v[slots // BLOCK, slots % BLOCK], value)):
            return f"layer {i}: read back other values"
        others = torch.ones(BLOCKS, BLOCK, dtype=torch.bool)
        others[slots // BLOCK, slots % BLOCK] = False
        if view.k[others].any() or view.v[others].any():
            return f"layer {i}: other slots are not empty"
    return "ok"


def main() -> int:
    from vllm.v1.kv_cache_layout import KVCacheLayout

    for name, (module, cls) in BACKENDS.items():
        backend = getattr(importlib.import_module(f"vllm.v1.attention.backends.{module}"), cls)
        assert backend.get_name() == name
        for layout in layouts(backend):
            results = {check(name, layout, dtype) for dtype in (torch.float16, torch.bfloat16, torch.float32)}
            print(name, layout.name, ",".join(sorted(results)))
    # a tensor described with another layout than its own is refused, naming the layout
    kv = tensors(KVCacheLayout.LBHNC, torch.float16)[0]
    try:
        layer_kv(kv, layout="LBNHC", order=tuple(KVCacheLayout.LBNHC.layer_view_order), packing="split",
                 block_size=BLOCK, num_heads=HEADS, head_dim=DIM)
        print("mislabelled accepted")
    except KVLayoutError as e:
        print("mislabelled", e)
    return 0


if __name__ == "__main__":
    sys.exit(main())
