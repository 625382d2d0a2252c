"""kvcache_common.layout: the one PoolLayout the service and the engine client share."""

from __future__ import annotations

import pytest

import cache_service.memory
import engine_client
import engine_client.types
from kvcache_common.layout import DTYPE_BYTES, DTYPE_NAMES, LayerGroup, PoolLayout

LAYOUT = PoolLayout(num_layers=3, num_kv_heads=4, head_dim=16, dtype="bfloat16", page_size=8, num_pages=5)


def test_service_and_client_use_the_same_definitions() -> None:
    for module in (engine_client, engine_client.types, cache_service.memory):
        assert module.PoolLayout is PoolLayout
        assert module.DTYPE_BYTES is DTYPE_BYTES
        assert module.DTYPE_NAMES is DTYPE_NAMES


def test_dtype_names_and_sizes() -> None:
    assert DTYPE_NAMES == ("float16", "bfloat16", "float32", "float8_e4m3fn", "float8_e5m2")
    assert [DTYPE_BYTES[n] for n in DTYPE_NAMES] == [2, 2, 4, 1, 1]


def test_layout_arithmetic() -> None:
    assert LAYOUT.itemsize == 2
    assert LAYOUT.shape == (3, 2, 5, 8, 4, 16)
    assert LAYOUT.page_bytes == 8 * 4 * 16 * 2 == 1024
    assert LAYOUT.bytes_per_page == 3 * 2 * 1024 == 6144
    assert LAYOUT.size_bytes == 5 * 6144 == 30720
    assert LAYOUT.usable_tokens == 4 * 8 == 32
    assert LAYOUT.describe() == "3 layers, 4 kv heads x 16, bfloat16, 8 tokens/page"


def test_size_is_the_product_of_the_shape() -> None:
    for dtype in DTYPE_NAMES:
        layout = PoolLayout(num_layers=2, num_kv_heads=3, head_dim=5, dtype=dtype, page_size=7, num_pages=11)
        elements = 2 * 2 * 11 * 7 * 3 * 5
        assert layout.size_bytes == elements * DTYPE_BYTES[dtype]


@pytest.mark.parametrize(("overrides", "message"), [
    ({"dtype": "int8"}, "unknown dtype 'int8'; one of float16, bfloat16, float32, float8_e4m3fn, float8_e5m2"),
    ({"num_layers": 0}, "num_layers must be >= 1, got 0"),
    ({"num_kv_heads": -1}, "num_kv_heads must be >= 1, got -1"),
    ({"head_dim": 0}, "head_dim must be >= 1, got 0"),
    ({"page_size": 0}, "page_size must be >= 1, got 0"),
    ({"num_pages": 1}, "num_pages must be >= 2 (page 0 is reserved), got 1"),
])
def test_invalid_layouts_are_refused_naming_the_field(overrides: dict[str, object], message: str) -> None:
    values: dict[str, object] = dict(num_layers=1, num_kv_heads=1, head_dim=1, dtype="float16", page_size=1,
                                     num_pages=2)
    values.update(overrides)
    with pytest.raises(ValueError) as err:
        PoolLayout(**values)  # type: ignore[arg-type]
    assert str(err.value) == message


def test_a_layout_is_frozen_and_slotted() -> None:
    with pytest.raises(AttributeError):
        LAYOUT.num_pages = 6  # type: ignore[misc]
    assert not hasattr(LAYOUT, "__dict__")


MLA = PoolLayout(num_layers=3, num_kv_heads=1, head_dim=576, dtype="bfloat16", page_size=16, num_pages=5,
                 attention="mla")


def test_an_mla_layout_stores_each_latent_in_halves_across_the_k_and_v_planes() -> None:
    assert MLA.plane_dim == 288
    assert MLA.shape == (3, 2, 5, 16, 1, 288)
    assert MLA.page_bytes == 16 * 288 * 2 == 9216
    assert MLA.bytes_per_page == 3 * 16 * 576 * 2 == 55296  # exactly the model's latents: nothing padded
    assert MLA.size_bytes == 5 * 55296
    assert MLA.describe() == "3 layers, MLA latent 576 (its halves in the K and V planes), bfloat16, 16 tokens/page"
    assert MLA.groups == (LayerGroup("mla", 3, 1, 576),)
    assert LAYOUT.groups == (LayerGroup("full", 3, 4, 16),)
    assert (LAYOUT.attention, LAYOUT.plane_dim) == ("full", 16)


@pytest.mark.parametrize(("overrides", "message"), [
    ({"attention": "linear"}, "unknown attention 'linear'; one of full, mla"),
    ({"num_kv_heads": 2}, "num_kv_heads must be 1 with MLA (one latent per token), got 2"),
    ({"head_dim": 575}, "head_dim must be a multiple of 2 with MLA (its halves go in the K and V planes), got 575"),
])
def test_invalid_mla_layouts_are_refused_naming_the_field(overrides: dict[str, object], message: str) -> None:
    values: dict[str, object] = dict(num_layers=1, num_kv_heads=1, head_dim=576, dtype="float16", page_size=1,
                                     num_pages=2, attention="mla")
    values.update(overrides)
    with pytest.raises(ValueError) as err:
        PoolLayout(**values)  # type: ignore[arg-type]
    assert str(err.value) == message
