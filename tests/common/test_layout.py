"""kvcache_common.layout: the one PoolLayout the service and the engine client share."""

from __future__ import annotations

import pytest

import cache_service.memory
import engine_client
import engine_client.types
from kvcache_common.layout import (
    ATTENTION_KINDS,
    DTYPE_BYTES,
    DTYPE_NAMES,
    GROUP_KINDS,
    LayerGroup,
    PoolLayout,
    format_layers,
    parse_layers,
    window_flags,
)

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


GEMMA3 = PoolLayout(num_layers=12, num_kv_heads=2, head_dim=64, dtype="float32", page_size=16, num_pages=5,
                    sliding_window=64, window_layers=(0, 1, 2, 3, 4, 6, 7, 8, 9, 10))


def test_a_window_pool_keeps_the_full_attention_layout_with_two_groups_ordered_by_their_first_layer() -> None:
    assert GEMMA3.shape == (12, 2, 5, 16, 2, 64)  # every layer of every page: a page is whole across groups
    assert GEMMA3.bytes_per_page == PoolLayout(num_layers=12, num_kv_heads=2, head_dim=64, dtype="float32",
                                               page_size=16, num_pages=5).bytes_per_page == 12 * 2 * 16 * 2 * 64 * 4
    assert GEMMA3.groups == (
        LayerGroup("sliding_window", 10, 2, 64, layers=(0, 1, 2, 3, 4, 6, 7, 8, 9, 10), sliding_window=64),
        LayerGroup("full", 2, 2, 64, layers=(5, 11)),
    )
    assert GEMMA3.describe() == ("12 layers, 2 kv heads x 64, float32, 16 tokens/page, sliding window 64 on layers "
                                 "0-4,6-10")
    gpt_oss = PoolLayout(num_layers=4, num_kv_heads=8, head_dim=64, dtype="bfloat16", page_size=16, num_pages=5,
                         sliding_window=128, window_layers=(1, 3))
    assert [(g.kind, g.layers) for g in gpt_oss.groups] == [("full", (0, 2)), ("sliding_window", (1, 3))]
    assert gpt_oss.describe().endswith(", sliding window 128 on layers 1,3")


def test_a_window_on_every_layer_is_one_group_of_every_layer() -> None:
    mistral = PoolLayout(num_layers=3, num_kv_heads=8, head_dim=128, dtype="bfloat16", page_size=16, num_pages=5,
                         sliding_window=4096, window_layers=(0, 1, 2))
    assert mistral.groups == (LayerGroup("sliding_window", 3, 8, 128, layers=(), sliding_window=4096),)
    assert mistral.describe() == ("3 layers, 8 kv heads x 128, bfloat16, 16 tokens/page, sliding window 4096 on every "
                                  "layer")
    one = PoolLayout(num_layers=3, num_kv_heads=8, head_dim=128, dtype="bfloat16", page_size=16, num_pages=5,
                     sliding_window=32, window_layers=(2,))
    assert one.describe().endswith(", sliding window 32 on layer 2")
    assert LAYOUT.groups[0].layers == () and LAYOUT.groups[0].sliding_window == 0  # no window: as before


def test_group_kinds_are_the_page_formats_and_the_window() -> None:
    assert tuple(ATTENTION_KINDS) == ("full", "mla")  # --attention's choices: page formats only
    assert GROUP_KINDS == {"full": "full attention", "mla": "MLA", "sliding_window": "sliding window"}


@pytest.mark.parametrize(("overrides", "message"), [
    ({"sliding_window": -1}, "sliding_window must be >= 0, got -1"),
    ({"sliding_window": 64}, "window_layers must name the layers of sliding_window 64, got none"),
    ({"window_layers": (0, 1)}, "window_layers needs sliding_window > 0 (the window they attend within), got "
                                "window_layers 0,1"),
    ({"sliding_window": 64, "window_layers": (2, 1)}, "window_layers must be ascending and unique, got [2, 1]"),
    ({"sliding_window": 64, "window_layers": (1, 1)}, "window_layers must be ascending and unique, got [1, 1]"),
    ({"sliding_window": 64, "window_layers": (0, 4)},
     "window_layers: layer 4 is out of range (the pool has 4 layers, 0-3)"),
    ({"sliding_window": 64, "window_layers": (-1, 0)},
     "window_layers: layer -1 is out of range (the pool has 4 layers, 0-3)"),
    ({"sliding_window": 64, "window_layers": (0,), "attention": "mla", "num_kv_heads": 1},
     "sliding_window needs attention full (window layers keep K and V per head), got attention mla"),
])
def test_invalid_windows_are_refused_naming_the_field(overrides: dict[str, object], message: str) -> None:
    assert _refusal(num_pages=2, **overrides) == message


def _refusal(**overrides: object) -> str:
    """The ValueError a 4-layer float16 layout with `overrides` is refused with."""
    values: dict[str, object] = dict(num_layers=4, num_kv_heads=2, head_dim=64, dtype="float16", page_size=16)
    values.update(overrides)
    with pytest.raises(ValueError) as err:
        PoolLayout(**values)  # type: ignore[arg-type]
    return str(err.value)


