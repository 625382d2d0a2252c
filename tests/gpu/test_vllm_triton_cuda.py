"""On a GPU, with vLLM's own Triton cache write: a layer's K/V written by `triton_reshape_and_cache_flash`
(what vLLM's Triton attention backend runs to fill its cache) into layer tensors allocated by vLLM's own
layout code (`compute_layout_strides` / `create_kv_cache_views`), NHD and HND, is read by the connector's
view of that layout, saved into a real `cuda_vmm` pool and loaded back into fresh layer tensors byte for
byte; vLLM's Triton attention over the loaded cache gives the output it gives over the written one.

vLLM's CUDA build cannot be installed on a GPU machine without a registry, but its Python sources (the
Triton kernels are Python) can be carried there: `make gpu-carry` packs them, `make gpu-test` runs this
with them on the path (docs/gpu.md). Without them these tests skip, saying so.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import torch

from engine_client import KVCacheClient, map_pool
from engine_client.vllm.transfer import LayerKV, TransferIndex, Transfers, layer_kv, load_layer, save_layer
from tests.integration.conftest import ServerProcess

GPU_NEEDS = "vllm_triton"
LAYERS, HEADS, DIM, BLOCK, BLOCKS = 2, 4, 128, 16, 12
Q_HEADS = 8
"""A GQA model: 8 query heads over 4 KV heads of 128, bfloat16, vLLM blocks of 16 tokens, 12 blocks a layer."""
POOL = ("--backend", "cuda_vmm", "--device", "0", "--num-layers", str(LAYERS), "--num-kv-heads", str(HEADS),
        "--head-dim", str(DIM), "--dtype", "bfloat16", "--page-size", "16", "--num-pages", "64")
LAYOUTS = ("LBNHC", "LBHNC")
"""NHD (FlashAttention's default) and HND (FlashInfer's, and Triton attention's when asked)."""
TOKENS = 48
VLLM_BLOCKS = np.array([7, 2, 10], np.int32)
"""The request's 48 tokens fill vLLM blocks 7, 2 and 10."""
POOL_PAGES = np.array([5, 9, 3], np.int32)
"""The pool pages (16 tokens each) the request's KV is saved to."""


def _vllm_layers(layout_name: str) -> tuple[torch.Tensor, list[torch.Tensor], Any]:
    """The raw buffer and per-layer tensors vLLM's GPU worker allocates for this model in `layout_name`."""
    from vllm.v1.kv_cache_interface import (
        FullAttentionSpec,
        KVCacheTensor,
        compute_layout_strides,
        create_kv_cache_views,
    )
    from vllm.v1.kv_cache_layout import KVCacheLayout

    layout = KVCacheLayout[layout_name]
    spec = FullAttentionSpec(block_size=BLOCK, num_kv_heads=HEADS, head_size=DIM, dtype=torch.bfloat16)
    layer_stride, block_stride, *_ = compute_layout_strides(spec, BLOCKS, LAYERS, layout)
    size = LAYERS * BLOCKS * spec.page_size_bytes
    raw = torch.zeros(size, dtype=torch.int8, device="cuda")
    tensor = KVCacheTensor(size=size, layers=[f"model.layers.{i}.self_attn.attn" for i in range(LAYERS)],
                           layer_stride=layer_stride, block_stride=block_stride)
    return raw, create_kv_cache_views(raw, spec, BLOCKS, layout, tensor), layout


def _caches(kv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The backends' key and value caches `[blocks, block_size, heads, dim]` of a layer tensor."""
    key_cache, value_cache = kv.transpose(1, 2).split(DIM, dim=-1)
    return key_cache, value_cache


def _slots() -> torch.Tensor:
    pos = np.arange(TOKENS)
    return torch.from_numpy(VLLM_BLOCKS[pos // BLOCK].astype(np.int64) * BLOCK + pos % BLOCK).cuda()


def _written(layout_name: str) -> tuple[torch.Tensor, list[torch.Tensor], Any, list[tuple[torch.Tensor, ...]]]:
    """vLLM's layer tensors with the request's K/V written by vLLM's Triton cache write; the K/V per layer."""
    from vllm.v1.attention.ops.triton_reshape_and_cache_flash import triton_reshape_and_cache_flash

    raw, layers, layout = _vllm_layers(layout_name)
    gen = torch.Generator(device="cuda").manual_seed(11)
    scale = torch.ones((), dtype=torch.float32, device="cuda")
    kvs = []
    for kv in layers:
        key = torch.randn(TOKENS, HEADS, DIM, generator=gen, device="cuda").to(torch.bfloat16)
        value = torch.randn(TOKENS, HEADS, DIM, generator=gen, device="cuda").to(torch.bfloat16)
        triton_reshape_and_cache_flash(key, value, *_caches(kv), _slots(), "auto", scale, scale)
        kvs.append((key, value))
    torch.cuda.synchronize()
    return raw, layers, layout, kvs


def _view(kv: torch.Tensor, layout: Any) -> LayerKV:
    """The connector's view of a layer tensor, from vLLM's layout description alone."""
    return layer_kv(kv, layout=layout.name, order=tuple(layout.layer_view_order), packing="split", block_size=BLOCK,
                    num_heads=HEADS, head_dim=DIM)


@pytest.mark.parametrize("layout_name", LAYOUTS)
def test_kv_written_by_vllms_triton_kernel_round_trips_through_a_cuda_vmm_pool(
        start_server: Callable[..., ServerProcess], layout_name: str) -> None:
    raw, layers, layout, kvs = _written(layout_name)
    pos = np.arange(TOKENS)
    where = (torch.from_numpy(VLLM_BLOCKS[pos // BLOCK].astype(np.int64)).cuda(), torch.from_numpy(pos % BLOCK).cuda())
    for kv, (key, value) in zip(layers, kvs, strict=True):
        view = _view(kv, layout)
        assert view.k.data_ptr() == kv.data_ptr()
        assert torch.equal(view.k[where], key) and torch.equal(view.v[where], value)

    server = start_server(*POOL)
    with KVCacheClient(server.target) as client, map_pool(client, "cuda") as pool:
        assert pool.tensor.is_cuda and pool.tensor.dtype == torch.bfloat16
        index = TransferIndex.build(Transfers.build([(0, TOKENS, POOL_PAGES, VLLM_BLOCKS)]), page_size=16,
                                    block_size=BLOCK, device="cuda")
        for i, kv in enumerate(layers):
            save_layer(_view(kv, layout), pool.tensor[i], index)
        torch.cuda.synchronize()
        for i, (key, value) in enumerate(kvs):  # pool page p holds tokens [16 j, 16 j + 16) as [page, token, head, dim]
            for j, page in enumerate(POOL_PAGES):
                assert torch.equal(pool.tensor[i, 0, page], key[16 * j:16 * j + 16])
                assert torch.equal(pool.tensor[i, 1, page], value[16 * j:16 * j + 16])

        raw2, layers2, _ = _vllm_layers(layout_name)
        for i, kv in enumerate(layers2):
            load_layer(pool.tensor[i], _view(kv, layout), index)
        torch.cuda.synchronize()
        assert torch.equal(raw2, raw)  # byte for byte, every layer, the blocks written and the empty ones


def test_vllms_triton_attention_over_the_loaded_cache_equals_it_over_the_written_one(
        start_server: Callable[..., ServerProcess]) -> None:
    from vllm.v1.attention.ops.triton_unified_attention import unified_attention

    _, layers, layout, kvs = _written("LBNHC")
    server = start_server(*POOL)
    with KVCacheClient(server.target) as client, map_pool(client, "cuda") as pool:
        index = TransferIndex.build(Transfers.build([(0, TOKENS, POOL_PAGES, VLLM_BLOCKS)]), page_size=16,
                                    block_size=BLOCK, device="cuda")
        _, layers2, _ = _vllm_layers("LBNHC")
        for i in range(LAYERS):
            save_layer(_view(layers[i], layout), pool.tensor[i], index)
            load_layer(pool.tensor[i], _view(layers2[i], layout), index)
        torch.cuda.synchronize()

    gen = torch.Generator(device="cuda").manual_seed(12)
    query = torch.randn(TOKENS, Q_HEADS, DIM, generator=gen, device="cuda").to(torch.bfloat16)

    def attend(kv: torch.Tensor) -> torch.Tensor:
        out = torch.empty_like(query)
        key_cache, value_cache = _caches(kv)
        unified_attention(q=query, k=key_cache, v=value_cache, out=out,
                          cu_seqlens_q=torch.tensor([0, TOKENS], dtype=torch.int32, device="cuda"),
                          max_seqlen_q=TOKENS, seqused_k=torch.tensor([TOKENS], dtype=torch.int32, device="cuda"),
                          max_seqlen_k=TOKENS, softmax_scale=DIM ** -0.5, causal=True, window_size=(-1, -1),
                          block_table=torch.from_numpy(VLLM_BLOCKS).cuda().unsqueeze(0), softcap=0,
                          q_descale=None, k_descale=None, v_descale=None)
        torch.cuda.synchronize()
        return out

    for i in range(LAYERS):
        written, loaded = attend(layers[i]), attend(layers2[i])
        assert torch.equal(loaded, written)
        key, value = (t.repeat_interleave(Q_HEADS // HEADS, dim=1).transpose(0, 1).float() for t in kvs[i])
        reference = torch.nn.functional.scaled_dot_product_attention(
            query.transpose(0, 1).float(), key, value, is_causal=True).transpose(0, 1)
        assert torch.allclose(written.float(), reference, atol=2e-2, rtol=2e-2)  # bfloat16 against float32
