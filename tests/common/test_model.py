"""kvcache_common.model: a model's KV layout from its config.json, and the models a session cannot hold."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from kvcache_common.model import ModelConfigError, ModelLayout, UnsupportedModel, model_layout, read_model_layout

MODELS = Path(__file__).resolve().parent.parent / "models"


@pytest.mark.parametrize(("name", "layout"), [
    ("llama-3.1-8b", ModelLayout(32, 8, 128, "bfloat16", "LlamaForCausalLM")),
    ("qwen2-7b", ModelLayout(28, 4, 128, "bfloat16", "Qwen2ForCausalLM")),  # head_dim from 3584 / 28
    ("mistral-7b-v0.3", ModelLayout(32, 8, 128, "bfloat16", "MistralForCausalLM")),
    ("llava-1.5-7b", ModelLayout(32, 32, 128, "float16", "LlavaForConditionalGeneration")),  # its text_config
    # MLA: one latent of kv_lora_rank 512 + qk_rope_head_dim 64 per token and layer
    ("deepseek-v3", ModelLayout(61, 1, 576, "bfloat16", "DeepseekV3ForCausalLM", "mla")),
])
def test_the_layout_of_a_full_attention_or_mla_model(name: str, layout: ModelLayout) -> None:
    assert read_model_layout(MODELS / f"{name}.json") == layout


@pytest.mark.parametrize(("config", "context"), [
    ({"max_position_embeddings": 131072, "n_positions": 1024}, (131072, "max_position_embeddings")),
    ({"n_positions": 1024}, (1024, "n_positions")),  # GPT-2's name
    ({"max_position_embeddings": 0}, (0, "")),
    ({}, (0, "")),  # not stated: serve --model sizes by free memory alone
])
def test_the_context_length_serve_model_sizes_by(config: dict[str, int], context: tuple[int, str]) -> None:
    layout = model_layout({"num_hidden_layers": 2, "num_attention_heads": 2, "hidden_size": 128, **config})
    assert (layout.context_tokens, layout.context_key) == context


def test_a_model_directory_is_read_through_its_config_json(tmp_path: Path) -> None:
    shutil.copy(MODELS / "llama-3.1-8b.json", tmp_path / "config.json")
    layout = read_model_layout(tmp_path)
    assert layout.flags() == "--num-layers 32 --num-kv-heads 8 --head-dim 128 --dtype bfloat16"
    assert layout.describe() == "32 layers, 8 kv heads x 128, bfloat16"


@pytest.mark.parametrize(("name", "reason"), [
    ("qwen3-next-80b", "Qwen3NextForCausalLM has linear_attention layers: a kvcache session keeps per-head K and V "
                       "for every position, so only a stack of full-attention layers fits"),
    ("jamba-mini", "JambaForCausalLM has mamba layers: a kvcache session keeps per-head K and V for every position, "
                   "so only a stack of full-attention layers fits"),
    ("t5-small", "T5ForConditionalGeneration is an encoder-decoder model: its cross-attention K/V comes from the "
                 "encoder's output, and a kvcache session keeps per-head K and V for every position of one decoder "
                 "sequence"),
])
def test_attention_a_session_cannot_hold_is_refused_with_the_reason(name: str, reason: str) -> None:
    with pytest.raises(UnsupportedModel) as err:
        read_model_layout(MODELS / f"{name}.json")
    assert str(err.value) == reason


def test_an_mla_model_is_described_with_the_flags_that_fit_it() -> None:
    layout = read_model_layout(MODELS / "deepseek-v3.json")
    assert layout.flags() == "--attention mla --num-layers 61 --num-kv-heads 1 --head-dim 576 --dtype bfloat16"
    assert layout.describe() == "61 layers, MLA latent 576 (its halves in the K and V planes), bfloat16"
    config = json.loads((MODELS / "deepseek-v3.json").read_text())
    with pytest.raises(ModelConfigError) as err:
        model_layout({k: v for k, v in config.items() if k != "qk_rope_head_dim"})
    assert str(err.value) == "missing the MLA rope head dim (qk_rope_head_dim)"


def test_a_window_as_long_as_the_context_is_full_attention() -> None:
    config = json.loads((MODELS / "mistral-7b-v0.1.json").read_text())
    full = ModelLayout(32, 8, 128, "bfloat16", "MistralForCausalLM")
    assert model_layout({**config, "sliding_window": 32768}) == full
    assert model_layout({**config, "use_sliding_window": False}) == full  # Qwen2's switch
    gemma = json.loads((MODELS / "gemma-3-4b-text.json").read_text())
    assert model_layout({**gemma, "sliding_window": 131072}).sliding_window == 0  # its layer_types notwithstanding


@pytest.mark.parametrize(("name", "layout"), [
    ("mistral-7b-v0.1", ModelLayout(32, 8, 128, "bfloat16", "MistralForCausalLM", sliding_window=4096,
                                    window_layers=tuple(range(32)))),
    ("gemma-3-4b-text", ModelLayout(6, 4, 256, "bfloat16", "Gemma3ForCausalLM", sliding_window=1024,
                                    window_layers=(0, 1, 2, 3, 4))),
])
def test_the_layout_of_a_sliding_window_model(name: str, layout: ModelLayout) -> None:
    assert read_model_layout(MODELS / f"{name}.json") == layout


def test_a_window_model_is_described_with_the_flags_that_fit_it() -> None:
    gemma = read_model_layout(MODELS / "gemma-3-4b-text.json")
    assert gemma.flags() == ("--num-layers 6 --num-kv-heads 4 --head-dim 256 --dtype bfloat16 --sliding-window 1024 "
                             "--window-layers 0-4")
    assert gemma.describe() == "6 layers, 4 kv heads x 256, bfloat16, sliding window 1024 on layers 0-4"
    mistral = read_model_layout(MODELS / "mistral-7b-v0.1.json")
    assert mistral.flags() == "--num-layers 32 --num-kv-heads 8 --head-dim 128 --dtype bfloat16 --sliding-window 4096"
    assert mistral.describe() == "32 layers, 8 kv heads x 128, bfloat16, sliding window 4096 on every layer"


# Tiny configs as transformers writes them (save_pretrained), 6 layers, window 64 within a 2,048 context.
TINY = {"num_hidden_layers": 6, "num_attention_heads": 4, "num_key_value_heads": 2, "hidden_size": 128,
        "head_dim": 32, "vocab_size": 256, "max_position_embeddings": 2048, "sliding_window": 64, "dtype": "bfloat16"}


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, object]]:
    """Each family's config.json as transformers' save_pretrained writes it, decoded."""
    transformers = pytest.importorskip("transformers")
    families = {"gemma2": ("Gemma2Config", "Gemma2ForCausalLM", {}),
                "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM", {}),
                "gpt_oss": ("GptOssConfig", "GptOssForCausalLM", {}),
                "mistral": ("MistralConfig", "MistralForCausalLM", {}),
                "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", {"use_sliding_window": True, "max_window_layers": 2})}
    configs = {}
    for family, (cls, arch, extra) in families.items():
        where = tmp_path_factory.mktemp(family)
        getattr(transformers, cls)(**TINY, **extra, architectures=[arch]).save_pretrained(where)
        configs[family] = json.loads((where / "config.json").read_text())
    return configs


@pytest.mark.parametrize(("family", "window_layers"), [
    ("gemma2", (0, 2, 4)),  # even layers
    ("gemma3", (0, 1, 2, 3, 4)),  # every sixth layer is full
    ("gpt_oss", (0, 2, 4)),
    ("mistral", (0, 1, 2, 3, 4, 5)),  # no layer_types: the window is every layer's
    ("qwen2", (2, 3, 4, 5)),  # from max_window_layers on
])
def test_the_window_layers_of_configs_transformers_writes(saved: dict[str, dict[str, object]], family: str,
                                                          window_layers: tuple[int, ...]) -> None:
    config = saved[family]
    arch = config["architectures"][0]  # type: ignore[index]
    assert model_layout(config) == ModelLayout(6, 2, 32, "bfloat16", str(arch), sliding_window=64,
                                               window_layers=window_layers)
    assert ("layer_types" in config) == (family != "mistral")


@pytest.mark.parametrize(("family", "older", "window_layers"), [
    ("gemma3", {"sliding_window_pattern": 6}, (0, 1, 2, 3, 4)),
    ("gemma3", {"sliding_window_pattern": 2}, (0, 2, 4)),
    ("gemma2", {}, (0, 2, 4)),
    ("qwen2", {}, (2, 3, 4, 5)),
    ("qwen2", {"use_sliding_window": False}, ()),
    ("mistral", {"use_sliding_window": False}, ()),
])
def test_the_window_layers_of_older_configs_without_layer_types(saved: dict[str, dict[str, object]], family: str,
                                                                older: dict[str, object],
                                                                window_layers: tuple[int, ...]) -> None:
    config = {k: v for k, v in saved[family].items() if k != "layer_types"} | older
    layout = model_layout(config)
    assert (layout.sliding_window, layout.window_layers) == ((64, window_layers) if window_layers else (0, ()))


@pytest.mark.parametrize(("extra", "reason"), [
    ({"swa_head_dim": 16}, "Gemma3ForCausalLM's window layers have 2 kv heads x 16 and its full-attention layers 2 kv "
                           "heads x 32: a kvcache pool's layers share one KV head count and head dim"),
    ({"global_num_key_value_heads": 4}, "Gemma3ForCausalLM's window layers have 2 kv heads x 32 and its "
                                        "full-attention layers 4 kv heads x 32: a kvcache pool's layers share one KV "
                                        "head count and head dim"),
    ({"layer_types": ["sliding_attention"] * 5 + ["linear_attention"]},
     "Gemma3ForCausalLM has linear_attention layers: a kvcache session keeps per-head K and V for every position, "
     "so only a stack of full-attention layers fits"),
])
def test_window_models_a_pool_cannot_hold_are_refused_with_the_reason(saved: dict[str, dict[str, object]],
                                                                       extra: dict[str, object], reason: str) -> None:
    with pytest.raises(UnsupportedModel) as err:
        model_layout(saved["gemma3"] | extra)
    assert str(err.value) == reason


def test_mla_with_a_window_is_refused_with_the_reason() -> None:
    config = json.loads((MODELS / "deepseek-v3.json").read_text())
    with pytest.raises(UnsupportedModel) as err:
        model_layout({**config, "sliding_window": 64, "max_position_embeddings": 4096})
    assert str(err.value) == ("DeepseekV3ForCausalLM is MLA with a sliding window (sliding_window=64 on layers 0-60): "
                              "a kvcache pool holds MLA latents or window layers, not both")


@pytest.mark.parametrize("kinds", [["full_attention"] * 6 + ["sliding_attention"], ["sliding_attention"] * 5])
def test_window_layer_types_of_another_length_than_the_model(kinds: list[str]) -> None:
    with pytest.raises(ModelConfigError) as err:
        model_layout({**TINY, "layer_types": kinds})
    assert str(err.value) == f"layer_types names {len(kinds)} layers, the model has 6"


@pytest.mark.parametrize(("config", "message"), [
    ({"num_attention_heads": 8, "hidden_size": 512},
     "missing the layer count (num_hidden_layers / n_layer / num_layers / n_layers)"),
    ({"num_hidden_layers": 2, "hidden_size": 512},
     "missing the attention head count (num_attention_heads / n_head / num_heads / n_heads)"),
    ({"num_hidden_layers": 2, "num_attention_heads": 8},
     "missing the hidden size (or head_dim) (hidden_size / n_embd / d_model)"),
    ({"num_hidden_layers": 0, "num_attention_heads": 8, "head_dim": 64},
     "the layer count is 0, not a positive integer"),
    ({"num_hidden_layers": 2, "num_attention_heads": 7, "hidden_size": 512},
     "hidden size 512 is not a multiple of 7 attention heads"),
])
def test_a_config_without_what_the_layout_needs(config: dict[str, object], message: str) -> None:
    with pytest.raises(ModelConfigError) as err:
        model_layout(config)
    assert str(err.value) == message


def test_unreadable_configs_name_the_file(tmp_path: Path) -> None:
    with pytest.raises(ModelConfigError, match=rf"^{tmp_path} has no config.json \(give a Hugging Face model "):
        read_model_layout(tmp_path)
    bad = tmp_path / "config.json"
    bad.write_text("{not json")
    with pytest.raises(ModelConfigError, match=rf"^{bad} is not JSON "):
        read_model_layout(bad)
    bad.write_text("[1, 2]")
    with pytest.raises(ModelConfigError, match=rf"^{bad} is not a JSON object$"):
        read_model_layout(bad)
    bad.write_text('{"num_hidden_layers": 2}')
    with pytest.raises(ModelConfigError, match=rf"^{bad}: missing the attention head count"):
        read_model_layout(bad)


def test_gpt2_and_falcon_names() -> None:
    gpt2 = {"architectures": ["GPT2LMHeadModel"], "n_layer": 12, "n_head": 12, "n_embd": 768,
            "torch_dtype": "float32"}
    assert model_layout(gpt2) == ModelLayout(12, 12, 64, "float32", "GPT2LMHeadModel")
    falcon = {"model_type": "falcon", "num_hidden_layers": 32, "num_attention_heads": 71, "hidden_size": 4544,
              "multi_query": True, "torch_dtype": "bfloat16"}
    assert model_layout(falcon) == ModelLayout(32, 1, 64, "bfloat16", "falcon")
    assert model_layout({**gpt2, "torch_dtype": "auto"}).dtype is None  # --dtype decides