@pytest.mark.parametrize(("text", "layers", "short"), [
    ("0-4,6-10", (0, 1, 2, 3, 4, 6, 7, 8, 9, 10), "0-4,6-10"),
    ("6-10, 0-4", (0, 1, 2, 3, 4, 6, 7, 8, 9, 10), "0-4,6-10"),
    ("0,2,4", (0, 2, 4), "0,2,4"),
    ("0,1,3", (0, 1, 3), "0,1,3"),
    ("3,3,2-4", (2, 3, 4), "2-4"),
    ("5", (5,), "5"),
    ("", (), ""),
])
def test_layer_lists_parse_and_format_in_short_form(text: str, layers: tuple[int, ...], short: str) -> None:
    assert parse_layers(text) == layers
    assert parse_layers(text, 11) == layers
    assert format_layers(layers) == short


@pytest.mark.parametrize(("text", "message"), [
    ("x", "not a layer list: 'x' (use 0-based layer indices and ranges, e.g. 0-4,6-10)"),
    ("0,,1", "not a layer list: '0,,1' (use 0-based layer indices and ranges, e.g. 0-4,6-10)"),
    ("4-2", "not a layer list: '4-2' (use 0-based layer indices and ranges, e.g. 0-4,6-10)"),
    ("-1", "not a layer list: '-1' (use 0-based layer indices and ranges, e.g. 0-4,6-10)"),
    ("0-12", "layer 12 is out of range (the pool has 12 layers, 0-11)"),
])
def test_bad_layer_lists_are_refused_with_the_form(text: str, message: str) -> None:
    with pytest.raises(ValueError) as err:
        parse_layers(text, 12)
    assert str(err.value) == message


def test_window_flags_leave_out_the_layers_when_every_layer_has_the_window() -> None:
    assert window_flags(64, (0, 1, 2, 3, 4, 6, 7, 8, 9, 10), 12) == " --sliding-window 64 --window-layers 0-4,6-10"
    assert window_flags(64, (0, 1, 2), 3) == " --sliding-window 64"
    assert window_flags(0, (), 3) == ""


def test_window_pages_split_the_pool_into_the_full_layers_pages_and_the_window_layers_window_pages() -> None:
    gemma = PoolLayout(num_layers=6, num_kv_heads=2, head_dim=8, dtype="float32", page_size=4, num_pages=10,
                       sliding_window=16, window_layers=(0, 1, 2, 4, 5), window_pages=7)
    page = 4 * 2 * 8 * 4  # one page in one layer's K (or V) plane
    assert gemma.page_bytes == page
    assert gemma.full_layers == (3,)
    assert gemma.shape == (1, 2, 10, 4, 2, 8)
    assert gemma.window_shape == (5, 2, 7, 4, 2, 8)
    assert (gemma.bytes_per_page, gemma.bytes_per_window_page) == (1 * 2 * page, 5 * 2 * page)
    assert gemma.window_offset_bytes == 10 * 2 * page
    assert gemma.window_size_bytes == 7 * 10 * page
    assert gemma.size_bytes == 10 * 2 * page + 7 * 10 * page
    assert gemma.groups == PoolLayout(num_layers=6, num_kv_heads=2, head_dim=8, dtype="float32", page_size=4,
                                      num_pages=10, sliding_window=16, window_layers=(0, 1, 2, 4, 5)).groups
    assert gemma.describe() == ("6 layers, 2 kv heads x 8, float32, 4 tokens/page, sliding window 16 on layers "
                                "0-2,4,5, window rows apart in 6 window pages")
    mistral = PoolLayout(num_layers=2, num_kv_heads=2, head_dim=8, dtype="float32", page_size=4, num_pages=10,
                         sliding_window=16, window_layers=(0, 1), window_pages=3)
    assert (mistral.full_layers, mistral.shape, mistral.bytes_per_page) == ((), (0, 2, 10, 4, 2, 8), 0)
    assert mistral.size_bytes == mistral.window_size_bytes == 3 * 2 * 2 * page


def test_without_window_pages_a_window_pool_is_one_region_of_every_layer_as_before() -> None:
    one = PoolLayout(num_layers=6, num_kv_heads=2, head_dim=8, dtype="float32", page_size=4, num_pages=10,
                     sliding_window=16, window_layers=(0, 1, 2, 4, 5))
    assert one.window_pages == 0 and one.full_layers == tuple(range(6))
    assert one.shape == (6, 2, 10, 4, 2, 8) and one.window_shape == (0, 2, 0, 4, 2, 8)
    assert one.window_offset_bytes == one.size_bytes == 10 * 6 * 2 * 4 * 2 * 8 * 4
    assert (one.window_size_bytes, one.bytes_per_window_page) == (0, 0)


@pytest.mark.parametrize(("overrides", "message"), [
    ({"window_pages": 4}, "window_pages 4 needs sliding_window > 0 (the window layers whose rows they hold), got no "
                          "window"),
    ({"window_pages": 1, "sliding_window": 8, "window_layers": (0,)},
     "window_pages must be 0 or >= 2 (window page 0 is reserved), got 1"),
    ({"window_pages": -2, "sliding_window": 8, "window_layers": (0,)},
     "window_pages must be 0 or >= 2 (window page 0 is reserved), got -2"),
])
def test_invalid_window_pages_are_refused_naming_both_sides(overrides: dict[str, object], message: str) -> None:
    assert _refusal(num_pages=8, **overrides) == message
